"""Kubernetes manifests of a parameter-server job (`kfit-ps manifests`).

Kubeflow's Trainer v2 no longer runs TensorFlow jobs, so `TF_CONFIG` is ours
to write. Three forms of one `ManifestConfig`: a JobSet (`kfit_ps.launch.jobset`,
`--format jobset`), for clusters with the JobSet controller; a Kubeflow Trainer v2
runtime built on it (`kfit_ps.launch.trainer_runtime`, `--format trainer-runtime`);
and the one this module renders (`--format statefulsets`) for clusters without
JobSet. All build their pods from the same blocks below (`pod_template`). `render(config)` here
returns the objects of one job:

- workers and ps: one `StatefulSet` per task type (`<name>-worker`,
  `<name>-ps`), which never runs two pods for one task (a TensorFlow task
  registered twice breaks the cluster) and reschedules a pod whose node was
  lost. Pod `i` runs `kfit-ps run --tasks <type>:<i>`, which restarts the
  server process itself within the pod; its index comes from the pod's
  `apps.kubernetes.io/pod-index` label. A headless `Service` per type gives
  each pod its stable DNS name `<name>-<type>-<i>.<name>-<type>.<namespace>.svc`.
  Readiness and liveness probes check the server's port;
- the chief: a `Job` running `kfit-ps run --tasks chief:0 --backup-dir ...
  -- <command>`, behind its own headless `Service`. Its `podFailurePolicy` is
  `kfit_ps.exit_status.pod_failure_rules`: a pod disrupted by Kubernetes
  (drain, preemption) is ignored and replaced, a retry status is counted
  against `backoffLimit`, a program error fails the Job. `podReplacementPolicy:
  Failed` starts a new chief only once the old one is gone, and
  `terminationGracePeriodSeconds` leaves the chief its `--grace` to save;
- the evaluator (optional): a `Job` running its command;
- a `PodDisruptionBudget` per server type: a drain takes at most one worker
  and one ps at a time;
- a `NetworkPolicy` that admits traffic to the server port only from the
  job's own pods (TensorFlow servers have no authentication), and to the
  status port only from the job's pods and a scraper (pods labelled
  `scraper`, in any namespace: Prometheus by default).

Each launcher serves its status page and metrics on `status_port` of the
pod (`kfit-ps run --status-port`; on the chief's pod the chief's metrics
too), and every pod that runs a launcher carries Prometheus' scrape
annotations (`prometheus.io/scrape`, `/port`, `/path`). `KFIT_PS_JOB` is the
job's name: the `job` label of every metric.

Every pod gets the same cluster in `TF_CONFIG` and its own task, resource
requests (`DEFAULT_REQUESTS` unless given), no service-account token, and a
restrictive security context. A shared volume (an existing
PersistentVolumeClaim) can be mounted in every pod for backups and
checkpoints. Deleting the job is `kubectl delete all,pdb,networkpolicy -l
kfit-ps/job=<name>`: the StatefulSets run until then.
"""

import dataclasses
import json
import re

from kfit_ps import exit_status, validation
from kfit_ps.launch.config import LAUNCH_DEFAULTS

_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL = "kfit-ps/job"
TYPE_LABEL = "kfit-ps/type"
SERVER_TYPES = ("worker", "ps")
# The pod's index in its StatefulSet, from the label Kubernetes sets (GA in 1.32).
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
INDEX_ENV = "KFIT_PS_TASK_INDEX"
# Requests of a task type when the config gives none: a pod without requests is
# BestEffort, the first one Kubernetes evicts under memory pressure.
DEFAULT_REQUESTS = {"chief": {"cpu": "1", "memory": "2Gi"},
                    "worker": {"cpu": "2", "memory": "4Gi"},
                    "ps": {"cpu": "1", "memory": "4Gi"},
                    "evaluator": {"cpu": "1", "memory": "2Gi"}}
