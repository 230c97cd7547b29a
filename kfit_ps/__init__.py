"""kfit_ps: parameter-server training for Keras 3 `model.fit`.

The first training name a process asks for (`kfit_ps.ParameterServerStrategy`,
`kfit_ps.LocalCluster`, `kfit_ps.DatasetCreator`, `kfit_ps.layers`, ...)
loads TensorFlow and Keras and routes `Model.fit` / `evaluate` / `predict` of
models built under a `kfit_ps.ParameterServerStrategy` scope to the
parameter-server loop, and makes `assign_add` / `assign_sub` of Keras
variables created under that scope atomic on the ps. Nothing changes for other
models and variables. See `kfit_ps._setup`.

`import kfit_ps` itself loads neither TensorFlow nor Keras, so the launcher
(`kfit-ps run`, `status`, `scale`, `manifests`, and `kfit_ps.launch`) starts
without them. It keeps TensorFlow's C++ log lines off standard error
(`kfit_ps.tf_logs`; `KFIT_PS_TF_LOGS=1` shows them), whoever imports
TensorFlow later.

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

import importlib as _importlib
import os as _os

_os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from kfit_ps import tf_logs as _tf_logs  # noqa: E402

_tf_logs.install()  # Before TensorFlow is imported: its C++ log lines stay off stderr.

__version__ = "0.1.0"

# Each public name and the module that defines it. The launcher's names load without
# TensorFlow; the others, and the public modules, prepare the process for training first.
_LAUNCHER_NAMES = {
    "ClusterConfig": "kfit_ps.cluster.spec",
    "LaunchConfig": "kfit_ps.launch",
    "run": "kfit_ps.launch",
    "scale": "kfit_ps.launch",
}
_TRAINING_NAMES = {
    "ClusterError": "kfit_ps.errors",
    "DatasetCreator": "kfit_ps.training",
    "LocalCluster": "kfit_ps.cluster.local",
    "ParameterServerError": "kfit_ps.errors",
    "ParameterServerStrategy": "kfit_ps.strategy",
    "SidecarEvaluator": "kfit_ps.evaluator",
    "WorkersLostError": "kfit_ps.errors",
    "export_saved_model": "kfit_ps.training",
    "job_cluster": "kfit_ps.cluster.job",
    "shardable": "kfit_ps.training",
    "shards": "kfit_ps.strategy",
}
_MODULES = {"callbacks", "errors", "layers", "ledger", "partitioners"}

__all__ = sorted([*_LAUNCHER_NAMES, *_TRAINING_NAMES, *_MODULES, "__version__"])


def __getattr__(name):
    """Loads a public name on first use (PEP 562), then keeps it as a module attribute.

    Any but the launcher's names first prepares the process for training
    (`kfit_ps._setup.prepare_training`). kfit_ps' own modules never ask the root for a
    name (`from kfit_ps import callbacks`): they import the module that defines it, so
    preparing never comes back here (tests/test_public_api.py checks it).
    """
    if name in _LAUNCHER_NAMES:
        value = getattr(_importlib.import_module(_LAUNCHER_NAMES[name]), name)
    elif name in _TRAINING_NAMES or name in _MODULES:
        _importlib.import_module("kfit_ps._setup").prepare_training()
        if name in _MODULES:
            value = _importlib.import_module(f"kfit_ps.{name}")
        else:
            value = getattr(_importlib.import_module(_TRAINING_NAMES[name]), name)
    else:
        raise AttributeError(f"module 'kfit_ps' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
