"""This process's eager cluster connection (TensorFlow's private eager context).

When a `LocalCluster` stops its servers, a chief still connected to them tries
to unregister from them every function it releases afterwards (a model
deleted later, a notebook's next cell) and logs four lines of gRPC errors per
function and server. Shrinking the eager context's cluster to the chief alone
(TensorFlow's own cluster-update path, used when workers are replaced) leaves
nothing to talk to.

That update must never run beside another one. A `ClusterCoordinator`
recovering a lost worker calls `context.update_server_def` from its
`WorkerPreemptionHandler` thread, under the handler's `_cluster_update_lock`;
two concurrent updates crash the process (a segfault, seen when a
`LocalCluster` stopped right after a worker was restarted). So
`forget_servers` first stops every coordinator this process made
(`track_coordinator`) from starting more work, then ends each handler's
thread (taking its lock waits, bounded, for a recovery in progress) and its
worker threads (a function running on a cluster being replaced), and
only then releases functions and updates the cluster, with no lock held (a
coordinator's `__del__`, which garbage collection may run, takes the
handler's lock). If a recovery does not finish in time (its worker never
came back), the disconnect is skipped: some log noise at exit, never a
crash or a hang.

At interpreter exit the same holds: Python freezes daemon threads once it
finalizes, and a handler thread frozen inside a recovery keeps its lock, so the
coordinator's `__del__` (run by the final garbage collection) would wait for it
forever (seen: a chief that printed its result and never exited, after a worker
was lost during its last `evaluate`). An `atexit` hook, which runs before that
freeze, quiesces every tracked coordinator; one whose recovery does not end in
time gets a `stop` that does not wait.
"""

import atexit
import contextlib
import gc
import logging
import queue
import threading
import time
import weakref

from tensorflow.core.protobuf import tensorflow_server_pb2
from tensorflow.python.eager import context

from kfit_ps._tf_compat.versions import check_versions

log = logging.getLogger("kfit_ps.cluster")

_coordinators = weakref.WeakSet()
_RECOVERY_WAIT_SECONDS = 10.0
_EXIT_WAIT_SECONDS = 30.0
_at_exit = []


def track_coordinator(coordinator):
    """Remembers a `ClusterCoordinator` so `forget_servers` can quiesce it first, and so
    that it is quiesced before the interpreter exits (`quiesce_all`)."""
    _coordinators.add(coordinator)
    if not _at_exit:
        _at_exit.append(atexit.register(quiesce_all))
    return coordinator


def quiesce_all(wait=_EXIT_WAIT_SECONDS):
    """Quiesces every tracked coordinator (an `atexit` hook: before Python freezes daemon
    threads); one whose recovery thread did not end within `wait` s gets a `stop` that
    does not wait for its lock, so its `__del__` cannot hang the exit."""
    deadline = time.monotonic() + wait
    for coordinator in list(_coordinators):
        try:
            if not quiesce(coordinator, deadline, workers_too=False):  # Only the lock matters.
                coordinator._cluster.failure_handler.stop = lambda: None
        except Exception as e:  # noqa: BLE001 - an exit hook: never stop the exit
            log.debug("kfit_ps: could not quiesce a coordinator at exit: %s", e)


def _remote_addresses(server_def):
    return {address for job in server_def.cluster.job if job.name != server_def.job_name
            for address in job.tasks.values()}


@contextlib.contextmanager
def _run_block(*args, **kwargs):
    yield


_stopped_classes = {}


def _stopped(handler):
    """Makes `handler` (a coordinator's failure handler) one that was stopped.

    A worker thread waiting for its worker's recovery wakes once the handler's
    cluster update ends: a success re-enters `wait_on_failure` to rebuild the
    worker's resources, where TensorFlow asserts that the handler still runs; a
    failure (a cancelled queue makes any error one) is raised in the thread. Either
    killed the thread with a traceback (and a gRPC error) on the chief's output, and
    set an error on a function another worker had finished (seen: a worker killed just
    before a scale). A stopped handler's `wait_on_failure` runs its block, and the
    error of its last update is dropped: the thread ends quietly, and a stopped
    worker thread runs no function.
    """
    cls = type(handler)
    if cls not in _stopped_classes:
        _stopped_classes[cls] = type(f"Stopped{cls.__name__}", (cls,), {
            "wait_on_failure": _run_block,
            "_error_from_recovery": property(lambda self: None, lambda self, error: None)})
    handler.__class__ = _stopped_classes[cls]
    return handler


def _stop_scheduling(coordinator):
    """TensorFlow's `Cluster.stop()` without its unbounded wait for the handler's lock, and
    with a handler stopped for its worker threads too (`_stopped`)."""
    cluster = coordinator._cluster
    for worker in cluster.workers:
        worker.stop()
    cluster.closure_queue.stop()
    cluster.resource_cancellation_mgr.start_cancel()
    _stopped(cluster.failure_handler)._should_preemption_thread_run = False
    return cluster.failure_handler


def _alone(server_def):
    alone = tensorflow_server_pb2.ServerDef()
    alone.CopyFrom(server_def)
    own_job = [job for job in alone.cluster.job if job.name == server_def.job_name]
    del alone.cluster.job[:]
    alone.cluster.job.extend(own_job)
    alone.default_session_config.ClearField("device_filters")
    return alone


