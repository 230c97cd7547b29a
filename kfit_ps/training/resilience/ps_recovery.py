"""A lost ps restored in place: training goes on in the same chief process.

Under `kfit-ps run --ps-recovery in-place` (the default), the launcher restarts a
ps that died at its address (on many hosts, `--tasks`, the ps host's own
launcher), and the chief's `fit` does not stop: when a scheduled function fails,
`PsRecovery.lost()` probes every ps task's variables (a ps that died or
restarted no longer answers for them). The chief learns of the loss and of the
new process from its connection alone, never from a launcher's process table,
so a ps on another host is restored the same way. For those tasks, `recover()`:

1. waits for the functions in flight (those that used the lost ps fail; their
   steps are scheduled again), then for the ps to accept connections again;
2. reconnects to its new incarnation and makes each of its variables again, empty
   (`_tf_compat.ps_restore`);
3. reads the newest complete backup of this `fit` (`BackupAndRestore`) and writes
   *only the values that lived on that ps* (whole variables, shards of sharded
   variables, optimizer slots); the other ps tasks keep their current values;
4. `optimizer.iterations`, if it lived there, is set to the exact number of steps
   finished (the loop counts them), not to the backup's;
5. drops the traced functions (they captured the dead handles) so that the next
   steps trace them again.

What it means for the model: the restored variables are older than the rest by
the steps trained since that backup (at most `save_freq`, plus the functions in
flight); every other variable keeps its progress, and the steps lost are not
re-run. A function that failed with the ps may have applied its update to the
other ps tasks before it failed (its step is then run again: at-least-once, at
most the functions in flight).

When it is impossible, `fit` raises `ParameterServerError` as before and the
launcher restarts the whole job from the backup: no backup of this `fit` yet, a
`DynamicEmbedding` (its hash tables are not made again in place), a one-pass epoch
(its ledger records splits by position), the ps not back within
`KFIT_PS_STARTUP_TIMEOUT`, or a plain script (no launcher restarts the ps).
"""

import time

from kfit_ps import _tf_compat, constants, embeddings, net
from kfit_ps.training.resilience import cluster_health
from kfit_ps.training.callbacks.backup_and_restore import BackupAndRestore


_DRAIN_SECONDS = 60  # The functions in flight when a ps is lost end (failed) well within it.
_RECONNECT_SECONDS = 60.0


