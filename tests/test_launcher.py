"""`kfit-ps run`: real supervisors, servers and chiefs, killed with real signals."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from tests import helpers

# A chief script. It prints "STEP <iterations>" at every synchronisation (each backup) and
# "RESULT {...}" at the end; `kfit-ps run --backup-dir` adds the BackupAndRestore.
JOB = textwrap.dedent("""
    import json, sys
    import keras, kfit_ps
    from tests import helpers as h

    epochs, steps, spe = (int(a) for a in sys.argv[1:4])
    strategy = kfit_ps.ParameterServerStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile("adam", "mse", metrics=[h.counting_metric()], steps_per_execution=spe)

    class Steps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if logs:  # only right after a synchronisation
                print("STEP", int(self.model.optimizer.iterations.numpy()), flush=True)

    history = model.fit(kfit_ps.DatasetCreator(h.regression_dataset_fn()), epochs=epochs,
                        steps_per_epoch=steps, verbose=0, callbacks=[Steps()])
    print("RESULT " + json.dumps({"iterations": int(model.optimizer.iterations.numpy()),
                                  "batches": history.history["batches"],
                                  "epochs": history.epoch}), flush=True)
""")


class Job:
    """A `kfit-ps run` process with a run directory, read line by line."""

    def __init__(self, tmp_path, *flags, script=JOB, script_args=(), env=None):
        (tmp_path / "job.py").write_text(script)
        self.run_dir = tmp_path / "run"
        self.pids = set()
        self.lines = []
        self.proc = helpers.popen(
            [sys.executable, "-m", "kfit_ps.cli.main", "run", "--run-dir", str(self.run_dir),
             *flags, "--", sys.executable, str(tmp_path / "job.py"), *map(str, script_args)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=helpers.ROOT,
            env=dict(helpers.chief_env(), **(env or {})), start_new_session=True)

    def tasks(self):
        for _ in range(50):
            try:
                tasks = json.loads((self.run_dir / "tasks.json").read_text())["tasks"]
                self.pids.update(tasks.values())
                return tasks
            except (OSError, ValueError):
                time.sleep(0.1)
        raise AssertionError("no tasks.json")

    def read_until(self, predicate, timeout=240):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line.rstrip("\n"))
            if predicate(line):
                return line
        raise AssertionError("not seen; output:\n" + "\n".join(self.lines[-60:]))

    def finish(self, timeout=300):
        out, _ = self.proc.communicate(timeout=timeout)
        self.lines.extend(out.splitlines())
        return self.proc.returncode

    def result(self):
        [line] = [x for x in self.lines if x.startswith("[chief] RESULT ")]
        return json.loads(line.split("RESULT ", 1)[1])

    def left_running(self):
        self.tasks()
        return [p for p in self.pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def step_of(line):
    return int(line.split("STEP ", 1)[1]) if "[chief] STEP " in line else None


@pytest.mark.chaos
@pytest.mark.slow
def test_a_job_survives_sigkill_of_a_worker_a_ps_and_the_chief(tmp_path):
    epochs, steps, spe = 4, 500, 5
    total = epochs * steps
    job = Job(tmp_path, "--workers", "2", "--ps", "1", "--backup-dir", str(tmp_path / "backup"),
              "--save-freq", "50", "--max-restarts", "2", script_args=(epochs, steps, spe))
    rng = random.Random(1234)
    victims = ["worker:1", "ps:0", "chief:0"]
    rng.shuffle(victims)
    points = sorted(rng.sample(range(150, 1400, 50), 3))
    killed = []
    try:
        for victim, point in zip(victims, points):
            job.read_until(lambda line: (step_of(line) or 0) >= point)
            pid = job.tasks()[victim]
            os.kill(pid, signal.SIGKILL)
            killed.append((victim, point, pid))
            job.read_until(lambda line: step_of(line) is not None)  # it trains again
        status = job.finish()
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    assert status == 0, "\n".join(job.lines[-80:])
    result = job.result()
    assert total <= result["iterations"] <= total + len(killed) * spe, (result, killed)
    assert result["epochs"][-1] == epochs - 1
    assert result["batches"][-1] == steps  # the final epoch's metrics are exact
    restarts = json.loads((job.run_dir / "tasks.json").read_text())["restarts"]
    assert set(restarts) >= {"worker:1", "ps:0", "chief:0"}, restarts
    assert not (tmp_path / "backup").exists()  # deleted when fit completed, nothing half-done
    output = "\n".join(job.lines)
    assert "ParameterServerError" in output  # the chief stopped on the ps loss, typed
    assert "GRPC error information" not in output
    assert helpers.wait_for_no_servers(list(job.pids), timeout=15) == []
    assert job.left_running() == []


@pytest.mark.slow
def test_a_failing_script_is_not_retried(tmp_path):
    job = Job(tmp_path, "--workers", "1", "--ps", "1", script=textwrap.dedent("""
        import kfit_ps
        strategy = kfit_ps.ParameterServerStrategy()
        raise ValueError("a bug in the user's script")
    """))
    assert job.finish() == 1
    output = "\n".join(job.lines)
    assert output.count("ValueError: a bug in the user's script") == 1
    assert "Traceback (most recent call last)" in output
    assert "not retried" in output
    assert json.loads((job.run_dir / "tasks.json").read_text())["restarts"] == {}
    assert "no --backup-dir" in output  # said at the start
    assert helpers.wait_for_no_servers(list(job.pids), timeout=15) == []


@pytest.mark.chaos
@pytest.mark.slow
def test_a_worker_that_keeps_dying_fails_the_job_with_a_summary(tmp_path):
    job = Job(tmp_path, "--workers", "2", "--ps", "1", "--max-restarts", "1",
              script_args=(1000, 500, 5))
    try:
        job.read_until(lambda line: "servers ready" in line)
        killed = None
        for _ in range(2):
            deadline = time.monotonic() + 60
            while job.tasks()["worker:0"] == killed and time.monotonic() < deadline:
                time.sleep(0.2)  # until the restarted worker is up
            time.sleep(2)  # the chief is at work
            killed = job.tasks()["worker:0"]
            os.kill(killed, signal.SIGKILL)
            job.read_until(lambda line: "worker:0 ended with signal SIGKILL" in line)
        status = job.finish(timeout=120)
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    output = "\n".join(job.lines)
    assert status == 1, output[-3000:]
    assert "has failed 2 times; giving up (--max-restarts 1)" in output
    assert "Its last log lines" in output
    assert helpers.wait_for_no_servers(list(job.pids), timeout=15) == []


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGINT-group", "SIGTERM", "SIGKILL"])
def test_stopping_the_launcher_stops_everything(tmp_path, how):
    job = Job(tmp_path, "--workers", "1", "--ps", "1", script_args=(1000, 500, 5))
    try:
        job.read_until(lambda line: line.startswith("[chief]"))
        tasks = job.tasks()
        assert set(tasks) == {"worker:0", "ps:0", "chief:0"}
        started = time.monotonic()
        if how == "SIGINT-group":  # Ctrl-C in a terminal
            os.killpg(job.proc.pid, signal.SIGINT)
        else:
            job.proc.send_signal(getattr(signal, how))
        job.proc.wait(timeout=30)
        assert time.monotonic() - started < 15
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    deadline = time.monotonic() + 15
    while job.left_running() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job.left_running() == []


@pytest.mark.slow
def test_multi_host_form_each_launcher_runs_its_share(tmp_path):
    """One launcher runs the servers of TF_CONFIG's cluster, another the chief: two 'hosts'."""
    cluster = {"chief": [f"localhost:{helpers.free_port()}"],
               "worker": [f"localhost:{helpers.free_port()}" for _ in range(2)],
               "ps": [f"localhost:{helpers.free_port()}"]}
    env = {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 0}})}
    servers_dir, chief_dir = tmp_path / "servers", tmp_path / "chief"
    servers_dir.mkdir()
    chief_dir.mkdir()
    servers = helpers.popen(
        [sys.executable, "-m", "kfit_ps.cli.main", "run", "--run-dir", str(servers_dir / "run"),
         "--tasks", "ps:0,worker:0,worker:1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, cwd=helpers.ROOT, env=dict(helpers.chief_env(), **env),
        start_new_session=True)
    try:
        while "servers ready" not in servers.stdout.readline():
            assert servers.poll() is None
        chief = Job(chief_dir, "--tasks", "chief:0", script_args=(2, 30, 3), env=env)
        assert chief.finish() == 0, "\n".join(chief.lines[-40:])
        assert chief.result()["iterations"] == 60
        assert chief.result()["batches"] == [30.0, 30.0]
        server_pids = list(json.loads((servers_dir / "run" / "tasks.json").read_text())[
            "tasks"].values())
        assert len(server_pids) == 3
        servers.send_signal(signal.SIGTERM)
        assert servers.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if servers.poll() is None:
            servers.kill()
    assert helpers.wait_for_no_servers(server_pids, timeout=15) == []
