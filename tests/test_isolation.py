"""Isolated local mode: a job's servers in a private network namespace (loopback only)."""

import json
import re
import signal
import socket
import subprocess
import sys

import pytest

from kfit_ps import net
from kfit_ps.launch import isolation
from tests import helpers
from tests.test_launcher import JOB, Job

pytestmark = pytest.mark.skipif(isolation.available() is not None,
                                reason=str(isolation.available()))


def this_machines_addresses():
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"],
                         capture_output=True, text=True).stdout
    return re.findall(r"inet (\d+\.\d+\.\d+\.\d+)/", out)


# That `kfit-ps quickstart` runs isolated by default is checked on the README's main job itself
# (`tests/test_main_job.py`).


@pytest.mark.slow
def test_isolated_servers_cannot_be_reached_from_outside_and_the_job_trains(tmp_path):
    job = Job(tmp_path, "--isolated", "--workers", "1", "--ps", "1", "--backup-dir",
              str(tmp_path / "backup"), "--save-freq", "20", script=JOB,
              script_args=(1000, 500, 5))
    try:
        ready = job.read_until(lambda line: "servers ready" in line)
        ports = [int(p) for p in re.findall(r"localhost:(\d+)", ready)]
        assert len(ports) == 3  # chief, worker, ps
        job.read_until(lambda line: line.startswith("[chief] STEP "))  # it trains
        assert any("network isolated" in line for line in job.lines)
        for port in ports:
            assert not net.accepts_connections(f"127.0.0.1:{port}", timeout=2)  # not our loopback
            for address in this_machines_addresses():
                assert not net.accepts_connections(f"{address}:{port}", timeout=2), (address, port)
        job.proc.send_signal(signal.SIGTERM)
        assert job.proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    assert helpers.wait_for_no_servers(list(job.pids), timeout=15) == []


@pytest.mark.slow
def test_run_keeps_the_network_unless_asked(tmp_path):
    script = ("import json, socket\n"
              "print('IFACES', json.dumps(sorted(n for _, n in socket.if_nameindex())))\n")
    job = Job(tmp_path, "--workers", "1", "--ps", "1", script=script)
    assert job.finish() == 0, "\n".join(job.lines[-20:])
    [line] = [x for x in job.lines if "IFACES" in x]
    assert json.loads(line.split("IFACES ", 1)[1]) == sorted(
        n for _, n in socket.if_nameindex())  # this machine's own interfaces
    assert not any("network isolated" in x for x in job.lines)
    bad = subprocess.run([sys.executable, "-m", "kfit_ps.cli.main", "run", "--isolated",
                          "--tasks", "ps:0"], capture_output=True, text=True,
                         env=helpers.chief_env(), cwd=helpers.ROOT, timeout=120)
    assert bad.returncode == 2 and "--isolated" in bad.stderr


def test_an_explicit_isolated_never_falls_back_to_the_open_network(tmp_path):
    """`kfit-ps run --isolated` where no namespace can be made stops before starting anything
    (here: no `unshare` on PATH), instead of running the servers on the machine's network."""
    env = dict(helpers.chief_env(), PATH=str(tmp_path))  # an empty PATH: no `unshare`
    proc = subprocess.run([sys.executable, "-m", "kfit_ps.cli.main", "run", "--isolated",
                           "--run-dir", str(tmp_path / "run"), "--", sys.executable, "-c", "1"],
                          capture_output=True, text=True, env=env, cwd=helpers.ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--isolated: a private network namespace is not available here" in proc.stderr
    assert "`unshare` command" in proc.stderr and "nothing was started" in proc.stderr
    assert not (tmp_path / "run").exists()
