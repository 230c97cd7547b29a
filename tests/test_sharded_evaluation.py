"""Exact evaluation where workers read the data themselves, in shards (no batch shipped)."""

import numpy as np
import pytest

from tests import helpers


def _model(strategy):
    import keras

    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse",
                      metrics=["mae", helpers.counting_metric()])
    return model


def _data(rows=1000, batch=16):
    import tensorflow as tf

    x, y = helpers.regression_arrays(rows=rows)
    return x, y, tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def _stock(model, x, y, batch=16):
    """The same evaluation by single-process Keras, with the same weights."""
    import keras

    reference = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(1)])
    reference.compile(loss="mse", metrics=["mae", helpers.counting_metric()])
    reference.set_weights(model.get_weights())
    return reference.evaluate(x, y, batch_size=batch, verbose=0, return_dict=True)


def test_dataset_creator_without_steps_is_evaluated_whole_on_the_workers(strategy):
    import kfit_ps

    x, y, _ = _data()
    model = _model(strategy)

    def dataset_fn(input_context):
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices((x, y)).batch(16)

    shards = []

    class Count(__import__("keras").callbacks.Callback):
        def on_test_batch_end(self, batch, logs=None):
            shards.append(batch)

    logs = model.evaluate(kfit_ps.DatasetCreator(dataset_fn), return_dict=True, verbose=0,
                          callbacks=[Count()])
    expected = _stock(model, x, y)
    assert logs["batches"] == 63 == expected["batches"]  # ceil(1000 / 16): each batch once
    np.testing.assert_allclose(logs["loss"], expected["loss"], rtol=1e-5)
    np.testing.assert_allclose(logs["mae"], expected["mae"], rtol=1e-5)
    assert shards == list(range(10))  # 5 shards per worker, 2 workers

    def unshardable_fn(input_context):  # auto-sharding switched off by the user's options
        import tensorflow as tf

        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.OFF)
        return dataset_fn(input_context).with_options(options)

    logs = model.evaluate(kfit_ps.DatasetCreator(unshardable_fn), return_dict=True, verbose=0)
    assert logs["batches"] == 63


def test_a_shard_loops_over_its_batches_in_the_functions_own_graph(strategy):
    """The model's step runs in a while loop of the shard's function, which TensorFlow
    optimises once per worker; a `Dataset.reduce` (what autograph makes of a loop over a
    dataset) would instantiate and optimise the whole model again for every shard."""
    import tensorflow as tf

    import kfit_ps
    from kfit_ps.training.step import functions

    _, _, dataset = _data()
    model = _model(strategy)
    logs = model.evaluate(kfit_ps.shardable(dataset, num_shards=4), return_dict=True, verbose=0)
    assert logs["batches"] == 63
    shard_fn = functions.for_model(model, strategy, "test_function").test_shard(
        4, tf.data.experimental.AutoShardPolicy.DATA)
    graph = shard_fn.get_concrete_function(tf.data.DatasetSpec(dataset.element_spec),
                                           tf.TensorSpec([], tf.int64)).graph
    op_types = {op.type for op in graph.get_operations()}
    assert "ReduceDataset" not in op_types
    assert op_types & {"While", "StatelessWhile"}


def test_shardable_dataset_and_validation_are_exact(strategy):
    import kfit_ps

    x, y, dataset = _data(rows=999, batch=10)
    model = _model(strategy)
    logs = model.evaluate(kfit_ps.shardable(dataset, num_shards=7), return_dict=True,
                          verbose=0)
    expected = _stock(model, x, y, batch=10)
    assert logs["batches"] == 100 == expected["batches"]
    np.testing.assert_allclose(logs["loss"], expected["loss"], rtol=1e-5)

    train = kfit_ps.DatasetCreator(helpers.regression_dataset_fn())
    history = model.fit(train, epochs=2, steps_per_epoch=5, verbose=0,
                        validation_data=kfit_ps.shardable(dataset, num_shards=3))
    assert history.history["val_batches"] == [100.0, 100.0]
    expected = _stock(model, x, y, batch=10)
    np.testing.assert_allclose(history.history["val_loss"][-1], expected["loss"], rtol=1e-5)


def test_fewer_batches_than_shards_evaluate_exactly(strategy):
    """61 rows in batches of 32 (2 batches) against the default 10 shards of 2 workers: a
    dataset built on the coordinator reaches the workers as a `DistributedDataset`, whose own
    sharding tried files ("the dataset only has 2 file(s)"); its copies are split by element
    as the coordinator decided. Shards 2..9 are empty; each batch counts once."""
    import kfit_ps

    x, y, dataset = _data(rows=61, batch=32)
    model = _model(strategy)
    logs = model.evaluate(kfit_ps.shardable(dataset), return_dict=True, verbose=0)
    expected = _stock(model, x, y, batch=32)
    assert logs["batches"] == 2 == expected["batches"]
    np.testing.assert_allclose([logs["loss"], logs["mae"]], [expected["loss"], expected["mae"]],
                               rtol=1e-6)


