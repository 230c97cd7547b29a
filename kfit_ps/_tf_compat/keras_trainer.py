"""Hooks into the Keras 3 TensorFlow trainer.

`install_dispatch` wraps `keras.Model.fit` / `evaluate` / `predict` so that a
model whose distribution strategy satisfies a predicate is trained by another
implementation (kfit_ps's parameter-server loop); every other model runs
Keras' own method unchanged. The remaining functions read the few private
trainer attributes the loop needs.
"""

import functools
import threading

from keras.src.backend.tensorflow import trainer as _tf_trainer

from kfit_ps._tf_compat.versions import check_versions

_METHODS = ("fit", "evaluate", "predict")
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
            if predicate(self):
                return handlers[name](self, *args, **kwargs)
        return stock(self, *args, **kwargs)

    method._kfit_ps_stock = stock
    return method


def install_dispatch(key, predicate, fit, evaluate, predict):
    """Routes `Model.fit/evaluate/predict` of models where `predicate(model)` holds.

    Idempotent per `key`. Subclasses that override these methods themselves
    are not affected.
    """
    with _install_lock:
        check_versions()
        _handlers[key] = (predicate, {"fit": fit, "evaluate": evaluate, "predict": predict})
        cls = _tf_trainer.TensorFlowTrainer
        for name in _METHODS:
            stock = getattr(cls, name)
            if not hasattr(stock, "_kfit_ps_stock"):
                setattr(cls, name, _dispatching(name, stock))


def stock_method(name):
    """Keras' own, undispatched `TensorFlowTrainer` method (for tests)."""
    method = getattr(_tf_trainer.TensorFlowTrainer, name)
    return getattr(method, "_kfit_ps_stock", method)



