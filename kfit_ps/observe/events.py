"""The event log of a job: one JSON object per line, appended by the launcher and the chief.

Each event has `time` (seconds since the epoch), `event` (a kind of
`KINDS`), `task` (`"worker:1"`, or null for the whole job), `reason` (a
sentence) and the kind's own fields. Event kinds are a contract with whoever
reads the log: this table defines them, `docs/observability.md` prints it.

Under `kfit-ps run` the log is `events.jsonl` in the run directory; the
launcher passes its path to the chief (`KFIT_PS_EVENTS`). Both append to it:
each event is one `write` of one line to a file opened with `O_APPEND`, which
POSIX applies whole at the end of a local file, so lines of the two writers
never mix. (This is the one file kfit_ps writes outside `tf.io.gfile`: an
append-only log shared by two processes needs that guarantee, and the run
directory is local.) A plain script logs events only when it sets
`KFIT_PS_EVENTS` itself.
"""

import json
import os
import sys
import threading
import time

from kfit_ps import constants

KINDS = {  # kind: what it says, and who writes it (the docs print this table).
    "start": "launcher: the job started (`pid`: the launcher's)",
    "task_lost": "launcher: a task's process ended (`status`: its exit status, negative for "
                 "the signal that killed it)",
    "task_done": "launcher: a task's process finished its work (`status` 0)",
    "task_removed": "launcher: a worker left the job (`kfit-ps scale`): drained by the chief, "
                    "then stopped; on the chief's host of a multi-host job (`address`): "
                    "drained by the chief once its name stopped resolving (DNS) or a "
                    "scale-down left it out, and it may stop now",
    "restart": "launcher: a task was started again (`pid`, `cause`: the restart reason)",
    "scale": "launcher: a scale request was taken (`workers`: how many the job is to have; "
             "the launcher's output says whether it was carried out or refused)",
    "worker_ready": "launcher: a worker added by `kfit-ps scale` serves (`pid`); on the "
                    "chief's host of a multi-host job, a worker joins the published list "
                    "(`address`): found through DNS (it resolves and serves), or one of "
                    "`TF_CONFIG`'s workers (the first list, and those a scale request added "
                    "once they serve)",
    "workers": "chief: it trains on a new set of workers (`workers`, `addresses`)",
    "first_step": "chief: a worker that joined finished its first function (`seconds` after "
                  "the chief took it)",
    "ps_lost": ("launcher: a ps was lost: restarted and restored in place by the chief where "
                "it can (`--ps-recovery in-place`, then `ps_restored`), else the job restarts"),
    "ps_restored": "chief: a lost ps was restored in place (`seconds`, `backup_step`, `bytes`)",
    "job_restart": "launcher: every task of this host is restarted (`delay`); the chief "
                   "resumes from its backup",
    "fit_begin": "chief: a fit began (`epochs`, `steps_per_epoch`)",
    "resumed": "chief: fit resumed from a backup (`epoch`, `step`: where it resumes)",
    "backup": "chief: a backup was written (`seconds`, `step`)",
    "checkpoint": "chief: a checkpoint was written (`seconds`, `path`)",
    "epoch": "chief: an epoch ended (`epoch`, `logs`: its metrics, the status page's curve)",
    "evaluation": "chief: an evaluation ended (`logs`)",
    "straggler": "chief: a worker is named a straggler (`steps_per_second`, `others`)",
    "straggler_cleared": "chief: a straggler keeps pace again",
    "hot_ps": "chief: a ps is named hot (`cpu_cores`, `quota_cores`, `others`)",
    "hot_ps_cleared": "chief: a hot ps is no longer hot",
    "stop": "launcher: it received a stop signal (`signal`)",
    "done": "launcher or chief: the job or the fit ended (`status`)",
}


class EventLog:
    """Appends events to `path`; `emit` never raises (an event log must not stop a job)."""

    def __init__(self, path, source):
        self.path = path
        self.source = source  # "launcher" or "chief"
        self._lock = threading.Lock()
        self._failing = False  # Said once when appending fails, and once when it works again.

    def emit(self, kind, task=None, reason="", **fields):
        if kind not in KINDS:
            raise ValueError(f"Unknown event kind {kind!r}; the kinds are {sorted(KINDS)}.")
        event = {"time": round(time.time(), 3), "event": kind, "task": task, "reason": reason,
                 "source": self.source}
        event.update(fields)
        line = (json.dumps(event, default=_plain) + "\n").encode()
        with self._lock:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, line)
                finally:
                    os.close(fd)
            except OSError as e:
                if not self._failing:
                    self._failing = True
                    print(f"kfit_ps: cannot append to the event log {self.path} ({e}); events "
                          "are not logged until it works again (KFIT_PS_EVENTS must be a local "
                          "file path)", file=sys.stderr, flush=True)
                return event
            if self._failing:
                self._failing = False
                print(f"kfit_ps: the event log {self.path} is written again",
                      file=sys.stderr, flush=True)
        return event


def _plain(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def from_environment(source):
    """The `EventLog` at `KFIT_PS_EVENTS`, or None when it is unset."""
    path = constants.events_path()
    return EventLog(path, source) if path else None


class Follower:
    """Reads the log at `path` as it grows: each `new()` returns the events appended since
    the last call, whole lines only (a line being written waits for the next call).

    The status page asks for the job's events on every request; reading only what was
    appended keeps a request's cost flat however long the job runs.
    """

    def __init__(self, path):
        self.path = path
        self._offset = 0
        self._partial = b""
        self._lock = threading.Lock()

    def new(self):
        with self._lock:
            try:
                with open(self.path, "rb") as f:
                    if os.fstat(f.fileno()).st_size < self._offset:  # A new log: start over.
                        self._offset, self._partial = 0, b""
                    f.seek(self._offset)
                    data = f.read()
            except OSError:
                return []
            self._offset += len(data)
            lines = (self._partial + data).split(b"\n")
            self._partial = lines.pop()
        events = []
        for line in lines:
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
        return events


def read(path):
    """Every event of the log at `path`, in order (a line being written is skipped)."""
    events = []
    try:
        with open(path, "rb") as f:
            for line in f:
                try:
                    events.append(json.loads(line))
                except ValueError:
                    continue
    except OSError:
        pass
    return events
