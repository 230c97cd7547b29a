"""Waiting on the cluster without hanging, and errors that say which task is gone.

TensorFlow's `ClusterCoordinator.join()` never times out: with every worker
gone it waits for one to come back, forever, and so does fetching a scheduled
function's result. `join(strategy)` and `result_fetcher(strategy)` wait in
slices instead, and between slices checks that some worker still accepts
connections; when none has for `worker_timeout` seconds (the strategy's
argument, else `KFIT_PS_WORKER_TIMEOUT`, 300 by default), it raises
`kfit_ps.errors.WorkersLostError` naming the workers and the timeout. A
worker that comes back in time is taken back by TensorFlow as usual.

A lost ps takes the variables it held with it. Under `kfit-ps run
--ps-recovery in-place` (the default) the chief restores them in place where
it can (`kfit_ps.training.resilience.ps_recovery`); where it cannot (no backup yet, a
`DynamicEmbedding`, one-pass epochs, a plain script, a ps not back in time),
TensorFlow's gRPC errors from `join()` or from reading a variable reach the
caller: `cluster_errors()` turns those (and only those: errors of the program
pass through) into `kfit_ps.errors.ParameterServerError` naming the ps tasks,
without the wall of gRPC text (kept as the error's `tf_error`).
"""

import contextlib
import functools
import re
import time

import tensorflow as tf

from kfit_ps import _tf_compat, constants, net
from kfit_ps.errors import (ParameterServerError, WorkerResultLostError, WorkersLostError,
                            WorkerStalledError)

_WAIT_SLICE_SECONDS = 1.0
_PROBE_SECONDS = 5.0  # between two handshakes with each worker (`net.answers_grpc`)
_PS_TASK = re.compile(r"/job:ps/replica:\d+/task:(\d+)")
_WORKER_TASK = re.compile(r"/job:worker/replica:\d+/task:(\d+)")
# Errors that a lost or restarted ps produces (its variables are gone or unreachable).
_PS_LOSS_ERRORS = (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.CancelledError,
                   tf.errors.NotFoundError, tf.errors.FailedPreconditionError)


class _WorkerWatch:
    """Raises `WorkersLostError` once no worker has accepted connections for `timeout` s, and
    `WorkerStalledError` once a worker has accepted connections without answering for as
    long (a stopped or wedged process: its functions never finish)."""

    def __init__(self, strategy):
        self._strategy, self.timeout = strategy, strategy.worker_timeout
        self._all_down_since = None
        self._silent_since = {}
        self._next_probe = 0.0

    @property
    def addresses(self):  # Read each time: elastic workers change them (`resilience.elastic`).
        return list(self._strategy.worker_addresses)

    def any_reachable(self):
        return any(net.accepts_connections(a) for a in self.addresses)

    def _check_answers(self, now):
        if now < self._next_probe:
            return
        self._next_probe = now + _PROBE_SECONDS
        for index, address in enumerate(self.addresses):
            if net.grpc_state(address) != "silent":  # Down is TensorFlow's to recover.
                self._silent_since.pop(address, None)
                continue
            since = self._silent_since.setdefault(address, now)
            if now - since >= self.timeout:
                raise WorkerStalledError(
                    f"Worker {index} ({address}) accepts connections but has not answered for "
                    f"{self.timeout:g} s (worker_timeout): the process is stopped or wedged, "
                    "and the functions it holds never finish. Restart it (kfit-ps run kills and "
                    "restarts such a worker by itself, see --liveness-timeout) and rerun the "
                    "script to resume from its last backup.", tasks=[f"worker:{index}"])

    def check(self):
        now = time.monotonic()
        if self.any_reachable():
            self._all_down_since = None
            self._check_answers(now)
            return
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


def join(strategy, cancel_when=None):
    """`strategy.coordinator.join()`, bounded when every worker is gone (see the module doc).

    When `cancel_when()` turns true during the wait (a stop was requested), the
    functions no worker has started yet are dropped and only the running ones are
    waited for. Returns the results (remote values) of the dropped functions: not
    always the newest (a lost worker's function waits at the queue's tail).
    """
    coordinator = strategy.coordinator
    watch = _WorkerWatch(strategy)
    cancelled = None
    while True:
        if cancelled is None and cancel_when is not None and cancel_when():
            cancelled = _tf_compat.cancel_queued_closures(coordinator)
        if _tf_compat.wait_for_closures(coordinator, _WAIT_SLICE_SECONDS):
            return cancelled or []
        watch.check()


def result_fetcher(strategy):
    """A `fetch(remote_value)` for scheduled functions' results, bounded like `join`.

    It waits in slices for the result; a result that cannot be copied from its
    worker (the worker died after the function finished) is an error of that
    worker, unless every worker is gone, which is `WorkersLostError` once the
    timeout has passed.
    """
    watch = _WorkerWatch(strategy)

    def fetch(remote_value):
        while not _tf_compat.remote_value_ready(remote_value, _WAIT_SLICE_SECONDS):
            watch.check()
        try:
            return remote_value.fetch()
        except (tf.errors.UnavailableError, tf.errors.CancelledError) as e:
            time.sleep(_WAIT_SLICE_SECONDS)  # Workers lost together are seen lost together.
            while not watch.any_reachable():  # Every worker gone: raises after the timeout.
                watch.check()
                time.sleep(_WAIT_SLICE_SECONDS)
            workers = sorted({int(i) for i in _WORKER_TASK.findall(str(e))})
            names = [f"worker:{i}" for i in workers]
            error = WorkerResultLostError(
                f"Worker {', '.join(names) or '(unknown)'} was lost after a scheduled function "
                "finished on it and before its metric results were fetched, so this epoch's "
                "metrics cannot be exact. Rerun the script to resume from its last backup "
                "(kfit-ps run does this by itself).", tasks=names)
            error.tf_error = e
            raise error from None

    return fetch


def _ps_tasks(error):
    original = getattr(error, "original_exception", None)  # TF's Closure*Error wrappers
    if original is not None:
        error = original
    if not isinstance(error, _PS_LOSS_ERRORS) and not (
            isinstance(error, tf.errors.InvalidArgumentError) and (
                "unknown device" in str(error).lower() or "remote_handle" in str(error))):
        return []
    return sorted({int(i) for i in _PS_TASK.findall(str(error))})


def is_ps_loss(error):
    """Whether `error` is one of TensorFlow's errors about a lost or restarted ps."""
    return bool(_ps_tasks(error))


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
