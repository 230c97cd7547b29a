"""Stateful Keras layers on ps variables: BatchNormalization's moving statistics, seed draws."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import kfit_ps
from tests import helpers

MOMENTUM = 0.99
STEPS = 200


def updates_toward(value, start, target, momentum=MOMENTUM):
    """n such that `start` averaged n times toward `target` is `value`."""
    return math.log((float(value) - target) / (start - target)) / math.log(momentum)


def constant_dataset_fn(value=5.0, batch=8):
    def dataset_fn(input_context):
        x = tf.fill((batch, 1), value)
        return tf.data.Dataset.from_tensors((x, tf.zeros((batch, 1)))).repeat()

    return dataset_fn


@pytest.mark.parametrize("steps_per_execution", [1, 10])
def test_batch_norm_keeps_every_workers_update(strategy, steps_per_execution):
    """Constant input 5.0, momentum 0.99: after 200 steps on 2 workers each moving statistic
    was averaged 200 times (Keras' read-then-assign kept 135-147 of them), and each seed
    generator advanced 200 times. The step takes four critical sections (the renorm
    variance, three seed generators) on both ps: at `steps_per_execution=10` two workers
    each held one while waiting for another until they were taken one at a time."""
    with strategy.scope():
        inputs = keras.Input((1,))
        plain = keras.layers.BatchNormalization(momentum=MOMENTUM, name="plain")
        renorm = keras.layers.BatchNormalization(
            momentum=MOMENTUM, renorm=True, renorm_momentum=MOMENTUM, name="renorm")
        dropouts = [keras.layers.Dropout(0.5, seed=seed) for seed in (3, 4, 5)]
        outputs = keras.layers.Add()(
            [plain(inputs), renorm(inputs)] + [dropout(inputs) for dropout in dropouts])
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse",
                      steps_per_execution=steps_per_execution)
    model.fit(kfit_ps.DatasetCreator(constant_dataset_fn()), epochs=1, steps_per_epoch=STEPS,
              verbose=0)
    assert int(model.optimizer.iterations.numpy()) == STEPS
    stddev = math.sqrt(plain.epsilon)  # the batch's: its variance is 0
    counts = {
        "plain.moving_mean": updates_toward(plain.moving_mean.numpy()[0], 0.0, 5.0),
        "plain.moving_variance": updates_toward(plain.moving_variance.numpy()[0], 1.0, 0.0),
        "renorm.moving_mean": updates_toward(renorm.moving_mean.numpy()[0], 0.0, 5.0),
        "renorm.renorm_mean": updates_toward(renorm.renorm_mean.numpy()[0], 0.0, 5.0),
        "renorm.moving_stddev": updates_toward(renorm.moving_stddev.numpy()[0], 1.0, stddev),
        "renorm.renorm_stddev": updates_toward(renorm.renorm_stddev.numpy()[0], 1.0, stddev),
    }
    assert all(abs(n - STEPS) < 0.5 for n in counts.values()), counts
    # moving_variance follows the updated moving_stddev.
    expected = max(float(renorm.moving_stddev.numpy()[0]) ** 2 - renorm.epsilon, 0.0)
    assert renorm.moving_variance.numpy()[0] == pytest.approx(expected, rel=1e-5, abs=1e-7)
    seed_states = [dropout.seed_generator.state.numpy().tolist() for dropout in dropouts]
    assert seed_states == [[3, STEPS], [4, STEPS], [5, STEPS]]


def test_dropout_masks_are_distinct_across_workers_and_steps(strategy):
    """300 masks drawn by functions that 2 workers run at once (one draw each, or 10 in a
    loop, as with steps_per_execution): no two alike, and the seed state counts every draw."""
    with strategy.scope():
        dropout = keras.layers.Dropout(0.5, seed=11)
    ones = tf.ones((1, 64))
    coordinator = strategy.coordinator

    @tf.function
    def one():
        return dropout(ones, training=True)[0] > 0

    @tf.function
    def ten():
        masks = tf.TensorArray(tf.bool, size=10)
        for i in tf.range(10):
            masks = masks.write(i, dropout(ones, training=True)[0] > 0)
        return masks.stack()

    results = [coordinator.schedule(one) for _ in range(100)]
    results += [coordinator.schedule(ten) for _ in range(20)]
    coordinator.join()
    masks = []
    for result in results:
        value = result.fetch()
        masks.extend(value.reshape(-1, 64) if value.ndim == 2 else [value])
    assert len(masks) == 300
    distinct = {np.packbits(mask).tobytes() for mask in masks}
    assert len(distinct) == 300, f"{300 - len(distinct)} repeated masks"
    assert dropout.seed_generator.state.numpy().tolist() == [11, 300]


@pytest.mark.slow
def test_batch_norm_on_one_worker_matches_single_process_keras():
    """With one worker the steps run one after another: the moving statistics (plain and
    renorm), a seeded Dropout's draws and the optimizer's moving averages (`use_ema`, which
    become the weights at the end of `fit`) are Keras' own, to float error: the trained
    weights match too."""
    result = helpers.run_chief("""
        rng = np.random.default_rng(0)
        x = rng.normal(2.0, 3.0, size=(480, 3)).astype("float32")
        y = np.zeros((480, 1), "float32")

        def build():
            inputs = keras.Input((3,))
            plain = keras.layers.BatchNormalization(momentum=0.9)(inputs)
            renorm = keras.layers.BatchNormalization(momentum=0.9, renorm=True,
                                                     renorm_momentum=0.8)(inputs)
            joined = keras.layers.Dropout(0.5, seed=5)(keras.layers.Concatenate()([plain, renorm]))
            model = keras.Model(inputs, keras.layers.Dense(1)(joined))
            model.compile(optimizer=keras.optimizers.SGD(0.01, use_ema=True, ema_momentum=0.9),
                          loss="mse")
            return model

        def statistics(model):
            return [[v.name, v.numpy().tolist()] for v in model.non_trainable_variables
                    + model.trainable_variables]

        keras.utils.set_random_seed(1)
        local = build()
        local.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        expected = statistics(local)  # before connecting: then the local device is gone
        with kfit_ps.LocalCluster(num_workers=1, num_ps=1) as cluster:
            strategy = kfit_ps.ParameterServerStrategy(cluster.cluster_resolver)
            with strategy.scope():
                keras.utils.set_random_seed(1)
                remote = build()
            def dataset_fn(input_context):
                return tf.data.Dataset.from_tensor_slices((x, y)).batch(16).repeat()
            remote.fit(kfit_ps.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=30,
                       verbose=0)
            report(local=expected, remote=statistics(remote))
        os._exit(0)
    """)
    local, remote = result["local"], result["remote"]
    assert [name for name, _ in remote] == [name for name, _ in local] and len(local) == 14
    for (name, values), (_, remote_values) in zip(local, remote):
        np.testing.assert_allclose(remote_values, values, rtol=1e-4, atol=1e-5, err_msg=name)


def test_optimizer_moving_averages_keep_every_workers_update(strategy):
    """`use_ema=True`: with the weight held at 5.0 (learning rate 0) and its average set to 0
    after the first step, 200 steps on 2 workers average it 200 times (Keras' assign of
    `m * average + (1 - m) * variable` loses the updates of concurrent workers)."""
    from kfit_ps import _tf_compat

    with strategy.scope():
        inputs = keras.Input((1,))
        model = keras.Model(inputs, keras.layers.Dense(
            1, use_bias=False, kernel_initializer=keras.initializers.Constant(5.0))(inputs))
        model.compile(optimizer=keras.optimizers.SGD(0.0, use_ema=True, ema_momentum=MOMENTUM),
                      loss="mse")
    data = kfit_ps.DatasetCreator(constant_dataset_fn())
    model.fit(data, epochs=1, steps_per_epoch=1, verbose=0)  # the first step: average = weight
    [(variable, average)] = _tf_compat.moving_average_pairs(model.optimizer)
    average.assign(tf.zeros_like(average))
    model.fit(data, epochs=1, steps_per_epoch=STEPS, verbose=0)
    # At the end of `fit` the weight takes its average's value, as in Keras. Every update is
    # kept; two computed from the same read both move the average a full step (a fraction of
    # an update more than one after the other). Keras' assign kept about 150 of 200.
    n = updates_toward(variable.numpy().ravel()[0], 0.0, 5.0)
    assert STEPS - 0.5 < n < STEPS + 2, n
