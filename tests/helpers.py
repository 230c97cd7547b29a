"""Test helpers: chief subprocesses, server-process discovery, small models."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import psutil

SERVER_MODULE = os.path.join("kfit_ps", "cluster", "_server_main.py")  # run by its path
RESULT_PREFIX = "KFIT_PS_TEST_RESULT "
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def is_server(proc, or_template=False):
    """A worker or ps process: started by its path, or forked from a `LocalCluster`'s server
    template (whose command line it keeps). The template itself is not a server; it is
    counted too with `or_template` (a template must not outlive its cluster either)."""
    try:
        command = " ".join(proc.cmdline())
        if SERVER_MODULE not in command:
            return False
        # A template keeps the interpreter's name until it renames itself, then its own; a
        # server forked from it takes its task's ("worker:0") at once.
        return or_template or "--fork-server" not in command or bool(
            re.fullmatch(r"(worker|ps):\d+", proc.name()))
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def server_pids(session=None):
    """The running kfit_ps servers and server templates: all, or those started under test
    session `session` (their environment's `KFIT_PS_TEST_SESSION`, set by conftest and passed
    on to every child)."""
    pids = []
    for p in psutil.process_iter():
        try:
            if not is_server(p, or_template=True) or p.status() == psutil.STATUS_ZOMBIE:
                continue
            if session is None or p.environ().get("KFIT_PS_TEST_SESSION") == session:
                pids.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return pids


def wait_for_no_servers(pids=None, exclude=(), timeout=10.0):
    """Waits until none of `pids` (default: every server) runs; returns those left."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in (server_pids() if pids is None else pids)
                 if p not in exclude and psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


_HANDED_OUT = set()


def missing_tool(message):
    """A test needs a tool this machine lacks (`message` says how to install it): it fails
    where every tool must be present (CI: `KFIT_PS_REQUIRE_TOOLS=1`, set by `.ci/run`,
    which installs them), and is skipped elsewhere."""
    import pytest

    if os.environ.get("KFIT_PS_REQUIRE_TOOLS") == "1":
        pytest.fail(message)
    pytest.skip(message)


def free_port():
    """A port free on this machine right now, never one this process was handed before (the
    kernel may hand a just-closed probe port out again, and a spec with it twice is invalid)."""
    # Here, not at the top: `import kfit_ps` loads neither TensorFlow nor Keras, but it puts
    # its standard-error filter in place (`kfit_ps.tf_logs`).
    from kfit_ps import net

    return net.distinct_ports("localhost", 1, _HANDED_OUT)[0]


def wait_listening(address, proc, timeout=90):
    """Waits until `address` accepts connections; fails if `proc` exits first."""
    from kfit_ps import net

    def ready(name, address):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        return net.accepts_connections(address)

    missing = net.wait_for_servers([(address, address)], timeout, ready=ready)
    assert not missing, f"{address} never listened"


_spawned = []


def _default_sigint():
    # A suite run from `nohup` or a background job inherits an ignored SIGINT; the children
    # that tests interrupt (Ctrl-C) must get Python's KeyboardInterrupt as in a terminal.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def popen(args, **kwargs):
    """`subprocess.Popen` for tests: default SIGINT in the child, reaped after the test."""
    proc = subprocess.Popen(args, preexec_fn=_default_sigint, **kwargs)
    _spawned.append((proc, kwargs.get("start_new_session", False)))
    return proc


def reap_spawned(timeout=10):
    """Kills (with their process group, if they lead one) the test's children still running."""
    left = []
    while _spawned:
        proc, leads_group = _spawned.pop()
        if proc.poll() is None:
            left.append(proc.pid)
            try:
                if leads_group:
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    proc.kill()
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    return left


# TMPDIR of the processes tests start (set by conftest for the session, which removes it): what
# they leave there, such as autograph's sources in a chief that ends with os._exit, goes with it.
CHILD_TMPDIR = None


def chief_env():
    env = dict(os.environ)
    if CHILD_TMPDIR:
        env["TMPDIR"] = CHILD_TMPDIR
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("PYTHONFAULTHANDLER", "1")  # A crashed chief leaves its threads' stacks.
    return env


# One interpreter runs `kfit-ps` on many argument lists (`cli_failures`).
_CLI_RUNS = """
import contextlib, io, json, os, sys
from kfit_ps.cli.main import main

results = []
for argv, env in json.loads(sys.stdin.read()):
    os.environ.pop("TF_CONFIG", None)
    os.environ.update(env)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as e:
            status = e.code
    for name in env:
        os.environ.pop(name, None)
    results.append([status, err.getvalue()])
print(json.dumps(results))
"""


