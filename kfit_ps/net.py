"""Two small network checks shared by the cluster and training layers."""

import socket


def accepts_connections(address, timeout=1.0):
    """Whether something accepts TCP connections at `host:port` right now."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def free_port(host):
    """A TCP port that is free on `host` at this moment (it may be taken later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host if host != "localhost" else "127.0.0.1", 0))
        return s.getsockname()[1]
