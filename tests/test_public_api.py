"""The public API, the layering rules, and the private-API gate."""

import ast
import pathlib
import pkgutil
import subprocess
import sys

import pytest

import kfit_ps
from tests import helpers

PACKAGE = pathlib.Path(kfit_ps.__file__).parent

# Which kfit_ps layers each layer may import. Layers point one way: cli -> launch and jobs ->
# cluster and training -> strategy -> _tf_compat; the leaves below may be used by any layer.
# `observe` (metrics, events, diagnosis; no TensorFlow) serves the launcher and the chief.
LEAVES = {"constants", "validation", "net", "errors", "membership"}
ALLOWED = {
    "cli": {"launch", "cluster", "training", "strategy", "jobs", "_tf_compat"} | LEAVES,
    "launch": {"launch", "cluster", "_tf_log_filter", "observe"} | LEAVES,
    "jobs": {"cluster", "training", "strategy", "data"} | LEAVES,
    "data": set(),
    "training": {"strategy", "_tf_compat", "training", "embeddings", "ledger", "observe"}
    | LEAVES,
    "cluster": {"cluster", "_tf_compat"} | LEAVES,
    "strategy": {"_tf_compat", "strategy"} | LEAVES,
    "_tf_compat": {"_tf_compat"},
    "constants": set(),
    "validation": {"constants"},
    "net": set(),
    "membership": set(),
    "errors": set(),
    "tf_logs": {"constants"},
    "_tf_log_filter": set(),
    "callbacks": {"training"},
    "layers": {"embeddings"},
    "embeddings": {"embeddings", "strategy", "_tf_compat"} | LEAVES,
    "partitioners": set(),
    "ledger": {"ledger", "_tf_compat"} | LEAVES,
    "observe": {"observe"} | LEAVES,
}


def test_all_is_the_public_api():
    assert sorted(kfit_ps.__all__) == sorted([
        "ClusterConfig", "ClusterError", "DatasetCreator", "LaunchConfig", "LocalCluster",
        "ParameterServerError", "ParameterServerStrategy", "SidecarEvaluator",
        "WorkersLostError", "__version__", "callbacks", "errors", "export_saved_model",
        "job_cluster", "layers", "ledger", "partitioners", "run", "scale", "shardable",
        "shards"])
    assert issubclass(kfit_ps.WorkersLostError, kfit_ps.ClusterError)
    assert issubclass(kfit_ps.ParameterServerError, kfit_ps.ClusterError)
    assert sorted(kfit_ps.callbacks.__all__) == [
        "BackupAndRestore", "ModelCheckpoint", "SyncCallback", "TensorBoard"]
    assert kfit_ps.layers.__all__ == ["DynamicEmbedding"]
    assert "reports" in kfit_ps.ledger.__all__
    for name in kfit_ps.__all__:
        assert getattr(kfit_ps, name) is not None
    import tensorflow as tf

    assert issubclass(kfit_ps.ParameterServerStrategy, tf.distribute.ParameterServerStrategy)


def modules():
    return sorted(m.name for m in pkgutil.walk_packages([str(PACKAGE)], "kfit_ps."))


def kfit_imports(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            yield name


def layer_of(name):
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(
    p.relative_to(PACKAGE)))
def test_layers_point_one_way_and_private_apis_stay_in_tf_compat(path):
    rel = path.relative_to(PACKAGE)
    layer = rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.stem != "__init__" \
        else None
    for name in kfit_imports(path):
        if layer != "_tf_compat":
            assert not name.startswith(("keras.src", "tensorflow.python", "tf_keras")), (
                f"{rel} imports private API {name}; go through kfit_ps._tf_compat")
        if layer in ALLOWED and name.startswith("kfit_ps."):
            target = layer_of(name)
            if target in ALLOWED:  # not a public re-export name like kfit_ps.constants
                assert target in ALLOWED[layer] | {layer}, f"{rel} (layer {layer}) imports {name}"


# One interpreter imports TensorFlow and Keras once, then forks a child per module: each
# child imports its kfit_ps module first (kfit_ps modules are not loaded before the fork).
IMPORT_EACH_ALONE = """
import importlib, os, sys, traceback
import tensorflow, keras
assert not [m for m in sys.modules if m == "kfit_ps" or m.startswith("kfit_ps.")]
failed = []
for module in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(module)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
        failed.append(module)
print("FAILED:" + ",".join(failed))
"""


def test_every_module_imports_on_its_own():
    """Catches import cycles: each module first in a fresh interpreter (a fork of one that
    has imported only TensorFlow and Keras)."""
    names = modules()
    assert len(names) > 50
    proc = subprocess.run([sys.executable, "-c", IMPORT_EACH_ALONE, *names],
                          env=helpers.chief_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "FAILED:\n" in proc.stdout, f"{proc.stdout[-500:]}\n{proc.stderr[-4000:]}"


def test_no_module_is_huge():
    for path in PACKAGE.rglob("*.py"):
        assert len(path.read_text().splitlines()) < 400, path
