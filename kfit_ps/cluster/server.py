"""Running one TensorFlow gRPC server for a worker or ps task.

`run_server` is what both `LocalCluster` (through `_server_main`) and the
`kfit-ps server` CLI call. It blocks until the process is told to stop.

Security: a TensorFlow server listens on every interface, even when its
address says `localhost`, and accepts unauthenticated requests that run
arbitrary code. See docs/security.md.
"""

import os
import signal
import sys
import threading
import time

from kfit_ps import constants
from kfit_ps._tf_compat import server_lib
from kfit_ps.cluster import fork_server
from kfit_ps.cluster.logs import READY_LINE

SECURITY_WARNING = (
    "kfit_ps: this TensorFlow server ({address}) listens on ALL network interfaces and accepts "
    "unauthenticated connections; anyone who can reach the port can run code in this process. "
    "Run it only on a trusted network or behind a firewall (see docs/security.md)."
)


def _die_with_parent(parent_pid, poll_interval, log_file=None, owner_pid=None):
    """Exits this process within `poll_interval` seconds of `parent_pid` dying.

    Polling for re-parenting works whatever killed the parent (SIGKILL too)
    and whichever thread started us; the kernel's parent-death signal would
    fire when the *thread* that spawned us exits, which breaks `restart()`
    from a helper thread. An orphaned server also removes its `log_file`, and
    the launcher's log folder once it is empty, since nobody else will: unless
    `owner_pid` (a forked server's `LocalCluster` process, whose template
    `parent_pid` is) still runs, which keeps the log and reads the exit.
    """

    def exit_orphaned():
        if log_file and not (owner_pid and fork_server.running(owner_pid)):
            for remove, path in ((os.remove, log_file), (os.rmdir, os.path.dirname(log_file))):
                try:
                    remove(path)
                except OSError:
                    pass  # another server removes the folder, or it is not empty yet
        os._exit(0)

    if os.getppid() != parent_pid:  # Parent died before we got here.
        exit_orphaned()

    def watch():
        while True:
            if os.getppid() != parent_pid:
                exit_orphaned()
            time.sleep(poll_interval)

    threading.Thread(target=watch, name="kfit_ps-parent-watch", daemon=True).start()


def server_config(task_type, num_workers, inter_op_threads=None, config_proto=None):
    """The `tf.compat.v1.ConfigProto` (or `config_proto`) for a server of `task_type`."""
    if config_proto is None:
        import tensorflow as tf

        config_proto = tf.compat.v1.ConfigProto
    config = config_proto()
    if task_type == constants.WORKER:
        config.inter_op_parallelism_threads = (
            inter_op_threads or constants.worker_inter_op_threads(num_workers)
        )
    return config


def run_server(cluster_config, inter_op_threads=None, parent_pid=None, log_file=None,
               warn=True, bare_tensorflow=False, owner_pid=None):
    """Starts the server for `cluster_config`'s task and blocks forever.

    Args:
        cluster_config: a `ClusterConfig` whose `task_type` is `worker` or `ps`.
        inter_op_threads: inter-op threads of a worker; None picks a value that
            cannot deadlock (see `constants.worker_inter_op_threads`).
        parent_pid: exit when this process dies. Defaults to None (no watch).
        log_file: this server's log, removed if `parent_pid` dies. Defaults to None.
        owner_pid: a forked server's owner (`fork_server`): its log stays while that runs.
        warn: print the all-interfaces security warning. Defaults to True.
        bare_tensorflow: import only TensorFlow's server classes where that loads
            the same runtime (`_tf_compat.server_lib`); only for a process
            that never imports TensorFlow otherwise. Defaults to False.
    """
    task_type, index = cluster_config.task_type, cluster_config.task_index
    if task_type not in constants.SERVER_TASK_TYPES:
        raise ValueError(
            f"A kfit_ps server runs a 'worker' or 'ps' task. Received: task type {task_type!r} "
            f"from {cluster_config.source}. The chief runs your training script and the "
            "evaluator runs `kfit-ps evaluator`."
        )
    if parent_pid is not None:
        _die_with_parent(parent_pid, constants.parent_poll_interval(), log_file, owner_pid)
    # SIGTERM / SIGINT end the process at once. A Python handler would never run: the main
    # thread blocks in `server.join()` (C++), so the launcher would wait for its SIGKILL.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)

    server_class, cluster_spec, config_proto, how = server_lib.server_api(bare=bare_tensorflow)
    address = cluster_config.address(task_type, index)
    if warn:
        print(SECURITY_WARNING.format(address=address), file=sys.stderr, flush=True)
    server = server_class(
        cluster_spec(cluster_config.training_cluster()),
        job_name=task_type,
        task_index=index,
        protocol="grpc",
        config=server_config(task_type, cluster_config.num_tasks(constants.WORKER),
                             inter_op_threads, config_proto),
        start=True,
    )
    # Printed only once the server has bound its port: launchers wait for this line.
    print(f"{READY_LINE} {task_type}:{index} at {address} (TensorFlow import: {how})",
          flush=True)
    server.join()
