"""`use_ema=True` under parameter-server training: Keras' moving averages, updated on the ps.

Keras 3 updates an optimizer's moving averages inside its `apply` and
overwrites the variables with them (`ema_overwrite_frequency`) in a
conditional that TensorFlow's distribution strategies reject. kfit_ps'
gradient step traces Keras' `apply` without them
(`_tf_compat.keras_averages_off`) and, after the step's updates, runs Keras'
formulas here:

- `update`: `average = m * average + (1 - m) * variable`, with
  `m = ema_momentum`, except 0 on the first step (Keras' rule), written as
  `average -= (1 - m) * (average - variable)`, one atomic subtraction, so
  concurrent workers' updates are all kept; each average is updated on its
  own device, a sharded one shard by shard, so nothing crosses the network;
- every `ema_overwrite_frequency` steps, each variable takes its average's
  value;
- `finalize`: at the end of `fit`, each variable takes its average's value
  (Keras' `finalize_variable_values`).

Dynamic embedding tables keep no moving average: their rows are not Keras
variables, and an average of a row that is evicted and re-admitted has no
meaning.
"""

import tensorflow as tf

from kfit_ps import _tf_compat


def _pairs(optimizer):
    """[(variable part, average part)] on the same devices where the two are sharded alike."""
    pairs = []
    for variable, average in _tf_compat.moving_average_pairs(optimizer):
        parts, averages = _tf_compat.shards(variable), _tf_compat.shards(average)
        if len(parts) == len(averages):
            pairs += list(zip(parts, averages))
        else:
            pairs.append((variable, average))
    return pairs


def update(optimizer, step):
    """The averages after this step (`step`: `iterations + 1` of this step, int64)."""
    not_first = tf.not_equal(step, 1)
    writes = []
    for variable, average in _pairs(optimizer):
        with tf.device(average.device):
            momentum = tf.cast(not_first, average.dtype) * optimizer.ema_momentum
            # Keras' `m * average + (1 - m) * variable` as one in-place subtraction on the
            # ps (`assign_sub` is atomic there): an update of another worker between the read
            # and the write is kept, not overwritten (as BatchNormalization's statistics).
            # The first step assigns the variable (m = 0): several workers' first steps
            # would otherwise each add the variable to the zero-initialised average.
            writes.append(tf.cond(
                not_first,
                lambda a=average, v=variable, m=momentum: a.assign_sub(
                    (1 - m) * (a - tf.convert_to_tensor(v))),
                lambda a=average, v=variable: a.assign(tf.convert_to_tensor(v))))
    frequency = optimizer.ema_overwrite_frequency
    if not frequency:
        return
    with tf.control_dependencies(writes):
        tf.cond(tf.equal(tf.math.floormod(step, frequency), 0),
                lambda: _overwrite(optimizer), lambda: tf.constant(False))


def _overwrite(optimizer):
    for variable, average in _pairs(optimizer):
        with tf.device(variable.device):
            variable.assign(tf.convert_to_tensor(average))
    return tf.constant(True)


def finalize(optimizer):
    """Each variable takes its average's value (eagerly, at the end of `fit`)."""
    if getattr(optimizer, "use_ema", False):
        _overwrite(optimizer)
