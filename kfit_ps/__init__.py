"""kfit_ps: parameter-server training for Keras 3 `model.fit`.

Importing kfit_ps routes `Model.fit` / `evaluate` / `predict` of models built
under a `kfit_ps.ParameterServerStrategy` scope to the parameter-server loop,
and makes `assign_add` / `assign_sub` of Keras variables created under that
scope atomic on the ps. Nothing changes for other models and variables.
It also keeps TensorFlow's C++ log lines off standard error
(`kfit_ps.tf_logs`; `KFIT_PS_TF_LOGS=1` shows them).

```python
import kfit_ps
with kfit_ps.LocalCluster(num_workers=2, num_ps=1) as cluster:
    strategy = kfit_ps.ParameterServerStrategy(cluster.cluster_resolver)
    with strategy.scope():
        model = build_model()
        model.compile(optimizer="adam", loss="binary_crossentropy")
    model.fit(kfit_ps.DatasetCreator(dataset_fn), epochs=3, steps_per_epoch=100)
```
"""

import os as _os

_os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from kfit_ps import tf_logs as _tf_logs  # noqa: E402

_tf_logs.install()  # Before TensorFlow is imported: its C++ log lines stay off stderr.

from kfit_ps import constants as _constants  # noqa: E402
from kfit_ps import errors  # noqa: E402
from kfit_ps import training as _training  # noqa: E402
from kfit_ps.cluster.job import job_cluster  # noqa: E402
from kfit_ps.cluster.local import LocalCluster  # noqa: E402
from kfit_ps.cluster.spec import ClusterConfig  # noqa: E402
from kfit_ps.strategy import ParameterServerStrategy, shards  # noqa: E402
from kfit_ps import partitioners  # noqa: E402
from kfit_ps.training import (DatasetCreator, SidecarEvaluator, export_saved_model,  # noqa: E402
                              shardable)
from kfit_ps import callbacks  # noqa: E402
from kfit_ps import layers  # noqa: E402
from kfit_ps import ledger  # noqa: E402
from kfit_ps.errors import ClusterError, ParameterServerError, WorkersLostError  # noqa: E402
from kfit_ps.launch import LaunchConfig, run, scale  # noqa: E402

__version__ = "0.1.0"

_training.install()
if _constants.launched():  # A chief of `kfit-ps run`: a ClusterError exits with status 75,
    # and SIGTERM stops `fit` at a safe point after a last backup (status 143).
    from kfit_ps._tf_compat import remove_autograph_files as _remove_autograph_files
    from kfit_ps.training import preemption as _preemption

    errors.exit_with_status_on_cluster_error(_remove_autograph_files)
    _preemption.install()

__all__ = [
    "ClusterConfig",
    "ClusterError",
    "DatasetCreator",
    "LaunchConfig",
    "LocalCluster",
    "ParameterServerError",
    "ParameterServerStrategy",
    "SidecarEvaluator",
    "WorkersLostError",
    "__version__",
    "callbacks",
    "errors",
    "export_saved_model",
    "job_cluster",
    "layers",
    "ledger",
    "partitioners",
    "run",
    "scale",
    "shardable",
    "shards",
]
