"""`kfit-ps manifests --format trainer-runtime`: a ClusterTrainingRuntime and a TrainJob valid
against Kubeflow Trainer v2.3.0's CRDs, the JobSet a TrainJob makes valid against JobSet and
Kubernetes, a TrainJob's `trainer` in the chief's container alone, and every task named."""

import copy
import re

import kubernetes_validate
import pytest
import yaml

from kfit_ps import ClusterConfig
from kfit_ps.cli.main import main
from kfit_ps.launch import jobset, manifests, trainer_runtime
from tests import crd_schema
from tests.jobset_policy import job_decision, jobset_action, replicated_job
from tests.test_jobset import CONFIGS, SCHEMA_FILE, jobs_as_jobset_creates_them
from tests.test_manifests import K8S_VERSIONS, expand, job

RUNTIME_FILE = "trainer-v2.3.0-clustertrainingruntimes-v1alpha1.schema.json"
TRAIN_JOB_FILE = "trainer-v2.3.0-trainjobs-v1alpha1.schema.json"
ANCESTOR = trainer_runtime.ANCESTOR_LABEL


def stored(filename):
    schema = crd_schema.load(filename)
    assert (schema["release"], schema["version"]) == ("v2.3.0", "v1alpha1")
    assert schema["commit"] == "658725bdae5c7e3a0854d93ac6ff492e109a22ab"  # the tag's commit
    assert schema["source"].startswith("https://github.com/kubeflow/trainer/blob/v2.3.0/")
    return schema["openAPIV3Schema"]


@pytest.fixture(scope="module")
def schemas():
    return {"ClusterTrainingRuntime": stored(RUNTIME_FILE), "TrainJob": stored(TRAIN_JOB_FILE),
            "JobSet": crd_schema.load(SCHEMA_FILE)["openAPIV3Schema"]}


def rendered(config, train_job_name="ctr-run-7"):
    """`{kind: object}` of the rendered runtime and TrainJob, and the list of all objects."""
    objects = trainer_runtime.render(config, train_job_name)
    return {o["kind"]: o for o in objects[:2]}, objects


def trainer_builds(train_job, runtime):
    """The JobSet Trainer v2.3.0 makes of `train_job` on `runtime`, a plain runtime (no
    torch, mpi, jax, xgboost or flux policy), as its code does (read, not copied):

    - the JobSet is named after the TrainJob, in its namespace, with the labels of the
      runtime's `template.metadata` (`pkg/runtime/core/trainingruntime.go`);
    - each replicated job's pod count is its `parallelism` (1 unset), the trainer's (the
      Job labelled `trainjob-ancestor-step: trainer`) `mlPolicy.numNodes` (1 unset) where
      the runtime has an `mlPolicy`, and the TrainJob's `trainer.numNodes` where given
      (`plugins/plainml`); every Job's `parallelism` and `completions` become that count
      (`plugins/jobset/jobset.go`, `SyncParallelCount`);
    - the trainer's Job gets `replicas: 1`, and in its container `node` the TrainJob's
      `trainer.image`, `command` and `args` replace the runtime's where given, its `env` is
      upserted by name (`plugins/jobset/builder.go`), and with an `mlPolicy` its
      `resourcesPerNode` is merged into the container's (a strategic merge: a key given
      wins). No other replicated job is touched.
    """
    spec = copy.deepcopy(runtime["spec"]["template"]["spec"])
    policy = runtime["spec"].get("mlPolicy")
    trainer = train_job["spec"].get("trainer", {})
    for rjob in spec["replicatedJobs"]:
        template = rjob["template"]
        count = template["spec"].get("parallelism", 1)
        if template["metadata"].get("labels", {}).get(ANCESTOR) == "trainer":
            if policy is not None:
                count = policy.get("numNodes", 1)
            count = trainer.get("numNodes", count)
            rjob["replicas"] = 1
            for container in template["spec"]["template"]["spec"]["containers"]:
                if container["name"] != "node":
                    continue
                container.update({k: trainer[k] for k in ("image", "command", "args")
                                  if k in trainer})
                for variable in trainer.get("env", []):
                    names = [e["name"] for e in container["env"]]
                    if variable["name"] in names:
                        container["env"][names.index(variable["name"])] = variable
                    else:
                        container["env"].append(variable)
                if policy is not None and "resourcesPerNode" in trainer:
                    for kind, values in trainer["resourcesPerNode"].items():
                        container["resources"][kind] = dict(
                            container["resources"].get(kind, {}), **values)
        template["spec"]["parallelism"] = template["spec"]["completions"] = count
    metadata = train_job["metadata"]
    return {"apiVersion": jobset.API_VERSION, "kind": "JobSet",
            "metadata": {"name": metadata["name"], "namespace": metadata["namespace"],
                         "labels": dict(runtime["spec"]["template"]["metadata"]["labels"])},
            "spec": spec}


