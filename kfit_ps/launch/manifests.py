"""Kubernetes manifests of a parameter-server job (`kfit-ps manifests`).

Kubeflow's Trainer v2 no longer runs TensorFlow jobs, so `TF_CONFIG` is ours
to write. `render(ManifestConfig(...))` returns the objects of one job:

- one headless `Service` per task, `<name>-<type>-<index>`: the task's stable
  DNS name `<name>-<type>-<index>.<namespace>.svc`, whatever pod runs it;
- each worker and ps: a one-replica `Deployment` (restarted wherever a node
  fails; `restartPolicy: Always`) running `kfit-ps run --tasks <type>:<index>`,
  which restarts the server process itself within the pod;
- the chief: a `Job` running `kfit-ps run --tasks chief:0 --backup-dir ...
  -- <command>`. Its pod failure policy ends the Job when the chief exits with
  a status other than 0 or 75: a failure of the program is not retried,
  while a pod lost with its node is (up to `backoffLimit`);
- the evaluator (optional): a `Job` running its command;
- a `NetworkPolicy` that admits traffic to the server port only from the
  job's own pods (TensorFlow servers have no authentication).

Every pod gets the same cluster in `TF_CONFIG` and its own task. A shared
volume (an existing PersistentVolumeClaim) can be mounted in every pod for
backups and checkpoints.
"""

import dataclasses
import json
import re

from kfit_ps import validation
from kfit_ps.errors import EXIT_CLUSTER_ERROR

_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL = "kfit-ps/job"
TASK_LABEL = "kfit-ps/task"


@dataclasses.dataclass(frozen=True)
class ManifestConfig:
    """The job to render.

    Args:
        name: the job's name; a DNS label (lowercase letters, digits, '-').
        image: the container image (with kfit_ps and the training script).
        command: the chief's command, e.g. `("python", "/app/train.py")`.
        num_workers, num_ps: tasks. Defaults to 2 and 1.
        evaluator_command: the evaluator's command (e.g. `kfit-ps evaluator ...`),
            or None for no evaluator. Defaults to None.
        namespace: Kubernetes namespace. Defaults to "default".
        port: the servers' gRPC port. Defaults to 2222.
        claim: an existing PersistentVolumeClaim mounted at `mount_path` in
            every pod, or None. Defaults to None.
        mount_path: where the claim is mounted. Defaults to "/shared".
        backup_dir: the chief's `--backup-dir`. Defaults to "/shared/backup"
            with a claim, else None.
        save_freq: the chief's `--save-freq`. Defaults to 100.
        max_restarts: `--max-restarts` of each pod's launcher. Defaults to 3.
        backoff_limit: pod restarts of the chief's Job (pods lost with their
            node). Defaults to 6.
        cpu, memory: resource requests per task type, e.g.
            `{"worker": "2", "ps": "1", "chief": "1"}`; missing types request nothing.
    """

    name: str
    image: str
    command: tuple
    num_workers: int = 2
    num_ps: int = 1
    evaluator_command: tuple = None
    namespace: str = "default"
    port: int = 2222
    claim: str = None
    mount_path: str = "/shared"
    backup_dir: str = None
    save_freq: object = 100
    max_restarts: int = 3
    backoff_limit: int = 6
    cpu: dict = dataclasses.field(default_factory=dict)
    memory: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        for field in ("name", "namespace"):
            value = getattr(self, field)
            if not isinstance(value, str) or not _DNS_LABEL.match(value) or len(value) > 40:
                raise ValueError(
                    f"ManifestConfig: `{field}` must be a DNS label of at most 40 characters "
                    f"(lowercase letters, digits and '-', starting with a letter). Received: "
                    f"{field}={value!r}.")
        if not self.image:
            raise ValueError("ManifestConfig: `image` is required (--image). Received: "
                             f"image={self.image!r}.")
        set_("command", tuple(str(c) for c in self.command))
        if not self.command:
            raise ValueError("ManifestConfig: the chief needs a command. Received: command=(). "
                             "Example: kfit-ps manifests ... -- python /app/train.py")
        if self.evaluator_command is not None:
            set_("evaluator_command", tuple(str(c) for c in self.evaluator_command))
        for field, minimum in (("num_workers", 1), ("num_ps", 1), ("port", 1),
                               ("max_restarts", 0), ("backoff_limit", 0)):
            set_(field, validation.check_int(field, getattr(self, field), minimum,
                                             owner="ManifestConfig"))
        if self.backup_dir is None and self.claim:
            set_("backup_dir", f"{self.mount_path.rstrip('/')}/backup")

    def tasks(self):
        """`(type, index)` of every task, chief first."""
        tasks = [("chief", 0)] + [("worker", i) for i in range(self.num_workers)]
        tasks += [("ps", i) for i in range(self.num_ps)]
        return tasks + ([("evaluator", 0)] if self.evaluator_command else [])

    def service_name(self, task_type, index):
        return f"{self.name}-{task_type}-{index}"

    def address(self, task_type, index):
        """The task's stable DNS name and port."""
        return f"{self.service_name(task_type, index)}.{self.namespace}.svc:{self.port}"

    def tf_config(self, task_type, index):
        cluster = {}
        for kind, i in self.tasks():
            cluster.setdefault(kind, []).append(self.address(kind, i))
        return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