# Seconds Kubernetes waits after the chief's SIGTERM beyond its `--grace`, for the
# launcher to stop the servers of its pod.
SHUTDOWN_MARGIN = 10
# With `max_workers`: seconds a terminating worker serves past the chief's discovery grace,
# for the chief's safe point and drain.
DRAIN_SECONDS = 30


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
        backoff_limit: chief pods the Job replaces after a retry status (a
            disruption is not counted). Defaults to 6.
        grace: the chief's `--grace`: seconds to save after SIGTERM. The chief
            pod's `terminationGracePeriodSeconds` is this plus `SHUTDOWN_MARGIN`.
            Defaults to 20.
        status_port: each launcher's status page and metrics port (the chief's
            own metrics take the next port, on loopback). Defaults to 9400.
        scraper: labels of the pods allowed to scrape `status_port` (in any
            namespace). Defaults to `{"app.kubernetes.io/name": "prometheus"}`.
        cpu, memory: resource requests per task type, e.g.
            `{"worker": "2", "ps": "1", "chief": "1"}`; a type not given gets
            `DEFAULT_REQUESTS`.
        ttl_after_finished: the JobSet and Trainer-runtime forms only: seconds after
            which a finished JobSet is deleted (`ttlSecondsAfterFinished`), or None to keep it.
            Defaults to None.
        max_workers: workers found through DNS (elastic): `TF_CONFIG` names workers
            0 .. `max_workers`-1 and the chief's launcher runs with `--discover-workers
            <the workers' name pattern> --max-workers <max_workers>`, so scaling the
            worker set (`kubectl scale`, up to `max_workers`) is all a change of workers
            takes (`kfit_ps.launch.discovery`). In the StatefulSet form a worker's name
            then resolves only while its pod is ready (`publishNotReadyAddresses:
            false`), and a terminating worker keeps serving `DRAIN_SECONDS` past the
            chief's `--discovery-grace` (a `preStop` sleep), so it is drained before it
            stops. Defaults to None: the fixed `num_workers`.
    """

    name: str
    image: str
    command: tuple
    num_workers: int = LAUNCH_DEFAULTS["num_workers"]
    num_ps: int = LAUNCH_DEFAULTS["num_ps"]
    evaluator_command: tuple = None
    namespace: str = "default"
    port: int = 2222
    claim: str = None
    mount_path: str = "/shared"
    backup_dir: str = None
    save_freq: object = 100
    max_restarts: int = LAUNCH_DEFAULTS["max_restarts"]
    backoff_limit: int = 6
    grace: int = int(LAUNCH_DEFAULTS["grace"])
    status_port: int = 9400
    scraper: dict = dataclasses.field(
        default_factory=lambda: {"app.kubernetes.io/name": "prometheus"})
    cpu: dict = dataclasses.field(default_factory=dict)
    memory: dict = dataclasses.field(default_factory=dict)
    ttl_after_finished: int = None
    max_workers: int = None

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
                               ("max_restarts", 0), ("backoff_limit", 0), ("grace", 0),
                               ("status_port", 1)):
            set_(field, validation.check_int(field, getattr(self, field), minimum,
                                             owner="ManifestConfig"))
        set_("ttl_after_finished", validation.check_optional_int(
            "ttl_after_finished", self.ttl_after_finished, 0, owner="ManifestConfig"))
        set_("max_workers", validation.check_optional_int(
            "max_workers", self.max_workers, self.num_workers, owner="ManifestConfig",
            hint=f"(--max-workers) It must be at least the {self.num_workers} workers the "
                 "job starts with (--workers)."))
        if self.status_port in (self.port, self.port - 1) or self.status_port > 65534:
            raise ValueError(
                "ManifestConfig: `status_port` and the next port (the chief's metrics) must "
                f"differ from the servers' port={self.port} and be below 65535. Received: "
                f"status_port={self.status_port}.")
        if self.backup_dir is None and self.claim:
            set_("backup_dir", f"{self.mount_path.rstrip('/')}/backup")

    def tasks(self):
        """`(type, index)` of every task `TF_CONFIG` names, chief first (with `max_workers`,
        every worker there may be)."""
        workers = self.max_workers or self.num_workers
        tasks = [("chief", 0)] + [("worker", i) for i in range(workers)]
        tasks += [("ps", i) for i in range(self.num_ps)]
        return tasks + ([("evaluator", 0)] if self.evaluator_command else [])

    def service_name(self, task_type, index=0):
        """The headless Service behind a task: one per server type, one per other task."""
        if task_type in SERVER_TYPES:
            return f"{self.name}-{task_type}"
        return f"{self.name}-{task_type}-{index}"

    def address(self, task_type, index):
        """The task's stable DNS name and port."""
        host = f"{self.name}-{task_type}-{index}"
        if task_type in SERVER_TYPES:  # The StatefulSet's pod, under its Service.
            host = f"{host}.{self.service_name(task_type)}"
        return f"{host}.{self.namespace}.svc:{self.port}"

    def tf_config(self, task_type, index, address=None):
        """`TF_CONFIG` for a task; `index` may be a string spliced in as is (`$(VAR)`).

        `address(type, index)` names each task (the JobSet form's names); defaults to
        `self.address`.
        """
        address = address or self.address
        cluster = {}
        for kind, i in self.tasks():
            cluster.setdefault(kind, []).append(address(kind, i))
        text = json.dumps({"cluster": cluster, "task": {"type": task_type, "index": -1}})
        return text.replace('"index": -1', f'"index": {index}')

    def requests(self, task_type):
        requests = dict(DEFAULT_REQUESTS[task_type])
        for key in ("cpu", "memory"):
            if task_type in getattr(self, key):
                requests[key] = str(getattr(self, key)[task_type])
        return requests


