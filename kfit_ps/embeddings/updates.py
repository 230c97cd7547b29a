"""Optimizer formulas on the rows a step touched: what a dynamic table's update runs on its ps.

A dynamic table stores, next to each row, that row's optimizer slots. A step
reads the touched rows and slots, applies one of these formulas and writes
both back, so untouched rows and their slots never move: the *lazy*
semantics of kfit_ps' sharded tables (`training.sharded_updates`):

- `SGD` (momentum, Nesterov): Keras' formulas on the rows;
- `Adagrad`: Keras' formula on the rows;
- `Adam` / `AdamW` (and `amsgrad`): lazy Adam, bias correction by the global
  step, as Keras does; weight decay on the touched rows, before the update.

The hyperparameters are the model's optimizer's; the learning rate and the
step are the values the step read once (they travel with the gradients).
"""

import keras
import tensorflow as tf

SUPPORTED = ("SGD", "Adagrad", "Adam", "AdamW")


def slot_names(optimizer):
    """The slot names a dynamic table keeps per row for `optimizer` (may be empty).

    Raises ValueError naming the supported optimizers for any other.
    """
    if isinstance(optimizer, keras.optimizers.Adam):  # AdamW is an Adam.
        return ("m", "v", "v_hat") if optimizer.amsgrad else ("m", "v")
    if isinstance(optimizer, keras.optimizers.Adagrad):
        return ("accumulator",)
    if isinstance(optimizer, keras.optimizers.SGD):
        return ("momentum",) if optimizer.momentum else ()
    raise ValueError(
        f"DynamicEmbedding tables are updated by {', '.join(SUPPORTED)} (the model's "
        f"optimizer, with its own hyperparameters). Received: optimizer="
        f"{type(optimizer).__name__}. Compile the model with one of those.")


def initial_slots(optimizer, n, dim):
    """Slot rows of ids that have none yet: zeros, except Adagrad's initial accumulator."""
    names = slot_names(optimizer)
    value = (optimizer.initial_accumulator_value
             if isinstance(optimizer, keras.optimizers.Adagrad) else 0.0)
    return tf.fill([n, dim * len(names)], tf.constant(value, tf.float32))


def apply(optimizer, rows, slots, g, lr, step):
    """(new rows, new slots) after one update with gradient rows `g`.

    `slots` is [n, dim * len(slot_names)], the slots side by side in
    `slot_names` order; `lr` and `step` are float32 scalars.
    """
    names = slot_names(optimizer)
    parts = dict(zip(names, tf.split(slots, len(names), axis=1))) if names else {}
    if optimizer.weight_decay:
        rows = rows - rows * tf.cast(optimizer.weight_decay, tf.float32) * lr
    if isinstance(optimizer, keras.optimizers.Adam):
        rows = rows - _adam(optimizer, parts, g, lr, step)
    elif isinstance(optimizer, keras.optimizers.Adagrad):
        parts["accumulator"] = parts["accumulator"] + tf.square(g)
        rows = rows - lr * g / tf.sqrt(parts["accumulator"] + optimizer.epsilon)
    elif "momentum" in parts:
        momentum = tf.cast(optimizer.momentum, tf.float32)
        m = parts["momentum"] * momentum - lr * g
        parts["momentum"] = m
        rows = rows + (m * momentum - lr * g if optimizer.nesterov else m)
    else:
        rows = rows - lr * g
    new_slots = tf.concat([parts[name] for name in names], axis=1) if names else slots
    return rows, new_slots


def _adam(optimizer, parts, g, lr, step):
    beta_1 = tf.cast(optimizer.beta_1, tf.float32)
    beta_2 = tf.cast(optimizer.beta_2, tf.float32)
    alpha = lr * tf.sqrt(1 - tf.pow(beta_2, step)) / (1 - tf.pow(beta_1, step))
    parts["m"] = parts["m"] + (g - parts["m"]) * (1 - beta_1)
    parts["v"] = parts["v"] + (tf.square(g) - parts["v"]) * (1 - beta_2)
    v = parts["v"]
    if "v_hat" in parts:
        parts["v_hat"] = v = tf.maximum(parts["v_hat"], v)
    return parts["m"] * alpha / (tf.sqrt(v) + optimizer.epsilon)
