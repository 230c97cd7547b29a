"""DLRM throughput: kfit_ps vs tf_keras's parameter-server `fit` vs single-process Keras 3.

The main job's model (`kfit_ps.jobs.dlrm`: bottom MLP, 26 embedding tables,
pairwise dot interaction, top MLP; Adam, binary cross-entropy, AUC) on the
same Criteo-shaped files (`kfit_ps.data.criteo`, written once by this script),
trained by three contenders, each measurement in a fresh process:

- `kfit_ps`: `model.fit` on a `LocalCluster` of `--workers` workers and `--ps`
  ps tasks, tables of 64 KB and more sharded over the ps tasks (as the main job);
- `tf_keras`: tf_keras's own parameter-server `model.fit` (Keras 2), the same
  model, partitioner, cluster shape, data and batch;
- `keras`: single-process Keras 3 `model.fit` with no cluster at all, on the
  same machine: the baseline that tells what distribution costs. Its input
  pipeline runs as kfit_ps' CPU workers run theirs, without tf.data's
  autotuning (`--keras-autotune on` for Keras' default: on this machine its
  rate is then exactly 24,990 examples/s in some processes and 30,000 to
  43,000 in others);
- `kfit_ps_dynamic` (only when named in `--contenders`): `kfit_ps` with one
  `DynamicEmbedding` for the 26 features instead of the 26 fixed tables (the
  same ids, the same rows); compared with `kfit_ps` as
  `kfit_ps_dynamic/kfit_ps`.

kfit_ps' contenders also report the ps tasks' CPU seconds per timed step
(user + system time of the ps processes over the timed `fit`).

Each times one `fit` of `--steps` steps after a 20-step warm-up (tracing and
dataset start excluded); repeats alternate the order of the contenders.
Prints examples/s, the per-repeat ratios kfit_ps/tf_keras and kfit_ps/keras,
and their medians.

    python bench/dlrm_throughput.py                              # as in docs/benchmarks.md
    python bench/dlrm_throughput.py --repeats 1 --steps 200      # quick
    python bench/dlrm_throughput.py --contenders kfit_ps,kfit_ps_dynamic --repeats 5
"""

import argparse
import atexit
import os
import shutil
import statistics
import sys
import tempfile
import time

import child_process

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

CONTENDERS = ("kfit_ps", "tf_keras", "keras", "kfit_ps_dynamic")
DEFAULT_CONTENDERS = ("kfit_ps", "tf_keras", "keras")
WARMUP_STEPS = 20
MIN_SHARD_BYTES = 64 << 10  # as the main job (kfit_ps.jobs.quickstart)


def _spec(args):
    from kfit_ps.data import criteo

    return criteo.CriteoSpec(scale=args.scale)


def dataset_fn_for(paths, args):
    def dataset_fn(input_context):
        from kfit_ps.data import criteo

        batch = input_context.get_per_replica_batch_size(args.batch_size)
        shard = [p for i, p in enumerate(paths)
                 if i % input_context.num_input_pipelines == input_context.input_pipeline_id]
        return criteo.dataset(shard or paths, batch, _spec(args))

    return dataset_fn


def build_tf_keras_dlrm(spec, dim):
    """`kfit_ps.jobs.dlrm.build_dlrm` written with tf_keras layers (same shapes and math)."""
    import tensorflow as tf
    import tf_keras

    from kfit_ps.data import criteo

    class DotInteraction(tf_keras.layers.Layer):
        def call(self, vectors):
            stack = tf.stack(vectors, axis=1)
            n = stack.shape[1]
            flat = tf.reshape(tf.matmul(stack, stack, transpose_b=True), (-1, n * n))
            return tf.gather(flat, [i * n + j for i in range(n) for j in range(i + 1, n)],
                             axis=1)

    layers = tf_keras.layers
    dense = layers.Input((criteo.NUM_DENSE,), name="dense")
    categorical = {c: layers.Input((), dtype="int64", name=c) for c in criteo.CATEGORICAL}
    bottom = layers.Dense(64, activation="relu", name="bottom_1")(dense)
    bottom = layers.Dense(dim, activation="relu", name="bottom_2")(bottom)
    vectors = [bottom] + [layers.Embedding(rows, dim)(categorical[c])
                          for c, rows in zip(criteo.CATEGORICAL, spec.buckets)]
    x = layers.Concatenate()([bottom, DotInteraction()(vectors)])
    x = layers.Dense(64, activation="relu", name="top_1")(x)
    out = layers.Dense(1, activation="sigmoid", name="click")(x)
    return tf_keras.Model({"dense": dense, **categorical}, out)


def _compile(model, module, args):
    model.compile(optimizer=module.optimizers.Adam(0.005), loss="binary_crossentropy",
                  metrics=[module.metrics.AUC(name="auc")],
                  steps_per_execution=args.steps_per_execution)