def _labels(config, task_type=None, index=None):
    labels = {LABEL: config.name, "app.kubernetes.io/managed-by": "kfit-ps"}
    if task_type is not None:
        labels[TASK_LABEL] = f"{task_type}-{index}"
    return labels


def _metadata(config, name, labels):
    return {"name": name, "namespace": config.namespace, "labels": labels}


def _container(config, task_type, index, command):
    container = {
        "name": task_type, "image": config.image, "command": list(command),
        "env": [{"name": "TF_CONFIG", "value": config.tf_config(task_type, index)},
                {"name": "PYTHONUNBUFFERED", "value": "1"}],
    }
    if task_type in ("worker", "ps"):
        container["ports"] = [{"name": "grpc", "containerPort": config.port}]
    requests = {key: str(getattr(config, key)[task_type]) for key in ("cpu", "memory")
                if task_type in getattr(config, key)}
    if requests:
        container["resources"] = {"requests": requests}
    if config.claim:
        container["volumeMounts"] = [{"name": "shared", "mountPath": config.mount_path}]
    return container


def _pod_spec(config, task_type, index, command, restart_policy):
    spec = {"restartPolicy": restart_policy,
            "containers": [_container(config, task_type, index, command)]}
    if config.claim:
        spec["volumes"] = [{"name": "shared",
                            "persistentVolumeClaim": {"claimName": config.claim}}]
    return spec


def _service(config, task_type, index):
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _metadata(config, config.service_name(task_type, index),
                                  _labels(config, task_type, index)),
            "spec": {"clusterIP": "None", "selector": _labels(config, task_type, index),
                     "ports": [{"name": "grpc", "port": config.port,
                                "targetPort": config.port}]}}


def _server(config, task_type, index):
    labels = _labels(config, task_type, index)
    command = ["kfit-ps", "run", "--tasks", f"{task_type}:{index}",
               "--max-restarts", str(config.max_restarts)]
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": _metadata(config, config.service_name(task_type, index), labels),
            "spec": {"replicas": 1, "strategy": {"type": "Recreate"},
                     "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels},
                                  "spec": _pod_spec(config, task_type, index, command,
                                                    "Always")}}}


def _job(config, task_type, command, failure_policy):
    labels = _labels(config, task_type, 0)
    spec = {"backoffLimit": config.backoff_limit,
            "template": {"metadata": {"labels": labels},
                         "spec": _pod_spec(config, task_type, 0, command,
                                           "Never" if failure_policy else "OnFailure")}}
    if failure_policy:
        spec["podFailurePolicy"] = {"rules": [
            {"action": "FailJob", "onExitCodes": {
                "containerName": task_type, "operator": "NotIn",
                "values": [0, EXIT_CLUSTER_ERROR]}},
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget",
                                                     "status": "True"}]}]}
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": _metadata(config, config.service_name(task_type, 0), labels),
            "spec": spec}


def _network_policy(config):
    job_pods = {"matchLabels": {LABEL: config.name}}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _metadata(config, f"{config.name}-servers", _labels(config)),
            "spec": {"podSelector": job_pods, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"podSelector": job_pods}],
                                  "ports": [{"protocol": "TCP", "port": config.port}]}]}}


def render(config):
    """The job's Kubernetes objects, as dicts (see the module doc)."""
    objects = [_service(config, t, i) for t, i in config.tasks()]
    objects += [_server(config, t, i) for t, i in config.tasks() if t in ("worker", "ps")]
    chief = ["kfit-ps", "run", "--tasks", "chief:0", "--max-restarts", str(config.max_restarts)]
    if config.backup_dir:
        chief += ["--backup-dir", config.backup_dir, "--save-freq", str(config.save_freq)]
    objects.append(_job(config, "chief", chief + ["--", *config.command], failure_policy=True))
    if config.evaluator_command:
        objects.append(_job(config, "evaluator", config.evaluator_command,
                            failure_policy=False))
    objects.append(_network_policy(config))
    return objects


def to_yaml(objects):
    """One YAML stream (`kubectl apply -f -`)."""
    import yaml

    return yaml.safe_dump_all(objects, sort_keys=False)
