"""Hooks into the Keras 3 TensorFlow trainer.

`install_dispatch` wraps `keras.Model.fit` / `evaluate` / `predict` (and the
`*_on_batch` methods) so that a
model whose distribution strategy satisfies a predicate is trained by another
implementation (kfit_ps's parameter-server loop); every other model runs
Keras' own method unchanged. The remaining functions read the few private
trainer attributes the loop needs.
"""

import contextlib
import functools
import re
import threading

import tensorflow as tf
from keras.src import backend, tree
from keras.src.backend.tensorflow import trainer as _tf_trainer
from keras.src.backend.common.variables import Variable as KerasVariable
from keras.src.callbacks.monitor_callback import MonitorCallback
from keras.src.losses import loss as loss_module
from keras.src.trainers import data_adapters
from keras.src.utils import io_utils

from kfit_ps._tf_compat.read_cache import CachedReadScope
from kfit_ps._tf_compat.versions import check_versions

_METHODS = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch")
_install_lock = threading.Lock()
_handlers = {}


def model_strategy(model):
    """The strategy a Keras model was created under, or None."""
    return getattr(model, "_distribute_strategy", None)


def symbolic_build(model, data_batch):
    """Builds model, compiled loss/metrics and optimizer state from a batch spec.

    `data_batch` is a structure of objects with `.shape` and `.dtype` (for
    example `tf.TensorSpec`s from `Dataset.element_spec`). Variables are created
    in the caller's scope.
    """
    model._symbolic_build(data_batch=data_batch)


def build_for_predict(model, data_batch):
    """Builds the model's own variables from a batch spec, as Keras' `predict` needs.

    Unlike `symbolic_build`, it needs no `compile()` and no targets: only `x`
    of `data_batch` is used. Does nothing for a built model.
    """
    if all(layer.built for layer in model._flatten_layers()):
        return
    symbolic = tree.map_structure(
        lambda v: None if v is None else backend.KerasTensor(
            v.shape, backend.standardize_dtype(v.dtype)), data_batch)
    x, _, _ = data_adapters.data_adapter_utils.unpack_x_y_sample_weight(symbolic)
    backend.compute_output_spec(model, x, training=False)


def improvement_test(model, monitor, mode):
    """`better(current, best)` for `monitor`, with Keras' `MonitorCallback` rules.

    `mode` "auto" takes the direction from the model's compiled metric of that
    name (so `cosine_similarity` is maximised), "min" for the loss; an unknown
    direction is Keras' ValueError, which asks for `mode`.
    """
    monitor_callback = MonitorCallback(monitor=monitor, mode=mode)
    monitor_callback.set_model(model)
    monitor_callback._set_monitor_op()
    return lambda current, best: bool(monitor_callback._is_improvement(current, best))


def print_msg(message, line_break=True):
    """Keras' own console output, silent under `keras.config.disable_interactive_logging()`."""
    io_utils.print_msg(message, line_break=line_break)


def flatten_metrics_in_order(model, logs):
    """What Keras' `evaluate(return_dict=False)` returns for `logs`."""
    return model._flatten_metrics_in_order(logs)


def initial_epoch_override(model):
    """The epoch a Keras `BackupAndRestore` asked `fit` to resume from, or None."""
    return getattr(model, "_initial_epoch", None)


def _dispatching(name, stock):
    @functools.wraps(stock)
    def method(self, *args, **kwargs):
        for predicate, handlers in _handlers.values():
            handler = handlers.get(name)
            if handler is not None and predicate(self):
                return handler(self, *args, **kwargs)
        return stock(self, *args, **kwargs)

    method._kfit_ps_stock = stock
    return method


def install_dispatch(key, predicate, **handlers):
    """Routes `Model.fit/evaluate/predict/*_on_batch` of models where `predicate(model)` holds.

    `handlers` maps method names to replacements (a method without one, or
    with None, keeps Keras' own). Idempotent
    per `key`. Subclasses that override these methods themselves are not
    affected.
    """
    with _install_lock:
        check_versions()
        _handlers[key] = (predicate, dict(handlers))
        cls = _tf_trainer.TensorFlowTrainer
        for name in _METHODS:
            stock = getattr(cls, name)
            if not hasattr(stock, "_kfit_ps_stock"):
                setattr(cls, name, _dispatching(name, stock))


def stock_method(name):
    """Keras' own, undispatched `TensorFlowTrainer` method (for tests)."""
    method = getattr(_tf_trainer.TensorFlowTrainer, name)
    return getattr(method, "_kfit_ps_stock", method)




def has_stock_train_step(model):
    """Whether `model` uses Keras' own TensorFlow `train_step` (not overridden)."""
    return has_stock_step(model, "train_step")


def has_stock_step(model, name):
    """Whether `model`'s `name` (`train_step`, `test_step`, `predict_step`) is Keras' own
    TensorFlow step (not overridden)."""
    return getattr(type(model), name) is getattr(_tf_trainer.TensorFlowTrainer, name)


def sublayers(model):
    """Every layer inside `model`, nested ones included (not `model` itself)."""
    return list(model._flatten_layers(include_self=False))


