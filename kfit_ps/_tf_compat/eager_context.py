"""This process's eager cluster connection (TensorFlow's private eager context).

When a `LocalCluster` stops its servers, a chief still connected to them tries
to unregister from them every function it releases afterwards (a model
deleted later, a notebook's next cell) and logs four lines of gRPC errors per
function and server. Shrinking the eager context's cluster to the chief alone
(TensorFlow's own cluster-update path, used when workers are replaced) leaves
nothing to talk to.
"""

import logging

from tensorflow.core.protobuf import tensorflow_server_pb2
from tensorflow.python.eager import context

log = logging.getLogger("kfit_ps.cluster")


def _remote_addresses(server_def):
    return {address for job in server_def.cluster.job if job.name != server_def.job_name
            for address in job.tasks.values()}


def forget_servers(addresses):
    """Disconnects this process from a cluster that contains any of `addresses`.

    Returns True when the eager context was connected to one of them and now
    only knows its own task; False when it was not connected to them.
    """
    ctx = context.context()
    server_def = ctx.get_server_def()
    if server_def is None or not _remote_addresses(server_def) & set(addresses):
        return False
    alone = tensorflow_server_pb2.ServerDef()
    alone.CopyFrom(server_def)
    own_job = [job for job in alone.cluster.job if job.name == server_def.job_name]
    del alone.cluster.job[:]
    alone.cluster.job.extend(own_job)
    alone.default_session_config.ClearField("device_filters")
    try:
        ctx.update_server_def(alone)
    except Exception as e:  # noqa: BLE001 - only the exit-time log noise is at stake
        log.debug("kfit_ps: could not disconnect from the stopped cluster: %s", e)
        return False
    return True
