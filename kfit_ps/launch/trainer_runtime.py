"""The job as a Kubeflow Trainer v2 runtime (`kfit-ps manifests --format trainer-runtime`).

Kubeflow Trainer v2 (kubeflow/trainer, API `trainer.kubeflow.org/v1alpha1`;
written against its release v2.3.0, which builds on JobSet v0.12.0) turns a
`TrainJob` into a JobSet from the `ClusterTrainingRuntime` it names. It has no
TensorFlow policy (kubeflow/trainer#2699); this runtime is a plain one: no
`torch` or `mpi` policy, so Trainer's `PlainML` step applies, which sets the
trainer's pod count and env and nothing else. `render(config)` returns the
runtime, an example `TrainJob`, and that TrainJob's PodDisruptionBudgets and
NetworkPolicy. Who decides what:

- the runtime's `template.spec`: the JobSet form's spec (`kfit_ps.launch.jobset`:
  replicated jobs `ps`, `worker`, `chief` (and `evaluator`), `dependsOn`, the
  success and failure policies, the Jobs' pod failure rules, the pods), with
  three changes, as one runtime serves TrainJobs of any name in any namespace:
  - names: Trainer names the JobSet after the TrainJob, and JobSet gives its
    pods the subdomain of the JobSet's name (`network.subdomain` is left unset).
    Each pod reads the name from its label `jobset.sigs.k8s.io/jobset-name` into
    `KFIT_PS_JOB` and its namespace into `KFIT_PS_NAMESPACE`, and Kubernetes'
    `$(VAR)` expansion writes them into `TF_CONFIG`: task `worker:3` of TrainJob
    `ctr` in `ml` is `ctr-worker-3-0.ctr.ml.svc:2222`, as in the JobSet form;
  - labels: `kfit-ps/runtime: <runtime>` where the JobSet form has
    `kfit-ps/job: <name>`; a TrainJob's pods are those with its
    `jobset.sigs.k8s.io/jobset-name`;
  - the chief: its Job carries `trainer.kubeflow.org/trainjob-ancestor-step:
    trainer` and its container is named `node`, so Trainer applies a TrainJob's
    `trainer` (`image`, `command`, `args`, `env`, `resourcesPerNode`) to it
    alone. The launcher is the container's `command` (`kfit-ps run --tasks
    chief:<i> ... --`) and the script its `args`: a TrainJob sets `args` to run
    another script under the same launcher. The chief's task index is its pod's
    completion index (`batch.kubernetes.io/job-completion-index`, 0): a TrainJob
    whose `numNodes` gives the chief's Job a second pod makes it `chief:1`, which
    is in no `TF_CONFIG`; its launcher exits 2 and the TrainJob fails, instead of
    two chiefs training on the same servers;
- `mlPolicy: {numNodes: 1}`: one chief pod. It also makes Trainer merge a
  TrainJob's `resourcesPerNode` into the chief's requests (it does so only with
  an `mlPolicy`);
- fixed in the runtime, as Trainer overrides only the trainer's Job: the number
  of workers and ps, the servers' image, requests and commands, the failure
  handling. Another shape is another runtime (`--name`);
- the TrainJob's own objects: the PodDisruptionBudgets and the NetworkPolicy of
  the JobSet form, selecting the TrainJob's pods by `jobset.sigs.k8s.io/jobset-name`;
  Trainer creates only the JobSet. Deleting the TrainJob deletes its JobSet;
  `kubectl delete trainjob,pdb,networkpolicy -l kfit-ps/job=<trainjob>` deletes
  the rest.
"""

import dataclasses
import functools
import types

from kfit_ps import constants, exit_status
from kfit_ps.launch import jobset, manifests

