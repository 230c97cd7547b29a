"""Where the time of consecutive kfit_ps `fit` calls goes, phase by phase.

The DLRM job of `dlrm_throughput.py` (same model, data and flags) on one
`LocalCluster`, `--fits` timed `fit`s of `--steps` steps in a row after a
20-step warm-up, as a user's loop of `fit` calls runs them. For each `fit`:

- `before`: from the call to `on_train_begin` (kfit_ps adapts the input:
  traces the dataset function, builds the per-worker datasets; TensorFlow
  registers the new functions with every worker and removes the previous
  `fit`'s as they are collected);
- `steps`: `on_train_begin` to the last batch's callback (kfit_ps runs a
  batch's callbacks when its function's result comes back, so this is the
  training itself);
- `join`: from there to `on_train_end`;
- `after`: `on_train_end` to the return of `fit`;

with steps/s over the whole call and how busy the cores were (`/proc/stat`).
A `fit` whose `before` or `after` takes seconds with the cores idle is the
"slow mode" of docs/benchmarks.md.

    python bench/fit_phases.py --fits 8 --json phases.json
"""

import argparse
import json
import os
import statistics
import sys
import time

import child_process
import dlrm_throughput

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

STALL_SECONDS = 1.0  # `before` or `after` longer than this counts as a stall.


def _idle_and_total():
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return ticks[3] + ticks[4], sum(ticks)  # idle + iowait, all


def timed_phases(model, data, steps):
    """One `fit` of `steps` steps: its phases in seconds, steps/s and the cores' busy share."""
    import keras

    marks = {}

    class Marks(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            marks["begin"] = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            marks["last_batch"] = time.perf_counter()

        def on_train_end(self, logs=None):
            marks["end"] = time.perf_counter()

    idle0, total0 = _idle_and_total()
    start = time.perf_counter()
    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[Marks()])
    done = time.perf_counter()
    idle1, total1 = _idle_and_total()
    return {"steps_per_s": steps / (done - start),
            "busy": 1 - (idle1 - idle0) / max(1, total1 - total0),
            "before": marks["begin"] - start,
            "steps": marks["last_batch"] - marks["begin"],
            "join": marks["end"] - marks["last_batch"],
            "after": done - marks["end"]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    dlrm_throughput.add_arguments(parser)
    parser.add_argument("--fits", type=int, default=8, help="timed fits in a row")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    import kfit_ps

    data_dir = dlrm_throughput.write_data(args)
    paths = sorted(os.path.join(data_dir, f) for f in os.listdir(data_dir))
    fits = []
    with kfit_ps.LocalCluster(num_workers=args.workers, num_ps=args.ps) as cluster:
        strategy = kfit_ps.ParameterServerStrategy(cluster.cluster_resolver,
                                                   **dlrm_throughput.kfit_strategy_args(args))
        model, data = dlrm_throughput.make_kfit(strategy, paths, args)
        dlrm_throughput.timed_fit(model, data, dlrm_throughput.WARMUP_STEPS)
        for i in range(args.fits):
            fits.append(timed_phases(model, data, args.steps))
            print(f"fit {i + 1}/{args.fits}: " + ", ".join(
                f"{k} {v:.2f}" for k, v in fits[-1].items()), flush=True)
        iterations = int(model.optimizer.iterations.numpy())
        del model, data
    stalls = [i for i, f in enumerate(fits) if max(f["before"], f["after"]) > STALL_SECONDS]
    result = {"config": {k: v for k, v in vars(args).items() if k != "data_dir"},
              "fits": fits, "stalled_fits": stalls, "iterations": iterations,
              "expected_iterations": dlrm_throughput.WARMUP_STEPS + args.fits * args.steps,
              "median_steps_per_s": {
                  "all": statistics.median(f["steps_per_s"] for f in fits),
                  "without_stalls": statistics.median(
                      [f["steps_per_s"] for i, f in enumerate(fits) if i not in stalls]
                      or [float("nan")])}}
    medians = json.dumps(result["median_steps_per_s"])
    print(f"fits with a stall of more than {STALL_SECONDS:.0f} s before or after training: "
          f"{len(stalls)} of {len(fits)}; median steps/s {medians}")
    print(f"optimizer.iterations == {result['expected_iterations']}: "
          f"{iterations == result['expected_iterations']}")
    child_process.write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
