"""Turning what users pass to `fit` / `evaluate` / `predict` into worker input.

Two kinds of input exist under parameter servers:

- `WorkerInput`: every worker builds and iterates its *own* dataset; a
  scheduled step takes the next batch of the worker it happens to run on.
  Used for all training input and for `DatasetCreator` / infinite datasets in
  `evaluate` and `predict` (which then need `steps`).
- `ShippedInput`: finite data read on the coordinator and sent, batch by
  batch, as the argument of each scheduled function. Every batch is used
  exactly once and predictions come back in order. Used for numpy arrays and
  finite `tf.data.Dataset`s in `evaluate`, `predict` and validation.
- Sharded evaluation (a `WorkerInput` with `sharded=True`): a finite dataset
  each worker builds itself, split into shards (`_tf_compat.shard_dataset`);
  each scheduled function evaluates one whole shard and returns its metric
  state, so a shard re-run after a worker died counts once. Used by
  `evaluate` and validation for a `DatasetCreator` given without `steps`,
  and for a dataset wrapped in `kfit_ps.shardable(...)`.

How each supported input is split across workers:

| input | training | evaluate / predict / validation |
| --- | --- | --- |
| `DatasetCreator(fn)` | `fn` runs on each worker (finite, without `steps_per_epoch`: one-pass epochs) | without `steps`: `fn` runs on each worker, its finite dataset evaluated in shards, exactly once (predict: `steps` required); with `steps`: that many batches of the workers' datasets |
| `tf.data.Dataset` (batched) | finite, without `steps_per_epoch`: one-pass epochs; else a copy on each worker, repeated | finite: shipped in order; infinite: per worker, `steps` required |
| `kfit_ps.shardable(dataset)` | as the dataset | a copy on each worker, evaluated in shards, exactly once |
| `kfit_ps.ledger.split_shuffle(dataset, n)` | a file pipeline's one-pass epochs, its records shuffled within each split | refused |
| numpy arrays / tensors `(x, y[, sample_weight])` | without `steps_per_epoch`: one-pass epochs; else a copy on each worker, shuffled independently, repeated, batched | shipped in order |

One-pass epochs (`fit` without `steps_per_epoch` on finite data) read each
batch by index on the worker that trains it (`WorkerInput.one_pass`, a
`kfit_ps.ledger` source); see `kfit_ps.ledger`.
"""

import dataclasses
import math
import re

import numpy as np
import tensorflow as tf

import kfit_ps.ledger as ledger
from kfit_ps import _tf_compat, validation
from kfit_ps.training.inputs.dataset_creator import DatasetCreator

SUPPORTED_INPUTS = (
    "kfit_ps.DatasetCreator(dataset_fn), a batched tf.data.Dataset, or numpy arrays / "
    "tensors (x, y[, sample_weight]) (also lists/dicts of them)"
)
DEFAULT_BATCH_SIZE = 32


@dataclasses.dataclass(frozen=True)
class WorkerInput:
    """A dataset built on each worker (from `dataset_fn`, or a copy of `dataset`)."""

    element_spec: object
    dataset_fn: object = None
    dataset: object = None
    options: object = None
    num_batches: int = None  # Batches in one pass, when known.
    finite: bool = False  # The dataset ends (evaluation can then be split in shards).
    sharded: bool = False  # Only sharded evaluation applies (`shardable(dataset)`).
    num_shards: int = None  # None: `default_num_shards`.
    # For training: a function returning the `kfit_ps.ledger` source of one-pass epochs
    # (finite data, `fit` without `steps_per_epoch`); it raises when the data has none.
    one_pass: object = dataclasses.field(default=None, compare=False, repr=False)
    # For training: the finite tf.data.Dataset given, which the coordinator can read itself
    # and ship batch by batch when workers cannot read it by index (`training.inputs.shipped`).
    shippable: object = dataclasses.field(default=None, compare=False, repr=False)
    # For training: the `kfit_ps.ledger.split_shuffle` asked for (one-pass epochs only).
    split_shuffle: object = dataclasses.field(default=None, compare=False, repr=False)
    # For evaluation: the finite dataset `dataset_fn` built on the coordinator when adapted,
    # kept to pick how it is split (`_tf_compat.shard_policy`) without building it again.
    sample: object = dataclasses.field(default=None, compare=False, repr=False)


class Shardable:
    """A finite evaluation input that workers read themselves, in shards (`shardable`)."""

    def __init__(self, data, num_shards=None):
        if not (isinstance(data, tf.data.Dataset) or is_dataset_creator(data)):
            raise ValueError(
                "`kfit_ps.shardable(data)` takes a finite tf.data.Dataset of batches or a "
                f"kfit_ps.DatasetCreator. Received: data of type {type(data).__name__}. Pass "
                "the evaluation dataset itself.")
        self.data = data
        self.num_shards = validation.check_optional_int("num_shards", num_shards, 1)


