"""`DatasetCreator`: a function that builds each worker's `tf.data.Dataset`."""

import tensorflow as tf


class DatasetCreator:
    """Wraps `dataset_fn(input_context) -> tf.data.Dataset`, called once per worker.

    This is the input type parameter-server `model.fit` is built around: the
    dataset is created *on each worker* (so data is read where it is used),
    and every scheduled step takes the next batch from the worker it runs on.
    Shuffle and `repeat()` the dataset: steps are counted by `steps_per_epoch`,
    not by the end of the data.

    ```python
    def dataset_fn(input_context):
        batch_size = input_context.get_per_replica_batch_size(64)
        return make_dataset().shuffle(1024).repeat().batch(batch_size)

    model.fit(kfit_ps.DatasetCreator(dataset_fn), epochs=3, steps_per_epoch=100)
    ```

    Args:
        dataset_fn: a callable taking a `tf.distribute.InputContext` and
            returning a `tf.data.Dataset` of batches.
        input_options: optional `tf.distribute.InputOptions`. Defaults to None:
            each CPU worker iterates the dataset itself, with tf.data
            autotuning off unless the dataset's options turn it on (see
            `kfit_ps.training.inputs.scheduling.without_autotune_sleep`). Given, the
            workers use TensorFlow's distributed iterator with these options
            (as on workers with accelerators).
    """

    def __init__(self, dataset_fn, input_options=None):
        if not callable(dataset_fn):
            raise ValueError(
                "DatasetCreator: `dataset_fn` must be a callable that takes a "
                "tf.distribute.InputContext and returns a tf.data.Dataset. Received: "
                f"dataset_fn={dataset_fn!r} of type {type(dataset_fn).__name__}. "
                "Example: DatasetCreator(lambda ctx: tf.data.Dataset.range(10).repeat().batch(2))."
            )
        if input_options is not None and not isinstance(input_options, tf.distribute.InputOptions):
            raise ValueError(
                "DatasetCreator: `input_options` must be a tf.distribute.InputOptions or None. "
                f"Received: input_options={input_options!r}."
            )
        self.dataset_fn = dataset_fn
        self.input_options = input_options

    def __call__(self, input_context=None):
        dataset = self.dataset_fn(input_context or tf.distribute.InputContext())
        if not isinstance(dataset, tf.data.Dataset):
            name = getattr(self.dataset_fn, "__name__", repr(self.dataset_fn))
            raise ValueError(
                f"DatasetCreator: `dataset_fn` ({name}) must return a tf.data.Dataset. "
                f"Received: an object of type {type(dataset).__name__}. "
                "Return a dataset of batches, e.g. `return dataset.repeat().batch(32)`."
            )
        return dataset

    def __repr__(self):
        return f"DatasetCreator({getattr(self.dataset_fn, '__name__', self.dataset_fn)!s})"
