"""What the launcher shows of its job: metrics, the event log, the status page.

`JobView` is fed by the supervisor (a task started, ended, was restarted)
and samples its host's processes with `psutil` every `SAMPLE_SECONDS`. It
serves, at `--status-address:--status-port`:

- `/`: the status page (`kfit_ps.observe.page`);
- `/status.json`: tasks with state, pid, restarts, steps/s, CPU and memory;
  the last events but epochs; the training curve (the `epoch` events' loss);
- `/metrics`: this host's task metrics and, on the chief's host, the chief's
  (scraped from its `KFIT_PS_METRICS_PORT` on loopback and passed on), so a
  scraper needs one port per host or pod.

`kfit-ps status` reads `status.json` (its address is in `tasks.json`).
"""

import collections
import json
import threading
import time
import urllib.request

import os

from kfit_ps import constants, exit_status, net
from kfit_ps.launch.policy import Action
from kfit_ps.observe import events as event_log
from kfit_ps.observe import metrics as observe_metrics
from kfit_ps.observe import usage
from kfit_ps.observe.http import Server
from kfit_ps.observe.page import HTML

SAMPLE_SECONDS = 2.0
RECENT_EVENTS = 30
_CHIEF_SCRAPE_TIMEOUT = 2.0


def restart_reason(status):
    """The `reason` label of a restart after a process ended with `status`."""
    if status is not None and status < 0:
        return "killed" if exit_status.from_returncode(status) == exit_status.KILLED else "signal"
    if status == exit_status.CLUSTER_ERROR:
        return "cluster_error"
    return "program_error"


