"""Dynamic embeddings: quality against hashed tables, step time against table size, eviction.

Three measurements, each in fresh processes on a `LocalCluster` (2 workers,
2 ps by default):

- `quality`: the main job's DLRM model on Criteo-shaped files with raw ids
  and an id space that grows over time (`criteo.generate(raw_ids=True,
  growth=...)`); the last file is the held-out set (the latest period, with
  ids the training files never had). Three ways to embed the 26 features:
  `hashed` (fixed tables of `--buckets-fraction` x cardinality rows, ids
  hashed into them: they collide), `dynamic` (one `DynamicEmbedding` for the
  26 features, `capacity` = the same rows: the same memory), `unbounded` (`DynamicEmbedding`
  without a capacity: a row for every id seen) and `full` (fixed tables with
  a row for every id: no collision, sized ahead). Reports held-out AUC
  (exact, worker-read evaluation) and the rows each holds.
- `table_size`: one `DynamicEmbedding` prefilled on the ps with `--small` and
  then `--large` rows (generated there, not sent), then trained at the same
  batch on ids it holds: examples/s at each size (alternating, medians) and
  the chief's RSS before the fill, after it and after training.
- `eviction`: `--stream` distinct ids, each seen once, through a table of
  `--capacity` rows: the most rows any ps held, against the documented bound.

    python bench/dynamic_embeddings.py --part quality
    python bench/dynamic_embeddings.py --part table_size --small 1000000 --large 10000000
    python bench/dynamic_embeddings.py --part eviction --stream 5000000 --capacity 500000

`--part` takes several parts, comma-separated: they run one after the other with the same
arguments, and `--json` then names one file per part (`{part}` in the path stands for the
part's name):

    python bench/dynamic_embeddings.py --part quality,table_size,eviction --json {part}.json
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

EMBEDDINGS = ("hashed", "dynamic", "unbounded", "full")


def _rss_mb():
    import psutil

    return psutil.Process().memory_info().rss / 2**20


# Quality ---------------------------------------------------------------------------------


def _quality_child(args):
    import keras
    import tensorflow as tf

    import kfit_ps
    from kfit_ps.data import criteo
    from kfit_ps.jobs.dlrm import build_dlrm

    paths = sorted(os.path.join(args.data_dir, f) for f in os.listdir(args.data_dir))
    train, held_out = paths[:-1], paths[-1:]
    base = criteo.CriteoSpec(scale=args.scale)
    full_rows = [int(c * (1 + args.growth)) + 2 for c in base.cardinalities]
    buckets = tuple(max(2, int(c * args.buckets_fraction)) for c in base.cardinalities)
    kind = args.child
    spec = criteo.CriteoSpec(scale=args.scale, buckets=buckets)
    raw = kind != "hashed"

    def embeddings(categorical):
        if kind in ("dynamic", "unbounded"):  # One layer, one table for the 26 features.
            layer = kfit_ps.layers.DynamicEmbedding(
                args.dim, capacity=sum(buckets) if kind == "dynamic" else None, seed=1,
                name="dynamic_embedding")
            return layer(categorical)
        sizes = full_rows if kind == "full" else buckets
        return {c: keras.layers.Embedding(rows, args.dim, name=f"{c}_embedding")(categorical[c])
                for c, rows in zip(criteo.CATEGORICAL, sizes)}

    def data(files, repeat):
        def fn(context):
            mine = [p for i, p in enumerate(files)
                    if i % context.num_input_pipelines == context.input_pipeline_id]
            ds = criteo.dataset(mine or files, args.batch_size, spec, shuffle=repeat,
                                repeat=repeat, seed=context.input_pipeline_id, raw_ids=raw)
            if kind == "full":  # Empty values (-1) get the last row.
                ds = ds.map(lambda x, y: ({k: tf.where(v < 0, tf.cast(full_rows[
                    criteo.CATEGORICAL.index(k)] - 1, v.dtype), v) if k != "dense" else v
                    for k, v in x.items()}, y))
            return ds
        return kfit_ps.DatasetCreator(fn)

    with child_process.local_cluster(args.workers, args.ps) as (_, strategy):
        with strategy.scope():
            model = build_dlrm(spec, args.dim, embeddings=embeddings)
            model.compile(optimizer=keras.optimizers.Adam(0.005), loss="binary_crossentropy",
                          metrics=[keras.metrics.AUC(name="auc")])
        steps = args.rows * (len(paths) - 1) // len(paths) // args.batch_size
        start = time.perf_counter()
        model.fit(data(train, True), epochs=1, steps_per_epoch=steps, verbose=0)
        seconds = time.perf_counter() - start
        result = model.evaluate(data(held_out, False), return_dict=True, verbose=0)
        if kind in ("dynamic", "unbounded"):
            rows = sum(layer.stats()["rows"] for layer in model.layers
                       if isinstance(layer, kfit_ps.layers.DynamicEmbedding))
        else:
            rows = sum(full_rows) if kind == "full" else sum(buckets)
    child_process.report({"auc": result["auc"], "loss": result["loss"], "rows": rows,
                          "megabytes": rows * args.dim * 4 / 2**20,
                          "examples_per_s": steps * args.batch_size / seconds,
                          "iterations": steps})


def quality(args, argv):
    from kfit_ps.data import criteo

    args.data_dir = tempfile.mkdtemp(prefix="kfit_ps_dynamic_bench_")
    atexit.register(shutil.rmtree, args.data_dir, ignore_errors=True)
    criteo.generate(args.data_dir, args.rows, criteo.CriteoSpec(scale=args.scale),
                    files=5, seed=0, raw_ids=True, growth=args.growth)
    results = {kind: [] for kind in EMBEDDINGS}
    for repeat in range(args.repeats):
        order = EMBEDDINGS if repeat % 2 == 0 else EMBEDDINGS[::-1]
        for kind in order:
            r = _measure(kind, argv + ["--data-dir", args.data_dir])
            results[kind].append(r)
            print(f"repeat {repeat + 1} {kind:8s} held-out AUC {r['auc']:.4f}  rows "
                  f"{r['rows']:>9,d} ({r['megabytes']:.1f} MB of rows)  "
                  f"{r['examples_per_s']:,.0f} examples/s", flush=True)
    medians = {kind: statistics.median(r["auc"] for r in rs) for kind, rs in results.items()}
    print("median held-out AUC: " + ", ".join(f"{k} {v:.4f}" for k, v in medians.items()))
    return {"results": results, "median_auc": medians}


# Table size ------------------------------------------------------------------------------


def _fill(layer, rows):
    """Inserts `rows` ids (0..rows-1) with random vectors, generated on each shard's ps."""
    import tensorflow as tf

    from kfit_ps.embeddings import hashing

    table = layer.table
    chunk = 1 << 20
    for index, shard in enumerate(table.shards):
        @tf.function
        def fill(start):
            with tf.device(shard.device):
                keys = tf.range(start, tf.minimum(start + chunk, rows), dtype=tf.int64)
                keys = tf.boolean_mask(keys, tf.equal(
                    hashing.shard_of(keys, table.num_shards), index))
                shard.values.insert(keys, tf.random.uniform([tf.size(keys), table.dim]))
                return shard.values.size()

        for start in range(0, rows, chunk):
            fill(tf.constant(start, tf.int64))


