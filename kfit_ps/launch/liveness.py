"""Finding a server that runs and accepts connections but no longer answers (wedged).

The kernel accepts TCP connections for a process that is stopped, deadlocked or
swapped to a standstill, so "accepts connections" is no health check. A gRPC
server answers an HTTP/2 handshake from its I/O threads at once
(`net.answers_grpc`); one that has answered none for `timeout` seconds is
wedged, and the launcher kills it, so that its restart and TensorFlow's
re-run of its functions follow as for any lost task.
"""

import time

from kfit_ps import net


class LivenessWatch:
    """Probes servers at most every `interval` s; names those silent for `timeout` s.

    Args:
        timeout: seconds without an answer after which a server is wedged; 0 turns
            the watch off.
        interval: seconds between two probes of a server. Defaults to 2.
    """

    def __init__(self, timeout, interval=2.0, probe=net.answers_grpc, clock=time.monotonic):
        self.timeout, self._interval = timeout, interval
        self._probe, self._clock = probe, clock
        self._last_answer = {}  # (task, pid) -> when it last answered (or started)
        self._next = 0.0

    def wedged(self, servers):
        """`servers`: `{task: (pid, address)}` of the running servers. Returns the tasks
        that have not answered for `timeout` seconds; a server named is counted afresh."""
        now = self._clock()
        if not self.timeout or now < self._next:
            return []
        self._next = now + self._interval
        live = {(task, pid) for task, (pid, _) in servers.items()}
        self._last_answer = {k: v for k, v in self._last_answer.items() if k in live}
        found = []
        for task, (pid, address) in sorted(servers.items()):
            key = (task, pid)
            since = self._last_answer.setdefault(key, now)  # a new process counts from now
            if self._probe(address, timeout=min(self._interval, self.timeout)):
                self._last_answer[key] = self._clock()
            elif now - since >= self.timeout:
                found.append(task)
                self._last_answer.pop(key)
        return found