API_VERSION = "trainer.kubeflow.org/v1alpha1"
API_GROUP = API_VERSION.partition("/")[0]
# The Trainer release this runtime is written and tested against.
RELEASE = "v2.3.0"
# Trainer applies a TrainJob's `trainer` to the Job with this label and value, in the
# container of this name (its webhook refuses a trainer Job without one, or of replicas != 1).
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
TRAINER_ANCESTOR = "trainer"
TRAINER_CONTAINER = "node"
TRAINER_JOB = "chief"  # the replicated job that runs the user's script
# The label Kubeflow's SDK lists runtimes by.
FRAMEWORK_LABEL = "trainer.kubeflow.org/framework"
FRAMEWORK = "tensorflow"
RUNTIME_LABEL = "kfit-ps/runtime"
# Labels JobSet, and the Job controller, set on every pod of a JobSet.
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
# The pod's namespace, for `$(VAR)` expansion in `TF_CONFIG` (kfit_ps does not read it).
NAMESPACE_ENV = "KFIT_PS_NAMESPACE"
# The label each pod reads its task index from: JobSet's Job index (one Job per task) for
# the servers, the chief Job's completion index for the chief; the evaluator is index 0.
INDEX_LABELS = {**jobset.INDEX_LABELS, "chief": COMPLETION_INDEX_LABEL}


def address(config, task_type, index):
    """A task's address in `TF_CONFIG`: the JobSet form's (`jobset.address`), with the
    JobSet's name and namespace left for Kubernetes to expand in the pod."""
    in_the_pod = types.SimpleNamespace(name=f"$({constants.JOB_ENV})",
                                       namespace=f"$({NAMESPACE_ENV})", port=config.port)
    return jobset.address(in_the_pod, task_type, index)


def _from_the_pod(container):
    """Names the JobSet and its namespace in the container's env, from the pod's label and
    namespace, ahead of `TF_CONFIG`, which refers to them."""
    env = [e for e in container["env"] if e["name"] != constants.JOB_ENV]
    names = [{"name": constants.JOB_ENV, "valueFrom": {"fieldRef": {
                 "fieldPath": f"metadata.labels['{JOBSET_NAME_LABEL}']"}}},
             {"name": NAMESPACE_ENV, "valueFrom": {"fieldRef": {
                 "fieldPath": "metadata.namespace"}}}]
    at = [e["name"] for e in env].index(constants.TF_CONFIG)
    container["env"] = env[:at] + names + env[at:]


def _runtime_labels(labels):
    """`labels` with `kfit-ps/runtime` for `kfit-ps/job`: the runtime names no job."""
    return {RUNTIME_LABEL if key == manifests.LABEL else key: value
            for key, value in labels.items()}


def _as_trainer(config, job_spec):
    """The chief's Job as Trainer's trainer: its container `node`, the launcher its `command`
    (up to its `--`) and the script its `args` (`TrainJob.spec.trainer.args`)."""
    pod = job_spec["template"]["spec"]
    [container] = pod["containers"]
    launcher = container["command"]
    script = len(launcher) - len(config.command)
    trainer = {}
    for key, value in container.items():  # `args` right after `command`
        trainer[key] = value
        if key == "command":
            trainer.update(command=launcher[:script], args=launcher[script:])
    pod["containers"] = [dict(trainer, name=TRAINER_CONTAINER)]
    job_spec["podFailurePolicy"] = {"rules": exit_status.pod_failure_rules(TRAINER_CONTAINER)}


def replicated_jobs(config):
    """The JobSet form's replicated jobs, their pods named from within (see the module doc)."""
    jobs = jobset.replicated_jobs(config, functools.partial(address, config), INDEX_LABELS)
    for rjob in jobs:
        task_type, template = rjob["name"], rjob["template"]
        pod = template["spec"]["template"]
        for labelled in (template, pod):
            labelled["metadata"]["labels"] = _runtime_labels(labelled["metadata"]["labels"])
        _from_the_pod(pod["spec"]["containers"][0])
        if task_type == TRAINER_JOB:
            template["metadata"]["labels"][ANCESTOR_LABEL] = TRAINER_ANCESTOR
            _as_trainer(config, template["spec"])
    return jobs


def runtime(config):
    """The `ClusterTrainingRuntime` `<name>` (see the module doc)."""
    spec = jobset.jobset(config, replicated_jobs(config))["spec"]
    del spec["network"]["subdomain"]  # JobSet's default: the JobSet's (the TrainJob's) name
    labels = _runtime_labels(manifests.labels(config))
    return {"apiVersion": API_VERSION, "kind": "ClusterTrainingRuntime",
            "metadata": {"name": config.name, "labels": {**labels, FRAMEWORK_LABEL: FRAMEWORK}},
            "spec": {"mlPolicy": {"numNodes": 1},
                     "template": {"metadata": {"labels": labels}, "spec": spec}}}


