"""Entry point of a server process started by `LocalCluster`.

Usage (internal): python -m kfit_ps.cluster._server_main TF_CONFIG_JSON PARENT_PID THREADS LOG
"""

import sys

from kfit_ps.cluster.server import run_server
from kfit_ps.cluster.spec import ClusterConfig


def main(argv):
    tf_config, parent_pid, threads, log_file = argv
    config = ClusterConfig.from_tf_config(tf_config)
    run_server(config, inter_op_threads=int(threads) or None, parent_pid=int(parent_pid),
               log_file=log_file, warn=False)


if __name__ == "__main__":
    main(sys.argv[1:])
