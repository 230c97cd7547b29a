"""What users run: the README's main job and the examples, as real processes."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from kfit_ps.launch import isolation
from tests import helpers


# Output that neither kfit_ps nor Keras writes: TensorFlow's C++ and Python logs, gRPC, absl.
FOREIGN = re.compile(r"^[IWEF]\d{4} |absl|tensorflow|oneDNN|cuda|grpc|Please report", re.I)


def user_env():
    """The environment of a user who set nothing (no TF_CPP_MIN_LOG_LEVEL either)."""
    env = helpers.chief_env()
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    env.pop("KFIT_PS_TF_LOGS", None)
    return env


def foreign_lines(out):
    lines = [line for line in out.replace("\r", "\n").splitlines()
             if not line.startswith(("kfit_ps", "kfit-ps"))]
    return [line for line in lines if FOREIGN.search(line)]


def run_and_watch(args, timeout=300, env=None):
    """Runs a command in its own session, recording every kfit_ps server it or its children
    start; returns (proc, out, pids). Fails, with the output and what was left running, if
    it does not finish within `timeout` s or if something it started still holds its output
    30 s after it exited (a side-car outliving a crashed parent); both are killed."""
    proc = helpers.popen(args, env=env or helpers.chief_env(), cwd=helpers.ROOT, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True)
    chunks = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(proc.stdout.readline, "")),
                              daemon=True)
    reader.start()
    pids = set()
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            pids.update(c.pid for c in psutil.Process(proc.pid).children(recursive=True)
                        if helpers.is_server(c))
        except psutil.NoSuchProcess:
            pass
        try:
            proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
    finished = proc.poll() is not None
    reader.join(30 if finished else 0)
    if not finished or reader.is_alive():
        left = [" ".join(p.cmdline()[:4]) for p in psutil.process_iter()
                if _in_session(p, proc.pid)]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        reader.join(10)
        what = (f"exited {proc.returncode} but left running: {left}" if finished
                else f"did not finish within {timeout} s (running: {left})")
        pytest.fail(f"{args} {what}\n{''.join(chunks)[-4000:]}")
    return proc, "".join(chunks), sorted(pids)


def _in_session(process, sid):
    try:
        return os.getsid(process.pid) == sid
    except OSError:
        return False


@pytest.mark.slow
def test_quickstart_main_job_learns_and_leaves_nothing(tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    proc, out, pids = run_and_watch([sys.executable, "-m", "kfit_ps.cli.main", "quickstart"],
                                    env=dict(user_env(), TMPDIR=str(temp)))
    assert proc.returncode == 0, out[-3000:]
    assert foreign_lines(out) == [], out[-3000:]  # only kfit_ps's and Keras' output
    if isolation.available() is None:  # isolated by default where namespaces work
        assert "kfit-ps: network isolated" in out
        assert "listen on all network interfaces" not in out  # nothing can reach them
    assert len(pids) == 4  # 2 workers + 2 ps, real processes
    match = re.search(r"held-out: auc=([0-9.]+) loss=([0-9.]+) \(steps trained: (\d+)", out)
    assert match, out[-3000:]
    assert float(match.group(1)) > 0.7
    # One-pass epochs over its files (a dataset made before the cluster started): 100,000
    # lines in batches of 256, 2 epochs, exactly; no split lost or re-run.
    assert int(match.group(3)) == 2 * 391
    assert "Epoch 2/2" in out and "391/391" in out
    assert ("one-pass epochs: 100,000 examples per epoch in 79 splits; splits re-run 0 "
            "(at most 0 examples trained twice), splits lost 0") in out
    assert "Failed to remove function" not in out
    assert helpers.wait_for_no_servers(pids, timeout=10) == []
    # Neither its data, nor server logs, nor autograph's generated sources (the exit skips the
    # atexit hook that removes those).
    assert sorted(p.name for p in temp.iterdir()) == []


@pytest.mark.slow
def test_examples_quickstart_learns_alone_and_on_the_launchers_servers(tmp_path):
    """The example's two changed lines (the strategy from a LocalCluster, the scope): alone,
    its servers run until the script ends; under `kfit-ps run` the same LocalCluster is the
    launcher's cluster and starts no server of its own. Run as a user who set nothing, it
    prints kfit_ps' and Keras' output only."""
    proc, out, pids = run_and_watch([sys.executable, "examples/quickstart.py"], env=user_env())
    assert proc.returncode == 0, out[-3000:]
    assert foreign_lines(out) == [], out[-3000:]
    match = re.search(r"final training AUC: ([0-9.]+)", out)
    # Usually 0.84 to 0.86, but the model finds the taste pattern late (epoch AUCs about 0.55,
    # 0.69, 0.86): one suite run in about ten, with a slow start, ended at 0.63. Chance is 0.5.
    assert match and float(match.group(1)) > 0.6, out[-3000:]
    assert len(pids) == 4
    assert "Failed to remove function" not in out
    assert helpers.wait_for_no_servers(pids, timeout=10) == []

    proc, out, pids = run_and_watch(
        [sys.executable, "-m", "kfit_ps.cli.main", "run", "--workers", "1", "--ps", "1",
         "--run-dir", str(tmp_path / "run"), "--", sys.executable, "examples/quickstart.py"])
    assert proc.returncode == 0, out[-3000:]
    assert "[chief] final training AUC: " in out
    assert "LocalCluster under kfit-ps run trains on the launcher's 1 worker(s) and 1 ps" in out
    assert len(pids) == 2  # the launcher's worker and ps: the script started none
    assert helpers.wait_for_no_servers(pids, timeout=10) == []


@pytest.mark.slow
def test_examples_train_with_evaluator(tmp_path):
    proc, out, pids = run_and_watch([sys.executable, "examples/train_with_evaluator.py",
                                     str(tmp_path)], env=user_env())
    assert proc.returncode == 0, out[-3000:]
    assert foreign_lines(out) == [], out[-3000:]
    steps = [int(s) for s in re.findall(r"evaluator: ckpt-\S+ at step (\d+)", out)]
    assert steps == [50, 100, 150, 200], out[-3000:]  # each checkpoint once, in order
    assert "4 checkpoints evaluated" in out
    assert (tmp_path / "best.keras").exists()
    assert list((tmp_path / "validation").glob("events.*"))
    assert len(pids) == 3
    assert helpers.wait_for_no_servers(pids, timeout=10) == []


def test_readme_quick_start_has_exactly_two_commands_and_ci_runs_the_second():
    readme = open(f"{helpers.ROOT}/README.md").read()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(?:\w+)?\n(.*?)```", section, re.S)
    assert len(blocks) == 1
    lines = [line for line in blocks[0].splitlines() if line.strip()]
    assert len(lines) == 2
    assert "pip install" in lines[0] and "kfit-ps quickstart" in lines[0]
    assert "pip install" in lines[1] and "[test]" in lines[1] and "pytest" in lines[1]
    ci = open(f"{helpers.ROOT}/.ci/run").read()
    assert lines[1] in ci


def test_help_and_training_print_no_tensorflow_logs_and_the_switch_brings_them_back():
    """`kfit-ps --help` (no TensorFlow at all) and a script's first training name (which
    loads TensorFlow and Keras) print no TensorFlow C++ log line; KFIT_PS_TF_LOGS=1 shows
    TensorFlow's own lines again."""
    quiet = subprocess.run([sys.executable, "-m", "kfit_ps.cli.main", "--help"], text=True,
                           capture_output=True, env=user_env(), cwd=helpers.ROOT, timeout=120)
    assert quiet.returncode == 0 and "usage: kfit-ps" in quiet.stdout
    assert foreign_lines(quiet.stdout + quiet.stderr) == [], quiet.stderr
    training = [sys.executable, "-c", "import kfit_ps; kfit_ps.ParameterServerStrategy"]
    quiet = subprocess.run(training, text=True, capture_output=True, env=user_env(),
                           cwd=helpers.ROOT, timeout=120)
    assert quiet.returncode == 0 and foreign_lines(quiet.stdout + quiet.stderr) == [], \
        quiet.stderr
    loud = subprocess.run(training, text=True, capture_output=True,
                          env=dict(user_env(), KFIT_PS_TF_LOGS="1"), cwd=helpers.ROOT,
                          timeout=120)
    assert loud.returncode == 0 and foreign_lines(loud.stderr)  # TensorFlow's own lines


