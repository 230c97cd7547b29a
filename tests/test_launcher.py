"""`kfit-ps run`: real supervisors, servers and chiefs, killed with real signals."""

import contextlib
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import psutil
import pytest

from kfit_ps import membership
from tests import chaos, helpers

# A chief script. It prints "STEP <iterations>" at every synchronisation (each backup) and
# "RESULT {...}" at the end; `kfit-ps run --backup-dir` adds the BackupAndRestore.
JOB = textwrap.dedent("""
    import json, sys
    import keras, kfit_ps
    from tests import helpers as h

    epochs, steps, spe = (int(a) for a in sys.argv[1:4])
    own = [keras.callbacks.BackupAndRestore(sys.argv[4])] if len(sys.argv) > 4 else []
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
                        steps_per_epoch=steps, verbose=0, callbacks=[Steps()] + own)
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

    @contextlib.contextmanager
    def running(self):
        """The block drives the job; if it fails before the launcher ended, the launcher is
        killed (its servers and chief follow it)."""
        try:
            yield self
        finally:
            if self.proc.poll() is None:
                self.proc.kill()

    def finish(self, timeout=300):
        out, _ = self.proc.communicate(timeout=timeout)
        self.lines.extend(out.splitlines())
        # What the job printed, kept beside its run directory for a failure's post-mortem.
        (self.run_dir.parent / "output.txt").write_text("\n".join(self.lines) + "\n")
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
    """The script brings Keras' own BackupAndRestore, as the TensorFlow tutorial's does: the
    launcher's --backup-dir replaces it (it displaced the launcher's: no backup was written,
    and the killed chief's job started over), and the chief says so."""
    epochs, steps, spe = 4, 500, 5
    total = epochs * steps
    scripts_own = tmp_path / "scripts_own_backup"
    # The whole-job restart after a ps loss, the fallback of in-place recovery, chosen here.
    job = Job(tmp_path, "--workers", "2", "--ps", "1", "--backup-dir", str(tmp_path / "backup"),
              "--save-freq", "50", "--max-restarts", "2", "--ps-recovery", "restart",
              script_args=(epochs, steps, spe, scripts_own))
    rng = random.Random(1234)
    victims = ["worker:1", "ps:0", "chief:0"]
    rng.shuffle(victims)
    points = chaos.kill_points(rng, 150, 1400, 3, step=50)
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
    assert (f"[chief] kfit_ps: the script's keras.callbacks.BackupAndRestore("
            f"{str(scripts_own)!r}) is replaced by the launcher's backup in "
            f"{str(tmp_path / 'backup')!r}") in output
    assert not scripts_own.exists()  # one backup: the launcher's
    assert helpers.wait_for_no_servers(list(job.pids), timeout=15) == []
    assert job.left_running() == []
    assert_event_log_tells_each_kill(job.run_dir / "events.jsonl", killed)


def assert_event_log_tells_each_kill(path, killed):
    """The job's event log lists each kill, then its restart and (after a ps or the chief)
    the chief's resume from its backup, in order; the job starts and ends in it."""
    from kfit_ps.observe import events

    log = events.read(str(path))
    kinds = [e["event"] for e in log]
    assert kinds[0] == "start" and kinds[-1] == "done" and log[-1]["status"] == 0, kinds
    position = 0

    def next_event(predicate, what):
        nonlocal position
        for i in range(position, len(log)):
            if predicate(log[i]):
                position = i + 1
                return log[i]
        raise AssertionError(f"no {what} after event {position}: "
                             + "\n".join(json.dumps(e) for e in log))

    for victim, _, pid in killed:
        lost = next_event(lambda e: e["event"] == "task_lost" and e["task"] == victim,
                          f"loss of {victim}")
        assert lost["status"] == -signal.SIGKILL, lost
        if victim != "worker:1":
            next_event(lambda e: e["event"] == "job_restart", "job restart")
        back = next_event(lambda e: e["event"] == "restart" and e["task"] == victim,
                          f"restart of {victim}")
        assert back["pid"] != pid and back["cause"] == "killed", back
        if victim != "worker:1":
            next_event(lambda e: e["event"] == "resumed", "resume from the backup")
    resumed = [e for e in log if e["event"] == "resumed"]
    assert len(resumed) == 2, resumed  # after the ps and after the chief, not after the worker


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
    assert status == 76, output[-3000:]  # exit_status.RESTARTS_EXHAUSTED
    assert "has failed 2 times within 600 s of each other; giving up (--max-restarts 1" in output
    assert "Its last log lines" in output
    assert helpers.wait_for_no_servers(list(job.pids), timeout=15) == []


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGINT-group", "SIGTERM", "SIGKILL"])
def test_stopping_the_launcher_stops_everything(tmp_path, how):
    job = Job(tmp_path, "--workers", "1", "--ps", "1", script_args=(1000, 500, 5))
    try:
        if how == "SIGTERM":  # In `fit` (its first epoch ended), where SIGTERM stops it.
            job.read_until(lambda line: "STEP" in line)
        else:
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
        if how == "SIGTERM":  # No --backup-dir: the chief says no backup exists.
            [stopped] = [line for line in job.proc.stdout.read().splitlines()
                         if "fit stopped on SIGTERM" in line]
            assert "but no backup was written" in stopped and "backup of them" not in stopped
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    deadline = time.monotonic() + 15
    while job.left_running() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job.left_running() == []


@pytest.mark.slow
def test_multi_host_form_each_launcher_runs_its_share(tmp_path):
    """One launcher runs the servers of TF_CONFIG's cluster, another the chief: two 'hosts'.
    The chief's run directory is reused from a scaled job: its old worker lists (of workers
    long gone) are not this job's, which trains on its own workers."""
    cluster = {"chief": [f"localhost:{helpers.free_port()}"],
               "worker": [f"localhost:{helpers.free_port()}" for _ in range(2)],
               "ps": [f"localhost:{helpers.free_port()}"]}
    env = {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 0}})}
    servers_dir, chief_dir = tmp_path / "servers", tmp_path / "chief"
    servers_dir.mkdir()
    chief_dir.mkdir()
    stale = chief_dir / "run" / membership.DIR_NAME
    stale.mkdir(parents=True)
    for generation, count in ((1, 3), (2, 2)):  # The old job's 2 -> 3 -> 2 workers.
        membership.publish(str(stale), generation,
                           [f"localhost:{helpers.free_port()}" for _ in range(count)])
    membership.acknowledge(str(stale), 2)
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


