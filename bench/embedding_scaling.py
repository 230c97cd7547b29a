"""Sharded embeddings: step cost follows the rows touched, not the table size.

Four measurements, each in fresh chief processes with their own LocalCluster
(2 workers, 2 ps, every table in 2 shards via FixedShardsPartitioner(2)):

1. **Table size**: steady-state step time with a `--small-rows` (20K) table vs a
   `--large-rows` (2M) table, same batch of ids (Zipf over 20K base ids, spread
   over the whole table with a stride), same shards. Target: ratio <= 1.3.
2. **Coordinator memory**: peak RSS of the chief while it creates the large
   table (and its Adam slots) vs its RSS just before. Target: peak below
   1.5 x baseline + 100 MB (the table alone is rows x dim x 4 bytes).
3. **Speed vs tf_keras**: examples/s of the same model (Embedding -> mean over
   the ids of an example -> Dense -> Dense, Adam, same data, same shards) with
   kfit_ps `model.fit` and with tf_keras's PS `model.fit`. Target: ratio >= 1.0.
4. **Bytes per step**: loopback bytes during the timed kfit_ps run per step,
   against the minimum `S = 4*P + U*(4*D + 8)` each way (P dense parameters, U
   unique ids per batch, D embedding dimension), and the bytes/s reached as a
   fraction of the loopback bandwidth gRPC reaches on this machine (a large
   variable read from a ps).

    python bench/embedding_scaling.py                 # the defaults in docs/benchmarks.md
    python bench/embedding_scaling.py --large-rows 200000 --steps 50   # quick
"""

import argparse
import os
import sys
import threading
import time

import child_process

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

BASE_IDS = 20_000


