"""The job as one JobSet (`kfit-ps manifests --format jobset`).

JobSet (kubernetes-sigs/jobset, API `jobset.x-k8s.io/v1alpha2`; written against
v0.12.0) runs a group of Jobs as one workload, with a success and a failure
policy of its own. `render(ManifestConfig(...))` returns a JobSet, the
PodDisruptionBudgets and the NetworkPolicy of the job; its pods are those of the
StatefulSet form (`kfit_ps.launch.manifests.pod_template`: the same command,
`TF_CONFIG`, probes, requests, security context, no service-account token,
scrape annotations and shared volume). Who decides what:

- tasks: one replicated job per task type, `ps`, `worker`, `chief` (and
  `evaluator`), of `replicas` Jobs with one pod each (`completionMode: Indexed`,
  `parallelism` = `completions` = 1): Job `<name>-<type>-<i>` is task `<type>:<i>`,
  its pod reads `i` from its label `jobset.sigs.k8s.io/job-index` (which JobSet
  sets) into `KFIT_PS_TASK_INDEX` and runs `kfit-ps run --tasks <type>:<i>`. Every
  Job has `podReplacementPolicy: Failed` (a new pod only once the old one has
  terminated) and the JobSet restarts with `BlockingRecreate` (new Jobs only once
  the old ones and their pods are gone): no task ever runs twice;
- names: `network.enableDNSHostnames`, `subdomain: <name>`: JobSet's headless
  Service gives the pod of Job `<name>-<type>-<i>` the name
  `<name>-<type>-<i>-0.<name>.<namespace>.svc` (`address`), published before the
  pod is ready (`publishNotReadyAddresses`); every `TF_CONFIG` names every task so;
- start-up: `dependsOn` (one item per replicated job in v0.12.0): the workers'
  Jobs are created once every ps Job is Ready (its server's port open), the
  chief's once every worker Job is Ready; the evaluator's at once. After a JobSet
  restart the order holds again;
- success: `successPolicy` `All` of `chief` (and `evaluator`, so that it
  evaluates the last checkpoint): the JobSet is Completed and JobSet deletes the
  servers' Jobs;
- failure, first in the pod's Job, then in the JobSet (`failure_rules`, first match):
  - the chief: a disruption (`DisruptionTarget`: a drain, a preemption) is
    ignored and a retry status (75, 130, 137, 143) counted against `backoffLimit`,
    each with a new pod and no JobSet action (the servers keep running); a
    program error (76 and any status not in the table) fails its Job
    (`PodFailurePolicy`) and the JobSet (`FailJobSet`); a Job whose retries are
    spent (`BackoffLimitExceeded`) restarts the JobSet (`RestartJobSet`);
  - a ps or a worker: the same, but 76 is counted too (the launcher in the pod
    gave up on its server; a new pod, maybe on another node, tries again) and its
    `backoffLimit` is `SERVER_BACKOFF_LIMIT`: a server pod replaced does not
    restart the job;
  - the evaluator: its container restarts in place (`OnFailure`) up to
    `SERVER_BACKOFF_LIMIT` times; a failed evaluator Job fails the JobSet, which
    cannot succeed without it (no JobSet action ignores a failed Job).

  `RestartJobSet` recreates every Job (the chief resumes from its last backup), at
  most `maxRestarts` (`max_restarts`) times; then the JobSet fails. JobSet's
  per-Job restart (`RestartJob`) needs its alpha feature gate `RestartJob`, off
  by default and refused by JobSet's webhook without it, so no rule uses it: a
  chief or server restarts alone inside its own Job instead.

JobSet owns its Jobs and its Service: deleting the JobSet deletes them (and
`ttl_after_finished` deletes a finished JobSet). The PodDisruptionBudgets and the
NetworkPolicy are separate objects (an owner reference needs the JobSet's UID):
`kubectl delete jobset,pdb,networkpolicy -l kfit-ps/job=<name>`.
"""

import functools

from kfit_ps import exit_status
from kfit_ps.launch import manifests

API_VERSION = "jobset.x-k8s.io/v1alpha2"
# The index of a Job in its replicated job: a label JobSet sets on each Job and its pods.
JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
# Replicated jobs in start-up order; each after the one before it is Ready (`dependsOn`).
ORDER = ("ps", "worker", "chief")
# Pod failures a server's (or the evaluator's) Job rides out before it fails: high, as a
# server pod replaced is no reason to restart the whole job; the chief bounds the rest (a
# ps that keeps failing makes the chief exit 75 until its own Job fails).
SERVER_BACKOFF_LIMIT = 100
# Job failure reasons (Kubernetes' `JobReason...`) the rules match.
POD_FAILURE_POLICY = "PodFailurePolicy"
BACKOFF_LIMIT_EXCEEDED = "BackoffLimitExceeded"


def address(config, task_type, index):
    """A task's DNS name and port: pod 0 of Job `<name>-<type>-<index>` in the subdomain."""
    host = f"{config.name}-{task_type}-{index}-0.{config.name}"
    return f"{host}.{config.namespace}.svc:{config.port}"


