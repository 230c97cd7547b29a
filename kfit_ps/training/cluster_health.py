"""Waiting on the cluster without hanging, and errors that say which task is gone.

TensorFlow's `ClusterCoordinator.join()` never times out: with every worker
gone it waits for one to come back, forever. `join(strategy)` waits in
slices instead, and between slices checks that some worker still accepts
connections; when none has for `worker_timeout` seconds (the strategy's
argument, else `KFIT_PS_WORKER_TIMEOUT`, 300 by default), it raises
`kfit_ps.errors.WorkersLostError` naming the workers and the timeout. A
worker that comes back in time is taken back by TensorFlow as usual.

A lost ps is not recoverable in-process: the variables it held are gone.
TensorFlow then raises gRPC errors from `join()` or from reading a variable;
`cluster_errors()` turns those (and only those: errors of the program pass
through) into `kfit_ps.errors.ParameterServerError` naming the ps tasks,
without the wall of gRPC text (kept as the error's `tf_error`).
"""

import contextlib
import functools
import re
import time

import tensorflow as tf

from kfit_ps import _tf_compat, constants, net
from kfit_ps.errors import ParameterServerError, WorkersLostError

_WAIT_SLICE_SECONDS = 1.0
_PS_TASK = re.compile(r"/job:ps/replica:\d+/task:(\d+)")
# Errors that a lost or restarted ps produces (its variables are gone or unreachable).
_PS_LOSS_ERRORS = (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.CancelledError,
                   tf.errors.NotFoundError, tf.errors.FailedPreconditionError)


class _WorkerWatch:
    """Raises `WorkersLostError` once no worker has accepted connections for `timeout` s."""

    def __init__(self, addresses, timeout):
        self.addresses, self.timeout = list(addresses), timeout
        self._all_down_since = None

    def check(self):
        if any(net.accepts_connections(a) for a in self.addresses):
            self._all_down_since = None
            return
        now = time.monotonic()
        if self._all_down_since is None:
            self._all_down_since = now
        elif now - self._all_down_since >= self.timeout:
            raise WorkersLostError(
                f"Every worker ({', '.join(self.addresses)}) has been unreachable for "
                f"{self.timeout:g} s (worker_timeout), so no scheduled step can run. Restart the "
                "workers and rerun the script to resume from its last backup (kfit-ps run does "
                f"both), or wait longer: set {constants.WORKER_TIMEOUT_ENV} or "
                "ParameterServerStrategy(worker_timeout=...).",
                tasks=[f"worker:{i}" for i in range(len(self.addresses))])


def join(strategy):
    """`strategy.coordinator.join()`, bounded when every worker is gone (see the module doc)."""
    coordinator = strategy.coordinator
    watch = _WorkerWatch(strategy.worker_addresses, strategy.worker_timeout)
    while not _tf_compat.wait_for_closures(coordinator, _WAIT_SLICE_SECONDS):
        watch.check()


def _ps_tasks(error):
    original = getattr(error, "original_exception", None)  # TF's Closure*Error wrappers
    if original is not None:
        error = original
    if not isinstance(error, _PS_LOSS_ERRORS) and not (
            isinstance(error, tf.errors.InvalidArgumentError) and (
                "unknown device" in str(error).lower() or "remote_handle" in str(error))):
        return []
    return sorted({int(i) for i in _PS_TASK.findall(str(error))})


@contextlib.contextmanager
def cluster_errors():
    """Turns TensorFlow's errors about a lost ps into `ParameterServerError`."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - re-raised unchanged unless it is a ps loss
        tasks = _ps_tasks(e)
        if not tasks:
            raise
        names = [f"ps:{i}" for i in tasks]
        error = ParameterServerError(
            f"Parameter server {', '.join(names)} failed or restarted ({type(e).__name__}), "
            "and the variables it held are gone, so training cannot continue in this process. "
            "Rerun the script once the ps is back to resume from the last backup "
            "(kfit_ps.callbacks.BackupAndRestore); `kfit-ps run` does this by itself.",
            tasks=names)
        error.tf_error = e
        raise error from None


def translating_cluster_errors(method):
    """Wraps a `fit`/`evaluate`/... implementation in `cluster_errors()`."""

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        with cluster_errors():
            return method(*args, **kwargs)

    return wrapped
