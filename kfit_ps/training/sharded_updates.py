"""Gradient steps for models with sharded variables: only touched rows move.

A sharded variable's gradient is taken with respect to its shards: for an
embedding lookup, each shard's gradient is an `IndexedSlices` of the rows the
batch touched. The update then reads and writes only those rows of the shard
and of its optimizer slots (which are sharded the same way, on the same ps
tasks). Duplicate ids are summed on the worker, so each unique row's gradient
is sent once; the update itself runs on the shard's ps task (gathers, the
formula, scatters), so no table or slot row leaves the ps:

- `SGD` (with or without momentum, Nesterov): Keras' formulas on the rows;
- `Adagrad`: Keras' formula on the rows;
- `Adam` / `AdamW` (and `amsgrad`): *lazy* Adam: moments of untouched rows
  are not decayed in that step (the dense formula would rewrite every row).
  Bias correction uses the global step, as Keras does.

Weight decay (`weight_decay=`, AdamW's default) is applied to the touched
rows only, before the update, as Keras applies it to whole variables.

Other Keras optimizers get the sharded variable's whole gradient in Keras'
own `optimizer.apply`, with the dense variables, so their per-step state
(Nadam's momentum schedule, ScheduleFree's averages, ...) advances as Keras
does it; every row and slot is then read and written each step: correct,
not sparse. Dense (unsharded) variables always take Keras' own
`optimizer.apply`, which also increments `iterations` once per step.

Options that need every gradient at once (`clipnorm`, `clipvalue`,
`global_clipnorm`) and `gradient_accumulation_steps` are refused at the start
of `fit` for models with sharded variables (`use_ema` for every model, see
`loop`).
"""

import keras
import tensorflow as tf

from kfit_ps import _tf_compat

_REFUSED = ("clipnorm", "clipvalue", "global_clipnorm", "gradient_accumulation_steps")


def has_sharded_variables(model):
    return any(_tf_compat.sharded_storage(v) is not None for v in model.trainable_variables)


def check_optimizer(model):
    """Raises ValueError if the model's optimizer cannot update its sharded variables."""
    optimizer = model.optimizer
    for option in _REFUSED:
        value = getattr(optimizer, option, None)
        if value:
            raise ValueError(
                f"Model {model.name!r} has sharded variables (variable_partitioner), and its "
                f"optimizer {type(optimizer).__name__} has {option}={value!r}, which needs "
                f"all gradients of a step at once. Received: {option}={value!r}. Remove "
                f"{option}, or create the model without a variable_partitioner.")


def _unique_rows(gradient, rows):
    """(unique row ids, summed gradient rows) of an IndexedSlices or dense gradient."""
    if isinstance(gradient, tf.IndexedSlices):
        ids, positions = tf.unique(gradient.indices)
        values = tf.math.unsorted_segment_sum(gradient.values, positions, tf.size(ids))
        return ids, values
    return tf.range(rows, dtype=tf.int64), gradient


def _scatter(variable, ids, values, op):
    getattr(variable, op)(tf.IndexedSlices(values, ids))