def shardable(data, num_shards=None):
    """Marks evaluation data that workers read themselves, split into shards.

    `model.evaluate(kfit_ps.shardable(dataset))` (or as `validation_data`)
    sends each worker a copy of the dataset's pipeline instead of shipping
    every batch from the coordinator. The data is split into `num_shards`
    shards (default: 5 per worker); each scheduled function evaluates one
    whole shard, so every batch counts exactly once, also when a worker dies
    and its shard runs again elsewhere. A pipeline that reads at least
    `num_shards` files is split by file; otherwise each shard reads the whole
    pipeline and keeps its part. A `DatasetCreator` given to `evaluate`
    without `steps` is evaluated this way without the wrapper.
    """
    return Shardable(data, num_shards)


def default_num_shards(num_workers):
    """Shards of a sharded evaluation when not given: 5 per worker (as tf_keras' "auto")."""
    return 5 * max(1, num_workers)


@dataclasses.dataclass(frozen=True)
class ShippedInput:
    """A finite dataset of batches read on the coordinator and shipped per step."""

    dataset: object
    element_spec: object
    num_batches: int = None  # None when the cardinality is unknown.


def is_dataset_creator(x):
    """Whether `x` is a kfit_ps (or tf_keras) `DatasetCreator`."""
    return isinstance(x, DatasetCreator) or (
        type(x).__name__ == "DatasetCreator" and callable(getattr(x, "dataset_fn", None))
    )


def as_dataset_creator(x):
    """A kfit_ps `DatasetCreator` for a kfit_ps or tf_keras one."""
    if isinstance(x, DatasetCreator):
        return x
    return DatasetCreator(x.dataset_fn, getattr(x, "input_options", None))


def is_array_like(leaf):
    return isinstance(leaf, (np.ndarray, tf.Tensor, np.generic)) or hasattr(leaf, "__array__")


def _tuples(structure):
    """Lists of arrays become tuples: tf.data would stack a list into one tensor."""
    if isinstance(structure, (list, tuple)):
        return tuple(_tuples(item) for item in structure)
    if isinstance(structure, dict):
        return {key: _tuples(value) for key, value in structure.items()}
    return structure


def _to_arrays(structure):
    return tf.nest.map_structure(
        lambda a: a if isinstance(a, tf.Tensor) else np.asarray(a), _tuples(structure))


def _num_rows(structure, arg):
    sizes = {int(a.shape[0]) for a in tf.nest.flatten(structure) if len(a.shape) > 0}
    if len(sizes) != 1:
        raise ValueError(
            f"`{arg}`: all arrays must have the same number of rows (first dimension). "
            f"Received row counts: {sorted(sizes) or 'none (scalars)'}."
        )
    return sizes.pop()


def _unsupported(arg, value):
    return ValueError(
        f"Parameter-server training does not support `{arg}` of type {type(value).__name__}. "
        f"Supported inputs: {SUPPORTED_INPUTS}. Received: {arg}={value!r:.200}."
    )


_WHERE_INSTEAD = {
    "y": "Put the targets in the dataset's elements as (x, y[, sample_weight]).",
    "sample_weight": "Put the weights in the dataset's elements as (x, y, sample_weight).",
    "batch_size": "Batch inside the dataset (e.g. `dataset.batch(32)`).",
}


def _made_here(dataset, arg):
    """`dataset`, rebuilt on the cluster's chief when it was made before the strategy
    connected to the cluster; a ValueError when it cannot be."""
    try:
        return _tf_compat.on_this_context(dataset)
    except _tf_compat.Unserializable as e:
        reason = re.sub(r"\{\{function_node [^}]*\}\}\s*|\s*\[Op:.*$", "", e.reason)
        raise ValueError(
            f"`{arg}` was made before the strategy connected to the cluster, and it uses "
            f"state of this process that TensorFlow cannot move to the cluster's devices "
            f"(TensorFlow says {reason!r}). Received: a tf.data.Dataset made on "
            f"/job:localhost. Create the strategy first (the line after the imports), then "
            f"build the data and its preprocessing (lookup tables, FeatureSpace).") from None


def _check_no_extra(arg, kind, **extras):
    for name, value in extras.items():
        if value is not None:
            raise ValueError(
                f"`{name}` must be None when `{arg}` is a {kind}. Received: {name}={value!r:.80} "
                f"of type {type(value).__name__}. {_WHERE_INSTEAD[name]}"
            )


