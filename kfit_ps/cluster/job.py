"""`job_cluster`: the cluster a script trains on, whether or not `kfit-ps run` started it."""

import contextlib

from kfit_ps import constants
from kfit_ps.cluster.local import LocalCluster
from kfit_ps.cluster.spec import ClusterConfig


@contextlib.contextmanager
def job_cluster(num_workers=2, num_ps=1, **local_cluster_kwargs):
    """Yields the `ClusterResolver` of this job's cluster.

    Under `kfit-ps run` (or `kfit_ps.run`) the servers already run and
    `TF_CONFIG` describes them: that cluster is used, and `num_workers` /
    `num_ps` are ignored (the launcher's `--workers` / `--ps` decide). Anywhere
    else a `LocalCluster(num_workers, num_ps, ...)` is started for the block
    and stopped after it. So one script runs both ways:

    ```python
    with kfit_ps.job_cluster(num_workers=2, num_ps=1) as resolver:
        strategy = kfit_ps.ParameterServerStrategy(resolver)
        ...
    ```
    """
    if constants.launched():
        yield ClusterConfig.from_tf_config().cluster_resolver()
        return
    with LocalCluster(num_workers, num_ps, **local_cluster_kwargs) as cluster:
        yield cluster.cluster_resolver
