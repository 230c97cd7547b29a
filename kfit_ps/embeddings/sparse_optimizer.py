"""Keras' optimizer `apply`, for the rows one step touched: the one update of every sparse table.

kfit_ps' sharded variables (`training.step.sparse_updaters`) and dynamic tables
(`embeddings.table`) both update only the rows a step touched, with those
rows' optimizer slots (the *lazy* rule: untouched rows and slots do not move
in that step). Both call `SparseOptimizer.apply`, which does what Keras'
`Optimizer.apply` does to a variable, in Keras' order and with Keras'
arithmetic (betas' complements as Python floats, as `adam.py` takes them):

1. the gradient is divided by `loss_scale_factor`;
2. weight decay, `row -= row * weight_decay * lr`, unless the variable is
   excluded (`exclude_from_weight_decay`);
3. the optimizer's formula: `SGD` (momentum, Nesterov), `Adagrad`, `Adam` /
   `AdamW` (`amsgrad` too), with the bias correction of the global step;
4. the variable's constraint: a row-wise one (`NonNeg`, or `MaxNorm`,
   `UnitNorm`, `MinMaxNorm` over the last axis) on the touched rows here;
   any other constraint spans rows, and the sharded updater applies it to the
   whole variable, as Keras does (`row_constraint` tells which).

`gradient_accumulation_steps` and the clipping options need every gradient
of a step at once; they are refused, with the same message, for every model
that has a sparse table (`check_optimizer`).
"""

import keras
import tensorflow as tf

from kfit_ps import _tf_compat

SUPPORTED = ("SGD", "Adagrad", "Adam", "AdamW")
REFUSED_OPTIONS = ("clipnorm", "clipvalue", "global_clipnorm", "gradient_accumulation_steps")
_ROW_NORMS = (keras.constraints.MaxNorm, keras.constraints.UnitNorm,
              keras.constraints.MinMaxNorm)


def slot_names(optimizer):
    """The slots kept per row for `optimizer`, in the order they are stored (may be empty).

    Raises ValueError naming the supported optimizers for any other.
    """
    if isinstance(optimizer, keras.optimizers.Adam):  # AdamW is an Adam.
        return ("m", "v", "v_hat") if optimizer.amsgrad else ("m", "v")
    if isinstance(optimizer, keras.optimizers.Adagrad):
        return ("accumulator",)
    if isinstance(optimizer, keras.optimizers.SGD):
        return ("momentum",) if optimizer.momentum else ()
    raise ValueError(
        f"Dynamic embedding tables are updated by {', '.join(SUPPORTED)} (the model's optimizer "
        f"or the layer's own `optimizer`). Received: optimizer={type(optimizer).__name__}. "
        "Use one of those.")


def initial_slot_value(optimizer, name):
    """A new row's value of slot `name`: zeros, except Adagrad's initial accumulator."""
    return float(optimizer.initial_accumulator_value) if name == "accumulator" else 0.0


def row_constraint(constraint):
    """Whether `constraint` acts on each row alone (so it may run on the touched rows only)."""
    if constraint is None or isinstance(constraint, keras.constraints.NonNeg):
        return True
    if isinstance(constraint, _ROW_NORMS):
        axis = constraint.axis
        axes = tuple(axis) if isinstance(axis, (list, tuple)) else (axis,)
        return axes in ((1,), (-1,))
    return False


def check_optimizer(optimizer, owner):
    """Raises ValueError if `optimizer` has an option no sparse update honours."""
    for option in REFUSED_OPTIONS:
        value = getattr(optimizer, option, None)
        if value:
            raise ValueError(
                f"{owner} has sparse tables (sharded variables or DynamicEmbedding layers), and "
                f"its optimizer {type(optimizer).__name__} has {option}={value!r}, which needs "
                f"every gradient of a step at once. Received: {option}={value!r}. Remove "
                f"{option} (or train without sparse tables).")


