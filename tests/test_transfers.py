"""Packed transfers between a worker and the ps tasks (one call per ps and dtype per step)."""

import numpy as np

from kfit_ps import constants
from kfit_ps.training.step import transfers

PS1 = "/job:ps/replica:0/task:1/device:CPU:0"


def test_send_delivers_mixed_parts_with_their_shapes(strategy):
    import tensorflow as tf

    shapes = {}

    @tf.function
    def move(n):
        parts = [tf.range(n, dtype=tf.float32), tf.ones((2, 3)), tf.constant(7, tf.int64),
                 tf.reshape(tf.range(n * 2, dtype=tf.int64), (n, 2)), tf.constant(2.5),
                 tf.zeros((0, 4)),
                 # Shapes one count cannot rebuild travel whole: two unknown dimensions; a
                 # known one of 0.
                 tf.reshape(tf.range(n * n, dtype=tf.float32), (n, n)),
                 tf.zeros((n, 0), tf.int32),
                 tf.reshape(tf.range(6 * n, dtype=tf.float32), (2, n, 3)),
                 tf.range(n, dtype=tf.int32),  # int32: counts not next to each other
                 tf.cast(tf.range(n), tf.float64),  # float64: all dynamic, consecutive
                 tf.reshape(tf.cast(tf.range(2 * n), tf.float64), (n, 2)),
                 tf.ones((n,), tf.uint8)]  # alone in its dtype
        received = transfers.send(PS1, parts)
        shapes.update({i: r.shape.as_list() for i, r in enumerate(received)})
        for r in received:
            assert PS1 in r.device, r.device
        return received

    result = strategy.coordinator.schedule(move, args=(tf.constant(3),))
    strategy.coordinator.join()
    values = [np.asarray(v) for v in result.fetch()]
    np.testing.assert_array_equal(values[0], [0.0, 1.0, 2.0])
    np.testing.assert_array_equal(values[1], np.ones((2, 3)))
    assert values[2] == 7 and values[4] == 2.5 and values[5].shape == (0, 4)
    np.testing.assert_array_equal(values[3], np.arange(6).reshape(3, 2))
    np.testing.assert_array_equal(values[6], np.arange(9).reshape(3, 3))
    assert values[7].shape == (3, 0) and values[7].dtype == np.int32
    np.testing.assert_array_equal(values[8], np.arange(18).reshape(2, 3, 3))
    np.testing.assert_array_equal(values[9], [0, 1, 2])
    np.testing.assert_array_equal(values[10], [0.0, 1.0, 2.0])
    np.testing.assert_array_equal(values[11], np.arange(6).reshape(3, 2))
    np.testing.assert_array_equal(values[12], [1, 1, 1])
    # Static shapes survive; dynamic ones travel.
    assert shapes == {0: [None], 1: [2, 3], 2: [], 3: [None, 2], 4: [], 5: [0, 4],
                      6: [None, None], 7: [None, 0], 8: [2, None, 3], 9: [None], 10: [None],
                      11: [None, 2], 12: [None]}


def _model(strategy):
    import keras

    with strategy.scope():
        ids = keras.Input((3,), dtype="int64")
        dense = keras.Input((5,))
        x = keras.layers.Embedding(50, 4)(ids)
        x = keras.layers.Flatten()(x)
        x = keras.layers.Concatenate()([x, dense])
        x = keras.layers.Dense(16, activation="relu",
                               kernel_regularizer=keras.regularizers.L2(0.01))(x)
        x = keras.layers.BatchNormalization()(x)
        out = keras.layers.Dense(1)(x)
        return keras.Model([ids, dense], out)