class ShardedGradientStep:
    """`apply_gradients(tape, loss)` for `_tf_compat.train_step_with`."""

    def __init__(self, model):
        self.model = model
        self.optimizer = model.optimizer

    def __call__(self, tape, loss):
        variables = self.model.trainable_variables
        groups = [_tf_compat.shards(v) for v in variables]
        flat = tape.gradient(loss, [s for group in groups for s in group])
        dense_vars, dense_grads, sharded, position = [], [], [], 0
        for variable, group in zip(variables, groups):
            grads = flat[position:position + len(group)]
            position += len(group)
            if _tf_compat.sharded_storage(variable) is None:
                dense_vars.append(variable)
                dense_grads.append(grads[0])
                continue
            slots = _tf_compat.optimizer_slots(self.optimizer, variable)
            if slots is None:
                # No sparse path for this optimizer: Keras' own apply, dense, in step order.
                dense_vars.append(variable)
                dense_grads.append(tf.concat(
                    [tf.convert_to_tensor(g) if g is not None else tf.zeros(s.shape, s.dtype)
                     for g, s in zip(grads, group)], axis=0))
            elif any(g is not None for g in grads):
                sharded.append((slots, group, grads))
        optimizer = self.optimizer
        learning_rate = tf.convert_to_tensor(optimizer.learning_rate)  # at this step
        step = tf.cast(optimizer.iterations, tf.float32) + 1.0
        for slots, group, grads in sharded:
            self._apply_sharded(slots, group, grads, learning_rate, step)
        if dense_vars:
            optimizer.apply(dense_grads, dense_vars)
        else:
            optimizer.iterations.assign_add(1)

    def _apply_sharded(self, slots, group, grads, learning_rate, step):
        optimizer = self.optimizer
        slot_shards = {name: _tf_compat.shards(slot) for name, slot in slots.items()}
        for j, (shard, grad) in enumerate(zip(group, grads)):
            if grad is None:
                continue
            ids, g = _unique_rows(grad, shard.shape[0])  # On the worker: U rows leave it.
            with tf.device(shard.device):  # The ps updates its rows and slots in place.
                self._apply_shard(optimizer, shard, ids, g, slot_shards, j, learning_rate, step)

    def _apply_shard(self, optimizer, shard, ids, g, slot_shards, j, learning_rate, step):
        g = tf.cast(g, shard.dtype)
        lr = tf.cast(learning_rate, shard.dtype)
        local = {name: shards_[j] for name, shards_ in slot_shards.items()}
        if optimizer.weight_decay:  # Keras decays before the update; here touched rows.
            decay = tf.cast(optimizer.weight_decay, shard.dtype) * lr
            _scatter(shard, ids, tf.gather(shard, ids) * decay, "scatter_sub")
        if isinstance(optimizer, keras.optimizers.Adam):
            self._adam(shard, local, ids, g, lr, tf.cast(step, shard.dtype))
        elif isinstance(optimizer, keras.optimizers.Adagrad):
            acc = local["accumulator"]
            rows = tf.gather(acc, ids) + tf.square(g)
            _scatter(acc, ids, rows, "scatter_update")
            _scatter(shard, ids, lr * g / tf.sqrt(rows + optimizer.epsilon), "scatter_sub")
        else:  # SGD
            self._sgd(shard, local, ids, g, lr)

    def _sgd(self, shard, slots, ids, g, lr):
        optimizer = self.optimizer
        if "momentum" not in slots:
            _scatter(shard, ids, lr * g, "scatter_sub")
            return
        m = slots["momentum"]
        momentum = tf.cast(optimizer.momentum, shard.dtype)
        m_rows = tf.gather(m, ids) * momentum - lr * g
        _scatter(m, ids, m_rows, "scatter_update")
        delta = m_rows * momentum - lr * g if optimizer.nesterov else m_rows
        _scatter(shard, ids, delta, "scatter_add")

    def _adam(self, shard, slots, ids, g, lr, step):
        optimizer = self.optimizer
        beta_1 = tf.cast(optimizer.beta_1, shard.dtype)
        beta_2 = tf.cast(optimizer.beta_2, shard.dtype)
        alpha = lr * tf.sqrt(1 - tf.pow(beta_2, step)) / (1 - tf.pow(beta_1, step))
        m_rows = tf.gather(slots["m"], ids)
        v_rows = tf.gather(slots["v"], ids)
        m_rows = m_rows + (g - m_rows) * (1 - beta_1)
        v_rows = v_rows + (tf.square(g) - v_rows) * (1 - beta_2)
        _scatter(slots["m"], ids, m_rows, "scatter_update")
        _scatter(slots["v"], ids, v_rows, "scatter_update")
        if "v_hat" in slots:
            v_rows = tf.maximum(tf.gather(slots["v_hat"], ids), v_rows)
            _scatter(slots["v_hat"], ids, v_rows, "scatter_update")
        _scatter(shard, ids, m_rows * alpha / (tf.sqrt(v_rows) + optimizer.epsilon),
                 "scatter_sub")
