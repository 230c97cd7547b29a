"""Workers joining and leaving a running `fit` (`kfit-ps scale`): join time, steps/s, steps lost.

One supervised job (`kfit-ps run --workers 2 --ps 1`; a 32-512-512-1 dense model, batch 256,
epochs of 500 steps) trains while this script alternates its worker count: 2, 4, 2, 4, 2,
each phase `--phase-seconds` long. It measures:

- the time from `kfit-ps scale --workers 4` to each new worker's first finished function,
  and from its server answering (`worker_ready` event) to that function (`first_step`);
- steps/s in each phase (from `optimizer.iterations` at each epoch end, the first 3 s of a
  phase left out), and the ratio of each 4-worker phase to the 2-worker phase before it;
- steps lost by the graceful removals: the job ends with `iterations` = epochs x 500.

    python bench/elastic_workers.py --phase-seconds 20 --json elastic.json

On a 2-core machine four workers share the cores two already use: the ratio shows the
coordination cost, not the gain that a host with the cores for them gives.
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
STEPS_PER_EPOCH = 500

JOB = textwrap.dedent(f"""
    import json, os, sys, time
    import keras, kfit_ps, tensorflow as tf

    stop_file = sys.argv[1]

    def dataset_fn(input_context):
        x = tf.random.stateless_normal((4096, 32), seed=(1, 2))
        y = tf.reduce_sum(x, axis=1, keepdims=True)
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(256)

    strategy = kfit_ps.ParameterServerStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile("adam", "mse", steps_per_execution=5)

    class Steps(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            print("STEP", int(self.model.optimizer.iterations.numpy()), time.time(), flush=True)
            self.model.stop_training = os.path.exists(stop_file)

    history = model.fit(kfit_ps.DatasetCreator(dataset_fn), epochs=100000,
                        steps_per_epoch={STEPS_PER_EPOCH}, verbose=0, callbacks=[Steps()])
    print("RESULT", json.dumps({{"iterations": int(model.optimizer.iterations.numpy()),
                                "epochs": len(history.history["loss"])}}), flush=True)
""")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase-seconds", type=float, default=20.0)
    parser.add_argument("--json", default=None, help="also write the results here")
    return parser.parse_args()


def wait_event(run_dir, predicate, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [e for e in child_process.events(run_dir) if predicate(e)]
        if found:
            return found[-1]
        time.sleep(0.2)
    raise TimeoutError("event not seen")


def main():
    args = parse_args()
    plan = [2, 4, 2, 4, 2]
    with tempfile.TemporaryDirectory(prefix="kfit_ps-elastic-") as workdir:
        script, stop_file = os.path.join(workdir, "job.py"), os.path.join(workdir, "stop")
        with open(script, "w") as f:
            f.write(JOB)
        run_dir = os.path.join(workdir, "run")
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        log = open(os.path.join(workdir, "out.txt"), "w+")
        proc = subprocess.Popen(
            [sys.executable, "-m", "kfit_ps.cli.main", "run", "--workers", "2", "--ps", "1",
             "--run-dir", run_dir, "--", sys.executable, script, stop_file],
            stdout=log, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        sys.path.insert(0, ROOT)
        from kfit_ps import membership

        phases, joins = [], []
        try:
            wait_event(run_dir, lambda e: e["event"] == "fit_begin", 300)
            time.sleep(5)  # The first epoch traces the functions.
            for number, workers in enumerate(plan):
                if number:
                    requested = time.time()
                    membership.request_scale(run_dir, workers)
                    applied = wait_event(run_dir, lambda e, n=workers: e["event"] == "workers"
                                         and e["workers"] == n and e["time"] > requested)
                    if workers == 4:
                        for task in ("worker:2", "worker:3"):
                            first = wait_event(run_dir, lambda e, t=task: e["event"] ==
                                               "first_step" and e["task"] == t
                                               and e["time"] > requested)
                            ready = wait_event(run_dir, lambda e, t=task: e["event"] ==
                                               "worker_ready" and e["task"] == t
                                               and e["time"] > requested)
                            joins.append({"from_request": first["time"] - requested,
                                          "from_server_ready": first["time"] - ready["time"]})
                    start = applied["time"] + 3
                else:
                    start = time.time()
                phases.append((workers, start, start + args.phase_seconds))
                time.sleep(max(0.0, start + args.phase_seconds - time.time()))
            open(stop_file, "w").close()
            proc.wait(300)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        log.seek(0)
        lines = log.read().splitlines()
    steps = [(float(x.split()[3]), int(x.split()[2])) for x in lines
             if x.startswith("[chief] STEP ")]
    [result] = [json.loads(x.split("RESULT ", 1)[1]) for x in lines
                if x.startswith("[chief] RESULT ")]
    rates = []
    for workers, start, end in phases:
        inside = [(t, s) for t, s in steps if start <= t <= end]
        rate = ((inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])
                if len(inside) >= 2 else None)
        rates.append({"workers": workers, "steps_per_second": rate})
        print(f"{workers} workers: {rate and round(rate, 1)} steps/s", flush=True)
    ratios = [b["steps_per_second"] / a["steps_per_second"] for a, b in zip(rates, rates[1:])
              if b["workers"] == 4 and a["steps_per_second"] and b["steps_per_second"]]
    lost = result["epochs"] * STEPS_PER_EPOCH - result["iterations"]
    out = {"join_seconds_from_request": [round(j["from_request"], 2) for j in joins],
           "join_seconds_from_server_ready": [round(j["from_server_ready"], 2) for j in joins],
           "phases": rates, "ratio_4_to_2": [round(r, 3) for r in ratios],
           "median_ratio_4_to_2": statistics.median(ratios) if ratios else None,
           "steps_lost": lost, "iterations": result["iterations"], "cores": os.cpu_count()}
    print(json.dumps(out, indent=2))
    child_process.write_json(args.json, out)


if __name__ == "__main__":
    main()
