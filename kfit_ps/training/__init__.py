"""The training layer: parameter-server `fit` / `evaluate` / `predict` for Keras 3."""

from kfit_ps import _tf_compat
from kfit_ps.training import loop, on_batch, user_errors
from kfit_ps.training.resilience import cluster_health
from kfit_ps.training.inputs.dataset_creator import DatasetCreator
from kfit_ps.training.export import export_saved_model
from kfit_ps.training.inputs.adapters import shardable


def _handles(model):
    return loop.strategy_for(model) is not None


def _build_optimizer_before_load(model):
    """Creates the optimizer's slots (on the ps) so `load_weights` restores them."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or optimizer.built or not model.built:
        return
    with loop.strategy_for(model).scope():
        optimizer.build(model.trainable_variables)


def install():
    """Routes `fit` / `evaluate` / `predict` (and `*_on_batch`) of kfit_ps models.

    Called once by `kfit_ps._setup.prepare_training` (the first training name a process
    takes from `kfit_ps`); idempotent. Models built outside a kfit_ps
    strategy scope keep Keras' own methods. A lost ps is restored in place where
    `ps_recovery` can (under `kfit-ps run`), else surfaces as
    `kfit_ps.errors.ParameterServerError` (`cluster_health`). `load_weights` of a kfit_ps model
    first creates its optimizer's slots, so that they are restored, never
    skipped.
    """
    handlers = dict(fit=loop.fit, evaluate=loop.evaluate, predict=loop.predict,
                    train_on_batch=on_batch.train_on_batch, test_on_batch=on_batch.test_on_batch,
                    predict_on_batch=on_batch.predict_on_batch)
    _tf_compat.install_dispatch("kfit_ps", _handles, **{
        name: user_errors.clean(cluster_health.translating_cluster_errors(handler), name,
                                loop.strategy_for)
        for name, handler in handlers.items()})
    user_errors.install_excepthook()
    _tf_compat.install_load_weights_hook("kfit_ps", _handles, _build_optimizer_before_load)


__all__ = ["DatasetCreator", "export_saved_model", "install", "shardable"]
