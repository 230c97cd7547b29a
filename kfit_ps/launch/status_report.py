"""`kfit-ps status`: a job's status page in the terminal.

```
$ kfit-ps status --run-dir /tmp/run
job kfit_ps: running, 5 tasks, 1 restart, up 42 s (http://127.0.0.1:41235/)
task      state       pid  restarts  steps/s  CPU cores  memory MiB  diagnosis
chief:0   running   12001         0                 0.41         512
worker:0  running   12002         0     31.2        0.62         480
...
```
"""

import json
import os
import time
import urllib.request

from kfit_ps.observe import events as event_log


class StatusUnavailable(Exception):
    """No running launcher answered; the message says what was tried."""


def status_url(run_dir):
    """The status page's address, from the run directory's `tasks.json`."""
    path = os.path.join(run_dir, "tasks.json")
    try:
        with open(path) as f:
            url = json.load(f).get("status_url")
    except (OSError, ValueError) as e:
        raise StatusUnavailable(f"no readable {path} ({e}): is --run-dir the directory "
                                "`kfit-ps run` printed at start?") from None
    if not url:
        raise StatusUnavailable(f"{path} names no status page (a launcher older than it).")
    return url


def fetch(url, timeout=5.0):
    """The job's `status.json` from its launcher at `url`."""
    target = url.rstrip("/") + "/status.json"
    try:
        with urllib.request.urlopen(target, timeout=timeout) as response:
            return json.loads(response.read())
    except (OSError, ValueError) as e:
        raise StatusUnavailable(f"the launcher at {url} did not answer ({e}); it has ended, "
                                "or it runs on another host (pass --url).") from None


def render(status, url="", events=8):
    """The status as text: a summary line, the tasks, the last `events` events."""
    up = status["now"] - status["started"]
    restarts = status["restarts"]
    lines = [f"job {status['job']}: {status['state']}, {len(status['tasks'])} tasks, "
             f"{restarts} restart{'s' if restarts != 1 else ''}, up {up:.0f} s"
             + (f" ({url})" if url else "")]
    rows = [("task", "state", "pid", "restarts", "steps/s", "CPU cores", "memory MiB",
             "diagnosis")]
    for t in status["tasks"]:
        flags = [name for name, on in (("straggler", t["straggler"]), ("hot ps", t["hot"]))
                 if on]
        rows.append((t["task"], t["state"], "" if t["pid"] is None else str(t["pid"]),
                     str(t["restarts"]), _num(t["steps_per_second"], 1),
                     _num(t["cpu_cores"], 2),
                     _num(t["rss_bytes"] / 2**20 if t["rss_bytes"] else None, 0),
                     ", ".join(flags)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        lines.append("  ".join(cell.ljust(w) if i in (0, 1, 7) else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(row, widths))).rstrip())
    points = status["curve"]["points"]
    if points:
        lines.append(f"{status['curve']['metric']} by epoch: "
                     + ", ".join(f"{p['y']:.4g}" for p in points[-10:]))
    if status["events"] and events:
        lines.append("recent events:")
        lines.extend(describe_event(e) for e in status["events"][-events:])
    return "\n".join(lines)


def describe_event(event):
    when = time.strftime("%H:%M:%S", time.localtime(event["time"]))
    task = f" {event['task']}" if event.get("task") else ""
    reason = f": {event['reason']}" if event.get("reason") else ""
    return f"  {when} {event['event']}{task}{reason}"


def from_events(run_dir, events=8):
    """What the event log says of a job whose launcher no longer runs."""
    found = event_log.read(os.path.join(run_dir, "events.jsonl"))
    if not found:
        return None
    return "\n".join(["the launcher is not running; its last events:"]
                     + [describe_event(e) for e in found[-events:]])


def _num(value, digits):
    return "" if value is None else f"{value:.{digits}f}"
