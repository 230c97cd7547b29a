"""Callbacks that act every N training steps on a synchronised, consistent state.

Parameter-server `fit` never waits for steps per batch: workers run ahead
while the coordinator schedules. A callback that reads weights every N steps
must therefore ask for a synchronisation, or it reads weights while steps are
still being applied. `SyncCallback` is how it asks:

- `sync_every = N` (an int, or None): the loop joins after every global step
  that is a multiple of N (global step = `epoch * steps_per_epoch + step`,
  counted from the first epoch, so a resumed run keeps the same points). No
  step is in flight then, and the epoch's metrics so far are exact.
- `on_train_sync(epoch, step, logs)` is then called, with `step` the number
  of steps completed in `epoch` (1..steps_per_epoch) and `logs` the epoch's
  metrics so far.
- `resume_position()`, called after `on_train_begin`, may return
  `(epoch, step)`: `fit` then starts `epoch` after its first `step` steps.
  `step == steps_per_epoch` means the epoch was trained and its validation
  stopped early: `fit` then runs the validation and the epoch-end callbacks,
  with the epoch's training logs from `resume_logs()`.
- `on_train_preempt(epoch, step, logs)` is called when the chief was asked
  to stop (SIGTERM, `kfit_ps.training.resilience.preemption`), after the steps in flight
  finished: the last chance to save a consistent state before `fit` raises
  `kfit_ps.errors.Preempted`.
- `on_train_failed(error)` is called when `fit` raises an error of the
  program (not of the cluster, which a restart retries).

The loop also joins at every epoch end, as always; `SyncPoints` computes the
union of the points.
"""

import keras

from kfit_ps import validation


def sync_every_from(callback, argument, value):
    """`sync_every` for a `"epoch"` or positive-int frequency argument (None for "epoch")."""
    if value == "epoch":
        return None
    return validation.check_int(argument, value, 1, owner=callback,
                                hint="Pass 'epoch' or a number of training steps.")


class SyncCallback(keras.callbacks.Callback):
    """Base class of kfit_ps callbacks that act on synchronised training state."""

    sync_every = None
    # The data ledger's `state()` when `fit` trains one-pass epochs (`kfit_ps.ledger`), else
    # None: set by `fit` before `on_train_begin`, for callbacks that save training state.
    ledger_state = None

    def on_train_sync(self, epoch, step, logs):
        """Called after a synchronisation at a multiple of `sync_every` steps."""

    def resume_position(self):
        """`(epoch, step)` to resume training from, or None to start as asked."""
        return None

    def resume_logs(self):
        """The resumed epoch's training logs when `resume_position()` is at its end, or None."""
        return None

    def on_train_preempt(self, epoch, step, logs):
        """Called once `step` steps of `epoch` are applied and `fit` is about to stop; returns
        the path of the backup it wrote, if it wrote one."""

    def on_train_failed(self, error):
        """Called when `fit` raises `error`, a failure of the program (not of the cluster):
        no restart will resume this training."""


class SyncPoints:
    """Where one `fit` call synchronises, from its callbacks' `sync_every`."""

    def __init__(self, callbacks, steps_per_epoch, ledger_state=None, every=None):
        self._callbacks = [cb for cb in callbacks if isinstance(cb, SyncCallback)]
        self._steps = steps_per_epoch
        self._every = every  # Also join every `every` steps of an epoch (shipped batches).
        for cb in self._callbacks:
            cb.ledger_state = ledger_state

    def resume_position(self):
        positions = [p for p in (cb.resume_position() for cb in self._callbacks)
                     if p is not None]
        return max(positions) if positions else None

    def resume_logs(self):
        """The training logs of the epoch `resume_position()` resumes at the end of."""
        position = self.resume_position()
        for cb in self._callbacks:
            if cb.resume_position() == position and cb.resume_logs() is not None:
                return dict(cb.resume_logs())
        return None

    def stops(self, epoch, first, sync_point=None):
        """Sorted steps of `epoch` after which to synchronise (the last is the epoch end);
        `sync_point(step)`, when given, moves each to where a window may end (the end of a
        split trained whole: a one-pass epoch over compressed files)."""
        base, points = epoch * self._steps, {self._steps}
        if self._every:
            points.update(range(self._every, self._steps, self._every))
        for cb in self._callbacks:
            n = cb.sync_every
            if not n:
                continue
            point = ((base + first) // n + 1) * n
            while point < base + self._steps:
                points.add(point - base)
                point += n
        if sync_point is not None:
            points = {sync_point(p) for p in points}
        return sorted(p for p in points if p > first)

    def failed(self, error):
        """Tells every callback that `fit` fails with `error` (the program's, not retried)."""
        for cb in self._callbacks:
            cb.on_train_failed(error)

    def preempted(self, epoch, step, logs):
        """Tells every callback that `fit` stops after `step` steps of `epoch` (all applied);
        returns the paths of the backups they wrote."""
        written = [cb.on_train_preempt(epoch, step, logs) for cb in self._callbacks]
        return [path for path in written if path]

    def synchronised(self, epoch, step, logs, since=None):
        """Tells each due callback that `step` steps of `epoch` are done and applied: each
        whose `sync_every` has a multiple at `step`, or after the previous synchronisation
        at `since` (a point moved to the end of a split trained whole)."""
        global_step = epoch * self._steps + step
        after = global_step - 1 if since is None else epoch * self._steps + since
        for cb in self._callbacks:
            if cb.sync_every and global_step // cb.sync_every > after // cb.sync_every:
                cb.on_train_sync(epoch, step, logs)
