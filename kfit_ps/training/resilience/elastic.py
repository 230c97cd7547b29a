"""Workers that join and leave during `fit`: the chief's side.

Under `kfit-ps run`, the launcher publishes the job's worker list
(`kfit_ps.membership`, in the directory named by `KFIT_PS_MEMBERSHIP`)
whenever `kfit-ps scale` or DNS (`--discover-workers`) changes it. `fit`
(and `evaluate`) ask `pending()` while they schedule and join; when a new
list is there:

1. nothing more is scheduled; the functions no worker has started are dropped
   (`cluster_health.join(cancel_when=...)`, the same path as a SIGTERM) and the
   running ones finish: a removed worker is drained, no step is lost;
2. `apply()` rebuilds the coordinator over the new workers at that safe point
   (`ParameterServerStrategy.resize_workers`) and acknowledges the generation, so
   that the launcher may stop a removed worker;
3. `fit` schedules the dropped steps again, on the new set of workers.

Steps, `optimizer.iterations` and metrics stay exact: a dropped function never
ran, and each function's metric state is added once (`metric_state`). The
pause costs one `join()` plus the rebuild (about 0.1 s on one host).
Without `KFIT_PS_MEMBERSHIP` (a plain script), `pending()` is always False.
"""

import time

from kfit_ps import _tf_compat, constants, membership

_POLL_SECONDS = 0.5  # between two looks at the membership directory


class Elastic:
    """The chief's view of the launcher's worker lists (see the module doc)."""

    def __init__(self, directory):
        self.directory = directory
        self._applied = 0
        self._latest = None
        self._next_look = 0.0

    def _look(self):
        now = time.monotonic()
        if now >= self._next_look:
            self._next_look = now + _POLL_SECONDS
            self._latest = membership.latest(self.directory)
        return self._latest

    def pending(self, strategy):
        """Whether the launcher published workers other than those `strategy` trains on."""
        latest = self._look()
        if latest is None or latest[0] <= self._applied:
            return False
        if list(latest[1]) == list(strategy.worker_addresses):
            self._applied = latest[0]
            membership.acknowledge(self.directory, latest[0])
            return False
        return True

    def apply(self, strategy, monitor):
        """Moves `strategy` to the newest worker list; returns its new coordinator.

        Call it with no function in flight."""
        generation, workers = self._latest
        before = [f"worker:{i}" for i in range(strategy.num_workers)]
        start = time.monotonic()
        coordinator = strategy.resize_workers(workers)
        self._applied = generation
        membership.acknowledge(self.directory, generation)
        reason = (f"now training on {len(workers)} workers (was {len(before)}; "
                  f"{time.monotonic() - start:.2f} s at a safe point)")
        _tf_compat.print_msg(f"kfit_ps: {reason}")
        monitor.workers_changed(strategy, before, reason)
        return coordinator


class _Fixed:
    """A plain script's cluster: the workers never change."""

    def pending(self, strategy):
        return False


def from_environment():
    directory = constants.membership_dir()
    return Elastic(directory) if directory else _Fixed()


_current = []


def elastic():
    """This process's `Elastic` (one per process: generations are acknowledged once)."""
    if not _current:
        _current.append(from_environment())
    return _current[0]
