"""Runs one benchmark measurement in a fresh Python process and reads its result back.

Each measurement of the scripts in `bench/` runs in its own process (its own
chief, its own LocalCluster), so no two contenders share a coordinator or
TensorFlow state. The child prints one line, `MARKER <json>`; `measure`
finds it. Used by the scripts as `from child_process import measure, report`
(they run with `bench/` as their directory).

`KFIT_PS_BENCH_ONE_PROCESS=1` (the tests' smoke runs, `tests/test_bench.py`)
runs the measurements a script marks as able to (`measure(..., run=...)`) in
the script's own process instead, on one `LocalCluster` and strategy shared by
them (`local_cluster`): one TensorFlow import and one cluster per script.
Their timings then share a process and are not comparable; the script says so.
"""

import contextlib
import json
import os
import subprocess
import sys

MARKER = "KFIT_PS_BENCH_RESULT "
ONE_PROCESS_ENV = "KFIT_PS_BENCH_ONE_PROCESS"

_in_process = []  # the results of the measurement running in this process (one process)
_shared = {}  # one process: "cluster" -> ((workers, ps), LocalCluster, strategy)


def one_process():
    """Whether measurements that can run in this process do (`ONE_PROCESS_ENV`)."""
    return os.environ.get(ONE_PROCESS_ENV, "") == "1"


def report(result):
    """In the child: hands `result` (JSON-serialisable) to the parent."""
    if _in_process:
        _in_process[-1].append(result)
        return
    print(MARKER + json.dumps(result), flush=True)


def measure(script, child, argv, timeout=3600, run=None):
    """Runs `script argv --child child` and returns the result it reported.

    `run()`, when given, is the same measurement as a call in this process: under
    `one_process()` it runs here instead of in a fresh process.
    """
    if run is not None and one_process():
        if not _shared.get("said"):
            _shared["said"] = True
            print(f"({ONE_PROCESS_ENV}=1: measurements share this process and its cluster; "
                  "their timings are not comparable)", flush=True)
        _in_process.append([])
        try:
            run()
        finally:
            results = _in_process.pop()
        if len(results) != 1:
            raise RuntimeError(f"{child} measurement reported {len(results)} results, not 1")
        return results[0]
    proc = subprocess.run([sys.executable, script, *argv, "--child", child],
                          capture_output=True, text=True, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    raise RuntimeError(f"{child} measurement failed (exit {proc.returncode}):\n"
                       f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


@contextlib.contextmanager
def local_cluster(num_workers, num_ps, **strategy_args):
    """`(cluster, strategy)` for one measurement: a fresh `LocalCluster` and its strategy
    (`kfit_ps.ParameterServerStrategy(resolver, **strategy_args)`), stopped at the end; in one
    process, the process' cluster and strategy, made by its first measurement and stopped at
    exit (a measurement that asks for another shape or other strategy arguments is refused)."""
    import kfit_ps

    if not _in_process:  # (a measurement in a process of its own, or no `measure` at all)
        with kfit_ps.LocalCluster(num_workers=num_workers, num_ps=num_ps) as cluster:
            yield cluster, kfit_ps.ParameterServerStrategy(cluster.cluster_resolver,
                                                           **strategy_args)
        return
    shape = (num_workers, num_ps, {k: (type(v).__name__, vars(v) if hasattr(v, "__dict__")
                                       else v) for k, v in strategy_args.items()})
    if "cluster" not in _shared:
        import atexit

        cluster = kfit_ps.LocalCluster(num_workers=num_workers, num_ps=num_ps).start()
        atexit.register(cluster.stop)
        _shared["cluster"] = (shape, cluster, kfit_ps.ParameterServerStrategy(
            cluster.cluster_resolver, **strategy_args))
    made, cluster, strategy = _shared["cluster"]
    if made != shape:
        raise RuntimeError(f"{ONE_PROCESS_ENV}=1: this process' cluster and strategy are "
                           f"{made}, a measurement asked for {shape}; run it in a process of "
                           "its own (no `run=`)")
    yield cluster, strategy


@contextlib.contextmanager
def contender_cluster(tf_keras, num_workers, num_ps, **strategy_args):
    """`(cluster, strategy)` for a contender: tf_keras' (`tf_keras` true) gets a `LocalCluster`
    of its own and makes its own strategy (None here: one strategy per process, so it always
    runs in a process of its own); kfit_ps' get `local_cluster`'s."""
    if tf_keras:
        import kfit_ps

        with kfit_ps.LocalCluster(num_workers=num_workers, num_ps=num_ps) as cluster:
            yield cluster, None
    else:
        with local_cluster(num_workers, num_ps, **strategy_args) as cluster_and_strategy:
            yield cluster_and_strategy


def run_if_child(args, run_child):
    """In a child (`--child` given): runs the measurement and exits at once.

    `os._exit`: the servers are gone, so TensorFlow's teardown would only log noise.
    """
    if args.child:
        run_child(args)
        sys.stdout.flush()
        os._exit(0)


def cpu_seconds(pid):
    """User + system CPU seconds of process `pid` so far (`/proc/PID/stat`)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def write_json(path, result):
    """Writes `result` to `path` when the script was given `--json`."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def events(run_dir):
    """The event log (`events.jsonl`) of a `kfit-ps run` job so far; [] before it exists."""
    try:
        with open(os.path.join(run_dir, "events.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    except OSError:
        return []