class SparseOptimizer:
    """Keras' `apply` of `optimizer` for the touched rows of one table.

    Args:
        optimizer: a Keras `SGD`, `Adagrad`, `Adam` or `AdamW`.
        decay: whether weight decay applies to this table (False when the
            table is excluded with `exclude_from_weight_decay`).
        constraint: the table's constraint, applied to the new rows when it is
            row-wise (`row_constraint`); other constraints are the caller's.
    """

    def __init__(self, optimizer, decay=True, constraint=None):
        self.optimizer = optimizer
        self.slot_names = slot_names(optimizer)
        self.decay = bool(decay and optimizer.weight_decay)
        self.constraint = constraint if constraint is not None and row_constraint(
            constraint) else None

    @classmethod
    def for_variable(cls, optimizer, variable):
        """The update of a Keras variable's rows: its exclusion and constraint as Keras reads them."""
        return cls(optimizer, decay=_tf_compat.uses_weight_decay(optimizer, variable),
                   constraint=variable.constraint)

    @property
    def needs_rows(self):
        """Whether the update reads the rows (weight decay, a constraint), not only the slots."""
        return self.decay or self.constraint is not None

    def apply(self, rows, slots, gradients, learning_rate, step):
        """(new rows, new slots) after one step; `slots` is {name: rows of that slot}.

        `learning_rate` is this step's rate (a schedule read at the step
        before it), `step` the optimizer's `iterations + 1` (any dtype).
        """
        dtype = rows.dtype
        lr = tf.cast(learning_rate, dtype)
        if self.decay:
            rows = rows - rows * tf.cast(self.optimizer.weight_decay, dtype) * lr
        change, slots = self.change(slots, gradients, lr, step, dtype)
        rows = rows + change
        if self.constraint is not None:
            rows = tf.cast(self.constraint(rows), dtype)
        return rows, slots

    def change(self, slots, gradients, learning_rate, step, dtype=tf.float32):
        """(what the formula adds to the rows, new slots), without weight decay or constraint.

        Keras subtracts its update; adding its negation gives the same bits,
        so a table without decay or constraint (`needs_rows` False) can
        `scatter_add` this without reading its rows.
        """
        optimizer = self.optimizer
        g = tf.cast(gradients, dtype)
        if optimizer.loss_scale_factor is not None:
            g = g / optimizer.loss_scale_factor
        lr = tf.cast(learning_rate, dtype)
        slots = dict(slots)
        if isinstance(optimizer, keras.optimizers.Adam):
            return -self._adam(slots, g, lr, tf.cast(step, dtype)), slots
        if isinstance(optimizer, keras.optimizers.Adagrad):
            slots["accumulator"] = slots["accumulator"] + tf.square(g)
            return -(lr * g / tf.sqrt(slots["accumulator"] + optimizer.epsilon)), slots
        if "momentum" in slots:
            momentum = tf.cast(optimizer.momentum, dtype)
            m = slots["momentum"] * momentum - g * lr
            slots["momentum"] = m
            return (m * momentum - g * lr if optimizer.nesterov else m), slots
        return -(g * lr), slots

    def _adam(self, slots, g, lr, step):
        optimizer, dtype = self.optimizer, g.dtype
        beta_1_power = tf.pow(tf.cast(optimizer.beta_1, dtype), step)
        beta_2_power = tf.pow(tf.cast(optimizer.beta_2, dtype), step)
        alpha = lr * tf.sqrt(1 - beta_2_power) / (1 - beta_1_power)
        # Keras multiplies by `1 - self.beta_1` computed in Python, not in float32.
        slots["m"] = slots["m"] + (g - slots["m"]) * _complement(optimizer.beta_1, dtype)
        slots["v"] = slots["v"] + (tf.square(g) - slots["v"]) * _complement(optimizer.beta_2,
                                                                           dtype)
        v = slots["v"]
        if "v_hat" in slots:
            slots["v_hat"] = v = tf.maximum(slots["v_hat"], v)
        return slots["m"] * alpha / (tf.sqrt(v) + optimizer.epsilon)


def _complement(beta, dtype):
    if isinstance(beta, (int, float)):
        return 1 - beta
    return 1 - tf.cast(beta, dtype)
