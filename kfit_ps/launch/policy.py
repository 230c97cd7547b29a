"""What to do when a task ends: a small policy object, apart from the process handling.

| what ended | decision |
| --- | --- |
| the chief, exit code 0 | the job is done (`FINISH`) |
| a worker | restart it at the same address; TensorFlow takes it back in the same chief |
| a ps, `--ps-recovery in-place` (default) with the chief running here | restart it at its address; the chief restores its variables from the last backup in the same process (if it cannot, it exits and the job restarts) |
| a ps on a host without the chief (`--tasks`, many hosts) | restart it at its address, counted; the chief, which sees the loss and the new process through its connection, restores its variables in place where its launcher's `--ps-recovery` and the fit allow (else it says why and exits 75: its launcher restarts the job) |
| a ps, `--ps-recovery restart` | its variables are gone: let the chief stop (its `fit` raises `ParameterServerError`), then restart the job |
| the chief, with a retry status (`exit_status.RETRY`: 75 `ClusterError`, 143 SIGTERM, 137 SIGKILL, 130 SIGINT, or killed by any signal), or after a ps was lost | restart the job: every server of this host and the chief, which resumes from its last backup |
| the chief, any other status | the program failed: not retried (`FAIL` with its status) |
| a ps lost without in-place recovery (`WAIT_FOR_CHIEF`), and the chief still runs `ps_failure_grace` s later | stop the chief (`STOP_CHIEF`); its exit restarts the job |
| the chief that a host's ps tasks served went away (multi-host) | restart those ps tasks at once, not counted (`RESTART_TASK`): a ps never keeps a dead chief's variables |
| a server accepts connections but has not answered for `--liveness-timeout` s | kill it (`KILL_TASK`); its exit is then decided on as above |
| a server runs but did not start serving in time | kill it and restart it, counted (`not_ready`) |

In-place ps recovery is the chief's: on one host its launcher restarts the ps; on many hosts
(`--tasks`) the ps host's launcher does, and the chief's launcher never sees the ps at all.

Restarting the ps tasks with the chief is deliberate: a ps keeps the variables a
chief created for as long as it runs, so a ps that outlived five chiefs would hold
five copies. Each task may be restarted `max_restarts` times, after `backoff`
seconds doubling up to `max_backoff`; one more failure fails the job with
`exit_status.RESTARTS_EXHAUSTED` and a summary of that task's last exit and log
lines. A task that ran `healthy_period` seconds since its last failure starts
with a fresh budget (a week-long job is not ended by its fourth ps loss).
"""

import collections
import dataclasses
import enum

import time

from kfit_ps import exit_status
from kfit_ps.launch.config import LAUNCH_DEFAULTS
from kfit_ps.launch.events import TaskExit, describe_status


class Action(enum.Enum):
    FINISH = "finish"
    FAIL = "fail"
    RESTART_TASK = "restart task"
    RESTART_JOB = "restart job"
    WAIT_FOR_CHIEF = "wait for the chief"
    STOP_CHIEF = "stop the chief"
    KILL_TASK = "kill the task"


@dataclasses.dataclass(frozen=True)
class Decision:
    action: Action
    reason: str = ""
    delay: float = 0.0
    exit_status: int = 0


