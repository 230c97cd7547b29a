"""One-pass ledgered epochs against a stream, and against tf.data service's dynamic sharding.

The job: `--examples` examples that each carry their index, batch
`--batch-size`, `steps_per_execution=5`, a small MLP, on a `LocalCluster` of
`--workers` workers + 1 ps. Every training step adds 1 to a per-index
counter on the ps, so each run counts which examples it trained (apart from
any ledger).

Throughput (no failure), each contender in a fresh process, repeats
alternating the order; examples/s of the epochs after the first (tracing
excluded):

- `ledger`: `fit(dataset)` on the finite dataset: one-pass epochs, each
  batch read by index on the worker that trains it (`kfit_ps.ledger`);
- `stream`: `fit(dataset.repeat(), steps_per_epoch=batches)`: each worker
  iterates its own copy of the pipeline (the same number of steps; no pass
  is exact);
- `data_service`: tf.data service with dynamic sharding
  (`processing_mode="distributed_epoch"`, a fault-tolerant dispatcher and 2
  tf.data workers in the chief's process), each training worker reading the
  shared job; one epoch per fit, after a warm-up fit. Its source is
  `range(batches).map(gather batch b)`, so the service hands out one split
  per batch (from `from_tensor_slices` it would hand out one per example:
  26 s per epoch here instead of 1 s);
- `files_ledger`, `files_stream`: the same examples as `tf.train.Example`s in 8
  TFRecord files (written once per run), read by `TFRecordDataset(files)
  .batch(b).map(parse_example)`: one-pass epochs (each batch read from its
  byte offset, `kfit_ps/ledger/files.py`) against the same pipeline repeated,
  with `steps_per_epoch`;
- `files_data_service`: tf.data service's `distributed_epoch` of that pipeline
  over the same files, as `data_service`. The service splits a file list by
  file (its split provider hands out file names: 8 splits), so each tf.data
  worker reads and batches whole files; it cannot split by record, as the
  records' offsets are not known to it (the ledger's file index finds them).

Failures (`--kills` SIGKILLs of training workers at seeded random points of
one epoch, each restarted 0.3 s later), `ledger`, `data_service` and
`files_data_service`: examples lost (trained 0 times), duplicated (trained
more than once), and for the ledger what it reported as re-run.

The file index (`--index-megabytes` of TFRecord files of Criteo-sized records,
about 200 bytes each, and as much CSV text): seconds to index them on one core
of the chief, per GB, just after writing them (in the page cache).

    python bench/data_ledger.py                    # docs/benchmarks.md
    python bench/data_ledger.py --contenders files_ledger,files_stream  # some contenders
"""

import argparse
import atexit
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import child_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

THROUGHPUT = ("ledger", "stream", "data_service", "files_ledger", "files_stream",
              "files_data_service")
FAILURES = ("ledger_kills", "data_service_kills", "files_data_service_kills")
INDEX = "index"
_RECORD_BYTES = 200  # A Criteo example as a tf.train.Example, about.
SPE = 5


