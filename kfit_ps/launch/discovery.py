"""Workers found through DNS: the chief's launcher publishes the names that resolve.

With `kfit-ps run --tasks chief:0 --discover-workers PATTERN`, the workers are
whoever DNS says they are, not `TF_CONFIG`'s list. Two kinds of pattern:

- `name-worker-{i}.name-worker.ns.svc:2222`: the names of indices 0 .. `max_workers`-1
  (a StatefulSet's pods under its headless Service, a JobSet's pods under its
  subdomain). Each name that resolves *and* serves joins; the list holds the
  names, not their addresses, so a pod that comes back at a new address under
  its name keeps its place: TensorFlow resolves the name again when it recovers
  the lost worker, and no new list is published.
- `name-worker.ns.svc:2222` (no `{i}`): the Service's A records, each address one
  worker. A pod back at a new address is a new worker; its old address leaves
  after the grace.

`DnsWorkers.poll()` asks DNS once per `POLL_SECONDS`, each name in its own
thread, bounded by `RESOLVE_SECONDS`. A name that stops resolving stays a worker
for `grace` seconds (a pod restarting under its name); past it, it is removed.
`DiscoveredWorkers` (the supervisor's scaler in this mode) publishes the list
through `kfit_ps.membership` exactly as `launch.scaling` does, one change at a
time, each after the chief applied the one before; the chief's side
(`kfit_ps.training.resilience.elastic`) is the same. Kept workers never change
their task index: a removal in the middle of the list first publishes the
workers before it, then, once applied, the ones after it again as new workers.
Never an empty list: with no worker left, the last list stays. A `kfit-ps scale`
request is refused here: DNS decides.

`DiscoveredWorkers` publishes for the chief's host of a `--tasks` job without
`--discover-workers` too: its source is then `TF_CONFIG`'s worker list
(`launch.roster.ListedWorkers`), and a scale request sets how many of it the job uses.
"""

import concurrent.futures
import dataclasses
import os
import re
import socket
import time

from kfit_ps import constants, membership, net

POLL_SECONDS = 1.0  # between two looks at DNS
RESOLVE_SECONDS = 2.0  # the longest one look waits for its answers
SERVE_SECONDS = 1.0  # the longest a new name's server is asked whether it serves
_INDEX = "{i}"


def _fail(text, problem):
    raise ValueError(f"--discover-workers: {problem} Received: --discover-workers {text!r}. "
                     "Pass HOST:PORT with {i} where the worker's index goes, e.g. "
                     "job-worker-{i}.job-worker.default.svc:2222, or a headless Service's "
                     "name and port, e.g. job-worker.default.svc:2222.")


@dataclasses.dataclass(frozen=True)
class WorkerPattern:
    """Where the workers are: `host` (with `{i}` for the index, or a Service) and `port`."""

    host: str
    port: int

    @classmethod
    def parse(cls, text):
        host, sep, port = str(text).rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            _fail(text, "it must end with :PORT (the workers' gRPC port).")
        rest = host.replace(_INDEX, "")
        if "{" in rest or "}" in rest or host.count(_INDEX) > 1:
            _fail(text, "the only placeholder it may hold is one {i}.")
        if not re.fullmatch(r"[A-Za-z0-9.-]+", rest):
            _fail(text, "the host must be a DNS name (letters, digits, '-' and '.').")
        return cls(host, int(port))

    @property
    def indexed(self):
        return _INDEX in self.host

    def __str__(self):
        return f"{self.host}:{self.port}"


def resolve(host):
    """The IPv4 addresses `host` resolves to now (sorted), or [] when it does not resolve."""
    try:  # IPv4 (A records): a worker's `address:port` is what TensorFlow dials.
        infos = socket.getaddrinfo(host, None, family=socket.AF_INET, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, OSError):
        return []
    return sorted({info[4][0] for info in infos})