class JobView:
    """The launcher's metrics, events and status page; see the module doc."""

    def __init__(self, run_dir, job, address="127.0.0.1", port=0, chief_metrics_port=None):
        self.job = job
        self.metrics = observe_metrics.Metrics(job, "launcher")
        self.run_dir = run_dir
        self.events_path = os.path.join(run_dir, "events.jsonl")
        self.log = event_log.EventLog(self.events_path, "launcher")
        self._events = event_log.Follower(self.events_path)
        self._notable = collections.deque(maxlen=RECENT_EVENTS)  # The page's recent events.
        self._epochs = []  # `epoch` events: the curve.
        self._events_lock = threading.Lock()
        self.chief_metrics_port = chief_metrics_port
        self.started = time.time()
        self.state = "starting"
        self._pids = {}  # task -> pid of its current process
        self._ended = {}  # task -> status of a process that ended and is not back yet
        self._restarts = {}
        self._due_reasons = {}  # task -> why its next start is a restart
        self._cpu = {}  # task -> (time, cpu seconds, cores over the last sample)
        self._rss = {}
        self._next_sample = 0.0
        self.server = Server(address, port, {
            "/": lambda: ("text/html; charset=utf-8", HTML),
            "/status.json": lambda: ("application/json", json.dumps(self.status())),
            "/metrics": lambda: (observe_metrics.CONTENT_TYPE, self.metrics_text()),
        })

    @property
    def url(self):
        return self.server.url

    @classmethod
    def open(cls, config, run_dir, say):
        """The view of a `LaunchConfig`'s run: serving, said where, the job's start logged."""
        chief_port = None
        if config.runs_chief:
            chief_port = (config.status_port + 1 if config.status_port
                          else net.free_port("127.0.0.1"))
        view = cls(run_dir, constants.job_name(), config.status_address, config.status_port,
                   chief_metrics_port=chief_port)
        say(f"status page {view.url} (metrics at {view.url}metrics; `kfit-ps status "
            f"--run-dir {run_dir}`); events in {view.events_path}")
        view.emit("start", None, f"{config!r}", pid=os.getpid())
        return view

    def write_tasks(self, tasks, restarts):
        """`tasks.json` of the run directory: each task's current pid, the restarts the
        policy counted, the supervisor's pid and the status page's address."""
        text = json.dumps({"supervisor": os.getpid(), "tasks": tasks, "restarts": restarts,
                           "status_url": self.url})
        with open(os.path.join(self.run_dir, "tasks.json"), "w") as f:
            f.write(text)  # One write: a reader may still see it empty for a moment; retry.

    def finish(self, status):
        """The launcher ends with `status` (None: before it had one)."""
        self.emit("done", None, "the launcher ends" if status is None
                  else f"the launcher ends with {exit_status.describe(status)}", status=status)
        self.close(status)

    # Fed by the supervisor ---------------------------------------------------------------

    def record_exit(self, event, decision):
        """A `TaskExit` and the policy's decision: logged, counted, and why the task's next
        start is a restart."""
        self.ended(event.task, event.status, decision.reason)
        self._due_reasons.setdefault(event.task, restart_reason(event.status))
        if event.kind == constants.PS and decision.action is Action.WAIT_FOR_CHIEF:
            self.emit("ps_lost", event.task, f"{event.task} was lost: the chief's fit stops, "
                      "then every task of this host restarts")
        elif event.kind == constants.PS and decision.action is Action.RESTART_TASK:
            self.emit("ps_lost", event.task, f"{event.task} was lost: it restarts, and the "
                      "chief restores its variables in place where it can, else the job "
                      "restarts")
        if decision.action is Action.RESTART_JOB:
            self.state = "restarting"
            self.emit("job_restart", None, decision.reason, delay=decision.delay)

    def restart_is_due(self, task, reason):
        """The supervisor stops `task` itself for `reason` (a `RESTART_REASONS` value)."""
        self._due_reasons[task] = reason

    def started_task(self, task, pid):
        """`task` runs as `pid`: its first start, or a restart (for the reason recorded, else
        a job restart)."""
        first = task not in self._pids and task not in self._ended
        reason = self._due_reasons.pop(task, None)
        self._pids[task] = pid
        if task == f"{constants.CHIEF}:0" or self.chief_metrics_port is None:
            self.state = "running"  # (on a host of servers only: once they start)
        self._ended.pop(task, None)
        self._cpu.pop(task, None)
        self.metrics.child("kfit_ps_task_up", task).set(1)
        if not first:
            reason = reason or "job_restart"
            self._restarts[task] = self._restarts.get(task, 0) + 1
            self.metrics.child("kfit_ps_task_restarts", task, reason=reason).inc()
            self.log.emit("restart", task, f"{task} is back (pid {pid})", pid=pid,
                          cause=reason)

    def removed_task(self, task, reason):
        """`task` left the job (`kfit-ps scale`): stopped on purpose, no longer listed."""
        self._pids.pop(task, None)
        self._ended.pop(task, None)
        self._cpu.pop(task, None)
        self.metrics.forget(task)  # Not a task of the job any more: no series, no alert.
        self.log.emit("task_removed", task, reason)

    def ended(self, task, status, reason):
        self._ended[task] = status
        self._pids.pop(task, None)
        self.metrics.child("kfit_ps_task_up", task).set(0)
        self.log.emit("task_done" if status == 0 else "task_lost", task, reason, status=status)

    def emit(self, kind, task=None, reason="", **fields):
        self.log.emit(kind, task, reason, **fields)

    def tick(self):
        """Samples this host's processes every `SAMPLE_SECONDS` (called by the supervisor's
        loop; cheap otherwise)."""
        now = time.monotonic()
        if now < self._next_sample:
            return
        self._next_sample = now + SAMPLE_SECONDS
        for task, pid in list(self._pids.items()):
            sample = usage.process_usage(pid)
            if sample is None:
                continue
            cpu, rss = sample
            self.metrics.child("kfit_ps_task_rss_bytes", task).set(rss)
            counter = self.metrics.child("kfit_ps_task_cpu_seconds", task)
            previous = self._cpu.get(task)
            if previous is None:
                counter.inc(cpu)
                cores = None
            else:
                counter.inc(max(0.0, cpu - previous[1]))
                cores = max(0.0, cpu - previous[1]) / max(1e-6, now - previous[0])
            self._cpu[task] = (now, cpu, cores)
            self._rss[task] = rss

    def close(self, status=None):
        if status is not None:
            self.state = "done" if status == 0 else f"ended ({exit_status.describe(status)})"
        self.server.close()

    # Served ------------------------------------------------------------------------------

    def _chief_text(self):
        if not self.chief_metrics_port or constants.CHIEF + ":0" not in self._pids:
            return ""
        url = f"http://127.0.0.1:{self.chief_metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=_CHIEF_SCRAPE_TIMEOUT) as response:
                return response.read().decode()
        except OSError:
            return ""  # The chief is starting, restarting, or gone.

    def metrics_text(self):
        return self.metrics.text().decode() + self._chief_text()

    def status(self):
        text = self._chief_text()
        chief = observe_metrics.parse(text) if text else {}
        by_task = {}
        for (name, labels), value in chief.items():
            labels = dict(labels)
            if "task_type" in labels:
                task = f"{labels['task_type']}:{labels['task_index']}"
                by_task.setdefault(task, {})[name] = value
        tasks = []
        for task in sorted(set(self._pids) | set(self._ended), key=_task_order):
            seen = by_task.get(task, {})
            cpu = self._cpu.get(task)
            running = task in self._pids
            tasks.append({
                "task": task,
                "state": "running" if running else "restarting",
                "pid": self._pids.get(task),
                "restarts": self._restarts.get(task, 0),
                "steps_per_second": seen.get("kfit_ps_worker_steps_per_second"),
                "cpu_cores": (cpu[2] if cpu and cpu[2] is not None
                              else seen.get("kfit_ps_ps_cpu_cores")) if running else None,
                "rss_bytes": (self._rss.get(task) or seen.get("kfit_ps_ps_rss_bytes"))
                if running else None,
                "straggler": bool(seen.get("kfit_ps_straggler")),
                "hot": bool(seen.get("kfit_ps_hot_ps")),
            })
        with self._events_lock:  # Requests may come in on several threads.
            for event in self._events.new():
                (self._epochs if event.get("event") == "epoch" else self._notable).append(event)
            notable, curve = list(self._notable), _curve(self._epochs)
        return {"job": self.job, "state": self.state, "started": self.started,
                "now": time.time(), "restarts": sum(self._restarts.values()),
                "tasks": tasks, "events": notable, "curve": curve}


def _task_order(task):
    task_type, index = task.split(":")
    return (constants.TASK_TYPES.index(task_type) if task_type in constants.TASK_TYPES else 9,
            int(index))


def _curve(events):
    """The training curve: the loss (or the first metric) of each `epoch` event."""
    points, metric = [], None
    for event in events:
        if event.get("event") != "epoch":
            continue
        logs = event.get("logs") or {}
        if metric is None:
            metric = "loss" if "loss" in logs else next(iter(sorted(logs)), None)
        if metric in logs:
            points.append({"x": len(points) + 1, "y": logs[metric], "axis": "epoch"})
    return {"metric": metric or "loss", "points": points}
