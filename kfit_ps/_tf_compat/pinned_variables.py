"""A variable on a device of our choosing, even inside a ParameterServerStrategy scope.

TensorFlow's parameter-server strategy places every `tf.Variable` created in
its scope round-robin over the ps tasks and ignores `tf.device`. A dynamic
table's counters (rows admitted, evicted, the most rows held) must sit next
to the table's shard, on that shard's ps, so that the update running there
increments them in place. `ResourceVariable(...)` is the concrete class: it
does not pass through the variable-creator stack, so the device holds.
"""

import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from kfit_ps._tf_compat.versions import check_versions


def pinned_variable(initial_value, device, name):
    """A non-trainable resource variable stored on `device`, created eagerly."""
    check_versions()
    with tf.init_scope(), tf.device(device):
        return resource_variable_ops.ResourceVariable(
            initial_value, trainable=False, name=name)
