"""Clusters not started by LocalCluster: `kfit-ps server` from TF_CONFIG, and in-process servers."""

import json
import os
import signal
import subprocess
import sys

import pytest

from tests import helpers


@pytest.mark.slow
def test_fit_on_kfit_ps_servers_configured_by_tf_config():
    cluster = {"chief": [f"localhost:{helpers.free_port()}"],
               "worker": [f"localhost:{helpers.free_port()}" for _ in range(2)],
               "ps": [f"localhost:{helpers.free_port()}"]}
    servers = []
    try:
        for task_type in ("worker", "ps"):
            for index, address in enumerate(cluster[task_type]):
                env = helpers.chief_env()
                env["TF_CONFIG"] = json.dumps({"cluster": cluster,
                                               "task": {"type": task_type, "index": index}})
                proc = helpers.popen([sys.executable, "-m", "kfit_ps.cli.main", "server"],
                                        env=env, cwd=helpers.ROOT, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                servers.append(proc)
                helpers.wait_listening(address, proc)
        os.environ["KFIT_PS_TEST_TF_CONFIG"] = json.dumps(
            {"cluster": cluster, "task": {"type": "chief", "index": 0}})
        result = helpers.run_chief("""
            from tests import helpers as h
            os.environ["TF_CONFIG"] = os.environ["KFIT_PS_TEST_TF_CONFIG"]
            resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
            strategy = kfit_ps.ParameterServerStrategy(resolver)
            with strategy.scope():
                model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
                model.compile(optimizer="sgd", loss="mse", metrics=[h.counting_metric()],
                              steps_per_execution=3)
            history = model.fit(kfit_ps.DatasetCreator(h.regression_dataset_fn()), epochs=2,
                                steps_per_epoch=25, verbose=0)
            report(iterations=int(model.optimizer.iterations.numpy()),
                   batches=history.history["batches"],
                   device=model.variables[0].value.device)
            sys.stdout.flush()
            os._exit(0)
        """)
    finally:
        os.environ.pop("KFIT_PS_TEST_TF_CONFIG", None)
        for proc in servers:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=30)
    assert result["iterations"] == 50
    assert result["batches"] == [25.0, 25.0]
    assert result["device"] == "/job:ps/replica:0/task:0/device:CPU:0"


@pytest.mark.slow
def test_fit_on_in_process_servers():
    """Any ClusterResolver works, including servers in the chief's own process."""
    result = helpers.run_chief("""
        from kfit_ps.cluster.server import server_config
        from tests import helpers as h
        spec = {"worker": [f"localhost:{h.free_port()}" for _ in range(2)],
                "ps": [f"localhost:{h.free_port()}"], "chief": [f"localhost:{h.free_port()}"]}
        cluster_spec = tf.train.ClusterSpec(spec)
        servers = [tf.distribute.Server(cluster_spec, job_name=t, task_index=i, protocol="grpc",
                                        config=server_config(t, 2), start=True)
                   for t in ("worker", "ps") for i in range(len(spec[t]))]
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            cluster_spec, task_type="chief", task_id=0, rpc_layer="grpc")
        strategy = kfit_ps.ParameterServerStrategy(resolver)
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse", metrics=[h.counting_metric()])
        history = model.fit(kfit_ps.DatasetCreator(h.regression_dataset_fn()), epochs=2,
                            steps_per_epoch=30, verbose=0)
        report(iterations=int(model.optimizer.iterations.numpy()),
               batches=history.history["batches"])
        sys.stdout.flush()
        os._exit(0)
    """)
    assert result["iterations"] == 60
    assert result["batches"] == [30.0, 30.0]
