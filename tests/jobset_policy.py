"""What Kubernetes and JobSet do when a pod of a rendered JobSet ends, as they document it.

Two steps, each from its documentation (read, not copied):

1. the pod's Job (Kubernetes' Job docs): an exit status of 0 completes the Job
   (one completion); otherwise the Job's `podFailurePolicy` decides by its first
   matching rule (`tests/pod_failure_policy.py`), and with `restartPolicy:
   OnFailure` (no policy allowed) the container restarts in place, counted. A
   `FailJob` fails the Job with reason `PodFailurePolicy`; a counted failure
   beyond `backoffLimit` fails it with `BackoffLimitExceeded`;
2. the JobSet (JobSet v0.12.0's API reference and failure-policy docs,
   `FailurePolicy.rules`): "For a given Job failure, the rules will be evaluated
   in order, and only the first matching rule will be executed. If no matching
   rule is found, the RestartJobSet action is applied." A rule matches a failed
   Job when its `onJobFailureReasons` is empty or holds the reason of the Job's
   `Failed` condition and its `targetReplicatedJobs` is empty or holds the Job's
   replicated job (with several failed Jobs, each rule is tried on all of them,
   earliest failure first, before the next rule). `RestartJobSet` counts against
   `maxRestarts`, and once they are spent the JobSet fails instead (reason
   `ReachedMaxRestarts`); a JobSet without `failurePolicy` fails on any failed Job.
   `successPolicy` `All`: every Job of `targetReplicatedJobs` (all when empty)
   has completed.

`onJobFailureMessagePatterns` and the gated `RestartJob` actions are not modelled
(the rendered rules use neither; `jobset_action` refuses them).
"""

import collections

from tests.pod_failure_policy import first_matching_rule


def replicated_job(jobset, name):
    [job] = [j for j in jobset["spec"]["replicatedJobs"] if j["name"] == name]
    return job


def job_decision(job_spec, container, exit_code, conditions=(), failed_before=0):
    """What a Job does when its pod's container ends with `exit_code`.

    Returns `("Complete", None)`; `("Ignore", None)` or `("Count", None)`: the Job runs on
    with a new pod (or, with `OnFailure`, the container restarted in place); or
    `("Failed", reason)`. `failed_before`: the failures already counted.
    """
    if exit_code == 0:
        return "Complete", None
    policy = job_spec.get("podFailurePolicy")
    if job_spec["template"]["spec"]["restartPolicy"] == "OnFailure":
        assert policy is None  # Kubernetes allows a podFailurePolicy with `Never` only.
        action = "Count"
    elif policy is None:
        action = "Count"
    else:
        action = first_matching_rule(policy["rules"], exit_code, conditions, container)
    if action == "FailJob":
        return "Failed", "PodFailurePolicy"
    if action == "Count" and failed_before + 1 > job_spec.get("backoffLimit", 6):
        return "Failed", "BackoffLimitExceeded"
    return action, None


def jobset_action(jobset, failed, restarts=0):
    """JobSet's action on its failed Jobs: `(action, rule name or None)`.

    `failed`: `[(replicated job, failure reason)]`, the earliest failure first;
    `restarts`: the restarts already counted against `maxRestarts`. The action is
    `FailJobSet`, `RestartJobSet`, `RestartJobSetAndIgnoreMaxRestarts`, or
    `ReachedMaxRestarts` where a `RestartJobSet` finds them spent.
    """
    policy = jobset["spec"].get("failurePolicy")
    if policy is None:
        return "FailJobSet", None
    action, name = "RestartJobSet", None
    for rule in policy.get("rules", []):
        assert rule["action"] not in ("RestartJob", "RestartJobAndIgnoreMaxRestarts"), (
            "RestartJob needs JobSet's alpha feature gate")
        reasons, targets = rule.get("onJobFailureReasons"), rule.get("targetReplicatedJobs")
        if any((not reasons or reason in reasons) and (not targets or rjob in targets)
               for rjob, reason in failed):
            action, name = rule["action"], rule["name"]
            break
    if action == "RestartJobSet" and restarts >= policy.get("maxRestarts", 0):
        return "ReachedMaxRestarts", name
    return action, name


def jobset_completed(jobset, complete):
    """Whether `successPolicy` holds once `complete` ({replicated job: Jobs complete}) are."""
    policy = jobset["spec"]["successPolicy"]
    jobs = jobset["spec"]["replicatedJobs"]
    targets = policy.get("targetReplicatedJobs") or [j["name"] for j in jobs]
    done = sum(n for name, n in complete.items() if name in targets)
    if policy["operator"] == "Any":
        return done >= 1
    return done >= sum(j["replicas"] for j in jobs if j["name"] in targets)


# One pod of a replicated job ends: `complete` are the other Jobs already complete.
Scenario = collections.namedtuple(
    "Scenario", "case replicated_job exit_code conditions failed_before restarts complete",
    defaults=((), 0, 0, {}))


def outcome(jobset, scenario):
    """`(the Job's decision, the JobSet's)` after `scenario`; the JobSet's is `Completed`,
    `(action, rule)` of `jobset_action`, or None (nothing to do: the Jobs run on)."""
    job = replicated_job(jobset, scenario.replicated_job)
    decision, reason = job_decision(job["template"]["spec"], scenario.replicated_job,
                                    scenario.exit_code, scenario.conditions,
                                    scenario.failed_before)
    if decision == "Complete":
        complete = collections.Counter(scenario.complete)
        complete[scenario.replicated_job] += 1
        return (decision, None), ("Completed" if jobset_completed(jobset, complete) else None)
    if decision == "Failed":
        return (decision, reason), jobset_action(
            jobset, [(scenario.replicated_job, reason)], scenario.restarts)
    return (decision, None), None


DISRUPTED = {("DisruptionTarget", "True")}
# The failures `test_jobset.py` asserts and `docs/kubernetes.md` prints (`tests/doc_tables.py`),
# for a JobSet with an evaluator, backoffLimit 6 and maxRestarts 3 (the defaults).
SCENARIOS = (
    Scenario("the chief's script finished, the evaluator done", "chief", 0,
             complete={"evaluator": 1}),
    Scenario("the chief's script finished, the evaluator still evaluating", "chief", 0),
    Scenario("the chief's program failed (an exception)", "chief", 1),
    Scenario("the chief's launcher spent its restarts", "chief", 76),
    Scenario("a cluster loss the chief's launcher could not ride out", "chief", 75),
    Scenario("... for the 7th time (backoffLimit 6 spent)", "chief", 75, failed_before=6),
    Scenario("... and the JobSet restarted 3 times already", "chief", 75, failed_before=6,
             restarts=3),
    Scenario("SIGTERM of the chief during a drain", "chief", 143, DISRUPTED),
    Scenario("the chief OOM-killed (SIGKILL)", "chief", 137),
    Scenario("a worker pod OOM-killed", "worker", 137),
    Scenario("a worker's launcher spent its restarts", "worker", 76),
    Scenario("a worker pod failing the 101st time", "worker", 76, failed_before=100),
    Scenario("a worker drained", "worker", 143, DISRUPTED),
    Scenario("a worker's launcher failed (a bad flag)", "worker", 2),
    Scenario("a ps pod OOM-killed", "ps", 137),
    Scenario("the evaluator failed", "evaluator", 1),
    Scenario("the evaluator failing the 101st time", "evaluator", 1, failed_before=100),
)
