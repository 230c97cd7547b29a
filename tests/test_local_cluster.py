"""LocalCluster: real server processes, their lifecycle, and no orphans ever."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from kfit_ps import LocalCluster, constants
from kfit_ps.net import accepts_connections
from tests import helpers


@pytest.mark.slow
def test_servers_are_forked_from_one_template_that_ends_with_the_cluster(
        children_reaped, monkeypatch):
    """Each server, restarted ones too, is forked from the cluster's server template: a process
    of its own in a session of its own, named by its task, whose exit status is reported as
    `subprocess` reports one; a server whose environment differs from the template's starts as
    a process of its own; the template ends with the cluster."""
    from kfit_ps.cluster import fork_server

    with LocalCluster(num_workers=2, num_ps=1) as cluster:
        processes = {task: psutil.Process(cluster.pid(*task)) for task in cluster.server_tasks()}
        [template] = {p.ppid() for p in processes.values()}
        assert psutil.Process(template).name() == fork_server.TEMPLATE_NAME
        assert psutil.Process(template).ppid() == os.getpid()
        for (task_type, index), p in processes.items():
            assert p.name() == f"{task_type}:{index}" and helpers.is_server(p)
            assert os.getsid(p.pid) == p.pid
            assert accepts_connections(cluster.address(task_type, index))
        cluster.kill("worker", 1, sig=signal.SIGTERM)
        assert cluster.exited() == {("worker", 1): -signal.SIGTERM}
        cluster.restart("worker", 1)
        assert psutil.Process(cluster.pid("worker", 1)).ppid() == template
        assert accepts_connections(cluster.address("worker", 1)) and cluster.exited() == {}

        monkeypatch.setenv("KFIT_PS_TEST_OTHER_SETTING", "1")  # not the template's environment
        cluster.kill("ps", 0)
        cluster.restart("ps", 0)
        assert psutil.Process(cluster.pid("ps", 0)).ppid() == os.getpid()
        assert accepts_connections(cluster.address("ps", 0))
        assert psutil.Process(cluster.pid("worker", 0)).ppid() == template
    assert helpers.wait_for_no_servers([template], timeout=10) == []  # gone (or a zombie)


@pytest.mark.slow
def test_a_killed_server_template_takes_its_servers_and_they_restart_from_a_new_one(
        children_reaped):
    """The template killed (SIGKILL): its servers exit (reported as killed), their logs stay
    (the cluster's process still runs and reads them), and a restart forks from a new one."""
    from kfit_ps.cluster import fork_server

    with LocalCluster(num_workers=1, num_ps=1) as cluster:
        template = psutil.Process(cluster.pid("worker", 0)).ppid()
        pids = cluster.pids()
        os.kill(template, signal.SIGKILL)
        assert helpers.wait_for_no_servers(pids, timeout=10) == []
        assert cluster.exited() == {("worker", 0): -signal.SIGKILL, ("ps", 0): -signal.SIGKILL}
        for task in cluster.server_tasks():
            assert os.path.exists(cluster._log_path(*task))
            cluster.restart(*task)
            assert accepts_connections(cluster.address(*task))
        [new] = {psutil.Process(p).ppid() for p in cluster.pids()}
        assert new != template and psutil.Process(new).name() == fork_server.TEMPLATE_NAME


@pytest.mark.slow
def test_a_process_forked_from_the_owner_does_not_keep_the_template_running(children_reaped):
    """A child forked from the cluster's process (multiprocessing's default) drops its copy of
    the template's pipe: `stop()` ends the template at once, and the child sends nothing to the
    parent's servers."""
    with LocalCluster(num_workers=1, num_ps=1) as cluster:
        template = psutil.Process(cluster.pid("worker", 0)).ppid()
        child = os.fork()
        if child == 0:  # It lives on past the parent's stop(), then leaves quietly.
            time.sleep(20)
            os._exit(0)
        try:
            started = time.monotonic()
            cluster.stop()
            assert time.monotonic() - started < 5
            assert helpers.wait_for_no_servers([template], timeout=5) == []
        finally:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)


@pytest.mark.slow
def test_servers_start_as_processes_of_their_own_when_forking_is_off(children_reaped,
                                                                       monkeypatch):
    monkeypatch.setenv("KFIT_PS_SERVER_FORK", "0")
    with LocalCluster(num_workers=1, num_ps=1) as cluster:
        for task in cluster.server_tasks():
            p = psutil.Process(cluster.pid(*task))
            assert p.ppid() == os.getpid() and helpers.is_server(p)
            assert accepts_connections(cluster.address(*task))


