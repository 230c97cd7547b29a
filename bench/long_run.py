"""A long epoch: coordinator memory and step rate at its start and at its end.

One `fit` of `--steps` steps (default 20,000) in a single epoch, on a
`LocalCluster` of 2 workers + 1 ps, of a small MLP with an AUC metric (200
thresholds: every scheduled function returns about 3 KB of metric state).
A sampler thread reads the optimizer's step counter on the ps and the
chief's resident memory every `--interval` seconds; from those samples the
script reports the steps/s over the first and the last `--window` steps
(1,000) and the chief's RSS after the first window and at the end.

`--pending N` sets `KFIT_PS_METRIC_RESULTS_PENDING` (how many finished
functions' results the coordinator keeps before folding the oldest);
`--compare` runs the default and a run that keeps every result until the
epoch's end (the behaviour before results were folded), in fresh processes.

    python bench/long_run.py --compare --json long_run.json     # docs/benchmarks.md
"""

import argparse
import os
import sys
import threading
import time

import child_process

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

WINDOW = 1000


def dataset_fn(input_context):
    import tensorflow as tf

    x = tf.random.stateless_normal((4096, 16), seed=(1, 2))
    y = tf.cast(tf.reduce_sum(x[:, :4], axis=1, keepdims=True) > 0, tf.float32)
    return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(4096).repeat().batch(64)


def _rate(samples, first, last):
    """Steps/s between the times the counter passed `first` and `last` (interpolated)."""
    def time_at(step):
        for (t0, s0, _), (t1, s1, _) in zip(samples, samples[1:]):
            if s0 <= step <= s1 and s1 > s0:
                return t0 + (t1 - t0) * (step - s0) / (s1 - s0)
        raise ValueError(f"no samples around step {step}")

    return (last - first) / (time_at(last) - time_at(first))


def run_child(args):
    import keras
    import psutil

    import kfit_ps

    me = psutil.Process()
    with kfit_ps.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = kfit_ps.ParameterServerStrategy(cluster.cluster_resolver)
        with strategy.scope():
            model = keras.Sequential([keras.Input((16,)),
                                      keras.layers.Dense(32, activation="relu"),
                                      keras.layers.Dense(1, activation="sigmoid")])
            model.compile(optimizer="adam", loss="binary_crossentropy",
                          metrics=[keras.metrics.AUC(name="auc")])
        data = kfit_ps.DatasetCreator(dataset_fn)
        model.fit(data, epochs=1, steps_per_epoch=20, verbose=0)  # tracing, datasets
        iterations = model.optimizer.iterations
        start = int(iterations.numpy())
        samples, stop = [], threading.Event()

        def sample():
            while not stop.is_set():
                samples.append((time.monotonic(), int(iterations.numpy()) - start,
                                me.memory_info().rss))
                stop.wait(args.interval)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        began = time.monotonic()
        model.fit(data, epochs=1, steps_per_epoch=args.steps, verbose=0)
        seconds = time.monotonic() - began
        stop.set()
        sampler.join()
        samples.append((time.monotonic(), int(iterations.numpy()) - start,
                        me.memory_info().rss))
        rss_after_first = next(r for _, s, r in samples if s >= args.window)
        child_process.report({
            "steps": int(iterations.numpy()) - start,
            "seconds": seconds,
            "window": args.window,
            "first_steps_per_s": _rate(samples, 0, args.window),
            "last_steps_per_s": _rate(samples, args.steps - args.window, args.steps),
            "rss_mb_after_first": rss_after_first / 2**20,
            "rss_mb_end": samples[-1][2] / 2**20,
            "rss_mb_peak": max(r for _, _, r in samples) / 2**20,
        })


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--window", type=int, default=WINDOW,
                        help="steps of the first and the last window, whose steps/s are reported")
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--pending", type=int, default=None)
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if not 1 <= args.window <= args.steps:
        parser.error(f"--window: received {args.window} for --steps {args.steps}; expected "
                     "1 to --steps (the first and the last window are both within the epoch)")
    if args.child:
        if args.pending:
            os.environ["KFIT_PS_METRIC_RESULTS_PENDING"] = str(args.pending)
        child_process.run_if_child(args, run_child)

    runs = {"default": [a for a in argv if a != "--compare"]}
    if args.compare:
        runs["every result kept until the end"] = runs["default"] + [
            "--pending", str(10 * args.steps)]
    results = {}
    for name, child_argv in runs.items():
        r = child_process.measure(os.path.abspath(__file__), "run", child_argv, timeout=7200)
        results[name] = r
        print(f"{name}: {r['steps']} steps in {r['seconds']:.0f} s; steps/s first {args.window} "
              f"{r['first_steps_per_s']:.1f}, last {args.window} {r['last_steps_per_s']:.1f} "
              f"(ratio {r['last_steps_per_s'] / r['first_steps_per_s']:.2f}); chief RSS "
              f"{r['rss_mb_after_first']:.0f} MB after {args.window} steps, "
              f"{r['rss_mb_end']:.0f} MB at the end (growth "
              f"{r['rss_mb_end'] - r['rss_mb_after_first']:+.0f} MB, peak "
              f"{r['rss_mb_peak']:.0f} MB)", flush=True)
    child_process.write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