def train_step_with(model, data, apply_gradients, cached=(), watcher=None, fetched=None):
    """Keras 3.15's TensorFlow `train_step`, with the gradient step supplied.

    `apply_gradients(tape, loss)` computes and applies the gradients; the rest
    (forward pass, loss, loss tracker, loss scaling, metrics) is Keras' own,
    line for line, so a model with sharded variables trains exactly like one
    without. `cached`: (variable, tensor) pairs the forward pass and loss read
    instead of the variables (`CachedReadScope`); the tape watches the
    trainable ones, so gradients are taken with respect to those tensors.
    `watcher` (optional): its `set_tape(tape)` is called as the tape opens
    (dynamic embeddings watch the rows they read on it), and the gradient
    step also runs when its `lookups` are not empty. `fetched` (optional): the
    step's rows of sharded tables fetched for the batch's ids; the tape
    watches its `rows` and the forward pass's lookups use its `lookups`
    (`CachedReadScope`).
    """
    x, y, sample_weight = data_adapters.data_adapter_utils.unpack_x_y_sample_weight(data)
    with tf.GradientTape() as tape:
        if watcher is not None:
            watcher.set_tape(tape)
        tape.watch([value for variable, value in cached if variable.trainable])
        lookups = fetched.lookups if fetched is not None else None
        if lookups:
            tape.watch(fetched.rows)
        with (CachedReadScope(cached, lookups) if cached or lookups
              else contextlib.nullcontext()):
            if model._call_has_training_arg:
                y_pred = model(x, training=True)
            else:
                y_pred = model(x)
            loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                       training=True)
            model._loss_tracker.update_state(
                loss_module.unscale_loss_for_distribution(loss),
                sample_weight=tf.shape(next(i for i in tree.flatten(x) if i is not None))[0])
        if model.optimizer is not None:
            loss = model.optimizer.scale_loss(loss)
    if model.trainable_weights or (watcher is not None and watcher.lookups):
        apply_gradients(tape, loss)
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def optimizer_slots(optimizer, variable):
    """The slot variables Keras 3.15's SGD, Adagrad and Adam keep for `variable`.

    Returns a dict (`momentum`; `accumulator`; `m`, `v`, `v_hat`), or None for
    other optimizers.
    """
    import keras

    index = optimizer._get_variable_index(variable)
    if isinstance(optimizer, keras.optimizers.Adam):
        slots = {"m": optimizer._momentums[index], "v": optimizer._velocities[index]}
        if optimizer.amsgrad:
            slots["v_hat"] = optimizer._velocity_hats[index]
        return slots
    if isinstance(optimizer, keras.optimizers.Adagrad):
        return {"accumulator": optimizer._accumulators[index]}
    if isinstance(optimizer, keras.optimizers.SGD):
        return {"momentum": optimizer.momentums[index]} if optimizer.momentum else {}
    return None


def uses_weight_decay(optimizer, variable):
    """Whether Keras 3.15's `optimizer` decays `variable` (honouring `exclude_from_weight_decay`).

    `variable` is a Keras variable, or the name of a table that has none (a
    dynamic table): a name is matched against the excluded `var_names` only.
    """
    if not optimizer.weight_decay:
        return False
    if isinstance(variable, str):
        pattern = getattr(optimizer, "_exclude_from_weight_decay_pattern", None)
        return pattern is None or re.search(pattern, variable) is None
    return bool(optimizer._use_weight_decay(variable))


def optimizer_scalars(optimizer):
    """The variables behind Keras 3.15's `optimizer.iterations` and a fixed learning rate.

    A learning-rate schedule has no variable of its own: it is a function of
    `iterations`.
    """
    if optimizer is None:
        return []
    rate = getattr(optimizer, "_learning_rate", None)
    scalars = [optimizer.iterations]
    if isinstance(rate, KerasVariable):
        scalars.append(rate)
    return scalars


def learning_rate_at(optimizer, iterations):
    """`optimizer`'s learning rate when its `iterations` is `iterations` (a float32 tensor).

    A schedule is evaluated at `iterations`; a fixed rate is the value it has
    when this is traced (the optimizer's own variable may live elsewhere).
    """
    import keras

    rate = optimizer._learning_rate
    if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
        return tf.cast(rate(iterations), tf.float32)
    if callable(rate):
        return tf.cast(rate(), tf.float32)
    with tf.init_scope():  # Read now, eagerly: a constant of the traced function.
        value = float(keras.ops.convert_to_numpy(rate))
    return tf.constant(value, tf.float32)


@contextlib.contextmanager
def keras_averages_off(optimizer):
    """Traces Keras' `optimizer.apply` without its moving-average update (kfit_ps does it).

    Keras 3.15 updates the averages, and overwrites the variables with them
    in a conditional, inside `_backend_apply_gradients` when `use_ema` is
    set; kfit_ps' `training.step.moving_averages` does both after the whole step.
    """
    saved = optimizer.use_ema
    optimizer.use_ema = False
    try:
        yield
    finally:
        optimizer.use_ema = saved


def moving_average_pairs(optimizer):
    """[(variable, its moving average)] of a built Keras 3.15 optimizer with `use_ema`."""
    averages = getattr(optimizer, "_model_variables_moving_average", None) or []
    return [(variable, average) for variable, average
            in zip(optimizer._trainable_variables, averages) if average is not None]


_load_hooks = {}


def install_load_weights_hook(key, predicate, hook):
    """Calls `hook(model)` before Keras' `Model.load_weights` when `predicate(model)` holds.

    Idempotent per `key`. Used to create optimizer slots before loading, so
    Keras loads them instead of skipping them with a warning.
    """
    from keras.src.models import model as _model

    with _install_lock:
        check_versions()
        _load_hooks[key] = (predicate, hook)
        stock = _model.Model.load_weights
        if hasattr(stock, "_kfit_ps_stock"):
            return

        @functools.wraps(stock)
        def load_weights(self, *args, **kwargs):
            for predicate_, hook_ in list(_load_hooks.values()):
                if predicate_(self):
                    hook_(self)
            return stock(self, *args, **kwargs)

        load_weights._kfit_ps_stock = stock
        _model.Model.load_weights = load_weights
