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
                 tf.zeros((0, 4))]
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
    # Static shapes survive; dynamic ones travel.
    assert shapes == {0: [None], 1: [2, 3], 2: [], 3: [None, 2], 4: [], 5: [0, 4]}


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
