"""Keras 3 variables stored as shards on several ps tasks.

Under a `ParameterServerStrategy` with a `variable_partitioner`, TensorFlow
creates a variable whose partitioner asks for more than one shard as a
`ShardedVariable` (shard `i` holds rows `offsets[i]:offsets[i+1]`, "div"
layout, shards round-robin over the ps tasks). A Keras 3 variable then holds
that `ShardedVariable` as its storage. Out of the box this breaks in the
ways below, which `install_sharding_support()` mends for variables created
under a kfit_ps scope only:

1. **Initialization.** Keras creates `tf.Variable(lambda: init(full_shape))`
   without a shape, so TensorFlow builds the *whole* initial value on the
   coordinator and slices it. Here the variable gets its shape and a
   partition-aware initial value: each shard's value is made for that shard,
   on its ps, with the distribution of the whole variable
   (`_PartitionAwareInit`, `sharded_init.shard_value`).
2. **Optimizer slots.** Keras creates a slot "colocated with" its variable;
   for a `ShardedVariable` TensorFlow then puts one unsharded slot on the
   coordinator. Here a slot of a sharded variable is sharded the same way,
   shard `i` colocated with the variable's shard `i`.
3. **Reading to numpy** (`variable.numpy()`, `get_weights`, `save_weights`,
   `model.save`): the shards are concatenated on the coordinator (Keras'
   own code would fail on a `ShardedVariable`). Loading assigns a whole
   value, which `ShardedVariable.assign` splits, whatever the shard count.
   A `tf.train.Checkpoint` saves the whole value too, and restores it into
   any number of shards.
4. **Lookups.** `ops.take(table, ids, axis=0)` (what `keras.layers.Embedding`
   does) would concatenate every shard each step. Here it becomes one gather
   per shard, on that shard's ps task, so only the touched rows travel
   (unless the active `CachedReadScope` holds the whole value: then the
   gather runs on the worker). In a step the rows of the batch's ids may
   already have been fetched with the step's packed transfer
   (`embedding_inputs`, `CachedReadScope.fetched_lookup`): a lookup of
   those very ids then gathers from them on the worker.

5. **Dense optimizer updates and weight decay.** For optimizers without a
   sparse path (`kfit_ps.training.step.sharded_updates`), the Keras optimizer's
   own `apply` updates the whole sharded variable: its per-variable update
   and its weight decay skip `extended.update` (which needs a single device)
   for sharded variables; the decay runs shard by shard, on each shard's ps.

6. **Gradients already on the ps.** Keras' TensorFlow optimizer "all-reduces"
   each gradient in the replica context before updating; with one replica
   per worker (kfit_ps refuses more) that is an identity, but its identity
   ops run on the worker, which would pull a gradient that
   `kfit_ps.training.step.transfers` already moved to its ps back to the worker.
   For kfit_ps variables the gradients are passed on unchanged.

Gradients with respect to a sharded variable are taken with respect to its
shards (`shards(variable)`); see `kfit_ps.training.step.sharded_updates`.
"""

import functools
import threading

import tensorflow as tf
from keras.src.backend.common.stateless_scope import get_stateless_scope
from keras.src.backend.common.variables import Variable as KerasVariable
from keras.src.backend.tensorflow import core as _tf_core
from keras.src.backend.tensorflow import numpy as _tf_numpy
from keras.src.backend.tensorflow import optimizer as _tf_optimizer
from keras.src.optimizers import base_optimizer as _base_optimizer
from tensorflow.python.distribute.sharded_variable import ShardedVariable

from kfit_ps._tf_compat.keras_variables import is_kfit_variable, mark_kfit_variable, storage
from kfit_ps._tf_compat.read_cache import CachedReadScope, cached_read
from kfit_ps._tf_compat.sharded_init import shard_value
from kfit_ps._tf_compat.versions import check_versions

_lock = threading.Lock()
_installed = False


def sharded_storage(variable):
    """The `ShardedVariable` behind a Keras or TF variable, or None if not sharded."""
    inner = storage(variable) if isinstance(variable, KerasVariable) else variable
    return inner if isinstance(inner, ShardedVariable) else None


def shards(variable):
    """The `tf.Variable` components of a (Keras) variable: one when not sharded."""
    sharded = sharded_storage(variable)
    if sharded is not None:
        return list(sharded.variables)
    inner = storage(variable) if isinstance(variable, KerasVariable) else variable
    return [inner]


def variable_partitioner(strategy):
    """The partitioner a TF parameter-server strategy was created with (or None)."""
    return getattr(strategy.extended, "_variable_partitioner", None)


