"""`kfit-ps manifests`: Kubernetes objects of a job, schema-valid, with a TF_CONFIG per pod."""

import json
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from kfit_ps import ClusterConfig
from kfit_ps.launch.manifests import ManifestConfig, render
from tests import helpers

K8S_VERSION = "1.30.0"


def job(**kwargs):
    defaults = dict(name="ctr", image="registry.example/ctr:1", command=("python", "/app/t.py"),
                    num_workers=4, num_ps=2, namespace="ml", claim="ckpt",
                    evaluator_command=("kfit-ps", "evaluator", "--checkpoint-dir",
                                       "/shared/ckpt", "--model-fn", "t:m", "--data-fn", "t:d"),
                    cpu={"worker": "2", "ps": "1"}, memory={"ps": "8Gi"})
    return ManifestConfig(**dict(defaults, **kwargs))


def pod_specs(objects):
    for obj in objects:
        if obj["kind"] in ("Deployment", "Job"):
            yield obj, obj["spec"]["template"]["spec"]


def test_every_object_passes_the_kubernetes_schema():
    objects = render(job())
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    kinds = [obj["kind"] for obj in objects]
    assert kinds.count("Service") == 8  # chief, 4 workers, 2 ps, evaluator
    assert kinds.count("Deployment") == 6 and kinds.count("Job") == 2
    assert kinds.count("NetworkPolicy") == 1


def test_each_pod_has_its_task_and_every_task_by_its_dns_name():
    config = job()
    objects = render(config)
    services = {obj["metadata"]["name"] for obj in objects if obj["kind"] == "Service"}
    seen = set()
    for obj, spec in pod_specs(objects):
        [container] = spec["containers"]
        env = {e["name"]: e["value"] for e in container["env"]}
        parsed = ClusterConfig.from_tf_config(env["TF_CONFIG"])
        task = (parsed.task_type, parsed.task_index)
        seen.add(task)
        assert obj["metadata"]["name"] == f"ctr-{task[0]}-{task[1]}"
        assert parsed.num_tasks("worker") == 4 and parsed.num_tasks("ps") == 2
        for kind in ("chief", "worker", "ps", "evaluator"):
            for i, address in enumerate(parsed.cluster[kind]):
                host, port = address.rsplit(":", 1)
                assert host == f"ctr-{kind}-{i}.ml.svc" and port == "2222"
                assert f"ctr-{kind}-{i}" in services  # a stable name behind every address
        assert container["volumeMounts"] == [{"name": "shared", "mountPath": "/shared"}]
    assert seen == set(config.tasks())


def test_restart_policies_match_the_fault_tolerance_semantics():
    objects = {obj["metadata"]["name"]: obj for obj in render(job())
               if obj["kind"] in ("Deployment", "Job")}
    worker = objects["ctr-worker-3"]["spec"]["template"]["spec"]
    assert worker["restartPolicy"] == "Always"
    assert worker["containers"][0]["command"][:4] == ["kfit-ps", "run", "--tasks", "worker:3"]
    assert worker["containers"][0]["resources"] == {"requests": {"cpu": "2"}}
    assert objects["ctr-ps-1"]["spec"]["template"]["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "1", "memory": "8Gi"}}
    chief = objects["ctr-chief-0"]["spec"]
    command = chief["template"]["spec"]["containers"][0]["command"]
    assert command[:4] == ["kfit-ps", "run", "--tasks", "chief:0"]
    assert command[command.index("--backup-dir") + 1] == "/shared/backup"
    assert command[command.index("--"):] == ["--", "python", "/app/t.py"]
    assert chief["template"]["spec"]["restartPolicy"] == "Never"
    [fail, ignore] = chief["podFailurePolicy"]["rules"]
    # A failing program ends the Job; status 75 (a ClusterError) and lost pods are retried.
    assert fail["action"] == "FailJob" and fail["onExitCodes"]["operator"] == "NotIn"
    assert fail["onExitCodes"]["values"] == [0, 75]
    assert ignore["action"] == "Ignore"


def test_network_policy_admits_only_the_jobs_pods_on_the_server_port():
    [policy] = [obj for obj in render(job()) if obj["kind"] == "NetworkPolicy"]
    job_pods = {"matchLabels": {"kfit-ps/job": "ctr"}}
    assert policy["spec"]["podSelector"] == job_pods
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": job_pods}],
                                          "ports": [{"protocol": "TCP", "port": 2222}]}]
    for obj, _ in pod_specs(render(job())):
        assert obj["spec"]["template"]["metadata"]["labels"]["kfit-ps/job"] == "ctr"


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(name="Bad_Name"), "`name` must be a DNS label"),
    (dict(command=()), "the chief needs a command"),
    (dict(num_ps=0), "`num_ps` must be a positive integer"),
    (dict(image=""), "`image` is required"),
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
    assert len(objects) == 8 + 6 + 2 + 1
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    bad = subprocess.run([sys.executable, "-m", "kfit_ps.cli.main", "manifests", "--name", "x",
                          "--image", "i", "--cpu", "gpu=1", "--", "python", "t.py"],
                         capture_output=True, text=True, env=helpers.chief_env(),
                         cwd=helpers.ROOT, timeout=120)
    assert bad.returncode == 2 and "--cpu: must be TYPE=VALUE" in bad.stderr
    json.dumps(objects)  # plain data
