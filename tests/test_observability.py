"""Seeing a job: metrics, events, diagnosis and the status page, on real `kfit-ps run` jobs."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
import urllib.request

import pytest

from kfit_ps.launch import job_view
from kfit_ps.observe import diagnosis, events, metrics
from tests import browser, helpers
from tests.test_launcher import Job

ALLOWED_LABELS = {"kfit_job", "task_type", "task_index", "reason", "le"}

# Trains each model of argv[3] ("table,dense") in turn, each until the file argv[1]-KIND exists;
# TensorBoard (with per-task scalars) in argv[2]. "table": one big table, the strategy's first
# variable, so on ps:0 (the few dense ones spread), trained flat out: the ps must burn CPU.
# "dense": a small dense model, also flat out: its ps tasks busy, yet none may be named hot.
LIVE = textwrap.dedent("""
    import os, sys
    import keras, kfit_ps
    from tests import helpers as h

    stop_prefix, log_dir, model_kinds = sys.argv[1:4]
    strategy = kfit_ps.ParameterServerStrategy()

    class StopOnFile(keras.callbacks.Callback):
        def __init__(self, path):
            super().__init__()
            self.path = path

        def on_epoch_end(self, epoch, logs=None):
            self.model.stop_training = os.path.exists(self.path)

    for model_kind in model_kinds.split(","):
        with strategy.scope():
            if model_kind == "dense":
                model = keras.Sequential([keras.Input((4,)),
                                          keras.layers.Dense(8, activation="relu"),
                                          keras.layers.Dense(1)])
                data = h.regression_dataset_fn()
            else:
                model = keras.Sequential([keras.Input((8,), dtype="int32"),
                                          keras.layers.Embedding(200_000, 32),
                                          keras.layers.Flatten(),
                                          keras.layers.Dense(16, activation="relu"),
                                          keras.layers.Dense(1)])
                def data(context):
                    import tensorflow as tf
                    ids = tf.random.stateless_uniform((256, 8), seed=(1, 2), maxval=200_000,
                                                      dtype=tf.int32)
                    return tf.data.Dataset.from_tensors((ids, tf.ones((256, 1)))).repeat()
            model.compile("adam", "mse", steps_per_execution=5)
        stop = StopOnFile(f"{stop_prefix}-{model_kind}")
        model.fit(kfit_ps.DatasetCreator(data), epochs=100_000, steps_per_epoch=50, verbose=0,
                  callbacks=[stop, kfit_ps.callbacks.TensorBoard(log_dir)])
        print("TRAINED", model_kind, flush=True)