def server_pod_failure_rules(container):
    """A server Job's `podFailurePolicy.rules`: the chief's, but a spent restart budget
    (`RESTARTS_EXHAUSTED`: the launcher in the pod gave up on its server) is counted, not
    final: a new pod, maybe on another node, tries again."""
    retry = sorted(exit_status.RETRY + (exit_status.RESTARTS_EXHAUSTED,))
    rules = exit_status.pod_failure_rules(container)
    for rule in rules:
        if "onExitCodes" in rule:
            rule["onExitCodes"]["values"] = list(retry)
    return rules


def failure_rules(config):
    """The JobSet's `failurePolicy.rules`, tried in order on its failed Jobs (see the module
    doc); a failed Job no rule matches gets JobSet's default, `RestartJobSet`."""
    launchers = list(ORDER)
    rules = [
        # A launcher's pod ended with a program error: its Job's `FailJob` rule fired.
        {"name": "program_error", "action": "FailJobSet", "targetReplicatedJobs": launchers,
         "onJobFailureReasons": [POD_FAILURE_POLICY]},
        # A Job spent its `backoffLimit` on retry statuses: start the whole job again.
        {"name": "retries_spent", "action": "RestartJobSet", "targetReplicatedJobs": launchers,
         "onJobFailureReasons": [BACKOFF_LIMIT_EXCEEDED]},
    ]
    if config.evaluator_command:  # Without it the JobSet could never succeed.
        rules.append({"name": "evaluator_failed", "action": "FailJobSet",
                      "targetReplicatedJobs": ["evaluator"]})
    return rules


def _job_template(config, task_type, names, index_labels):
    """A replicated job's Job: one pod, which is never run twice at once."""
    spec = {"completionMode": "Indexed", "parallelism": 1, "completions": 1,
            "podReplacementPolicy": "Failed", "backoffLimit": SERVER_BACKOFF_LIMIT}
    if task_type == "chief":
        spec.update(backoffLimit=config.backoff_limit, **manifests.chief_failure_handling())
        template = manifests.pod_template(config, task_type, "Never",
                                          index_labels.get(task_type), names)
    elif task_type == "evaluator":  # No launcher: its container restarts in place.
        template = manifests.pod_template(config, task_type, "OnFailure", address=names)
    else:
        spec["podFailurePolicy"] = {"rules": server_pod_failure_rules(task_type)}
        template = manifests.pod_template(config, task_type, "Never",
                                          index_labels.get(task_type), names)
    spec["template"] = template
    return {"metadata": {"labels": manifests.labels(config, task_type)}, "spec": spec}


# The label each task type's pods read their index from; a task type not named is index 0.
INDEX_LABELS = {"ps": JOB_INDEX_LABEL, "worker": JOB_INDEX_LABEL}


def replicated_jobs(config, names=None, index_labels=INDEX_LABELS):
    """`spec.replicatedJobs`: ps, then workers, then the chief (`ORDER`), then the evaluator.

    `names(type, index)` gives the tasks' addresses in `TF_CONFIG` (default `address`);
    `index_labels` the label each type's pods read their index from.
    """
    names = names or functools.partial(address, config)
    counts = {"ps": config.num_ps, "worker": config.num_workers, "chief": 1, "evaluator": 1}
    types = list(ORDER) + (["evaluator"] if config.evaluator_command else [])
    jobs = []
    for task_type in types:
        job = {"name": task_type, "replicas": counts[task_type],
               "template": _job_template(config, task_type, names, index_labels)}
        if task_type in ORDER[1:]:  # The evaluator needs no server: it starts at once.
            job["dependsOn"] = [{"name": ORDER[ORDER.index(task_type) - 1], "status": "Ready"}]
        jobs.append(job)
    return jobs


def jobset(config, jobs=None):
    """The JobSet object (see the module doc), of `jobs` (default `replicated_jobs(config)`)."""
    done = ["chief"] + (["evaluator"] if config.evaluator_command else [])
    spec = {"replicatedJobs": replicated_jobs(config) if jobs is None else jobs,
            "network": {"enableDNSHostnames": True, "subdomain": config.name,
                        "publishNotReadyAddresses": True},
            "successPolicy": {"operator": "All", "targetReplicatedJobs": done},
            "failurePolicy": {"maxRestarts": config.max_restarts,
                              "restartStrategy": "BlockingRecreate",
                              "rules": failure_rules(config)}}
    if config.ttl_after_finished is not None:
        spec["ttlSecondsAfterFinished"] = config.ttl_after_finished
    return {"apiVersion": API_VERSION, "kind": "JobSet",
            "metadata": manifests.metadata(config, config.name, manifests.labels(config)),
            "spec": spec}


def render(config):
    """The JobSet, a PodDisruptionBudget per server type and the NetworkPolicy, as dicts.

    The budgets give `minAvailable` (tasks - 1): a drain takes at most one worker and one
    ps at a time. Kubernetes allows only an integer `minAvailable` for pods whose
    controller has no scale subresource, as a Job's.
    """
    counts = {"worker": config.num_workers, "ps": config.num_ps}
    budgets = [manifests.disruption_budget(config, t, {"minAvailable": counts[t] - 1})
               for t in manifests.SERVER_TYPES]
    return [jobset(config), *budgets, manifests.network_policy(config)]
