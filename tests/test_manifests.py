"""`kfit-ps manifests`: Kubernetes objects of a job, schema-valid, with a TF_CONFIG per pod."""

import json
import subprocess
import sys

import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml

from kfit_ps import ClusterConfig
from kfit_ps.launch.manifests import ManifestConfig, render
from tests import helpers

from kfit_ps import exit_status
from kfit_ps.launch.manifests import DEFAULT_REQUESTS
from tests.pod_failure_policy import DISRUPTED, first_matching_rule

# The oldest Kubernetes whose Job API has everything the chief's Job uses (per-index backoff
# and podFailurePolicy GA; podReplacementPolicy beta, on by default), and the newest schema
# kubernetes-validate knows.
K8S_VERSIONS = ("1.33.0", kubernetes_validate.utils.latest_version())


def job(**kwargs):
    defaults = dict(name="ctr", image="registry.example/ctr:1", command=("python", "/app/t.py"),
                    num_workers=4, num_ps=2, namespace="ml", claim="ckpt",
                    evaluator_command=("kfit-ps", "evaluator", "--checkpoint-dir",
                                       "/shared/ckpt", "--model-fn", "t:m", "--data-fn", "t:d"),
                    cpu={"worker": "2", "ps": "1"}, memory={"ps": "8Gi"})
    return ManifestConfig(**dict(defaults, **kwargs))


def pod_specs(objects):
    for obj in objects:
        if obj["kind"] in ("StatefulSet", "Job"):
            yield obj, obj["spec"]["template"]["spec"]


def validate(objects):
    for version in K8S_VERSIONS:
        for obj in objects:
            kubernetes_validate.validate(obj, version, strict=True)


def expand(value, env):
    """Kubernetes' `$(VAR)` expansion in a container's env values and command."""
    for name, replacement in env.items():
        value = value.replace(f"$({name})", replacement)
    return value


def pods(objects):
    """(object, container, env, command) of every pod the objects make, indices expanded."""
    for obj, spec in pod_specs(objects):
        [container] = spec["containers"]
        replicas = obj["spec"].get("replicas", 1)
        for index in range(replicas):
            env = {"KFIT_PS_TASK_INDEX": str(index)} if obj["kind"] == "StatefulSet" else {}
            for e in container["env"]:
                if "value" in e:
                    env[e["name"]] = expand(e["value"], env)
            yield obj, container, env, [expand(c, env) for c in container["command"]]


def test_every_object_passes_the_kubernetes_schema():
    objects = render(job())
    validate(objects)
    kinds = [obj["kind"] for obj in objects]
    assert kinds.count("Service") == 4  # chief, workers, ps, evaluator
    assert kinds.count("StatefulSet") == 2 and kinds.count("Job") == 2  # one per task type
    assert kinds.count("PodDisruptionBudget") == 2 and kinds.count("NetworkPolicy") == 1


def test_each_pod_has_its_task_and_every_task_by_its_dns_name():
    config = job()
    objects = render(config)
    services = {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == "Service"}
    seen = []
    for obj, container, env, command in pods(objects):
        parsed = ClusterConfig.from_tf_config(env["TF_CONFIG"])
        task = (parsed.task_type, parsed.task_index)
        seen.append(task)
        if obj["kind"] == "StatefulSet":  # The index is the pod's, from its label.
            assert command[:4] == ["kfit-ps", "run", "--tasks", f"{task[0]}:{task[1]}"]
            [index_env] = [e for e in container["env"] if e["name"] == "KFIT_PS_TASK_INDEX"]
            assert index_env["valueFrom"]["fieldRef"]["fieldPath"] == (
                "metadata.labels['apps.kubernetes.io/pod-index']")
            assert obj["spec"]["serviceName"] in services
        assert parsed.num_tasks("worker") == 4 and parsed.num_tasks("ps") == 2
        for kind in ("chief", "worker", "ps", "evaluator"):
            for i, address in enumerate(parsed.cluster[kind]):
                host, port = address.rsplit(":", 1)
                service = f"ctr-{kind}" if kind in ("worker", "ps") else f"ctr-{kind}-{i}"
                pod = f"ctr-{kind}-{i}.{service}" if kind in ("worker", "ps") else service
                assert host == f"{pod}.ml.svc" and port == "2222"
                assert service in services  # a stable name behind every address
                assert services[service]["spec"]["selector"]["kfit-ps/type"] == kind
        assert container["volumeMounts"] == [{"name": "shared", "mountPath": "/shared"}]
    assert sorted(seen) == sorted(config.tasks())  # every task exactly once