# A script of several `fit`s: argv[1] is the plan, e.g. "[[2, 50], [4, 50], [1, 50]]"
# (epochs, steps_per_epoch of each fit); with argv[2] == "same-batch", every step trains on one
# fixed batch, so that the weights do not depend on where the input pipeline starts. It prints
# "EPOCH <fit> <epoch> <iterations>" as each epoch begins and, at the end, each fit's History,
# the final iterations and weights.
FITS = textwrap.dedent("""
    import json, sys
    import keras, kfit_ps, tensorflow as tf
    from tests import helpers as h

    plan = json.loads(sys.argv[1])
    data_fn = h.regression_dataset_fn()
    if sys.argv[2:] == ["same-batch"]:
        def data_fn(ctx):
            x = tf.random.stateless_normal((16, 4), seed=(1, 2))
            return tf.data.Dataset.from_tensors((x, tf.reduce_sum(x, 1, keepdims=True))).repeat()
    paced = [h.paced_until(a.split("=", 1)[1], 0.03) for a in sys.argv[2:] if
             a.startswith("paced=")]  # until that file exists
    keras.utils.set_random_seed(7)
    strategy = kfit_ps.ParameterServerStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile("adam", "mse", metrics=[h.counting_metric()], steps_per_execution=5)

    class Report(keras.callbacks.Callback):
        def __init__(self, fit):
            super().__init__()
            self.fit = fit

        def on_epoch_begin(self, epoch, logs=None):
            print("EPOCH", self.fit, epoch, int(self.model.optimizer.iterations.numpy()),
                  flush=True)

    histories = []
    for k, (epochs, steps) in enumerate(plan, 1):
        history = model.fit(kfit_ps.DatasetCreator(data_fn), epochs=epochs,
                            steps_per_epoch=steps, verbose=0, callbacks=[Report(k), *paced])
        histories.append({"epoch": history.epoch, "batches": history.history["batches"]})
    print("RESULT " + json.dumps({"iterations": int(model.optimizer.iterations.numpy()),
                                  "fits": histories,
                                  "weights": [w.tolist() for w in model.get_weights()]}),
          flush=True)
""")