def cli_failures(cases, timeout=180):
    """[(exit status, stderr)] of `kfit-ps ARGV` for each `(argv, env)` in `cases`.

    For argument errors, which end a command before it starts anything: one
    interpreter runs them all, where a `kfit-ps` process each would import
    TensorFlow and Keras again (about 5 s of CPU each). `TF_CONFIG` is unset
    unless a case's `env` sets it.
    """
    proc = subprocess.run([sys.executable, "-c", _CLI_RUNS], input=json.dumps(
        [[list(argv), dict(env or {})] for argv, env in cases]), capture_output=True,
        text=True, timeout=timeout, cwd=ROOT, env=chief_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [tuple(result) for result in json.loads(proc.stdout.strip().splitlines()[-1])]


def _run_chief_process(code, timeout):
    """Runs `code` as a chief process (forked by the session's zygote, `tests/zygote.py`, or
    with `python -c`); a `subprocess.CompletedProcess`, `TimeoutExpired` past `timeout`."""
    from tests import zygote

    env = chief_env()
    if zygote.enabled(env):
        return zygote.run(code, env, ROOT, timeout)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT, preexec_fn=_default_sigint)


def run_chief(code, timeout=240):
    """Runs `code` as a fresh chief process; returns the dict it passed to `report()`.

    The code gets `report(**values)` and `import kfit_ps, keras, numpy as np,
    tensorflow as tf` for free. It should end with `os._exit(0)` after its
    cluster stopped (TensorFlow's teardown only logs noise then).
    """
    prelude = textwrap.dedent(f"""
        import json, os, sys, time
        import numpy as np
        import kfit_ps, keras, tensorflow as tf
        def report(**values):
            print({RESULT_PREFIX!r} + json.dumps(values), flush=True)
    """)
    proc = _run_chief_process(prelude + textwrap.dedent(code), timeout)
    for line in proc.stdout.splitlines():
        if RESULT_PREFIX in line:  # a progress bar may precede it on the same line
            result = json.loads(line.split(RESULT_PREFIX, 1)[1])
            result["_returncode"] = proc.returncode
            result["_stdout"] = proc.stdout
            result["_stderr"] = proc.stderr
            return result
    raise AssertionError(
        f"chief subprocess reported nothing (exit {proc.returncode}).\n"
        f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}")


def counting_metric():
    """A Keras metric whose value is the number of batches it saw."""
    import keras

    class BatchCount(keras.metrics.Metric):
        def __init__(self, name="batches", **kwargs):
            super().__init__(name=name, **kwargs)
            self.count = self.add_variable(shape=(), initializer="zeros", name="count",
                                           aggregation="sum")

        def update_state(self, y_true, y_pred, sample_weight=None):
            self.count.assign_add(1.0)

        def result(self):
            return self.count

    return BatchCount()


def paced_until(path, seconds=0.02):
    """A callback that sleeps `seconds` before each batch until the file `path` exists, so that
    a fit outlasts what a test drives meanwhile; then the fit runs at full speed."""
    import keras

    class Paced(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if not os.path.exists(path):
                time.sleep(seconds)

    return Paced()


def regression_dataset_fn(features=4, batch=16, rows=256):
    import tensorflow as tf

    def dataset_fn(input_context):
        x = tf.random.stateless_normal((rows, features), seed=(1, 2))
        y = tf.reduce_sum(x, axis=1, keepdims=True)
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(rows).repeat().batch(batch)

    return dataset_fn


def regression_arrays(rows=200, features=4, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, features)).astype("float32")
    return x, x.sum(axis=1, keepdims=True)


def dump(obj):
    return json.dumps(obj)


