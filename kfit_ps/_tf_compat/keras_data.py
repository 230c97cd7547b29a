"""Keras' own conversions of `fit` arguments: `validation_split` and `class_weight`.

Keras 3 turns these into data before any data adapter sees it
(`keras/src/backend/tensorflow/trainer.py`, `keras/src/trainers/data_adapters/`):

- `validation_split` on arrays: the last fraction of the rows, taken before
  shuffling, becomes `validation_data` (`array_slicing.train_validation_split`);
- `class_weight`: arrays get per-example weights from their labels
  (`data_adapter_utils.class_weight_to_sample_weights`, refused beside a
  `sample_weight`); a `tf.data.Dataset` is mapped with
  `tf_dataset_adapter.make_class_weight_map_fn`.

kfit_ps calls the same functions, so the split and the weights are Keras' own.
"""

from keras.src.trainers.data_adapters import array_slicing, data_adapter_utils
from keras.src.trainers.data_adapters import tf_dataset_adapter

from kfit_ps._tf_compat.versions import check_versions


def train_validation_split(arrays, validation_split):
    """`(training arrays, validation arrays)`: Keras' split of `(x, y, sample_weight)`."""
    check_versions()
    return array_slicing.train_validation_split(arrays, validation_split=validation_split)


def class_weight_to_sample_weights(y, class_weight):
    """Keras' per-example weights of labels `y` (integer or one-hot) under `class_weight`."""
    check_versions()
    return data_adapter_utils.class_weight_to_sample_weights(y, class_weight)


def class_weight_map_fn(class_weight):
    """Keras' map function adding `class_weight`'s weights to `(x, y[, sample_weight])`."""
    check_versions()
    return tf_dataset_adapter.make_class_weight_map_fn(class_weight)
