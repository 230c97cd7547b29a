"""Public view of sharded variables."""

from kfit_ps import _tf_compat


def shards(variable):
    """The component `tf.Variable`s of a Keras (or TF) variable, in row order.

    A variable that a `variable_partitioner` split along axis 0 has one
    component per shard, each on its own ps task (`.device`) with its rows
    (`.shape`); any other variable has one component, itself.

    ```python
    [(s.device, tuple(s.shape)) for s in kfit_ps.shards(layer.embeddings)]
    # [('/job:ps/replica:0/task:0/device:CPU:0', (512, 1024)),
    #  ('/job:ps/replica:0/task:1/device:CPU:0', (512, 1024))]
    ```
    """
    components = _tf_compat.shards(variable)
    if any(c is None for c in components):
        raise ValueError(f"`shards` needs a created variable. Received: variable={variable!r}, "
                         "which has no storage yet. Build the layer first.")
    return components
