"""Isolated local mode: a job's servers in a private network namespace.

TensorFlow servers listen on every interface and accept unauthenticated
requests that run code (docs/security.md). A job that runs entirely on this
machine does not need any interface but loopback, so `kfit-ps quickstart`
(and `kfit-ps run --isolated`) re-execute themselves in a new network
namespace whose only interface is its own loopback: no other host, and no
other process on this machine, can reach the servers' ports.

`reexec_isolated(argv)` replaces this process with `unshare --net [...]`
running the same command (`--map-root-user` when not root, which needs
unprivileged user namespaces); inside, `enter()` brings loopback up. Where
that is impossible (`available()` says why), the command runs with the
network as usual and says so, with the security warning.

A program that reads remote data or writes to `gs://` needs the network:
`kfit-ps run` therefore keeps it unless `--isolated` is given.
"""

import fcntl
import os
import shutil
import socket
import struct
import subprocess
import sys

from kfit_ps import constants

_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def _unshare_command():
    command = ["unshare", "--net"]
    if os.geteuid() != 0:
        command.append("--map-root-user")
    return command


def available():
    """None when an isolated namespace can be made here, else why not."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux-only"
    if shutil.which("unshare") is None:
        return "the `unshare` command (util-linux) is not installed"
    probe = subprocess.run([*_unshare_command(), "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return (f"`{' '.join(_unshare_command())}` failed ({probe.stderr.strip() or 'exit '}"
                f"{probe.returncode}): unprivileged user namespaces may be disabled")
    return None


def inside():
    """Whether this process is the re-executed, isolated one."""
    return constants.isolated_network()


def reexec_isolated(argv):
    """Replaces this process with `argv` in a new network namespace (does not return)."""
    env = dict(os.environ)
    env[constants.ISOLATED_ENV] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    command = [*_unshare_command(), *argv]
    os.execvpe(command[0], command, env)


def enter():
    """In the new namespace: brings loopback up (it starts down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | _IFF_UP))


def interfaces():
    """Names of this network namespace's interfaces."""
    return sorted(name for _, name in socket.if_nameindex())
