"""The one wait for servers (`net.wait_for_servers`), on real sockets."""

import socket
import time

import pytest

from kfit_ps import net


def test_the_wait_returns_at_once_for_serving_servers_and_names_the_others_after_the_timeout():
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        serving = f"127.0.0.1:{listening.getsockname()[1]}"
        closed = f"127.0.0.1:{net.free_port('127.0.0.1')}"
        started = time.monotonic()
        assert net.wait_for_servers([("worker:0", serving)], 5) == []
        assert time.monotonic() - started < 1
        said = []
        started = time.monotonic()
        missing = net.wait_for_servers([("worker:0", serving), ("ps:0", closed)], 0.5,
                                       on_first_wait=said.append)
        waited = time.monotonic() - started
    assert missing == ["ps:0"]
    assert said == [["ps:0"]]  # Once, with only the one not ready.
    assert 0.5 <= waited < 0.5 + 10 * net.POLL_SECONDS


def test_a_readiness_check_that_raises_ends_the_wait():
    calls = []

    def ready(name, address):
        calls.append(name)
        if len(calls) == 3:
            raise RuntimeError("ps:0 exited")
        return False

    with pytest.raises(RuntimeError, match="ps:0 exited"):
        net.wait_for_servers([("ps:0", "127.0.0.1:1")], 30, ready=ready)
    assert calls == ["ps:0"] * 3