@pytest.mark.slow
def test_start_kill_restart_stop(children_reaped):
    with LocalCluster(num_workers=2, num_ps=1) as cluster:
        assert len(cluster.pids()) == 3
        for task in (("worker", 0), ("worker", 1), ("ps", 0)):
            assert accepts_connections(cluster.address(*task))
            assert helpers.is_server(psutil.Process(cluster.pid(*task)))
        spec = cluster.cluster_resolver.cluster_spec().as_dict()
        assert set(spec) == {"chief", "worker", "ps"}
        assert cluster.cluster_resolver.task_type == "chief"

        old_pid, address = cluster.pid("worker", 0), cluster.address("worker", 0)
        cluster.kill("worker", 0)
        assert not psutil.pid_exists(old_pid) or psutil.Process(old_pid).status() == "zombie"
        assert not accepts_connections(address)
        with pytest.raises(RuntimeError, match="still running"):
            cluster.restart("worker", 1)
        cluster.restart("worker", 0)
        assert cluster.pid("worker", 0) != old_pid
        assert cluster.address("worker", 0) == address and accepts_connections(address)
        pids = cluster.pids()
        log_dir = cluster._log_dir
        assert os.path.isdir(log_dir)
    assert helpers.wait_for_no_servers(pids, timeout=10) == []
    assert cluster.pids() == []
    assert not os.path.exists(log_dir)  # server logs are removed with the cluster


def test_exception_inside_with_stops_servers(children_reaped):
    with pytest.raises(KeyError):
        with LocalCluster(num_workers=1, num_ps=1) as cluster:
            pids = cluster.pids()
            assert len(pids) == 2
            raise KeyError("boom")
    assert helpers.wait_for_no_servers(pids, timeout=10) == []


@pytest.mark.parametrize("kwargs, fragment", [
    ({"num_workers": 0}, "num_workers"),
    ({"num_workers": "2"}, "num_workers"),
    ({"num_ps": -1}, "num_ps"),
    ({"num_ps": True}, "num_ps"),
    ({"worker_threads": 0}, "worker_threads"),
])
def test_bad_arguments_name_the_argument(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment) as info:
        LocalCluster(**kwargs)
    assert "Received" in str(info.value)


def test_unstarted_cluster_errors():
    cluster = LocalCluster(num_workers=1, num_ps=1)
    with pytest.raises(RuntimeError, match="started cluster"):
        cluster.cluster_resolver
    with pytest.raises(RuntimeError, match="started cluster"):
        cluster.kill("worker", 0)


def test_under_the_launcher_a_local_cluster_is_the_launchers_and_starts_nothing(monkeypatch):
    """In a chief that `kfit-ps run` started, `LocalCluster(...)` is the cluster of TF_CONFIG:
    no server starts, the launcher's --workers / --ps decide, and the servers are the
    launcher's to kill, restart and resize."""
    import json

    cluster = {"chief": ["localhost:1"], "worker": ["localhost:2", "localhost:3", "localhost:4"],
               "ps": ["localhost:5"]}
    monkeypatch.setenv(constants.LAUNCHED_ENV, "1")
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster,
                                                "task": {"type": "chief", "index": 0}}))
    session = os.environ["KFIT_PS_TEST_SESSION"]  # (another test file may run at once)
    before = set(helpers.server_pids(session=session))
    local = LocalCluster(num_workers=2, num_ps=2).start()
    assert local.adopted and (local.num_workers, local.num_ps) == (3, 1)
    assert local.cluster_resolver.cluster_spec().as_dict() == cluster
    assert local.pids() == [] and set(helpers.server_pids(session=session)) == before
    for call in (lambda: local.kill("worker", 0), lambda: local.restart("worker", 0),
                 lambda: local.resize_workers(4)):
        with pytest.raises(RuntimeError, match="the servers are the launcher's.*kfit-ps scale"):
            call()
    local.stop()


def test_worker_threads_never_deadlock_small_machines(monkeypatch):
    monkeypatch.delenv(constants.WORKER_THREADS_ENV, raising=False)
    for workers in (1, 2, 8, 32):
        assert constants.worker_inter_op_threads(workers) >= workers + 1
    monkeypatch.setenv(constants.WORKER_THREADS_ENV, "7")
    assert constants.worker_inter_op_threads(2) == 7
    monkeypatch.setenv(constants.WORKER_THREADS_ENV, "many")
    with pytest.raises(ValueError, match=constants.WORKER_THREADS_ENV):
        constants.worker_inter_op_threads(2)


OWNER = textwrap.dedent("""
    import json, sys, time
    from kfit_ps import LocalCluster
    with LocalCluster(num_workers=2, num_ps=1) as cluster:
        print(json.dumps([cluster.pids(), cluster._log_dir]), flush=True)
        time.sleep(600)
""")