def counting_model(num_examples, trained_log=None, saved=True):
    """A regression model on `((x, index), y)` whose training steps count each index.

    `model.counts` (int32, one per example, on a ps) is added to in every
    training step, outside the ledger: how often each example was trained.
    With `saved=True` it is a weight (backups save and restore it; each step
    also reads it, as every small weight); otherwise a plain variable.
    With `trained_log` (a path), each step also appends "first last" (its
    batch's smallest and largest index) to that file, from the worker: a
    record that outlives restarted processes. Build and compile it under the
    strategy's scope.
    """
    import keras
    import tensorflow as tf

    class Counting(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden = keras.layers.Dense(16, activation="relu")
            self.out = keras.layers.Dense(1)
            if saved:
                self.counts = self.add_weight(shape=(num_examples,), dtype="int32",
                                              initializer="zeros", trainable=False,
                                              name="counts")
            else:
                self.counts = tf.Variable(tf.zeros([num_examples], tf.int32), trainable=False)

        def call(self, inputs):
            return self.out(self.hidden(inputs[0]))

        def train_step(self, data):
            (_, index), _ = data
            counts = self.counts.value if saved else self.counts
            counts.scatter_add(tf.IndexedSlices(tf.ones_like(index, tf.int32), index))
            if trained_log:
                tf.print(tf.reduce_min(index), tf.reduce_max(index),
                         output_stream=f"file://{trained_log}")
            return super().train_step(data)

    return Counting()


def indexed_arrays(num_examples, features=8, seed=0):
    """`((x, index), y)` arrays: each example carries its own index."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_examples, features)).astype("float32")
    return (x, np.arange(num_examples, dtype=np.int64)), x.sum(axis=1, keepdims=True)


# Examples per file of `indexed_files`: uneven, one file empty, most of them smaller than a
# batch of 256 (batches cross file boundaries).
FILE_SIZES = (3000, 0, 7, 4100, 55, 2500, 1, 337)


def indexed_files(directory, kind, sizes=FILE_SIZES, features=8, compression=""):
    """`indexed_arrays(sum(sizes))` written to files, `sizes[i]` examples in file `i`: TFRecord
    files of `tf.train.Example`s (`kind="tfrecord"`), or CSV files with a header line
    (`kind="csv"`: `index,x0,...,y`, every seventh line ending in CRLF), compressed with
    `compression` ("GZIP": names ending in `.gz`, "ZLIB": `.zz`). Returns the paths;
    `indexed_file_dataset` reads them."""
    import gzip
    import zlib

    import tensorflow as tf

    (x, index), y = indexed_arrays(sum(sizes), features)
    paths, start = [], 0
    os.makedirs(directory, exist_ok=True)
    example = tf.train.Example()  # One message, refilled per record: 40x faster than new ones.
    feature = example.features.feature
    xs, ids, ys = (feature["x"].float_list.value, feature["index"].int64_list.value,
                   feature["y"].float_list.value)
    xs.extend([0.0] * features)
    ids.append(0)
    ys.append(0.0)
    suffix = {"": "", "GZIP": ".gz", "ZLIB": ".zz"}[compression]
    for number, size in enumerate(sizes):
        rows = range(start, start + size)
        path = os.path.join(directory, f"part-{number:05d}.{kind}{suffix}")
        if kind == "tfrecord":
            with tf.io.TFRecordWriter(path, compression or None) as writer:
                for i in rows:
                    xs[:], ids[0], ys[0] = x[i].tolist(), i, float(y[i, 0])
                    writer.write(example.SerializeToString())
        else:
            lines = [",".join(["index", *(f"x{j}" for j in range(features)), "y"]) + "\n"]
            for i in rows:
                values = [str(i), *(repr(float(v)) for v in x[i]), repr(float(y[i, 0]))]
                lines.append(",".join(values) + ("\r\n" if i % 7 == 0 else "\n"))
            text = "".join(lines).encode()
            with tf.io.gfile.GFile(path, "wb") as f:
                f.write({"": bytes, "GZIP": gzip.compress, "ZLIB": zlib.compress}[compression](
                    text))
        paths.append(path)
        start += size
    return paths


def indexed_file_dataset(paths, batch_size, features=8, compression=""):
    """A reader of `indexed_files`' files as a user writes one, giving `((x, index), y)`
    batches as `indexed_arrays`: `TFRecordDataset` then `parse_example` on each batch, or
    `TextLineDataset(path).skip(1)` in `interleave` then `decode_csv` on each line, with the
    files' `compression`. `paths` may be a dataset of TFRecord files' names (`list_files`),
    read in `interleave`."""
    import tensorflow as tf

    if isinstance(paths, tf.data.Dataset) or ".tfrecord" in paths[0]:
        spec = {"x": tf.io.FixedLenFeature([features], tf.float32),
                "index": tf.io.FixedLenFeature([], tf.int64),
                "y": tf.io.FixedLenFeature([1], tf.float32)}

        def parse(records):
            parsed = tf.io.parse_example(records, spec)
            return (parsed["x"], parsed["index"]), parsed["y"]

        records = (paths.interleave(lambda path: tf.data.TFRecordDataset(path, compression),
                                    cycle_length=4)
                   if isinstance(paths, tf.data.Dataset)
                   else tf.data.TFRecordDataset(paths, compression))
        return records.batch(batch_size).map(parse).prefetch(2)

    def parse_line(line):
        fields = tf.io.decode_csv(line, [tf.constant(0, tf.int64)] + [0.0] * (features + 1))
        return (tf.stack(fields[1:-1]), fields[0]), tf.stack(fields[-1:])

    return tf.data.Dataset.from_tensor_slices(paths).interleave(
        lambda path: tf.data.TextLineDataset(path, compression).skip(1)).map(
        parse_line).batch(batch_size)
