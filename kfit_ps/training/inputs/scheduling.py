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


def without_autotune_sleep(dataset):
    """`dataset`, with tf.data autotuning off unless its options set it.

    TensorFlow destroys an iterator without waking its autotuning thread
    first: the destructor waits out the thread's sleep, which doubles up to
    60 s as the pipeline runs. A worker destroys the previous `fit`'s
    iterator on a request thread that holds its table of remote tensors, so
    the worker takes no step for up to a minute (docs/performance.md, "The
    stall between fits"). Without autotuning, `AUTOTUNE` parallelism is the size of
    the pipeline's thread pool and `prefetch(AUTOTUNE)` grows its buffer on
    demand, as fast on the DLRM job. A dataset that sets
    `options.autotune.enabled` keeps its choice.
    """
    if dataset.options().autotune.enabled is not None:
        return dataset
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def _iterates_directly(strategy, worker_input):
    """Whether each worker can iterate its pipeline itself (CPU workers, no `InputOptions`)."""
    return worker_input.options is None and all(
        "CPU" in device.upper() for device in strategy.extended.worker_devices)


@_quiet_options_warning
def per_worker_iterator(strategy, worker_input):
    """An iterator over each worker's own (repeated or infinite) dataset.

    On CPU workers each worker iterates its pipeline itself, the form that
    `ClusterCoordinator.create_per_worker_dataset` documents: a
    `DistributedIterator` would add a `MultiDeviceIterator` (a second pipeline
    and a copy of every batch) for the one device there is. Workers with
    accelerators, or a `DatasetCreator` given `InputOptions`, get
    TensorFlow's distributed iterator, which places batches on the devices.
    """
    coordinator = strategy.coordinator
    if not _iterates_directly(strategy, worker_input):
        if worker_input.dataset is not None:
            return _tf_compat.track_per_worker(iter(coordinator.create_per_worker_dataset(
                strategy.experimental_distribute_dataset(worker_input.dataset))))
        return _tf_compat.track_per_worker(iter(coordinator.create_per_worker_dataset(
            lambda: strategy.distribute_datasets_from_function(worker_input.dataset_fn,
                                                               worker_input.options))))
    if worker_input.dataset is not None:
        return _tf_compat.track_per_worker(iter(coordinator.create_per_worker_dataset(
            without_autotune_sleep(worker_input.dataset))))
    # What `distribute_datasets_from_function` gives a worker: one pipeline of its own.
    context = tf.distribute.InputContext(num_replicas_in_sync=strategy.num_replicas_in_sync)
    creator = worker_input.dataset_fn
    return _tf_compat.track_per_worker(iter(coordinator.create_per_worker_dataset(
        lambda: without_autotune_sleep(creator(context)))))


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
        return _tf_compat.track_per_worker(
            coordinator.create_per_worker_dataset(distributed).build()), policy
    creator = worker_input.dataset_fn
    policy = _tf_compat.shard_policy(worker_input.sample, num_shards)
    dataset = coordinator.create_per_worker_dataset(lambda: _tf_compat.with_shard_policy(
        creator(tf.distribute.InputContext()), policy)).build()
    return _tf_compat.track_per_worker(dataset), policy


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
                   accumulator, should_stop=lambda: False, observe=None, hooked=0,
                   scheduled=None):
    """Schedules steps `start..stop-1` in functions of at most `k` steps (`k`: an int, or a
    function of a function's first step: its steps, as a ledger's `split_at`).

    `args`: the functions' arguments, or a function of the first step and the number
    of steps that returns them. Batch hooks: begin(first step), end(last step) per function, except the
    final end, which the caller makes after synchronising. Each function's
    returned metric state goes to `accumulator`. When `should_stop()` turns
    true, nothing more is scheduled. `observe(remote_value, steps)`, when
    given, hears of each function scheduled (`monitor.JobMonitor.expect`). Functions
    starting before step `hooked` are scheduled again (they were dropped before they
    ran: `training.resilience.elastic`) and call no batch hook: those hooks were called already.
    `scheduled`, when given, gets `(remote value, steps)` of each function as it goes.
    Returns the number of steps of each function scheduled, in order.
    """
    step, sizes = start, []
    while step < stop and not should_stop():
        n = min(k(step) if callable(k) else k, stop - step)
        if step >= hooked:
            on_begin(step)
        call_args = args(step, n) if callable(args) else args
        remote_value = coordinator.schedule(function_for(n), args=call_args)
        if observe is not None:
            observe(remote_value, n)
        if scheduled is not None:
            scheduled.append((remote_value, n))
        accumulator.add(remote_value)
        sizes.append(n)
        step += n
        if step < stop and step - n >= hooked:
            on_end(step - 1, {})
    return sizes