def _table_size_child(args):
    import keras
    import tensorflow as tf

    import kfit_ps

    rows = args.large if args.child == "large" else args.small
    with child_process.local_cluster(args.workers, args.ps) as (_, strategy):
        with strategy.scope():
            ids = keras.Input((args.ids_per_example,), dtype="int64")
            layer = kfit_ps.layers.DynamicEmbedding(args.dim, name="table")
            x = keras.layers.Flatten()(layer(ids))
            model = keras.Model(ids, keras.layers.Dense(1, activation="sigmoid")(x))
            model.compile(optimizer="adagrad", loss="binary_crossentropy",
                          steps_per_execution=args.steps_per_execution)
        rss_start = _rss_mb()
        _fill(layer, rows)
        rss_filled = _rss_mb()

        def fn(context):
            data = tf.data.Dataset.random(seed=context.input_pipeline_id).map(
                lambda r: tf.math.floormod(r, rows))
            data = data.batch(args.ids_per_example).map(lambda ids: (ids, 1.0))
            return data.batch(args.batch_size).prefetch(4)

        data = kfit_ps.DatasetCreator(fn)
        model.fit(data, epochs=1, steps_per_epoch=50, verbose=0)
        start = time.perf_counter()
        model.fit(data, epochs=1, steps_per_epoch=args.steps, verbose=0)
        seconds = time.perf_counter() - start
        stored = layer.stats()["rows"]
    child_process.report({"rows": stored, "examples_per_s": args.steps * args.batch_size / seconds,
                          "rss_start_mb": rss_start, "rss_filled_mb": rss_filled,
                          "rss_end_mb": _rss_mb()})


def table_size(args, argv):
    results = {"small": [], "large": []}
    for repeat in range(args.repeats):
        for size in (("small", "large") if repeat % 2 == 0 else ("large", "small")):
            r = _measure(size, argv)
            results[size].append(r)
            print(f"repeat {repeat + 1} {r['rows']:>11,d} rows: {r['examples_per_s']:,.0f} "
                  f"examples/s; chief RSS {r['rss_start_mb']:.0f} -> {r['rss_filled_mb']:.0f} "
                  f"-> {r['rss_end_mb']:.0f} MB", flush=True)
    ratios = [s["examples_per_s"] / l["examples_per_s"]
              for s, l in zip(results["small"], results["large"])]
    ratio = statistics.median(ratios)
    print(f"step time large / small (median of {len(ratios)}): {ratio:.3f} (target <= 1.3)")
    return {"results": results, "step_time_ratio": ratio}


# Eviction --------------------------------------------------------------------------------