def pods_of(built):
    """Every pod the JobSet's Jobs make: (Job, pod, container, env, command). JobSet names the
    subdomain after the JobSet when it is unset (its controller's `GetSubdomain`); the Job
    controller labels each pod of an Indexed Job with its completion index."""
    named = copy.deepcopy(built)
    named["spec"]["network"].setdefault("subdomain", built["metadata"]["name"])
    for _, created in jobs_as_jobset_creates_them(named):
        for completion in range(created["spec"]["completions"]):
            pod = copy.deepcopy(created["spec"]["template"])
            pod["metadata"]["labels"][trainer_runtime.COMPLETION_INDEX_LABEL] = str(completion)
            [container] = pod["spec"]["containers"]
            env = {}  # The downward API, then `$(VAR)` from the variables before.
            for e in container["env"]:
                if "value" in e:
                    env[e["name"]] = expand(e["value"], env)
                    continue
                path = e["valueFrom"]["fieldRef"]["fieldPath"]
                label = re.fullmatch(r"metadata\.labels\['(.+)'\]", path)
                env[e["name"]] = (pod["metadata"]["labels"][label.group(1)] if label
                                  else {"metadata.namespace": created["metadata"]["namespace"]}[
                                      path])
            command = [expand(c, env) for c in container["command"] + container.get("args", [])]
            yield created, pod, container, env, command