def batches(rows, args, seed=0):
    """Numpy (ids [N, F], labels [N, 1]): Zipf over BASE_IDS (at most `--small-rows`) base
    ids, spread over `rows` with a stride."""
    import numpy as np

    rng = np.random.default_rng(seed)
    n = 64 * args.batch_size
    base_ids = min(BASE_IDS, args.small_rows)  # the same base ids for both table sizes
    base = (rng.zipf(1.1, (n, args.ids_per_example)) - 1) % base_ids
    ids = base * max(1, rows // base_ids)
    labels = (np.sin(base[:, 0] * 0.618) > 0).astype("float32")[:, None]
    return ids.astype("int64"), labels


def dataset_fn_for(rows, args):
    def dataset_fn(input_context):
        import tensorflow as tf

        ids, labels = batches(rows, args)
        return tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(
            args.batch_size).prefetch(2)

    return dataset_fn


def build(layers, rows, args):
    ids = layers.Input((args.ids_per_example,), dtype="int64")
    x = layers.Embedding(rows, args.dim)(ids)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dense(args.hidden, activation="relu")(x)
    return ids, layers.Dense(1, activation="sigmoid")(x)


def make_kfit(strategy, rows, args):
    import keras

    import kfit_ps

    with strategy.scope():
        model = keras.Model(*build(keras.layers, rows, args))
        model.compile(keras.optimizers.Adam(1e-3), "binary_crossentropy",
                      steps_per_execution=args.steps_per_execution)
    return model, kfit_ps.DatasetCreator(dataset_fn_for(rows, args))


def make_tf_keras(cluster, rows, args):
    import tensorflow as tf
    import tf_keras

    strategy = tf.distribute.ParameterServerStrategy(
        cluster.cluster_resolver,
        variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(
            args.shards))
    with strategy.scope():
        model = tf_keras.Model(*build(tf_keras.layers, rows, args))
        model.compile(tf_keras.optimizers.Adam(1e-3), "binary_crossentropy",
                      steps_per_execution=args.steps_per_execution)
    return model, tf_keras.utils.experimental.DatasetCreator(dataset_fn_for(rows, args))


def loopback_bytes():
    import psutil

    counters = psutil.net_io_counters(pernic=True)
    lo = counters.get("lo")
    return None if lo is None else lo.bytes_sent


def child_speed(args, contender, rows):
    import numpy as np

    import kfit_ps

    partitioner = kfit_ps.partitioners.FixedShardsPartitioner(args.shards)
    with child_process.contender_cluster(contender == "tf_keras", args.workers, args.ps,
                                         variable_partitioner=partitioner) as (cluster, strategy):
        if strategy is None:
            model, data = make_tf_keras(cluster, rows, args)
        else:
            model, data = make_kfit(strategy, rows, args)
        model.fit(data, epochs=1, steps_per_epoch=20, verbose=0)  # warm-up
        before, start = loopback_bytes(), time.perf_counter()
        model.fit(data, epochs=1, steps_per_epoch=args.steps, verbose=0)
        seconds = time.perf_counter() - start
        after = loopback_bytes()
        # Everything but the table (tf_keras lists the table's shards separately).
        dense_params = sum(int(np.prod(v.shape)) for v in model.trainable_variables) - \
            rows * args.dim
        iterations = int(model.optimizer.iterations.numpy())
    ids, _ = batches(rows, args)
    per_batch = ids[: (len(ids) // args.batch_size) * args.batch_size].reshape(
        -1, args.batch_size * args.ids_per_example)
    unique = float(np.mean([len(np.unique(b)) for b in per_batch]))
    return {"steps_per_s": args.steps / seconds, "step_ms": 1000 * seconds / args.steps,
            "examples_per_s": args.steps * args.batch_size / seconds,
            "bytes_per_step": None if before is None else (after - before) / args.steps,
            "dense_params": dense_params, "unique_ids": unique, "iterations": iterations}


def child_rss(args):
    import keras
    import psutil

    import kfit_ps

    me = psutil.Process()
    partitioner = kfit_ps.partitioners.FixedShardsPartitioner(args.shards)
    with child_process.local_cluster(args.workers, args.ps,
                                     variable_partitioner=partitioner) as (_, strategy):
        with strategy.scope():  # Warm TF up with a small model first.
            keras.Model(*build(keras.layers, BASE_IDS, args)).compile("adam", "mse")
        baseline = me.memory_info().rss
        peak = [baseline]
        done = threading.Event()

        def poll():
            while not done.is_set():
                peak[0] = max(peak[0], me.memory_info().rss)
                time.sleep(0.005)

        watcher = threading.Thread(target=poll, daemon=True)
        watcher.start()
        started = time.perf_counter()
        with strategy.scope():
            model = keras.Model(*build(keras.layers, args.large_rows, args))
            model.compile(keras.optimizers.Adam(1e-3), "binary_crossentropy")
            model.optimizer.build(model.trainable_variables)
        seconds = time.perf_counter() - started
        done.set()
        watcher.join()
        peak[0] = max(peak[0], me.memory_info().rss)
        shards = [tuple(s.shape) for s in kfit_ps.shards(model.layers[1].embeddings)]
    return {"baseline_mb": baseline / 2**20, "peak_mb": peak[0] / 2**20,
            "table_mb": args.large_rows * args.dim * 4 / 2**20, "seconds": seconds,
            "shards": shards}


def child_bandwidth(args):
    """Bytes/s of reading a 256 MB variable from a cluster of 1 worker + 1 ps; in one process
    (`child_process`), from the process' cluster, whose partitioner splits it over the ps."""
    import tensorflow as tf

    import kfit_ps

    if child_process.one_process():
        partitioner = kfit_ps.partitioners.FixedShardsPartitioner(args.shards)
        cluster = child_process.local_cluster(args.workers, args.ps,
                                              variable_partitioner=partitioner)
    else:
        cluster = child_process.local_cluster(1, 1)
    with cluster as (_, strategy):
        with strategy.scope():
            big = tf.Variable(tf.zeros((64, 1 << 20), tf.float32))  # 256 MB on the ps
        big.numpy()
        reads, start = 3, time.perf_counter()
        for _ in range(reads):
            big.numpy()
        seconds = time.perf_counter() - start
    return {"bytes_per_s": reads * 64 * (1 << 20) * 4 / seconds}


def run_child(args):
    if args.child == "rss":
        result = child_rss(args)
    elif args.child == "bandwidth":
        result = child_bandwidth(args)
    else:
        contender, rows = args.child.split(":")
        result = child_speed(args, contender, int(rows))
    child_process.report(result)


def measure(child, argv, args=None):
    """`child` in a process of its own; with `args` (the script's), in this one when the tests
    ask for one process (`child_process`)."""
    here = None if args is None else argparse.Namespace(**{**vars(args), "child": child})
    return child_process.measure(os.path.abspath(__file__), child, argv, timeout=3600,
                                 run=None if here is None else lambda: run_child(here))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small-rows", type=int, default=20_000)
    parser.add_argument("--large-rows", type=int, default=2_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--ids-per-example", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per run")
    parser.add_argument("--steps-per-execution", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return run_child(args)
    given = list(argv if argv is not None else sys.argv[1:])
    passed = [a for i, a in enumerate(given)  # the children get every flag but --json
              if not a.startswith("--json") and (i == 0 or given[i - 1] != "--json")]

    small = measure(f"kfit_ps:{args.small_rows}", passed, args)
    large = measure(f"kfit_ps:{args.large_rows}", passed, args)
    print(f"1. table size: {args.small_rows} rows {small['step_ms']:.2f} ms/step, "
          f"{args.large_rows} rows {large['step_ms']:.2f} ms/step; ratio "
          f"{large['step_ms'] / small['step_ms']:.3f} (target <= 1.3)", flush=True)

    rss = measure("rss", passed, args)
    limit = 1.5 * rss["baseline_mb"] + 100
    print(f"2. coordinator RSS creating a {args.large_rows} x {args.dim} table "
          f"({rss['table_mb']:.0f} MB, shards {rss['shards']}) and its Adam slots: baseline "
          f"{rss['baseline_mb']:.0f} MB, peak {rss['peak_mb']:.0f} MB (limit {limit:.0f} MB: "
          f"{'met' if rss['peak_mb'] < limit else 'NOT met'})", flush=True)

    baseline = measure(f"tf_keras:{args.large_rows}", passed)
    print(f"3. examples/s with the {args.large_rows}-row table: kfit_ps "
          f"{large['examples_per_s']:.0f}, tf_keras {baseline['examples_per_s']:.0f}; ratio "
          f"{large['examples_per_s'] / baseline['examples_per_s']:.3f} (target >= 1.0)",
          flush=True)

    bandwidth = measure("bandwidth", passed, args)
    minimum = 4 * large["dense_params"] + large["unique_ids"] * (4 * args.dim + 8)
    moved = large["bytes_per_step"]
    line = (f"4. bytes per step: minimum S = 4*{large['dense_params']} + "
            f"{large['unique_ids']:.0f}*(4*{args.dim}+8) = {minimum / 1e6:.3f} MB each way, "
            f"{2 * minimum / 1e6:.3f} MB both ways; ")
    if moved is None:
        line += "loopback counters unavailable on this machine"
    else:
        line += (f"measured {moved / 1e6:.3f} MB on loopback ({moved / (2 * minimum):.2f} x the "
                 f"two-way minimum); {moved * large['steps_per_s'] / 1e6:.0f} MB/s = "
                 f"{moved * large['steps_per_s'] / bandwidth['bytes_per_s']:.1%} of the "
                 f"{bandwidth['bytes_per_s'] / 1e6:.0f} MB/s gRPC loopback bandwidth")
    print(line, flush=True)
    results = {"config": vars(args), "small": small, "large": large, "rss": rss,
               "tf_keras": baseline, "bandwidth": bandwidth, "minimum_bytes_each_way": minimum,
               "step_time_ratio": large["step_ms"] / small["step_ms"],
               "rss_limit_mb": limit,
               "examples_ratio": large["examples_per_s"] / baseline["examples_per_s"]}
    child_process.write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