# Every manifest default with a plain value, from the fields above: `kfit-ps manifests`' flags
# take theirs from here.
MANIFEST_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ManifestConfig)
                     if f.default is not dataclasses.MISSING}


# The building blocks below serve both forms: the StatefulSets here and the JobSet
# (`kfit_ps.launch.jobset`), so that a pod is the same whichever controller runs it.


def labels(config, task_type=None):
    """The labels of the job's objects (and of a task type's pods, with `task_type`)."""
    result = {LABEL: config.name, "app.kubernetes.io/managed-by": "kfit-ps"}
    if task_type is not None:
        result[TYPE_LABEL] = task_type
    return result


def metadata(config, name, object_labels):
    return {"name": name, "namespace": config.namespace, "labels": object_labels}


def _status_flags(config):
    """A launcher's status page: on the pod's network, for the scraper."""
    return ["--status-port", str(config.status_port), "--status-address", "0.0.0.0"]


def _scrape_annotations(config):
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(config.status_port),
            "prometheus.io/path": "/metrics"}


def launcher_command(config, task_type, index, address=None):
    """`kfit-ps run --tasks <type>:<index> ...` of a pod; the chief's runs the job's command
    (with `max_workers`, finding the workers named by `address(type, index)` through DNS)."""
    command = ["kfit-ps", "run", "--tasks", f"{task_type}:{index}", "--max-restarts",
               str(config.max_restarts)]
    if task_type != "chief":
        return command + _status_flags(config)
    command += ["--grace", str(config.grace), *_status_flags(config)]
    if config.max_workers:
        pattern = (address or config.address)("worker", "{i}")
        command += ["--discover-workers", pattern, "--max-workers", str(config.max_workers)]
    if config.backup_dir:
        command += ["--backup-dir", config.backup_dir, "--save-freq", str(config.save_freq)]
    return command + ["--", *config.command]


def _container(config, task_type, env, command):
    container = {
        "name": task_type, "image": config.image, "command": list(command),
        "env": env + [{"name": "PYTHONUNBUFFERED", "value": "1"},
                      {"name": "KFIT_PS_JOB", "value": config.name}],
        "resources": {"requests": config.requests(task_type)},
        "securityContext": {"allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]}},
    }
    if task_type in SERVER_TYPES:
        container["ports"] = [{"name": "grpc", "containerPort": config.port}]
        probe = {"tcpSocket": {"port": "grpc"}}
        container["readinessProbe"] = dict(probe, periodSeconds=5)
        # The launcher in the pod restarts a server that exits; the probe catches a pod
        # whose port stays closed for a minute (a launcher that cannot start its server).
        container["livenessProbe"] = dict(probe, initialDelaySeconds=60, periodSeconds=10,
                                          failureThreshold=6)
    if task_type != "evaluator":  # Pods of a launcher: its status page and metrics.
        container.setdefault("ports", []).append(
            {"name": "metrics", "containerPort": config.status_port})
    if config.claim:
        container["volumeMounts"] = [{"name": "shared", "mountPath": config.mount_path}]
    return container


def _pod_spec(config, container, restart_policy):
    spec = {"restartPolicy": restart_policy, "automountServiceAccountToken": False,
            "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [container]}
    if config.claim:
        spec["volumes"] = [{"name": "shared",
                            "persistentVolumeClaim": {"claimName": config.claim}}]
    return spec


def pod_template(config, task_type, restart_policy, index_label=None, address=None):
    """The pod template of a task type: its command, `TF_CONFIG`, probes and requests.

    With `index_label`, one template serves every task of the type: a pod's index is
    that label's value on the pod, read into `KFIT_PS_TASK_INDEX` and spliced into its
    command and `TF_CONFIG` by Kubernetes' `$(VAR)` expansion; without, the task is
    index 0. `address(type, index)` names the tasks in `TF_CONFIG` (defaults to
    `config.address`, the StatefulSet form's names).
    """
    index = f"$({INDEX_ENV})" if index_label else 0
    env = [{"name": "TF_CONFIG", "value": config.tf_config(task_type, index, address)}]
    if index_label:
        env.insert(0, {"name": INDEX_ENV, "valueFrom": {"fieldRef": {
            "fieldPath": f"metadata.labels['{index_label}']"}}})
    command = (config.evaluator_command if task_type == "evaluator"
               else launcher_command(config, task_type, index, address))
    spec = _pod_spec(config, _container(config, task_type, env, command), restart_policy)
    meta = {"labels": labels(config, task_type)}
    if task_type != "evaluator":  # A launcher: scraped.
        meta["annotations"] = _scrape_annotations(config)
    if task_type == "chief":
        spec["terminationGracePeriodSeconds"] = config.grace + SHUTDOWN_MARGIN
    return {"metadata": meta, "spec": spec}


def _drained_before_it_stops(template):
    """A discovered worker's pod (StatefulSet form): its name is gone as it starts
    terminating (its Service publishes ready pods only); it serves on through the chief's
    discovery grace and drain (a `preStop` sleep), then its launcher gets SIGTERM."""
    drain = int(LAUNCH_DEFAULTS["discovery_grace"]) + DRAIN_SECONDS
    template["spec"]["containers"][0]["lifecycle"] = {"preStop": {"sleep": {"seconds": drain}}}
    template["spec"]["terminationGracePeriodSeconds"] = drain + SHUTDOWN_MARGIN
    return template


def chief_failure_handling():
    """The chief Job's fields that decide what a failed chief pod means (see the module doc)."""
    return {"podReplacementPolicy": "Failed",
            "podFailurePolicy": {"rules": exit_status.pod_failure_rules("chief")}}


def _service(config, task_type, index=0):
    # Discovered workers resolve only while ready: a terminating one's name goes at once.
    discovered = task_type == "worker" and config.max_workers is not None
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": metadata(config, config.service_name(task_type, index),
                                 labels(config, task_type)),
            "spec": {"clusterIP": "None", "selector": labels(config, task_type),
                     "publishNotReadyAddresses": not discovered,
                     "ports": [{"name": "grpc", "port": config.port,
                                "targetPort": config.port}]}}


