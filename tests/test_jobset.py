"""`kfit-ps manifests --format jobset`: a JobSet valid against JobSet v0.12.0's CRD, pods
valid against Kubernetes, every task by its JobSet name, and failures handled as documented."""

import copy
import hashlib
import json
import os
import re

import kubernetes_validate
import pytest
import yaml

from kfit_ps import ClusterConfig, exit_status
from kfit_ps.cli.main import main
from kfit_ps.launch import jobset, manifests
from tests import crd_schema
from tests.jobset_policy import SCENARIOS, jobset_action, outcome, replicated_job
from tests.test_manifests import K8S_VERSIONS, expand, job

SCHEMA_FILE = "jobset-v0.12.0-v1alpha2.schema.json"
# The steering repo's copy of the CRD (`shared/k8s/README.md`), beside this checkout.
UPSTREAM_CRD = os.path.join(os.path.dirname(crd_schema.DATA), "..", "..", "shared", "k8s",
                            "jobset.x-k8s.io_jobsets-v0.12.0.yaml")


@pytest.fixture(scope="module")
def schema():
    stored = crd_schema.load(SCHEMA_FILE)
    assert (stored["release"], stored["version"]) == ("v0.12.0", "v1alpha2")
    return stored["openAPIV3Schema"]


def the_jobset(config):
    [obj] = [o for o in jobset.render(config) if o["kind"] == "JobSet"]
    return obj


CONFIGS = {"evaluator, claim": dict(),
           "no evaluator, no claim, a TTL": dict(evaluator_command=None, claim=None,
                                                 ttl_after_finished=3600),
           "one ps, one worker": dict(num_ps=1, num_workers=1, evaluator_command=None)}