def adapt(x, y=None, sample_weight=None, *, batch_size=None, shuffle=True, training,
          arg="x"):
    """Returns a `WorkerInput` or `ShippedInput` for `(x, y, sample_weight)`.

    Args:
        training: True for training data (always `WorkerInput`: a stream, or one-pass
            epochs through its `one_pass` source).
        arg: the argument name used in error messages.
    """
    batch_size = validation.check_optional_int("batch_size", batch_size, 1)
    if x is None:
        raise ValueError(f"`{arg}` is required. Supported inputs: {SUPPORTED_INPUTS}.")
    num_shards, sharded, split_shuffle = None, False, None
    if isinstance(x, ledger.SplitShuffle):
        if not training:
            raise ValueError(
                f"`{arg}`: kfit_ps.ledger.split_shuffle(...) shuffles training data (fit's "
                "`x`), and evaluation reads every batch as it comes. Received: "
                f"split_shuffle(...) as `{arg}`. Pass the dataset unwrapped.")
        split_shuffle, x = x, x.dataset  # Rebuilt below if made before the strategy.
    if isinstance(x, Shardable):
        if not training:
            sharded = True
            _check_no_extra(arg, "kfit_ps.shardable(...)", y=y, sample_weight=sample_weight,
                            batch_size=batch_size)
            num_shards = x.num_shards
        x = x.data

    if is_dataset_creator(x):
        _check_no_extra(arg, "DatasetCreator", y=y, sample_weight=sample_weight,
                        batch_size=batch_size)
        creator = as_dataset_creator(x)
        if training:  # Only the element spec is needed: no eager call (see `_traced_spec`).
            context = tf.distribute.InputContext()
            return WorkerInput(
                element_spec=_traced_spec(creator), dataset_fn=creator,
                options=creator.input_options,
                one_pass=lambda: ledger.dataset_source(creator(context), arg,
                                                       build=lambda: creator(context)))
        sample = creator(tf.distribute.InputContext())
        finite = int(sample.cardinality()) != tf.data.INFINITE_CARDINALITY
        return WorkerInput(element_spec=sample.element_spec, dataset_fn=creator,
                           options=creator.input_options, num_shards=num_shards,
                           finite=finite, sample=sample if finite else None)

    if isinstance(x, tf.data.Dataset):
        _check_no_extra(arg, "tf.data.Dataset", y=y, sample_weight=sample_weight,
                        batch_size=batch_size)
        x = _made_here(x, arg)
        cardinality = int(x.cardinality())
        if sharded:
            if cardinality == tf.data.INFINITE_CARDINALITY:
                raise ValueError(
                    f"`{arg}`: kfit_ps.shardable(...) needs a finite dataset (each shard is "
                    "evaluated to its end). Received an infinite dataset (it repeats). Remove "
                    "`.repeat()`, or pass the dataset unwrapped with `steps`.")
            return WorkerInput(element_spec=x.element_spec, dataset=x, finite=True,
                               sharded=True, num_shards=num_shards,
                               num_batches=cardinality if cardinality >= 0 else None)
        if training or cardinality == tf.data.INFINITE_CARDINALITY:
            dataset = x if cardinality == tf.data.INFINITE_CARDINALITY else x.repeat()
            return WorkerInput(element_spec=x.element_spec, dataset=dataset,
                               num_batches=cardinality if cardinality >= 0 else None,
                               one_pass=lambda: ledger.dataset_source(x, arg,
                                                                      split_shuffle=split_shuffle),
                               shippable=x if cardinality > 0 and not split_shuffle else None,
                               split_shuffle=split_shuffle)
        return ShippedInput(dataset=x, element_spec=x.element_spec,
                            num_batches=cardinality if cardinality >= 0 else None)

    structure = tuple(v for v in (x, y, sample_weight) if v is not None)
    leaves = tf.nest.flatten(structure)
    if not leaves or not all(is_array_like(leaf) for leaf in leaves):
        bad = next((leaf for leaf in leaves if not is_array_like(leaf)), x)
        raise _unsupported(arg, bad if leaves else x)
    arrays = _to_arrays(structure)
    if len(arrays) == 1 and not isinstance(arrays[0], tuple):  # (x,) keeps a tuple x whole
        arrays = arrays[0]
    rows = _num_rows(arrays, arg)
    batch_size = batch_size or DEFAULT_BATCH_SIZE
    num_batches = math.ceil(rows / batch_size)
    if training:
        def dataset_fn(input_context):
            dataset = tf.data.Dataset.from_tensor_slices(arrays)
            if shuffle:
                dataset = dataset.shuffle(rows, reshuffle_each_iteration=True)
            batch = input_context.get_per_replica_batch_size(batch_size)
            return dataset.repeat().batch(batch).prefetch(tf.data.AUTOTUNE)

        dataset_fn.__name__ = f"{arg}_arrays"
        creator = DatasetCreator(dataset_fn)
        spec = creator(tf.distribute.InputContext()).element_spec
        source = ledger.ArraySource(arrays, rows, batch_size, shuffle)
        return WorkerInput(element_spec=spec, dataset_fn=creator, num_batches=num_batches,
                           one_pass=lambda: source)
    dataset = tf.data.Dataset.from_tensor_slices(arrays).batch(batch_size)
    return ShippedInput(dataset=dataset, element_spec=dataset.element_spec,
                        num_batches=num_batches)


