"""A process's CPU seconds and resident memory.

The chief reads them on a remote ps by running `tf.io.read_file` of
`/proc/self/stat` there (the op runs in the ps' own process), and parses the
text here; the launcher reads its children with `psutil`.
"""

import os

import psutil

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def parse_proc_stat(text):
    """(CPU seconds, resident bytes) from the text of `/proc/<pid>/stat`."""
    # The command name (field 2) may hold spaces: the fields after it follow its ")".
    fields = text[text.rindex(")") + 2:].split()
    utime, stime, rss_pages = int(fields[11]), int(fields[12]), int(fields[21])
    return (utime + stime) / _TICKS, rss_pages * _PAGE


def parse_cpu_quota(cpu_max, online):
    """Cores a process may use: its cgroup v2 `cpu.max` ("quota period" or "max period"),
    else its host's online CPUs (`/sys/devices/system/cpu/online`, e.g. "0-15")."""
    parts = (cpu_max or "").split()
    if len(parts) == 2 and parts[0] != "max":
        return int(parts[0]) / int(parts[1])
    cores = 0
    for item in (online or "").strip().split(","):
        if not item:
            continue
        low, _, high = item.partition("-")
        cores += int(high or low) - int(low) + 1
    return float(cores) or None


def process_usage(pid):
    """(CPU seconds, resident bytes) of process `pid`, or None once it is gone."""
    try:
        process = psutil.Process(pid)
        with process.oneshot():
            times = process.cpu_times()
            return times.user + times.system, process.memory_info().rss
    except (psutil.Error, OSError):
        return None
