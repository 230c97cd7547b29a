"""Ids to table keys, keys to shards, and each id's own initial vector.

Everything here is a pure function of the id (and the layer's seed), so the
same id gets the same key, shard and initial vector on every worker, on every
ps and after a restart, with no table of its own:

- `keys`: integer ids are their own keys (int64, any value); string ids are
  fingerprinted to 64-bit keys (FarmHash Fingerprint64, whose output
  TensorFlow guarantees stable). Two distinct strings share a key with
  probability about n^2 / 2^65 for n strings.
- `salted`: the keys of one feature of a layer that embeds several, mixed
  with the feature's name, so that equal ids of two features differ.
- `shard_of`: a key's shard is its fingerprint modulo the number of shards,
  so structured ids (all even, consecutive blocks) still spread evenly.
- `initial_rows`: a new id's vector comes from its fingerprint with the
  element index and the seed: deterministic per id, independent of the
  batch it arrives in or of which worker sees it first.
"""

import math

import keras
import tensorflow as tf

_MANTISSA = 2 ** 53
SUPPORTED_INITIALIZERS = ("RandomUniform", "RandomNormal", "TruncatedNormal", "Zeros", "Ones",
                          "Constant")


def keys(ids):
    """int64 keys of integer or string `ids` (any shape)."""
    ids = tf.convert_to_tensor(ids)
    if ids.dtype == tf.string:
        return _fingerprint(tf.reshape(ids, [-1, 1]), tf.shape(ids))
    if not ids.dtype.is_integer:
        raise ValueError(f"DynamicEmbedding takes integer or string ids. Received: ids of dtype "
                         f"{ids.dtype.name}. Cast the ids to int64 (or pass them as strings).")
    return tf.cast(ids, tf.int64)


def _fingerprint(rows, shape):
    """int64 fingerprint of each row of a 2-D tensor, reshaped to `shape`."""
    return tf.reshape(tf.bitcast(tf.fingerprint(rows), tf.int64), shape)


def salted(keys_, label):
    """`keys_` (any shape) mixed with the string `label`: one key space per feature."""
    salt = tf.bitcast(tf.fingerprint(tf.constant([label])), tf.int64)[0]
    flat = tf.reshape(keys_, [-1])
    pairs = tf.stack([tf.fill(tf.shape(flat), salt), flat], axis=1)
    return _fingerprint(pairs, tf.shape(keys_))


def shard_of(keys_, num_shards):
    """int32 shard index in [0, num_shards) of each int64 key (1-D)."""
    if num_shards == 1:
        return tf.zeros_like(keys_, tf.int32)
    mixed = _fingerprint(tf.reshape(keys_, [-1, 1]), tf.shape(keys_))
    return tf.cast(tf.math.floormod(mixed, num_shards), tf.int32)


def _unit_uniform(keys_, dim, seed):
    """[n, dim] float64 in (0, 1): a uniform draw per (key, element, seed)."""
    n = tf.size(keys_)
    data = tf.stack([
        tf.broadcast_to(keys_[:, None], [n, dim]),
        tf.broadcast_to(tf.range(dim, dtype=tf.int64)[None, :], [n, dim]),
        tf.fill([n, dim], tf.constant(seed, tf.int64)),
    ], axis=2)
    bits = _fingerprint(tf.reshape(data, [-1, 3]), [n, dim])
    mantissa = tf.bitwise.bitwise_and(tf.bitwise.right_shift(bits, 11), _MANTISSA - 1)
    return (tf.cast(mantissa, tf.float64) + 0.5) / _MANTISSA


def initializer_spec(initializer):
    """(kind, parameters) of a Keras initializer a dynamic table can apply per id.

    Raises ValueError naming the supported initializers for any other.
    """
    initializer = keras.initializers.get(initializer)
    kind = type(initializer).__name__
    if kind not in SUPPORTED_INITIALIZERS:
        raise ValueError(
            f"DynamicEmbedding: `embeddings_initializer` must be one of "
            f"{', '.join(SUPPORTED_INITIALIZERS)} (or their names, e.g. 'uniform'): a table "
            f"without a fixed shape draws each new id's vector on its own. Received: "
            f"embeddings_initializer={initializer!r}. Use for example "
            f"keras.initializers.RandomUniform(-0.05, 0.05, seed=1).")
    config = initializer.get_config()
    seed = config.pop("seed", None)
    return kind, config, seed if isinstance(seed, int) else None


def initial_rows(keys_, dim, kind, config, seed, dtype=tf.float32):
    """[n, dim] initial vectors of the 1-D int64 `keys_`, one per key, per `initializer_spec`."""
    n = tf.size(keys_)
    if kind == "Zeros":
        return tf.zeros([n, dim], dtype)
    if kind in ("Ones", "Constant"):
        return tf.fill([n, dim], tf.cast(config.get("value", 1.0), dtype))
    u = _unit_uniform(keys_, dim, seed)
    if kind == "RandomUniform":
        low, high = config["minval"], config["maxval"]
        return tf.cast(low + (high - low) * u, dtype)
    if kind == "TruncatedNormal":  # Keras truncates at two standard deviations.
        lower = 0.5 * math.erfc(2 / math.sqrt(2))
        u = lower + (1 - 2 * lower) * u
    return tf.cast(config["mean"] + config["stddev"] * tf.math.ndtri(u), dtype)