def _servers(config, task_type, replicas):
    """A StatefulSet of one server type: pod `i` is task `<type>:<i>`."""
    selector = labels(config, task_type)
    template = pod_template(config, task_type, "Always", POD_INDEX_LABEL)
    if task_type == "worker" and config.max_workers:
        template = _drained_before_it_stops(template)
    return {"apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": metadata(config, config.service_name(task_type), selector),
            "spec": {"replicas": replicas, "serviceName": config.service_name(task_type),
                     "podManagementPolicy": "Parallel",
                     "selector": {"matchLabels": selector},
                     "template": template}}


def _job(config, task_type):
    chief = task_type == "chief"
    spec = {"backoffLimit": config.backoff_limit,
            "template": pod_template(config, task_type, "Never" if chief else "OnFailure")}
    if chief:
        spec.update(chief_failure_handling())
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": metadata(config, config.service_name(task_type, 0),
                                 labels(config, task_type)),
            "spec": spec}


def disruption_budget(config, task_type, budget):
    """A PodDisruptionBudget of a server type's pods; `budget`: `{"maxUnavailable": 1}`, or
    `{"minAvailable": n}` for pods of a controller without a scale subresource (a Job)."""
    selector = labels(config, task_type)
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": metadata(config, config.service_name(task_type), selector),
            "spec": dict(budget, selector={"matchLabels": selector})}


def network_policy(config):
    """Ingress to the job's pods: the server port from the job's pods, the status port from
    them and the scraper."""
    job_pods = {"matchLabels": {LABEL: config.name}}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": metadata(config, f"{config.name}-servers", labels(config)),
            "spec": {"podSelector": job_pods, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"podSelector": job_pods}],
                                  "ports": [{"protocol": "TCP", "port": config.port}]},
                                 {"from": [{"podSelector": job_pods},
                                           {"namespaceSelector": {},
                                            "podSelector": {"matchLabels": dict(
                                                config.scraper)}}],
                                  "ports": [{"protocol": "TCP",
                                             "port": config.status_port}]}]}}


def render(config):
    """The job's Kubernetes objects, as dicts (see the module doc)."""
    counts = {"worker": config.num_workers, "ps": config.num_ps}
    objects = [_service(config, "chief")] + [_service(config, t) for t in SERVER_TYPES]
    if config.evaluator_command:
        objects.append(_service(config, "evaluator"))
    objects += [_servers(config, t, counts[t]) for t in SERVER_TYPES]
    objects.append(_job(config, "chief"))
    if config.evaluator_command:
        objects.append(_job(config, "evaluator"))
    objects += [disruption_budget(config, t, {"maxUnavailable": 1}) for t in SERVER_TYPES]
    objects.append(network_policy(config))
    return objects


def to_yaml(objects):
    """One YAML stream (`kubectl apply -f -`)."""
    import yaml

    return yaml.safe_dump_all(objects, sort_keys=False)