def epoch_line(line):
    """(fit, epoch, iterations) of an "EPOCH" line, else None."""
    if "[chief] EPOCH " not in line:
        return None
    return tuple(int(x) for x in line.split("EPOCH ", 1)[1].split())


@pytest.mark.chaos
@pytest.mark.slow
def test_a_script_of_three_fits_killed_in_the_second_resumes_into_the_second(tmp_path):
    backup = tmp_path / "backup"
    plan = [[2, 50], [4, 50], [1, 50]]
    args = (json.dumps(plan), "same-batch")
    job = Job(tmp_path, "--workers", "1", "--ps", "1", "--backup-dir", str(backup),
              "--save-freq", "25", "--backoff", "0", script=FITS, script_args=args)
    try:
        # Kill the chief once fit 2 is in its second epoch (its step 50 is backed up).
        job.read_until(lambda line: (epoch_line(line) or (0,))[:2] == (2, 1))
        chief = job.tasks()["chief:0"]
        os.kill(chief, signal.SIGKILL)
        assert job.finish() == 0, "\n".join(job.lines[-40:])
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    epochs = [epoch_line(line) for line in job.lines if epoch_line(line)]
    restart = next(i for i, e in enumerate(epochs) if i and e[:2] <= epochs[i - 1][:2])
    first_run, rerun = epochs[:restart], epochs[restart:]
    assert [e[:2] for e in first_run] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    # The rerun skips fit 1 (no epoch of it runs) and resumes fit 2 in its epoch 1, at its
    # last backup (every 25 steps: 100 of fit 1 + 50 of epoch 0 + 0, 25 or 50)...
    assert rerun[0][:2] == (2, 1) and rerun[0][2] in (150, 175, 200), rerun
    assert [e[:2] for e in rerun] == [(2, 1), (2, 2), (2, 3), (3, 0)]
    assert rerun[-1][2] == 300  # ...and fit 3 starts after fit 2's 200 steps.
    result = job.result()
    assert result["iterations"] == 350  # not 450: fit 1 was not trained again
    # Fit 1 returns its History from the first run; fit 2 its epochs of the rerun.
    assert result["fits"][0] == {"epoch": [0, 1], "batches": [50.0, 50.0]}
    assert result["fits"][1]["epoch"][-2:] == [2, 3]
    assert result["fits"][2] == {"epoch": [0], "batches": [50.0]}
    assert any("fit 1 completed in an earlier run" in line for line in job.lines)
    assert not backup.exists()  # deleted only once the script exited 0
    assert job.left_running() == []
    # The same script, never interrupted, ends with the same weights (one worker trains each
    # step on the same batch, so a step redone from the backup is the step it replaces).
    (tmp_path / "uninterrupted").mkdir()
    alone = Job(tmp_path / "uninterrupted", "--workers", "1", "--ps", "1", script=FITS,
                script_args=args)
    try:
        assert alone.finish() == 0, "\n".join(alone.lines[-40:])
    finally:
        if alone.proc.poll() is None:
            alone.proc.kill()
    assert alone.result()["iterations"] == 350
    for resumed, straight in zip(result["weights"], alone.result()["weights"]):
        np.testing.assert_allclose(resumed, straight, rtol=1e-6, atol=1e-7)


