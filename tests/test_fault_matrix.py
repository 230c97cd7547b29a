"""The fault matrix: a fault at each phase of a real job, and the same invariants every time.

A cell is one fault at one phase. Each job of `JOBS` runs the script below under
`kfit-ps run --workers 2 --ps 2 --backup-dir` (a model with a variable sharded
over both ps and unsharded ones; a first `fit` with shipped validation,
`CSVLogger` and `EarlyStopping`; a second `fit` whose validation the workers read
in shards; then `evaluate` and `predict`) through the cells it holds, in phase
order. The job announces its phases ("PHASE <name>") and pauses 1.5 s at each of
its cells' phases; the harness injects that cell's fault there. A SIGTERM ends
the job with 143, and the harness reruns it, as an operator (or Kubernetes)
would; the next cell's fault then meets the rerun. Every job then checks one set
of invariants on what it left:

- each run ended 0, or 143 *with* a backup at the step it stopped (the stop
  message names it); the last run ended 0;
- `optimizer.iterations` within `[N, N + faults x steps_per_execution]`, and the
  last epoch of each `fit` counted every one of its batches exactly once;
- each `fit`'s History, and its CSV rows, hold each epoch exactly once;
- `evaluate` and `predict` returned for every example;
- nothing is left running, and the event log ends with `done`.

`test_fault_matrix` prints the table (job, cell, result, the job's seconds, what held);
the same table is in docs/fault_tolerance.md.
"""

import concurrent.futures
import csv
import os
import signal
import subprocess
import sys
import time

import pytest

from tests import helpers
from tests.test_launcher import Job

EPOCHS, STEPS, SPE = (3, 2), (60, 40), 2
TOTAL = EPOCHS[0] * STEPS[0] + EPOCHS[1] * STEPS[1]
VALIDATION_ROWS = 320

JOB = f"""
import json, os, sys, time
import numpy as np, keras, tensorflow as tf
import kfit_ps
from tests import helpers as h

pauses = os.environ.get("MATRIX_PAUSE", "").split(",")


def phase(name):
    print("PHASE " + name, flush=True)
    if name in pauses:
        time.sleep(1.5)  # The harness injects its fault now.


phase("start-up")
strategy = kfit_ps.ParameterServerStrategy(
    variable_partitioner=tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=4096, max_shards=2))
with strategy.scope():
    ids = keras.Input((), dtype="int64", name="ids")
    x = keras.Input((8,), name="x")
    table = keras.layers.Embedding(2000, 16, name="table")  # sharded over both ps
    hidden = keras.layers.Concatenate()([table(ids), x])
    hidden = keras.layers.Dense(16, activation="relu")(hidden)
    model = keras.Model({{"ids": ids, "x": x}}, keras.layers.Dense(1)(hidden))
    model.compile("adam", "mse", metrics=[h.counting_metric()], steps_per_execution={SPE})


def arrays(rows, seed):
    rng = np.random.default_rng(seed)
    features = {{"ids": rng.integers(0, 2000, rows), "x": rng.normal(size=(rows, 8)).astype("float32")}}
    return features, features["x"].sum(axis=1, keepdims=True) + (features["ids"] % 7)[:, None] / 7


def stream(context):
    features, y = arrays(4096, 1)
    return tf.data.Dataset.from_tensor_slices((features, y)).shuffle(4096).repeat().batch(32)


vx, vy = arrays({VALIDATION_ROWS}, 2)


class Phases(keras.callbacks.Callback):
    def __init__(self, fit):
        super().__init__()
        self.fit, self.epoch, self.fitting = fit, 0, False

    def on_train_begin(self, logs=None):
        self.fitting = True

    def on_train_end(self, logs=None):
        self.fitting = False

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.fit, self.epoch, batch) == (1, 1, 20):
            phase("training")
        if (self.fit, self.epoch, batch) == (2, 0, 10):
            phase("second-fit")

    def on_test_batch_begin(self, batch, logs=None):
        if self.fitting and (self.fit, self.epoch, batch) == (1, 1, 3):
            phase("validation-shipped")
        if self.fitting and (self.fit, self.epoch, batch) == (2, 0, 1):
            phase("validation-workers")
        if not self.fitting and batch == 2:
            phase("evaluate")

    def on_epoch_end(self, epoch, logs=None):
        if (self.fit, epoch) == (1, 1):
            phase("epoch-end")

    def on_predict_batch_begin(self, batch, logs=None):
        if batch == 2:
            phase("predict")


work = sys.argv[1]
first = model.fit(kfit_ps.DatasetCreator(stream), epochs={EPOCHS[0]}, steps_per_epoch={STEPS[0]},
                  validation_data=(vx, vy), validation_batch_size=16, verbose=0,
                  callbacks=[Phases(1), keras.callbacks.CSVLogger(work + "/fit1.csv",
                                                                   append=True),
                             keras.callbacks.EarlyStopping("val_loss", patience=100)])
val = tf.data.Dataset.from_tensor_slices((vx, vy)).batch(16)
second = model.fit(kfit_ps.DatasetCreator(stream), epochs={EPOCHS[1]}, steps_per_epoch={STEPS[1]},
                   validation_data=kfit_ps.shardable(val, num_shards=4), verbose=0,
                   callbacks=[Phases(2), keras.callbacks.CSVLogger(work + "/fit2.csv",
                                                                    append=True)])
loss = model.evaluate(vx, vy, batch_size=16, verbose=0, callbacks=[Phases(3)])
predictions = model.predict(vx, batch_size=16, verbose=0, callbacks=[Phases(3)])
print("RESULT " + json.dumps({{
    "iterations": int(model.optimizer.iterations.numpy()),
    "epochs": [first.epoch, second.epoch],
    "batches": [first.history["batches"][-1], second.history["batches"][-1]],
    "val_loss": [len(first.history["val_loss"]), len(second.history["val_loss"])],
    "loss": float(loss[0]), "eval_batches": float(loss[1]),
    "predictions": int(len(predictions)),
}}), flush=True)
"""