def _end_handler_thread(handler, deadline):
    """Wakes a stopped handler's thread and waits (until `deadline`) for it to end.

    Taking the lock waits for an update in progress; the thread then sees it
    must stop. Returns whether the thread has ended.
    """
    if not handler._cluster_update_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
        return False
    try:
        handler._cluster_due_for_update_or_finish.set()
    finally:
        handler._cluster_update_lock.release()
    handler._preemption_handler_thread.join(max(0.0, deadline - time.monotonic()))
    if handler._preemption_handler_thread.is_alive():
        return False
    # Its thread has ended: a worker thread entering TensorFlow's own `wait_on_failure` now
    # (looked up before the stop) passes its assertion that the handler runs.
    handler._should_preemption_thread_run = True
    return True


def _end_worker_threads(coordinator, deadline):
    """Waits (until `deadline`) for the stopped `coordinator`'s worker threads to end; returns
    whether they have.

    A stopped worker thread ends after the function it runs (a cancelled one returns at
    once). None may run while the cluster is changed under it (the function's remote
    devices and their contexts are replaced).
    """
    # A worker waiting for its recovery runs no function: its thread is not waited for (its
    # handler has ended, so it waits on until TensorFlow's hour-long bound).
    workers = {id(worker) for worker in coordinator._cluster.workers
               if not worker._is_dead_with_error}
    threads = [thread for thread in threading.enumerate()
               if id(getattr(getattr(thread, "_target", None), "__self__", None)) in workers]
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(thread.is_alive() for thread in threads)


def quiesce(coordinator, deadline, workers_too=True):
    """Stops `coordinator` from taking work and ends its recovery thread (waiting, until
    `deadline`, for a recovery in progress) and, with `workers_too`, its worker threads;
    returns whether they have ended.

    After this, nothing of `coordinator` updates the eager context's cluster or (with
    `workers_too`) runs a function on it.
    """
    ended = _end_handler_thread(_stop_scheduling(coordinator), deadline)
    return ended and (not workers_too or _end_worker_threads(coordinator, deadline))


def forget_servers(addresses, recovery_wait=_RECOVERY_WAIT_SECONDS):
    """Disconnects this process from a cluster that contains any of `addresses`.

    Call it while the servers still run. Returns True when the eager context
    was connected to one of them and now only knows its own task; False when
    it was not connected to them, or when a worker recovery did not finish
    within `recovery_wait` seconds (nothing is changed then).
    """
    check_versions()
    ctx = context.context()
    server_def = ctx.get_server_def()
    if server_def is None or not _remote_addresses(server_def) & set(addresses):
        return False
    deadline = time.monotonic() + recovery_wait
    if not all([quiesce(c, deadline) for c in list(_coordinators)]):
        log.debug("kfit_ps: a worker recovery is still running; not disconnecting")
        return False
    # No thread can update the cluster now. Release what this process registered on the
    # servers while they still answer (a coordinator's `__del__` may run here: it takes the
    # handler's lock, which nobody holds), then drop them from the cluster.
    gc.collect()
    try:
        ctx.update_server_def(_alone(server_def))
    except Exception as e:  # noqa: BLE001 - only the exit-time log noise is at stake
        log.debug("kfit_ps: could not disconnect from the stopped cluster: %s", e)
        return False
    return True


def wait_for_closures(coordinator, timeout):
    """`coordinator.join()` for at most `timeout` seconds; True when every function finished.

    Raises what `join()` raises (the first error of a scheduled function).
    """
    return coordinator._cluster.closure_queue.wait(timeout=timeout)


def cancel_queued_closures(coordinator):
    """Drops the functions scheduled on `coordinator` that no worker has started; returns
    their results (remote values), in queue order.

    The queue is not the order of scheduling: TensorFlow puts a function back at the
    *tail* of the queue when its worker was lost, so a dropped function can be older
    than functions that finished. Each dropped function's result becomes a
    `CancelledError`, as when TensorFlow cancels its queue after an error; functions
    running on a worker finish as usual, so a following `join()` waits for those only.
    """
    closures = coordinator._cluster.closure_queue
    cancelled = []
    with closures._queue_lock:
        while True:
            try:
                closure = closures._queue.get(block=False)
            except queue.Empty:
                break
            closures._queue_free_slot_condition.notify()
            closure.mark_cancelled()
            ref = getattr(closure, "_output_remote_value_ref", None)
            value = ref() if ref is not None else None
            if value is not None:
                cancelled.append(value)
        closures._stop_waiting_condition.notify_all()
    return cancelled


def remote_value_ready(remote_value, timeout):
    """Waits at most `timeout` s for a scheduled function's result; True once `fetch()`
    returns or raises without waiting on a worker.

    TensorFlow's coordinator thread copies each finished function's result from its
    worker to the chief, holding the value's lock, with no deadline: a result whose
    worker stopped after finishing never arrives. So the result counts as there once
    its status is set and nobody is copying it (copied already, or free to copy).
    """
    deadline = time.monotonic() + timeout
    if not remote_value._status_available_event.wait(timeout):
        return False
    if remote_value._has_fetched_to_local:
        return True
    lock = remote_value._has_fetched_to_local_lock
    if not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
        return False  # Being copied from its worker.
    lock.release()
    return True