def _start_owner():
    owner = helpers.popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True,
                             env=helpers.chief_env(), cwd=helpers.ROOT, start_new_session=True)
    line = owner.stdout.readline()
    assert line, "owner process printed no pids"
    import json

    pids, log_dir = json.loads(line)
    assert len(pids) == 3 and all(psutil.pid_exists(p) for p in pids)
    assert os.path.isdir(log_dir)
    return owner, pids, log_dir


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM", "SIGINT-group"])
def test_owner_death_leaves_no_servers(how):
    owner, pids, log_dir = _start_owner()
    if how == "SIGKILL":
        owner.send_signal(signal.SIGKILL)
    elif how == "SIGTERM":
        owner.send_signal(signal.SIGTERM)
    else:  # Ctrl-C in a terminal: SIGINT to the whole foreground process group.
        os.killpg(owner.pid, signal.SIGINT)
    owner.wait(timeout=30)
    assert helpers.wait_for_no_servers(pids, timeout=10) == []
    assert not os.path.exists(log_dir)  # orphaned servers removed their logs too


SCRIPT_KEEPS_MODEL = textwrap.dedent("""
    import gc
    import numpy as np
    import kfit_ps, keras
    x = np.random.rand(64, 4).astype("float32")
    with kfit_ps.LocalCluster(num_workers=1, num_ps=1) as cluster:
        strategy = kfit_ps.ParameterServerStrategy(cluster.cluster_resolver)
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse")
        model.fit(x, x.sum(axis=1, keepdims=True), epochs=2, verbose=0)
        model.evaluate(x, x.sum(axis=1, keepdims=True), verbose=0)
        print("iterations", int(model.optimizer.iterations.numpy()))
    del model  # released after its servers stopped
    gc.collect()
    print("model released")
""")