def _model(num_examples, features):
    """An MLP on `((x, index), y)`; `model.counts` (a ps variable, not a weight) counts each
    index trained; index -1 (the data service's padding after its end) is not counted."""
    import keras
    import tensorflow as tf

    counts = tf.Variable(tf.zeros([num_examples], tf.int32), trainable=False)

    class Counted(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden = [keras.layers.Dense(64, activation="relu") for _ in range(2)]
            self.out = keras.layers.Dense(1)

        def call(self, inputs):
            x = inputs[0]
            for layer in self.hidden:
                x = layer(x)
            return self.out(x)

        def train_step(self, data):
            (_, index), _ = data
            index = tf.boolean_mask(index, index >= 0)
            counts.scatter_add(tf.IndexedSlices(tf.ones_like(index, tf.int32), index))
            return super().train_step(data)

    model = Counted()
    model.counts = counts
    model.compile(optimizer="adam", loss="mse", steps_per_execution=SPE)
    return model


def _tfrecord_paths(args):
    """The examples of `_arrays(args)` as `tf.train.Example`s in 8 TFRecord files of
    `args.data_dir` (written by the first child that needs them): their paths."""
    sys.path.insert(0, ROOT)
    from tests import helpers

    bounds = [args.examples * i // 8 for i in range(9)]
    done = os.path.join(args.data_dir, "written")
    if os.path.exists(done):
        paths = sorted(os.path.join(args.data_dir, f) for f in os.listdir(args.data_dir)
                       if f.endswith(".tfrecord"))
    else:
        paths = helpers.indexed_files(args.data_dir, "tfrecord", features=args.features,
                                      sizes=[b - a for a, b in zip(bounds, bounds[1:])])
        open(done, "w").close()
    return paths


def _tfrecord_files(args):
    """A pipeline that reads `_tfrecord_paths(args)` as a user writes one (the tests'
    `indexed_files` and `indexed_file_dataset`, which make the same examples)."""
    sys.path.insert(0, ROOT)
    from tests import helpers

    return helpers.indexed_file_dataset(_tfrecord_paths(args), args.batch_size,
                                        features=args.features)


def _arrays(args):
    """`((x, index), y)`: the tests' `indexed_arrays` (each example carries its index)."""
    sys.path.insert(0, ROOT)
    from tests import helpers

    return helpers.indexed_arrays(args.examples, args.features)


class _EpochTimes:
    """Wall time of each epoch (a Keras callback, made in the child)."""

    @staticmethod
    def make():
        import keras

        class Times(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.seconds = []

            def on_epoch_begin(self, epoch, logs=None):
                self._start = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                self.seconds.append(time.perf_counter() - self._start)

        return Times()


class _DataService:
    """A fault-tolerant tf.data service dispatcher and 2 tf.data workers, in this process."""

    def __init__(self):
        import tensorflow as tf

        service = tf.data.experimental.service
        self.work_dir = tempfile.mkdtemp(prefix="kfit_ps_data_service_")
        atexit.register(shutil.rmtree, self.work_dir, True)  # its journal: this run's only
        self.dispatcher = service.DispatchServer(service.DispatcherConfig(
            port=0, work_dir=self.work_dir, fault_tolerant_mode=True))
        address = self.dispatcher.target.split("://")[1]
        self.workers = [service.WorkerServer(service.WorkerConfig(dispatcher_address=address))
                        for _ in range(2)]

    def creator(self, source, features, job_name):
        """A DatasetCreator: each training worker reads the shared job `job_name` of the
        dataset `source()` makes, then padding (index -1) once the service's epoch is over."""
        import numpy as np
        import tensorflow as tf

        import kfit_ps

        target = self.dispatcher.target
        pad = ((np.zeros((1, features), "float32"), np.full((1,), -1, np.int64)),
               np.zeros((1, 1), "float32"))

        def dataset_fn(context):
            shared = source().apply(tf.data.experimental.service.distribute(
                processing_mode="distributed_epoch", service=target, job_name=job_name))
            return shared.concatenate(tf.data.Dataset.from_tensors(pad).repeat())

        return kfit_ps.DatasetCreator(dataset_fn)


def _array_batches(arrays, batch_size):
    """`source()` for `_DataService.creator`: the arrays' batches, one split per batch."""
    import tensorflow as tf

    num_examples = len(arrays[1])

    def source():
        (features, index), targets = tf.nest.map_structure(tf.constant, arrays)

        def batch(b):  # The service splits its source: one split per batch index.
            start = b * batch_size
            stop = tf.minimum(start + batch_size, num_examples)
            return (features[start:stop], index[start:stop]), targets[start:stop]

        return tf.data.Dataset.range(-(-num_examples // batch_size)).map(batch)

    return source


def _file_batches(args):
    """`source()` for `_DataService.creator`: `_tfrecord_files`' pipeline over its files. The
    service splits a file list by file: each tf.data worker reads whole files, one split each,
    and batches the records of the files it was handed (its last batch may be short)."""
    paths = _tfrecord_paths(args)
    sys.path.insert(0, ROOT)
    from tests import helpers

    return lambda: helpers.indexed_file_dataset(paths, args.batch_size, features=args.features)


def _kill_workers(cluster, model, args, seed):
    """`tests.chaos.WorkerKills` of `args.kills` training workers at seeded points."""
    sys.path.insert(0, ROOT)
    from tests import chaos

    rng = random.Random(seed)
    batches = -(-args.examples // args.batch_size)
    iterations = model.optimizer.iterations
    start = int(iterations.numpy())
    points = chaos.kill_points(rng, batches // 20, batches - batches // 4, args.kills)
    return chaos.WorkerKills(cluster, lambda: int(iterations.numpy()) - start, points, rng,
                             workers=args.workers)


def _index_cost(args):
    """Seconds per GB to index `--index-megabytes` of TFRecord files and of text files (4 of
    each), by `kfit_ps.ledger.file_index` in this process."""
    import numpy as np
    import tensorflow as tf

    from kfit_ps.ledger import file_index

    folder = tempfile.mkdtemp(prefix="kfit_ps_index_bench_")
    per_file = args.index_megabytes * 2**20 // 4
    record = bytes(range(256))[:_RECORD_BYTES - 16]  # + 16 bytes of framing: 200 bytes
    line = (",".join(["1"] * 13 + ["68fd1e64"] * 26) + "\n").encode()
    text_block = line * (2**20 // len(line))
    result = {}
    try:
        for kind in (file_index.TFRECORD, file_index.TEXT):
            paths = [os.path.join(folder, f"{kind}-{i}") for i in range(4)]
            for path in paths:
                if kind == file_index.TFRECORD:
                    with tf.io.TFRecordWriter(path) as writer:
                        for _ in range(per_file // _RECORD_BYTES):
                            writer.write(record)
                else:
                    with open(path, "wb") as f:
                        for _ in range(max(1, per_file // len(text_block))):
                            f.write(text_block)
            gigabytes = sum(os.path.getsize(p) for p in paths) / 1e9
            indexes, seconds = file_index.index_files(paths, kind, threads=1)
            result[kind] = {"gigabytes": gigabytes, "seconds": seconds,
                            "seconds_per_gb": seconds / gigabytes,
                            "records": int(np.sum([i.records for i in indexes]))}
            for path in paths:
                os.remove(path)
    finally:
        for name in os.listdir(folder):
            os.remove(os.path.join(folder, name))
        os.rmdir(folder)
    return result


def run_child(args):
    import numpy as np
    import tensorflow as tf

    name = args.child
    if name == INDEX:
        child_process.report(_index_cost(args))
        return
    arrays = _arrays(args)
    batches = -(-args.examples // args.batch_size)
    service = _DataService() if "data_service" in name else None
    if service is not None:  # What the service distributes: batches, or the files' pipeline.
        source = (_file_batches(args) if name.startswith("files_")
                  else _array_batches(arrays, args.batch_size))
    with child_process.local_cluster(args.workers, 1) as (cluster, strategy):
        with strategy.scope():
            model = _model(args.examples, args.features)
        dataset = tf.data.Dataset.from_tensor_slices(arrays).batch(args.batch_size)
        times = _EpochTimes.make()
        result = {}
        if name == "ledger":
            model.fit(dataset, epochs=args.epochs, verbose=0, callbacks=[times])
            seconds = times.seconds[1:]
        elif name == "stream":
            model.fit(dataset.repeat(), epochs=args.epochs, steps_per_epoch=batches, verbose=0,
                      callbacks=[times])
            seconds = times.seconds[1:]
        elif name == "files_ledger":
            model.fit(_tfrecord_files(args), epochs=args.epochs, verbose=0,
                      callbacks=[times])
            seconds = times.seconds[1:]
        elif name == "files_stream":
            model.fit(_tfrecord_files(args).repeat(), epochs=args.epochs,
                      steps_per_epoch=batches, verbose=0, callbacks=[times])
            seconds = times.seconds[1:]
        elif name in ("data_service", "files_data_service"):
            seconds = []
            for epoch in range(args.epochs):  # one job per epoch; the first traces
                model.fit(service.creator(source, args.features, f"epoch{epoch}"), epochs=1,
                          steps_per_epoch=batches + 4 * args.workers * SPE, verbose=0,
                          callbacks=[times])
            seconds = times.seconds[1:]
        else:  # a failure run: one epoch with kills, after a warm-up that traces
            model.fit(dataset.take(2 * SPE), epochs=1, verbose=0)
            if name == "ledger_kills":
                data, steps = dataset, None
            else:
                model.fit(service.creator(source, args.features, "warmup"), epochs=1,
                          steps_per_epoch=2 * SPE, verbose=0)
                data, steps = service.creator(source, args.features, "killed"), (
                    batches + 4 * args.workers * SPE)
            model.counts.assign(tf.zeros([args.examples], tf.int32))
            with _kill_workers(cluster, model, args, args.seed) as kills:
                start = time.perf_counter()
                history = model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
                seconds = [time.perf_counter() - start]
            counts = model.counts.numpy()
            result.update(kills=len(kills.kills), lost=int((counts == 0).sum()),
                          duplicated=int((counts > 1).sum()),
                          trained_twice_or_more=int((counts > 1).sum()))
            if name == "ledger_kills":
                result.update(ledger_examples_rerun=history.history["ledger_examples_rerun"][0],
                              ledger_splits_rerun=history.history["ledger_splits_rerun"][0],
                              ledger_splits_lost=history.history["ledger_splits_lost"][0])
        counts = model.counts.numpy()
        trained = int(np.minimum(counts, 1).sum()) if name.endswith("kills") else None
        result.update(examples_per_s=args.examples / statistics.median(seconds),
                      epoch_seconds=seconds, trained=trained)
    child_process.report(result)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--examples", type=int, default=200_000)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--failure-repeats", type=int, default=1)
    parser.add_argument("--index-megabytes", type=int, default=1024,
                        help="input indexed for the index's cost, per kind (0: none)")
    parser.add_argument("--contenders", default=",".join(THROUGHPUT + FAILURES),
                        help="comma-separated contenders to run (default: all)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", choices=THROUGHPUT + FAILURES + (INDEX,), default=None,
                        help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", default=None, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    child_process.run_if_child(args, run_child)
    data_dir = tempfile.mkdtemp(prefix="kfit_ps_ledger_files_")  # The TFRecord contenders'.
    atexit.register(shutil.rmtree, data_dir, ignore_errors=True)
    argv = [*argv, "--data-dir", data_dir]

    script = os.path.abspath(__file__)

    def measure(name, argv):
        return child_process.measure(script, name, argv, run=lambda: run_child(
            parser.parse_args([*argv, "--child", name])))

    chosen = args.contenders.split(",")
    unknown = sorted(set(chosen) - set(THROUGHPUT + FAILURES))
    if unknown:
        parser.error(f"--contenders: unknown {', '.join(unknown)}; expected some of "
                     f"{', '.join(THROUGHPUT + FAILURES)}")
    throughput = tuple(n for n in THROUGHPUT if n in chosen)
    results = {name: [] for name in THROUGHPUT + FAILURES}
    for repeat in range(args.repeats if throughput else 0):
        order = throughput if repeat % 2 == 0 else tuple(reversed(throughput))
        for name in order:
            results[name].append(measure(name, argv))
        print(f"repeat {repeat + 1}/{args.repeats}: " + ", ".join(
            f"{n} {results[n][-1]['examples_per_s']:,.0f} examples/s" for n in throughput)
            + f" (host load {os.getloadavg()[0]:.1f})", flush=True)
    for repeat in range(args.failure_repeats):
        for name in (n for n in FAILURES if n in chosen):
            results[name].append(measure(name, [*argv, "--seed", str(args.seed + repeat)]))
            r = results[name][-1]
            print(f"{name}: {r['kills']} kills, lost {r['lost']}, duplicated {r['duplicated']}, "
                  f"{r['examples_per_s']:,.0f} examples/s", flush=True)
    index = measure(INDEX, argv) if args.index_megabytes else None
    for kind, cost in (index or {}).items():
        print(f"index of {kind} files: {cost['gigabytes']:.2f} GB, {cost['records']:,} records "
              f"in {cost['seconds']:.2f} s on one core ({cost['seconds_per_gb']:.2f} s/GB)",
              flush=True)
    ratios = [a["examples_per_s"] / b["examples_per_s"]
              for a, b in zip(results["ledger"], results["stream"])]
    file_ratios = [a["examples_per_s"] / b["examples_per_s"]
                   for a, b in zip(results["files_ledger"], results["files_stream"])]
    service_ratios = [a["examples_per_s"] / b["examples_per_s"]
                      for a, b in zip(results["files_data_service"], results["files_stream"])]
    summary = {
        "config": {k: v for k, v in vars(args).items() if k != "child"},
        "host_load": os.getloadavg(),  # 1, 5 and 15 minutes, at the end
        "examples_per_s": {n: statistics.median(r["examples_per_s"] for r in runs)
                           for n, runs in results.items() if runs},
        "ratio_ledger_over_stream": {"median": statistics.median(ratios),
                                     "per_repeat": ratios} if ratios else None,
        "ratio_files_ledger_over_stream": {"median": statistics.median(file_ratios),
                                           "per_repeat": file_ratios} if file_ratios else None,
        "ratio_files_data_service_over_stream": {
            "median": statistics.median(service_ratios),
            "per_repeat": service_ratios} if service_ratios else None,
        "runs": results,
        "index": index,
    }
    for label, values in (("ledger / stream", ratios),
                          ("TFRecord files: ledger / stream", file_ratios),
                          ("TFRecord files: data service / stream", service_ratios)):
        if values:
            print(f"{label}: median {statistics.median(values):.2f} "
                  f"(per repeat {', '.join(f'{r:.2f}' for r in values)})")
    child_process.write_json(args.json, summary)
    return summary


if __name__ == "__main__":
    main()
