"""Reading the end of a process's log file (servers' and the chief's)."""

import os

# The line a server writes to its log once it serves (`kfit_ps.cluster.server`), which
# `LocalCluster` waits for.
READY_LINE = "kfit_ps server ready:"


def read_tail(path, lines=20):
    """The last `lines` lines of the file at `path` (reads only its end), or "(no log)"."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 200 * lines))
            text = f.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])
