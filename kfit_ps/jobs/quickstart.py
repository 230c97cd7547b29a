"""The main job: a DLRM-style click model on Criteo-shaped data, on a local PS cluster.

It writes Criteo-layout files (13 integer and 26 categorical features,
Zipf-distributed ids, cardinalities shaped like Criteo's and scaled down, a
learnable signal; `kfit_ps.data.criteo`), trains `jobs.dlrm.build_dlrm` with
`model.fit` on workers and ps tasks that are real server processes, with the
large embedding tables sharded over the ps tasks, and reports AUC on held-out
files. AUC well above 0.5 shows the model recovered the signal.
"""

import dataclasses
import tempfile
import time

from kfit_ps import validation


def _flag(default, flag):
    """A setting `kfit-ps quickstart` takes as `flag`; the CLI's default is `default`."""
    return dataclasses.field(default=default, metadata={"flag": flag})


@dataclasses.dataclass(frozen=True)
class QuickstartConfig:
    """Settings of the main job; those with a `flag` are `kfit-ps quickstart`'s flags, whose
    defaults are these (`QUICKSTART_FLAGS`)."""

    num_workers: int = _flag(2, "--workers")
    num_ps: int = _flag(2, "--ps")
    epochs: int = _flag(3, "--epochs")
    steps_per_epoch: int = _flag(100, "--steps-per-epoch")
    batch_size: int = 256
    num_examples: int = 100_000
    steps_per_execution: int = 5
    verbose: int = _flag(1, "--verbose")
    seed: int = 0

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            minimum = 0 if field.name in ("verbose", "seed") else 1
            validation.check_int(field.name, value, minimum, owner="QuickstartConfig")


# field name -> (flag, default): the settings `kfit-ps quickstart` takes.
QUICKSTART_FLAGS = {field.name: (field.metadata["flag"], field.default)
                    for field in dataclasses.fields(QuickstartConfig) if "flag" in field.metadata}


def run(config=None):
    """Trains on a fresh LocalCluster (or `kfit-ps run`'s cluster) with `config` (default
    `QuickstartConfig()`); returns held-out metrics."""
    import tensorflow as tf

    config = QuickstartConfig() if config is None else config

    workdir = tempfile.mkdtemp(prefix="kfit_ps_quickstart_")
    try:
        return _train_and_evaluate(config, workdir)
    finally:
        tf.io.gfile.rmtree(workdir)  # about 30 MB of generated data


def _train_and_evaluate(config, workdir):
    import keras

    import kfit_ps
    from kfit_ps.data import criteo
    from kfit_ps.jobs.dlrm import build_dlrm

    spec = criteo.CriteoSpec(scale=1e-3)
    train_files = criteo.generate(f"{workdir}/train", config.num_examples, spec, files=4,
                                  seed=config.seed)
    test_files = criteo.generate(f"{workdir}/test", 20_000, spec, files=1,
                                 seed=config.seed + 1)

    def dataset_fn(input_context):
        batch = input_context.get_per_replica_batch_size(config.batch_size)
        shard = [f for i, f in enumerate(train_files)
                 if i % input_context.num_input_pipelines == input_context.input_pipeline_id]
        return criteo.dataset(shard or train_files, batch, spec)

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
        model.fit(kfit_ps.DatasetCreator(dataset_fn), epochs=config.epochs,
                  steps_per_epoch=config.steps_per_epoch, verbose=config.verbose)
        test = criteo.dataset(test_files, 1024, spec, shuffle=False, repeat=False)
        results = model.evaluate(test, return_dict=True, verbose=0)
        results["iterations"] = int(model.optimizer.iterations.numpy())
    results["seconds"] = time.monotonic() - started
    print(f"held-out: auc={results['auc']:.4f} loss={results['loss']:.3f} "
          f"(steps trained: {results['iterations']}, {results['seconds']:.1f}s)", flush=True)
    return results