""")


def read_events(job):
    return events.read(str(job.run_dir / "events.jsonl"))


def wait_for_event(job, predicate, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [e for e in read_events(job) if predicate(e)]
        if found:
            return found[0]
        assert job.proc.poll() is None, "the launcher ended:\n" + job.proc.stdout.read()[-4000:]
        time.sleep(0.5)
    raise AssertionError(f"no such event within {timeout} s; events:\n"
                         + "\n".join(json.dumps(e) for e in read_events(job)[-30:]))


def status_url(job):
    return json.loads((job.run_dir / "tasks.json").read_text())["status_url"]


def fetch(url):
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def bounded(page):
    """The samples of a metric page, parsed with prometheus-client's parser; every label
    set bounded (no per-step, per-id or per-pid label)."""
    samples = metrics.parse(page)
    assert samples, page
    for name, labels in samples:
        assert name.startswith("kfit_ps_"), name
        assert {k for k, _ in labels} <= ALLOWED_LABELS, (name, labels)
        values = dict(labels)
        assert values.get("task_type") in ("chief", "worker", "ps"), (name, labels)
        assert values.get("reason") in (None, *metrics.RESTART_REASONS), (name, labels)
    return samples


def value(samples, name, task):
    task_type, index = task.split(":")
    for (sample, labels), number in samples.items():
        labels = dict(labels)
        if sample == name and (labels["task_type"], labels["task_index"]) == (task_type, index):
            return number
    return None


class DutyCycle(threading.Thread):
    """Stops and continues a process every `period` / 2 s: half its speed, or less."""

    def __init__(self, pid, period=0.5):
        super().__init__(daemon=True)
        self.pid, self.period, self.done = pid, period, threading.Event()

    def run(self):
        try:
            while not self.done.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                time.sleep(self.period / 2)
                os.kill(self.pid, signal.SIGCONT)
                time.sleep(self.period / 2)
        except ProcessLookupError:
            pass

    def stop(self):
        self.done.set()
        self.join(5)
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


# The rules and tables, without a cluster ------------------------------------------------------


def test_diagnosis_names_only_a_sustained_slow_worker_or_hot_ps_and_clears_them():
    rules = diagnosis.Diagnosis(window=10, sustain=6)
    steps = {"worker:0": 0.0, "worker:1": 0.0, "worker:2": 0.0}
    busy = dict.fromkeys(steps, 0.0)
    cpu = {"ps:0": 0.0, "ps:1": 0.0}
    findings = []
    for t in range(0, 80):
        slow = 20 <= t < 50
        # A job that synchronises often: every worker finishes as many steps per second, and
        # the fast ones wait at the joins half of the time; the slow one works all of it.
        for task in steps:
            lost = task == "worker:2" and t >= 60  # no step at all: lost, not slow
            steps[task] += 0 if lost else 10
            busy[task] += 0 if lost else (1.0 if slow and task == "worker:1" else 0.5)
        cpu["ps:0"] += 0.9 if 30 <= t < 60 else 0.3
        cpu["ps:1"] += 0.25
        for task, count in steps.items():
            rules.steps.add(task, float(t), count)
            rules.busy.add(task, float(t), busy[task])
        for task, seconds in cpu.items():
            rules.cpu.add(task, float(t), seconds)
        findings += [(t, f.kind, f.task, f.active) for f in rules.update(float(t))]
    named = [(kind, task, active) for _, kind, task, active in findings]
    assert named == [("straggler", "worker:1", True), ("hot_ps", "ps:0", True),
                     ("straggler", "worker:1", False), ("hot_ps", "ps:0", False)], findings
    first = {(kind, task): t for t, kind, task, active in findings if active}
    # The rate crosses the line a few seconds into the slowdown; then `sustain` more.
    assert 20 + 6 <= first[("straggler", "worker:1")] <= 20 + 10 + 6
    # A worker with no step is lost, not slow; one ps alone is never "far above the others".
    assert ("straggler", "worker:2") not in first
    quota = diagnosis.Diagnosis(window=4, sustain=2)
    quota.quota["ps:0"] = 1.0
    for t in range(10):
        quota.cpu.add("ps:0", float(t), 0.95 * t)
        changes = quota.update(float(t))
        if changes:
            assert changes[0].kind == "hot_ps" and "of its 1 CPU cores" in changes[0].text
            break
    else:
        raise AssertionError("a ps at 95% of its CPU quota was not named hot")


def test_every_metric_of_the_table_serves_a_bounded_page_that_prometheus_parses():
    for role in ("chief", "launcher"):
        served = metrics.Metrics("job-a", role)
        for name, (kind, _, extra, by) in metrics.TABLE.items():
            if by != role:
                continue
            for task in ("chief:0", "worker:0", "worker:1", "ps:0"):
                labels = {"reason": "killed"} if extra else {}
                child = served.child(name, task, **labels)
                if kind.__name__ == "Histogram":
                    child.observe(0.003)
                elif kind.__name__ == "Counter":
                    child.inc(2)
                else:
                    child.set(1.5)
        samples = bounded(served.text().decode())
        names = {name for name, _ in samples}
        for name, (kind, _, _, by) in metrics.TABLE.items():
            if by == role:
                suffix = {"Counter": "_total", "Histogram": "_count"}.get(kind.__name__, "")
                assert name + suffix in names, name
    assert metrics.FUNCTION_BUCKETS[0] == 0.001 and metrics.FUNCTION_BUCKETS[-1] == 1000.0
    # The restart reasons are the whole label set of `reason`.
    assert {job_view.restart_reason(s) for s in (-9, -15, 75, 1, 2)} <= set(
        metrics.RESTART_REASONS)
    # A worker that left the job (`kfit-ps scale`) has no series left, not "down" ones.
    served.forget("worker:1")
    left = bounded(served.text().decode())
    assert not [labels for _, labels in left if ("task_index", "1") in labels and (
        "task_type", "worker") in labels]
    assert {name for name, _ in left} == names  # The other tasks' series stay.
    assert all(("kfit_job", "job-a") in labels for _, labels in left)


def test_the_chief_forgets_a_removed_worker_and_a_new_one_at_its_index_is_served():
    """A worker removed by a scale-down loses its series and diagnosis; a worker added later
    at the same index gets series of its own (the chief cached the removed one's)."""
    from kfit_ps.training import monitor as monitor_lib

    monitor = monitor_lib.JobMonitor()
    monitor._child("kfit_ps_steps", "worker:2").inc(7)
    monitor._child("kfit_ps_steps", "worker:0").inc(3)
    monitor.forget("worker:2")
    page = monitor.metrics.text().decode()
    assert 'task_index="2"' not in page and 'task_index="0"' in page
    monitor._child("kfit_ps_steps", "worker:2").inc(1)
    assert re.search(r'kfit_ps_steps_total\{[^}]*task_index="2"[^}]*\} 1\.0',
                     monitor.metrics.text().decode())


def test_an_unwritable_event_log_is_said_once_and_a_remote_run_dir_is_refused(tmp_path, capsys):
    """Events that cannot be appended are said to be lost (once, and once when the log works
    again), never silently; the launcher refuses a `--run-dir` it could not write."""
    from kfit_ps.launch import LaunchConfig

    log = events.EventLog(str(tmp_path / "missing" / "events.jsonl"), "chief")
    for _ in range(3):
        log.emit("epoch", None, "an epoch ended")
    err = capsys.readouterr().err
    assert err.count("cannot append to the event log") == 1 and "missing" in err
    (tmp_path / "missing").mkdir()
    log.emit("epoch", None, "an epoch ended")
    assert capsys.readouterr().err.count("is written again") == 1
    assert len(events.read(log.path)) == 1
    with pytest.raises(ValueError, match=r"`run_dir` \(--run-dir\) must be a local directory.*"
                                         r"Received: run_dir='gs://bucket/run'"):
        LaunchConfig(command=("python", "train.py"), run_dir="gs://bucket/run")


def test_the_status_page_reads_only_what_the_event_log_appended(tmp_path):
    """`/status.json` follows the event log (`events.Follower`): each read returns the whole
    lines appended since the last one, a half-written line once it is whole, and a new log
    from its start."""
    path = tmp_path / "events.jsonl"
    log, follower = events.EventLog(str(path), "chief"), events.Follower(str(path))
    assert follower.new() == []  # No log yet.
    log.emit("epoch", None, "one")
    log.emit("backup", None, "two")
    assert [e["reason"] for e in follower.new()] == ["one", "two"]
    assert follower.new() == []
    with open(path, "ab") as f:
        f.write(b'{"event": "stop", "reas')
        f.flush()
        assert follower.new() == []
        f.write(b'on": "three"}\n')
    assert [e["reason"] for e in follower.new()] == ["three"]
    path.write_bytes(b'{"event": "start", "reason": "again"}\n')  # A new log, shorter.
    assert [e["reason"] for e in follower.new()] == ["again"]


def test_an_event_log_appends_whole_lines_from_two_processes(tmp_path):
    path = str(tmp_path / "events.jsonl")
    code = textwrap.dedent(f"""
        from kfit_ps.observe.events import EventLog
        log = EventLog({path!r}, "chief")
        for i in range(300):
            log.emit("backup", "chief:0", "x" * 500, step=i)
    """)
    writers = [subprocess.Popen([sys.executable, "-c", code], cwd=helpers.ROOT)
               for _ in range(2)]
    assert [w.wait(60) for w in writers] == [0, 0]
    with open(path) as f:
        lines = f.read().splitlines()
    assert len(lines) == 600
    assert sorted(json.loads(line)["step"] for line in lines) == sorted(list(range(300)) * 2)
    with pytest.raises(ValueError, match="Unknown event kind 'oops'"):
        events.EventLog(path, "chief").emit("oops")


# Live jobs ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live_job(tmp_path_factory):
    """One `kfit-ps run` job (2 workers, 2 ps) that both live tests observe, started once: it
    trains the table model until ps:0 is named hot, then the dense model, whose worker:1 is
    slowed until named a straggler, then killed, restarted and shown on the status page and by
    `kfit-ps status`. Returns what was seen; an exception that ended a phase early is kept in
    `errors` for its test to raise, and the other phase still runs. The job is killed if it
    still runs at the end."""
    tmp_path = tmp_path_factory.mktemp("live")
    seen = types.SimpleNamespace(log_dir=tmp_path / "tb", profile=tmp_path / "chromium",
                                 errors={}, status=None)
    stop = tmp_path / "stop"
    job = seen.job = Job(tmp_path, "--workers", "2", "--ps", "2", script=LIVE,
                         script_args=(stop, seen.log_dir, "table,dense"))
    try:
        for kind, phase in (("table", _hot_ps_phase), ("dense", _straggler_phase)):
            try:
                phase(job, seen)
            except Exception as e:  # noqa: BLE001 - its test raises it
                seen.errors[kind] = e
            finally:
                (tmp_path / f"stop-{kind}").write_text("")
        seen.status = job.finish()
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    seen.events = read_events(job)
    begins = [i for i, e in enumerate(seen.events) if e["event"] == "fit_begin"]
    split = begins[1] if len(begins) > 1 else len(seen.events)
    seen.table_events, seen.dense_events = seen.events[:split], seen.events[split:]
    seen.output = "\n".join(job.lines)
    seen.left_running = job.left_running()
    return seen


def _hot_ps_phase(job, seen):
    """The table model: every table on ps:0, no worker slowed."""
    seen.table_begun = wait_for_event(job, lambda e: e["event"] == "fit_begin", 180)
    seen.hot = wait_for_event(job, lambda e: e["event"] == "hot_ps", 60)
    seen.hot_samples = bounded(fetch(status_url(job) + "metrics"))  # The launcher's page.


def _straggler_phase(job, seen):
    """The dense model: once it trains (an epoch ended), worker:1 is slowed until it is named;
    then killed. What the status page, its metrics and `kfit-ps status` show."""
    after = getattr(seen, "table_begun", {"time": 0.0})["time"]
    begun = wait_for_event(job, lambda e: e["event"] == "fit_begin" and e["time"] > after, 180)
    wait_for_event(job, lambda e: e["event"] == "epoch" and e["time"] > begun["time"], 180)
    cycle = DutyCycle(job.tasks()["worker:1"])
    seen.slowed_at, started = time.time(), time.monotonic()
    cycle.start()
    try:
        seen.straggler = wait_for_event(
            job, lambda e: e["event"] == "straggler" and e["time"] >= seen.slowed_at, 60)
        seen.elapsed = time.monotonic() - started
        seen.straggler_samples = bounded(fetch(status_url(job) + "metrics"))
    finally:
        cycle.stop()

    os.kill(job.tasks()["worker:1"], signal.SIGKILL)
    wait_for_event(job, lambda e: e["event"] == "restart" and e["task"] == "worker:1", 60)
    seen.restarted_pid = job.tasks()["worker:1"]
    try:
        seen.dom = browser.rendered_dom(status_url(job), seen.profile)
    except (pytest.skip.Exception, pytest.fail.Exception) as e:  # No browser here.
        seen.dom = e
    seen.shown = subprocess.run([sys.executable, "-m", "kfit_ps.cli.main", "status",
                                 "--run-dir", str(job.run_dir)], capture_output=True,
                                text=True, timeout=60, cwd=helpers.ROOT)
    seen.shown_pid = job.tasks()["worker:1"]


@pytest.mark.chaos
@pytest.mark.slow
def test_a_live_job_names_a_slowed_worker_renders_its_restart_and_serves_bounded_metrics(
        live_job):
    """A worker stopped half of the time is named a straggler within 60 s, on the launcher's
    metrics and in the chief's output, and no worker before it was slowed nor a ps of the
    dense model ever; its restart after SIGKILL shows on the status page (in a browser) and
    in `kfit-ps status`; the per-task scalars reach TensorBoard."""
    seen = live_job
    if "dense" in seen.errors:
        raise seen.errors["dense"]
    # Healthy, for more than a window and its sustain (the table phase, then the dense model
    # until worker:1 was slowed): no worker named; the dense model's ps tasks never hot.
    assert [e for e in seen.events if e["event"] == "straggler"
            and e["time"] < seen.slowed_at] == []
    assert [e for e in seen.dense_events if e["event"] == "hot_ps"] == []

    named, samples = seen.straggler, seen.straggler_samples
    assert named["task"] == "worker:1" and seen.elapsed <= 60, (named, seen.elapsed)
    assert named["steps_per_second"] < diagnosis.STRAGGLER_RATIO * named["others"]
    assert value(samples, "kfit_ps_straggler", "worker:1") == 1.0
    assert value(samples, "kfit_ps_straggler", "worker:0") in (None, 0.0)
    assert value(samples, "kfit_ps_steps_total", "worker:0") > 0
    assert value(samples, "kfit_ps_task_up", "ps:1") == 1.0
    assert value(samples, "kfit_ps_ps_cpu_cores", "ps:0") is not None

    shown = seen.shown
    assert shown.returncode == 0, shown.stderr
    [line] = [x for x in shown.stdout.splitlines() if x.startswith("worker:1 ")]
    assert line.split()[1:4] == ["running", str(seen.shown_pid), "1"], shown.stdout
    assert "restart worker:1" in shown.stdout

    assert seen.status == 0, "\n".join(seen.job.lines[-60:])
    assert "[chief] kfit_ps: worker:1 is straggling" in seen.output
    assert "status page http://127.0.0.1:" in seen.output
    from kfit_ps.training.callbacks import summaries

    scalars = {}
    for name in os.listdir(seen.log_dir / "tasks"):
        scalars.update(summaries.read_scalars(str(seen.log_dir / "tasks" / name)))
    assert {"worker_0/steps_per_second", "worker_1/steps_per_second", "ps_0/cpu_cores",
            "ps_1/cpu_cores"} <= set(scalars), sorted(scalars)
    assert seen.left_running == []

    if isinstance(seen.dom, BaseException):  # No browser: skipped (failed in CI).
        raise seen.dom
    dom = seen.dom
    rows = {task: state for state, task in
            re.findall(r'<tr class="(\w+)" data-task="([\w:]+)"', dom)}
    assert rows == {"chief:0": "running", "worker:0": "running", "worker:1": "running",
                    "ps:0": "running", "ps:1": "running"}, dom[-3000:]
    restarts = dict(re.findall(
        r'data-task="([\w:]+)"><td>[^<]*</td><td class="state">\w+</td><td>\d*</td>'
        r'<td class="restarts">(\d+)</td>', dom))
    assert restarts == {"chief:0": "0", "worker:0": "0", "worker:1": "1", "ps:0": "0",
                        "ps:1": "0"}, dom[-3000:]
    assert 'data-event="restart"' in dom and 'data-event="task_lost"' in dom
    assert f"worker:1 is back (pid {seen.restarted_pid})" in dom
    assert "<polyline" in dom  # the training curve


@pytest.mark.chaos  # Its job, shared, also kills a worker.
@pytest.mark.slow
def test_a_ps_holding_every_table_is_named_hot_and_no_worker_a_straggler(live_job):
    """The ps holding the one big table is named hot within 60 s of the fit's start, on the
    launcher's metrics (with its table's rows) and in the chief's output; while that model
    trains, nothing else is named."""
    seen = live_job
    if "table" in seen.errors:
        raise seen.errors["table"]
    assert seen.status == 0, "\n".join(seen.job.lines[-60:])
    named, begun, samples = seen.hot, seen.table_begun, seen.hot_samples
    assert named["task"] == "ps:0" and named["time"] - begun["time"] <= 60, (named, begun)
    assert named["cpu_cores"] >= diagnosis.HOT_RATIO * named["others"]
    assert value(samples, "kfit_ps_hot_ps", "ps:0") == 1.0
    assert value(samples, "kfit_ps_table_rows", "ps:0") == 200_000
    assert value(samples, "kfit_ps_table_rows", "ps:1") is None
    kinds = [(e["event"], e["task"]) for e in seen.table_events
             if e["event"] in ("hot_ps", "straggler")]
    assert kinds == [("hot_ps", "ps:0")], kinds
    assert "[chief] kfit_ps: ps:0 is hot" in seen.output
    assert seen.left_running == []


def test_bad_status_arguments_name_the_flag_and_say_what_to_do(tmp_path):
    from kfit_ps.launch import LaunchConfig

    with pytest.raises(ValueError, match=r"status_port.*Received: status_port=70000"):
        LaunchConfig(command=("python", "x.py"), status_port=70000)
    run = subprocess.run([sys.executable, "-m", "kfit_ps.cli.main", "status"],
                         capture_output=True, text=True, timeout=60, cwd=helpers.ROOT)
    assert run.returncode == 2 and "--run-dir/--url: pass one" in run.stderr, run.stderr
    run = subprocess.run([sys.executable, "-m", "kfit_ps.cli.main", "status", "--run-dir",
                          str(tmp_path)], capture_output=True, text=True, timeout=60,
                         cwd=helpers.ROOT)
    assert run.returncode == 1, run
    assert "no readable" in run.stderr and "is --run-dir the directory" in run.stderr
    # A finished job: its event log still tells what happened.
    events.EventLog(str(tmp_path / "events.jsonl"), "launcher").emit("done", None, "bye",
                                                                     status=0)
    (tmp_path / "tasks.json").write_text(json.dumps({"status_url": "http://127.0.0.1:9/"}))
    run = subprocess.run([sys.executable, "-m", "kfit_ps.cli.main", "status", "--run-dir",
                          str(tmp_path)], capture_output=True, text=True, timeout=60,
                         cwd=helpers.ROOT)
    assert run.returncode == 0 and "the launcher is not running" in run.stdout, run
    assert "done: bye" in run.stdout
