"""`predict` on models that were never fitted or evaluated, as stock Keras allows."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kfit_ps
from tests import helpers


def fresh_model(strategy, how, compiled, steps_per_execution=1):
    with strategy.scope():
        if how == "sequential":
            model = keras.Sequential([keras.layers.Dense(8, activation="relu"),
                                      keras.layers.Dense(1)])
        elif how == "input":
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                                      keras.layers.Dense(1)])
        else:
            inputs = keras.Input((4,))
            model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Dense(8)(inputs)))
        if compiled:
            model.compile(loss="mse", steps_per_execution=steps_per_execution)
    return model


def reference_predictions(model, x):
    reference = keras.models.clone_model(model)  # outside the scope: stock Keras
    reference.set_weights(model.get_weights())
    return reference.predict(x, verbose=0)


@pytest.mark.parametrize("how", ["sequential", "input", "functional"])
@pytest.mark.parametrize("compiled", [False, True], ids=["uncompiled", "compiled"])
def test_predict_first_on_numpy(strategy, how, compiled):
    model = fresh_model(strategy, how, compiled)
    x, _ = helpers.regression_arrays(rows=50, seed=5)
    predictions = model.predict(x, batch_size=16, verbose=0)
    assert predictions.shape == (50, 1)
    assert all("/job:ps" in v.value.device for v in model.variables)
    np.testing.assert_allclose(predictions, reference_predictions(model, x), rtol=1e-6,
                               atol=1e-6)


@pytest.mark.parametrize("compiled", [False, True], ids=["uncompiled", "compiled"])
def test_predict_first_on_datasets_and_dataset_creators(strategy, compiled):
    x, _ = helpers.regression_arrays(rows=40, seed=6)
    model = fresh_model(strategy, "sequential", compiled, steps_per_execution=3)
    from_dataset = model.predict(tf.data.Dataset.from_tensor_slices(x).batch(8), verbose=0)
    np.testing.assert_allclose(from_dataset, reference_predictions(model, x), rtol=1e-6,
                               atol=1e-6)
    model = fresh_model(strategy, "input", compiled, steps_per_execution=3)
    from_workers = model.predict(kfit_ps.DatasetCreator(
        lambda ctx: tf.data.Dataset.from_tensor_slices(x).repeat().batch(10)), steps=4,
        verbose=0)
    assert from_workers.shape == (40, 1)
    # Each batch is the worker's next batch of x: every prediction is one of x's rows'.
    expected = reference_predictions(model, x)
    assert all(np.isclose(expected, p, rtol=1e-5, atol=1e-6).any() for p in from_workers)


def test_predict_first_then_compile_and_fit(strategy):
    model = fresh_model(strategy, "sequential", compiled=False)
    x, y = helpers.regression_arrays(rows=32)
    before = model.predict(x, verbose=0)
    with strategy.scope():
        model.compile("adam", "mse")
    model.fit(x, y, epochs=1, batch_size=8, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 4
    assert not np.allclose(before, model.predict(x, verbose=0))
