"""ParameterServerStrategy: the seed's placement contract, validation, atomic updates."""

import json
import socket
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import kfit_ps
from kfit_ps import _tf_compat
from tests import helpers


def resolver(cluster, task_type="chief"):
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type=task_type, task_id=0, rpc_layer="grpc")


@pytest.mark.slow
def test_seed_placement_example_with_three_ps():
    result = helpers.run_chief("""
        with kfit_ps.LocalCluster(num_workers=1, num_ps=3) as cluster:
            strategy = kfit_ps.ParameterServerStrategy(cluster.cluster_resolver)
            v1 = tf.Variable(initial_value=0.0)
            with strategy.scope():
                tf_vars = [tf.Variable(initial_value=float(i)) for i in range(1, 5)]
                keras_vars = [keras.Variable(float(i)) for i in range(3)]
            report(outside=v1.device, inside=[v.device for v in tf_vars],
                   keras=[_v._value.device for _v in keras_vars],
                   is_tf_pss=isinstance(strategy, tf.distribute.ParameterServerStrategy),
                   values=[float(v.numpy()) for v in tf_vars])
        os._exit(0)
    """)
    assert result["is_tf_pss"]
    assert result["outside"] == "/job:chief/replica:0/task:0/device:CPU:0"
    assert result["inside"] == [
        "/job:ps/replica:0/task:0/device:CPU:0",
        "/job:ps/replica:0/task:1/device:CPU:0",
        "/job:ps/replica:0/task:2/device:CPU:0",
        "/job:ps/replica:0/task:0/device:CPU:0",
    ]
    # Keras variables continue the same round robin.
    assert result["keras"] == [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in (1, 2, 0)]
    assert result["values"] == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("cluster, fragment", [
    ({"chief": ["localhost:1"], "worker": ["localhost:2"]}, "no 'ps' task"),
    ({"chief": ["localhost:1"], "ps": ["localhost:2"]}, "no 'worker' task"),
    ({"chief": ["localhost:1"], "worker": ["localhost:2"], "ps": ["localhost:3"],
      "gpu": ["localhost:4"]}, "task type(s) ['gpu']"),
])
def test_invalid_clusters_are_value_errors(cluster, fragment):
    with pytest.raises(ValueError) as info:
        kfit_ps.ParameterServerStrategy(resolver(cluster))
    assert fragment in str(info.value)
    assert "Received cluster spec" in str(info.value)


def _listening(count):
    """`count` loopback sockets that listen and never accept: a connection would queue."""
    sockets = []
    for _ in range(count):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        sock.setblocking(False)
        sockets.append(sock)
    return sockets, [f"127.0.0.1:{s.getsockname()[1]}" for s in sockets]


@pytest.mark.parametrize("shape, task, rule", [
    ({"chief": 3, "worker": 1, "ps": 1}, ("chief", 0), '"cluster.chief" has 3 addresses; at most '
     "one is allowed"),
    ({"chief": 1, "ps": 1}, ("chief", 0), "no 'worker' task"),
    ({"chief": 1, "worker": 2}, ("chief", 0), "no 'ps' task"),
    ({"chief": 1, "worker": 1, "ps": 1}, ("chief", 1), '"task.index" 1 is out of range for task '
     "type 'chief'"),
    ({"worker": 1, "ps": 1}, ("chief", 0), "out of range for task type 'chief', which has 0"),
    ({"chief": 1, "worker": 2, "ps": 1}, ("chief", 0), "appears twice"),
])
@pytest.mark.parametrize("via", ["TF_CONFIG", "cluster_resolver"])
def test_invalid_cluster_shapes_are_refused_before_any_connection(shape, task, rule, via,
                                                                   monkeypatch):
    """Each rule is checked before the strategy waits for (or connects to) any server: refused
    within 1 s, naming the rule, and no server of the cluster saw a connection."""
    sockets, addresses = _listening(sum(shape.values()))
    try:
        cluster, free = {}, iter(addresses)
        for kind, count in shape.items():
            cluster[kind] = [next(free) for _ in range(count)]
        if "appears twice" in rule:
            cluster["worker"][1] = cluster["ps"][0]
        if via == "TF_CONFIG":
            monkeypatch.setenv("TF_CONFIG", json.dumps(
                {"cluster": cluster, "task": {"type": task[0], "index": task[1]}}))
            arguments = {}
        else:
            arguments = {"cluster_resolver": tf.distribute.cluster_resolver.SimpleClusterResolver(
                tf.train.ClusterSpec(cluster), task_type=task[0], task_id=task[1],
                rpc_layer="grpc")}
        started = time.monotonic()
        with pytest.raises(ValueError) as info:
            kfit_ps.ParameterServerStrategy(**arguments)
        assert time.monotonic() - started < 1.0
        assert rule in str(info.value)
        if via == "TF_CONFIG":
            assert "TF_CONFIG" in str(info.value)
        for sock in sockets:
            with pytest.raises(BlockingIOError):
                sock.accept()  # Nothing connected.
    finally:
        for sock in sockets:
            sock.close()