class PsRecovery:
    """In-place recovery of lost ps tasks for one `fit` (see the module doc)."""

    def __init__(self, model, strategy, callbacks, ledger, monitor, shipped=False):
        self.model, self.strategy, self.monitor = model, strategy, monitor
        self.backup = next((c for c in callbacks if isinstance(c, BackupAndRestore)), None)
        self.why_not = None
        if not constants.ps_recovery_in_place():
            self.why_not = "in-place ps recovery is off (KFIT_PS_PS_RECOVERY)"
        elif self.backup is None:
            self.why_not = "the fit has no BackupAndRestore to restore from"
        elif embeddings.dynamic_layers(model):
            self.why_not = "DynamicEmbedding tables are not restored in place"
        elif ledger is not None:
            self.why_not = "one-pass epochs record their splits by position"
        elif shipped:
            self.why_not = "shipped one-pass epochs schedule their batches by position"
        self._iterations = model.optimizer.iterations if model.optimizer is not None else None
        self._recovered_at = None
        if self.why_not is not None and constants.ps_recovery_in_place():
            _tf_compat.print_msg(f"kfit_ps: a lost ps restarts the job in this fit, not in place: "
                                 f"{self.why_not}")

    def iterations(self):
        """`optimizer.iterations` now (read only when a recovery could need it), or None."""
        if self.why_not is not None or self._iterations is None:
            return None
        return int(self._iterations.numpy())

    def lost(self, error):
        """The ps tasks whose variables no longer answer (after a failed function), or []
        when in-place recovery does not apply: then `error` is the caller's to raise.

        Right after a recovery, workers may still fail to reach the restarted ps for a few
        seconds (gRPC waits before it connects again): `transient(error)` says so."""
        del error  # Whatever it says: the probe below tells a lost ps from a failed program.
        if self.why_not is not None:
            return []
        _tf_compat.ps_restore.drain(self.strategy.coordinator, time.monotonic() + _DRAIN_SECONDS)
        lost = []
        for task in range(self.strategy.num_ps):
            variables = _tf_compat.ps_restore.variables_on(task)
            if variables and not all(_tf_compat.ps_restore.readable(v) for v in variables[:1]):
                lost.append(task)
        return lost

    def transient(self, error):
        """Whether `error` is a worker not reaching a ps that answers the chief, within
        `_RECONNECT_SECONDS` of a recovery: the failed functions are then run again."""
        return (self._recovered_at is not None and cluster_health.is_ps_loss(error)
                and time.monotonic() - self._recovered_at < _RECONNECT_SECONDS)

    def recover(self, tasks, iterations):
        """Restores `tasks` in place; `iterations`: the exact count of steps finished."""
        started = time.monotonic()
        deadline = started + constants.startup_timeout()
        path, marker = self.backup.newest_backup()
        if path is None:
            raise _impossible(tasks, "this fit has written no backup yet")
        servers = [(f"ps:{task}", _tf_compat.ps_restore.ps_address(task)) for task in tasks]
        missing = net.wait_for_servers(servers, deadline - time.monotonic())
        if missing:
            where = dict(servers)
            raise _impossible(tasks, ", ".join(f"{name} ({where[name]})" for name in missing)
                              + f" did not come back within {constants.startup_timeout():g} s")
        _tf_compat.ps_restore.reconnect(self.strategy.coordinator, deadline)
        recreated = [v for task in tasks for v in _tf_compat.ps_restore.variables_on(task)]
        for variable in recreated:
            _tf_compat.ps_restore.recreate(variable)
        with _tf_compat.ps_restore.restoring_only(tasks) as restored:
            self.model.load_weights(path)
        written = restored["bytes"]
        # Metrics are written whole when results are folded; anything else the backup did not
        # write would be read empty by the next step: the job restarts instead.
        metrics = _tf_compat.ps_restore.resources_of(
            [v for metric in self.model.metrics for v in metric.variables])
        empty = [v for v in recreated
                 if id(v) not in metrics and not _tf_compat.ps_restore.holds_value(v)]
        if empty:
            names = ", ".join(sorted({v.name for v in empty})[:5])
            raise _impossible(tasks, (
                f"the backup holds no value for {len(empty)} variable(s) it held ({names}): "
                "variables made under the strategy's scope that are neither the model's "
                "weights nor its optimizer's (a custom train step's, a captured one's); no "
                "step ran on them"))
        if iterations is not None:
            self._iterations.assign(iterations)  # Exact, wherever it lives.
        for slot in ("train_function", "test_function", "predict_function"):
            setattr(self.model, slot, None)  # They hold the dead handles: traced again.
        names = ", ".join(f"ps:{t}" for t in tasks)
        self._recovered_at = time.monotonic()
        seconds = time.monotonic() - started
        size = (f"{written / 2**20:.{0 if written >= 10 * 2**20 else 2}f} MB"
                if written >= 2**20 / 100 else f"{written} bytes")  # Never "0 MB" nor "0.00".
        reason = (f"{names} restored in place from the backup of step {marker['step']} "
                  f"({size}) in {seconds:.1f} s; the other ps tasks keep their state")
        _tf_compat.print_msg(f"kfit_ps: {reason}")
        for task in tasks:
            self.monitor.event("ps_restored", f"ps:{task}", reason, seconds=round(seconds, 3),
                               backup_step=marker["step"], bytes=written)


def _impossible(tasks, why):
    from kfit_ps.errors import ParameterServerError

    names = [f"ps:{t}" for t in tasks]
    return ParameterServerError(
        f"Parameter server {', '.join(names)} was lost and cannot be restored in place: {why}. "
        "Rerun the script to resume from the last backup (kfit-ps run restarts the job by "
        "itself).", tasks=names)