def _traced_spec(creator):
    """The element spec of `creator`'s dataset, built in a throw-away graph.

    Built eagerly, a dataset's functions (its `map`s, `filter`s, ...) are
    registered with every task of the cluster, then removed again when the
    dataset goes: two calls to each server per function, in every `fit`.
    `dataset_fn` is traced into a graph on the workers anyway, so it builds in
    one here; if it cannot (e.g. it captures an eager tensor), it runs eagerly.
    """
    try:
        with tf.Graph().as_default():
            return creator(tf.distribute.InputContext()).element_spec
    except Exception:  # noqa: BLE001 - the eager call below raises what the user must see
        return creator(tf.distribute.InputContext()).element_spec



def split_for_validation(x, y, sample_weight, validation_split, validation_data):
    """`((x, y, sample_weight), validation_data)` after Keras' `validation_split`.

    As in Keras: the last `validation_split` of the rows of arrays, taken before any
    shuffling, become the validation data (unless `validation_data` is given, which
    wins); other inputs are refused, since workers read them themselves.
    """
    if not validation_split:
        return (x, y, sample_weight), validation_data
    if isinstance(validation_split, bool) or not isinstance(
            validation_split, (int, float, np.number)) or not 0 < validation_split < 1:
        raise ValueError("`validation_split` must be a float between 0 and 1. Received: "
                         f"validation_split={validation_split!r}.")
    if validation_data is not None:
        return (x, y, sample_weight), validation_data
    leaves = [leaf for v in (x, y, sample_weight) if v is not None for leaf in tf.nest.flatten(v)]
    if not leaves or not all(is_array_like(leaf) for leaf in leaves):
        raise ValueError(
            "`validation_split` is only supported for arrays (NumPy arrays or tensors), as in "
            f"Keras. Received: x of type {type(x).__name__}. Pass `validation_data` instead "
            "(and `validation_steps` for an infinite dataset).")
    return _tf_compat.train_validation_split((x, y, sample_weight), validation_split)


def with_class_weight(x, y, sample_weight, class_weight):
    """`(x, sample_weight)` with Keras' `class_weight` applied, as Keras applies it.

    Arrays get per-example weights from their labels (refused beside a
    `sample_weight`, as in Keras); a `tf.data.Dataset`, and the dataset a
    `DatasetCreator` makes on each worker, are mapped to add them.
    """
    if class_weight is None:
        return x, sample_weight
    if not isinstance(class_weight, dict) or not class_weight:
        raise ValueError("`class_weight` must be a dict of class index -> weight, as in Keras. "
                         f"Received: class_weight={class_weight!r}.")
    if is_dataset_creator(x) or isinstance(x, tf.data.Dataset):
        add_weights = _tf_compat.class_weight_map_fn(class_weight)
        if isinstance(x, tf.data.Dataset):
            return x.map(add_weights), sample_weight
        creator = as_dataset_creator(x)
        return DatasetCreator(lambda context: creator(context).map(add_weights),
                              creator.input_options), sample_weight
    if sample_weight is not None:
        raise ValueError("You cannot pass `class_weight` and `sample_weight` at the same time "
                         "(Keras refuses it too). Received both. Fold the class weights into "
                         "`sample_weight`, or drop one of them.")
    if y is None:
        raise ValueError("`class_weight` weighs examples by their labels, and no `y` was given. "
                         "Pass `y`, or per-example `sample_weight` instead.")
    return x, _tf_compat.class_weight_to_sample_weights(y, class_weight)


def check_steps(name, value, required_because=None):
    """Validates a `steps`-like argument; returns it (None allowed unless required)."""
    if value is None:
        if required_because:
            raise ValueError(
                f"`{name}` is required {required_because}: parameter-server workers read "
                f"their own (usually repeated) datasets, so the end of the data does not end "
                f"the loop. Received: {name}=None. Pass e.g. {name}=100."
            )
        return None
    return validation.check_int(name, value, 1,
                                hint=f"Pass the number of batches, e.g. {name}=100.")


def static_batch_size(adapted):
    """Examples per step of an adapted input when its batch dimension is static, else None."""
    for spec in tf.nest.flatten(adapted.element_spec):
        shape = getattr(spec, "shape", None)
        if shape is not None and shape.rank and shape[0] is not None:
            return int(shape[0])
    return None
