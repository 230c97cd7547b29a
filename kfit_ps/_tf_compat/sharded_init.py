"""The initial value of one shard of a sharded Keras variable.

A Keras initializer called with a shard's shape gets two things wrong: it
takes its fans (Glorot, He, LeCun) from the shard's shape, and, since an
unseeded Keras initializer holds a fixed integer seed, every shard of the
same shape receives the same numbers (rows `i` and `i + rows/2` of a
2-shard table start equal). `shard_value` fixes both:

- element-wise random initializers (`RandomUniform`, `RandomNormal`,
  `TruncatedNormal`, `VarianceScaling` and its Glorot/He/LeCun forms) are
  called with the shard's shape, a seed derived from their seed and the
  shard's offset (so shards differ, and a seeded initializer gives the same
  values on every run), and for `VarianceScaling` a scale that makes the
  fans those of the whole variable;
- constant initializers (`Zeros`, `Ones`, `Constant`) are called with the
  shard's shape;
- anything else (`Orthogonal`, `Identity`, a user's initializer) builds the
  whole value and keeps the shard's rows. TensorFlow's parameter-server
  strategy evaluates a shard's initial value on that shard's ps task, so the
  whole value is built there, never on the coordinator.

This is how `tf_keras` initializers treat `partition_offset` (a seed nonce),
done for Keras 3 initializers, whose fan computation is private.
"""

import copy
import zlib

import keras
from keras.src.initializers.random_initializers import compute_fans

_ELEMENTWISE = (
    keras.initializers.RandomUniform,
    keras.initializers.RandomNormal,
    keras.initializers.TruncatedNormal,
    keras.initializers.VarianceScaling,
    keras.initializers.GlorotUniform,
    keras.initializers.GlorotNormal,
    keras.initializers.HeUniform,
    keras.initializers.HeNormal,
    keras.initializers.LecunUniform,
    keras.initializers.LecunNormal,
)
_SHAPE_ONLY = (keras.initializers.Zeros, keras.initializers.Ones, keras.initializers.Constant)


def _shard_seed(seed, offset):
    """A 32-bit seed for the shard at row `offset` (the seed itself for the first shard)."""
    if offset == 0:
        return seed
    return zlib.crc32(f"{seed}/{offset}".encode())


def _fan(initializer, shape):
    """The fan that `VarianceScaling` divides its scale by, for `shape`."""
    fan_in, fan_out = compute_fans(shape, input_axes=getattr(initializer, "input_axes", None),
                                   output_axes=getattr(initializer, "output_axes", None))
    fan = {"fan_in": fan_in, "fan_out": fan_out}.get(initializer.mode,
                                                     (fan_in + fan_out) / 2.0)
    return max(1.0, fan)


def shard_value(initializer, shape, dtype, partition_shape, partition_offset):
    """The initial value of the shard `partition_shape` at `partition_offset` of `shape`."""
    shape, partition_shape = tuple(shape), tuple(partition_shape)
    offset = int(partition_offset[0])
    kind = type(initializer)
    if kind in _SHAPE_ONLY:
        return initializer(partition_shape, dtype=dtype)
    if kind in _ELEMENTWISE:
        shard = copy.copy(initializer)
        if isinstance(initializer.seed, int):  # A SeedGenerator advances by itself.
            shard.seed = _shard_seed(initializer.seed, offset)
        if isinstance(initializer, keras.initializers.VarianceScaling):
            shard.scale = initializer.scale * (_fan(initializer, partition_shape)
                                               / _fan(initializer, shape))
        return shard(partition_shape, dtype=dtype)
    whole = initializer(shape, dtype=dtype)
    return whole[offset:offset + partition_shape[0]]
