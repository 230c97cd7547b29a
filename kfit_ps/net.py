"""Small network checks shared by the cluster and training layers."""

import socket
import time

POLL_SECONDS = 0.1  # How often `wait_for_servers` asks again.


def accepts_connections(address, timeout=1.0):
    """Whether something accepts TCP connections at `host:port` right now."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def wait_for_servers(servers, timeout, ready=None, on_first_wait=None,
                     clock=time.monotonic, sleep=time.sleep):
    """Waits until every server is ready; returns the names of those still not after
    `timeout` seconds (an empty list once all are). The one wait for servers in kfit_ps.

    Args:
        servers: `(name, address)` pairs, e.g. `("ps:0", "host:2222")`.
        timeout: seconds to wait at most; each server is asked every `POLL_SECONDS`.
        ready: `ready(name, address)`, whether a server serves; it may raise to stop the
            wait (a server process that exited). Defaults to `accepts_connections(address)`.
        on_first_wait: called once with the names not ready at the first check, before
            the first pause (to say what is waited for).
    """
    ready = ready or (lambda name, address: accepts_connections(address))
    deadline, pending = clock() + timeout, list(servers)
    while True:
        pending = [(name, address) for name, address in pending if not ready(name, address)]
        if not pending:
            return []
        if clock() > deadline:
            return [name for name, _ in pending]
        if on_first_wait is not None:
            on_first_wait([name for name, _ in pending])
            on_first_wait = None
        sleep(POLL_SECONDS)


def free_port(host):
    """A TCP port that is free on `host` at this moment (it may be taken later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host if host != "localhost" else "127.0.0.1", 0))
        return s.getsockname()[1]


def distinct_ports(host, count, taken, probe=free_port, tries=100):
    """`count` free ports on `host`, none in `taken` (which they are added to).

    Each probe closes its socket, so the kernel may hand the same port out twice in a row
    (seen in CI: worker 0 and ps 0 given one port); a port already taken is probed again.
    """
    ports = []
    for _ in range(tries):
        if len(ports) == count:
            break
        port = probe(host)
        if port not in taken:
            taken.add(port)
            ports.append(port)
    if len(ports) < count:
        raise RuntimeError(f"No {count} distinct free ports on {host!r} after {tries} probes "
                           f"(taken: {sorted(taken)}).")
    return ports


# An HTTP/2 client preface followed by an empty SETTINGS frame: a gRPC server answers it with
# its own SETTINGS frame at once, from its I/O threads.
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def grpc_state(address, timeout=2.0):
    """`"answers"`, `"silent"` or `"down"`: how a gRPC server at `host:port` takes an HTTP/2
    handshake within `timeout` seconds.

    A running server answers at once, from its I/O threads. A process that is stopped or
    wedged is *silent*: the kernel still accepts connections for it until its listen
    backlog is full, then lets them time out. A process that is gone is *down*: the
    connection is refused.
    """
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(_HTTP2_PREFACE)
            return "answers" if s.recv(9) else "down"
    except (socket.timeout, TimeoutError):
        return "silent"
    except OSError:
        return "down"


def answers_grpc(address, timeout=2.0):
    """Whether a gRPC server at `host:port` answers an HTTP/2 handshake (`grpc_state`)."""
    return grpc_state(address, timeout) == "answers"