def _scale(job, workers):
    subprocess.run([sys.executable, "-m", "kfit_ps.cli.main", "scale", "--run-dir",
                    str(job.run_dir), "--workers", str(workers)], check=True, timeout=60,
                   capture_output=True, cwd=helpers.ROOT, env=helpers.chief_env())


def _inject(job, fault):
    """Injects `fault` into the running job; returns how many faults that counts as."""
    tasks = job.tasks()
    if fault == "SIGKILL worker":
        os.kill(tasks["worker:0"], signal.SIGKILL)
    elif fault == "SIGKILL ps":
        os.kill(tasks["ps:1"], signal.SIGKILL)
    elif fault == "SIGKILL chief":
        os.kill(tasks["chief:0"], signal.SIGKILL)
    elif fault == "SIGTERM launcher":
        job.proc.send_signal(signal.SIGTERM)
    elif fault == "SIGTERM group":
        os.killpg(job.proc.pid, signal.SIGTERM)
    elif fault == "SIGSTOP worker":
        os.kill(tasks["worker:1"], signal.SIGSTOP)
    elif fault == "SIGSTOP ps":  # Wedged: the launcher's liveness watch kills it.
        os.kill(tasks["ps:1"], signal.SIGSTOP)
    elif fault == "worker loss, SIGTERM 2 s later":
        os.kill(tasks["worker:0"], signal.SIGKILL)
        time.sleep(2.0)
        job.proc.send_signal(signal.SIGTERM)
        return 2
    elif fault == "scale 2-3-2":  # The launcher takes the newest request: 3 served, then 2.
        _scale(job, 3)
        job.read_until(lambda line: "new worker(s) serve" in line, timeout=120)
        _scale(job, 2)
    elif fault == "SIGKILL ps, then a worker during its restore":
        os.kill(tasks["ps:1"], signal.SIGKILL)
        job.read_until(lambda line: "ps:1 is back" in line)  # The chief restores it now.
        os.kill(tasks["worker:0"], signal.SIGKILL)
        return 2
    elif fault == "SIGKILL ps and a worker at once":  # TF's worker recovery reconnects first.
        os.kill(tasks["ps:1"], signal.SIGKILL)
        os.kill(tasks["worker:0"], signal.SIGKILL)
        return 2
    elif fault == "scale to 3, SIGKILL a worker while it joins":
        _scale(job, 3)
        job.read_until(lambda line: "new worker(s) serve" in line, timeout=120)
        os.kill(tasks["worker:0"], signal.SIGKILL)
        return 1
    else:
        raise ValueError(fault)
    return 1


def _flags(backup):
    # Restarts: a job restart counts against every task, and the chief's job meets three.
    return ("--workers", "2", "--ps", "2", "--backup-dir", str(backup), "--save-freq", "20",
            "--grace", "30", "--liveness-timeout", "10", "--max-restarts", "5")


# Faults that stop the run (143 with a backup): the harness runs the job again.
STOPS = ("worker loss, SIGTERM 2 s later", "SIGTERM group", "SIGTERM launcher")


