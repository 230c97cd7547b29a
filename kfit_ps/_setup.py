"""Preparing a process to train: the hooks kfit_ps installs in Keras and TensorFlow.

`prepare_training()` runs once, when a process first asks the package root for
a training name (`kfit_ps.ParameterServerStrategy`, `kfit_ps.LocalCluster`,
`kfit_ps.DatasetCreator`, `kfit_ps.layers`, ...), and in the
`kfit-ps quickstart` and `kfit-ps evaluator` commands:

1. `Model.fit` / `evaluate` / `predict` of models built under a kfit_ps
   strategy scope go to the parameter-server loop, and `assign_add` /
   `assign_sub` of their variables are atomic on the ps
   (`kfit_ps.training.install`); importing the training layer registers
   `kfit_ps.layers.DynamicEmbedding` with `keras.saving`;
2. in a chief started by `kfit-ps run`, an uncaught `ClusterError` exits with
   status 75 and SIGTERM stops `fit` at a safe point after a last backup
   (status 143).

The launcher (`kfit-ps run`, `status`, `scale`, `manifests`) never calls it:
it imports neither TensorFlow nor Keras.
"""

import functools

from kfit_ps import constants


@functools.cache  # Once per process: the steps below chain hooks (`sys.excepthook`).
def prepare_training():
    """Sets up this process for training, once; imports TensorFlow and Keras."""
    from kfit_ps import training

    training.install()
    if constants.launched():
        from kfit_ps._tf_compat import remove_autograph_files
        from kfit_ps.errors import exit_with_status_on_cluster_error
        from kfit_ps.training.resilience import preemption

        exit_with_status_on_cluster_error(remove_autograph_files)
        preemption.install()