@pytest.mark.chaos
@pytest.mark.slow
@pytest.mark.parametrize("to", ["launcher", "group", "launcher and chief"])
def test_sigterm_saves_the_steps_in_flight_and_the_rerun_loses_none(tmp_path, to):
    """SIGTERM to the launcher (as Kubernetes sends it), to its whole process group (as
    `timeout` and systemd do), or to the launcher and the chief both (the chief then gets
    two copies, as when Slurm signals the processes of a step): the chief stops once,
    finishes the steps in flight and writes its final backup while the servers still run;
    the rerun resumes at that step (checked after the signal to the launcher; the others
    check the backup's step)."""
    backup = tmp_path / "backup"
    flags = ("--workers", "1", "--ps", "1", "--backup-dir", str(backup), "--grace", "60")
    plan = json.dumps([[1, 2000]])  # one long epoch, backed up only at its end
    # Paced (30 ms before each function: at most 1,200 steps in 7 s), then at full speed for
    # the last 0.5 s before the signal, so that it lands in the epoch with the coordinator's
    # queue of functions full; the rerun runs at full speed.
    unpaced = tmp_path / "unpaced"
    job = Job(tmp_path, *flags, script=FITS, script_args=(plan, f"paced={unpaced}"))
    try:
        job.read_until(lambda line: epoch_line(line) == (1, 0, 0))
        time.sleep(random.Random(7).uniform(4.0, 7.0) - 0.5)
        unpaced.touch()
        time.sleep(0.5)
        started = time.monotonic()
        if to == "group":
            os.killpg(job.proc.pid, signal.SIGTERM)  # the launcher's session leads its group
        elif to == "launcher and chief":
            for pid in (job.tasks()["chief:0"], job.proc.pid):
                os.kill(pid, signal.SIGTERM)
        else:
            job.proc.send_signal(signal.SIGTERM)
        status = job.finish(timeout=120)
        took = time.monotonic() - started
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    assert status == 143, "\n".join(job.lines[-40:])
    assert took < 60
    stopped = [line for line in job.lines if "fit stopped on SIGTERM after step" in line]
    assert len(stopped) == 1, "\n".join(job.lines[-40:])
    assert f"a backup of them was written ({backup}" in stopped[0], stopped
    saved = int(stopped[0].split("after step ", 1)[1].split()[0])
    # 0 when the first function had not started yet (its registration takes seconds here).
    assert 0 <= saved < 2000 and saved % 5 == 0, stopped
    assert any("the chief stopped with exit code 143" in line for line in job.lines)
    assert job.left_running() == []
    markers = [json.loads(p.read_text()) for p in backup.rglob("*.kfit_ps.json")]
    assert saved in [m["step"] for m in markers], markers
    if to != "launcher":
        return
    # The rerun resumes at exactly the step the SIGTERM stopped at: no step lost or redone.
    (tmp_path / "again").mkdir()
    rerun = Job(tmp_path / "again", *flags, script=FITS, script_args=(plan,))
    try:
        assert rerun.finish() == 0, "\n".join(rerun.lines[-40:])
    finally:
        if rerun.proc.poll() is None:
            rerun.proc.kill()
    [first] = [epoch_line(line) for line in rerun.lines if epoch_line(line)]
    assert first == (1, 0, saved)
    assert rerun.result()["iterations"] == 2000
    assert rerun.result()["fits"][0]["batches"] == [2000.0 - saved]  # this run's steps
    assert rerun.left_running() == []


@pytest.mark.slow
def test_sigterm_while_servers_start_stops_everything_at_once(tmp_path):
    """A ps held before it serves (SIGSTOPped as it starts, a process of its own: a forked
    server serves within milliseconds, before the signal could come), then SIGTERM: the
    launcher stops at once, with every process it started, and never says the servers are
    ready (a race with the servers' start-up before)."""
    job = Job(tmp_path, "--workers", "2", "--ps", "2", script_args=(1, 10, 5),
              env={"KFIT_PS_SERVER_FORK": "0"})
    try:
        job.read_until(lambda line: "LaunchConfig(" in line)  # servers are being started
        _stop_next_server(job.proc.pid, "ps", set())
        children = psutil.Process(job.proc.pid).children(recursive=True)
        started = time.monotonic()
        job.proc.send_signal(signal.SIGTERM)
        status = job.finish(timeout=60)
        took = time.monotonic() - started
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    assert status == 143, "\n".join(job.lines)
    assert took < 10, took
    assert not any("servers ready" in line for line in job.lines), job.lines
    deadline = time.monotonic() + 10
    while any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children):
        assert time.monotonic() < deadline, children
        time.sleep(0.2)


