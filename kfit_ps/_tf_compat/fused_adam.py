"""Keras 3's Adam update in one TensorFlow kernel per variable.

Keras' `Adam.update_step` is about a dozen small ops per variable (casts,
powers, two moment updates, the step). On a ps each op is scheduled by the
executor one by one, and a DLRM's dozens of small variables make that the
ps's main cost. TensorFlow's `ResourceApplyAdam` computes the same formula
(`lr_t = lr * sqrt(1 - beta_2^t) / (1 - beta_1^t)`, `m += (g - m)(1 - beta_1)`,
`v += (g^2 - v)(1 - beta_2)`, `var -= lr_t * m / (sqrt(v) + epsilon)`) in one
kernel, under the variable's lock (`use_locking`), so two workers cannot
interleave inside one update.

`apply_adam` replaces `optimizer.apply(grads, variables)` only when nothing
else of Keras' apply would run: a plain `Adam` / `AdamW` whose update step
is Keras' own, without `amsgrad`, gradient clipping or accumulation, loss
scaling or variables that take their gradient as their value. Weight decay
(AdamW) is applied first, and constraints after, as Keras' `apply` does.
Otherwise it returns False and the caller uses Keras' `apply`.
"""

import keras
import tensorflow as tf

from kfit_ps._tf_compat.keras_variables import storage
from kfit_ps._tf_compat.versions import check_versions

_NOT_FUSED = ("clipnorm", "clipvalue", "global_clipnorm", "gradient_accumulation_steps",
              "loss_scale_factor", "use_ema")


def can_fuse(optimizer, variables):
    """Whether `apply_adam` computes exactly what Keras' `apply` would."""
    check_versions()
    if not isinstance(optimizer, keras.optimizers.Adam) or optimizer.amsgrad:
        return False
    if type(optimizer).update_step is not keras.optimizers.Adam.update_step:
        return False
    if any(getattr(optimizer, option, None) for option in _NOT_FUSED):
        return False
    return all(not getattr(v, "overwrite_with_gradient", False) and storage(v) is not None
               and hasattr(storage(v), "handle") for v in variables)


def apply_adam(optimizer, grads, variables, scalars_on):
    """Keras' `optimizer.apply(grads, variables)` for a fusable Adam (see `can_fuse`).

    `scalars_on(device)`: (learning rate, step number) of this step as float32
    tensors available on `device` (the step number is `iterations + 1`). Each
    update runs on its variable's device, next to its moment slots.
    """
    pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
    if pairs:
        optimizer._apply_weight_decay([v for _, v in pairs])
    scalars = {}  # (device, dtype) -> the step's scalars there: made once per ps and dtype
    for grad, variable in pairs:
        index = optimizer._get_variable_index(variable)
        inner = storage(variable)
        dtype = inner.dtype
        with tf.device(inner.device):
            if (inner.device, dtype) not in scalars:
                learning_rate, step = scalars_on(inner.device)
                local_step = tf.cast(step, dtype)
                beta_1 = tf.cast(optimizer.beta_1, dtype)
                beta_2 = tf.cast(optimizer.beta_2, dtype)
                scalars[inner.device, dtype] = dict(
                    beta1_power=tf.pow(beta_1, local_step),
                    beta2_power=tf.pow(beta_2, local_step), lr=tf.cast(learning_rate, dtype),
                    beta1=beta_1, beta2=beta_2, epsilon=tf.cast(optimizer.epsilon, dtype))
            tf.raw_ops.ResourceApplyAdam(
                var=inner.handle, m=storage(optimizer._momentums[index]).handle,
                v=storage(optimizer._velocities[index]).handle,
                grad=tf.cast(tf.convert_to_tensor(grad), dtype), use_locking=True,
                **scalars[inner.device, dtype])
    for _, variable in pairs:
        if variable.constraint is not None:
            variable.assign(variable.constraint(variable))
    optimizer.iterations.assign_add(1)
