"""DynamicEmbedding's Keras options: frozen layers, moving averages, padding, combiners,
per-table optimizers, refusals, eviction under two workers, serving an export."""

import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import kfit_ps


def _rows(layer, ids):
    return layer(tf.constant(ids, tf.int64)[:, None], training=False).numpy()[:, 0]


def _state(layer):
    """Every shard's keys, values (rows and slots), counts and counters, sorted by key."""
    out = []
    for shard in layer.table.shards:
        with tf.device(shard.device):
            keys, values = shard.values.export()
            meta_keys, meta = shard.meta.export()
        order, meta_order = np.argsort(keys.numpy()), np.argsort(meta_keys.numpy())
        out.append((keys.numpy()[order], values.numpy()[order], meta_keys.numpy()[meta_order],
                    meta.numpy()[meta_order], shard.counters.numpy()))
    return out


def _head_model(layer, width=2):
    ids = keras.Input(shape=(width,), dtype="int64")
    summed = keras.layers.Lambda(lambda v: keras.ops.sum(v, axis=1))(layer(ids))
    return keras.Model(ids, keras.layers.Dense(1, name="head")(summed))


def test_a_frozen_table_is_bit_identical_after_fit(strategy):
    """Fine-tuning the head only: rows, slots, counts and counters of the table do not move."""
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 50, (64, 2)), rng.normal(size=(64, 1)).astype("float32")
    with strategy.scope():
        layer = kfit_ps.layers.DynamicEmbedding(4, name="frozen")
        model = _head_model(layer)
        model.compile(keras.optimizers.Adam(0.05), "mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    before, head = _state(layer), model.get_layer("head").get_weights()[0].copy()
    layer.trainable = False
    with strategy.scope():
        model.compile(keras.optimizers.Adam(0.05), "mse")
    model.fit(np.concatenate([x, x + 100]), np.concatenate([y, y]), batch_size=8, epochs=2,
              verbose=0)
    after = _state(layer)
    for a, b in zip(before, after):
        for u, v in zip(a, b):
            np.testing.assert_array_equal(u, v)
    assert not np.array_equal(model.get_layer("head").get_weights()[0], head)  # Head trained.
    assert np.all(_rows(layer, [101, 120]) == 0)  # Ids first seen while frozen: not stored.


@pytest.mark.parametrize("overwrite", [None, 2])
def test_use_ema_averages_equal_keras(strategy, overwrite):
    """One worker's steps in order (train_on_batch): Keras' averages, and the weights take
    them at the end of fit (finalize_variable_values) or every `overwrite` steps."""
    def make():
        return keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.9,
                                    ema_overwrite_frequency=overwrite)

    rng = np.random.default_rng(1)
    batches = [(rng.normal(size=(4, 3)).astype("float32"), rng.normal(size=(4, 1)).astype(
        "float32")) for _ in range(5)]
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
        model.compile(make(), "mse")
    reference = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    reference.compile(make(), "mse")
    reference.set_weights(model.get_weights())
    for x, y in batches:
        model.train_on_batch(x, y)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(reference(x) - y))
        # Keras' own apply, eagerly (its overwrite conditional runs outside any strategy).
        reference.optimizer.apply(tape.gradient(loss, reference.trainable_variables),
                                  reference.trainable_variables)
    for ours, theirs in zip(model.optimizer.variables, reference.optimizer.variables):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=0, atol=1e-6)
    for ours, theirs in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6)
    # fit ends with the averages as weights, as Keras' fit does.
    x = np.concatenate([b[0] for b in batches])
    y = np.concatenate([b[1] for b in batches])
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
    averages = [v.numpy() for v in model.optimizer._model_variables_moving_average]
    for weight, average in zip(model.trainable_weights, averages):
        np.testing.assert_array_equal(weight.numpy(), average)


