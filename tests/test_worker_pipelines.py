"""How each worker iterates its input: its own pipeline, without autotuning's sleep."""

import keras
import pytest
import tensorflow as tf

import kfit_ps
from kfit_ps.training.inputs import adapters, scheduling
from tests import helpers


def _iterator_kind(strategy, iterator):
    """The class of `iterator` as a scheduled function on a worker receives it."""
    kinds = []

    @tf.function
    def peek(worker_iterator):
        kinds.append(worker_iterator)  # Traced once, on the coordinator.
        return next(worker_iterator)

    strategy.coordinator.schedule(peek, args=(iterator,)).fetch()
    return kinds[0]


def _counting_model(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse", metrics=[helpers.counting_metric()])
    return model


@pytest.mark.parametrize("given", ["creator", "dataset"])
def test_cpu_workers_iterate_their_own_pipeline(strategy, given):
    dataset_fn = helpers.regression_dataset_fn()
    data = (kfit_ps.DatasetCreator(dataset_fn) if given == "creator"
            else dataset_fn(tf.distribute.InputContext()))
    iterator = scheduling.per_worker_iterator(strategy, adapters.adapt(data, training=True))
    kind = _iterator_kind(strategy, iterator)
    assert isinstance(kind, tf.data.Iterator)
    assert not isinstance(kind, tf.distribute.DistributedIterator)


def test_input_options_keep_tensorflows_distributed_iterator(strategy):
    creator = kfit_ps.DatasetCreator(helpers.regression_dataset_fn(),
                                     input_options=tf.distribute.InputOptions())
    iterator = scheduling.per_worker_iterator(strategy, adapters.adapt(creator, training=True))
    assert isinstance(_iterator_kind(strategy, iterator), tf.distribute.DistributedIterator)

    model = _counting_model(strategy)
    history = model.fit(creator, epochs=2, steps_per_epoch=7, verbose=0)
    assert history.history["batches"] == [7.0, 7.0]
    assert int(model.optimizer.iterations.numpy()) == 14


def test_worker_pipelines_turn_autotuning_off_unless_the_dataset_chose():
    dataset = tf.data.Dataset.range(8).map(lambda x: x + 1, num_parallel_calls=tf.data.AUTOTUNE)
    assert dataset.options().autotune.enabled is None
    turned_off = scheduling.without_autotune_sleep(dataset)
    assert turned_off.options().autotune.enabled is False
    assert list(turned_off.as_numpy_iterator()) == list(range(1, 9))
    for choice in (True, False):
        options = tf.data.Options()
        options.autotune.enabled = choice
        chosen = dataset.with_options(options)
        assert scheduling.without_autotune_sleep(chosen).options().autotune.enabled is choice


def test_consecutive_fits_on_the_direct_path_stay_exact(strategy):
    """Each `fit` makes a fresh iterator; the previous one is destroyed meanwhile."""
    model = _counting_model(strategy)
    creator = kfit_ps.DatasetCreator(helpers.regression_dataset_fn())
    x, y = helpers.regression_arrays(rows=512)

    def full_loss():  # Every row at once: four shuffled batches vary more than 90 steps move.
        return float(keras.ops.mean(keras.ops.square(model(x) - y)))

    first = full_loss()
    for _ in range(3):
        history = model.fit(creator, epochs=1, steps_per_epoch=30, verbose=0)
        assert history.history["batches"] == [30.0]
    assert int(model.optimizer.iterations.numpy()) == 90
    assert full_loss() < first
