"""The main job: a DLRM-style click model on Criteo-shaped data, on a local PS cluster.

It writes Criteo-layout files (13 integer and 26 categorical features,
Zipf-distributed ids, cardinalities shaped like Criteo's and scaled down, a
learnable signal; `kfit_ps.data.criteo`), trains `jobs.dlrm.build_dlrm` with
`model.fit` on workers and ps tasks that are real server processes, with the
large embedding tables sharded over the ps tasks, and reports AUC on held-out
files. AUC well above 0.5 shows the model recovered the signal.

By default each epoch is one pass over the training files (`kfit_ps.ledger`): every
line trained once per epoch, in a new order of batches each epoch, whatever worker
is lost; the ledger's figures are printed at the end. `--steps-per-epoch S` streams
instead: each worker reads its own shuffled, repeated share of the files.
"""

import dataclasses
import tempfile
import time

from kfit_ps import validation


def _flag(default, flag, help=None):
    """A setting `kfit-ps quickstart` takes as `flag`; the CLI's default is `default`."""
    return dataclasses.field(default=default, metadata={"flag": flag, "help": help})


@dataclasses.dataclass(frozen=True)
class QuickstartConfig:
    """Settings of the main job; those with a `flag` are `kfit-ps quickstart`'s flags, whose
    defaults are these (`QUICKSTART_FLAGS`)."""

    num_workers: int = _flag(2, "--workers")
    num_ps: int = _flag(2, "--ps")
    epochs: int = _flag(2, "--epochs")
    steps_per_epoch: int = _flag(None, "--steps-per-epoch",
                                 "stream this many steps per epoch (default: one pass over the "
                                 "training files per epoch)")
    batch_size: int = 256
    num_examples: int = 100_000
    steps_per_execution: int = 5
    verbose: int = _flag(1, "--verbose")
    seed: int = 0

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None and field.name == "steps_per_epoch":
                continue
            minimum = 0 if field.name in ("verbose", "seed") else 1
            validation.check_int(field.name, value, minimum, owner="QuickstartConfig")


# field name -> (flag, default): the settings `kfit-ps quickstart` takes.
QUICKSTART_FLAGS = {field.name: (field.metadata["flag"], field.default)
                    for field in dataclasses.fields(QuickstartConfig) if "flag" in field.metadata}
# field name -> the flag's help, where it needs one.
QUICKSTART_HELP = {field.name: field.metadata["help"]
                   for field in dataclasses.fields(QuickstartConfig)
                   if field.metadata.get("help")}


def run(config=None):
    """Trains on a fresh LocalCluster (or `kfit-ps run`'s cluster) with `config` (default
    `QuickstartConfig()`); returns held-out metrics."""
    import tensorflow as tf

    from kfit_ps import constants

    config = QuickstartConfig() if config is None else config
    backup = constants.launcher_backup()
    if backup is not None:
        # Under `kfit-ps run --backup-dir`: the data lives beside the backups, so a restarted
        # chief trains on the same files (a backup records them), and goes with them.
        return _train_and_evaluate(config, f"{backup[0].rstrip('/')}/quickstart-data")
    workdir = tempfile.mkdtemp(prefix="kfit_ps_quickstart_")
    try:
        return _train_and_evaluate(config, workdir)
    finally:
        tf.io.gfile.rmtree(workdir)  # about 30 MB of generated data


def _data(config, spec, workdir):
    """`(train files, test files)` in `workdir`: written there, then a marker; files an
    earlier start of this job wrote whole are used as they are."""
    import tensorflow as tf

    from kfit_ps.data import criteo

    marker = f"{workdir}/written"
    if tf.io.gfile.exists(marker):
        return (sorted(tf.io.gfile.glob(f"{workdir}/train/*")),
                sorted(tf.io.gfile.glob(f"{workdir}/test/*")))
    if tf.io.gfile.exists(workdir):
        tf.io.gfile.rmtree(workdir)  # A start that stopped while writing.
    train = criteo.generate(f"{workdir}/train", config.num_examples, spec, files=4,
                            seed=config.seed)
    test = criteo.generate(f"{workdir}/test", 20_000, spec, files=1, seed=config.seed + 1)
    with tf.io.gfile.GFile(marker, "w") as f:
        f.write("data, then this marker\n")
    return train, test


