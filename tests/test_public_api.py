"""The public API, the layering rules, and the private-API gate."""

import ast
import json
import pathlib
import pkgutil
import subprocess
import sys

import pytest

import kfit_ps
from tests import helpers

PACKAGE = pathlib.Path(kfit_ps.__file__).parent

# Which kfit_ps layers each layer may import. Layers point one way: cli -> launch and jobs ->
# cluster and training -> strategy -> _tf_compat (the side-car `evaluator` reads checkpoints
# with training's inputs and files); the leaves below may be used by any layer.
# `observe` (metrics, events, diagnosis; no TensorFlow) serves the launcher and the chief.
LEAVES = {"constants", "validation", "net", "errors", "membership"}
ALLOWED = {
    "cli": {"launch", "cluster", "training", "evaluator", "strategy", "jobs", "_tf_compat",
            "_setup"} | LEAVES,
    "launch": {"launch", "cluster", "_tf_log_filter", "observe"} | LEAVES,
    "jobs": {"cluster", "training", "strategy", "data"} | LEAVES,
    "data": set(),
    "training": {"strategy", "_tf_compat", "training", "embeddings", "ledger", "observe"}
    | LEAVES,
    "evaluator": {"evaluator", "training", "strategy", "_tf_compat"} | LEAVES,
    "cluster": {"cluster", "_tf_compat"} | LEAVES,
    "strategy": {"_tf_compat", "strategy"} | LEAVES,
    "_tf_compat": {"_tf_compat"},
    "constants": set(),
    "validation": {"constants"},
    "net": set(),
    "membership": set(),
    "errors": set(),
    "tf_logs": {"constants"},
    "_setup": {"constants", "training", "errors", "_tf_compat"},
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
        namespace = {}
        exec(f"from kfit_ps import {name}", namespace)  # noqa: S102 - the public names only
        assert namespace[name] is getattr(kfit_ps, name)
    assert set(kfit_ps.__all__) <= set(dir(kfit_ps))
    with pytest.raises(AttributeError, match="no attribute 'Strategy'"):
        kfit_ps.Strategy  # noqa: B018
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


def asks_the_root_for(path):
    """The names that `path` imports from the package root (`from kfit_ps import x`)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "kfit_ps" and not node.level:
            yield from (a.name for a in node.names)


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
    # The root's public names are loaded on first use, which first prepares training and so
    # imports the training layer: kfit_ps' own modules import where a name is defined.
    lazy = set(asks_the_root_for(path)) & set(kfit_ps.__all__)
    assert not lazy, f"{rel}: `from kfit_ps import {', '.join(sorted(lazy))}`; import the " \
        "defining module instead (e.g. `import kfit_ps.ledger as ledger`)"


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


# In one fresh interpreter: import the launcher's modules, run `kfit-ps --help` and two
# subcommands' help, remove a finished job's local backups (as the launcher does once its
# script exited 0), then list every TensorFlow or Keras module loaded.
IMPORT_THE_LAUNCHER = """
import importlib, json, os, sys, tempfile
for module in sys.argv[1:]:
    importlib.import_module(module)
from kfit_ps.cli.main import main
for argv in (["--help"], ["run", "--help"], ["status", "--help"]):
    try:
        main(argv)
    except SystemExit:
        pass
from kfit_ps.launch import chief_process
backups = os.path.join(tempfile.mkdtemp(), "backup")
os.makedirs(backups)
open(os.path.join(backups, "backup-00000001.weights.h5"), "w").close()
chief_process.remove_backups(backups)
assert not os.path.exists(backups)
print("LOADED:" + json.dumps(sorted(m for m in sys.modules
                                    if m.split(".")[0] in ("tensorflow", "keras", "tf_keras"))))
"""


def launcher_modules():
    """The modules of the launcher, the CLI and `observe`, and the leaves they use."""
    return ["kfit_ps", "kfit_ps.membership", "kfit_ps.exit_status", "kfit_ps.constants"] + [
        name for name in modules() if name.startswith(("kfit_ps.cli.", "kfit_ps.launch.",
                                                        "kfit_ps.observe."))]


def test_the_launcher_loads_neither_tensorflow_nor_keras():
    names = launcher_modules()
    assert {"kfit_ps.cli.main", "kfit_ps.launch.supervisor", "kfit_ps.observe.http"} <= set(names)
    proc = subprocess.run([sys.executable, "-c", IMPORT_THE_LAUNCHER, *names],
                          env=helpers.chief_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    loaded = json.loads(proc.stdout.rpartition("LOADED:")[2])
    assert loaded == [], f"the launcher imported {loaded[:10]} ({len(loaded)} modules)"