def test_pods_are_hardened_and_request_resources():
    for obj, spec in pod_specs(render(job())):
        [container] = spec["containers"]
        assert spec["automountServiceAccountToken"] is False
        assert spec["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
        assert container["securityContext"] == {"allowPrivilegeEscalation": False,
                                                "capabilities": {"drop": ["ALL"]}}
        requests = container["resources"]["requests"]
        assert set(requests) == {"cpu", "memory"}  # never BestEffort
    objects = {o["metadata"]["name"]: o for o in render(job()) if o["kind"] == "StatefulSet"}
    worker = objects["ctr-worker"]["spec"]["template"]["spec"]["containers"][0]
    assert worker["resources"] == {"requests": {"cpu": "2",
                                                "memory": DEFAULT_REQUESTS["worker"]["memory"]}}
    ps = objects["ctr-ps"]["spec"]["template"]["spec"]["containers"][0]
    assert ps["resources"] == {"requests": {"cpu": "1", "memory": "8Gi"}}
    assert ps["readinessProbe"]["tcpSocket"] == {"port": "grpc"}
    assert ps["livenessProbe"]["tcpSocket"] == {"port": "grpc"}
    budgets = [o for o in render(job()) if o["kind"] == "PodDisruptionBudget"]
    assert [b["spec"]["selector"]["matchLabels"]["kfit-ps/type"] for b in budgets] == [
        "worker", "ps"]
    assert all(b["spec"]["maxUnavailable"] == 1 for b in budgets)


def test_restart_policies_match_the_fault_tolerance_semantics():
    objects = {obj["metadata"]["name"]: obj for obj in render(job(grace=25))
               if obj["kind"] in ("StatefulSet", "Job")}
    for name in ("ctr-worker", "ctr-ps"):
        assert objects[name]["spec"]["template"]["spec"]["restartPolicy"] == "Always"
        assert objects[name]["spec"]["podManagementPolicy"] == "Parallel"
    chief = objects["ctr-chief-0"]["spec"]
    command = chief["template"]["spec"]["containers"][0]["command"]
    assert command[:4] == ["kfit-ps", "run", "--tasks", "chief:0"]
    assert command[command.index("--backup-dir") + 1] == "/shared/backup"
    assert command[command.index("--grace") + 1] == "25"
    assert command[command.index("--"):] == ["--", "python", "/app/t.py"]
    assert chief["template"]["spec"]["restartPolicy"] == "Never"
    assert chief["template"]["spec"]["terminationGracePeriodSeconds"] == 35
    assert chief["podReplacementPolicy"] == "Failed"
    assert chief["podFailurePolicy"]["rules"] == exit_status.pod_failure_rules("chief")


@pytest.mark.parametrize("case, exit_code, conditions, action", [
    ("the script finished", 0, (), "Succeeded"),
    ("the program failed (an exception)", 1, (), "FailJob"),
    ("a bad argument (argparse)", 2, (), "FailJob"),
    ("a cluster loss the launcher could not ride out", exit_status.CLUSTER_ERROR, (), "Count"),
    ("the launcher's restart budget is spent", exit_status.RESTARTS_EXHAUSTED, (), "FailJob"),
    ("SIGTERM during a node drain", exit_status.PREEMPTED, DISRUPTED, "Ignore"),
    ("SIGTERM after a spot preemption, killed at the deadline", exit_status.KILLED, DISRUPTED,
     "Ignore"),
    ("SIGTERM without a disruption condition (kubectl delete pod)", exit_status.PREEMPTED, (),
     "Count"),
    ("SIGKILL by the kernel's OOM killer", exit_status.KILLED, (), "Count"),
    ("a segfault", 139, (), "FailJob"),
])
def test_chief_pod_failure_policy_under_the_first_match_rule(case, exit_code, conditions,
                                                             action):
    [chief] = [o for o in render(job()) if o["kind"] == "Job" and
               o["metadata"]["name"] == "ctr-chief-0"]
    rules = chief["spec"]["podFailurePolicy"]["rules"]
    assert first_matching_rule(rules, exit_code, conditions) == action, case


def test_network_policy_admits_only_the_jobs_pods_on_the_server_port_and_a_scraper():
    [policy] = [obj for obj in render(job()) if obj["kind"] == "NetworkPolicy"]
    job_pods = {"matchLabels": {"kfit-ps/job": "ctr"}}
    scraper = {"namespaceSelector": {},
               "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    assert policy["spec"]["podSelector"] == job_pods
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [
        {"from": [{"podSelector": job_pods}], "ports": [{"protocol": "TCP", "port": 2222}]},
        {"from": [{"podSelector": job_pods}, scraper],
         "ports": [{"protocol": "TCP", "port": 9400}]}]
    for obj, _ in pod_specs(render(job())):
        assert obj["spec"]["template"]["metadata"]["labels"]["kfit-ps/job"] == "ctr"


def test_every_launcher_pod_is_scraped_on_its_status_port():
    scraped = 0
    for obj, _ in pod_specs(render(job(status_port=9500,
                                       evaluator_command=("kfit-ps", "evaluator")))):
        template = obj["spec"]["template"]
        [container] = template["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["KFIT_PS_JOB"] == "ctr"  # the `job` label of every metric
        if container["command"][:2] != ["kfit-ps", "run"]:
            assert "annotations" not in template["metadata"]  # the evaluator: no launcher
            continue
        assert template["metadata"]["annotations"] == {
            "prometheus.io/scrape": "true", "prometheus.io/port": "9500",
            "prometheus.io/path": "/metrics"}
        command = container["command"]
        assert command[command.index("--status-port") + 1] == "9500"
        assert command[command.index("--status-address") + 1] == "0.0.0.0"
        assert {"name": "metrics", "containerPort": 9500} in container["ports"]
        scraped += 1
    assert scraped == 3  # the chief, the workers' and the ps' StatefulSets


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(name="Bad_Name"), "`name` must be a DNS label"),
    (dict(command=()), "the chief needs a command"),
    (dict(num_ps=0), "`num_ps` must be a positive integer"),
    (dict(image=""), "`image` is required"),
    (dict(status_port=2221), "`status_port` and the next port"),
])
def test_config_errors(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment.replace("`", ".")):
        job(**kwargs)