class _PartitionAwareInit:
    """A Keras initializer as a TF initial value that can make one shard at a time."""

    def __init__(self, initializer, shape, dtype):
        self.initializer, self.shape, self.dtype = initializer, tuple(shape), dtype

    def __call__(self, partition_shape=None, partition_offset=None):
        if partition_shape is None:
            return self.initializer(self.shape, dtype=self.dtype)
        return shard_value(self.initializer, self.shape, self.dtype, partition_shape,
                           partition_offset)


def _active_partitioner():
    if not tf.distribute.has_strategy():
        return None
    return variable_partitioner(tf.distribute.get_strategy())


def _initialize_with_initializer(stock):
    def initialize(self, initializer):
        if _active_partitioner() is None or len(self._shape) == 0:
            return stock(self, initializer)
        self._value = tf.Variable(
            _PartitionAwareInit(initializer, self._shape, self._dtype),
            shape=self._shape,
            dtype=self._dtype,
            trainable=self.trainable,
            name=self.name,
            aggregation=self._map_aggregation(self.aggregation),
            synchronization=self._map_synchronization(self.synchronization),
        )

    initialize._kfit_ps_stock = stock
    return initialize


def _colocated_shards_creator(reference, next_creator, **kwargs):
    """Creates a variable sharded like `reference`, shard i next to its shard i."""
    initial_value = kwargs["initial_value"]
    name = kwargs.get("name") or "slot"

    @functools.lru_cache(maxsize=1)
    def whole():  # Only for a value that cannot be made per shard; built once.
        return tf.convert_to_tensor(initial_value() if callable(initial_value) else initial_value)

    parts, offset = [], 0
    for i, ref in enumerate(reference.variables):
        shape = tuple(ref.shape)
        if isinstance(initial_value, _PartitionAwareInit):
            value = functools.partial(initial_value, partition_shape=shape,
                                      partition_offset=(offset,) + (0,) * (len(shape) - 1))
        else:
            value = functools.partial(lambda start, stop: whole()[start:stop],
                                      offset, offset + shape[0])
        # `colocate_with` is how the strategy's creator learns to place (and not shard) it.
        parts.append(next_creator(**dict(kwargs, initial_value=value, shape=shape,
                                         name=f"{name}/part_{i}", colocate_with=ref)))
        offset += shape[0]
    return mark_kfit_variable(ShardedVariable(parts))


def _add_variable_from_reference(stock):
    def add(self, reference_variable, name=None, initializer="zeros"):
        reference = sharded_storage(reference_variable)
        if reference is None:
            return stock(self, reference_variable, name=name, initializer=initializer)
        # Not the TF optimizer's colocate_vars_with(ShardedVariable): see the module doc.
        with tf.variable_creator_scope(functools.partial(_colocated_shards_creator, reference)):
            return _base_optimizer.BaseOptimizer.add_variable_from_reference(
                self, reference_variable, name=name, initializer=initializer)

    add._kfit_ps_stock = stock
    return add


def _take(stock):
    def take(x, indices, axis=None):
        sharded = sharded_storage(x) if isinstance(x, KerasVariable) else None
        if (sharded is None or axis != 0 or isinstance(indices, tf.SparseTensor)
                or cached_read(x)):  # A whole value already on this worker.
            return stock(x, indices, axis=axis)
        scope = get_stateless_scope()
        fetched = (scope.fetched_lookup(x, indices) if isinstance(scope, CachedReadScope)
                   else None)
        if fetched is not None:
            return fetched
        ids = tf.convert_to_tensor(indices)
        if not ids.dtype.is_integer:
            ids = tf.cast(ids, "int64")
        # One gather per shard, on its own ps task ("div" layout, as TF shards).
        return tf.compat.v1.nn.embedding_lookup(sharded.variables, ids,
                                                partition_strategy="div")

    take._kfit_ps_stock = stock
    return take


def embedding_inputs(model):
    """[(index in the model's flat inputs, layer)] of a Keras 3.15 functional model's
    `keras.layers.Embedding` layers (exactly that class, without LoRA or quantization)
    whose table is sharded and that the model calls once, on one of its own inputs.

    Such a layer's lookup ids are known before the forward pass runs
    (`standardized_inputs`), so a training step can fetch their rows with its
    other reads; anything else keeps its lookup in the forward pass.
    """
    import keras
    from keras.src.models.functional import Functional

    check_versions()
    if not isinstance(model, Functional) or type(model).call is not Functional.call:
        return []  # A model's own `call` may call its layers on anything.
    inputs = list(model.inputs)
    found = []
    for layer in model.layers:
        if (type(layer) is not keras.layers.Embedding or layer.lora_enabled
                or layer.quantization_mode is not None or not layer.built
                or sharded_storage(layer._embeddings) is None):
            continue
        nodes = layer._inbound_nodes
        if len(nodes) != 1 or nodes[0].arguments.kwargs or len(nodes[0].arguments.args) != 1:
            continue
        source = nodes[0].arguments.args[0]
        index = next((i for i, t in enumerate(inputs) if t is source), None)
        if index is not None:
            found.append((index, layer))
    return found


