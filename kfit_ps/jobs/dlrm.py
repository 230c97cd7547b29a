"""A DLRM-style model for Criteo-shaped data (`kfit_ps.data.criteo`).

Dense features go through a bottom MLP to an `embedding_dim` vector; each of
the 26 categorical features has its own embedding table (the large ones are
sharded over the ps tasks by the strategy's partitioner); the pairwise dot
products of all 27 vectors, with the bottom output, feed a top MLP.
"""

import keras
from keras import ops

from kfit_ps.data import criteo


@keras.saving.register_keras_serializable(package="kfit_ps")
class DotInteraction(keras.layers.Layer):
    """Pairwise dot products of a stack of vectors [B, N, D] -> [B, N*(N-1)/2]."""

    def call(self, stack):
        n = stack.shape[1]
        products = ops.matmul(stack, ops.transpose(stack, (0, 2, 1)))
        flat = ops.reshape(products, (-1, n * n))
        upper = [i * n + j for i in range(n) for j in range(i + 1, n)]
        return ops.take(flat, upper, axis=1)


@keras.saving.register_keras_serializable(package="kfit_ps")
class Stack(keras.layers.Layer):
    """A list of [B, D] vectors -> [B, N, D]."""

    def call(self, vectors):
        return ops.stack(vectors, axis=1)


def build_dlrm(spec=criteo.CriteoSpec(), embedding_dim=16, name="dlrm", embeddings=None):
    """The model; inputs are `criteo.dataset()` features, the output a click probability.

    `embeddings(categorical)` maps the dict of the 26 id inputs to a dict of
    their vectors (default: one `keras.layers.Embedding` per feature, of
    `spec.buckets` rows); pass for example a `kfit_ps.layers.DynamicEmbedding`
    for raw, unbounded ids.
    """
    dense = keras.Input((criteo.NUM_DENSE,), name="dense")
    categorical = {c: keras.Input((), dtype="int64", name=c) for c in criteo.CATEGORICAL}
    bottom = keras.layers.Dense(64, activation="relu", name="bottom_1")(dense)
    bottom = keras.layers.Dense(embedding_dim, activation="relu", name="bottom_2")(bottom)
    if embeddings is None:
        embedded = {c: keras.layers.Embedding(rows, embedding_dim, name=f"{c}_embedding")(
            categorical[c]) for c, rows in zip(criteo.CATEGORICAL, spec.buckets)}
    else:
        embedded = embeddings(categorical)
    vectors = [bottom] + [embedded[c] for c in criteo.CATEGORICAL]
    stack = Stack()(vectors)
    x = keras.layers.Concatenate()([bottom, DotInteraction()(stack)])
    x = keras.layers.Dense(64, activation="relu", name="top_1")(x)
    out = keras.layers.Dense(1, activation="sigmoid", name="click")(x)
    return keras.Model({"dense": dense, **categorical}, out, name=name)
