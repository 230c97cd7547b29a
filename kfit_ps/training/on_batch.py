"""Parameter-server `train_on_batch`, `test_on_batch` and `predict_on_batch`.

Each call ships the one batch it is given to a worker as the argument of a
scheduled function (as evaluation of numpy data does), waits for it, and
returns what Keras 3 returns: the metrics of that batch alone (Keras resets
the metrics at each call), or the batch's predictions as numpy arrays.
Metric state is counted exactly once, as in `fit` (`metric_state`).
"""

import numpy as np
import tensorflow as tf

from kfit_ps import _tf_compat
from kfit_ps.training.inputs import adapters
from kfit_ps.training.resilience import cluster_health
from kfit_ps.training.step import functions, metric_state
from kfit_ps.training.loop import prepare, strategy_for
from kfit_ps.training.inputs.scheduling import metric_logs


def _one_batch(method, x, y=None, sample_weight=None):
    """(spec, batch): `(x[, y[, sample_weight]])` as one batch of tensors, as Keras ships it."""
    parts = tuple(v for v in (x, y, sample_weight) if v is not None)
    leaves = tf.nest.flatten(parts)
    if not leaves or not all(adapters.is_array_like(leaf) for leaf in leaves):
        raise ValueError(
            f"`{method}` takes one batch of numpy arrays or tensors (also lists/dicts of "
            f"them). Received: x of type {type(x).__name__}. For datasets and DatasetCreators "
            "call `fit`, `evaluate` or `predict`.")
    batch = tf.nest.map_structure(tf.convert_to_tensor, parts)
    return tf.nest.map_structure(tf.TensorSpec.from_tensor, batch), batch


def _run_for_metrics(model, method, fn_slot, make_fn, x, y, sample_weight, return_dict):
    strategy = strategy_for(model)
    spec, batch = _one_batch(method, x, y, sample_weight)
    prepare(model, strategy, spec, method)
    fns = functions.for_model(model, strategy, fn_slot)
    coordinator = strategy.coordinator
    model.reset_metrics()
    accumulator = metric_state.Accumulator(
        fns.metric_state, fetch=cluster_health.result_fetcher(strategy))
    accumulator.add(coordinator.schedule(make_fn(fns), args=(batch,)))
    cluster_health.join(strategy)
    accumulator.commit()
    logs = metric_logs(model)
    if return_dict:
        return logs
    return _tf_compat.flatten_metrics_in_order(model, logs)


def train_on_batch(model, x, y=None, sample_weight=None, class_weight=None, return_dict=False):
    """Parameter-server `Model.train_on_batch`; same arguments and return value as Keras'."""
    x, sample_weight = adapters.with_class_weight(x, y, sample_weight, class_weight)
    return _run_for_metrics(model, "train_on_batch", "train_function",
                            lambda fns: fns.train_batch(), x, y, sample_weight, return_dict)


def test_on_batch(model, x, y=None, sample_weight=None, return_dict=False):
    """Parameter-server `Model.test_on_batch`; same arguments and return value as Keras'."""
    return _run_for_metrics(model, "test_on_batch", "test_function",
                            lambda fns: fns.test_batch(), x, y, sample_weight, return_dict)


def predict_on_batch(model, x):
    """Parameter-server `Model.predict_on_batch`: the batch's predictions as numpy arrays."""
    strategy = strategy_for(model)
    spec, batch = _one_batch("predict_on_batch", x)
    prepare(model, strategy, spec, "predict_on_batch")
    fns = functions.for_model(model, strategy, "predict_function")
    result = strategy.coordinator.schedule(fns.predict_batch(), args=(batch,))
    cluster_health.join(strategy)
    return tf.nest.map_structure(np.asarray, result.fetch())
