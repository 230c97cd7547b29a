"""Recovery time of a `kfit-ps run` job, per failure kind, and ps memory over chief restarts.

One supervised job (2 workers, 1 ps, a small dense model, `--backup-dir` with a backup every
`--save-freq` steps, `--ps-recovery restart`: a ps loss restarts the job) prints `STEP <iterations> <unix time>` at every synchronisation. This
script SIGKILLs one task at a time, after the job has made progress, and measures the time
from the kill to the first finished step after it (the next `STEP` line stamped after the
kill). Kinds alternate (worker, ps, chief, worker, ...) and each is repeated `--repeats`
times; the medians are reported. It also records the ps task's resident memory each time the
job trains again after a chief kill (the ps is restarted with the chief: it must not hold
the variables of dead chiefs).

    python bench/recovery.py --repeats 3 --json recovery.json

On a 2-core machine the ps and chief figures are dominated by starting processes and
importing TensorFlow (the servers and the new chief start at the same time).
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

import psutil

import child_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

JOB = textwrap.dedent("""
    import sys, time
    import keras, kfit_ps, tensorflow as tf

    def dataset_fn(input_context):
        x = tf.random.stateless_normal((1024, 16), seed=(1, 2))
        y = tf.reduce_sum(x, axis=1, keepdims=True)
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(1024).repeat().batch(64)

    strategy = kfit_ps.ParameterServerStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile("adam", "mse", steps_per_execution=5)

    class Steps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if logs:
                print("STEP", int(self.model.optimizer.iterations.numpy()), time.time(),
                      flush=True)

    model.fit(kfit_ps.DatasetCreator(dataset_fn), epochs=1000, steps_per_epoch=1000,
              verbose=0, callbacks=[Steps()])
""")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="kills of each kind")
    parser.add_argument("--save-freq", type=int, default=10)
    parser.add_argument("--warmup-steps", type=int, default=100,
                        help="steps of progress before each kill")
    parser.add_argument("--json", default=None, help="also write the results here")
    return parser.parse_args()


class Job:
    def __init__(self, workdir, save_freq, max_restarts):
        script = os.path.join(workdir, "job.py")
        with open(script, "w") as f:
            f.write(JOB)
        self.run_dir = os.path.join(workdir, "run")
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kfit_ps.cli.main", "run", "--workers", "2", "--ps", "1",
             "--run-dir", self.run_dir, "--backup-dir", os.path.join(workdir, "backup"),
             "--save-freq", str(save_freq), "--max-restarts", str(max_restarts),
             "--ps-recovery", "restart", "--",
             sys.executable, script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env=env, start_new_session=True)

    def next_step(self, timeout=300):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("the job ended")
            if line.startswith("[chief] STEP "):
                _, _, step, stamp = line.split()
                return int(step), float(stamp)
        raise TimeoutError("no step")

    def tasks(self):
        for _ in range(100):
            try:
                with open(os.path.join(self.run_dir, "tasks.json")) as f:
                    return json.load(f)["tasks"]
            except (OSError, ValueError):
                time.sleep(0.05)
        raise RuntimeError("no tasks.json")

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def main():
    args = parse_args()
    kinds = {"worker": "worker:0", "ps": "ps:0", "chief": "chief:0"}
    times = {kind: [] for kind in kinds}
    ps_rss_mb = []
    with tempfile.TemporaryDirectory(prefix="kfit_ps-recovery-") as workdir:
        job = Job(workdir, args.save_freq, max_restarts=2 * args.repeats + 2)
        try:
            for _ in range(args.repeats):
                for kind, task in kinds.items():
                    start, _ = job.next_step()
                    step = start
                    while step < start + args.warmup_steps:
                        step, _ = job.next_step()
                    victim = job.tasks()[task]
                    killed_at = time.time()
                    os.kill(victim, signal.SIGKILL)
                    while True:
                        step, stamp = job.next_step()
                        if stamp > killed_at:
                            break
                    times[kind].append(stamp - killed_at)
                    print(f"{kind}: {stamp - killed_at:.2f} s from SIGKILL to the next step",
                          flush=True)
                    if kind == "chief":
                        ps_rss_mb.append(psutil.Process(job.tasks()["ps:0"]).memory_info().rss
                                         / 2**20)
        finally:
            job.stop()
    result = {"seconds": times,
              "median_seconds": {k: statistics.median(v) for k, v in times.items()},
              "ps_rss_mb_after_each_chief_restart": [round(x, 1) for x in ps_rss_mb],
              "save_freq": args.save_freq, "cores": os.cpu_count()}
    print(json.dumps(result, indent=2))
    child_process.write_json(args.json, result)


if __name__ == "__main__":
    main()