def _stop_next_server(launcher_pid, task_type, known, timeout=60):
    """SIGSTOPs the first server process of `task_type` under the launcher not in `known`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in psutil.Process(launcher_pid).children():
            try:
                if child.pid not in known and f'"type": "{task_type}"' in " ".join(
                        child.cmdline()):
                    child.send_signal(signal.SIGSTOP)
                    return child.pid
            except psutil.Error:
                continue
        time.sleep(0.005)
    raise AssertionError(f"no new {task_type} server within {timeout} s")


@pytest.mark.chaos
@pytest.mark.slow
def test_a_server_that_never_starts_serving_is_killed_and_started_again(tmp_path):
    # Servers started as processes of their own (a forked one serves within milliseconds, too
    # soon to be stopped before it does): the hang is one in Python's or TensorFlow's start.
    job = Job(tmp_path, "--workers", "1", "--ps", "1", "--backoff", "0", script=FITS,
              script_args=(json.dumps([[3, 200]]),),
              env={"KFIT_PS_STARTUP_TIMEOUT": "8", "KFIT_PS_SERVER_FORK": "0"})
    try:
        job.read_until(lambda line: epoch_line(line) == (1, 0, 0))
        tasks = job.tasks()
        os.kill(tasks["worker:0"], signal.SIGKILL)
        # Its restart hangs before serving (stopped): the launcher must not wait forever.
        stopped = _stop_next_server(job.proc.pid, "worker", set(tasks.values()))
        job.read_until(lambda line: "worker:0 did not start serving in time" in line)
        job.read_until(lambda line: "worker:0 is back" in line)
        assert job.finish() == 0, "\n".join(job.lines[-40:])
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    assert not psutil.pid_exists(stopped) or psutil.Process(stopped).status() == (
        psutil.STATUS_ZOMBIE)
    assert job.result()["iterations"] >= 600
    assert job.result()["fits"][0]["batches"] == [200.0] * 3  # exact metrics throughout
    assert job.left_running() == []


@pytest.mark.chaos
@pytest.mark.slow
def test_a_wedged_worker_is_killed_and_restarted(tmp_path):
    job = Job(tmp_path, "--workers", "2", "--ps", "1", "--liveness-timeout", "4", script=FITS,
              script_args=(json.dumps([[3, 300]]),))
    try:
        job.read_until(lambda line: epoch_line(line) == (1, 1, 300))
        stopped = job.tasks()["worker:0"]
        os.kill(stopped, signal.SIGSTOP)  # the port stays open; nothing answers
        started = time.monotonic()
        job.read_until(lambda line: "worker:0 accepts connections but has not answered for 4 s"
                       in line)
        assert time.monotonic() - started < 4 + 15
        # The other worker may finish the job before the restarted one is back.
        job.read_until(lambda line: "worker:0 ended with signal SIGKILL; restarting it" in line)
        assert job.finish() == 0, "\n".join(job.lines[-40:])
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    result = job.result()
    assert 900 <= result["iterations"] <= 905  # at-least-once for the wedged worker's function
    assert result["fits"][0]["batches"] == [300.0] * 3  # exactly-once metrics
    assert job.left_running() == []


# A job whose backups take long to write: a 1,000,000 x 16 embedding (64 MB).
SLOW_BACKUP = textwrap.dedent("""
    import json
    import keras, kfit_ps, tensorflow as tf

    def data_fn(ctx):
        ids = tf.random.stateless_uniform((256, 1), seed=(1, 2), maxval=1_000_000,
                                          dtype=tf.int32)
        return tf.data.Dataset.from_tensor_slices((ids, tf.ones((256, 1)))).repeat().batch(32)

    strategy = kfit_ps.ParameterServerStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,), dtype="int32"),
                                  keras.layers.Embedding(1_000_000, 16), keras.layers.Flatten(),
                                  keras.layers.Dense(1)])
        model.compile("sgd", "mse", steps_per_execution=5)
    model.fit(kfit_ps.DatasetCreator(data_fn), epochs=1, steps_per_epoch=100, verbose=0)
    print("RESULT " + json.dumps({"iterations": int(model.optimizer.iterations.numpy())}),
          flush=True)
