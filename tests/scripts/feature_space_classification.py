"""Structured-data classification with `FeatureSpace`, as keras-io's example does it.

The steps of that example (which downloads the heart-disease CSV; here rows of its
schema are generated, with a target to learn): a pandas frame split 80/20,
`tf.data.Dataset.from_tensor_slices((dict(frame), labels))` shuffled and batched, a
`FeatureSpace` of integer, string and float features with crosses, adapted on the
training data *before* the model and outside any scope, datasets mapped through it,
a model on the encoded features with `Dropout`, `fit` with `validation_data`, and an
inference model (the `FeatureSpace` inputs into the trained model) that predicts one
raw example. Usage: `python feature_space_classification.py RESULT.json`.
"""

import json
import sys

import keras
import numpy as np
import pandas as pd
import tensorflow as tf
from keras.utils import FeatureSpace

rng = np.random.default_rng(3)
rows = 1500
frame = pd.DataFrame({
    "age": rng.integers(29, 78, rows), "sex": rng.integers(0, 2, rows),
    "cp": rng.integers(0, 5, rows), "fbs": rng.integers(0, 2, rows),
    "restecg": rng.integers(0, 3, rows), "exang": rng.integers(0, 2, rows),
    "ca": rng.integers(0, 4, rows), "thal": rng.choice(["normal", "fixed", "reversible"], rows),
    "trestbps": rng.normal(131, 17, rows).round(), "chol": rng.normal(246, 51, rows).round(),
    "thalach": rng.normal(150, 22, rows).round(), "oldpeak": rng.exponential(1.0, rows).round(1),
    "slope": rng.integers(0, 3, rows)})
risk = ((frame["cp"] >= 3).astype(int) + (frame["thal"] == "reversible") + (frame["ca"] >= 2)
        + (frame["oldpeak"] > 1.5) + (frame["age"] > 60))
frame["target"] = (risk >= 2).astype("int64")

val_frame = frame.sample(frac=0.2, random_state=1337)
train_frame = frame.drop(val_frame.index)


def dataframe_to_dataset(dataframe):
    dataframe = dataframe.copy()
    labels = dataframe.pop("target")
    return tf.data.Dataset.from_tensor_slices((dict(dataframe), labels)).shuffle(
        buffer_size=len(dataframe))


train_ds = dataframe_to_dataset(train_frame).batch(32)
val_ds = dataframe_to_dataset(val_frame).batch(32)

feature_space = FeatureSpace(
    features={
        "sex": FeatureSpace.integer_categorical(num_oov_indices=0),
        "cp": FeatureSpace.integer_categorical(num_oov_indices=0),
        "fbs": FeatureSpace.integer_categorical(num_oov_indices=0),
        "restecg": FeatureSpace.integer_categorical(num_oov_indices=0),
        "exang": FeatureSpace.integer_categorical(num_oov_indices=0),
        "ca": FeatureSpace.integer_categorical(num_oov_indices=0),
        "thal": FeatureSpace.string_categorical(num_oov_indices=0),
        "age": FeatureSpace.float_discretized(num_bins=30),
        "trestbps": FeatureSpace.float_normalized(),
        "chol": FeatureSpace.float_normalized(),
        "thalach": FeatureSpace.float_normalized(),
        "oldpeak": FeatureSpace.float_normalized(),
        "slope": FeatureSpace.float_normalized(),
    },
    crosses=[FeatureSpace.cross(feature_names=("sex", "age"), crossing_dim=64),
             FeatureSpace.cross(feature_names=("thal", "ca"), crossing_dim=16)],
    output_mode="concat")
feature_space.adapt(train_ds.map(lambda x, _: x))

preprocessed_train_ds = train_ds.map(lambda x, y: (feature_space(x), y),
                                     num_parallel_calls=tf.data.AUTOTUNE).prefetch(
    tf.data.AUTOTUNE)
preprocessed_val_ds = val_ds.map(lambda x, y: (feature_space(x), y),
                                 num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)

# MODEL
dict_inputs = feature_space.get_inputs()
encoded_features = feature_space.get_encoded_features()
x = keras.layers.Dense(32, activation="relu")(encoded_features)
x = keras.layers.Dropout(0.5)(x)
predictions = keras.layers.Dense(1, activation="sigmoid")(x)
training_model = keras.Model(inputs=encoded_features, outputs=predictions)
training_model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
# END MODEL

history = training_model.fit(preprocessed_train_ds, epochs=12,
                             validation_data=preprocessed_val_ds, verbose=2)

inference_model = keras.Model(inputs=dict_inputs, outputs=predictions)
sample = {"age": 70, "sex": 1, "cp": 4, "fbs": 0, "restecg": 2, "exang": 1, "ca": 3,
          "thal": "reversible", "trestbps": 145.0, "chol": 233.0, "thalach": 150.0,
          "oldpeak": 2.3, "slope": 3}
input_dict = {name: keras.ops.convert_to_tensor([value]) for name, value in sample.items()}
probability = float(inference_model.predict(input_dict, verbose=0)[0][0])
with open(sys.argv[1], "w") as f:
    json.dump({"val_accuracy": history.history["val_accuracy"], "epochs": history.epoch,
               "probability": probability}, f)
