"""Every Keras optimizer option means on kfit_ps' sparse tables what it means in Keras.

The reference is single-machine Keras with the *lazy* rule computed by Keras
itself: each table row is its own Keras variable, so a row without gradient
in a step is skipped by Keras' `apply` (its value and slots do not move),
and every other row goes through Keras' whole `apply`: loss-scale division,
weight decay (with `exclude_from_weight_decay`), the formula, the constraint.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kfit_ps
from kfit_ps import _tf_compat

ROWS, DIM = 16, 4
# Three steps; ids 0 and 8-15 are never touched, 1-3 skip step 2, 4-6 skip steps 1 and 3.
BATCHES = [np.array([[1, 2], [3, 1], [7, 2]]), np.array([[4, 5], [6, 4], [7, 7]]),
           np.array([[1, 7], [2, 2], [3, 5]])]
TARGETS = [np.array([[0.5], [-1.0], [2.0]], np.float32)] * 3
TOUCHED = sorted(set(np.concatenate([b.ravel() for b in BATCHES]).tolist()))


def _schedule():
    return keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=1, decay_rate=0.5)


def _excluded(optimizer):
    optimizer.exclude_from_weight_decay(var_names=["embeddings"])
    return optimizer


CASES = {
    "sgd": lambda: keras.optimizers.SGD(0.1, weight_decay=0.05, loss_scale_factor=128.0),
    "momentum": lambda: keras.optimizers.SGD(_schedule(), momentum=0.9, weight_decay=0.05),
    "nesterov": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True,
                                             loss_scale_factor=64.0),
    "adagrad": lambda: keras.optimizers.Adagrad(_schedule(), weight_decay=0.1,
                                                loss_scale_factor=32.0),
    "adam": lambda: keras.optimizers.Adam(0.05),
    "adam_schedule": lambda: keras.optimizers.Adam(_schedule(), weight_decay=0.02,
                                                   loss_scale_factor=128.0),
    "adamw_excluded": lambda: _excluded(keras.optimizers.AdamW(0.05, weight_decay=0.5)),
    "amsgrad": lambda: keras.optimizers.Adam(0.05, amsgrad=True, weight_decay=0.1,
                                             loss_scale_factor=16.0),
}
CONSTRAINTS = {"adagrad": lambda: keras.constraints.MaxNorm(0.05, axis=-1),
               "amsgrad": lambda: keras.constraints.NonNeg(),
               "adam_schedule": lambda: keras.constraints.UnitNorm(axis=-1)}


def _model(table, two_towers=False):
    ids = keras.Input(shape=(2,), dtype="int64")
    vectors = table(ids)
    summed = keras.layers.Lambda(lambda v: keras.ops.sum(v, axis=1))(vectors)
    if two_towers:  # The same layer called again on the reversed ids: one update per step.
        again = table(keras.layers.Lambda(lambda i: keras.ops.flip(i, axis=1))(ids))
        summed = summed + keras.layers.Lambda(lambda v: keras.ops.sum(v * v, axis=1))(again)
    return keras.Model(ids, keras.layers.Dense(1, name="head")(summed))


class Reference:
    """Single-machine Keras, one variable per row (the lazy rule, by Keras itself)."""

    def __init__(self, rows, head, make_optimizer, constraint=None, two_towers=False):
        self.rows = {i: keras.Variable(np.asarray(row)[None], name="embeddings")
                     for i, row in rows.items()}
        for variable in self.rows.values():
            variable.constraint = constraint
        self.kernel = keras.Variable(head[0], name="kernel")
        self.bias = keras.Variable(head[1], name="bias")
        self.optimizer = make_optimizer()
        self.variables = list(self.rows.values()) + [self.kernel, self.bias]
        self.optimizer.build(self.variables)
        self.two_towers = two_towers

    def _embed(self, ids):
        return tf.stack([tf.concat([self.rows[int(i)] for i in row], axis=0) for row in ids])

    def step(self, ids, y):
        with tf.GradientTape() as tape:
            summed = tf.reduce_sum(self._embed(ids), axis=1)
            if self.two_towers:
                summed += tf.reduce_sum(tf.square(self._embed(ids[:, ::-1])), axis=1)
            prediction = tf.matmul(summed, self.kernel) + self.bias
            loss = self.optimizer.scale_loss(tf.reduce_mean(tf.square(prediction - y)))
        grads = tape.gradient(loss, self.variables)
        with warnings.catch_warnings():  # "Gradients do not exist": the untouched rows.
            warnings.simplefilter("ignore")
            self.optimizer.apply(grads, self.variables)

    def row(self, i):
        return self.rows[i].numpy()[0]


def _compare(model, reference, read_rows, ids):
    np.testing.assert_allclose(read_rows(ids), np.stack([reference.row(i) for i in ids]),
                               rtol=0, atol=1e-5)  # float32 order of summation: 2.6e-6 seen
                                                   # (the lazy rule's misses are 0.08 or more)
    kernel, bias = model.get_layer("head").get_weights()
    np.testing.assert_allclose(kernel, reference.kernel.numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(bias, reference.bias.numpy(), rtol=0, atol=1e-6)


def _train(model, reference):
    for ids, y in zip(BATCHES, TARGETS):
        model.train_on_batch(ids, y)
        reference.step(ids, y)


@pytest.fixture(scope="module")
def two_shards(cluster):
    return kfit_ps.ParameterServerStrategy(
        cluster.cluster_resolver, variable_partitioner=kfit_ps.partitioners.FixedShardsPartitioner(2))


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_rows_equal_keras_lazy_reference(two_shards, case):
    constraint = CONSTRAINTS.get(case, lambda: None)()
    with two_shards.scope():
        table = keras.layers.Embedding(ROWS, DIM, embeddings_constraint=constraint)
        model = _model(table)
        model.compile(CASES[case](), "mse")
    assert len(kfit_ps.shards(table.embeddings)) == 2
    initial = table.embeddings.numpy()
    reference = Reference({i: initial[i] for i in range(ROWS)},
                          model.get_layer("head").get_weights(), CASES[case],
                          CONSTRAINTS.get(case, lambda: None)())
    _train(model, reference)
    _compare(model, reference, lambda ids: table.embeddings.numpy()[ids], list(range(ROWS)))
    untouched = sorted(set(range(ROWS)) - set(TOUCHED))
    np.testing.assert_array_equal(table.embeddings.numpy()[untouched], initial[untouched])
    assert int(model.optimizer.iterations.numpy()) == 3


@pytest.mark.parametrize("case", sorted(CASES))
def test_dynamic_rows_equal_keras_lazy_reference(strategy, case):
    from kfit_ps.embeddings import hashing

    constraint = CONSTRAINTS.get(case, lambda: None)()
    with strategy.scope():
        table = kfit_ps.layers.DynamicEmbedding(DIM, embeddings_constraint=constraint, seed=3)
        model = _model(table)
        model.compile(CASES[case](), "mse")
    initial = hashing.initial_rows(tf.constant(TOUCHED, tf.int64), DIM, *table._initializer,
                                   table.seed).numpy()
    reference = Reference(dict(zip(TOUCHED, initial)), model.get_layer("head").get_weights(),
                          CASES[case], CONSTRAINTS.get(case, lambda: None)())
    _train(model, reference)

    def read(ids):
        return table(tf.constant(ids, tf.int64)[:, None], training=False).numpy()[:, 0]

    _compare(model, reference, read, TOUCHED)
    assert table.stats()["rows"] == len(TOUCHED)


def test_whole_variable_constraint_applies_as_keras_does(two_shards):
    """MaxNorm() spans rows (axis 0): applied to the whole sharded variable after the update."""
    make = lambda: keras.optimizers.Adam(0.05)  # noqa: E731
    with two_shards.scope():
        table = keras.layers.Embedding(ROWS, DIM, embeddings_constraint=keras.constraints.MaxNorm(0.1))
        model = _model(table)
        model.compile(make(), "mse")
    initial = table.embeddings.numpy()
    reference = Reference({i: initial[i] for i in range(ROWS)},
                          model.get_layer("head").get_weights(), make)
    constraint = keras.constraints.MaxNorm(0.1)
    for ids, y in zip(BATCHES, TARGETS):
        model.train_on_batch(ids, y)
        reference.step(ids, y)
        whole = constraint(tf.concat([reference.rows[i] for i in range(ROWS)], axis=0))
        for i in range(ROWS):
            reference.rows[i].assign(whole[i:i + 1])
    _compare(model, reference, lambda ids: table.embeddings.numpy()[ids], list(range(ROWS)))


@pytest.mark.parametrize("kind", ["sharded", "dynamic"])
def test_a_layer_called_twice_in_a_step_updates_once(two_shards, kind):
    """Two towers sharing ids: Keras sums the gradients and applies once (Adagrad's
    accumulator grows by (g1 + g2)^2, not g1^2 + g2^2)."""
    from kfit_ps.embeddings import hashing

    make = lambda: keras.optimizers.Adagrad(0.1)  # noqa: E731
    with two_shards.scope():
        table = (keras.layers.Embedding(ROWS, DIM) if kind == "sharded"
                 else kfit_ps.layers.DynamicEmbedding(DIM, seed=5))
        model = _model(table, two_towers=True)
        model.compile(make(), "mse")
    if kind == "sharded":
        initial = dict(enumerate(table.embeddings.numpy()))

        def read(ids):
            return table.embeddings.numpy()[ids]
    else:
        initial = dict(zip(TOUCHED, hashing.initial_rows(
            tf.constant(TOUCHED, tf.int64), DIM, *table._initializer, table.seed).numpy()))

        def read(ids):
            return table(tf.constant(ids, tf.int64)[:, None], training=False).numpy()[:, 0]
    reference = Reference(initial, model.get_layer("head").get_weights(), make, two_towers=True)
    _train(model, reference)
    _compare(model, reference, read, TOUCHED)


@pytest.mark.parametrize("kind", ["sharded", "dynamic"])
def test_adam_rows_equal_keras_bit_for_bit(two_shards, kind):
    """Ten Adam(1.0) steps on a table alone (no dense weights): Keras' own arithmetic, so
    the rows equal Keras' exactly (betas' complements taken in Python, as adam.py does)."""
    from kfit_ps.embeddings import hashing

    make = lambda: keras.optimizers.Adam(1.0)  # noqa: E731
    with two_shards.scope():
        table = (keras.layers.Embedding(ROWS, DIM) if kind == "sharded"
                 else kfit_ps.layers.DynamicEmbedding(DIM, seed=9))
        ids = keras.Input(shape=(2,), dtype="int64")
        out = keras.layers.Lambda(lambda v: keras.ops.sum(v, axis=(1, 2)))(table(ids))
        model = keras.Model(ids, out)
        model.compile(make(), lambda y, p: p * y)
    if kind == "sharded":
        initial = dict(enumerate(table.embeddings.numpy()))
    else:
        initial = dict(zip(TOUCHED, hashing.initial_rows(
            tf.constant(TOUCHED, tf.int64), DIM, *table._initializer, table.seed).numpy()))
    rows = {i: keras.Variable(np.asarray(r)[None]) for i, r in initial.items()}
    optimizer = make()
    optimizer.build(list(rows.values()))
    for step in range(10):
        batch, y = BATCHES[step % 3], TARGETS[step % 3][:, 0]
        model.train_on_batch(batch, y)
        with tf.GradientTape() as tape:
            vectors = tf.stack([tf.concat([rows[int(i)] for i in row], axis=0) for row in batch])
            loss = tf.reduce_mean(tf.reduce_sum(vectors, axis=(1, 2)) * y)
        grads = tape.gradient(loss, list(rows.values()))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimizer.apply(grads, list(rows.values()))
    if kind == "sharded":
        ours = table.embeddings.numpy()[TOUCHED]
    else:
        ours = table(tf.constant(TOUCHED, tf.int64)[:, None], training=False).numpy()[:, 0]
    np.testing.assert_array_equal(ours, np.stack([rows[i].numpy()[0] for i in TOUCHED]))


@pytest.mark.parametrize("overwrite", [None, 2])
def test_moving_averages_of_a_sharded_table_equal_keras(two_shards, overwrite):
    """use_ema=True: every row's average (a sharded variable, updated shard by shard on the
    ps) and, with ema_overwrite_frequency, the rows themselves equal Keras'."""
    def make():
        return keras.optimizers.SGD(0.1, momentum=0.9, use_ema=True, ema_momentum=0.5,
                                    ema_overwrite_frequency=overwrite)

    with two_shards.scope():
        table = keras.layers.Embedding(ROWS, DIM)
        model = _model(table)
        model.compile(make(), "mse")
    initial = table.embeddings.numpy()
    reference = Reference({i: initial[i] for i in range(ROWS)},
                          model.get_layer("head").get_weights(), make)
    _train(model, reference)
    _compare(model, reference, lambda ids: table.embeddings.numpy()[ids], list(range(ROWS)))
    averages = dict((id(v), a) for v, a in _tf_compat.moving_average_pairs(model.optimizer))
    ours = averages[id(table.embeddings)].numpy()
    theirs = dict((id(v), a) for v, a in _tf_compat.moving_average_pairs(reference.optimizer))
    expected = np.concatenate([theirs[id(reference.rows[i])].numpy() for i in range(ROWS)])
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-6)
