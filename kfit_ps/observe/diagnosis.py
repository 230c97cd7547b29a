"""Naming a straggling worker and a hot ps from rates over a sliding window.

Rules (DLRover's, adapted to what a coordinator sees):

- **straggler**: a worker whose speed over the window is below
  `STRAGGLER_RATIO` of the median of the other workers'. Speed is steps per
  second of work: steps finished over the seconds its functions took, so a
  job that synchronises often (every worker then waits for the slowest at
  each `join()`, and their step counts even out) still shows which worker
  its steps wait for. A worker with no step at all is lost or restarting,
  not slow: the launcher's liveness watch and TensorFlow's re-dispatch
  handle it.
- **hot ps**: a ps whose CPU over the window is at least `HOT_QUOTA_RATIO`
  of its quota (its cgroup's `cpu.max`, as Kubernetes sets from a CPU limit),
  or at least `HOT_RATIO` times the median of the other ps tasks and at least
  `HOT_MIN_CORES`.

A rule names a task once it has held for `sustain` seconds in a row, and
clears it once it no longer holds. `Diagnosis.update` returns what changed.
"""

import collections
import dataclasses
import statistics

STRAGGLER_RATIO = 0.65
HOT_RATIO = 3.0
HOT_MIN_CORES = 0.2
HOT_QUOTA_RATIO = 0.9
DEFAULT_WINDOW = 15.0
DEFAULT_SUSTAIN = 12.0


@dataclasses.dataclass(frozen=True)
class Finding:
    """A task named (`active`) or cleared: `kind` is "straggler" or "hot_ps"."""

    kind: str
    task: str
    active: bool
    text: str
    fields: dict


class Window:
    """Cumulative counters per task, sampled over time; rates over the last `seconds`."""

    def __init__(self, seconds):
        self.seconds = seconds
        self._samples = collections.defaultdict(collections.deque)

    def add(self, task, now, value):
        samples = self._samples[task]
        samples.append((now, value))
        while len(samples) > 2 and samples[1][0] <= now - self.seconds:
            samples.popleft()

    def change(self, task, now):
        """(change of the value, seconds) over the window, or None until it is covered."""
        samples = self._samples.get(task)
        if not samples or len(samples) < 2:
            return None
        (t0, v0), (t1, v1) = samples[0], samples[-1]
        if t1 - t0 < self.seconds * 0.8 or now - t1 > self.seconds:
            return None
        return max(0.0, v1 - v0), t1 - t0

    def rate(self, task, now):
        """Change per second over the window, or None until the window is covered."""
        change = self.change(task, now)
        return None if change is None else change[0] / change[1]

    def forget(self, task):
        self._samples.pop(task, None)


class Diagnosis:
    """Feeds on per-worker steps and per-ps CPU seconds; names stragglers and hot ps."""

    def __init__(self, window=DEFAULT_WINDOW, sustain=DEFAULT_SUSTAIN):
        self.steps = Window(window)
        self.busy = Window(window)  # Seconds each worker's finished functions took.
        self.cpu = Window(window)
        self.quota = {}
        self.sustain = sustain
        self._since = {}  # (kind, task) -> when its rule began to hold
        self.named = set()  # (kind, task) named now

    def speeds(self, now):
        """{worker: steps per second of work} over the window, for workers with steps."""
        speeds = {}
        for task in self.steps._samples:
            steps, busy = self.steps.change(task, now), self.busy.change(task, now)
            if steps and busy and steps[0] > 0 and busy[0] > 0:
                speeds[task] = steps[0] / busy[0]
        return speeds

    def rates(self, now):
        workers = {t: self.steps.rate(t, now) for t in self.steps._samples}
        ps = {t: self.cpu.rate(t, now) for t in self.cpu._samples}
        return ({t: r for t, r in workers.items() if r is not None},
                {t: r for t, r in ps.items() if r is not None})

    def update(self, now):
        """The findings that changed at `now`."""
        _, ps = self.rates(now)
        speeds = self.speeds(now)
        holding = {}
        for task, speed in speeds.items():
            others = [r for t, r in speeds.items() if t != task]
            if not others:
                continue
            median = statistics.median(others)
            if speed < STRAGGLER_RATIO * median:
                holding[("straggler", task)] = (
                    f"{task} is straggling: {speed:.1f} steps per second of work over the "
                    f"last {self.steps.seconds:g} s, the other workers {median:.1f} (median)",
                    {"steps_per_second": round(speed, 3), "others": round(median, 3)})
        for task, cores in ps.items():
            quota = self.quota.get(task)
            others = [r for t, r in ps.items() if t != task]
            median = statistics.median(others) if others else None
            near_quota = quota and cores >= HOT_QUOTA_RATIO * quota
            far_above = (median is not None and cores >= HOT_MIN_CORES
                         and cores >= HOT_RATIO * median)
            if near_quota or far_above:
                why = (f"{cores:.2f} of its {quota:g} CPU cores" if near_quota else
                       f"{cores:.2f} CPU cores, the other ps tasks {median:.2f} (median)")
                advice = ("it is near its CPU limit" if near_quota else "its variables take "
                          "most of the work; a variable_partitioner spreads large ones")
                holding[("hot_ps", task)] = (
                    f"{task} is hot: {why} over the last {self.cpu.seconds:g} s; {advice}",
                    {"cpu_cores": round(cores, 3), "quota_cores": quota,
                     "others": None if median is None else round(median, 3)})
        changes = []
        for key in list(self._since):
            if key not in holding:
                del self._since[key]
        for key, (text, fields) in holding.items():
            since = self._since.setdefault(key, now)
            if key not in self.named and now - since >= self.sustain:
                self.named.add(key)
                changes.append(Finding(key[0], key[1], True, text, fields))
        for key in sorted(self.named - set(holding)):
            self.named.discard(key)
            changes.append(Finding(key[0], key[1], False, f"{key[1]} is no longer "
                                   f"{'straggling' if key[0] == 'straggler' else 'hot'}", {}))
        return changes
