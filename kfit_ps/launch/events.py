"""What the supervisor saw: a task's process ended, with what status and last words."""

import dataclasses
import signal


def describe_status(status):
    """`exit code 3`, or `signal SIGKILL` for a negative `subprocess` status."""
    if status is not None and status < 0:
        try:
            return f"signal {signal.Signals(-status).name}"
        except ValueError:
            return f"signal {-status}"
    return f"exit code {status}"


@dataclasses.dataclass(frozen=True)
class TaskExit:
    """One process of the job ended.

    Attributes:
        task: `"chief:0"`, `"worker:1"`, `"ps:0"`.
        status: its exit status; negative for the signal that killed it.
        log_tail: the last lines of its log.
    """

    task: str
    status: int
    log_tail: str = ""

    @property
    def kind(self):
        return self.task.split(":", 1)[0]

    def describe(self):
        return f"{self.task} ended with {describe_status(self.status)}"