def _await_phase(job, phase, start):
    """The index in `job.lines` of the first "PHASE `phase`" line at or after `start`, read as
    it comes (an injection that waited for a line may have read past it already)."""
    wanted = f"[chief] PHASE {phase}"
    for index in range(start, len(job.lines)):
        if job.lines[index].startswith(wanted):
            return index
    job.read_until(lambda line: line.startswith(wanted), timeout=300)
    return len(job.lines) - 1


def run_job(tmp_path, cells):
    """Runs one job through its cells' faults, in phase order, rerunning it after each stop;
    returns (statuses, faults, job runs, work directory)."""
    backup = tmp_path / "backup"
    work = tmp_path / "work"
    work.mkdir()
    statuses, runs, faults = [], [], 0
    pending = [(phase, fault) for phase, fault, _ in cells]
    while not statuses or (statuses[-1] == 143 and len(runs) <= len(cells)):
        (tmp_path / f"run{len(runs) + 1}").mkdir()
        job = Job(tmp_path / f"run{len(runs) + 1}", *_flags(backup), script=JOB,
                  script_args=(work,), env={"MATRIX_PAUSE": ",".join(p for p, _ in pending)})
        runs.append(job)
        with job.running():
            seen = 0
            while pending:
                phase, fault = pending.pop(0)
                seen = _await_phase(job, phase, seen) + 1
                faults += _inject(job, fault)
                if fault in STOPS:
                    break
            statuses.append(job.finish(timeout=400))
    assert not pending, f"the job ended {statuses} before the faults {pending}"
    return statuses, faults, runs, work


def check(statuses, faults, runs, work, recoveries=()):
    """The invariants every job holds (module doc), and the `recoveries` its cells name, each
    as often as they name it (`ps_restored`: in place, and no job restart unless a cell names
    one; `job_restart`: the named fallback; `resumed`: a fit resumed from a backup); returns
    what held."""
    held = []
    for run, status in zip(runs, statuses):
        output = "\n".join(run.lines)
        assert status in (0, 143), output[-4000:]
        if status == 143:
            stopped = [line for line in run.lines if "fit stopped on SIGTERM after step" in line]
            assert len(stopped) == 1 and "a backup of them was written" in stopped[0], \
                output[-4000:]
        walls = [i for i, line in enumerate(run.lines) if "GRPC error information" in line]
        assert not walls, "\n".join(run.lines[max(0, walls[0] - 6):walls[0] + 2]) if walls else ""
        assert run.left_running() == []
    assert statuses[-1] == 0
    if 143 in statuses:
        held.append(f"{statuses.count(143)} x 143 with a backup")
    result = runs[-1].result()
    assert TOTAL <= result["iterations"] <= TOTAL + faults * SPE, (result, faults)
    held.append(f"iterations {result['iterations']}")
    assert result["epochs"] == [list(range(EPOCHS[0])), list(range(EPOCHS[1]))], result
    assert result["batches"] == [float(STEPS[0]), float(STEPS[1])], result
    assert result["val_loss"] == list(EPOCHS), result
    held.append("History once")
    for name, epochs in (("fit1.csv", EPOCHS[0]), ("fit2.csv", EPOCHS[1])):
        with open(work / name) as f:
            rows = [row["epoch"] for row in csv.DictReader(f) if row.get("epoch") != "epoch"]
        assert rows == [str(e) for e in range(epochs)], (name, rows)
    held.append("CSV rows once")
    assert result["predictions"] == VALIDATION_ROWS and result["loss"] == result["loss"]
    assert result["eval_batches"] == VALIDATION_ROWS / 16  # every evaluate batch once
    from kfit_ps.observe import events

    log = events.read(str(runs[-1].run_dir / "events.jsonl"))
    assert log[-1]["event"] == "done" and log[-1]["status"] == 0, log[-3:]
    logged = [e for run in runs for e in events.read(str(run.run_dir / "events.jsonl"))]
    kinds = [e["event"] for e in logged]
    how = [f"{kinds.count(kind)} {kind}" for kind in ("ps_restored", "job_restart", "resumed")
           if kind in kinds]  # In place, or the named fallback (a job restart, a resume).
    for kind in ("ps_restored", "job_restart"):  # Each the cells' own, and no other.
        assert kinds.count(kind) == list(recoveries).count(kind), _recoveries(kind, logged, runs)
    for run, after in zip(runs, runs[1:]):  # Each rerun after a stop resumed its fit.
        if run.proc.returncode == 143:
            assert "resumed" in [e["event"] for e in events.read(
                str(after.run_dir / "events.jsonl"))], kinds
    assert kinds.count("resumed") >= list(recoveries).count("resumed"), kinds
    return ", ".join(held + how)