def test_packed_reads_cover_small_variables_and_train_like_per_use_reads(strategy, monkeypatch):
    import keras

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, (32, 3)).astype("int64")
    dense = rng.normal(size=(32, 5)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")
    model = _model(strategy)
    packed = transfers.PackedReads(model.variables)
    assert {v.path for v in packed.variables} == {v.path for v in model.variables}
    assert {v.path for v in transfers.PackedReads(model.variables, max_bytes=100).variables} \
        == {v.path for v in model.variables if np.prod(v.shape) * 4 <= 100}
    initial = model.get_weights()
    results = {}
    for setting in ("0", str(constants.DEFAULT_PACKED_READ_MAX_BYTES)):
        monkeypatch.setenv(constants.PACKED_READ_MAX_BYTES_ENV, setting)
        model.set_weights(initial)
        with strategy.scope():
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        losses = [model.train_on_batch([ids, dense], y) for _ in range(3)]
        results[setting] = (losses, model.get_weights())
    (per_use_losses, per_use), (packed_losses, packed_weights) = results.values()
    np.testing.assert_allclose(per_use_losses, packed_losses, rtol=1e-5)
    for a, b in zip(per_use, packed_weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    bn = next(layer for layer in model.layers if "batch_normalization" in layer.name)
    assert np.abs(bn.moving_mean.numpy()).sum() > 0  # written through to the ps
    # Evaluation and prediction read the same packed values.
    expected = keras.Model.from_config(model.get_config())
    expected.set_weights(model.get_weights())
    np.testing.assert_allclose(model.predict([ids, dense], verbose=0),
                               expected.predict([ids, dense], verbose=0), rtol=1e-5, atol=1e-6)


def _crossings(graph):
    """Counter of (from device, to device, dtype) over the tensors of `graph` that cross
    between explicitly placed devices (ops placed on ps tasks, and the worker's)."""
    import collections

    import tensorflow as tf

    def where(device):
        return device[device.index("/job:ps"):] if "/job:ps" in device else "worker"

    found = collections.Counter()
    for op in graph.get_operations():
        for tensor in op.inputs:
            a, b = where(tensor.op.device), where(op.device)
            if tensor.dtype != tf.resource and a != b:
                found[(a, b, tensor.dtype.name)] += 1
    return found


def test_sharded_lookups_come_with_the_packed_reads_and_train_as_in_the_forward_pass(
        cluster, monkeypatch):
    """Sharded tables looked up on the model's own inputs: their unique ids go to each ps in
    one transfer and their rows come back with its packed read (`fetched_lookups`); training,
    evaluation and prediction equal the per-shard lookups of the forward pass, duplicate
    ids included."""
    import keras
    import tensorflow as tf

    import kfit_ps
    from kfit_ps.training.step import fetched_lookups

    strategy = kfit_ps.ParameterServerStrategy(
        cluster.cluster_resolver,
        variable_partitioner=kfit_ps.partitioners.FixedShardsPartitioner(2))
    with strategy.scope():
        wide = keras.Input((3,), dtype="int64", name="wide")
        one = keras.Input((), dtype="int32", name="one")
        x = keras.layers.Flatten()(keras.layers.Embedding(40, 4, name="t_wide")(wide))
        y = keras.layers.Embedding(30, 4, name="t_one")(one)
        model = keras.Model({"wide": wide, "one": one},
                            keras.layers.Dense(1)(keras.layers.Concatenate()([x, y])))
    rng = np.random.default_rng(1)
    batches = [({"wide": rng.integers(0, 8, (16, 3)), "one": rng.integers(0, 30, (16,))},
                rng.normal(size=(16, 1)).astype("float32")) for _ in range(3)]
    initial = model.get_weights()
    results = {}
    for fetched in (True, False):
        if not fetched:
            monkeypatch.setattr(fetched_lookups, "fetched_tables", lambda *args, **kwargs: [])
        model.set_weights(initial)
        with strategy.scope():
            model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
        losses = [model.train_on_batch(*batch) for batch in batches]
        results[fetched] = (losses, model.get_weights(),
                            model.predict(batches[0][0], batch_size=8, verbose=0),
                            model.evaluate(*batches[1], batch_size=8, verbose=0))
        (traced,) = model.train_function.train_batch()._list_all_concrete_functions()
        gathers = [op for op in traced.graph.get_operations() if op.type == "ResourceGather"]
        # The lookups and the update's reads of slots, placed on the ps tasks; a lookup in
        # the forward pass is only colocated with its shard.
        assert all("/job:ps" in op.device for op in gathers) is fetched
        if fetched:
            assert sorted(v.path for _, v in fetched_lookups.fetched_tables(model)) == [
                "t_one/embeddings", "t_wide/embeddings"]
            ps = [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in range(2)]
            # Per ps: the ids out, the reads back, the gradients (and their ids) out.
            assert _crossings(traced.graph) == {
                **{("worker", p, "int64"): 2 for p in ps},
                **{("worker", p, "float32"): 1 for p in ps},
                **{(p, "worker", "float32"): 1 for p in ps},
                (ps[1], "worker", "int64"): 1}  # The optimizer's step number lives there.
    fetched, forward = results.values()
    np.testing.assert_allclose(fetched[0], forward[0], rtol=1e-6)
    for a, b in zip(fetched[1], forward[1]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(fetched[2], forward[2], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fetched[3], forward[3], rtol=1e-5)


def test_only_embeddings_called_once_on_a_model_input_are_fetched(cluster):
    """`_tf_compat.embedding_inputs`: a sharded `Embedding` the functional model calls once,
    on one of its own inputs; not one called twice, on a computed tensor, unsharded, or in a
    model whose own `call` decides what its layers see."""
    import keras

    import kfit_ps
    from kfit_ps import _tf_compat
    from kfit_ps.training.step import fetched_lookups

    strategy = kfit_ps.ParameterServerStrategy(
        cluster.cluster_resolver,
        variable_partitioner=kfit_ps.partitioners.MinSizePartitioner(
            min_shard_bytes=256, max_shards=2))

    class OwnCall(keras.Model):
        def call(self, inputs):
            return super().call(inputs)

    with strategy.scope():
        a, b, c = (keras.Input((2,), dtype="int64", name=n) for n in "abc")
        direct = keras.layers.Embedding(40, 4, name="direct")
        computed = keras.layers.Embedding(40, 4, name="computed")
        twice = keras.layers.Embedding(40, 4, name="twice")
        small = keras.layers.Embedding(3, 4, name="small")  # 48 bytes: one shard
        vectors = [direct(a), computed(keras.layers.Lambda(lambda x: x + 1)(b)), twice(b),
                   twice(c), small(c)]
        out = keras.layers.Dense(1)(keras.layers.Flatten()(keras.layers.Concatenate()(vectors)))
        model = keras.Model([a, b, c], out)
        own = OwnCall([a, b, c], out)
        for m in (model, own):
            m.compile(keras.optimizers.SGD(0.1), "mse")
            m.optimizer.build(m.trainable_variables)
    assert [len(kfit_ps.shards(layer.embeddings)) for layer in (direct, computed, twice, small)] \
        == [2, 2, 2, 1]
    assert [(i, layer.name) for i, layer in _tf_compat.embedding_inputs(model)] == [(0, "direct")]
    assert [(i, v.path) for i, v in fetched_lookups.fetched_tables(model)] == [
        (0, "direct/embeddings")]
    assert _tf_compat.embedding_inputs(own) == []


def test_other_lookups_of_a_fetched_table_read_their_own_ids_and_bad_ids_name_the_table(
        cluster, monkeypatch):
    """A layer looking up other ids in a fetched table (a tied vocabulary) gets their rows,
    and its gradient rows join the fetched ones: the same result as the forward pass'
    lookups. An id outside the table fails the step, naming the table and the id."""
    import keras
    import pytest
    import tensorflow as tf

    import kfit_ps
    from kfit_ps.training.step import fetched_lookups

    class Tied(keras.layers.Layer):
        def __init__(self, embedding, **kwargs):
            super().__init__(**kwargs)
            self.embedding = embedding

        def call(self, ids):
            return keras.ops.take(self.embedding.embeddings, ids, axis=0)

    strategy = kfit_ps.ParameterServerStrategy(
        cluster.cluster_resolver,
        variable_partitioner=kfit_ps.partitioners.FixedShardsPartitioner(2))
    with strategy.scope():
        a, b = (keras.Input((2,), dtype="int64", name=name) for name in "ab")
        table = keras.layers.Embedding(20, 3, name="table")
        table.build((None, 2))
        tied = Tied(table)(b)  # Runs before the table's own lookup.
        out = keras.layers.Dense(1)(keras.layers.Flatten()(
            keras.layers.Concatenate()([tied, table(a)])))
        model = keras.Model({"a": a, "b": b}, out)
    rng = np.random.default_rng(2)
    x = {"a": rng.integers(0, 5, (8, 2)), "b": rng.integers(10, 20, (8, 2))}
    y = rng.normal(size=(8, 1)).astype("float32")
    initial = model.get_weights()
    results = []
    for fetched in (True, False):
        if not fetched:
            monkeypatch.setattr(fetched_lookups, "fetched_tables", lambda *args, **kwargs: [])
        model.set_weights(initial)
        with strategy.scope():
            model.compile(keras.optimizers.Adagrad(0.1), "mse")
        results.append([model.predict(x, batch_size=8, verbose=0), model.train_on_batch(x, y),
                        model.train_on_batch(x, y)] + model.get_weights())
    for a_value, b_value in zip(*results):
        np.testing.assert_allclose(a_value, b_value, rtol=1e-6, atol=1e-7)
    monkeypatch.undo()
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        model.train_on_batch({"a": np.array([[1, 27]] * 4), "b": np.ones((4, 2), "int64")},
                             np.zeros((4, 1), "float32"))
    assert "Embedding ids must be in [0, input_dim)" in str(raised.value)
    assert "[table/embeddings (20 rows):] [1] [27]" in str(raised.value)