def test_cli_prints_valid_yaml():
    proc = subprocess.run(
        [sys.executable, "-m", "kfit_ps.cli.main", "manifests", "--name", "demo", "--image",
         "img:1", "--workers", "4", "--ps", "2", "--claim", "ckpt", "--cpu", "worker=2",
         "--evaluator", "kfit-ps evaluator --checkpoint-dir /shared/ckpt --model-fn m:f "
         "--data-fn m:g", "--", "python", "/app/train.py"],
        capture_output=True, text=True, env=helpers.chief_env(), cwd=helpers.ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    objects = list(yaml.safe_load_all(proc.stdout))
    assert len(objects) == 4 + 2 + 2 + 2 + 1
    validate(objects)
    bad = subprocess.run([sys.executable, "-m", "kfit_ps.cli.main", "manifests", "--name", "x",
                          "--image", "i", "--cpu", "gpu=1", "--", "python", "t.py"],
                         capture_output=True, text=True, env=helpers.chief_env(),
                         cwd=helpers.ROOT, timeout=120)
    assert bad.returncode == 2 and "--cpu: must be TYPE=VALUE" in bad.stderr
    json.dumps(objects)  # plain data


@pytest.mark.parametrize("form", ["statefulsets", "jobset"])
def test_workers_found_through_dns_up_to_max_workers(form):
    """With `max_workers`, the chief's launcher finds the workers through DNS: its pattern
    names exactly the workers TF_CONFIG lists (so a pod scaled in up to the maximum has its
    task), and in the StatefulSet form a terminating worker loses its name at once and is
    drained before it stops."""
    from kfit_ps.launch import discovery, jobset
    from kfit_ps.launch.config import LAUNCH_DEFAULTS, LaunchConfig

    config = job(max_workers=6)
    objects = render(config) if form == "statefulsets" else jobset.render(config)
    if form == "statefulsets":
        validate(objects)
    [command] = [c for c in _commands(objects) if "--discover-workers" in c]
    pattern = command[command.index("--discover-workers") + 1]
    assert command[command.index("--max-workers") + 1] == "6"
    [cluster] = set(_clusters(objects))  # every pod's TF_CONFIG names one cluster
    workers = json.loads(cluster)["worker"]
    assert workers == [pattern.replace("{i}", str(i)) for i in range(6)]
    LaunchConfig(command=("python", "t.py"), tasks=(("chief", 0),), discover_workers=pattern,
                 max_workers=6)  # what the chief's launcher parses
    assert discovery.WorkerPattern.parse(pattern).indexed
    if form == "statefulsets":
        [service] = [o for o in objects if o["metadata"]["name"] == "ctr-worker"
                     and o["kind"] == "Service"]
        assert service["spec"]["publishNotReadyAddresses"] is False
        [workers_set] = [o for o in objects if o["metadata"]["name"] == "ctr-worker"
                         and o["kind"] == "StatefulSet"]
        assert workers_set["spec"]["replicas"] == 4
        pod = workers_set["spec"]["template"]["spec"]
        drain = pod["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert drain > LAUNCH_DEFAULTS["discovery_grace"]
        assert pod["terminationGracePeriodSeconds"] > drain


def _commands(value):
    if isinstance(value, dict):
        if "command" in value and isinstance(value["command"], list):
            yield value["command"]
        for item in value.values():
            yield from _commands(item)
    elif isinstance(value, list):
        for item in value:
            yield from _commands(item)


def _clusters(value):
    if isinstance(value, dict):
        if value.get("name") == "TF_CONFIG" and "value" in value:
            yield json.dumps(json.loads(value["value"].replace("$(KFIT_PS_TASK_INDEX)", "0"))
                             ["cluster"])
        for item in value.values():
            yield from _clusters(item)
    elif isinstance(value, list):
        for item in value:
            yield from _clusters(item)