def _eviction_child(args):
    import keras
    import tensorflow as tf

    import kfit_ps

    with child_process.local_cluster(args.workers, args.ps) as (_, strategy):
        with strategy.scope():
            ids = keras.Input((1,), dtype="int64")
            layer = kfit_ps.layers.DynamicEmbedding(args.dim, capacity=args.capacity,
                                                    name="table")
            x = keras.layers.Flatten()(layer(ids))
            model = keras.Model(ids, keras.layers.Dense(1, activation="sigmoid")(x))
            model.compile(optimizer="sgd", loss="binary_crossentropy")
        per_worker = args.stream // args.workers

        def fn(context):  # Each worker streams its own distinct ids, each once.
            first = context.input_pipeline_id * per_worker
            data = tf.data.Dataset.range(first, first + per_worker)
            return data.map(lambda i: (i[None], 1.0)).batch(args.batch_size).repeat()

        steps = args.stream // args.batch_size
        start = time.perf_counter()
        model.fit(kfit_ps.DatasetCreator(fn), epochs=1, steps_per_epoch=steps, verbose=0)
        seconds = time.perf_counter() - start
        stats = layer.stats()
        table = layer.table
    bound = table.shard_capacity + table.slack + args.workers * args.batch_size
    child_process.report({**stats, "shard_capacity": table.shard_capacity,
                          "slack": table.slack, "bound": bound, "seconds": seconds,
                          "ids": steps * args.batch_size})


def eviction(args, argv):
    r = _measure("eviction", argv)
    print(f"{r['ids']:,d} ids streamed, capacity {args.capacity:,d} ({r['shard_capacity']:,d} "
          f"per ps, slack {r['slack']:,d}): most rows held on one ps {r['peak_rows_per_shard']:,d}"
          f" (bound {r['bound']:,d}); rows held at the end {r['rows']:,d}; evicted "
          f"{r['evicted']:,d}; {r['seconds']:.0f} s")
    return r


PARTS = {"quality": (quality, _quality_child), "table_size": (table_size, _table_size_child),
         "eviction": (eviction, _eviction_child)}


def _measure(kind, argv):
    """`child_process.measure` of `kind` (in this process when the tests ask for one); `argv`
    names one part."""
    [part] = _parser().parse_args(argv).part
    return child_process.measure(__file__, kind, argv, run=lambda: PARTS[part][1](
        _parser().parse_args([*argv, "--child", kind])))


def _parts(text):
    """`--part`: one part or several, comma-separated, each of `PARTS`."""
    parts = [p for p in text.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise argparse.ArgumentTypeError(
            f"received {text!r}; expected one or more of {', '.join(sorted(PARTS))}, "
            "comma-separated (e.g. --part quality,eviction)")
    return list(dict.fromkeys(parts))


def _without(argv, *flags):
    """`argv` without `flags` and their values (`--flag value` or `--flag=value`)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif not arg.startswith(tuple(f + "=" for f in flags)):
            kept.append(arg)
    return kept


def _parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", type=_parts, required=True,
                        help=f"of {', '.join(sorted(PARTS))}; several comma-separated")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--rows", type=int, default=200_000, help="quality: examples written")
    parser.add_argument("--scale", type=float, default=1e-3, help="quality: Criteo scale")
    parser.add_argument("--growth", type=float, default=1.0, help="quality: id-space growth")
    parser.add_argument("--buckets-fraction", type=float, default=0.25,
                        help="quality: hashed rows (and dynamic capacity) / cardinality")
    parser.add_argument("--small", type=int, default=1_000_000, help="table_size: rows")
    parser.add_argument("--large", type=int, default=10_000_000, help="table_size: rows")
    parser.add_argument("--ids-per-example", type=int, default=8, help="table_size")
    parser.add_argument("--steps", type=int, default=500, help="table_size: timed steps")
    parser.add_argument("--steps-per-execution", type=int, default=5)
    parser.add_argument("--stream", type=int, default=5_000_000, help="eviction: distinct ids")
    parser.add_argument("--capacity", type=int, default=500_000, help="eviction: rows")
    parser.add_argument("--json", default=None,
                        help="also write the results to this file ({part}: the part's name)")
    parser.add_argument("--data-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv=None):
    """Runs each part of `--part` in turn; returns their results by part."""
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    args = parser.parse_args(argv)
    if args.child:
        [part] = args.part
        child_process.run_if_child(args, PARTS[part][1])
    if len(args.part) > 1 and args.json and "{part}" not in args.json:
        parser.error(f"--json: received {args.json!r} for {len(args.part)} parts; each part "
                     "writes a file of its own: put {part} in the path (e.g. --json {part}.json)")
    results = {}
    for part in args.part:
        part_args = parser.parse_args([*argv, "--part", part])
        child_argv = [*_without(argv, "--json", "--part"), "--part", part]
        results[part] = PARTS[part][0](part_args, child_argv)
        if args.json:
            child_process.write_json(args.json.replace("{part}", part),
                                     {"part": part, **results[part]})
    return results


if __name__ == "__main__":
    main()
