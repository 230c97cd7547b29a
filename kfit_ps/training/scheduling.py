"""Scheduling steps on workers: per-worker datasets, step functions, metric reads.

Shared by `fit`, `evaluate` and `predict` (`loop`, `evaluation`): each
scheduled function runs on whichever worker is free; the coordinator keeps
each function's returned metric state (`metric_state.Accumulator`) and reads
the metrics after synchronising (`metric_logs`).
"""

import contextlib
import functools
import warnings

import numpy as np
import tensorflow as tf

from kfit_ps import _tf_compat


# TensorFlow warns when it reads a dataset's options while tracing the per-worker dataset
# function; the options it reads there are the ones kfit_ps or the user set.
_OPTIONS_WARNING = "To make it possible to preserve tf.data options"


@contextlib.contextmanager
def quiet_options_warning():
    """Hides TensorFlow's warning about reading dataset options while tracing."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_OPTIONS_WARNING)
        yield


def _quiet_options_warning(make):
    @functools.wraps(make)
    def quiet(*args):
        with quiet_options_warning():
            return make(*args)

    return quiet


@_quiet_options_warning
def per_worker_iterator(strategy, worker_input):
    """An iterator over each worker's own (repeated or infinite) dataset."""
    coordinator = strategy.coordinator
    if worker_input.dataset is not None:
        distributed = strategy.experimental_distribute_dataset(worker_input.dataset)
        return iter(coordinator.create_per_worker_dataset(distributed))

    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(
            worker_input.dataset_fn, worker_input.options)

    return iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))


@_quiet_options_warning
def per_worker_dataset(strategy, worker_input, num_shards):
    """(each worker's copy of a finite dataset, its auto-shard policy).

    The dataset is built whole (an `InputContext` of one pipeline), as an
    argument of scheduled functions that take one of `num_shards` shards
    (`_tf_compat.shard_dataset`), by file or by element as
    `_tf_compat.shard_policy` decides here.
    """
    coordinator = strategy.coordinator
    if worker_input.dataset is not None:
        policy = _tf_compat.shard_policy(worker_input.dataset, num_shards)
        distributed = strategy.experimental_distribute_dataset(
            _tf_compat.with_shard_policy(worker_input.dataset, policy))
        return coordinator.create_per_worker_dataset(distributed).build(), policy
    creator = worker_input.dataset_fn
    policy = _tf_compat.shard_policy(worker_input.sample, num_shards)
    dataset = coordinator.create_per_worker_dataset(lambda: _tf_compat.with_shard_policy(
        creator(tf.distribute.InputContext()), policy)).build()
    return dataset, policy


def _pythonify(logs):
    result = {}
    for key, value in sorted(logs.items()):
        if isinstance(value, dict):
            result.update(_pythonify(value))
            continue
        array = np.asarray(value)
        result[key] = float(array) if array.ndim == 0 else array
    return result


def metric_logs(model):
    """The model's metric results as Python floats (arrays for non-scalar metrics)."""
    return _pythonify(model.get_metrics_result())


def schedule_steps(coordinator, start, stop, k, function_for, args, on_begin, on_end,
                   accumulator):
    """Schedules steps `start..stop-1` in functions of at most `k` steps.

    Batch hooks: begin(first step), end(last step) per function, except the
    final end, which the caller makes after synchronising. Each function's
    returned metric state goes to `accumulator`.
    """
    step = start
    while step < stop:
        n = min(k, stop - step)
        on_begin(step)
        accumulator.add(coordinator.schedule(function_for(n), args=args))
        step += n
        if step < stop:
            on_end(step - 1, {})
