"""Exact evaluation speed: batches shipped from the coordinator vs read by the workers.

The main job's DLRM model (untrained weights are enough to time evaluation)
on a `LocalCluster` of `--workers` workers + 2 ps evaluates a held-out set of
`--rows` Criteo-shaped examples written as `--files` files, two ways:

- `shipped`: `model.evaluate(dataset)` with a finite `tf.data.Dataset`: the
  coordinator reads and parses every batch and sends it with its function;
- `worker_read`: `model.evaluate(kfit_ps.DatasetCreator(fn))` without
  `steps`: each worker builds the pipeline, split into shards (5 per worker,
  by file), each shard evaluated once by one function.

Both are exact: each reports the examples it counted (a sum metric), which
must equal `--rows`, and the same loss and AUC. Each measurement runs in a
fresh process, after a warm-up evaluation of a small set of as many files
(so tracing, which depends on the split by file, is excluded);
repeats alternate the order. The worker-kill case is a test
(`tests/test_sharded_evaluation.py`), not timed here.

    python bench/exact_evaluation.py                 # docs/benchmarks.md
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import child_process

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

CONTENDERS = ("shipped", "worker_read")


def _examples_metric():
    import keras

    class Examples(keras.metrics.Metric):
        def __init__(self, name="examples", **kwargs):
            super().__init__(name=name, **kwargs)
            self.count = self.add_variable(shape=(), initializer="zeros", name="count",
                                           aggregation="sum")

        def update_state(self, y_true, y_pred, sample_weight=None):
            self.count.assign_add(keras.ops.cast(keras.ops.shape(y_true)[0], "float32"))

        def result(self):
            return self.count

    return Examples()


def run_child(args):
    import keras

    import kfit_ps
    from kfit_ps.data import criteo
    from kfit_ps.jobs.dlrm import build_dlrm

    spec = criteo.CriteoSpec(scale=1e-3)
    def files_in(directory):
        return sorted(os.path.join(directory, f) for f in os.listdir(directory))

    paths, warmup_paths = files_in(args.data_dir), files_in(args.warmup_dir)

    def evaluate(model, files):
        if args.child == "shipped":
            data = criteo.dataset(files, args.batch_size, spec, shuffle=False, repeat=False)
        else:
            def dataset_fn(input_context):
                return criteo.dataset(files, args.batch_size, spec, shuffle=False,
                                      repeat=False)

            data = kfit_ps.DatasetCreator(dataset_fn)
        return model.evaluate(data, verbose=0, return_dict=True)

    partitioner = kfit_ps.partitioners.MinSizePartitioner(64 << 10, max_shards=2)
    with child_process.local_cluster(args.workers, 2, variable_partitioner=partitioner) as (
            _, strategy):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = build_dlrm(spec)
            model.compile(loss="binary_crossentropy",
                          metrics=[keras.metrics.AUC(name="auc"), _examples_metric()])
        evaluate(model, warmup_paths)  # warm-up: tracing, as many files, 5 % of the examples
        start = time.perf_counter()
        logs = evaluate(model, paths)
        seconds = time.perf_counter() - start
        del model
    child_process.report({"examples_per_s": logs["examples"] / seconds,
                          "examples": logs["examples"], "loss": logs["loss"],
                          "auc": logs["auc"]})


def _measure_all(args, argv, data_dir, warmup_dir):
    from kfit_ps.data import criteo

    criteo.generate(data_dir, args.rows, criteo.CriteoSpec(scale=1e-3), files=args.files,
                    seed=1)
    criteo.generate(warmup_dir, args.rows // 20, criteo.CriteoSpec(scale=1e-3),
                    files=args.files, seed=2)
    child_argv = [*argv, "--data-dir", data_dir, "--warmup-dir", warmup_dir]
    results = {name: [] for name in CONTENDERS}
    for repeat in range(args.repeats):
        order = CONTENDERS if repeat % 2 == 0 else tuple(reversed(CONTENDERS))
        for name in order:
            here = argparse.Namespace(**{**vars(args), "child": name, "data_dir": data_dir,
                                         "warmup_dir": warmup_dir})
            results[name].append(child_process.measure(
                os.path.abspath(__file__), name, child_argv, timeout=3600,
                run=lambda: run_child(here)))
        print(f"repeat {repeat + 1}/{args.repeats}: " + ", ".join(
            f"{n} {results[n][-1]['examples_per_s']:,.0f} examples/s" for n in CONTENDERS),
            flush=True)
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--files", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--data-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--warmup-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=CONTENDERS, default=None, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    child_process.run_if_child(args, run_child)

    data_dir = tempfile.mkdtemp(prefix="kfit_ps_eval_bench_")
    warmup_dir = tempfile.mkdtemp(prefix="kfit_ps_eval_bench_warmup_")
    try:
        results = _measure_all(args, argv, data_dir, warmup_dir)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
        shutil.rmtree(warmup_dir, ignore_errors=True)
    ratios = [w["examples_per_s"] / s["examples_per_s"]
              for w, s in zip(results["worker_read"], results["shipped"])]
    summary = {
        "config": {k: v for k, v in vars(args).items() if k not in ("child",)},
        "examples_per_s": {n: statistics.median(r["examples_per_s"] for r in runs)
                           for n, runs in results.items()},
        "ratio_worker_read_over_shipped": {"median": statistics.median(ratios),
                                           "per_repeat": ratios},
        "runs": results,
    }
    for name, runs in results.items():
        print(f"{name}: median {summary['examples_per_s'][name]:,.0f} examples/s; examples "
              f"counted {sorted({int(r['examples']) for r in runs})} (expected {args.rows}); "
              f"loss {sorted({round(r['loss'], 6) for r in runs})}, "
              f"auc {sorted({round(r['auc'], 6) for r in runs})}")
    print(f"worker_read / shipped: median {statistics.median(ratios):.2f} "
          f"(per repeat {', '.join(f'{r:.2f}' for r in ratios)})")
    child_process.write_json(args.json, summary)
    return summary


if __name__ == "__main__":
    main()