def train_job(config, runtime_name):
    """A `TrainJob` `<name>` in `<namespace>` on the runtime `runtime_name`: the chief's
    script as `trainer.args`, the one field a TrainJob of kfit_ps usually sets."""
    return {"apiVersion": API_VERSION, "kind": "TrainJob",
            "metadata": manifests.metadata(config, config.name, manifests.labels(config)),
            "spec": {"runtimeRef": {"apiGroup": API_GROUP, "kind": "ClusterTrainingRuntime",
                                    "name": runtime_name},
                     "trainer": {"args": list(config.command)}}}


def _select_by_jobset_name(node, key=None):
    """A copy of `node` whose pod selectors pick a TrainJob's pods by JobSet's name label
    (its own labels keep `kfit-ps/job`)."""
    if isinstance(node, list):
        return [_select_by_jobset_name(item) for item in node]
    if not isinstance(node, dict):
        return node
    if key == "matchLabels":
        return {JOBSET_NAME_LABEL if k == manifests.LABEL else k: v for k, v in node.items()}
    return {k: dict(v) if k == "metadata" else _select_by_jobset_name(v, k)
            for k, v in node.items()}


def render(config, train_job_name=None):
    """The runtime `config.name`, a TrainJob `train_job_name` (defaults to `config.name`) on
    it, and that TrainJob's PodDisruptionBudgets and NetworkPolicy, as dicts.

    ```python
    config = ManifestConfig(name="ctr", image="registry.example/ctr:1",
                            command=("python", "/app/train.py"), num_workers=4)
    objects = render(config, "ctr-run-1")  # ClusterTrainingRuntime ctr, TrainJob ctr-run-1, ...
    ```
    """
    job = config
    if train_job_name is not None:
        try:
            job = dataclasses.replace(config, name=train_job_name)
        except ValueError:
            raise ValueError(
                "trainer_runtime.render: the TrainJob's name (--train-job) must be a DNS label "
                "of at most 40 characters (lowercase letters, digits and '-', starting with a "
                f"letter). Received: train_job_name={train_job_name!r}.") from None
    # The budgets and the NetworkPolicy of the JobSet form.
    objects = _select_by_jobset_name(jobset.render(job)[1:])
    return [runtime(config), train_job(job, config.name), *objects]


# What each document is, printed above it by `to_yaml`.
_HEADERS = {
    "ClusterTrainingRuntime": (
        "kfit_ps's Kubeflow Trainer v2 runtime (written against Trainer {release}, on JobSet "
        "v0.12.0): once\nper cluster, by its administrator (kubectl apply -f). Fixed here: "
        "{workers} workers, {ps} ps, the\nservers' pods, the failure handling."),
    "TrainJob": (
        "A TrainJob on it. `trainer.args` is the chief's script (run by `kfit-ps run ... --`);"
        "\n`trainer.image`, `env` and `resourcesPerNode` change the chief's container alone. "
        "Leave\n`command` (the launcher) and `numNodes` (one chief pod) unset."),
    "PodDisruptionBudget": "For TrainJob {job}: a drain takes one {type} pod at a time.",
    "NetworkPolicy": "For TrainJob {job}: its servers admit its own pods (and the scraper) only.",
}


def to_yaml(objects):
    """`render`'s objects as one YAML stream (`kubectl apply -f -`), each under a comment."""
    rjobs = objects[0]["spec"]["template"]["spec"]["replicatedJobs"]
    counts = {rjob["name"]: rjob["replicas"] for rjob in rjobs}
    documents = []
    for obj in objects:
        header = _HEADERS[obj["kind"]].format(
            release=RELEASE, workers=counts["worker"], ps=counts["ps"],
            job=objects[1]["metadata"]["name"],
            type=obj["metadata"].get("labels", {}).get(manifests.TYPE_LABEL))
        comment = "".join(f"# {line}\n" for line in header.splitlines())
        documents.append(comment + manifests.to_yaml([obj]))
    return "---\n".join(documents)
