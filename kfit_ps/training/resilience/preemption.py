"""Stopping `fit` at a safe point when the chief is asked to stop (SIGTERM).

Kubernetes sends SIGTERM before it takes a pod away (a node drain, a spot
preemption, an autoscaler scale-down) and SIGKILL a grace period later.
`kfit-ps run` forwards the signal to the chief, where the first training name
it took from `kfit_ps` installed `install()`'s handler (`kfit_ps._setup`):

- during `fit`, the handler only records the request. `fit` schedules no
  further step, waits for the steps in flight (`join`), folds their metrics,
  lets every `SyncCallback` act on that consistent state
  (`on_train_preempt`: `BackupAndRestore` writes a final backup) and raises
  `kfit_ps.errors.Preempted`, which ends the script with
  `exit_status.PREEMPTED` (143). A rerun resumes at exactly that step: a
  preemption costs no step.
- outside `fit` (building the model, exporting, between `fit`s), the signal
  ends the process at once, as it would without kfit_ps: the backups of the
  `fit`s already completed hold everything a rerun needs.
- a second SIGTERM ends the process at once; one within 2 s of the first is the
  same stop delivered twice (Slurm signals every process of a step, and the
  launcher forwards its copy) and is ignored.

This is TensorFlow's `PreemptionCheckpointHandler` idea (save within the
grace period, exit with a status the orchestrator retries) for `model.fit`.
"""

import functools
import os
import signal
import sys
import threading
import time

from kfit_ps import constants

_state = {"requested": False, "fits": 0, "at": 0.0}
# A SIGTERM this soon after the first is the same stop delivered twice (Slurm signals every
# process of a job step, and the launcher forwards its own copy): it is not a second one.
_SAME_STOP_SECONDS = 2.0
# Re-entrant: the handler runs in the main thread, which may hold the lock when it arrives.
_lock = threading.RLock()


def requested():
    """Whether a stop was requested during the current `fit`."""
    return _state["requested"]


def _die_by_signal(signum):
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _on_sigterm(signum, frame):
    with _lock:
        now = time.monotonic()
        if _state["requested"] and now - _state["at"] < _SAME_STOP_SECONDS:
            return
        if _state["fits"] == 0 or _state["requested"]:
            _die_by_signal(signum)
            return
        _state["requested"], _state["at"] = True, now
    print("kfit_ps: SIGTERM received: finishing the steps in flight, then saving and stopping",
          file=sys.stderr, flush=True)


def install():
    """Makes SIGTERM stop `fit` at a safe point (see the module doc); main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, _on_sigterm)


def stops_at_a_safe_point(fit):
    """Wraps a `fit` implementation: SIGTERM is recorded, not fatal, while it runs."""

    @functools.wraps(fit)
    def wrapped(*args, **kwargs):
        if constants.launched():  # Idempotent; the first training name may have been asked
            install()             # for on another thread, where no handler can be set.
        with _lock:
            _state["fits"] += 1
        completed = False
        try:
            result = fit(*args, **kwargs)
            completed = True
            return result
        finally:
            with _lock:
                _state["fits"] -= 1
                stop_now = _state["fits"] == 0 and _state["requested"]
            if stop_now and completed:  # Requested after fit's last check: stop now.
                _die_by_signal(signal.SIGTERM)

    return wrapped


def reset():
    """Forgets a request (tests, and a script that caught `Preempted` to carry on)."""
    _state["requested"] = False