@pytest.mark.parametrize("kwargs", CONFIGS.values(), ids=CONFIGS.keys())
def test_the_jobset_passes_the_crd_schema_strictly(schema, kwargs):
    obj = the_jobset(job(**kwargs))
    assert crd_schema.errors(obj, schema) == []
    assert obj["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and obj["kind"] == "JobSet"
    assert set(obj["metadata"]) == {"name", "namespace", "labels"}  # ObjectMeta: not in the CRD


def test_strict_validation_catches_an_unknown_field_and_a_bad_value(schema):
    obj = the_jobset(job())
    typo = copy.deepcopy(obj)
    typo["spec"]["failurePolicy"]["maxRestart"] = 3  # the API server would drop it silently
    deep = copy.deepcopy(obj)
    deep["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0][
        "readinessProbe"]["periodSecond"] = 5
    bad = copy.deepcopy(obj)
    bad["spec"]["failurePolicy"]["rules"][0]["action"] = "RestartPod"
    assert crd_schema.errors(typo, schema) == [
        "spec.failurePolicy: Additional properties are not allowed ('maxRestart' was "
        "unexpected)"]
    [error] = crd_schema.errors(deep, schema)
    assert "readinessProbe" in error and "'periodSecond' was unexpected" in error
    [error] = crd_schema.errors(bad, schema)
    assert error.startswith("spec.failurePolicy.rules.0.action: 'RestartPod' is not one of")


# sha256 of JobSet v0.12.0's CRD file (config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml)
# and of the stored schema (its v1alpha2 `openAPIV3Schema` without descriptions, as sorted JSON).
UPSTREAM_SHA256 = "d022b87624512cf0b6741b31b24a2bea9945b5a838b50713af29332c878bb6fe"
STORED_SHA256 = "22987be4c091f4cc7baad4aa53702e70c652689559c5706339bc5de24eba0280"


def test_the_stored_schema_is_the_v0_12_0_crd_without_descriptions():
    """The stored schema is the one derived from the v0.12.0 CRD: checked against its digest
    everywhere, and derived again from the CRD where a copy of the file is at hand."""
    stored = crd_schema.load(SCHEMA_FILE)["openAPIV3Schema"]
    digest = hashlib.sha256(json.dumps(stored, sort_keys=True).encode()).hexdigest()
    assert digest == STORED_SHA256
    if not os.path.exists(UPSTREAM_CRD):  # (the steering repository's copy, next to a checkout)
        return
    with open(UPSTREAM_CRD, "rb") as f:
        raw = f.read()
    assert hashlib.sha256(raw).hexdigest() == UPSTREAM_SHA256
    [version] = [v for v in yaml.safe_load(raw)["spec"]["versions"] if v["name"] == "v1alpha2"]

    def without_descriptions(node):
        if isinstance(node, dict):
            return {k: without_descriptions(v) for k, v in node.items() if k != "description"}
        return [without_descriptions(v) for v in node] if isinstance(node, list) else node

    assert stored == without_descriptions(version["schema"]["openAPIV3Schema"])


def test_what_jobsets_webhook_and_cel_rules_check():
    """The checks of JobSet's admission webhook and CRD CEL rule that the schema cannot make."""
    obj = the_jobset(job(name="a" * 40, num_workers=1000))
    spec = obj["spec"]
    names = [j["name"] for j in spec["replicatedJobs"]]
    assert "startupPolicy" not in spec  # `InOrder` and `dependsOn` exclude each other (CEL)
    assert "dependsOn" not in spec["replicatedJobs"][0]
    for position, rjob in enumerate(spec["replicatedJobs"]):
        for dependency in rjob.get("dependsOn", []):
            assert len(rjob["dependsOn"]) == 1 and dependency["name"] in names[:position]
        # The longest pod name JobSet makes, with the Job controller's suffix: a DNS-1035 label.
        pod = f"{obj['metadata']['name']}-{rjob['name']}-{rjob['replicas'] - 1}-0-abcde"
        assert len(pod) <= 63 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", pod)
    rules = spec["failurePolicy"]["rules"]
    assert len({r["name"] for r in rules}) == len(rules)
    for rule in rules:
        assert re.fullmatch(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?", rule["name"])
        assert set(rule.get("targetReplicatedJobs", [])) <= set(names)
        assert set(rule.get("onJobFailureReasons", [])) <= {
            "BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes",
            "MaxFailedIndexesExceeded", "PodFailurePolicy"}
        assert rule["action"] in ("FailJobSet", "RestartJobSet")  # no gated RestartJob
    assert set(spec["successPolicy"]["targetReplicatedJobs"]) <= set(names)
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", spec["network"]["subdomain"])


def jobs_as_jobset_creates_them(obj):
    """The Jobs JobSet creates from `obj` (its labels, the pods' subdomain): (index, Job)."""
    name, namespace = obj["metadata"]["name"], obj["metadata"]["namespace"]
    for rjob in obj["spec"]["replicatedJobs"]:
        for index in range(rjob["replicas"]):
            labels = {"jobset.sigs.k8s.io/jobset-name": name,
                      "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"],
                      jobset.JOB_INDEX_LABEL: str(index),
                      "jobset.sigs.k8s.io/restart-attempt": "0"}
            spec = copy.deepcopy(rjob["template"]["spec"])
            spec["template"]["metadata"]["labels"].update(labels)
            spec["template"]["spec"]["subdomain"] = obj["spec"]["network"]["subdomain"]
            metadata = dict(rjob["template"]["metadata"], name=f"{name}-{rjob['name']}-{index}",
                            namespace=namespace)
            metadata["labels"] = dict(metadata["labels"], **labels)
            yield index, {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata,
                          "spec": spec}


def test_every_job_and_object_passes_the_kubernetes_schema():
    objects = jobset.render(job())
    assert [o["kind"] for o in objects] == [
        "JobSet", "PodDisruptionBudget", "PodDisruptionBudget", "NetworkPolicy"]
    jobs = [j for _, j in jobs_as_jobset_creates_them(objects[0])]
    assert len(jobs) == 2 + 4 + 1 + 1
    for version in K8S_VERSIONS:
        for obj in jobs + objects[1:]:
            kubernetes_validate.validate(obj, version, strict=True)


def test_each_pod_is_its_task_and_names_every_task_by_its_jobset_name():
    config = job()
    obj = the_jobset(config)
    seen = []
    for index, created in jobs_as_jobset_creates_them(obj):
        pod = created["spec"]["template"]
        [container] = pod["spec"]["containers"]
        label = {}  # The downward API: an env var from the pod's label.
        for e in container["env"]:
            if "valueFrom" in e:
                key = re.fullmatch(r"metadata\.labels\['(.+)'\]",
                                   e["valueFrom"]["fieldRef"]["fieldPath"]).group(1)
                label[e["name"]] = pod["metadata"]["labels"][key]
        env = {e["name"]: expand(e["value"], label) for e in container["env"] if "value" in e}
        parsed = ClusterConfig.from_tf_config(env["TF_CONFIG"])
        task = (parsed.task_type, parsed.task_index)
        seen.append(task)
        assert task == (created["metadata"]["labels"]["kfit-ps/type"], index)
        if task[0] != "evaluator":
            command = [expand(c, label) for c in container["command"]]
            assert command[:4] == ["kfit-ps", "run", "--tasks", f"{task[0]}:{index}"]
        # The Job controller names an Indexed Job's pod `<job>-<index>`, in the subdomain.
        hostname = f"{created['metadata']['name']}-0.{pod['spec']['subdomain']}"
        assert parsed.cluster[task[0]][index] == f"{hostname}.ml.svc:2222"
        for kind, addresses in parsed.cluster.items():
            assert list(addresses) == [f"ctr-{kind}-{i}-0.ctr.ml.svc:2222" for i in range(
                len(addresses))]
    assert sorted(seen) == sorted(config.tasks())  # every task exactly once


def test_pods_are_those_of_the_statefulset_form():
    """Probes, requests, security context, no token, volume, scrape annotations: the same."""
    config = job(grace=25)
    forms = {}
    for obj in manifests.render(config):
        if obj["kind"] in ("StatefulSet", "Job"):
            forms[obj["spec"]["template"]["spec"]["containers"][0]["name"]] = [
                obj["spec"]["template"]]
    for rjob in the_jobset(config)["spec"]["replicatedJobs"]:
        forms[rjob["name"]].append(rjob["template"]["spec"]["template"])
    for task_type, (before, now) in forms.items():
        before, now = copy.deepcopy(before), copy.deepcopy(now)
        for template in (before, now):
            [container] = template["spec"]["containers"]
            container["env"] = [e for e in container["env"]  # the names and the index label
                                if e["name"] not in ("TF_CONFIG", "KFIT_PS_TASK_INDEX")]
            template["spec"].pop("restartPolicy")
        assert now == before, task_type
    chief = replicated_job(the_jobset(config), "chief")["template"]["spec"]
    assert chief["template"]["spec"]["terminationGracePeriodSeconds"] == 35
    assert chief["podFailurePolicy"] == {"rules": exit_status.pod_failure_rules("chief")}


def test_one_pod_per_task_started_in_order_and_restarted_whole():
    config = job(max_restarts=5, backoff_limit=4)
    spec = the_jobset(config)["spec"]
    for rjob in spec["replicatedJobs"]:
        template = rjob["template"]["spec"]
        assert (template["parallelism"], template["completions"]) == (1, 1)
        assert template["completionMode"] == "Indexed"
        assert template["podReplacementPolicy"] == "Failed"  # never two pods of one task
        restart = "OnFailure" if rjob["name"] == "evaluator" else "Never"
        assert template["template"]["spec"]["restartPolicy"] == restart
        limit = 4 if rjob["name"] == "chief" else jobset.SERVER_BACKOFF_LIMIT
        assert template["backoffLimit"] == limit
    assert [(j["name"], j["replicas"], j.get("dependsOn")) for j in spec["replicatedJobs"]] == [
        ("ps", 2, None), ("worker", 4, [{"name": "ps", "status": "Ready"}]),
        ("chief", 1, [{"name": "worker", "status": "Ready"}]), ("evaluator", 1, None)]
    assert spec["network"] == {"enableDNSHostnames": True, "subdomain": "ctr",
                               "publishNotReadyAddresses": True}
    assert spec["successPolicy"] == {"operator": "All",
                                     "targetReplicatedJobs": ["chief", "evaluator"]}
    assert spec["failurePolicy"]["maxRestarts"] == 5
    assert spec["failurePolicy"]["restartStrategy"] == "BlockingRecreate"
    assert "ttlSecondsAfterFinished" not in spec
    assert the_jobset(job(ttl_after_finished=600))["spec"]["ttlSecondsAfterFinished"] == 600
    no_evaluator = the_jobset(job(evaluator_command=None))["spec"]
    assert no_evaluator["successPolicy"]["targetReplicatedJobs"] == ["chief"]
    assert [r["name"] for r in no_evaluator["failurePolicy"]["rules"]] == [
        "program_error", "retries_spent"]


NOTHING = None  # The JobSet takes no action: its Jobs run on.
EXPECTED = {
    "the chief's script finished, the evaluator done": (("Complete", None), "Completed"),
    "the chief's script finished, the evaluator still evaluating": (("Complete", None),
                                                                     NOTHING),
    "the chief's program failed (an exception)": (("Failed", "PodFailurePolicy"),
                                                  ("FailJobSet", "program_error")),
    "the chief's launcher spent its restarts": (("Failed", "PodFailurePolicy"),
                                                ("FailJobSet", "program_error")),
    "a cluster loss the chief's launcher could not ride out": (("Count", None), NOTHING),
    "... for the 7th time (backoffLimit 6 spent)": (("Failed", "BackoffLimitExceeded"),
                                                    ("RestartJobSet", "retries_spent")),
    "... and the JobSet restarted 3 times already": (("Failed", "BackoffLimitExceeded"),
                                                     ("ReachedMaxRestarts", "retries_spent")),
    "SIGTERM of the chief during a drain": (("Ignore", None), NOTHING),
    "the chief OOM-killed (SIGKILL)": (("Count", None), NOTHING),
    "a worker pod OOM-killed": (("Count", None), NOTHING),
    "a worker's launcher spent its restarts": (("Count", None), NOTHING),
    "a worker pod failing the 101st time": (("Failed", "BackoffLimitExceeded"),
                                            ("RestartJobSet", "retries_spent")),
    "a worker drained": (("Ignore", None), NOTHING),
    "a worker's launcher failed (a bad flag)": (("Failed", "PodFailurePolicy"),
                                                ("FailJobSet", "program_error")),
    "a ps pod OOM-killed": (("Count", None), NOTHING),
    "the evaluator failed": (("Count", None), NOTHING),
    "the evaluator failing the 101st time": (("Failed", "BackoffLimitExceeded"),
                                             ("FailJobSet", "evaluator_failed")),
}


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.case for s in SCENARIOS])
def test_failures_follow_the_exit_status_table_under_jobsets_rule_order(scenario):
    assert set(EXPECTED) == {s.case for s in SCENARIOS}
    assert outcome(the_jobset(job()), scenario) == EXPECTED[scenario.case]


