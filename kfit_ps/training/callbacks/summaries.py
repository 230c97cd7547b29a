"""TensorBoard scalar summaries, written with TensorFlow alone.

A scalar summary is only a float32 scalar tensor tagged with the "scalars"
plugin, so kfit_ps writes it with `tf.summary.write`, which is part of
TensorFlow itself (`tf.summary.scalar` needs the `tensorboard` package, which
kfit_ps installs for Keras' own callback and for `tensorboard --logdir`, but
does not need to write its own scalars).
"""

import numpy as np
import tensorflow as tf

_SCALARS = tf.compat.v1.SummaryMetadata(
    plugin_data=tf.compat.v1.SummaryMetadata.PluginData(plugin_name="scalars"))


def write_scalars(writer, tag_format, logs, step):
    """Writes each scalar in `logs` as `tag_format.format(name)` at `step`, and flushes."""
    with writer.as_default(step=int(step)):
        for name, value in logs.items():
            if np.ndim(value) != 0:
                continue  # TensorBoard scalars only.
            tf.summary.write(tag_format.format(name), tf.constant(float(value), tf.float32),
                             metadata=_SCALARS)
    writer.flush()


def read_scalars(event_file):
    """`{tag: [(step, value), ...]}` from one event file (for tests and tools)."""
    scalars = {}
    for event in tf.compat.v1.train.summary_iterator(event_file):
        for value in event.summary.value:
            if value.HasField("tensor"):
                array = tf.make_ndarray(value.tensor)
                if array.ndim != 0 or array.dtype.kind not in "fiu":
                    continue  # Not a scalar (e.g. Keras' model-config text summary).
                number = float(array)
            else:
                number = float(value.simple_value)
            scalars.setdefault(value.tag, []).append((int(event.step), number))
    return scalars