@pytest.mark.parametrize("kwargs", CONFIGS.values(), ids=CONFIGS.keys())
def test_the_runtime_and_the_train_job_pass_their_crd_schemas_strictly(schemas, kwargs):
    objects, _ = rendered(job(**kwargs))
    for kind, obj in objects.items():
        assert crd_schema.errors(obj, schemas[kind]) == [], kind
        assert obj["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert set(objects["ClusterTrainingRuntime"]["metadata"]) == {"name", "labels"}  # cluster
    assert set(objects["TrainJob"]["metadata"]) == {"name", "namespace", "labels"}
    template = objects["ClusterTrainingRuntime"]["spec"]["template"]
    as_jobset = {"apiVersion": jobset.API_VERSION, "kind": "JobSet",
                 "metadata": {"name": "ctr-run-7"}, "spec": template["spec"]}
    assert crd_schema.errors(as_jobset, schemas["JobSet"]) == []


def test_the_runtimes_template_is_jobset_v0_12_0s_spec_and_strictness_holds(schemas):
    runtime_template = schemas["ClusterTrainingRuntime"]["properties"]["spec"]["properties"][
        "template"]["properties"]["spec"]
    assert runtime_template == schemas["JobSet"]["properties"]["spec"]
    objects, _ = rendered(job())
    runtime, train_job = objects["ClusterTrainingRuntime"], objects["TrainJob"]
    typo = copy.deepcopy(runtime)
    typo["spec"]["mlPolicy"]["tensorflow"] = {}  # no such policy: the server would drop it
    deep = copy.deepcopy(runtime)
    replicated_job(deep["spec"]["template"], "chief")["template"]["spec"]["template"]["spec"][
        "containers"][0]["arg"] = ["python"]
    misspelt = copy.deepcopy(train_job)
    misspelt["spec"]["trainer"]["numNode"] = 1
    assert crd_schema.errors(typo, schemas["ClusterTrainingRuntime"]) == [
        "spec.mlPolicy: Additional properties are not allowed ('tensorflow' was unexpected)"]
    [error] = crd_schema.errors(deep, schemas["ClusterTrainingRuntime"])
    assert "'arg' was unexpected" in error
    assert crd_schema.errors(misspelt, schemas["TrainJob"]) == [
        "spec.trainer: Additional properties are not allowed ('numNode' was unexpected)"]


def test_what_trainers_webhooks_and_cel_rules_check():
    """The checks of Trainer's runtime webhook and CRD CEL rules that a schema cannot make."""
    objects, _ = rendered(job(name="a" * 40), train_job_name="b" * 40)
    runtime, train_job = objects["ClusterTrainingRuntime"], objects["TrainJob"]
    rjobs = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    ancestors = {r["name"]: r["template"]["metadata"]["labels"].get(ANCESTOR) for r in rjobs}
    assert ancestors == {"ps": None, "worker": None, "chief": "trainer", "evaluator": None}
    chief = replicated_job(runtime["spec"]["template"], "chief")
    assert chief["replicas"] == 1  # the webhook: an ancestor's replicated job has 1 replica
    pod = chief["template"]["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["node"]  # ... and the trainer a `node`
    policy = runtime["spec"]["mlPolicy"]
    assert policy == {"numNodes": 1}  # no torch, mpi, jax, xgboost, flux: Trainer's PlainML
    assert "podGroupPolicy" not in runtime["spec"]
    assert runtime["metadata"]["labels"][trainer_runtime.FRAMEWORK_LABEL] == "tensorflow"
    name = train_job["metadata"]["name"]  # the TrainJob's CEL rules
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63
    assert train_job["spec"]["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime", "name": "a" * 40}
    assert "managedBy" not in train_job["spec"] and "runtimePatches" not in train_job["spec"]
    # JobSet: the subdomain is its name (the TrainJob's), a DNS-1035 label; the longest pod name
    # with the Job controller's suffix is a DNS-1035 label too.
    assert "subdomain" not in runtime["spec"]["template"]["spec"]["network"]
    for rjob in rjobs:
        longest = f"{name}-{rjob['name']}-{rjob['replicas'] - 1}-0-abcde"
        assert len(longest) <= 63 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", longest)
        # Kubernetes: a podFailurePolicy names a container of the pod.
        spec = rjob["template"]["spec"]
        containers = {c["name"] for c in spec["template"]["spec"]["containers"]}
        for rule in spec.get("podFailurePolicy", {}).get("rules", []):
            if "onExitCodes" in rule:
                assert rule["onExitCodes"]["containerName"] in containers


def test_every_job_a_train_job_makes_and_its_objects_pass_the_kubernetes_schema():
    objects, everything = rendered(job())
    built = trainer_builds(objects["TrainJob"], objects["ClusterTrainingRuntime"])
    assert [o["kind"] for o in everything[2:]] == [
        "PodDisruptionBudget", "PodDisruptionBudget", "NetworkPolicy"]
    created = list(pods_of(built))
    assert len(created) == 2 + 4 + 1 + 1
    for version in K8S_VERSIONS:
        for obj in [c[0] for c in created] + everything[2:]:
            kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("kwargs", CONFIGS.values(), ids=CONFIGS.keys())
def test_each_pod_is_its_task_and_every_tf_config_names_every_task(kwargs):
    """The runtime names no job: each pod names the TrainJob's tasks from its own labels."""
    config = job(**kwargs)
    objects, _ = rendered(config, "ctr-run-7")
    train_job = objects["TrainJob"]
    train_job["metadata"]["namespace"] = "team-a"  # any namespace
    seen = []
    for created, pod, container, env, command in pods_of(
            trainer_builds(train_job, objects["ClusterTrainingRuntime"])):
        parsed = ClusterConfig.from_tf_config(env["TF_CONFIG"])
        task = (parsed.task_type, parsed.task_index)
        seen.append(task)
        index = int(created["metadata"]["labels"][jobset.JOB_INDEX_LABEL])
        assert task == (pod["metadata"]["labels"]["kfit-ps/type"], index)
        assert env["KFIT_PS_JOB"] == "ctr-run-7"  # the `job` label of its metrics
        if task[0] != "evaluator":
            assert command[:4] == ["kfit-ps", "run", "--tasks", f"{task[0]}:{index}"]
        hostname = f"{created['metadata']['name']}-0.{pod['spec']['subdomain']}"
        assert parsed.cluster[task[0]][index] == f"{hostname}.team-a.svc:2222"
        for kind, addresses in parsed.cluster.items():
            assert list(addresses) == [f"ctr-run-7-{kind}-{i}-0.ctr-run-7.team-a.svc:2222"
                                       for i in range(len(addresses))]
    assert sorted(seen) == sorted(config.tasks())  # every task exactly once


def test_a_train_jobs_trainer_lands_in_the_chiefs_container_alone():
    config = job()
    objects, _ = rendered(config)
    runtime, train_job = objects["ClusterTrainingRuntime"], objects["TrainJob"]
    assert train_job["spec"]["trainer"] == {"args": ["python", "/app/t.py"]}
    train_job["spec"]["trainer"] = {
        "image": "registry.example/ctr:2", "args": ["python", "/app/other.py", "--epochs", "3"],
        "env": [{"name": "EPOCHS", "value": "3"}],
        "resourcesPerNode": {"requests": {"cpu": "4"}, "limits": {"memory": "8Gi"}}}
    built = trainer_builds(train_job, runtime)
    before = {r["name"]: r for r in runtime["spec"]["template"]["spec"]["replicatedJobs"]}
    for rjob in built["spec"]["replicatedJobs"]:
        if rjob["name"] != "chief":
            assert rjob == before[rjob["name"]]  # the servers and the evaluator: untouched
    pods = {p[1]["metadata"]["labels"]["kfit-ps/type"]: p for p in pods_of(built)}
    _, _, container, env, command = pods["chief"]
    assert container["name"] == "node" and container["image"] == "registry.example/ctr:2"
    launcher = manifests.launcher_command(config, "chief", 0)
    assert command == launcher[:-2] + ["python", "/app/other.py", "--epochs", "3"]
    assert launcher[-3:] == ["--", "python", "/app/t.py"]
    assert env["EPOCHS"] == "3" and "TF_CONFIG" in env
    assert container["resources"] == {"requests": {"cpu": "4", "memory": "2Gi"},
                                      "limits": {"memory": "8Gi"}}
    for task_type in ("worker", "ps"):
        assert pods[task_type][2]["image"] == "registry.example/ctr:1"
        assert "EPOCHS" not in pods[task_type][3]


def test_a_second_chief_pod_from_num_nodes_fails_the_train_job(capsys):
    """`trainer.numNodes: 2` gives the chief's Job two pods; the second is `chief:1`, in no
    TF_CONFIG: its launcher refuses to start (status 2), a program error that fails the Job
    and the JobSet, rather than two chiefs on the same servers."""
    objects, _ = rendered(job())
    train_job = objects["TrainJob"]
    train_job["spec"]["trainer"]["numNodes"] = 2
    built = trainer_builds(train_job, objects["ClusterTrainingRuntime"])
    chiefs = [p for p in pods_of(built) if p[0]["metadata"]["name"] == "ctr-run-7-chief-0"]
    assert len(chiefs) == 2
    _, _, _, env, command = chiefs[1]
    with pytest.raises(ValueError, match=r'"task.index" 1 is out of range for task type'):
        ClusterConfig.from_tf_config(env["TF_CONFIG"])
    assert command[:4] == ["kfit-ps", "run", "--tasks", "chief:1"]
    with pytest.raises(SystemExit) as stopped:
        main(["run", "--tasks", "chief:1", "--", "true"])
    assert stopped.value.code == 2 and "has no 'chief:0'" in capsys.readouterr().err
    chief = replicated_job(built, "chief")["template"]["spec"]
    assert job_decision(chief, "node", 2) == ("Failed", "PodFailurePolicy")
    assert jobset_action(built, [("chief", "PodFailurePolicy")]) == (
        "FailJobSet", "program_error")


def test_the_runtime_is_the_jobset_form_but_for_names_labels_and_the_trainer():
    """Equal to the JobSet form once the names, labels and the trainer's container are put
    back: the same pods, Jobs, start-up order, success and failure handling (which
    `tests/test_jobset.py` evaluates for each failure)."""
    config = job(grace=25, ttl_after_finished=600)
    form = jobset.jobset(config)["spec"]
    spec = copy.deepcopy(trainer_runtime.runtime(config)["spec"]["template"]["spec"])
    assert form["network"].pop("subdomain") == "ctr"
    for rjob in spec["replicatedJobs"]:
        template = rjob["template"]
        assert template["metadata"]["labels"].pop(ANCESTOR, None) == (
            "trainer" if rjob["name"] == "chief" else None)
        pod = template["spec"]["template"]
        for labels in (template["metadata"]["labels"], pod["metadata"]["labels"]):
            labels[manifests.LABEL] = labels.pop(trainer_runtime.RUNTIME_LABEL)
        [container] = pod["spec"]["containers"]
        env = [e["name"] for e in container.pop("env")]
        index = ["KFIT_PS_TASK_INDEX"] if rjob["name"] != "evaluator" else []
        assert env == index + ["KFIT_PS_JOB", "KFIT_PS_NAMESPACE", "TF_CONFIG",
                               "PYTHONUNBUFFERED"]
        if rjob["name"] == "chief":
            container["name"] = "chief"
            container["command"] = [c.replace("$(KFIT_PS_TASK_INDEX)", "0") for c in
                                    container["command"] + container.pop("args")]
            for rule in template["spec"]["podFailurePolicy"]["rules"]:
                if "onExitCodes" in rule:
                    rule["onExitCodes"]["containerName"] = "chief"
    for rjob in form["replicatedJobs"]:
        rjob["template"]["spec"]["template"]["spec"]["containers"][0].pop("env")
    assert spec == form


def test_the_train_jobs_budgets_and_network_policy_select_its_pods_alone():
    objects, everything = rendered(job())
    built = trainer_builds(objects["TrainJob"], objects["ClusterTrainingRuntime"])
    pods = {p[1]["metadata"]["labels"]["kfit-ps/type"]: p[1]["metadata"]["labels"]
            for p in pods_of(built)}
    other = trainer_builds(dict(objects["TrainJob"], metadata=dict(
        objects["TrainJob"]["metadata"], name="other")), objects["ClusterTrainingRuntime"])
    others = [p[1]["metadata"]["labels"] for p in pods_of(other)]
    for obj in everything[2:]:
        assert obj["metadata"]["labels"][manifests.LABEL] == "ctr-run-7"  # for cleanup
        selector = (obj["spec"]["selector"] if obj["kind"] == "PodDisruptionBudget"
                    else obj["spec"]["podSelector"])["matchLabels"]
        selected = [t for t, labels in pods.items() if selector.items() <= labels.items()]
        assert selected == ([obj["metadata"]["labels"]["kfit-ps/type"]]
                            if obj["kind"] == "PodDisruptionBudget" else list(pods))
        assert not any(selector.items() <= labels.items() for labels in others)
    [policy] = [o for o in everything if o["kind"] == "NetworkPolicy"]
    peers = [p["podSelector"] for rule in policy["spec"]["ingress"] for p in rule["from"]
             if "namespaceSelector" not in p]
    assert peers == [policy["spec"]["podSelector"]] * 2


def test_cli_renders_the_runtime_and_names_a_bad_combination(capsys, schemas):
    argv = ["manifests", "--format", "trainer-runtime", "--name", "kfit-ctr", "--image",
            "img:1", "--workers", "3", "--namespace", "ml", "--train-job", "ctr-run-2",
            "--ttl-after-finished", "60", "--", "python", "/app/train.py"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    objects = list(yaml.safe_load_all(out))
    assert [o["kind"] for o in objects] == [
        "ClusterTrainingRuntime", "TrainJob", "PodDisruptionBudget", "PodDisruptionBudget",
        "NetworkPolicy"]
    assert out.startswith("# kfit_ps's Kubeflow Trainer v2 runtime")
    assert "\n---\n# A TrainJob on it. `trainer.args` is the chief's script" in out
    runtime, train_job = objects[:2]
    for obj in objects[:2]:
        assert crd_schema.errors(obj, schemas[obj["kind"]]) == []
    assert runtime["metadata"]["name"] == "kfit-ctr"
    assert runtime["spec"]["template"]["spec"]["ttlSecondsAfterFinished"] == 60
    assert replicated_job(runtime["spec"]["template"], "worker")["replicas"] == 3
    assert train_job["metadata"] == {"name": "ctr-run-2", "namespace": "ml", "labels": {
        manifests.LABEL: "ctr-run-2", "app.kubernetes.io/managed-by": "kfit-ps"}}
    assert train_job["spec"]["trainer"]["args"] == ["python", "/app/train.py"]
    for bad, fragment in (
            (["--format", "jobset", "--train-job", "r1"],
             "--train-job: names the TrainJob of a Kubeflow Trainer runtime: pass it with "
             "--format trainer-runtime"),
            (["--ttl-after-finished", "60"], "pass it with --format jobset or trainer-runtime"),
            (["--format", "trainer-runtime", "--train-job", "Run_1"],
             "the TrainJob's name (--train-job) must be a DNS label"),
            (["--format", "trainer"], "'trainer-runtime' (a Kubeflow Trainer v2")):
        with pytest.raises(SystemExit) as stopped:
            main(["manifests", *bad, "--name", "x", "--image", "i", "--", "python", "t.py"])
        error = capsys.readouterr().err
        assert stopped.value.code == 2 and fragment in error and "Received: " in error