def test_padding_ids_read_zeros_and_never_train(strategy):
    with strategy.scope():
        layer = kfit_ps.layers.DynamicEmbedding(3, padding_id=0, name="padded")
        model = _head_model(layer, width=3)
        model.compile(keras.optimizers.SGD(0.1, weight_decay=0.1), "mse")
    x = np.array([[5, 0, 0], [6, 7, 0], [0, 0, 0]])
    model.fit(x, np.ones((3, 1)), batch_size=3, epochs=2, verbose=0)
    assert np.all(_rows(layer, [0]) == 0)
    assert layer.stats()["rows"] == 3  # 5, 6, 7: never 0.
    masking = kfit_ps.layers.DynamicEmbedding(3, mask_zero=True)
    assert masking.padding_id == 0 and masking.get_config()["mask_zero"]
    mask = masking.compute_mask(tf.constant(x))
    np.testing.assert_array_equal(mask.numpy(), x != 0)
    other = kfit_ps.layers.DynamicEmbedding(3, padding_id="<pad>")
    other.build()
    with pytest.raises(ValueError, match="padding_id='<pad>' cannot pad ids of dtype int64"):
        other(tf.constant([[1]], tf.int64))


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_combiners_over_multi_hot_and_ragged_ids(combiner):
    layer = kfit_ps.layers.DynamicEmbedding(2, combiner=combiner, padding_id=-1,
                                            embeddings_initializer="ones")
    layer.build()
    from kfit_ps.embeddings import sparse_optimizer

    keys = tf.constant([1, 2, 3], tf.int64)  # Store rows 1, 2, 3 = ones, 2 * ones, 3 * ones.
    layer.table.use_optimizer(keras.optimizers.SGD(1.0))
    layer.table.update(0, keys, -tf.constant([[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]),
                       tf.ones([3], tf.int64), sparse_optimizer.SparseOptimizer(
                           keras.optimizers.SGD(1.0)), 1.0, tf.constant(1, tf.int64))
    dense = layer(tf.constant([[1, 2, -1], [3, -1, -1]], tf.int64)).numpy()
    ragged = layer(tf.ragged.constant([[1, 2], [3]], tf.int64)).numpy()
    sparse = layer(tf.sparse.SparseTensor([[0, 0], [0, 1], [1, 0]], tf.constant([1, 2, 3],
                                                                                 tf.int64),
                                          [2, 4])).numpy()
    expected = {"sum": [[3, 3], [3, 3]], "mean": [[1.5, 1.5], [3, 3]],
                "sqrtn": [[3 / np.sqrt(2)] * 2, [3, 3]]}[combiner]
    np.testing.assert_allclose(dense, expected, rtol=1e-6)
    np.testing.assert_allclose(ragged, expected, rtol=1e-6)
    np.testing.assert_allclose(sparse, expected, rtol=1e-6)
    spec = layer.compute_output_spec(keras.KerasTensor((None, 3), "int64"))
    assert tuple(spec.shape) == (None, 2)
    with pytest.raises(ValueError, match="combines the ids of each example.*shape \\(2,\\)"):
        layer(tf.constant([1, 2], tf.int64))


def test_a_table_with_its_own_optimizer_and_learning_rate(strategy):
    """The table's Adagrad(0.5) updates its rows; the model's SGD the head."""
    from kfit_ps.embeddings import hashing

    with strategy.scope():
        layer = kfit_ps.layers.DynamicEmbedding(
            2, optimizer=keras.optimizers.Adagrad(0.5), seed=2)
        ids = keras.Input(shape=(1,), dtype="int64")
        out = keras.layers.Lambda(lambda v: keras.ops.sum(v, axis=(1, 2)))(layer(ids))
        model = keras.Model(ids, out)
        model.compile(keras.optimizers.SGD(0.01), lambda y, p: p)
    model.train_on_batch(np.array([[4]]), np.zeros(1))
    initial = hashing.initial_rows(tf.constant([4], tf.int64), 2, *layer._initializer,
                                   layer.seed).numpy()
    # Adagrad: accumulator 0.1 + 1, step 0.5 * 1 / sqrt(1.1 + 1e-7).
    np.testing.assert_allclose(_rows(layer, [4]), initial - 0.5 / np.sqrt(1.1 + 1e-7),
                               rtol=0, atol=1e-6)
    assert layer.table.slot_names == ("accumulator",)
    restored = kfit_ps.layers.DynamicEmbedding.from_config(layer.get_config())
    assert isinstance(restored.optimizer, keras.optimizers.Adagrad)


@pytest.mark.parametrize("option", [{"gradient_accumulation_steps": 2}, {"clipnorm": 1.0},
                                    {"global_clipnorm": 1.0}])
def test_options_needing_every_gradient_are_refused_for_dynamic_tables(strategy, option):
    with strategy.scope():
        model = _head_model(kfit_ps.layers.DynamicEmbedding(2))
        model.compile(keras.optimizers.Adam(0.1, **option), "mse")
    name = next(iter(option))
    with pytest.raises(ValueError, match=f"sparse tables.*Received: {name}="):
        model.fit(np.ones((4, 2), np.int64), np.zeros((4, 1)), verbose=0)


def test_row_spanning_constraints_are_refused_for_dynamic_tables():
    with pytest.raises(ValueError, match="embeddings_constraint.*axis=-1"):
        kfit_ps.layers.DynamicEmbedding(2, embeddings_constraint=keras.constraints.MaxNorm(1))


def test_slots_of_another_optimizer_are_dropped_with_a_message(tmp_path, capsys):
    layer = kfit_ps.layers.DynamicEmbedding(2, name="moved")
    model = keras.Sequential([keras.Input((1,), dtype="int64"), layer])
    layer.table.use_optimizer(keras.optimizers.Adam())
    path = str(tmp_path / "w.weights.h5")
    model.save_weights(path)
    layer.table.use_optimizer(keras.optimizers.Adagrad())
    model.load_weights(path)
    assert "saved slots are dropped" in capsys.readouterr().out


def test_two_workers_evicting_leave_no_orphan_and_count_exactly(strategy):
    """2 workers x 1,000 steps over 400 ids, capacity 200 (50 %): afterwards every key has a
    row, slots and a count, and `evicted` equals the rows actually removed."""
    rng = np.random.default_rng(3)
    x = rng.integers(0, 400, (2000 * 4, 2))
    with strategy.scope():
        layer = kfit_ps.layers.DynamicEmbedding(4, capacity=200, name="evicting")
        model = _head_model(layer)
        model.compile(keras.optimizers.Adam(0.01), "mse")
    dataset_fn = lambda _: tf.data.Dataset.from_tensor_slices(  # noqa: E731
        (x, np.zeros((len(x), 1), np.float32))).batch(4).repeat()
    model.fit(kfit_ps.DatasetCreator(dataset_fn), steps_per_epoch=2000, epochs=1, verbose=0)
    rows = 0
    for keys, values, meta_keys, meta, _ in _state(layer):
        has_row = set(meta_keys[meta[:, 2] > 0].tolist())
        assert set(keys.tolist()) == has_row  # No row without a count, nor the reverse.
        assert not np.isnan(values).any()  # Row and slots of every key.
        rows += len(keys)
    stats = layer.stats()
    assert stats["admitted"] - stats["evicted"] == rows == stats["rows"], stats
    assert stats["evicted"] > 0 and rows <= 2 * (100 + 10)


def test_an_exported_dynamic_table_serves_without_kfit_ps(strategy, tmp_path):
    with strategy.scope():
        layer = kfit_ps.layers.DynamicEmbedding(3, name="served")
        ids = keras.Input(shape=(2,), dtype="int64")
        model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(layer(ids))))
        model.compile(keras.optimizers.Adam(0.05), "mse")
    x = np.array([[1, 2], [3, 4]])
    model.fit(x, np.ones((2, 1)), batch_size=2, epochs=3, verbose=0)
    expected = model.predict(x, verbose=0)
    kfit_ps.export_saved_model(model, str(tmp_path / "export"))
    code = (f"import numpy as np, sys, tensorflow as tf\n"
            f"served = tf.saved_model.load({str(tmp_path / 'export')!r})\n"
            f"out = served.serve(tf.constant({x.tolist()!r}, tf.int64)).numpy()\n"
            f"assert 'kfit_ps' not in sys.modules\n"
            f"print(repr(out.tolist()))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    served = np.array(eval(result.stdout.strip().splitlines()[-1]))
    np.testing.assert_allclose(served, expected, rtol=1e-6)


def _local_update(table, keys, optimizer, step=1):
    from kfit_ps.embeddings import sparse_optimizer

    keys = tf.constant(keys, tf.int64)
    n = int(tf.size(keys))
    return table.update(0, keys, tf.ones([n, table.dim]), tf.ones([n], tf.int64),
                        sparse_optimizer.SparseOptimizer(optimizer), 0.1,
                        tf.constant(step, tf.int64))


def test_a_row_with_a_nan_element_is_still_a_row():
    """"Missing" is the count table's flag, never a NaN in the row: a diverged element does not
    reset the row or admit it again."""
    layer = kfit_ps.layers.DynamicEmbedding(3)
    layer.build()
    optimizer = keras.optimizers.SGD(0.1)
    layer.table.use_optimizer(optimizer)
    _local_update(layer.table, [7], optimizer)
    shard = layer.table.shards[0]
    shard.values.insert(tf.constant([7], tf.int64), tf.constant([[np.nan, 1.0, 2.0]]))
    _local_update(layer.table, [7], optimizer)
    row = _rows(layer, [7])[0]
    assert np.isnan(row[0]) and row[1:].tolist() == pytest.approx([0.9, 1.9])
    assert layer.stats()["admitted"] == 1


def test_ages_follow_the_table_clock_not_the_optimizer_step(tmp_path):
    """A fresh optimizer (iterations back to 0) on a loaded table: ages keep counting."""
    optimizer = keras.optimizers.SGD(0.1)

    def layer_and_model():
        layer = kfit_ps.layers.DynamicEmbedding(2, max_age=5, name="aged")
        model = keras.Sequential([keras.Input((1,), dtype="int64"), layer])
        layer.table.use_optimizer(optimizer)
        return layer, model

    layer, model = layer_and_model()
    _local_update(layer.table, [1], optimizer, step=100)
    for step in range(101, 104):
        _local_update(layer.table, [2], optimizer, step=step)
    path = str(tmp_path / "aged.weights.h5")
    model.save_weights(path)
    restored, model = layer_and_model()
    model.load_weights(path)
    assert int(restored.table.shards[0].clock.numpy()) == 4
    for _ in range(6):  # Step numbers of a new optimizer: 1, 1, ... (never ahead of 100).
        _local_update(restored.table, [2], optimizer, step=1)
    assert np.all(_rows(restored, [1]) == 0) and restored.stats()["rows"] == 1
    assert restored.stats()["evicted"] == 1


def test_ragged_multi_hot_ids_train_through_fit(strategy):
    """A ragged input with a combiner: each example's ids are looked up, averaged and trained."""
    with strategy.scope():
        ids = keras.Input(shape=(None,), dtype="int64", ragged=True)
        layer = kfit_ps.layers.DynamicEmbedding(3, combiner="mean", name="bags")
        model = keras.Model(ids, keras.layers.Dense(1)(layer(ids)))
        model.compile(keras.optimizers.Adagrad(0.1), "mse")

    def dataset_fn(_):
        x = tf.ragged.constant([[1, 2], [3], [4, 5, 6], [7]], tf.int64)
        return tf.data.Dataset.from_tensor_slices((x, tf.ones([4, 1]))).repeat().batch(2)

    before = model.evaluate(kfit_ps.DatasetCreator(dataset_fn), steps=2, verbose=0)
    model.fit(kfit_ps.DatasetCreator(dataset_fn), steps_per_epoch=20, epochs=1, verbose=0)
    assert layer.stats()["rows"] == 7
    assert model.evaluate(kfit_ps.DatasetCreator(dataset_fn), steps=2, verbose=0) < before
