"""The training layer: parameter-server `fit` / `evaluate` / `predict` for Keras 3."""

from kfit_ps import _tf_compat
from kfit_ps.training import loop
from kfit_ps.training.dataset_creator import DatasetCreator
from kfit_ps.training.sidecar_evaluator import Evaluation, SidecarEvaluator


def _handles(model):
    return loop.strategy_for(model) is not None


def install():
    """Routes `fit` / `evaluate` / `predict` of models built under a kfit_ps strategy.

    Called once by `import kfit_ps`; idempotent. Models built outside a kfit_ps
    strategy scope keep Keras' own methods.
    """
    _tf_compat.install_dispatch("kfit_ps", _handles, fit=loop.fit, evaluate=loop.evaluate,
                                predict=loop.predict)


__all__ = ["DatasetCreator", "Evaluation", "SidecarEvaluator", "install"]
