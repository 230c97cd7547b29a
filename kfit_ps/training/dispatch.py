"""One window of training steps: from a synchronisation to the next.

`fit` (`loop`) calls `Dispatcher.run(step, stop, ...)` for each window of an epoch
(`callbacks.base.SyncPoints` decides where windows end). It schedules the
window's functions, joins them, and handles what may happen in between:

- a stop request (SIGTERM, `preemption`): nothing more is scheduled, queued
  functions are dropped, the window ends early;
- new workers published by the launcher (`elastic`): queued functions are
  dropped, the coordinator moves to the new workers, the dropped steps are
  scheduled again;
- a lost ps restored in place (`ps_recovery`): the functions that failed with
  it are scheduled again once its variables are back.

Batch hooks are called once per step however often a step is scheduled.
"""

import time

from kfit_ps import _tf_compat
from kfit_ps.training import cluster_health, preemption
from kfit_ps.training.scheduling import schedule_steps


class Dispatcher:
    """Runs windows of one `fit` (see the module doc)."""

    def __init__(self, model, strategy, train_for, callbacks, observe, workers, recovery,
                 monitor, ledger=None):
        self.model, self.strategy, self.train_for = model, strategy, train_for
        self.callbacks, self.observe, self.ledger = callbacks, observe, ledger
        self.workers, self.recovery, self.monitor = workers, recovery, monitor
        self.iterations = None  # `optimizer.iterations` after the last window, when needed

    def guarded(self, function, *args):
        """`function(*args)` (work between windows: metric reads, callbacks, backups); if a ps
        was lost meanwhile and is restored in place, it runs again once."""
        try:
            return function(*args)
        except Exception as e:  # noqa: BLE001 - re-raised unless a ps was restored
            self._recover_or_raise(e, self.iterations)
            return self.guarded(function, *args)

    def _recover_or_raise(self, error, iterations):
        """Restores the ps tasks `error` came from in place, or waits a second when workers
        have not reached a restored ps yet; raises `error` when neither applies."""
        lost = self.recovery.lost(error)
        if lost:
            self.recovery.recover(lost, iterations)
        elif self.recovery.transient(error):
            time.sleep(1.0)
        else:
            raise error

    def interrupted(self):
        return preemption.requested() or self.workers.pending(self.strategy)

    def run(self, step, stop, args, accumulator):
        """Trains steps `step..stop-1`; returns the step reached (below `stop` only when a
        stop was requested)."""
        hooked, start = step, step  # Batch hooks were called for the steps before `hooked`.
        if self.iterations is None:  # Read once; then counted (a restored ps resets it).
            self.iterations = self.recovery.iterations()
        iterations = self.iterations
        while True:
            scheduled = []
            try:
                schedule_steps(
                    self.strategy.coordinator, step, stop, self.model.steps_per_execution,
                    self.train_for(), args, self.callbacks.on_train_batch_begin,
                    self.callbacks.on_train_batch_end, accumulator,
                    should_stop=self.interrupted, observe=self.observe, hooked=hooked,
                    scheduled=scheduled)
                # On SIGTERM or new workers, functions no worker started are dropped: the newest.
                cancelled = cluster_health.join(self.strategy, cancel_when=self.interrupted)
            except Exception as e:  # noqa: BLE001 - re-raised unless a ps was restored
                hooked = max(hooked, step + sum(n for _, n in scheduled))
                failed = [v for v, _ in scheduled if not _tf_compat.ps_restore.finished(v)]
                accumulator.discard(failed)
                accumulator.fold()  # Results still on workers: fetched before reconnecting.
                step += sum(n for v, n in scheduled if _tf_compat.ps_restore.finished(v))
                self._recover_or_raise(e, None if iterations is None
                                       else iterations + step - start)
                continue  # The failed functions' steps are scheduled again.
            sizes = [n for _, n in scheduled]
            hooked = max(hooked, step + sum(sizes))
            accumulator.discard_newest(cancelled)
            if self.ledger is not None:
                self.ledger.dispatched(step, sizes)
                self.ledger.joined(cancelled)
            step += sum(sizes[:len(sizes) - cancelled])
            if self.workers.pending(self.strategy) and not preemption.requested():
                # A safe point: nothing in flight. The dropped steps run on the new workers.
                self.workers.apply(self.strategy, self.monitor)
            elif preemption.requested() or step >= stop:
                if iterations is not None:
                    self.iterations = iterations + step - start
                return step
            # Else the worker list changed back before a safe point (a scale flap): the
            # dropped steps run again on the same workers. Only a stop request ends a window
            # early.
