"""A job across separate network stacks: one Linux network namespace per "host".

Chief, two workers and a ps each run in their own namespace with their own address
(10.213.0.x, joined by a bridge), all on the same port, each host under its own
`kfit-ps run --tasks ...` launcher, configured by one `TF_CONFIG`. Nothing can assume
`localhost`: no task can reach another through it.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests import helpers, netns

pytestmark = [pytest.mark.slow, pytest.mark.chaos,
              pytest.mark.skipif(netns.unavailable() is not None,
                                 reason=str(netns.unavailable()))]

JOB = textwrap.dedent("""
    import json, sys
    import keras, kfit_ps
    from kfit_ps.data import criteo
    from kfit_ps.jobs.dlrm import build_dlrm
    from tests import helpers as h

    files, spec = sys.argv[1:], criteo.CriteoSpec(scale=1e-3)
    strategy = kfit_ps.ParameterServerStrategy()  # from TF_CONFIG
    with strategy.scope():
        model = build_dlrm(spec)
        model.compile(keras.optimizers.Adam(0.005), "binary_crossentropy",
                      metrics=[keras.metrics.AUC(name="auc"), h.counting_metric()],
                      steps_per_execution=5)

    class Epochs(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            print("EPOCH", epoch, flush=True)

    history = model.fit(kfit_ps.DatasetCreator(lambda ctx: criteo.dataset(files, 128, spec)),
                        epochs=4, steps_per_epoch=60, verbose=0, callbacks=[Epochs()])
    print("RESULT " + json.dumps({
        "iterations": int(model.optimizer.iterations.numpy()),
        "batches": history.history["batches"], "auc": history.history["auc"],
        "devices": sorted({v.value.device for v in model.variables})}), flush=True)
""")


@pytest.fixture
def hosts():
    netns.remove_leftovers()
    made = netns.Hosts(["chief", "w0", "w1", "ps0"])
    yield made
    made.close()


def read_until(proc, text, lines, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if text in line:
            return
    raise AssertionError(f"{text!r} not seen:\n" + "\n".join(lines[-40:]))


def launcher_output(proc, lines):
    """What a launcher that ended early printed: the lines read so far, then the rest."""
    rest = proc.stdout.read() if proc.poll() is not None else ""
    return f"launcher ended with {proc.returncode}:\n" + "\n".join(lines[-40:]) + "\n" + rest


def read_tasks(path, timeout=10.0):
    """A launcher's tasks.json; it is rewritten in place, so a read may catch it empty."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_main_job_model_across_four_network_namespaces(hosts, tmp_path):
    from kfit_ps.data import criteo

    files = criteo.generate(str(tmp_path / "criteo"), 20_000, criteo.CriteoSpec(scale=1e-3),
                            files=2)
    address = {host: f"{ip}:2222" for host, ip in hosts.addresses.items()}
    cluster = {"chief": [address["chief"]], "worker": [address["w0"], address["w1"]],
               "ps": [address["ps0"]]}
    env = dict(helpers.chief_env(), TF_CONFIG=json.dumps(
        {"cluster": cluster, "task": {"type": "chief", "index": 0}}))
    launchers, lines = {}, []
    for host, task in (("ps0", "ps:0"), ("w0", "worker:0"), ("w1", "worker:1")):
        launchers[host] = hosts.run(
            host, [sys.executable, "-m", "kfit_ps.cli.main", "run", "--run-dir",
                   str(tmp_path / host), "--tasks", task], env=env, cwd=helpers.ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        read_until(launchers[host], "servers ready", lines)
    (tmp_path / "job.py").write_text(JOB)
    chief = hosts.run("chief", [sys.executable, "-m", "kfit_ps.cli.main", "run", "--run-dir",
                                str(tmp_path / "chief"), "--tasks", "chief:0", "--",
                                sys.executable, str(tmp_path / "job.py"), *files],
                      env=env, cwd=helpers.ROOT, stdout=subprocess.PIPE,
                      stderr=subprocess.STDOUT, text=True)
    read_until(chief, "[chief] EPOCH 0", lines)
    # Kill host w0's worker; its own launcher restarts it at 10.213.0.11:2222.
    killed = read_tasks(tmp_path / "w0" / "tasks.json")["tasks"]["worker:0"]
    os.kill(killed, signal.SIGKILL)  # (the namespaces share one pid space)
    read_until(launchers["w0"], "worker:0 ended with signal SIGKILL", lines)
    read_until(launchers["w0"], "worker:0 is back", lines)
    read_until(chief, "RESULT ", lines, timeout=300)
    assert chief.wait(timeout=60) == 0, "\n".join(lines[-40:])
    result = json.loads(lines[-1].split("RESULT ", 1)[1])
    assert 240 <= result["iterations"] <= 245  # 4 x 60 steps; at-least-once for the killed one
    assert result["batches"] == [60.0] * 4  # exactly-once metrics across the kill
    assert all(d.startswith("/job:ps/replica:0/task:0") for d in result["devices"])
    restarted = read_tasks(tmp_path / "w0" / "tasks.json")  # written before "is back"
    assert launchers["w0"].poll() is None, launcher_output(launchers["w0"], lines)
    assert restarted["restarts"] == {"worker:0": 1}, (restarted, "\n".join(lines[-40:]))
    assert restarted["tasks"]["worker:0"] != killed
    for proc in launchers.values():
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM


def test_a_server_is_not_reachable_on_localhost_of_another_host(hosts, tmp_path):
    """The hosts really are separate: the ps's port answers on its address, not on w0's
    localhost (which a test that assumed one machine would use)."""
    cluster = {"worker": [f"{hosts.addresses['w0']}:2222"],
               "ps": [f"{hosts.addresses['ps0']}:2222"]}
    env = dict(helpers.chief_env(), TF_CONFIG=json.dumps(
        {"cluster": cluster, "task": {"type": "ps", "index": 0}}))
    lines = []
    server = hosts.run("ps0", [sys.executable, "-m", "kfit_ps.cli.main", "run", "--run-dir",
                               str(tmp_path / "ps0"), "--tasks", "ps:0"], env=env,
                       cwd=helpers.ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)
    read_until(server, "servers ready", lines)
    probe = ("import socket, sys\n"
             "try:\n"
             "    socket.create_connection((sys.argv[1], 2222), timeout=2).close(); print('open')\n"
             "except OSError:\n"
             "    print('closed')\n")
    here = hosts.run("w0", [sys.executable, "-c", probe, hosts.addresses["ps0"]],
                     stdout=subprocess.PIPE, text=True)
    local = hosts.run("w0", [sys.executable, "-c", probe, "127.0.0.1"],
                      stdout=subprocess.PIPE, text=True)
    assert here.communicate(timeout=30)[0].strip() == "open"
    assert local.communicate(timeout=30)[0].strip() == "closed"
