"""The exit statuses of a kfit_ps job: one contract for the chief, the launcher and Kubernetes.

A process says why it ended through its exit status, and whoever restarts it
(the launcher `kfit-ps run`, Kubernetes' Job controller) decides from that
status alone. This module is the one table of those statuses; the chief's
exception hook, the launcher's `RestartPolicy` and the chief Job's
`podFailurePolicy` (`kfit_ps.launch.manifests`) all read it, and
`docs/fault_tolerance.md` prints it.

| status | name | who exits with it | meaning | launcher | Kubernetes (chief Job) |
| --- | --- | --- | --- | --- | --- |
| 0 | `DONE` | chief, launcher | the script finished | job done | pod succeeded |
| 75 | `CLUSTER_ERROR` | chief, launcher | a task training needs is unreachable (`ClusterError`, or TensorFlow's `UnavailableError` outside `fit`) | restarts the job | `Count` (retried up to `backoffLimit`) |
| 76 | `RESTARTS_EXHAUSTED` | launcher | a task failed more than `--max-restarts` times within the healthy period | — | `FailJob` |
| 130 | `INTERRUPTED` | chief, launcher | SIGINT (Ctrl-C) | stops | `Count` |
| 137 | `KILLED` | (the kernel) | SIGKILL: out of memory, or the grace period ran out | restarts the job | `Count` |
| 143 | `PREEMPTED` | chief, launcher | SIGTERM (a drain, a preemption, a scale-down): the steps in flight finished and a final backup was written | — | `Ignore` with `DisruptionTarget`, else `Count` |
| any other | program error | chief | the program itself failed (an exception, a bad argument) | not retried | `FailJob` |

Kubernetes' Job controller applies the *first* `podFailurePolicy` rule that
matches a failed pod, and an exit status of 0 is never a failure; so the
chief Job lists the disruption rule first (`pod_failure_rules`).
"""

import signal

DONE = 0
CLUSTER_ERROR = 75  # BSD's EX_TEMPFAIL: "temporary failure, try again".
RESTARTS_EXHAUSTED = 76
INTERRUPTED = 128 + signal.SIGINT  # 130
KILLED = 128 + signal.SIGKILL  # 137
PREEMPTED = 128 + signal.SIGTERM  # 143

# Statuses after which a new attempt resumes the job from its last backup.
RETRY = (CLUSTER_ERROR, INTERRUPTED, KILLED, PREEMPTED)
# Statuses that are neither a success nor a retry but are not the program's fault either.
NOT_PROGRAM_ERRORS = (DONE, RESTARTS_EXHAUSTED) + RETRY

NAMES = {DONE: "done", CLUSTER_ERROR: "cluster error", RESTARTS_EXHAUSTED: "restarts exhausted",
         INTERRUPTED: "interrupted (SIGINT)", KILLED: "killed (SIGKILL)",
         PREEMPTED: "preempted (SIGTERM)"}


def for_signal(signum):
    """The status of a process that stops on signal `signum` (128 + its number)."""
    return 128 + int(signum)


def from_returncode(returncode):
    """A `subprocess` return code (negative for a signal) as an exit status (128 + signal)."""
    return for_signal(-returncode) if returncode < 0 else returncode


def is_retry(status):
    """Whether a new attempt should resume the job after a process ended with `status`."""
    return from_returncode(status) in RETRY


def is_program_error(status):
    """Whether `status` says the program itself failed (not retried anywhere)."""
    return from_returncode(status) not in NOT_PROGRAM_ERRORS


def describe(status):
    """`"exit code 75 (cluster error)"`, or `"exit code 1 (program error)"`."""
    status = from_returncode(status)
    return f"exit code {status} ({NAMES.get(status, 'program error')})"


def pod_failure_rules(container):
    """The chief Job's `podFailurePolicy.rules`, in the order Kubernetes must try them.

    1. a pod disrupted by Kubernetes (drain, preemption, eviction): `Ignore`,
       whatever its status: a new pod resumes from the backup written on SIGTERM,
       and the disruption does not count against `backoffLimit`;
    2. a program error (any status not in `NOT_PROGRAM_ERRORS`, and
       `RESTARTS_EXHAUSTED`): `FailJob`, at once;
    3. a retry status: `Count`, so the Job starts a new pod up to `backoffLimit`.
    """
    return [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget",
                                                 "status": "True"}]},
        {"action": "FailJob", "onExitCodes": {
            "containerName": container, "operator": "NotIn", "values": list(RETRY)}},
        {"action": "Count", "onExitCodes": {
            "containerName": container, "operator": "In", "values": list(RETRY)}},
    ]