""")


@pytest.mark.chaos
@pytest.mark.slow
def test_a_kill_during_the_first_backup_write_is_followed_by_a_successful_restart(tmp_path):
    backup = tmp_path / "backup"
    first = backup / "backup-00000001.weights.h5"
    job = Job(tmp_path, "--workers", "1", "--ps", "1", "--backup-dir", str(backup),
              "--save-freq", "50", "--backoff", "0", script=SLOW_BACKUP)
    try:
        job.read_until(lambda line: "servers ready" in line)
        chief = job.tasks()["chief:0"]
        deadline = time.monotonic() + 240
        while not first.exists():  # the first backup's file is being written...
            assert time.monotonic() < deadline and job.proc.poll() is None
            time.sleep(0.002)
        os.kill(chief, signal.SIGKILL)  # ...and its writer dies before its marker
        assert not pathlib.Path(str(first) + ".kfit_ps.json").exists()
        assert job.finish() == 0, "\n".join(job.lines[-40:])
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    output = "\n".join(job.lines)
    assert "no complete backup" in output and "training starts from the beginning" in output
    assert job.result()["iterations"] == 100
    assert job.left_running() == []


# One one-pass epoch of 200,000 indexed examples: arrays, or TFRecord files in the folder
# given; each training step logs its indices from the worker (`helpers.counting_model`), so
# the log covers every incarnation of the job.
ONE_PASS_JOB = textwrap.dedent("""
    import json, os, sys
    import keras, kfit_ps, numpy as np, tensorflow as tf
    from tests import helpers as h

    N = 200_000
    strategy = kfit_ps.ParameterServerStrategy()
    if sys.argv[2] == "arrays":
        (x, index), y = h.indexed_arrays(N)
        dataset = tf.data.Dataset.from_tensor_slices(((x, index), y)).batch(256)
    else:  # The files the test wrote, read as a user writes it.
        paths = sorted(os.path.join(sys.argv[2], f) for f in os.listdir(sys.argv[2]))
        dataset = h.indexed_file_dataset(paths, 256)
    with strategy.scope():
        model = h.counting_model(N, trained_log=sys.argv[1])
        model.compile("adam", "mse", steps_per_execution=5)

    class Steps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if logs:  # only right after a synchronisation (a backup)
                print("STEP", batch + 1, flush=True)

    history = model.fit(dataset, epochs=1, verbose=0, callbacks=[Steps()])
    print("RESULT " + json.dumps({"counts": np.bincount(model.counts.numpy()).tolist(),
                                  "logs": history.history}), flush=True)
""")


@pytest.mark.chaos
@pytest.mark.slow
@pytest.mark.parametrize("data", ["arrays", "tfrecord"])
def test_a_killed_chief_resumes_a_one_pass_epoch_at_its_first_untrained_split(tmp_path, data):
    """Over arrays, and over 8 TFRecord files of uneven sizes (one empty)."""
    n, batch, save_freq, spe, workers = 200_000, 256, 50, 5, 2
    trained = tmp_path / "trained.log"
    if data == "tfrecord":
        data = str(tmp_path / "files")
        helpers.indexed_files(data, "tfrecord", sizes=(60_000, 0, 7, 41_000, 55, 70_000, 1,
                                                       28_937))
    job = Job(tmp_path, "--workers", str(workers), "--ps", "1", "--backup-dir",
              str(tmp_path / "backup"), "--save-freq", str(save_freq),
              script=ONE_PASS_JOB, script_args=(trained, data))
    try:
        job.read_until(lambda line: (step_of(line) or 0) >= 300)
        os.kill(job.tasks()["chief:0"], signal.SIGKILL)
        resumed = job.read_until(lambda line: "resuming one-pass epoch 1 at batch" in line)
        status = job.finish()
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    assert status == 0, "\n".join(job.lines[-80:])
    first = int(resumed.split("at batch ", 1)[1].split()[0])
    assert first >= 300 - save_freq and first % save_freq == 0, resumed
    # The restored state plus the resumed run: every example exactly once in the final model.
    result = job.result()
    assert result["counts"] == [0, n]
    assert result["logs"]["ledger_splits_lost"] == [0.0]
    # Over both runs (the worker-side log): every example trained, and the ones trained
    # twice lie after the last backup, within its interval plus the splits in flight.
    counts = np.zeros(n, np.int64)
    for line in trained.read_text().split("\n"):
        if line.strip():
            lo, hi = map(int, line.split())
            counts[lo:hi + 1] += 1
    assert counts.min() >= 1
    twice = np.flatnonzero(counts > 1)
    assert twice.size and twice.min() >= first * batch, (twice[:5], first)
    assert twice.max() < (first + save_freq + workers * spe) * batch, (twice.max(), first)
    assert counts.max() == 2
    assert job.left_running() == []
