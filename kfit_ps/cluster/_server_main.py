"""Entry point of a server process started by `LocalCluster`.

Usage (internal): python .../kfit_ps/cluster/_server_main.py TF_CONFIG_JSON PARENT_PID THREADS LOG

`LocalCluster` runs this file by its path, not with `-m`: a server needs
`tf.distribute.Server` and none of the training stack, so it skips the
package's `__init__` (which loads Keras and patches it), and imports only
TensorFlow's server classes where that loads the same runtime
(`_tf_compat.server_lib`), never Keras. On the project's 2-core machine a
server then starts on about 0.6 s of CPU instead of 3 to 3.5 s with the whole
of TensorFlow, and every `LocalCluster` starts four or more of them.

`_server_main.py --fork-server OWNER_PID LOG` is a `LocalCluster`'s server template
(`fork_server.py`): it imports the same once, then forks each server.
"""

import os
import sys
import types


def _bare_packages():
    """Makes kfit_ps' packages a server uses importable without running their `__init__`."""
    cluster_dir = os.path.dirname(os.path.abspath(__file__))
    package_dir = os.path.dirname(cluster_dir)
    # Not this file's folder: its modules (server, spec, local, ...) would shadow top-level ones.
    sys.path[0] = os.path.dirname(package_dir)
    for name, path in (("kfit_ps", package_dir), ("kfit_ps.cluster", cluster_dir),
                       ("kfit_ps._tf_compat", os.path.join(package_dir, "_tf_compat"))):
        package = types.ModuleType(name)
        package.__path__ = [path]
        sys.modules[name] = package
    sys.modules["keras"] = None  # TensorFlow imports Keras when it can; a server never uses it.


def main(argv, owner_pid=None):
    from kfit_ps.cluster.server import run_server
    from kfit_ps.cluster.spec import ClusterConfig

    tf_config, parent_pid, threads, log_file = argv
    config = ClusterConfig.from_tf_config(tf_config)
    run_server(config, inter_op_threads=int(threads) or None, parent_pid=int(parent_pid),
               log_file=log_file, warn=False, bare_tensorflow=True, owner_pid=owner_pid)


if __name__ == "__main__":
    if "kfit_ps" not in sys.modules:  # run by path (not `python -m`, which imports kfit_ps)
        _bare_packages()
    if sys.argv[1:2] == ["--fork-server"]:  # LocalCluster's server template (fork_server.py)
        from kfit_ps.cluster import fork_server

        fork_server.serve(int(sys.argv[2]), sys.argv[3], main)
    else:
        main(sys.argv[1:])