def kfit_strategy_args(args):
    """The `kfit_ps.ParameterServerStrategy` arguments of the `kfit_ps` contender."""
    import kfit_ps

    return {"variable_partitioner": kfit_ps.partitioners.MinSizePartitioner(
        MIN_SHARD_BYTES, max_shards=args.ps)}


def make_kfit(strategy, paths, args):
    """The `kfit_ps` contender's model (under `strategy`, made with `kfit_strategy_args`)."""
    import keras

    import kfit_ps
    from kfit_ps.jobs.dlrm import build_dlrm

    with strategy.scope():
        model = build_dlrm(_spec(args), args.dim)
        _compile(model, keras, args)
    return model, kfit_ps.DatasetCreator(dataset_fn_for(paths, args))


def make_kfit_dynamic(strategy, paths, args):
    import keras

    import kfit_ps
    from kfit_ps.jobs.dlrm import build_dlrm

    spec = _spec(args)

    def embeddings(categorical):  # One table for the 26 features, as many rows as theirs.
        return kfit_ps.layers.DynamicEmbedding(args.dim, capacity=sum(spec.buckets), seed=1,
                                               name="dynamic_embedding")(categorical)

    with strategy.scope():
        model = build_dlrm(spec, args.dim, embeddings=embeddings)
        _compile(model, keras, args)
    return model, kfit_ps.DatasetCreator(dataset_fn_for(paths, args))


def _ps_cpu_seconds(cluster, num_ps):
    return sum(child_process.cpu_seconds(cluster.pid("ps", i)) for i in range(num_ps))


def make_tf_keras(cluster, paths, args):
    """tf_keras' own strategy on `cluster` (a process of its own: one strategy per process)."""
    import tensorflow as tf
    import tf_keras

    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        MIN_SHARD_BYTES, max_shards=args.ps)
    strategy = tf.distribute.ParameterServerStrategy(cluster.cluster_resolver,
                                                     variable_partitioner=partitioner)
    with strategy.scope():
        model = build_tf_keras_dlrm(_spec(args), args.dim)
        _compile(model, tf_keras, args)
    return model, tf_keras.utils.experimental.DatasetCreator(dataset_fn_for(paths, args))


def make_keras(paths, args):
    import keras
    import tensorflow as tf

    from kfit_ps.jobs.dlrm import build_dlrm

    model = build_dlrm(_spec(args), args.dim)
    _compile(model, keras, args)
    data = dataset_fn_for(paths, args)(tf.distribute.InputContext())
    if args.keras_autotune == "off":  # The input pipeline of kfit_ps' CPU workers.
        options = tf.data.Options()
        options.autotune.enabled = False
        data = data.with_options(options)
    return model, data


def timed_fit(model, data, steps):
    start = time.perf_counter()
    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
    return time.perf_counter() - start


def run_child(args):
    """One measurement in this process; reports examples/s and the final iterations."""
    paths = sorted(os.path.join(args.data_dir, f) for f in os.listdir(args.data_dir))
    report = {}
    if args.child == "keras":
        if args.threads:  # as many cores and threads as a cluster has workers (scaling.py)
            import tensorflow as tf

            os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.threads])
            tf.config.threading.set_intra_op_parallelism_threads(args.threads)
            tf.config.threading.set_inter_op_parallelism_threads(args.threads)
        report["cores"] = len(os.sched_getaffinity(0))  # tf.data's threads: one per core
        model, data = make_keras(paths, args)
        timed_fit(model, data, WARMUP_STEPS)
        seconds = timed_fit(model, data, args.steps)
        iterations = int(model.optimizer.iterations.numpy())
    else:
        strategy_args = kfit_strategy_args(args) if args.child == "kfit_ps" else {}
        with child_process.contender_cluster(args.child == "tf_keras", args.workers, args.ps,
                                             **strategy_args) as (cluster, strategy):
            if strategy is None:
                model, data = make_tf_keras(cluster, paths, args)
            else:
                make = make_kfit if args.child == "kfit_ps" else make_kfit_dynamic
                model, data = make(strategy, paths, args)
            timed_fit(model, data, WARMUP_STEPS)
            ps_cpu = _ps_cpu_seconds(cluster, args.ps)
            seconds = timed_fit(model, data, args.steps)
            ps_cpu = _ps_cpu_seconds(cluster, args.ps) - ps_cpu
            iterations = int(model.optimizer.iterations.numpy())
            del model, data
        report["ps_cpu_ms_per_step"] = 1000 * ps_cpu / args.steps
    child_process.report({"examples_per_s": args.steps * args.batch_size / seconds,
                          "iterations": iterations, **report})


