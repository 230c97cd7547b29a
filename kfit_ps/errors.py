"""The errors kfit_ps raises when the cluster, not the program, is at fault.

A `ClusterError` means a task that training needs is gone: the same script,
rerun (or restarted by `kfit-ps run`) after the task is back, resumes from
its last backup. Errors of the program itself (a bad argument, a shape
mismatch, a NaN check) are never turned into a `ClusterError`.
"""

import tensorflow as tf

from kfit_ps import exit_status


class ClusterError(RuntimeError, tf.errors.UnavailableError):
    """A task that training needs is unreachable; retrying after it is back resumes the job.

    It is a `tf.errors.UnavailableError` (TensorFlow's documented error for a lost
    task), so code written to TensorFlow's fault-tolerance contract keeps catching
    kfit_ps' cluster errors; and a `RuntimeError`, as it always was.

    Attributes:
        tasks: the tasks concerned, as `"ps:0"`-style names.
    """

    def __init__(self, message, tasks=()):
        tf.errors.UnavailableError.__init__(self, None, None, message)
        self.tasks = tuple(tasks)


class WorkersLostError(ClusterError):
    """Every worker has been unreachable for longer than the configured timeout."""


class WorkerStalledError(ClusterError):
    """A worker accepts connections but has not answered for longer than the timeout."""


class WorkerResultLostError(ClusterError):
    """A worker was lost with the result of a function that had finished on it."""


class ParameterServerError(ClusterError):
    """A ps task failed or restarted: the variables it held are gone."""


class Preempted(SystemExit):
    """The process was asked to stop (SIGTERM) and stopped at a safe point.

    Raised by `fit` after the steps in flight finished and a final backup (if
    any) was written; as a `SystemExit`, it ends the script with
    `exit_status.PREEMPTED` (143) unless caught, and `except Exception` in the
    script does not swallow it.
    """

    def __init__(self, message):
        super().__init__(exit_status.PREEMPTED)
        self.message = message

    def __str__(self):
        return self.message


def is_cluster_failure(error):
    """Whether an uncaught `error` means the cluster, not the program, failed: a
    `ClusterError`, TensorFlow's `UnavailableError` (a task unreachable, e.g. a ps lost
    while the model's variables were created, outside `fit`), or its `AbortedError` for a
    remote context that is gone (a task restarted under the chief: a ps its host's launcher
    brought back within a second, read by `get_weights()` or `save()` outside `fit`)."""
    if isinstance(error, tf.errors.AbortedError):
        return any(sign in str(error) for sign in _RESTARTED_TASK)
    return isinstance(error, (ClusterError, tf.errors.UnavailableError))


# TensorFlow's words for a remote eager context that no longer exists (its task restarted).
_RESTARTED_TASK = ("Unable to find a context_id", "Perhaps the worker was restarted")


def exit_with_status_on_cluster_error(before_exit=None):
    """Makes an uncaught cluster failure (`is_cluster_failure`) end the process with
    `exit_status.CLUSTER_ERROR` (75; `kfit_ps.exit_status` is the table of every status).

    Installed in a chief started by `kfit-ps run` by the first training name it takes
    from `kfit_ps` (`kfit_ps._setup.prepare_training`); the launcher
    restarts the job on that status (and treats any other failure as the
    program's own, not retried). The traceback is printed as usual first;
    `before_exit()`, if given, runs last (the exit skips `atexit` hooks).
    """
    import os
    import sys

    previous = sys.excepthook

    def excepthook(kind, value, traceback):
        previous(kind, value, traceback)
        if is_cluster_failure(value):
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            if before_exit is not None:
                before_exit()
            os._exit(exit_status.CLUSTER_ERROR)

    sys.excepthook = excepthook