def test_the_first_matching_rule_wins_over_every_failed_job():
    """A program error anywhere fails the JobSet even when another Job's retries are spent."""
    obj = the_jobset(job())
    failed = [("worker", "BackoffLimitExceeded"), ("chief", "PodFailurePolicy")]
    assert jobset_action(obj, failed) == ("FailJobSet", "program_error")
    # No rule names this reason: JobSet's default.
    assert jobset_action(obj, [("chief", "DeadlineExceeded")]) == ("RestartJobSet", None)


def test_budgets_and_network_policy_select_the_jobset_pods():
    config = job()
    objects = jobset.render(config)
    pods = {r["name"]: r["template"]["spec"]["template"]["metadata"]["labels"]
            for r in objects[0]["spec"]["replicatedJobs"]}
    budgets = {o["metadata"]["name"]: o["spec"] for o in objects
               if o["kind"] == "PodDisruptionBudget"}
    # Pods of Jobs (no scale subresource): only an integer minAvailable is honoured.
    assert budgets["ctr-worker"]["minAvailable"] == 3 and budgets["ctr-ps"]["minAvailable"] == 1
    for name, budget in budgets.items():
        task_type = name.removeprefix("ctr-")
        assert "maxUnavailable" not in budget
        assert budget["selector"]["matchLabels"].items() <= pods[task_type].items()
    [policy] = [o for o in objects if o["kind"] == "NetworkPolicy"]
    [before] = [o for o in manifests.render(config) if o["kind"] == "NetworkPolicy"]
    assert policy == before
    for labels in pods.values():
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()


def test_cli_renders_the_jobset_and_names_a_bad_format(capsys):
    argv = ["manifests", "--format", "jobset", "--name", "demo", "--image", "img:1",
            "--workers", "3", "--claim", "ckpt", "--ttl-after-finished", "60", "--", "python",
            "/app/train.py"]
    assert main(argv) == 0
    objects = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [o["kind"] for o in objects] == [
        "JobSet", "PodDisruptionBudget", "PodDisruptionBudget", "NetworkPolicy"]
    assert crd_schema.errors(objects[0], crd_schema.load(SCHEMA_FILE)["openAPIV3Schema"]) == []
    assert objects[0]["spec"]["ttlSecondsAfterFinished"] == 60
    assert replicated_job(objects[0], "worker")["replicas"] == 3
    for bad, fragment in ((["--format", "jobsets"], "--format: must be 'jobset'"),
                          (["--ttl-after-finished", "60"], "pass it with --format jobset")):
        with pytest.raises(SystemExit) as stopped:
            main(["manifests", *bad, "--name", "x", "--image", "i", "--", "python", "t.py"])
        error = capsys.readouterr().err
        assert stopped.value.code == 2 and fragment in error and "Received: " in error
