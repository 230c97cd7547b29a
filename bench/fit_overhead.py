"""Steady-state `fit` speed: kfit_ps (Keras 3) vs tf_keras's own PS `model.fit` (Keras 2).

Both train the same model (same layers, optimizer, loss, metric, batch size,
input pipeline) on the same cluster shape, in alternating repeats within one
run of this script. Each repeat is a fresh chief process with its own
LocalCluster (two coordinators sharing servers in one process disturb each
other's timings), which times one `fit` call of `--epochs` x `--steps` after a
warm-up fit (tracing and dataset creation are excluded). Prints steps/s for
both, the per-repeat ratios and the median ratio (kfit_ps / tf_keras; >= 1.0
means kfit_ps is at least as fast).

    python bench/fit_overhead.py                      # defaults used in docs/benchmarks.md
    python bench/fit_overhead.py --steps-per-execution 10 --repeats 3
"""

import argparse
import os
import statistics
import sys
import time

import child_process

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

CONTENDERS = ("kfit_ps", "tf_keras")


def dataset_fn_for(features, batch_size):
    import tensorflow as tf

    def dataset_fn(input_context):
        x = tf.random.stateless_normal((4096, features), seed=(1, 2))
        y = tf.reduce_sum(x[:, :8], axis=1, keepdims=True)
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(4096).repeat()
        return dataset.batch(batch_size).prefetch(2)

    return dataset_fn


def build(layers_module, features, hidden):
    inputs = layers_module.Input((features,))
    x = layers_module.Dense(hidden, activation="relu")(inputs)
    x = layers_module.Dense(hidden, activation="relu")(x)
    return inputs, layers_module.Dense(1)(x)


def make_kfit(cluster, args):
    import keras

    import kfit_ps

    strategy = kfit_ps.ParameterServerStrategy(cluster.cluster_resolver)
    with strategy.scope():
        inputs, outputs = build(keras.layers, args.features, args.hidden)
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", metrics=["mae"],
                      steps_per_execution=args.steps_per_execution)
    data = kfit_ps.DatasetCreator(dataset_fn_for(args.features, args.batch_size))
    return model, data


def make_tf_keras(cluster, args):
    import tensorflow as tf
    import tf_keras

    strategy = tf.distribute.ParameterServerStrategy(cluster.cluster_resolver)
    with strategy.scope():
        inputs, outputs = build(tf_keras.layers, args.features, args.hidden)
        model = tf_keras.Model(inputs, outputs)
        model.compile(optimizer=tf_keras.optimizers.Adam(1e-3), loss="mse", metrics=["mae"],
                      steps_per_execution=args.steps_per_execution)
    data = tf_keras.utils.experimental.DatasetCreator(
        dataset_fn_for(args.features, args.batch_size))
    return model, data


def timed_fit(model, data, epochs, steps):
    start = time.perf_counter()
    model.fit(data, epochs=epochs, steps_per_epoch=steps, verbose=0)
    return epochs * steps / (time.perf_counter() - start)


def _cpu_seconds(cluster, args):
    """User + system CPU seconds of this process (the chief) and of each server process."""
    pids = {"chief": os.getpid()}
    for kind, count in (("worker", args.workers), ("ps", args.ps)):
        pids.update({f"{kind}:{i}": cluster.pid(kind, i) for i in range(count)})
    return {name: child_process.cpu_seconds(pid) for name, pid in pids.items()}


def run_child(args):
    """One measurement in this process; reports its steps/s, final iterations and the CPU ms
    per step of the chief, the workers and the ps tasks over the timed `fit`."""
    import kfit_ps

    make = {"kfit_ps": make_kfit, "tf_keras": make_tf_keras}[args.child]
    with kfit_ps.LocalCluster(num_workers=args.workers, num_ps=args.ps) as cluster:
        model, data = make(cluster, args)
        timed_fit(model, data, 1, 20)  # warm-up: tracing, datasets, first steps
        before = _cpu_seconds(cluster, args)
        rate = timed_fit(model, data, args.epochs, args.steps)
        after = _cpu_seconds(cluster, args)
        iterations = int(model.optimizer.iterations.numpy())
        del model, data
    steps = args.epochs * args.steps
    cpu = {name: 1000 * (after[name] - before[name]) / steps for name in before}
    child_process.report({"steps_per_s": rate, "iterations": iterations,
                          "cpu_ms_per_step": cpu})


def measure(child, argv):
    return child_process.measure(os.path.abspath(__file__), child, argv, timeout=1800)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300, help="steps per epoch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps-per-execution", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--child", choices=CONTENDERS, default=None, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    child_process.run_if_child(args, run_child)

    rates = {name: [] for name in CONTENDERS}
    iterations = {name: [] for name in CONTENDERS}
    cpu = {name: [] for name in CONTENDERS}
    for repeat in range(args.repeats):
        order = CONTENDERS if repeat % 2 == 0 else tuple(reversed(CONTENDERS))
        for name in order:
            result = measure(name, argv)
            rates[name].append(result["steps_per_s"])
            iterations[name].append(result["iterations"])
            cpu[name].append(result["cpu_ms_per_step"])
        print(f"repeat {repeat + 1}/{args.repeats}: "
              + ", ".join(f"{n} {rates[n][-1]:.1f} steps/s" for n in CONTENDERS), flush=True)
    ratios = [k / t for k, t in zip(rates["kfit_ps"], rates["tf_keras"])]
    expected = 20 + args.epochs * args.steps
    result = {
        "config": vars(args),
        "steps_per_s": {n: statistics.median(r) for n, r in rates.items()},
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "expected_iterations": expected,
        "iterations": iterations,
        # CPU ms per step by process (chief, worker:i, ps:i), medians over the repeats.
        "cpu_ms_per_step": {n: {task: statistics.median(r[task] for r in runs)
                                for task in runs[0]} for n, runs in cpu.items()},
    }
    print(f"kfit_ps {result['steps_per_s']['kfit_ps']:.1f} steps/s, tf_keras "
          f"{result['steps_per_s']['tf_keras']:.1f} steps/s (medians); ratio kfit_ps/tf_keras: "
          f"median {result['median_ratio']:.3f}, per repeat "
          f"{', '.join(f'{r:.3f}' for r in ratios)}")
    for name, tasks in result["cpu_ms_per_step"].items():
        print(f"{name} CPU ms per step (medians): {sum(tasks.values()):.2f} in all; "
              + ", ".join(f"{task} {ms:.2f}" for task, ms in tasks.items()))
    exact = {n: all(i == expected for i in its) for n, its in iterations.items()}
    print(f"optimizer.iterations == {expected} after every run: {exact}")
    child_process.write_json(args.json, result)


if __name__ == "__main__":
    main()
