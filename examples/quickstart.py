"""Keras 3 model.fit on a parameter-server cluster of real TensorFlow servers.

Run: python examples/quickstart.py
Or, supervised (restarts lost tasks): kfit-ps run --workers 2 --ps 2 -- python examples/quickstart.py

Against single-process Keras, two lines differ: the strategy line, and `with strategy.scope():`
around the model. The LocalCluster's servers run until the script ends; under `kfit-ps run` it
is the launcher's cluster (its --workers / --ps) and starts no servers.
"""

# kfit_ps first: imported before TensorFlow, it keeps TensorFlow's C++ start-up log lines
# off the terminal (KFIT_PS_TF_LOGS=1 brings them back).
import kfit_ps  # isort: skip

import keras
import numpy as np
import tensorflow as tf


def dataset_fn(input_context):
    # Runs on each worker: synthetic clicks that depend on (user, item) taste.
    rng = np.random.default_rng(0)
    users, items = rng.integers(0, 1000, 50_000), rng.integers(0, 500, 50_000)
    taste = np.sin(users * 0.37) * np.cos(items * 0.73)
    clicks = (rng.random(50_000) < 1 / (1 + np.exp(-4 * taste))).astype("float32")
    data = tf.data.Dataset.from_tensor_slices(({"user": users, "item": items}, clicks))
    return data.shuffle(10_000).repeat().batch(256)


def build_model():
    user = keras.Input(shape=(), dtype="int64", name="user")
    item = keras.Input(shape=(), dtype="int64", name="item")
    u = keras.layers.Embedding(1000, 16)(user)
    i = keras.layers.Embedding(500, 16)(item)
    x = keras.layers.Concatenate()([u, i, u * i])
    x = keras.layers.Dense(32, activation="relu")(x)
    return keras.Model({"user": user, "item": item}, keras.layers.Dense(1, "sigmoid")(x))


if __name__ == "__main__":
    strategy = kfit_ps.ParameterServerStrategy(kfit_ps.LocalCluster(num_workers=2, num_ps=2))
    with strategy.scope():  # Variables, optimizer and metrics live on the ps tasks.
        model = build_model()
        model.compile(keras.optimizers.Adam(0.01), "binary_crossentropy",
                      metrics=[keras.metrics.AUC(name="auc")], steps_per_execution=5)
    history = model.fit(kfit_ps.DatasetCreator(dataset_fn), epochs=3, steps_per_epoch=100)
    print(f"final training AUC: {history.history['auc'][-1]:.3f}")
