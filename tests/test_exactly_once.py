"""Exact evaluation and resumable training when processes die (real SIGKILLs)."""

import os
import shutil
import signal
import subprocess
import sys

import pytest

from tests import helpers

EVALUATE_WITH_A_DEATH = """
import threading

with kfit_ps.LocalCluster(num_workers=3, num_ps=1) as cluster:
    strategy = kfit_ps.ParameterServerStrategy(cluster.cluster_resolver)

    class Slow(keras.layers.Layer):
        # About 10 ms of work per batch, so that the kill lands mid-evaluation.
        def call(self, x):
            a = tf.ones((400, 400)) * 1e-3
            for _ in range(4):
                a = tf.matmul(a, a)
            return x + 0.0 * tf.reduce_sum(a)

    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), Slow()])
        model.compile(loss="mse", metrics=[keras.metrics.MeanMetricWrapper(
            lambda y_true, y_pred: y_true, name="mean_y")])
    values = np.arange(1024, dtype="float32").reshape(-1, 1)
    warm = model.evaluate(values[:8], values[:8], batch_size=4, verbose=0, return_dict=True)
    events = []

    class KillDuringEvaluation(keras.callbacks.Callback):
        def on_test_batch_end(self, batch, logs=None):
            if batch == 100:  # Scheduled 101 of 512 functions: the workers are busy.
                cluster.kill("worker", 1)
                events.append(("killed", batch))

        def on_test_end(self, logs=None):
            events.append(("ended", None))

    logs = model.evaluate(values, values, batch_size=2, verbose=0, return_dict=True,
                          callbacks=[KillDuringEvaluation()])
    report(mean_y=logs["mean_y"], loss=logs["loss"], events=events, pids=cluster.pids(),
           alive=cluster.pid("worker", 1) is not None and
           __import__("psutil").pid_exists(cluster.pid("worker", 1)))
os._exit(0)
"""


@pytest.mark.chaos
@pytest.mark.slow
def test_evaluate_is_exact_when_a_worker_dies_during_it():
    result = helpers.run_chief(EVALUATE_WITH_A_DEATH, timeout=300)
    assert result["events"] == [["killed", 100], ["ended", None]]
    assert result["mean_y"] == 511.5  # every element of 0..1023 exactly once
    assert result["loss"] == 0.0
    assert helpers.wait_for_no_servers(result["pids"], timeout=10) == []


RESUMABLE_JOB = """
import sys
from tests import helpers as h

backup_dir = sys.argv[1]
with kfit_ps.LocalCluster(num_workers=2, num_ps=1) as cluster:
    print("PIDS", json.dumps(cluster.pids()), flush=True)
    strategy = kfit_ps.ParameterServerStrategy(cluster.cluster_resolver)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse", metrics=[h.counting_metric()])

    class Announce(kfit_ps.callbacks.SyncCallback):
        sync_every = 10

        def on_train_sync(self, epoch, step, logs):
            print("SYNCED", epoch, step, flush=True)
            if epoch == 2 and step == 10 and os.environ.get("KFIT_PS_TEST_PAUSE"):
                time.sleep(60)  # The test kills this process (SIGKILL) here.

    history = model.fit(kfit_ps.DatasetCreator(h.regression_dataset_fn()), epochs=5,
                        steps_per_epoch=30, verbose=0, callbacks=[
                            kfit_ps.callbacks.BackupAndRestore(backup_dir, save_freq=10),
                            Announce()])
    report(iterations=int(model.optimizer.iterations.numpy()), epochs=history.epoch,
           batches=history.history["batches"], backup_left=os.path.exists(backup_dir),
           pids=cluster.pids())
os._exit(0)
"""


@pytest.mark.chaos
@pytest.mark.slow
def test_backup_and_restore_resumes_after_the_coordinator_is_sigkilled(tmp_path):
    script = tmp_path / "job.py"
    prelude = ("import json, os, sys, time\nimport numpy as np\nimport kfit_ps, keras\n"
               "def report(**values):\n"
               f"    print({helpers.RESULT_PREFIX!r} + json.dumps(values), flush=True)\n")
    script.write_text(prelude + RESUMABLE_JOB)
    backup_dir = str(tmp_path / "backup")
    env = dict(helpers.chief_env(), KFIT_PS_TEST_PAUSE="1")
    chief = helpers.popen([sys.executable, str(script), backup_dir], stdout=subprocess.PIPE,
                             text=True, env=env, cwd=helpers.ROOT)
    pids = []
    try:
        for line in chief.stdout:
            if line.startswith("PIDS"):
                pids = [int(p) for p in line.split(None, 1)[1].strip()[1:-1].split(",")]
            if line.strip() == "SYNCED 2 10":
                break
        else:
            pytest.fail(f"the job ended before epoch 3 (exit {chief.wait()})")
        chief.send_signal(signal.SIGKILL)  # During epoch 3, right after a backup.
        chief.wait(timeout=30)
    finally:
        if chief.poll() is None:
            chief.kill()
    assert helpers.wait_for_no_servers(pids, timeout=15) == []  # its servers follow it
    assert any(name.endswith(".kfit_ps.json") for name in os.listdir(backup_dir))

    rerun = subprocess.run([sys.executable, str(script), backup_dir], capture_output=True,
                           text=True, env=helpers.chief_env(), cwd=helpers.ROOT, timeout=300)
    lines = [line for line in rerun.stdout.splitlines() if helpers.RESULT_PREFIX in line]
    assert lines, rerun.stderr[-4000:]
    import json

    result = json.loads(lines[-1].split(helpers.RESULT_PREFIX, 1)[1])
    assert result["iterations"] == 5 * 30  # exactly an uninterrupted run's steps
    # Resumed in epoch 3 (index 2) after its first 10 steps; the History holds the epochs
    # before the resume too, from the backup.
    assert result["epochs"] == [0, 1, 2, 3, 4]
    assert result["batches"] == [30.0, 30.0, 20.0, 30.0, 30.0]
    assert result["backup_left"] is False
    assert helpers.wait_for_no_servers(result["pids"], timeout=10) == []
    shutil.rmtree(backup_dir, ignore_errors=True)
