"""Splitting a worker's dataset into shards, with tf.data's auto-shard rewrite.

`shard_dataset(dataset, num_shards, index)` keeps shard `index` of
`num_shards` with TensorFlow's auto-shard rewrite (what tf_keras' exact
evaluation, `pss_evaluation_shards`, uses). `shard_policy` picks how: by file
when the pipeline reads at least `num_shards` files (each shard reads only its
files), otherwise by element (batch) at the end of the pipeline (each shard
reads everything and keeps its part). Either way every element lands in exactly one
shard, whatever the pipeline's own options say (`with_shard_policy`
overrides them; left OFF, every shard would see all data).
"""

import warnings

import tensorflow as tf
from tensorflow.python.distribute import input_lib, input_ops

from kfit_ps._tf_compat.versions import check_versions

AutoShardPolicy = tf.data.experimental.AutoShardPolicy


def _with_policy(dataset, policy):
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = policy
    return dataset.with_options(options)


def shard_policy(dataset, num_shards):
    """FILE when `dataset` reads at least `num_shards` files, otherwise DATA.

    Decided on the coordinator by applying the FILE rewrite to `dataset` and
    reading the first element of shard 0 (the rewrite's errors surface only
    then): TensorFlow's AUTO policy would instead fail on the workers for a
    pipeline with fewer files than shards.
    """
    check_versions()
    probe = _with_policy(dataset, AutoShardPolicy.FILE)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            next(iter(input_ops.auto_shard_dataset(probe, num_shards, 0)), None)
    except (tf.errors.InvalidArgumentError, tf.errors.NotFoundError,
            tf.errors.UnimplementedError):
        return AutoShardPolicy.DATA
    return AutoShardPolicy.FILE


def with_shard_policy(dataset, policy):
    """`dataset` split by `policy` (from `shard_policy`) in `shard_dataset`.

    Call it where the dataset is built: a dataset that arrives as a traced
    function's argument no longer knows its options.
    """
    return _with_policy(dataset, policy)


def shard_dataset(dataset, num_shards, index, policy):
    """Shard `index` (int64 scalar tensor) of `num_shards`, inside a traced function.

    `dataset`: a worker's `tf.data.Dataset` made with `with_shard_policy`, or
    the `DistributedDataset` of one; `policy`: the same policy. DATA keeps
    every `num_shards`-th element (batch) of the pipeline with a plain
    `Dataset.shard`; FILE applies the rewrite. A dataset that arrived as the
    function's argument reports default options while tracing (and the
    rewrite takes its policy from there), so the policy is set again.
    """
    check_versions()
    num_shards = tf.cast(num_shards, tf.int64)
    if isinstance(dataset, tf.data.Dataset):
        return _shard(dataset, num_shards, index, policy)
    # A `DistributedDataset` (a dataset built on the coordinator, each worker's copy): its
    # own `auto_shard` would read the policy from its components' options, which report
    # the default (AUTO) here and then tried files: a small `from_tensor_slices` dataset
    # failed with "the dataset only has 2 file(s)". Its components are sharded by `policy`.
    components = []
    for component in dataset._cloned_datasets:
        with tf.compat.v1.colocate_with(component._variant_tensor):
            components.append(_shard(component, num_shards, index, policy))
    return input_lib.DistributedDataset(
        dataset._input_workers, dataset._strategy, components=components,
        element_spec=dataset._element_spec, options=dataset._options,
        enable_get_next_as_optional=dataset._enable_get_next_as_optional)


def _shard(dataset, num_shards, index, policy):
    if policy == AutoShardPolicy.DATA:  # Every element of the pipeline, one in `num_shards`.
        return dataset.shard(num_shards, index)
    with warnings.catch_warnings():
        # `options()` in a traced function warns that serialized options may differ;
        # the policy is set again here, as where the dataset was built.
        warnings.simplefilter("ignore", UserWarning)
        return input_ops.auto_shard_dataset(_with_policy(dataset, policy), num_shards, index)


_SHUFFLE_OPS = ("ShuffleDataset", "ShuffleDatasetV2", "ShuffleDatasetV3",
                "ShuffleAndRepeatDataset", "ShuffleAndRepeatDatasetV2")


def shuffle_ops(dataset):
    """The shuffling ops of `dataset`'s pipeline (an eager dataset), sorted; [] when none.

    Read from the dataset's serialized graph (`_as_serialized_graph`, private).
    """
    check_versions()
    graph = tf.compat.v1.GraphDef()
    graph.ParseFromString(dataset._as_serialized_graph().numpy())  # noqa: SLF001
    ops = {node.op for node in graph.node}
    ops.update(node.op for function in graph.library.function for node in function.node_def)
    return sorted(ops & set(_SHUFFLE_OPS))


def external_state(dataset):
    """Why `dataset` (an eager dataset) cannot be copied to another task, or None.

    A pipeline that uses state of this process (a lookup table or a variable a
    `map` captures, e.g. an adapted preprocessing layer's; a stateful op) cannot
    be serialized without it: TensorFlow's own refusal (`ExternalStatePolicy.FAIL`,
    through the private `_as_serialized_graph`) is returned, its first line.
    """
    check_versions()
    try:
        dataset._as_serialized_graph(  # noqa: SLF001
            external_state_policy=tf.data.experimental.ExternalStatePolicy.FAIL)
    except (tf.errors.FailedPreconditionError, tf.errors.InvalidArgumentError) as e:
        return str(e).strip().splitlines()[0][:300]
    return None
