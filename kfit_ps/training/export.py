"""Export for serving: a SavedModel with whole tables, loadable without a cluster."""

import os
import tempfile

import keras
import tensorflow as tf


def export_saved_model(model, path):
    """Writes `model` as a TensorFlow SavedModel for serving (TF Serving, `tf.saved_model.load`).

    Under parameter-server training the model's variables live on ps tasks,
    some split into shards, and its lookup tables on the workers. The export
    holds none of that: the model is written to a `.keras` file and read back
    in this process as a plain Keras model (every table whole, on this
    machine), which Keras then exports. The result has a `serve` endpoint and
    needs neither kfit_ps nor a cluster.

    ```python
    kfit_ps.export_saved_model(model, "export/1")
    served = tf.saved_model.load("export/1")
    served.serve(batch)
    ```

    Args:
        model: a Keras model (trained under a kfit_ps strategy or not).
        path: directory to write (local or a `tf.io.gfile` URL); must not exist yet.
    """
    path = os.fspath(path)
    if tf.io.gfile.exists(path):
        raise ValueError(f"export_saved_model: `path` already exists. Received: path={path!r}. "
                         "Choose a new directory (for example, one per model version).")
    with tempfile.TemporaryDirectory(prefix="kfit_ps_export_") as workdir:
        copy = os.path.join(workdir, "model.keras")
        model.save(copy)
        plain = keras.models.load_model(copy, compile=False)
        plain.export(path, format="tf_saved_model", verbose=False)
    return path
