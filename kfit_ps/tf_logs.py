"""Keeping TensorFlow's C++ log lines off the user's terminal.

TensorFlow 2.21 writes C++ INFO/WARNING/ERROR lines to standard error
whatever `TF_CPP_MIN_LOG_LEVEL` says (the ones printed before absl's logging
is initialised ignore it): six lines when it is imported, more when a chief
connects to a cluster, and gRPC errors when it leaves one. A kfit_ps user
should see kfit_ps's and Keras' output, and their own.

`import kfit_ps` therefore calls `install()`; it imports no TensorFlow itself,
so the filter is in place before anyone does. It
raises the level of TensorFlow's Python logger (`tensorflow`) to CRITICAL:
its error lines about workers that failed and recovered carry pages of gRPC
text, and kfit_ps reports what matters as its own errors
(`kfit_ps.errors`). And the process's standard error (file descriptor 2)
becomes a pipe to a small filter
process (`_tf_log_filter.py`) that drops those lines and passes everything
else through unchanged, including Python tracebacks and TensorFlow's FATAL
lines. The filter outlives a crash of this process long enough to copy its
last words. Server processes write their whole output to their log files
(`LocalCluster`).

Set `KFIT_PS_TF_LOGS=1` to see everything (nothing is installed then). When
standard error is not a pipe, a file or a terminal the filter is not
installed either.
"""

import logging
import os
import stat
import subprocess
import sys

from kfit_ps import constants

_FILTER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_tf_log_filter.py")
_installed = []


def _filterable(fd):
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISREG(mode) or stat.S_ISCHR(mode) or \
        stat.S_ISSOCK(mode)


def install():
    """Routes this process's standard error through the TensorFlow log filter (once).

    Returns True when the filter is in place. Idempotent; does nothing when
    `KFIT_PS_TF_LOGS` asks for every line.
    """
    if _installed:
        return True
    if constants.show_tf_logs():
        return False
    logging.getLogger("tensorflow").setLevel(logging.CRITICAL)
    if not _filterable(2):
        return False
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    try:
        filter_process = subprocess.Popen(
            [sys.executable, "-I", "-S", _FILTER_SCRIPT], stdin=read_end, stdout=2,
            stderr=subprocess.DEVNULL, close_fds=True, start_new_session=True)
    except OSError:
        os.close(read_end)
        os.close(write_end)
        return False
    os.close(read_end)
    os.dup2(write_end, 2)
    os.close(write_end)
    _installed.append(filter_process)
    return True
