"""TensorFlow's server classes, importing as little of TensorFlow as it can.

A worker or ps process only creates a `tf.distribute.Server` and blocks in
its `join()`: every op it runs arrives from the chief as a function and runs
in TensorFlow's C++ runtime. `import tensorflow` would also load the whole
Python API (about 2,500 modules, 3 to 5 s of CPU); a server started by
`LocalCluster` imports only `tensorflow.python.training.server_lib` and its
dependencies (about 350 modules, 0.6 s), the same shared libraries and
kernels included.

That skips `tensorflow/__init__.py`, which this module replaces by a bare
package; it is done only where that `__init__` would load nothing more into
the runtime: TensorFlow in the tested range, no `tensorflow/core/kernels`,
no `tensorflow-plugins` folder, no `TF_PLUGGABLE_DEVICE_LIBRARY_PATH`.
Anywhere else, or once TensorFlow is imported, it is the ordinary import.
Nothing but a server process may ask for the bare import: `import
tensorflow` in that process would then find the bare package.

No imports of kfit_ps or TensorFlow at module level: `_server_main` loads
this file before TensorFlow.
"""

import importlib.metadata
import importlib.util
import os
import site
import sys
import sysconfig
import types

from kfit_ps._tf_compat.supported import is_supported

BARE = "bare"
FULL = "full"


# Distributions that install the `tensorflow` package (a nightly is outside the range anyway).
_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-intel")


def _installed_version():
    for name in _DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _site_dirs():
    dirs = [p for p in sys.path if p]
    dirs += site.getsitepackages() if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE and site.USER_SITE:
        dirs.append(site.USER_SITE)
    for scheme in sysconfig.get_scheme_names():
        dirs += [sysconfig.get_path(name, scheme) for name in ("purelib", "platlib")]
    return {d for d in dirs if d}


def bare_import_reason(spec=None):
    """None where the bare import loads what `import tensorflow` would; else why not."""
    if "tensorflow" in sys.modules:
        return "TensorFlow is already imported"
    spec = spec or importlib.util.find_spec("tensorflow")
    if spec is None or not spec.submodule_search_locations:
        return "TensorFlow is not installed as a package"
    version = _installed_version()
    if version is None:
        return "TensorFlow's installed version is unknown"
    if not is_supported("tensorflow", version):
        return f"TensorFlow {version} is outside the tested range"
    package_dir = list(spec.submodule_search_locations)[0]
    if os.path.exists(os.path.join(package_dir, "core", "kernels")):
        return "TensorFlow has first-party kernel libraries to load"
    if os.environ.get("TF_PLUGGABLE_DEVICE_LIBRARY_PATH"):
        return "TF_PLUGGABLE_DEVICE_LIBRARY_PATH is set"
    if any(os.path.exists(os.path.join(d, "tensorflow-plugins")) for d in _site_dirs()):
        return "a tensorflow-plugins folder is installed"
    return None


def _bare_tensorflow(spec):
    package = types.ModuleType("tensorflow")
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    package.__file__ = spec.origin
    sys.modules["tensorflow"] = package


_LOADED = []  # the first server_api() result in this process (a template's forks reuse it)


def server_api(bare=False):
    """(`Server`, `ClusterSpec`, `ConfigProto`, how TensorFlow was imported: BARE or FULL).

    `bare=True` (server processes only) takes the bare import where
    `bare_import_reason()` allows it. A second call returns the first one's classes (a server
    forked from a template that made the bare import must not try the full one).
    """
    if _LOADED:
        return _LOADED[0]
    _LOADED.append(_server_api(bare))
    return _LOADED[0]


def _server_api(bare):
    spec = importlib.util.find_spec("tensorflow")
    how = FULL
    if bare and bare_import_reason(spec) is None:
        _bare_tensorflow(spec)
        how = BARE
    if how == FULL:
        import tensorflow as tf

        return tf.distribute.Server, tf.train.ClusterSpec, tf.compat.v1.ConfigProto, how
    # The same native libraries `import tensorflow` loads first (kernels and runtime).
    from tensorflow.python import pywrap_tensorflow  # noqa: F401 pylint: disable=unused-import
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.training import server_lib

    return server_lib.Server, server_lib.ClusterSpec, config_pb2.ConfigProto, how