def serving(addresses, timeout=SERVE_SECONDS):
    """Those of `addresses` (`host:port`) whose gRPC server answers now (`net`'s one wait,
    a single look)."""
    missing = set(net.wait_for_servers(
        [(address, address) for address in addresses], 0,
        ready=lambda name, address: net.answers_grpc(address, timeout)))
    return [address for address in addresses if address not in missing]


class DnsWorkers:
    """The workers DNS names now, with a grace for names that stop resolving.

    `poll()` returns the wanted list: the known workers whose name resolved within
    `grace` seconds, in their order, then the new ones that resolve and serve
    (by index, or by address), at most `max_workers`.
    """

    def __init__(self, pattern, max_workers, grace, resolve=resolve, serving=serving,
                 clock=time.monotonic):
        self.pattern, self.max_workers, self.grace = pattern, max_workers, grace
        self._resolve, self._serving, self._clock = resolve, serving, clock
        self._seen = {}  # worker address -> when its name last resolved
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=min(16, max_workers), thread_name_prefix="kfit_ps-dns")
        self._asking = {}  # host -> its unfinished resolution (a stuck resolver)

    def _look(self):
        """`{worker address: resolves now}` for every name asked."""
        if self.pattern.indexed:
            hosts = [self.pattern.host.replace(_INDEX, str(i)) for i in range(self.max_workers)]
        else:
            hosts = [self.pattern.host]
        for host in hosts:
            if host not in self._asking:
                self._asking[host] = self._pool.submit(self._resolve, host)
        concurrent.futures.wait([self._asking[h] for h in hosts], timeout=RESOLVE_SECONDS)
        found = {}
        for host in hosts:
            future = self._asking[host]
            if not future.done():
                continue  # Unknown this time: neither seen nor missed.
            del self._asking[host]
            ips = future.result()
            if self.pattern.indexed:
                found[f"{host}:{self.pattern.port}"] = bool(ips)
            else:
                found.update({f"{ip}:{self.pattern.port}": True for ip in ips})
        return found

    def poll(self, current):
        """The workers wanted now, given `current` (the last list published)."""
        now = self._clock()
        found = self._look()
        for address, resolves in found.items():
            if resolves:
                self._seen[address] = now
        for address in current:  # A known worker's grace starts when it is first missed.
            self._seen.setdefault(address, now)
        kept = [a for a in current if now - self._seen[a] <= self.grace]
        new = [a for a, resolves in found.items() if resolves and a not in current]
        room = max(0, self.max_workers - len(kept))
        new = self._serving(sorted(new, key=self._order)[:room]) if room and new else []
        return kept + new

    def _order(self, address):
        host = address.rpartition(":")[0]
        if self.pattern.indexed:
            prefix, _, suffix = self.pattern.host.partition(_INDEX)
            index = host[len(prefix):len(host) - len(suffix)]
            return (int(index) if index.isdigit() else 0, host)
        return (0, socket.inet_aton(host) if host.count(".") == 3 else host)

    def request(self, workers, current):
        """A `kfit-ps scale` request: refused (DNS decides). Returns what to say."""
        return (f"scale to {workers} workers refused: this job's workers are found through DNS "
                f"at {self.pattern}; add or remove worker hosts (kubectl scale) instead")

    def __str__(self):
        return f"DNS at {self.pattern}"

    def close(self):
        self._pool.shutdown(wait=False, cancel_futures=True)


def next_step(current, wanted):
    """The next list to publish on the way from `current` to `wanted`.

    `wanted` keeps `current`'s order. Adding appends; a removal publishes the workers
    before the first removed one (a kept worker never changes its task index); the rest
    come back, as new workers, in the step after. When the first one is removed, there is
    no such prefix: the list is `wanted` at once, each worker at its new index.
    """
    if wanted[:len(current)] == list(current):
        return list(wanted)
    keep = 0
    while keep < len(current) and current[keep] in wanted:
        keep += 1
    # The first worker gone: no kept prefix (a list is never empty), all take new indices.
    return list(current[:keep]) if keep else list(wanted)


