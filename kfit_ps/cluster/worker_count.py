"""A cluster with more or fewer workers (`LocalCluster.resize_workers`, `kfit-ps scale`).

New workers get free ports after every address already taken; removing keeps the
lowest-numbered workers, so every kept task keeps its index and address.
"""

import subprocess
import time

from kfit_ps import constants, net, validation
from kfit_ps.cluster.spec import ClusterConfig


def with_workers(config, num_workers, host, probe):
    """`config` (a chief's `ClusterConfig`) with `num_workers` workers."""
    cluster = {t: list(a) for t, a in config.cluster.items()}
    workers = cluster[constants.WORKER][:num_workers]
    if num_workers > len(workers):
        taken = {int(a.rpartition(":")[2]) for addresses in cluster.values() for a in addresses}
        workers += [f"{host}:{port}" for port in net.distinct_ports(
            host, num_workers - len(workers), taken, probe=probe)]
    cluster[constants.WORKER] = workers
    return ClusterConfig(cluster=cluster, task_type=config.task_type,
                         task_index=config.task_index, source=config.source)


def terminate(procs, grace):
    """SIGTERM to each process, then SIGKILL to those still running after `grace` seconds."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def resize(cluster, num_workers, probe, grace):
    """`LocalCluster.resize_workers`: its processes, config and logs, under its lock."""
    num_workers = validation.check_int("num_workers", num_workers, 1,
                                       owner="LocalCluster.resize_workers")
    cluster._require_started("resize_workers")
    if not cluster.resizable:
        raise ValueError(
            "LocalCluster.resize_workers: this host runs a fixed share of a multi-host cluster "
            f"({cluster.config.source}); change the cluster's TF_CONFIG instead. Received: "
            f"num_workers={num_workers}.")
    current = cluster.config.num_tasks(constants.WORKER)
    cluster.config = with_workers(cluster.config, num_workers, cluster.host, probe)
    cluster.num_workers = num_workers
    added = [(constants.WORKER, i) for i in range(current, num_workers)]
    for task_type, index in added:
        cluster._spawn(task_type, index)
    cluster._wait_ready(added)
    with cluster._lock:
        removed = [(cluster._procs.pop(key), cluster._logs.pop(key)) for key in
                   [(constants.WORKER, i) for i in range(num_workers, current)]]
    terminate([proc for proc, _ in removed], grace)
    for _, log_file in removed:
        log_file.close()