class RestartPolicy:
    """Decides on each `TaskExit`; counts restarts per task. Its budget and times default to
    `LaunchConfig`'s (`LAUNCH_DEFAULTS`)."""

    def __init__(self, max_restarts=LAUNCH_DEFAULTS["max_restarts"],
                 backoff=LAUNCH_DEFAULTS["backoff"], max_backoff=LAUNCH_DEFAULTS["max_backoff"],
                 healthy_period=LAUNCH_DEFAULTS["healthy_period"],
                 ps_failure_grace=LAUNCH_DEFAULTS["ps_failure_grace"], clock=time.monotonic):
        self.max_restarts, self.backoff, self.max_backoff = max_restarts, backoff, max_backoff
        self.ps_failure_grace = ps_failure_grace
        self.healthy_period, self._clock = healthy_period, clock
        self.restarts = collections.Counter()  # failures counted against each task's budget
        self.failures = collections.Counter()  # every failure of each task, for tasks.json
        self._last_failure = {}

    def _count(self, event):
        """Counts one more failure of the event's task; a FAIL decision past the limit."""
        now = self._clock()
        last = self._last_failure.get(event.task)
        if last is not None and now - last >= self.healthy_period:
            self.restarts[event.task] = 0  # It ran healthy long enough: a fresh budget.
        self._last_failure[event.task] = now
        self.restarts[event.task] += 1
        self.failures[event.task] += 1
        count = self.restarts[event.task]
        if count <= self.max_restarts:
            return count, None
        return count, Decision(Action.FAIL, exit_status=exit_status.RESTARTS_EXHAUSTED, reason=(
            f"{event.describe()} and has failed {count} times within {self.healthy_period:g} s "
            f"of each other; giving up (--max-restarts {self.max_restarts}, exit code "
            f"{exit_status.RESTARTS_EXHAUSTED}). Its last log lines:\n{event.log_tail}"))

    def _delay(self, count):
        """The back-off before the `count`-th restart: doubling, capped at `max_backoff`."""
        return min(self.backoff * 2 ** (count - 1), self.max_backoff)

    def _restart(self, event, action, reason, what=None):
        count, give_up = self._count(event)
        if give_up:
            return give_up
        delay = self._delay(count)
        return Decision(action, delay=delay, reason=(
            f"{what or event.describe()}; {reason} (restart {count} of {self.max_restarts}, "
            f"in {delay:g} s)"))

    def chief_overdue(self, ps_lost_for):
        """`STOP_CHIEF` once a ps lost without in-place recovery (`WAIT_FOR_CHIEF`) has been
        lost `ps_lost_for` s and the chief still runs past `ps_failure_grace` (its `fit`
        should have stopped by itself); else None."""
        if ps_lost_for <= self.ps_failure_grace:
            return None
        return Decision(Action.STOP_CHIEF, reason=(
            f"the chief did not stop within {self.ps_failure_grace:g} s of the ps loss; "
            "stopping it"))

    @staticmethod
    def chief_gone(address):
        """The chief this host's ps tasks served went away: restart them now, not counted
        against their budget, so that its variables do not stay in their memory."""
        return Decision(Action.RESTART_TASK, reason=(
            f"the chief ({address}) went away: restarting this host's ps tasks so that its "
            "variables do not stay in their memory"))

    @staticmethod
    def wedged(task, timeout):
        """A server accepts connections but has not answered for `timeout` s: kill it (its
        exit is then decided on like any other)."""
        return Decision(Action.KILL_TASK, reason=(
            f"{task} accepts connections but has not answered for {timeout:g} s "
            "(--liveness-timeout): killing it"))

    def not_ready(self, task, log_tail=""):
        """A server of `task` runs but did not start serving in time: kill it, restart it."""
        return self._restart(TaskExit(task, exit_status.KILLED, log_tail), Action.RESTART_TASK,
                             "killing it and starting it again",
                             what=f"{task} did not start serving in time")

    def decide(self, event, server_lost=False, ps_in_place=False, chief_elsewhere=False):
        """The `Decision` for `event`; `server_lost`: a ps died since this chief started;
        `ps_in_place`: a lost ps is restarted alone and the running chief restores it;
        `chief_elsewhere`: this host runs servers but not the chief (`--tasks`)."""
        if event.kind == "ps" and ps_in_place:
            return self._restart(event, Action.RESTART_TASK,
                                 "restarting it; the chief restores its variables in place "
                                 "from the last backup")
        if event.kind == "ps" and chief_elsewhere:
            return self._restart(event, Action.RESTART_TASK, (
                "restarting it at its address; a chief connected to it (on its own host) "
                "restores its variables in place from the last backup where its "
                "--ps-recovery and the fit allow, else the job restarts from that backup"))
        if event.kind == "worker":
            return self._restart(event, Action.RESTART_TASK,
                                 "restarting it; training continues in the same chief")
        if event.kind == "ps":
            # `delay` serves a launcher with no chief running at the time (between two).
            count, give_up = self._count(event)
            return give_up or Decision(Action.WAIT_FOR_CHIEF, delay=self._delay(count), reason=(
                f"{event.describe()}; the variables it held are gone: the chief stops, then "
                "the job restarts from its last backup"))
        if event.status == 0:
            return Decision(Action.FINISH, reason="the chief finished", exit_status=0)
        if server_lost:  # Already counted against the server that was lost.
            delay = self.backoff
            return Decision(Action.RESTART_JOB, delay=delay, reason=(
                f"{event.describe()} after a ps was lost; restarting the job from its last "
                "backup"))
        if event.status < 0 or exit_status.is_retry(event.status):
            why = ("a task it needs is unreachable" if event.status == exit_status.CLUSTER_ERROR
                   else f"it stopped on a signal ({describe_status(event.status)})")
            return self._restart(event, Action.RESTART_JOB,
                                 f"{why}: restarting the job from its last backup")
        return Decision(Action.FAIL, exit_status=event.status, reason=(
            f"{event.describe()}: the program failed; a failure of the program itself is not "
            "retried (its output above says why)"))
