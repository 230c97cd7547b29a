"""The errors kfit_ps raises when the cluster, not the program, is at fault.

A `ClusterError` means a task that training needs is gone: the same script,
rerun (or restarted by `kfit-ps run`) after the task is back, resumes from
its last backup. Errors of the program itself (a bad argument, a shape
mismatch, a NaN check) are never turned into a `ClusterError`.
"""

# Exit status of a chief that stopped on a `ClusterError` under `kfit-ps run` (BSD's
# EX_TEMPFAIL: "temporary failure, try again"): the launcher restarts the job.
EXIT_CLUSTER_ERROR = 75


class ClusterError(RuntimeError):
    """A task that training needs is unreachable; retrying after it is back resumes the job.

    Attributes:
        tasks: the tasks concerned, as `"ps:0"`-style names.
    """

    def __init__(self, message, tasks=()):
        super().__init__(message)
        self.tasks = tuple(tasks)


class WorkersLostError(ClusterError):
    """Every worker has been unreachable for longer than the configured timeout."""


class ParameterServerError(ClusterError):
    """A ps task failed or restarted: the variables it held are gone."""


def exit_with_status_on_cluster_error(before_exit=None):
    """Makes an uncaught `ClusterError` end the process with `EXIT_CLUSTER_ERROR`.

    Installed by `import kfit_ps` in a chief started by `kfit-ps run`, which
    restarts the job on that status (and treats any other failure as the
    program's own, not retried). The traceback is printed as usual first;
    `before_exit()`, if given, runs last (the exit skips `atexit` hooks).
    """
    import os
    import sys

    previous = sys.excepthook

    def excepthook(kind, value, traceback):
        previous(kind, value, traceback)
        if isinstance(value, ClusterError):
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            if before_exit is not None:
                before_exit()
            os._exit(EXIT_CLUSTER_ERROR)

    sys.excepthook = excepthook
