"""Runs one benchmark measurement in a fresh Python process and reads its result back.

Each measurement of the scripts in `bench/` runs in its own process (its own
chief, its own LocalCluster), so no two contenders share a coordinator or
TensorFlow state. The child prints one line, `MARKER <json>`; `measure`
finds it. Used by the scripts as `from child_process import measure, report`
(they run with `bench/` as their directory).
"""

import json
import os
import subprocess
import sys

MARKER = "KFIT_PS_BENCH_RESULT "


def report(result):
    """In the child: hands `result` (JSON-serialisable) to the parent."""
    print(MARKER + json.dumps(result), flush=True)


def measure(script, child, argv, timeout=3600):
    """Runs `script argv --child child` and returns the result it reported."""
    proc = subprocess.run([sys.executable, script, *argv, "--child", child],
                          capture_output=True, text=True, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    raise RuntimeError(f"{child} measurement failed (exit {proc.returncode}):\n"
                       f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def run_if_child(args, run_child):
    """In a child (`--child` given): runs the measurement and exits at once.

    `os._exit`: the servers are gone, so TensorFlow's teardown would only log noise.
    """
    if args.child:
        run_child(args)
        sys.stdout.flush()
        os._exit(0)


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
