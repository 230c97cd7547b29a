"""Changing the workers of a running `ClusterCoordinator` (elastic workers).

TensorFlow's `ClusterCoordinator` fixes its worker list when it is built: one
`Worker` object (and thread) per worker task of the cluster the strategy
connected to, and its recovery re-applies that same server def
(tensorflow#48601, which added `add_worker`/`remove_worker`, was closed
unmerged). `resize_workers` works around it at a safe point, with no function
in flight:

1. the coordinator stops taking work (`eager_context.quiesce`); if TensorFlow's
   recovery thread is still updating the cluster (a worker lost and not back)
   after `_QUIESCE_SECONDS`, nothing is changed and `RecoveryInProgress` is
   raised: two cluster updates at once crash the process;
2. the eager context's cluster is updated in place to the new worker list
   (`context.update_server_def`, TensorFlow's path for replaced tasks: the ps
   tasks and kept workers keep their state, so every variable stays where it is;
   a removed worker's remote context is closed); each new worker gets the
   device filters the strategy gives workers (the ps tasks and the chief);
3. the strategy's worker count is updated and a new coordinator built over it;
4. every per-worker resource registered with `track_per_worker` (per-worker
   datasets and iterators) moves to the new coordinator: a kept worker keeps
   its own (its iterator continues where it was) and is registered with the new
   `Worker` for rebuilding after a failure; a new worker gets one built by the
   same resource function; a removed worker's is dropped.
"""

import time
import weakref

from tensorflow.core.protobuf import tensorflow_server_pb2
from tensorflow.python.distribute.coordinator import cluster_coordinator
from tensorflow.python.eager import context

from kfit_ps._tf_compat.eager_context import quiesce, track_coordinator
from kfit_ps._tf_compat.versions import check_versions

_WORKER = "worker"
_tracked = weakref.WeakSet()
_QUIESCE_SECONDS = 30.0


class RecoveryInProgress(RuntimeError):
    """TensorFlow's recovery thread was still updating the cluster: the workers were left
    as they were (a second update beside it crashes the process)."""


def track_per_worker(values):
    """Registers a `PerWorkerValues` (a per-worker dataset or iterator) to follow the
    coordinator's workers through `resize_workers`; returns it."""
    _tracked.add(values)
    return values


def _server_def_with_workers(server_def, addresses):
    updated = tensorflow_server_pb2.ServerDef()
    updated.CopyFrom(server_def)
    for job in updated.cluster.job:
        if job.name == _WORKER:
            job.tasks.clear()
            for index, address in enumerate(addresses):
                job.tasks[index] = address
    for job in updated.cluster_device_filters.jobs:
        if job.name == _WORKER:
            job.tasks.clear()
            for index in range(len(addresses)):
                job.tasks[index].device_filters.extend(["/job:ps", f"/job:{updated.job_name}"])
    return updated


def _move_resources(old_workers, new_cluster):
    """Gives each tracked per-worker value one resource per worker of `new_cluster`."""
    manager = new_cluster.resource_cancellation_mgr
    workers = new_cluster.workers
    for values in list(_tracked):
        current = list(values._values)
        kept = current[:len(workers)]
        for index, remote_value in enumerate(kept):
            closure = remote_value._closure
            if hasattr(closure, "_concrete_function"):  # Bound to the old cancellation manager.
                closure._function = manager.get_cancelable_function(closure._concrete_function)
            with workers[index]._resource_tracking_lock:
                workers[index]._register_resource(remote_value)
        template = current[0]
        for index in range(len(kept), len(workers)):
            closure = template._closure
            remote_value = workers[index].create_resource(
                closure._function if not hasattr(closure, "_concrete_function")
                else closure._concrete_function, args=closure._args, kwargs=closure._kwargs)
            remote_value._type_spec = template._type_spec
            kept.append(remote_value)
        values._values = tuple(kept)
    del old_workers


def worker_addresses():
    """The workers this process's eager context is connected to, in task order."""
    server_def = context.get_server_def()
    if server_def is None:
        return []
    for job in server_def.cluster.job:
        if job.name == _WORKER:
            return [job.tasks[i] for i in sorted(job.tasks)]
    return []


def resize_workers(strategy, addresses):
    """Connects `strategy` to `addresses` as its workers and rebuilds its coordinator.

    Call it with no scheduled function pending (after a `join()`). Returns the
    new `ClusterCoordinator`. Variables, ps state and the kept workers'
    per-worker resources are untouched.
    """
    check_versions()
    addresses = list(addresses)
    if not addresses:
        raise ValueError("resize_workers: a parameter-server cluster needs at least one worker. "
                         "Received: addresses=[].")
    old = strategy._cluster_coordinator
    old_workers = []
    if old is not None:
        old_workers = list(old._cluster.workers)
        if not quiesce(old, time.monotonic() + _QUIESCE_SECONDS):
            raise RecoveryInProgress(
                f"TensorFlow's worker recovery did not end within {_QUIESCE_SECONDS:g} s")
    ctx = context.context()
    ctx.update_server_def(_server_def_with_workers(ctx.get_server_def(), addresses))
    strategy._num_workers = len(addresses)
    strategy.extended._num_workers = len(addresses)
    strategy._cluster_coordinator = None
    coordinator = track_coordinator(cluster_coordinator.ClusterCoordinator(strategy))
    _move_resources(old_workers, coordinator._cluster)
    return coordinator