def standardized_inputs(model, x):
    """The flat input tensors Keras 3.15's functional `model(x)` hands its layers."""
    check_versions()
    return model._standardize_inputs(x)


def embedding_table(layer):
    """The Keras variable Keras 3.15's `keras.layers.Embedding.call` looks up."""
    check_versions()
    return layer._embeddings


def _array(stock):
    def __array__(self, dtype=None, *args, **kwargs):
        sharded = sharded_storage(self)
        if sharded is None:
            return stock(self, dtype, *args, **kwargs)
        value = tf.convert_to_tensor(sharded).numpy()  # Concatenated on the coordinator.
        return value if dtype is None else value.astype(dtype)

    __array__._kfit_ps_stock = stock
    return __array__


def _serialize_to_tensors(stock):
    def serialize(self):
        sharded = sharded_storage(self)
        if sharded is None:
            return stock(self)
        # The whole value: a checkpoint does not depend on the shard count.
        return {"VARIABLE_VALUE": tf.convert_to_tensor(sharded)}

    serialize._kfit_ps_stock = stock
    return serialize


def _restore_from_tensors(stock):
    def restore(self, restored_tensors):
        sharded = sharded_storage(self)
        if sharded is None:
            return stock(self, restored_tensors)
        return sharded.assign(restored_tensors["VARIABLE_VALUE"])  # Split across shards.

    restore._kfit_ps_stock = stock
    return restore


def _distributed_update_step(stock):
    def update(self, distribution, grads_and_vars, learning_rate):
        plain = []
        for grad, var in list(grads_and_vars):
            if sharded_storage(var) is not None:
                # `extended.update` needs one device per variable; a sharded variable's
                # dense update reads and writes every shard through its storage instead.
                self.update_step(grad, var, learning_rate)
            else:
                plain.append((grad, var))
        return stock(self, distribution, plain, learning_rate)

    update._kfit_ps_stock = stock
    return update


def _apply_weight_decay(stock):
    def apply_weight_decay(self, variables):
        if self.weight_decay is None:
            return stock(self, variables)
        plain = []
        for variable in variables:
            sharded = sharded_storage(variable)
            if sharded is None:
                plain.append(variable)
            elif self._use_weight_decay(variable):
                # Keras' formula (variable -= variable * decay * lr), shard by shard on its ps.
                for shard in sharded.variables:
                    with tf.device(shard.device):
                        lr = tf.cast(self.learning_rate, shard.dtype)
                        decay = tf.cast(self.weight_decay, shard.dtype)
                        shard.assign_sub(shard * decay * lr)
        return stock(self, plain)

    apply_weight_decay._kfit_ps_stock = stock
    return apply_weight_decay


def _all_reduce_sum_gradients(stock):
    def all_reduce(self, grads_and_vars):
        grads_and_vars = list(grads_and_vars)
        if grads_and_vars and all(is_kfit_variable(v) for _, v in grads_and_vars):
            return grads_and_vars  # One replica per worker: the sum is the gradient.
        return stock(self, grads_and_vars)

    all_reduce._kfit_ps_stock = stock
    return all_reduce


def install_sharding_support():
    """Installs the changes above once per process (idempotent, thread-safe)."""
    global _installed
    with _lock:
        if _installed:
            return
        check_versions()
        patches = [
            (_tf_core.Variable, "_initialize_with_initializer", _initialize_with_initializer),
            (_tf_optimizer.TFOptimizer, "add_variable_from_reference",
             _add_variable_from_reference),
            (_tf_numpy, "take", _take),
            (_tf_core.Variable, "__array__", _array),
            (_tf_optimizer.TFOptimizer, "_distributed_tf_update_step", _distributed_update_step),
            (_tf_optimizer.TFOptimizer, "_apply_weight_decay", _apply_weight_decay),
            (_tf_optimizer.TFOptimizer, "_all_reduce_sum_gradients", _all_reduce_sum_gradients),
            (_tf_core.Variable, "_serialize_to_tensors", _serialize_to_tensors),
            (_tf_core.Variable, "_restore_from_tensors", _restore_from_tensors),
        ]
        for owner, name, wrap in patches:
            current = getattr(owner, name)
            if not hasattr(current, "_kfit_ps_stock"):
                setattr(owner, name, wrap(current))
        _installed = True