def test_filtered_stderr_keeps_tracebacks_and_partial_lines():
    """Only TensorFlow's C++ log lines are dropped: an error's traceback gets through whole."""
    code = ("import sys, kfit_ps\n"
            "sys.stderr.write('progress 1/2\\r'); sys.stderr.flush()\n"
            "import os; os.write(2, b'I0000 00:00:17.5  12 port.cc:153] dropped\\n')\n"
            "os.write(2, b'E0000 00:00:17.6  12 meta_optimizer.cc:967] tf_auto_shard failed: "
            "Found an unshardable source dataset: goo.gle/debugproto  \\nname: "
            "\"TensorSliceDataset/_2\"\\nattr {\\n  key: \"k\"\\n}\\n\\n')\n"
            "sys.stderr.write('after the proto\\n'); sys.stderr.flush()\n"
            "raise ValueError('the user sees this')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, env=user_env(),
                          cwd=helpers.ROOT, timeout=120)
    err = proc.stderr.decode()
    assert proc.returncode == 1
    assert "progress 1/2\r" in err
    assert "Traceback (most recent call last)" in err
    assert "ValueError: the user sees this" in err
    assert "after the proto" in err and "TensorSliceDataset" not in err and "key:" not in err
    assert foreign_lines(err) == [], err


@pytest.mark.slow
def test_quickstart_runs_under_the_launcher(tmp_path):
    """Streamed (`--steps-per-epoch`). With `--backup-dir` its files live beside the backups
    (a restarted chief trains on the same files, which a one-pass epoch's backup records:
    `test_quickstart_data_written_whole_is_used_again`) and go with them when the job ends."""
    backup = tmp_path / "backup"
    proc, out, pids = run_and_watch(
        [sys.executable, "-m", "kfit_ps.cli.main", "run", "--workers", "2", "--ps", "2",
         "--run-dir", str(tmp_path / "run"), "--backup-dir", str(backup), "--",
         sys.executable, "-m", "kfit_ps.cli.main", "quickstart", "--epochs", "1",
         "--steps-per-epoch", "40"], env=user_env())
    assert proc.returncode == 0, out[-3000:]
    assert "kfit-ps run: the chief finished" in out
    match = re.search(r"\[chief\] held-out: auc=([0-9.]+) .*steps trained: (\d+)", out)
    assert match and int(match.group(2)) == 40, out[-3000:]
    assert "2 workers + 2 ps ready" in out  # the launcher's servers, not a LocalCluster of its own
    assert foreign_lines(out) == [], out[-3000:]
    # Each redraw of the progress bar ("\r", read here as a line end) carries the prefix.
    bars = [line for line in out.splitlines() if re.search(r"\d+/40\b", line)]
    assert bars and all(line.startswith("[chief] ") for line in bars), bars
    assert len(pids) == 4 and helpers.wait_for_no_servers(pids, timeout=10) == []
    assert not backup.exists()  # the data went with the backups


def test_quickstart_data_written_whole_is_used_again(tmp_path):
    """A restarted chief finds the files an earlier start wrote whole (same paths, not
    rewritten: a backup's data check compares sizes and modification times); a start that
    stopped while writing has its files written again."""
    from kfit_ps.data import criteo
    from kfit_ps.jobs import quickstart

    config, spec = quickstart.QuickstartConfig(num_examples=1000), criteo.CriteoSpec()
    first = quickstart._data(config, spec, str(tmp_path / "data"))
    stamps = [os.stat(path).st_mtime_ns for path in first[0] + first[1]]
    assert quickstart._data(config, spec, str(tmp_path / "data")) == first
    assert [os.stat(path).st_mtime_ns for path in first[0] + first[1]] == stamps
    os.remove(tmp_path / "data" / "written")
    os.remove(first[0][-1])
    assert quickstart._data(config, spec, str(tmp_path / "data")) == first
    assert os.path.exists(first[0][-1]) and (tmp_path / "data" / "written").exists()