def test_sharded_tables_are_read_once_per_shard_and_evaluate_exactly(cluster, monkeypatch):
    """A sharded evaluation reads a snapshot of every variable, sharded tables included,
    at the start of each shard: the same results as per-batch reads and lookups."""
    import keras
    import tensorflow as tf

    import kfit_ps
    from kfit_ps import constants
    from kfit_ps.training.step import transfers

    strategy = kfit_ps.ParameterServerStrategy(
        cluster.cluster_resolver,
        variable_partitioner=kfit_ps.partitioners.FixedShardsPartitioner(2))
    with strategy.scope():  # default initializers, a table of 2 shards on 2 ps tasks
        model = keras.Sequential([keras.Input((3,), dtype="int64"),
                                  keras.layers.Embedding(101, 4), keras.layers.Flatten(),
                                  keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse", metrics=["mae", helpers.counting_metric()])
    table = model.layers[0].embeddings
    assert len(kfit_ps.shards(table)) == 2
    whole = transfers.PackedReads(model.variables, max_bytes=1 << 20, sharded=True)
    assert {v.path for v in whole.variables} == {v.path for v in model.variables}
    assert table.path not in {v.path for v in transfers.PackedReads(model.variables).variables}
    rng = np.random.default_rng(1)
    x = rng.integers(0, 101, (999, 3)).astype("int64")
    y = rng.normal(size=(999, 1)).astype("float32")
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)  # trained, not initial, values

    reference = keras.Sequential([keras.Input((3,), dtype="int64"),
                                  keras.layers.Embedding(101, 4), keras.layers.Flatten(),
                                  keras.layers.Dense(1)])
    reference.compile(loss="mse", metrics=["mae", helpers.counting_metric()])
    reference.set_weights(model.get_weights())
    expected = reference.evaluate(x, y, batch_size=10, verbose=0, return_dict=True)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(10)
    for setting in (str(constants.DEFAULT_SNAPSHOT_READ_MAX_BYTES), "0"):  # snapshot, per batch
        monkeypatch.setenv(constants.SNAPSHOT_READ_MAX_BYTES_ENV, setting)
        model.test_function = None  # functions are built (and read the setting) per compile
        logs = model.evaluate(kfit_ps.shardable(dataset, num_shards=4), return_dict=True,
                              verbose=0)
        assert logs["batches"] == 100 == expected["batches"], setting
        np.testing.assert_allclose(logs["loss"], expected["loss"], rtol=1e-5)
        np.testing.assert_allclose(logs["mae"], expected["mae"], rtol=1e-5)


def test_sharded_evaluation_rejects_steps_predict_and_infinite_data(strategy):
    import kfit_ps

    _, _, dataset = _data()
    model = _model(strategy)
    with pytest.raises(ValueError, match=r"`steps` cannot be combined with kfit_ps.shardable"):
        model.evaluate(kfit_ps.shardable(dataset), steps=3)
    with pytest.raises(ValueError, match=r"`predict` does not take kfit_ps.shardable"):
        model.predict(kfit_ps.shardable(dataset))
    with pytest.raises(ValueError, match=r"needs a finite dataset"):
        model.evaluate(kfit_ps.shardable(dataset.repeat()))
    repeating = kfit_ps.DatasetCreator(helpers.regression_dataset_fn())
    with pytest.raises(ValueError, match=r"`steps` is required for an infinite dataset"):
        model.evaluate(repeating)
    with pytest.raises(ValueError, match=r"num_shards"):
        kfit_ps.shardable(dataset, num_shards=0)
    with pytest.raises(ValueError, match=r"takes a finite tf.data.Dataset"):
        kfit_ps.shardable([1, 2, 3])


SHARDED_EVALUATION_WITH_A_DEATH = """
with kfit_ps.LocalCluster(num_workers=3, num_ps=1) as cluster:
    strategy = kfit_ps.ParameterServerStrategy(cluster.cluster_resolver)

    class Slow(keras.layers.Layer):
        # About 10 ms of work per batch, so that the kill lands mid-shard.
        def call(self, x):
            a = tf.ones((400, 400)) * 1e-3
            for _ in range(4):
                a = tf.matmul(a, a)
            return x + 0.0 * tf.reduce_sum(a)

    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), Slow()])
        model.compile(loss="mse", metrics=[keras.metrics.MeanMetricWrapper(
            lambda y_true, y_pred: y_true, name="mean_y")])
    values = np.arange(2048, dtype="float32").reshape(-1, 1)

    def dataset_fn(input_context):
        return tf.data.Dataset.from_tensor_slices((values, values)).batch(2)

    kill = __import__("threading").Timer(2.5, lambda: cluster.kill("worker", 1))
    kill.start()
    started = time.monotonic()
    logs = model.evaluate(kfit_ps.DatasetCreator(dataset_fn), verbose=0, return_dict=True)
    kill.join()
    report(mean_y=logs["mean_y"], loss=logs["loss"], seconds=time.monotonic() - started,
           pids=cluster.pids())
os._exit(0)
"""


@pytest.mark.chaos
@pytest.mark.slow
def test_sharded_evaluation_is_exact_when_a_worker_dies_during_it():
    result = helpers.run_chief(SHARDED_EVALUATION_WITH_A_DEATH, timeout=300)
    assert result["seconds"] > 2.5, result  # the kill landed during the evaluation
    assert result["mean_y"] == 1023.5  # every element of 0..2047 exactly once
    assert result["loss"] == 0.0
    assert helpers.wait_for_no_servers(result["pids"], timeout=10) == []