def _train_and_evaluate(config, workdir):
    import keras

    import kfit_ps
    from kfit_ps.data import criteo
    from kfit_ps.jobs.dlrm import build_dlrm

    spec = criteo.CriteoSpec(scale=1e-3)
    train_files, test_files = _data(config, spec, workdir)

    def dataset_fn(input_context):  # A stream: each worker its share of the files.
        batch = input_context.get_per_replica_batch_size(config.batch_size)
        shard = [f for i, f in enumerate(train_files)
                 if i % input_context.num_input_pipelines == input_context.input_pipeline_id]
        return criteo.dataset(shard or train_files, batch, spec)

    if config.steps_per_epoch is None:  # One pass over the files per epoch, in a new order.
        train = criteo.dataset(train_files, config.batch_size, spec, shuffle="files",
                               repeat=False, seed=config.seed)
    else:
        train = kfit_ps.DatasetCreator(dataset_fn)

    started = time.monotonic()
    with kfit_ps.job_cluster(num_workers=config.num_workers, num_ps=config.num_ps) as resolver:
        tasks = resolver.cluster_spec().as_dict()
        num_ps = len(tasks["ps"])
        print(f"kfit_ps quickstart: {len(tasks['worker'])} workers + {num_ps} ps ready in "
              f"{time.monotonic() - started:.1f}s ({tasks})", flush=True)
        # Tables of 64 KB and more are sharded over the ps tasks.
        partitioner = kfit_ps.partitioners.MinSizePartitioner(min_shard_bytes=64 << 10,
                                                              max_shards=num_ps)
        strategy = kfit_ps.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
        with strategy.scope():
            model = build_dlrm(spec)
            model.compile(optimizer=keras.optimizers.Adam(0.005), loss="binary_crossentropy",
                          metrics=[keras.metrics.AUC(name="auc")],
                          steps_per_execution=config.steps_per_execution)
        sharded = [v.path for v in model.trainable_variables if len(kfit_ps.shards(v)) > 1]
        print(f"sharded tables: {len(sharded)} of {len(model.trainable_variables)} variables",
              flush=True)
        history = model.fit(train, epochs=config.epochs,
                            steps_per_epoch=config.steps_per_epoch, verbose=config.verbose)
        _report_ledger(history.history, config)
        test = criteo.dataset(test_files, 1024, spec, shuffle=False, repeat=False)
        results = model.evaluate(test, return_dict=True, verbose=0)
        results["iterations"] = int(model.optimizer.iterations.numpy())
    results["seconds"] = time.monotonic() - started
    print(f"held-out: auc={results['auc']:.4f} loss={results['loss']:.3f} "
          f"(steps trained: {results['iterations']}, {results['seconds']:.1f}s)", flush=True)
    return results


def _report_ledger(logs, config):
    """Prints what the ledger of one-pass epochs saw (nothing for a stream)."""
    if "ledger_splits" not in logs:
        return
    print(f"one-pass epochs: {config.num_examples:,} examples per epoch in "
          f"{_figures(logs['ledger_splits'])} splits; splits re-run "
          f"{_figures(logs['ledger_splits_rerun'])} (at most "
          f"{_figures(logs['ledger_examples_rerun'])} examples trained twice), splits lost "
          f"{_figures(logs['ledger_splits_lost'])}", flush=True)


def _figures(values):
    """An epoch's figure, or each epoch's: '24', or '0, 5, 0'."""
    values = [int(v) for v in values]
    return str(values[0]) if len(set(values)) == 1 else ", ".join(map(str, values))