def add_arguments(parser):
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1000, help="timed steps per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps-per-execution", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--dim", type=int, default=16, help="embedding dimension")
    parser.add_argument("--scale", type=float, default=1e-3,
                        help="Criteo cardinalities x this (the main job's 1e-3)")
    parser.add_argument("--rows", type=int, default=200_000, help="examples written")
    parser.add_argument("--keras-autotune", choices=("off", "on"), default="off",
                        help="tf.data autotuning of the keras contender's input pipeline: off "
                             "as kfit_ps' CPU workers run theirs (default), or on (Keras' "
                             "default, whose rate here is bimodal: see docs/benchmarks.md)")
    parser.add_argument("--threads", type=int, default=0,
                        help="the keras contender on this many cores, with as many intra- "
                             "and inter-op threads (0: every core)")
    parser.add_argument("--data-dir", default=None, help=argparse.SUPPRESS)


def write_data(args):
    """Criteo-shaped files in a fresh directory (once per run of the script; removed at exit)."""
    from kfit_ps.data import criteo

    args.data_dir = tempfile.mkdtemp(prefix="kfit_ps_dlrm_bench_")
    atexit.register(shutil.rmtree, args.data_dir, ignore_errors=True)
    criteo.generate(args.data_dir, args.rows, _spec(args), files=4, seed=0)
    return args.data_dir


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS),
                        help=f"comma-separated, of {', '.join(CONTENDERS)}")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--png", default=None, help="write a bar chart of examples/s here")
    parser.add_argument("--child", choices=CONTENDERS, default=None, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    child_process.run_if_child(args, run_child)

    contenders = [c for c in args.contenders.split(",") if c]
    data_dir = write_data(args)
    child_argv = [a for a in argv if a not in (args.png, "--png", args.json, "--json")]
    child_argv += ["--data-dir", data_dir]
    rates = {name: [] for name in contenders}
    iterations = {name: [] for name in contenders}
    ps_cpu = {name: [] for name in contenders}
    for repeat in range(args.repeats):
        order = contenders if repeat % 2 == 0 else list(reversed(contenders))
        for name in order:
            result = child_process.measure(
                os.path.abspath(__file__), name, child_argv, timeout=3600,
                run=None if name == "tf_keras" else lambda: run_child(  # its own strategy
                    parser.parse_args([*child_argv, "--child", name])))
            rates[name].append(result["examples_per_s"])
            iterations[name].append(result["iterations"])
            if "ps_cpu_ms_per_step" in result:
                ps_cpu[name].append(result["ps_cpu_ms_per_step"])
        print(f"repeat {repeat + 1}/{args.repeats}: "
              + ", ".join(f"{n} {rates[n][-1]:,.0f} examples/s" for n in contenders),
              flush=True)
    result = {"config": {k: v for k, v in vars(args).items() if k != "child"},
              "examples_per_s": {n: statistics.median(r) for n, r in rates.items()},
              "per_repeat": rates, "iterations": iterations,
              "ps_cpu_ms_per_step": {n: statistics.median(c) for n, c in ps_cpu.items() if c},
              "ps_cpu_ms_per_step_per_repeat": {n: c for n, c in ps_cpu.items() if c},
              "expected_iterations": WARMUP_STEPS + args.steps}
    for one, other in (("kfit_ps", "tf_keras"), ("kfit_ps", "keras"),
                       ("kfit_ps_dynamic", "kfit_ps")):
        if one in rates and other in rates:
            ratios = [k / o for k, o in zip(rates[one], rates[other])]
            result[f"{one}/{other}"] = {"median": statistics.median(ratios),
                                        "per_repeat": ratios}
            print(f"{one}/{other}: median {statistics.median(ratios):.2f} "
                  f"(per repeat {', '.join(f'{r:.2f}' for r in ratios)})")
    if result["ps_cpu_ms_per_step"]:
        print("ps CPU ms per step (medians): " + ", ".join(
            f"{n} {v:.2f}" for n, v in result["ps_cpu_ms_per_step"].items()))
    print("examples/s (medians): " + ", ".join(
        f"{n} {v:,.0f}" for n, v in result["examples_per_s"].items()))
    exact = {n: all(i == result["expected_iterations"] for i in its)
             for n, its in iterations.items()}
    print(f"optimizer.iterations == {result['expected_iterations']} after every run: {exact}")
    child_process.write_json(args.json, result)
    if args.png:
        import plots

        labels = {"kfit_ps": f"kfit_ps\n{args.workers} workers + {args.ps} ps",
                  "tf_keras": f"tf_keras PS fit\n{args.workers} workers + {args.ps} ps",
                  "keras": "Keras 3 fit\nsingle process",
                  "kfit_ps_dynamic": f"kfit_ps, DynamicEmbedding\n{args.workers} workers + "
                                     f"{args.ps} ps"}
        plots.bar_chart(args.png, {labels[n]: v for n, v in result["examples_per_s"].items()},
                        f"DLRM, batch {args.batch_size}, steps_per_execution "
                        f"{args.steps_per_execution} ({os.cpu_count()} cores, medians)",
                        "examples/s")
    return result


if __name__ == "__main__":
    main()