def _recoveries(kind, logged, runs):
    """A failed recovery count, told: the recovery events and the chief's errors."""
    told = [f"{e['event']} {e['task']}: {e['reason'][:200]}" for e in logged if e["event"] in (
        "task_lost", "ps_restored", "job_restart", "resumed")]
    errors = [line[:300] for run in runs for line in run.lines
              if line.startswith("[chief] ") and "Error" in line.split(":")[0]]
    return "\n".join([f"{kind}: the recoveries logged, then the chief's errors:"] + told + errors)


# The jobs, each the cells it meets in phase order: (phase, fault, the recovery the cell
# requires, if any: "ps_restored" in place and no job restart; "job_restart" the named
# fallback; "resumed" a fit resumed from a backup). Cells share a job where each fault meets
# the job recovered from the one before (a job costs about 18 CPU-s; 17 of them took a fifth of
# the suite): a `fit` waits for a lost task before it goes on to the next phase, and a stopped
# run's rerun resumes before the next cell's phase. The longest jobs (restarts, reruns) first.
JOBS = [
    [("epoch-end", "SIGKILL chief", "job_restart"),
     ("validation-workers", "SIGKILL chief", "job_restart"),
     ("predict", "SIGKILL ps", "job_restart")],  # Outside fit: no in-place restore.
    [("training", "SIGKILL ps and a worker at once", "ps_restored"),
     ("validation-shipped", "SIGTERM group", "resumed"),
     ("second-fit", "SIGTERM launcher", "resumed")],
    [("start-up", "SIGKILL ps", None), ("training", "SIGKILL worker", None),
     ("evaluate", "SIGKILL worker", None)],
    [("training", "SIGSTOP worker", None), ("second-fit", "scale 2-3-2", None)],
    [("training", "scale to 3, SIGKILL a worker while it joins", None),
     ("validation-workers", "SIGKILL worker", None)],
    [("training", "worker loss, SIGTERM 2 s later", "resumed")],
    [("training", "SIGSTOP ps", "ps_restored"),
     ("validation-shipped", "SIGKILL ps", "ps_restored")],
    [("training", "SIGKILL ps, then a worker during its restore", "ps_restored"),
     ("epoch-end", "SIGKILL ps", "ps_restored")],
]


PHASES = ("start-up", "training", "validation-shipped", "epoch-end", "second-fit",
          "validation-workers", "evaluate", "predict")
# A job meets its cells in phase order (a restarted chief announces earlier phases again).
assert all([PHASES.index(p) for p, _, _ in cells] == sorted(PHASES.index(p) for p, _, _ in cells)
           for cells in JOBS)

JOBS_AT_ONCE = 2  # Each job mostly waits (pauses, restarts, timeouts): two share the cores.


def run_and_check(number, cells, tmp_path):
    """One job, run and checked: its cells' table rows, and its failure or None."""
    job_dir = tmp_path / f"job{number}"
    job_dir.mkdir()
    started = time.monotonic()
    failure = None
    try:
        statuses, faults, runs, work = run_job(job_dir, cells)
        held = check(statuses, faults, runs, work, [recovery for _, _, recovery in cells])
        outcome = "holds"
    except Exception as e:  # noqa: BLE001 - every job runs; the failures are listed
        held, outcome = f"{type(e).__name__}: {str(e)[:1500]}", "FAILS"
        failure = (number, cells, held)
    seconds = f"{time.monotonic() - started:.0f} s"
    return [f"| {number} | {phase} | {fault} | {outcome} | {seconds} | {held} |"
            for phase, fault, _ in cells], failure


@pytest.mark.chaos
@pytest.mark.slow
@pytest.mark.timeout(1800)  # 8 jobs of 30-90 s, two at a time; a stuck job fails on its bounds
def test_fault_matrix(tmp_path):
    only = os.environ.get("KFIT_PS_MATRIX_JOBS")  # "3,5": run those jobs (debugging)
    numbers = [int(i) for i in only.split(",")] if only else range(len(JOBS))
    with concurrent.futures.ThreadPoolExecutor(JOBS_AT_ONCE) as pool:
        outcomes = list(pool.map(lambda n: run_and_check(n, JOBS[n], tmp_path), numbers))
    table = [row for rows, _ in outcomes for row in rows]
    failures = [failure for _, failure in outcomes if failure is not None]
    print("\n| job | phase | fault | result | seconds | checked |\n"
          "| --- | --- | --- | --- | --- | --- |\n" + "\n".join(table))
    assert not failures, "\n".join(map(str, failures))
