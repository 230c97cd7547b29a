"""On a host of ps servers: notice that the job's chief went away, so that its ps restart.

A TensorFlow ps keeps every variable a chief created for as long as the ps
runs, and a new chief creates its own (it restores them from the last
backup). On one host, `kfit-ps run` restarts the ps tasks with the chief. On
a host that runs ps tasks but not the chief (many hosts, Kubernetes), its
launcher cannot see the chief's process, so it watches the chief's address:
a chief that accepted connections and then stops accepting them (its process
ended; a new one connects only once it has started again) is gone, and the
launcher restarts its ps tasks. No dead chief's variables stay in a ps's
memory, and nobody restarts ps pods by hand.
"""

import time

from kfit_ps import constants, net


class ChiefWatch:
    """Says once per chief incarnation that it went away (see the module doc).

    Args:
        address: the chief's `host:port`.
        interval: seconds between two probes. Defaults to 0.5.
        misses: consecutive failed probes that mean "gone". Defaults to 2.
    """

    def __init__(self, address, interval=0.5, misses=2, probe=net.accepts_connections,
                 clock=time.monotonic):
        self.address = address
        self._interval, self._misses = interval, misses
        self._probe, self._clock = probe, clock
        self._seen_up = False
        self._missed = 0
        self._next = 0.0

    def gone(self):
        """True once after a chief that was seen up has missed `misses` probes in a row."""
        now = self._clock()
        if now < self._next:
            return False
        self._next = now + self._interval
        if self._probe(self.address, timeout=self._interval):
            self._seen_up, self._missed = True, 0
            return False
        if not self._seen_up:
            return False
        self._missed += 1
        if self._missed < self._misses:
            return False
        self._seen_up, self._missed = False, 0
        return True


def for_host(cluster, tasks):
    """The `ChiefWatch` of a host that runs ps `tasks` of `cluster` but not the chief, or
    None (no ps here, or no chief in the cluster)."""
    config = cluster.config if cluster is not None else None
    has_ps = any(t == constants.PS for t, _ in (tasks or ()))
    if config is None or not has_ps or not config.num_tasks(constants.CHIEF):
        return None
    return ChiefWatch(config.address(constants.CHIEF, 0))
