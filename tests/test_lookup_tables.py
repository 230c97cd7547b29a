"""Keras lookup layers under the scope: per-worker tables in fit, evaluate, predict, restarts."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kfit_ps
from tests import helpers

TOKENS = ["red", "green", "blue", "cyan", "unknown-token"]


def lookup_model(strategy):
    with strategy.scope():
        color = keras.Input((), dtype="string", name="color")
        size = keras.Input((), dtype="int64", name="size")
        colors = keras.layers.StringLookup(vocabulary=TOKENS[:4], name="colors")
        sizes = keras.layers.IntegerLookup(name="sizes")
        sizes.adapt(np.array([1, 2, 3, 2, 1, 1], "int64"))  # adapted vocabulary
        x = keras.layers.Concatenate()([keras.layers.Embedding(5, 4)(colors(color)),
                                        keras.layers.Embedding(4, 4)(sizes(size))])
        model = keras.Model({"color": color, "size": size},
                            keras.layers.Dense(1, "sigmoid")(x))
        model.compile(keras.optimizers.Adam(0.05), "binary_crossentropy")
    return model


def examples():
    colors = tf.constant(TOKENS * 8)
    sizes = tf.constant([1, 2, 3, 9, 2] * 8, tf.int64)
    labels = tf.cast(tf.strings.length(colors) > 3, tf.float32)[:, None]  # learnable by color
    return {"color": colors, "size": sizes}, labels


def dataset_fn(input_context):
    return tf.data.Dataset.from_tensor_slices(examples()).repeat().batch(8)


def test_lookup_layers_work_in_fit_evaluate_predict_and_save(strategy, tmp_path):
    model = lookup_model(strategy)
    # The strategy gave the layers per-worker copies of their tables.
    assert type(model.get_layer("colors").lookup_table).__name__ == "DistributedTable"
    history = model.fit(kfit_ps.DatasetCreator(dataset_fn), epochs=3, steps_per_epoch=20,
                        verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    features, labels = examples()
    features = {k: v.numpy() for k, v in features.items()}
    loss = model.evaluate(features, labels.numpy(), batch_size=8, verbose=0)
    predictions = model.predict(features, batch_size=8, verbose=0)
    path = str(tmp_path / "lookup.keras")
    model.save(path)
    result = helpers.run_chief(f"""
        m = keras.models.load_model({path!r})
        x = {{"color": tf.constant({TOKENS * 8!r}),
             "size": tf.constant({[1, 2, 3, 9, 2] * 8!r}, tf.int64)}}
        report(pred=m.predict(x, batch_size=8, verbose=0).tolist(),
               vocab=[int(v) for v in m.get_layer("sizes").get_vocabulary()])
        """)
    np.testing.assert_allclose(np.asarray(result["pred"], "float32"), predictions, rtol=1e-6)
    assert sorted(result["vocab"][1:]) == [1, 2, 3]  # the adapted vocabulary was saved
    assert loss == pytest.approx(float(keras.losses.binary_crossentropy(
        labels.numpy(), predictions).numpy().mean()), rel=1e-4, abs=1e-6)


def test_tables_created_inside_dataset_fn_live_on_each_worker(strategy):
    """A table built in `dataset_fn` is part of each worker's input pipeline."""

    def with_table(input_context):
        table = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(tf.constant(TOKENS[:4]),
                                                tf.constant([0, 1, 2, 3], tf.int64)), 4)
        features, labels = examples()
        ids = table.lookup(features["color"])
        return tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(8)

    with strategy.scope():
        ids = keras.Input((), dtype="int64")
        model = keras.Model(ids, keras.layers.Dense(1, "sigmoid")(
            keras.layers.Embedding(5, 4)(ids)))
        model.compile(keras.optimizers.Adam(0.05), "binary_crossentropy",
                      metrics=[helpers.counting_metric()])
    history = model.fit(kfit_ps.DatasetCreator(with_table), epochs=2, steps_per_epoch=15,
                        verbose=0)
    assert history.history["batches"] == [15.0, 15.0]
    assert history.history["loss"][1] < history.history["loss"][0]


RESTART = """
from tests import test_lookup_tables as t

with kfit_ps.LocalCluster(num_workers=2, num_ps=1) as cluster:
    strategy = kfit_ps.ParameterServerStrategy(cluster.cluster_resolver)
    model = t.lookup_model(strategy)
    events = []

    class Restart(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                cluster.kill("worker", 0)
                cluster.restart("worker", 0)
                events.append("restarted")

    model.fit(kfit_ps.DatasetCreator(t.dataset_fn), epochs=3, steps_per_epoch=30, verbose=0,
              callbacks=[Restart()])
    features, labels = t.examples()
    features = {k: v.numpy() for k, v in features.items()}
    # Many small batches: both workers, the restarted one included, look tokens up.
    ps_pred = model.predict(features, batch_size=2, verbose=0)
    import tempfile
    path = os.path.join(tempfile.mkdtemp(), "m.keras")
    model.save(path)
    plain = keras.models.load_model(path)  # plain Keras: tables of its own, no cluster
    report(events=events, ps=ps_pred.ravel().tolist(),
           plain=plain.predict(t.examples()[0], batch_size=2, verbose=0).ravel().tolist(),
           pids=cluster.pids())
os._exit(0)
"""


@pytest.mark.chaos
@pytest.mark.slow
def test_tables_are_rebuilt_on_a_restarted_worker():
    result = helpers.run_chief(RESTART, timeout=300)
    assert result["events"] == ["restarted"]
    np.testing.assert_allclose(result["ps"], result["plain"], rtol=1e-6)
    assert helpers.wait_for_no_servers(result["pids"], timeout=10) == []
