"""`train_on_batch`, `test_on_batch` and `predict_on_batch` on kfit_ps models."""

import keras
import numpy as np
import pytest

from tests import helpers


def twin_models(strategy, optimizer="sgd"):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=optimizer, loss="mse", metrics=["mae", helpers.counting_metric()])
    reference = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(1)])
    reference.compile(optimizer=optimizer, loss="mse", metrics=["mae", helpers.counting_metric()])
    reference.set_weights(model.get_weights())
    return model, reference


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_on_batch_methods_return_what_keras_returns(strategy, optimizer):
    model, reference = twin_models(strategy, optimizer)
    x, y = helpers.regression_arrays(rows=24, seed=1)
    # After fit/evaluate/predict (which leave kfit_ps functions in Keras' function slots).
    model.fit(x, y, epochs=0, verbose=0)
    model.evaluate(x, y, verbose=0)
    model.predict(x, verbose=0)
    for _ in range(3):
        ours = model.train_on_batch(x, y, return_dict=True)
        theirs = reference.train_on_batch(x, y, return_dict=True)
        assert ours["batches"] == 1.0  # Keras resets the metrics at each call
        assert ours.keys() == theirs.keys()
        for key in theirs:
            np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-5, atol=1e-6)
    assert int(model.optimizer.iterations.numpy()) == 3
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    ours = model.test_on_batch(x, y)
    theirs = reference.test_on_batch(x, y)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.predict_on_batch(x), reference.predict_on_batch(x),
                               rtol=1e-5, atol=1e-6)
    weights = np.linspace(0, 1, 24, dtype="float32")
    np.testing.assert_allclose(
        model.test_on_batch(x, y, sample_weight=weights, return_dict=True)["loss"],
        reference.test_on_batch(x, y, sample_weight=weights, return_dict=True)["loss"],
        rtol=1e-5)


def test_on_batch_methods_on_a_fresh_model_and_bad_input(strategy):
    model, reference = twin_models(strategy)
    x, _ = helpers.regression_arrays(rows=5, seed=2)
    np.testing.assert_allclose(model.predict_on_batch(x), reference.predict_on_batch(x),
                               rtol=1e-6)
    with pytest.raises(ValueError, match="takes one batch of numpy arrays"):
        model.train_on_batch("not data")
    with pytest.raises(ValueError, match="`class_weight` and `sample_weight` at the same time"):
        model.train_on_batch(x, x[:, :1], class_weight={0: 1.0}, sample_weight=np.ones(5))
    labels = (x[:, :1] > 0).astype("float32")  # Keras' class weights: from 0/1 labels.
    np.testing.assert_allclose(
        model.train_on_batch(x, labels, class_weight={0: 0.5, 1: 2.0}, return_dict=True)["loss"],
        reference.train_on_batch(x, labels, class_weight={0: 0.5, 1: 2.0},
                                 return_dict=True)["loss"], rtol=1e-5)