@pytest.mark.slow
def test_model_released_after_its_cluster_stopped_logs_no_errors():
    proc = subprocess.run([sys.executable, "-c", SCRIPT_KEEPS_MODEL], capture_output=True,
                          text=True, timeout=180, env=helpers.chief_env(), cwd=helpers.ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "iterations 4" in proc.stdout and "model released" in proc.stdout
    assert "Failed to remove function" not in proc.stderr
    assert "failed to connect" not in proc.stderr


def test_a_port_the_kernel_hands_out_twice_is_not_given_to_two_tasks(monkeypatch):
    """Probes close their sockets, so one port can come back twice in a row (seen in CI as
    'localhost:45685 appears twice: as worker[0] and as ps[0]'): the second is probed again."""
    import kfit_ps.cluster.local as local

    handed = iter([5001, 5002, 5002, 5002, 5001, 5003])
    monkeypatch.setattr(local, "_free_port", lambda host: next(handed))
    picked = LocalCluster(num_workers=1, num_ps=1)._pick_addresses()
    assert picked == {"chief": ["localhost:5001"], "worker": ["localhost:5002"],
                      "ps": ["localhost:5003"]}

    monkeypatch.setattr(local, "_free_port", lambda host: 5001)
    with pytest.raises(RuntimeError, match="No 1 distinct free ports on 'localhost'"):
        LocalCluster(num_workers=1, num_ps=1)._pick_addresses()


@pytest.mark.slow
def test_port_taken_before_the_server_binds_is_retried(monkeypatch, children_reaped):
    """Another process grabs a picked port (and even answers on it): start() picks new ports."""
    import kfit_ps.cluster.local as local

    squatter = socket.socket()
    squatter.bind(("0.0.0.0", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    real_free_port = local._free_port
    calls = []

    def free_port(host):
        calls.append(host)
        return taken if len(calls) == 2 else real_free_port(host)  # call 2: worker 0

    monkeypatch.setattr(local, "_free_port", free_port)
    try:
        with LocalCluster(num_workers=1, num_ps=1) as cluster:
            assert cluster.address("worker", 0) != f"localhost:{taken}"
            assert len(cluster.pids()) == 2 and accepts_connections(cluster.address("worker", 0))
            assert len(calls) == 6  # 3 addresses per attempt, 2 attempts
    finally:
        squatter.close()


def test_kill_with_a_signal_the_server_ignores_is_bounded(children_reaped):
    import time

    with LocalCluster(num_workers=1, num_ps=1) as cluster:
        pid = cluster.pid("worker", 0)
        started = time.monotonic()
        with pytest.raises(TimeoutError) as e:
            cluster.kill("worker", 0, sig=signal.SIGWINCH, timeout=1.0)  # ignored by default
        assert time.monotonic() - started < 10
        assert "SIGWINCH" in str(e.value) and "sig=SIGKILL" in str(e.value)
        assert psutil.pid_exists(pid)  # left running, and stopped with the cluster
    assert helpers.wait_for_no_servers([pid], timeout=10) == []


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.005, 0.05])
def test_restart_racing_stop_leaves_no_server(children_reaped, delay):
    import threading
    import time

    cluster = LocalCluster(num_workers=1, num_ps=1).start()
    cluster.kill("worker", 0)
    outcome = []

    def restart():
        try:
            cluster.restart("worker", 0)
            outcome.append("restarted")
        except RuntimeError as e:
            outcome.append(str(e))

    thread = threading.Thread(target=restart)
    thread.start()
    time.sleep(delay)
    cluster.stop()
    thread.join(60)
    assert not thread.is_alive()
    assert len(outcome) == 1
    assert outcome[0] == "restarted" or "was stopped" in outcome[0] or "exited" in outcome[0]
    assert cluster.pids() == []
    with pytest.raises(RuntimeError, match="was stopped"):
        cluster.restart("worker", 0)


SCRIPT_DROPS_ITS_STRATEGY = textwrap.dedent("""
    import gc
    import numpy as np
    import kfit_ps, keras
    gc.disable()  # The coordinator is then first collected when the cluster stops.

    def train(resolver):  # the strategy, its coordinator and the model die with this call
        strategy = kfit_ps.ParameterServerStrategy(resolver)
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse")
        x = np.random.rand(64, 4).astype("float32")
        model.fit(x, x.sum(axis=1, keepdims=True), epochs=1, verbose=0)

    with kfit_ps.LocalCluster(num_workers=1, num_ps=1) as cluster:
        train(cluster.cluster_resolver)
    print("left the cluster")
""")


@pytest.mark.slow
def test_leaving_a_cluster_whose_coordinator_is_garbage_does_not_hang():
    """Collecting a ClusterCoordinator runs TensorFlow's `Cluster.stop()`, which takes the
    failure handler's lock: stop() must not hold it then (it deadlocked)."""
    proc = subprocess.run([sys.executable, "-c", SCRIPT_DROPS_ITS_STRATEGY],
                          capture_output=True, text=True, timeout=120, env=helpers.chief_env(),
                          cwd=helpers.ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "left the cluster" in proc.stdout


def test_a_server_process_loads_neither_keras_nor_the_training_stack(tmp_path):
    """LocalCluster runs its servers by path: no kfit_ps `__init__`, no Keras, only TensorFlow's
    server classes (CPU at start)."""
    from kfit_ps.cluster import local, server
    from kfit_ps.cluster.spec import ClusterConfig

    config = ClusterConfig(cluster={"chief": [f"localhost:{helpers.free_port()}"],
                                    "worker": [f"localhost:{helpers.free_port()}"],
                                    "ps": [f"localhost:{helpers.free_port()}"]},
                           task_type="chief", task_index=0, source="test")
    with open(tmp_path / "stderr", "w") as stderr:  # -X importtime: pages of it
        proc = helpers.popen([sys.executable, "-X", "importtime", local._SERVER_SCRIPT,
                              config.to_tf_config("ps", 0), str(os.getpid()), "0",
                              str(tmp_path / "ps-0.log")],
                             stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        ready = proc.stdout.readline()
    finally:
        proc.kill()
        proc.wait()
    imported = {line.rsplit("|", 1)[-1].strip()
                for line in (tmp_path / "stderr").read_text().splitlines()
                if line.startswith("import time:")}
    assert ready.startswith(f"{server.READY_LINE} ps:0"), ready
    assert ready.rstrip().endswith("(TensorFlow import: bare)"), ready
    assert "tensorflow.python.training.server_lib" in imported
    assert "kfit_ps.cluster.server" in imported
    # Neither TensorFlow's Python API (its __init__ imports tensorflow._api.v2) nor Keras.
    assert not {m for m in imported if m.split(".")[0] == "keras" or m.startswith(
        ("tensorflow._api", "kfit_ps.training", "kfit_ps.strategy"))}
    assert {m for m in imported if m.startswith("kfit_ps._tf_compat")} == {
        "kfit_ps._tf_compat.server_lib", "kfit_ps._tf_compat.supported"}


def test_the_session_clusters_servers_carry_the_test_sessions_tag(cluster):
    """The orphan check (conftest) counts the servers whose environment names this session:
    servers inherit it through `LocalCluster`, so none escapes the check unseen."""
    mine = set(helpers.server_pids(session=os.environ["KFIT_PS_TEST_SESSION"]))
    assert set(cluster.pids()) <= mine and len(cluster.pids()) == 4
    assert not set(cluster.pids()) & set(helpers.server_pids(session="another session"))
