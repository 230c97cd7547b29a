"""TF_CONFIG parsing and validation (no servers needed)."""

import json

import pytest

from kfit_ps.cluster.spec import ClusterConfig

GOOD = {"cluster": {"chief": ["c:1"], "worker": ["w0:1", "w1:1"], "ps": ["p0:1"]},
        "task": {"type": "worker", "index": 1}}


def tf_config(**changes):
    data = json.loads(json.dumps(GOOD))
    for key, value in changes.items():
        data[key] = value
    return json.dumps(data)


def test_parses_and_round_trips():
    config = ClusterConfig.from_tf_config(json.dumps(GOOD))
    assert config.task_type == "worker" and config.task_index == 1
    assert config.num_tasks("worker") == 2
    assert config.address("ps", 0) == "p0:1"
    assert json.loads(config.to_tf_config()) == GOOD
    resolver = config.cluster_resolver()
    assert resolver.cluster_spec().as_dict() == GOOD["cluster"]
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)


def test_reads_environment(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps(GOOD))
    assert ClusterConfig.from_tf_config().address("worker", 0) == "w0:1"


def test_evaluator_is_outside_the_training_cluster():
    data = json.loads(json.dumps(GOOD))
    data["cluster"]["evaluator"] = ["e:1"]
    data["task"] = {"type": "evaluator", "index": 0}
    config = ClusterConfig.from_tf_config(json.dumps(data))
    assert "evaluator" not in config.training_cluster()
    assert "evaluator" not in config.cluster_resolver().cluster_spec().as_dict()


@pytest.mark.parametrize("raw, fragment", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", 'with a "cluster" key'),
    (tf_config(cluster={"worker": ["w:1"], "ps": ["p:1"], "gpu": ["g:1"]}),
     "unknown task type 'gpu'"),
    (tf_config(cluster={"ps": ["p:1"]}), "no 'worker' task"),
    (tf_config(cluster={"worker": ["w:1"]}), "no 'ps' task"),
    (tf_config(cluster={"worker": ["w:1"], "ps": ["w:1"]}), "appears twice"),
    (tf_config(cluster={"worker": ["nohostport"], "ps": ["p:1"]}), '"host:port"'),
    (tf_config(cluster={"worker": ["w:99999"], "ps": ["p:1"]}), "no valid port"),
    (tf_config(cluster={"worker": "w:1", "ps": ["p:1"]}), "must be a list"),
    (tf_config(cluster={"worker": ["w:1"], "ps": ["p:1"], "chief": ["a:1", "b:1"]}),
     "at most one"),
    (tf_config(task={"type": "worker", "index": 2}), "out of range"),
    (tf_config(task={"type": "worker", "index": -1}), "out of range"),
    (tf_config(task={"type": "master", "index": 0}), "unknown task type 'master'"),
    (tf_config(task={"type": "worker", "index": "0"}), "must be an integer"),
])
def test_invalid_tf_config_names_tf_config_and_fix(raw, fragment):
    with pytest.raises(ValueError) as info:
        ClusterConfig.from_tf_config(raw)
    message = str(info.value)
    assert "TF_CONFIG" in message
    assert fragment in message


def test_unset_tf_config(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match="TF_CONFIG is not set"):
        ClusterConfig.from_tf_config()


def test_repr_shows_cluster_and_task():
    assert repr(ClusterConfig.from_tf_config(json.dumps(GOOD))) == (
        "ClusterConfig(chief=['c:1'], worker=['w0:1', 'w1:1'], ps=['p0:1'], task=worker:1)")