class DiscoveredWorkers:
    """The scaler of a chief's launcher of a multi-host job: publishes what `source` wants.

    It has `launch.scaling.Scaler`'s interface: the supervisor calls `poll()` in its loop.
    `source` is a `DnsWorkers` (`--discover-workers`, see the module doc) or a
    `launch.roster.ListedWorkers` (`TF_CONFIG`'s workers): `poll(current)` returns the
    workers wanted now, `request(workers, current)` takes a `kfit-ps scale` request and
    returns what to say, `str(source)` says where the workers come from.
    """

    def __init__(self, run_dir, say, view, source, clock=time.monotonic):
        self.directory = os.path.join(run_dir, membership.DIR_NAME)
        membership.reset(self.directory)
        self.say, self.view, self._clock = say, view, clock
        self.source = source
        self.generation = 0
        self.workers = []  # The list published last (the chief's at its next start).
        self._next_look = 0.0
        self._none_said = False
        self._leaving = None  # (generation, {task: address}) until the chief drained them

    @classmethod
    def through_dns(cls, run_dir, say, view, pattern, max_workers, grace):
        """The publisher of `--discover-workers PATTERN`."""
        return cls(run_dir, say, view, DnsWorkers(WorkerPattern.parse(pattern), max_workers,
                                                  grace))

    def wait_for_workers(self, sleep=time.sleep):
        """Returns the first list, once the source wants at least one worker (DNS: one that
        resolves and serves; TF_CONFIG's list: at once)."""
        said = False
        while not self.workers:
            self.poll(None, chief_running=False)
            if not self.workers:
                if not said:
                    self.say(f"waiting for workers from {self.source}")
                    said = True
                sleep(POLL_SECONDS)
        return self.workers

    def poll(self, cluster, chief_running):
        """Hands a `kfit-ps scale` request to the source; publishes the next change it asks
        for."""
        workers = membership.take_request(self.directory)
        if workers is not None:
            self.view.emit("scale", None, f"scale to {workers} workers requested",
                           workers=workers)
            self.say(self.source.request(workers, self.workers))
        now = self._clock()
        if now < self._next_look:
            return False
        self._next_look = now + POLL_SECONDS
        if self.generation and chief_running and not membership.applied(
                self.directory, self.generation):
            return False  # One change at a time: the chief has not taken the last one.
        if self._leaving is not None:
            how = ("drained by the chief" if membership.applied(self.directory, self.generation)
                   else "no chief is running: its next start leaves it out")
            for task, address in self._leaving.items():
                self.view.emit("task_removed", task, f"{address} left the job ({how}): it "
                               "may stop now", address=address)
            self._leaving = None
        wanted = self.source.poll(self.workers)
        if not wanted:
            if self.workers and not self._none_said:
                self.say(f"no worker comes from {self.source} any more; the job keeps "
                         f"{len(self.workers)} until one does")
            self._none_said = True
            return False
        self._none_said = False
        step = next_step(self.workers, wanted)
        if step == self.workers:
            return False
        self._publish(step, wanted)
        return True

    def _publish(self, workers, wanted):
        before, self.workers = self.workers, list(workers)
        self.generation += 1
        membership.publish(self.directory, self.generation, self.workers)
        for index, address in enumerate(self.workers):
            if index >= len(before) or before[index] != address:
                self.view.emit("worker_ready", f"{constants.WORKER}:{index}",
                               f"{address} joins the job: worker:{index}",
                               address=address)
        # Those that leave the job (not those that come back at a new index next).
        leaving = {f"{constants.WORKER}:{index}": address for index, address in enumerate(before)
                   if address not in wanted}
        if leaving:
            self._leaving = leaving
        if before:
            self.say(f"workers from {self.source}: {len(self.workers)} (was {len(before)}): "
                     f"{', '.join(self.workers)}; the chief takes them at its next safe point")

    def close(self):
        self.source.close()
