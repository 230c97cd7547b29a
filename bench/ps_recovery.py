"""A lost ps: restored in place against a whole-job restart, side by side; DLRM quality after it.

Downtime: one supervised job (`kfit-ps run --workers 2 --ps 2 --backup-dir B --save-freq
100`; an `Embedding(rows, 64)` sharded over the 2 ps, Dense 16-1, Adam) prints `STEP
<iterations> <time>` at each synchronisation (every 10 steps). At step 150 (no step in
flight) a callback SIGKILLs ps:1. Downtime = from the SIGKILL to the first `STEP` stamped
after it. `--ps-recovery in-place` and `--ps-recovery restart` alternate, `--repeats` times
each, for a small table (20,000 rows) and a 512 MiB one (2,097,152 rows).

Quality: the DLRM main job (`kfit-ps quickstart`, 3 epochs x 100 steps) under `kfit-ps run
--backup-dir B --save-freq 50`, with ps:1 SIGKILLed right after the first backup (restored in
place), against the same job without a failure; held-out AUC of each, alternating.

    python bench/ps_recovery.py --repeats 2 --dlrm-repeats 2 --json ps_recovery.json
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

import child_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

JOB = textwrap.dedent("""
    import json, os, signal, sys, time
    import keras, kfit_ps
    import tensorflow as tf

    rows = int(sys.argv[1])

    class Steps(kfit_ps.callbacks.SyncCallback):
        sync_every = 10
        def on_train_sync(self, epoch, step, logs):
            at = epoch * 100 + step
            print("STEP", at, time.time(), flush=True)
            if at == 150 and not os.path.exists(sys.argv[2]):
                open(sys.argv[2], "w").close()
                with open(os.path.join(os.environ["KFIT_PS_RUN_DIR"], "tasks.json")) as f:
                    pid = json.load(f)["tasks"]["ps:1"]
                os.kill(pid, signal.SIGKILL)
                print("KILLED", time.time(), flush=True)

    strategy = kfit_ps.ParameterServerStrategy(
        variable_partitioner=kfit_ps.partitioners.MinSizePartitioner(
            min_shard_bytes=64 << 10, max_shards=2))
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,), dtype="int32"),
                                  keras.layers.Embedding(rows, 64), keras.layers.Flatten(),
                                  keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile("adam", "mse", steps_per_execution=5)

    def data(context):
        ids = tf.random.stateless_uniform((4096, 8), seed=(1, 2), maxval=rows, dtype=tf.int32)
        y = tf.cast(tf.reduce_sum(ids % 5, axis=1, keepdims=True), tf.float32) / 10.0
        return tf.data.Dataset.from_tensor_slices((ids, y)).repeat().batch(64)

    model.fit(kfit_ps.DatasetCreator(data), epochs=3, steps_per_epoch=100, verbose=0,
              callbacks=[Steps()])
""")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="downtime runs per mode and size")
    parser.add_argument("--dlrm-repeats", type=int, default=2, help="AUC runs per contender")
    parser.add_argument("--json", default=None, help="also write the results here")
    return parser.parse_args()


def _env():
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def downtime(rows, mode):
    """Seconds from the SIGKILL of ps:1 to the first synchronisation after it."""
    with tempfile.TemporaryDirectory(prefix="kfit_ps-psrec-") as workdir:
        script = os.path.join(workdir, "job.py")
        with open(script, "w") as f:
            f.write(JOB)
        out = subprocess.run(
            [sys.executable, "-m", "kfit_ps.cli.main", "run", "--workers", "2", "--ps", "2",
             "--run-dir", os.path.join(workdir, "run"), "--backup-dir",
             os.path.join(workdir, "backup"), "--save-freq", "100", "--ps-recovery", mode, "--",
             sys.executable, script, str(rows), os.path.join(workdir, "killed")],
            capture_output=True, text=True, env=_env(), timeout=1800).stdout
    killed = [float(x.split()[2]) for x in out.splitlines() if x.startswith("[chief] KILLED ")]
    steps = [float(x.split()[3]) for x in out.splitlines() if x.startswith("[chief] STEP ")]
    after = [t for t in steps if killed and t > killed[0]]
    if not killed or not after:
        raise RuntimeError(f"no kill or no step after it ({mode}, {rows} rows):\n{out[-3000:]}")
    return after[0] - killed[0]


def dlrm_auc(kill):
    """Held-out AUC of the main job; with `kill`, ps:1 dies right after the first backup."""
    with tempfile.TemporaryDirectory(prefix="kfit_ps-psrec-dlrm-") as workdir:
        run_dir = os.path.join(workdir, "run")
        proc = subprocess.Popen(
            [sys.executable, "-m", "kfit_ps.cli.main", "run", "--workers", "2", "--ps", "2",
             "--run-dir", run_dir, "--backup-dir", os.path.join(workdir, "backup"),
             "--save-freq", "50", "--", sys.executable, "-m", "kfit_ps.cli.main", "quickstart",
             "--verbose", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=_env(), start_new_session=True)
        if kill:
            while not any(e["event"] == "backup" for e in child_process.events(run_dir)):
                if proc.poll() is not None:
                    break
                time.sleep(0.1)
            with open(os.path.join(run_dir, "tasks.json")) as f:
                os.kill(json.load(f)["tasks"]["ps:1"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=1800)
        restored = [e for e in child_process.events(run_dir) if e["event"] == "ps_restored"]
        restarted = [e for e in child_process.events(run_dir) if e["event"] == "job_restart"]
    line = [x for x in out.splitlines() if "held-out: auc=" in x]
    if not line or (kill and (len(restored) != 1 or restarted)):
        raise RuntimeError(f"the DLRM job did not recover in place:\n{out[-3000:]}")
    return float(line[-1].split("auc=")[1].split()[0])


def main():
    args = parse_args()
    sizes = {"20,000 rows": 20_000, "512 MiB table": 2 * 1024 * 1024}
    seconds = {f"{size}, {mode}": [] for size in sizes for mode in ("in-place", "restart")}
    for _ in range(args.repeats):
        for size, rows in sizes.items():
            for mode in ("in-place", "restart"):
                value = downtime(rows, mode)
                seconds[f"{size}, {mode}"].append(round(value, 2))
                print(f"{size}, {mode}: {value:.1f} s from SIGKILL to the next step", flush=True)
    auc = {"no failure": [], "one in-place ps recovery": []}
    for _ in range(args.dlrm_repeats):
        for name, kill in (("no failure", False), ("one in-place ps recovery", True)):
            auc[name].append(dlrm_auc(kill))
            print(f"DLRM {name}: held-out AUC {auc[name][-1]:.4f}", flush=True)
    result = {"seconds": seconds,
              "median_seconds": {k: statistics.median(v) for k, v in seconds.items()},
              "auc": auc, "median_auc": {k: statistics.median(v) for k, v in auc.items() if v},
              "cores": os.cpu_count()}
    print(json.dumps(result, indent=2))
    child_process.write_json(args.json, result)


if __name__ == "__main__":
    main()