def test_non_resolver_and_wrong_task_are_value_errors():
    with pytest.raises(ValueError, match="`cluster_resolver` must be a"):
        kfit_ps.ParameterServerStrategy({"worker": ["localhost:1"]})
    spec = {"chief": ["localhost:1"], "worker": ["localhost:2"], "ps": ["localhost:3"]}
    with pytest.raises(ValueError, match="runs on the chief"):
        kfit_ps.ParameterServerStrategy(resolver(spec, task_type="worker"))
    with pytest.raises(ValueError, match="variable_partitioner"):
        kfit_ps.ParameterServerStrategy(resolver(spec), variable_partitioner=3)


def test_keras_variables_under_scope_are_marked(strategy):
    outside = keras.Variable(1.0)
    with strategy.scope():
        inside = keras.Variable(1.0)
    assert _tf_compat.is_kfit_variable(inside)
    assert not _tf_compat.is_kfit_variable(outside)
    assert _tf_compat.storage(inside).device.startswith("/job:ps/")
    # Both keep Keras semantics for a single writer.
    for v in (inside, outside):
        v.assign_add(2.0)
        v.assign_sub(0.5)
        assert float(v.numpy()) == 2.5
    with pytest.raises(ValueError, match="must match"):
        inside.assign_add(np.ones(3, "float32"))


def test_concurrent_assign_add_on_ps_is_exact(strategy):
    """Many concurrent read-modify-write-prone updates from 2 workers: none lost."""
    with strategy.scope():
        counter = keras.Variable(0.0, name="counter")
        int_counter = keras.Variable(0, dtype="int64", name="int_counter")
        vector = keras.Variable(np.zeros(3, "float32"), name="vector")
    coordinator = strategy.coordinator

    @tf.function
    def bump():
        for _ in tf.range(50):
            counter.assign_add(1.0)
            int_counter.assign_add(2)
            vector.assign_sub(tf.ones(3))

    for _ in range(40):
        coordinator.schedule(bump)
    coordinator.join()
    assert float(counter.numpy()) == 2000.0
    assert int(int_counter.numpy()) == 4000
    assert vector.numpy().tolist() == [-2000.0] * 3


def test_evaluator_is_dropped_from_the_training_cluster():
    from kfit_ps.strategy.strategy import _validated_resolver

    spec = {"chief": ["localhost:1"], "worker": ["localhost:2"], "ps": ["localhost:3"]}
    plain = resolver(spec)
    assert _validated_resolver(plain) is plain
    with_evaluator = resolver(dict(spec, evaluator=["localhost:4"]))
    validated = _validated_resolver(with_evaluator)
    assert validated.cluster_spec().as_dict() == spec
    assert (validated.task_type, validated.task_id, validated.rpc_layer) == ("chief", 0, "grpc")
