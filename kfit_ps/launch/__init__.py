"""`kfit-ps run`: a supervisor that keeps a parameter-server job alive through task losses."""

from kfit_ps import membership
from kfit_ps.launch.config import LaunchConfig
from kfit_ps.launch.events import TaskExit
from kfit_ps.launch.policy import Action, Decision, RestartPolicy
from kfit_ps.launch.supervisor import Supervisor


def run(command=(), **kwargs):
    """Runs `command` as the chief of a supervised job (`kfit-ps run`); returns its status.

    ```python
    status = kfit_ps.run(["python", "train.py"], num_workers=2, num_ps=1,
                         backup_dir="/tmp/backup", save_freq=100)
    ```

    Keyword arguments are `LaunchConfig`'s.
    """
    return Supervisor(LaunchConfig(command=tuple(command), **kwargs)).run()


def scale(run_dir, workers):
    """Asks the running job of `run_dir` (`kfit-ps run`) for `workers` workers
    (`kfit-ps scale`); returns at once.

    ```python
    kfit_ps.scale("/tmp/my-run", workers=4)  # the --run-dir the launcher printed
    ```

    New workers join the chief's `fit` at its next safe point; removed ones are
    drained (their functions finish, queued ones run elsewhere), then stopped.
    The launcher says each step on its output and in `events.jsonl`.
    """
    membership.request_scale(run_dir, workers)


__all__ = ["Action", "Decision", "LaunchConfig", "RestartPolicy", "Supervisor", "TaskExit", "run",
           "scale"]
