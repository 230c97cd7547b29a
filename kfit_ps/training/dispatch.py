"""One window of training steps: from a synchronisation to the next.

`fit` (`loop`) calls `Dispatcher.run(step, stop, ...)` for each window of an epoch
(`callbacks.base.SyncPoints` decides where windows end). It schedules the
window's functions, joins them, and handles what may happen in between:

- a stop request (SIGTERM, `preemption`): nothing more is scheduled, queued
  functions are dropped, the window ends early. The dropped functions are those
  TensorFlow's queue held, which are not always the newest: a lost worker's
  function goes back to the queue's tail, behind newer ones that may finish;
- new workers published by the launcher (`elastic`): queued functions are
  dropped, the coordinator moves to the new workers, the dropped steps are
  scheduled again;
- a lost ps restored in place (`ps_recovery`): the functions that failed with
  it are scheduled again once its variables are back.

Batch hooks are called once per step however often a step is scheduled.
"""

import time

from kfit_ps import _tf_compat
from kfit_ps.training.resilience import cluster_health, preemption
from kfit_ps.training.inputs.scheduling import schedule_steps


_PRUNE_EVERY = 256  # open functions at which finished ones are looked for


class _Scheduled:
    """The functions a window scheduled, `(remote value, steps)`, without keeping finished
    ones' results alive: a finished function's result (its metric state) is the
    accumulator's to fold and drop, so only its step count stays here. Holding every
    remote value of a 20,000-step window kept every result: the chief grew by ~13 KB a
    step."""

    def __init__(self):
        self.sizes = []  # steps of each function, in order
        self.finished_steps = 0  # steps of the functions pruned once finished
        self._open = []  # (remote value, steps, position) not seen finished yet
        self._next_prune = _PRUNE_EVERY

    def append(self, item):
        value, steps = item
        self._open.append((value, steps, len(self.sizes)))
        self.sizes.append(steps)
        if len(self._open) >= self._next_prune:  # Amortised: queued ones are looked at again
            self._open = [entry for entry in self._open if not self._prune(*entry)]
            self._next_prune = max(_PRUNE_EVERY, 2 * len(self._open))  # after they doubled.

    def _prune(self, value, steps, position):
        if _tf_compat.ps_restore.finished(value):
            self.finished_steps += steps
            return True
        return False

    def unfinished(self):
        return [v for v, _, _ in self._open if not _tf_compat.ps_restore.finished(v)]

    def steps_finished(self):
        return self.finished_steps + sum(
            n for v, n, _ in self._open if _tf_compat.ps_restore.finished(v))

    def positions(self, values):
        """The positions (in scheduling order) of the functions whose results are `values`."""
        ids = {id(v) for v in values}
        return sorted(i for v, _, i in self._open if id(v) in ids)


class Dispatcher:
    """Runs windows of one `fit` (see the module doc)."""

    def __init__(self, model, strategy, train_for, callbacks, observe, workers, recovery,
                 monitor, ledger=None, positional=False):
        self.model, self.strategy, self.train_for = model, strategy, train_for
        self.callbacks, self.observe, self.ledger = callbacks, observe, ledger
        self.workers, self.recovery, self.monitor = workers, recovery, monitor
        # Each step reads a given batch (shipped epochs): after a cancel, training goes on
        # from the first dropped function, as for the ledger's splits.
        self.positional = positional or ledger is not None
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
        # Splits by the ledger: `steps_per_execution` batches, or a compressed file's all.
        split = self.ledger.split_at if self.ledger is not None else \
            self.model.steps_per_execution
        while True:
            scheduled = _Scheduled()
            try:
                schedule_steps(
                    self.strategy.coordinator, step, stop, split,
                    self.train_for(), args, self.callbacks.on_train_batch_begin,
                    self.callbacks.on_train_batch_end, accumulator,
                    should_stop=self.interrupted, observe=self.observe, hooked=hooked,
                    scheduled=scheduled)
                # On SIGTERM or new workers, functions no worker started are dropped: the newest.
                cancelled = cluster_health.join(self.strategy, cancel_when=self.interrupted)
            except Exception as e:  # noqa: BLE001 - re-raised unless a ps was restored
                hooked = max(hooked, step + sum(scheduled.sizes))
                accumulator.discard(scheduled.unfinished())
                accumulator.fold()  # Results still on workers: fetched before reconnecting.
                step += scheduled.steps_finished()
                self._recover_or_raise(e, None if iterations is None
                                       else iterations + step - start)
                continue  # The failed functions' steps are scheduled again.
            sizes = scheduled.sizes
            hooked = max(hooked, step + sum(sizes))
            dropped = scheduled.positions(cancelled)  # Not always the newest (module doc).
            accumulator.discard(cancelled)
            if not self.positional:  # A stream: any step reads the next batch.
                step += sum(sizes) - sum(sizes[i] for i in dropped)
            else:  # Splits: on from the first dropped one (later ones run again, counted).
                if self.ledger is not None:
                    self.ledger.dispatched(step, sizes)
                    self.ledger.joined(dropped)
                step += sum(sizes[:dropped[0]]) if dropped else sum(sizes)
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
