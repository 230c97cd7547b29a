"""The workers of a multi-host job's chief: found through DNS (`kfit-ps run --discover-workers`,
`kfit_ps.launch.discovery`), or `TF_CONFIG`'s list scaled by `kfit-ps scale`
(`kfit_ps.launch.roster`); one publisher (`DiscoveredWorkers`) for both.

The unit tests drive the discovery with a fake resolver and clock, the roster with a fake
wait for servers. The DNS job test runs every host in its own network namespace, with a
real DNS server (`dnsmasq`) that serves the workers' names: a worker added by DNS alone
and later removed, and a worker killed and brought back at a new address under its old
name, during one `fit`. The roster's job test runs a launcher per host on this machine's
loopback: the chief starts on 1 of 2 workers, `kfit-ps scale` grows it to 2 and back to 1.
"""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kfit_ps import membership
from kfit_ps.launch import discovery, roster
from kfit_ps.launch.config import LaunchConfig
from kfit_ps.observe import events as event_log
from tests import dns, helpers, netns
from tests.test_multi_host import Launchers, read_tasks


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def fake_dns(table, serving=None):
    """A `DnsWorkers` over `table` ({host: [ips]}), each look at once."""
    clock = Clock()
    workers = discovery.DnsWorkers(
        discovery.WorkerPattern.parse("job-worker-{i}.svc:2222"), 4, grace=5.0,
        resolve=lambda host: list(table.get(host, ())),
        serving=lambda addresses: [a for a in addresses if serving is None or a in serving],
        clock=clock)
    return workers, clock


def name(i):
    return f"job-worker-{i}.svc:2222"


def test_names_join_when_they_resolve_and_serve_and_leave_after_the_grace():
    table = {"job-worker-0.svc": ["10.0.0.1"], "job-worker-2.svc": ["10.0.0.3"]}
    serving = {name(0), name(2)}
    workers, clock = fake_dns(table, serving)
    try:
        assert workers.poll([]) == [name(0), name(2)]
        table["job-worker-1.svc"] = ["10.0.0.2"]  # resolves, does not serve yet
        assert workers.poll([name(0), name(2)]) == [name(0), name(2)]
        serving.add(name(1))
        assert workers.poll([name(0), name(2)]) == [name(0), name(2), name(1)]
        # A name back at a new address within the grace keeps its place, nothing changes.
        del table["job-worker-0.svc"]
        clock.now = 4.0
        assert workers.poll([name(0), name(2), name(1)]) == [name(0), name(2), name(1)]
        table["job-worker-0.svc"] = ["10.0.0.9"]
        clock.now = 8.0
        assert workers.poll([name(0), name(2), name(1)]) == [name(0), name(2), name(1)]
        del table["job-worker-1.svc"]
        clock.now = 13.5  # missed since 8.0: past the grace
        assert workers.poll([name(0), name(2), name(1)]) == [name(0), name(2)]
    finally:
        workers.close()


def test_a_service_s_a_records_are_the_workers():
    table = {"job-worker.svc": ["10.0.0.10", "10.0.0.9"]}
    clock = Clock()
    workers = discovery.DnsWorkers(discovery.WorkerPattern.parse("job-worker.svc:2222"), 8,
                                   grace=1.0, resolve=lambda host: table.get(host, []),
                                   serving=lambda addresses: addresses, clock=clock)
    try:
        assert workers.poll([]) == ["10.0.0.9:2222", "10.0.0.10:2222"]
        table["job-worker.svc"] = ["10.0.0.10", "10.0.0.11"]  # .9 came back as .11
        clock.now = 2.0
        assert workers.poll(["10.0.0.9:2222", "10.0.0.10:2222"]) == [
            "10.0.0.10:2222", "10.0.0.11:2222"]
    finally:
        workers.close()


def test_a_kept_worker_never_changes_its_index():
    a, b, c, d = "a:1", "b:1", "c:1", "d:1"
    assert discovery.next_step([a, b], [a, b, c]) == [a, b, c]
    assert discovery.next_step([a, b, c], [a, b]) == [a, b]
    # b leaves from the middle: first a alone, then c again, as a new worker.
    assert discovery.next_step([a, b, c], [a, c, d]) == [a]
    assert discovery.next_step([a], [a, c, d]) == [a, c, d]
    # The first one leaves: no kept prefix, so the rest take new indices at once.
    assert discovery.next_step([a, b], [b]) == [b]
    assert discovery.next_step([a, b, c], [b, c, d]) == [b, c, d]


def test_the_publisher_makes_one_change_at_a_time_and_refuses_scale_requests(tmp_path):
    said, emitted = [], []

    class View:
        def emit(self, kind, task=None, reason="", **fields):
            emitted.append((kind, task))

    lists = [[name(0)], [name(0), name(1)], [name(0)], [name(0)]]
    dns, _ = fake_dns({})  # The DNS source's own refusal; what it wants, from `lists`.
    dns.poll = lambda current: lists.pop(0) if len(lists) > 1 else lists[0]

    clock = Clock()
    published = discovery.DiscoveredWorkers(str(tmp_path), said.append, View(), dns,
                                            clock=clock)
    directory = str(tmp_path / membership.DIR_NAME)
    assert published.wait_for_workers(sleep=lambda s: None) == [name(0)]
    clock.now = 1.0
    assert not published.poll(None, chief_running=True)  # the chief has not taken gen 1
    membership.acknowledge(directory, 1)
    clock.now = 2.0
    assert published.poll(None, chief_running=True)
    assert membership.latest(directory) == (2, [name(0), name(1)])
    clock.now = 3.0
    assert not published.poll(None, chief_running=True)  # gen 2 not applied yet
    membership.acknowledge(directory, 2)
    clock.now = 4.0
    assert published.poll(None, chief_running=True)
    assert membership.latest(directory) == (3, [name(0)])
    membership.acknowledge(directory, 3)
    membership.request_scale(str(tmp_path), 3)
    clock.now = 5.0
    assert not published.poll(None, chief_running=True)
    assert ("task_removed", "worker:1") in emitted and ("worker_ready", "worker:1") in emitted
    assert any("refused" in line and "DNS" in line for line in said), said


def test_workers_that_only_take_a_new_index_are_not_told_to_stop(tmp_path):
    """worker-1 of 0..3 leaves: the list shrinks to worker-0, then 2 and 3 come back at new
    indices. Only worker-1 is told it may stop; with no chief running that is said too.
    When worker-0 leaves, the others take new indices at once (no empty list, no stall)."""
    emitted = []

    class View:
        def emit(self, kind, task=None, reason="", **fields):
            emitted.append((kind, fields.get("address"), reason))

    wanted = [[name(0), name(1), name(2), name(3)]]

    class Wanted:
        def poll(self, current):
            return wanted[0]

        def close(self):
            pass

    clock = Clock()
    published = discovery.DiscoveredWorkers(str(tmp_path), [].append, View(), Wanted(),
                                            clock=clock)
    directory = str(tmp_path / membership.DIR_NAME)
    published.wait_for_workers(sleep=lambda s: None)
    membership.acknowledge(directory, 1)
    wanted[0] = [name(0), name(2), name(3)]
    for step, (expected, chief) in enumerate([([name(0)], True),
                                              ([name(0), name(2), name(3)], True)]):
        clock.now = 2.0 * (step + 1)
        assert published.poll(None, chief_running=chief)
        assert membership.latest(directory) == (step + 2, expected)
        membership.acknowledge(directory, step + 2)
    removed = [(address, reason) for kind, address, reason in emitted if kind == "task_removed"]
    assert removed == [(name(1), f"{name(1)} left the job (drained by the chief): it may "
                                 "stop now")]
    wanted[0] = [name(2), name(3)]  # worker-0 goes; no chief runs now
    clock.now = 10.0
    assert published.poll(None, chief_running=False)
    assert membership.latest(directory)[1] == [name(2), name(3)]
    clock.now = 12.0
    published.poll(None, chief_running=False)
    removed = [(address, reason) for kind, address, reason in emitted if kind == "task_removed"]
    assert removed[1:] == [(name(0), f"{name(0)} left the job (no chief is running: its next "
                                     "start leaves it out): it may stop now")]


def test_only_ipv4_addresses_are_workers():
    assert discovery.resolve("localhost") == ["127.0.0.1"]


@pytest.mark.parametrize("kwargs, error", [
    (dict(discover_workers="w-{i}.svc"), "must end with :PORT"),
    (dict(discover_workers="w-{i}-{j}.svc:2222"), "only placeholder"),
    (dict(discover_workers="w_{i}.svc:2222"), "DNS name"),
    (dict(discover_workers="w-{i}.svc:2222", tasks=None), "needs tasks with chief:0"),
    (dict(discover_workers="w-{i}.svc:2222", tasks=(("chief", 0), ("worker", 0))),
     "and no worker"),
    (dict(discover_workers="w-{i}.svc:2222", max_workers=0), "max_workers"),
])
def test_bad_discovery_arguments_name_the_flag(kwargs, error):
    kwargs = dict(dict(command=("python", "x.py"), tasks=(("chief", 0),)), **kwargs)
    with pytest.raises(ValueError, match=re.escape(error)):
        LaunchConfig(**kwargs)


class Events:
    """A `JobView` stand-in: the events emitted, as (kind, task, fields)."""

    def __init__(self):
        self.emitted = []

    def emit(self, kind, task=None, reason="", **fields):
        self.emitted.append((kind, task, fields))

    def kinds(self, kind):
        return [(task, fields) for k, task, fields in self.emitted if k == kind]


ROSTER = ["h0:2222", "h1:2222", "h2:2222"]


def test_the_roster_starts_on_its_first_workers_and_grows_once_the_new_ones_serve():
    waited, down = [], {"h2:2222"}

    def wait(addresses, seconds):
        waited.append((list(addresses), seconds))
        return [a for a in addresses if a in down]

    listed = roster.ListedWorkers(ROSTER, 1, wait=wait, join_seconds=7.0)
    assert listed.poll([]) == ROSTER[:1]
    assert roster.ListedWorkers(ROSTER).poll([]) == ROSTER  # default: all of them
    said = listed.request(3, ROSTER[:1])
    assert waited == [(ROSTER[1:], 7.0)]  # only the new ones are waited for
    assert said == ("scale to 3 workers refused, the job keeps 1: h2:2222 did not serve within "
                    "7 s. Start kfit-ps run --tasks on its host (worker:2), then ask again")
    assert listed.poll(ROSTER[:1]) == ROSTER[:1]
    assert listed.request(2, ROSTER[:1]).startswith("scaling to 2 workers: h1:2222 serves")
    assert listed.poll(ROSTER[:1]) == ROSTER[:2]
    assert listed.request(2, ROSTER[:2]) == "scale: the job already has 2 workers"
    said = listed.request(4, ROSTER[:2])
    assert said.startswith("scale to 4 workers refused: TF_CONFIG lists 3 workers"), said
    waited.clear()
    assert listed.request(1, ROSTER[:2]) == ("scaling to 1 workers: the chief drains h1:2222, "
                                             "then they may stop")
    assert waited == [] and listed.poll(ROSTER[:2]) == ROSTER[:1]  # a removal waits for nothing


@pytest.mark.parametrize("addresses, wanted, error", [
    (ROSTER, 4, "--workers: a job with --tasks chief:0 starts on the first N of TF_CONFIG's 3 "
                "workers, so N must be between 1 and 3. Received: --workers 4."),
    ([], None, "TF_CONFIG's cluster lists no worker"),
])
def test_a_roster_too_short_for_workers_names_the_flag(addresses, wanted, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        roster.ListedWorkers(addresses, wanted)


def test_the_publisher_takes_scale_requests_within_the_roster(tmp_path):
    """A request grows the published list once the new ones serve (the chief applies each
    change before the next), shrinks it, and tells the removed one it may stop once drained;
    a request beyond the roster or for an address that does not serve changes nothing."""
    said, view, clock = [], Events(), Clock()
    down = set()
    listed = roster.ListedWorkers(ROSTER, 1, wait=lambda addresses, seconds: [
        a for a in addresses if a in down])
    published = discovery.DiscoveredWorkers(str(tmp_path), said.append, view, listed,
                                            clock=clock)
    directory = str(tmp_path / membership.DIR_NAME)
    assert published.wait_for_workers(sleep=lambda s: None) == ROSTER[:1]
    assert membership.latest(directory) == (1, ROSTER[:1])
    membership.acknowledge(directory, 1)

    def poll(at):
        clock.now = at
        return published.poll(None, chief_running=True)

    down.add("h2:2222")
    membership.request_scale(str(tmp_path), 3)
    assert not poll(1.0)
    assert membership.latest(directory) == (1, ROSTER[:1])
    assert "h2:2222 did not serve" in said[-1], said
    membership.request_scale(str(tmp_path), 2)
    assert poll(2.0)
    assert membership.latest(directory) == (2, ROSTER[:2])
    assert view.kinds("worker_ready") == [("worker:0", {"address": "h0:2222"}),
                                          ("worker:1", {"address": "h1:2222"})]
    assert [fields["workers"] for _, fields in view.kinds("scale")] == [3, 2]
    membership.request_scale(str(tmp_path), 1)
    assert not poll(3.0)  # generation 2 not applied yet: one change at a time
    membership.acknowledge(directory, 2)
    assert poll(4.0)
    assert membership.latest(directory) == (3, ROSTER[:1])
    assert not poll(5.0) and view.kinds("task_removed") == []  # not drained yet
    membership.acknowledge(directory, 3)
    assert not poll(6.0)
    assert view.kinds("task_removed") == [("worker:1", {"address": "h1:2222"})]
    assert said[-1].startswith("workers from TF_CONFIG's worker list: 1 (was 2): h0:2222"), said


@pytest.mark.parametrize("kwargs, error", [
    (dict(tasks=None), "needs tasks with chief:0"),
    (dict(tasks=(("ps", 0),), command=()), "needs tasks with chief:0"),
    (dict(discover_workers="w-{i}.svc:2222"), "no --discover-workers"),
    (dict(initial_workers=0), "initial_workers"),
])
def test_bad_initial_workers_name_the_flag(kwargs, error):
    kwargs = dict(dict(command=("python", "x.py"), tasks=(("chief", 0),), initial_workers=2),
                  **kwargs)
    with pytest.raises(ValueError, match=re.escape(error)) as raised:
        LaunchConfig(**kwargs)
    assert "--workers" in str(raised.value)


def test_workers_on_a_host_without_the_chief_is_a_usage_error(capsys):
    from kfit_ps.cli.main import main

    with pytest.raises(SystemExit) as raised:
        main(["run", "--tasks", "ps:0", "--workers", "2"])
    assert raised.value.code == 2
    assert "(--workers with --tasks)" in capsys.readouterr().err


# The job: `steps` steps of a small model. Until the file `release` exists, the chief schedules
# a step every 20 ms (the fit outlasts what the test drives); while the file `hold` (if given)
# exists it schedules none (and says so in `held`), so that a worker can be killed with no step
# in it. Arguments: steps, release[, hold].
STEPS = 3000
DOMAIN = "kfit.test"
PATTERN = "worker-{i}." + DOMAIN + ":2222"
JOB = textwrap.dedent("""
    import json, os, sys, time
    import keras, kfit_ps
    import tensorflow as tf
    from tests import helpers as h

    steps, release, hold = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    strategy = kfit_ps.ParameterServerStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile("sgd", "mse", metrics=[h.counting_metric()])

    def data(context):
        x = tf.random.stateless_normal((1024, 8), seed=(1, 2))
        y = tf.reduce_sum(x, axis=1, keepdims=True)
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16)

    class Hold(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            while hold and os.path.exists(hold[0]):
                open(hold[0] + ".held", "w").close()
                time.sleep(0.01)

    history = model.fit(kfit_ps.DatasetCreator(data), epochs=1, steps_per_epoch=steps,
                        verbose=0, callbacks=[Hold(), h.paced_until(release)])
    print("RESULT " + json.dumps({"iterations": int(model.optimizer.iterations.numpy()),
                                  "batches": history.history["batches"][-1]}), flush=True)
""")

needs_hosts = pytest.mark.skipif(netns.unavailable() is not None,
                                 reason=str(netns.unavailable()))


def chief_events(tmp_path, predicate, timeout, launchers):
    """The first event of the chief's host (launcher and chief) that `predicate` accepts."""
    path, deadline = tmp_path / "chief" / "events.jsonl", time.monotonic() + timeout
    while time.monotonic() < deadline:
        if launchers.procs["chief"].poll() is not None:
            break
        for event in event_log.read(str(path)) if path.exists() else []:
            if predicate(event):
                return event
        time.sleep(0.1)
    raise AssertionError("event not seen; the launchers said:\n" + "\n".join(
        launchers.lines[-40:]) + "\n" + launcher_output(launchers, "chief"))


def launcher_output(launchers, host):
    proc = launchers.procs[host]
    return proc.stdout.read() if proc.poll() is not None else ""


def worker_steps(hosts, tmp_path, index):
    """The chief's count of steps worker `index` finished (its metrics, read in its host)."""
    url = read_tasks(tmp_path / "chief" / "tasks.json")["status_url"] + "metrics"
    text = subprocess.run(
        ["ip", "netns", "exec", hosts.namespaces["chief"], sys.executable, "-c",
         f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=5).read()"
         ".decode())"], capture_output=True, text=True, timeout=30).stdout
    pattern = (r'^kfit_ps_steps_total\{[^}]*task_index="%d"[^}]*task_type="worker"[^}]*\} (\S+)'
               % index)
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.fixture
def hosts():
    netns.remove_leftovers()
    made = netns.Hosts(["chief", "ps0", "dns", "w0", "w1", "w2", "w1b"])
    yield made
    made.close()


@pytest.mark.slow
@pytest.mark.chaos
@needs_hosts
def test_workers_found_through_dns_join_leave_and_come_back_at_a_new_address(hosts, tmp_path):
    """A 3,000-step fit on workers named `worker-<i>.kfit.test`: worker-2 is added by DNS
    alone (and its host started) and later removed from DNS; worker-1's host is killed
    and comes back at another address under the same name. Every step once, the new
    worker's first step within 15 s of its name resolving, no restart anywhere."""
    if dns.unavailable():
        helpers.missing_tool(dns.unavailable())
    ip = hosts.addresses
    hosts.use_nameserver(ip["dns"])
    server = dns.Dnsmasq(hosts, "dns", str(tmp_path), DOMAIN)
    names = {f"worker-{i}.{DOMAIN}": ip[f"w{i}"] for i in (0, 1)}
    server.set(names)
    server.wait_resolves("chief", f"worker-1.{DOMAIN}", ip["w1"])

    workers = [PATTERN.replace("{i}", str(i)) for i in range(3)]
    cluster = {"chief": [f"{ip['chief']}:2222"], "worker": workers, "ps": [f"{ip['ps0']}:2222"]}
    env = dict(helpers.chief_env(), TF_CONFIG=json.dumps(
        {"cluster": cluster, "task": {"type": "chief", "index": 0}}))
    release, hold = tmp_path / "release", tmp_path / "hold"
    (tmp_path / "job.py").write_text(JOB)
    run = Launchers(hosts, tmp_path, env)
    try:
        for host, task in (("ps0", "ps:0"), ("w0", "worker:0"), ("w1", "worker:1")):
            run.start(host, "--tasks", task)
        for host in ("ps0", "w0", "w1"):
            run.read_until(host, lambda line: "servers ready" in line)
        run.start("chief", "--tasks", "chief:0", "--discover-workers", PATTERN,
                  "--max-workers", "3", "--discovery-grace", "3", "--",
                  sys.executable, str(tmp_path / "job.py"), str(STEPS), str(release),
                  str(hold))
        chief_events(tmp_path, lambda e: e["event"] == "fit_begin", 180, run)

        # worker-2: its name resolves, its host starts; DNS alone brings it into the fit.
        names[f"worker-2.{DOMAIN}"] = ip["w2"]
        server.set(names)
        resolved = server.wait_resolves("chief", f"worker-2.{DOMAIN}", ip["w2"])
        run.start("w2", "--tasks", "worker:2")
        first = chief_events(tmp_path, lambda e: e["event"] == "first_step"
                             and e["task"] == "worker:2", 60, run)
        joined_after = first["time"] - resolved
        assert joined_after <= 15.0, joined_after

        # worker-2's name goes (a pod terminating): after the grace the chief drains it,
        # then its host stops.
        del names[f"worker-2.{DOMAIN}"]
        server.set(names)
        chief_events(tmp_path, lambda e: e["event"] == "task_removed"
                     and e["task"] == "worker:2", 60, run)
        run.procs["w2"].send_signal(signal.SIGTERM)
        assert run.procs["w2"].wait(timeout=30) == 128 + signal.SIGTERM

        # worker-1's host dies with no step in it; the name moves to a new host's address.
        hold.write_text("")
        while not (tmp_path / "hold.held").exists():
            time.sleep(0.05)
        time.sleep(1.0)  # the functions in flight finish
        before = worker_steps(hosts, tmp_path, 1)
        server_pid = run.task_pid("w1", "worker:1")
        os.kill(run.procs["w1"].pid, signal.SIGKILL)
        os.kill(server_pid, signal.SIGKILL)
        names[f"worker-1.{DOMAIN}"] = ip["w1b"]
        server.set(names)
        server.wait_resolves("chief", f"worker-1.{DOMAIN}", ip["w1b"])
        run.start("w1b", "--tasks", "worker:1")
        run.read_until("w1b", lambda line: "servers ready" in line)
        hold.unlink()
        deadline = time.monotonic() + 90
        while worker_steps(hosts, tmp_path, 1) <= before:
            assert time.monotonic() < deadline, "worker-1 did not come back:\n" + "\n".join(
                run.lines[-40:])
            time.sleep(0.5)
        comeback = time.monotonic() - (deadline - 90)

        release.write_text("")
        line = run.read_until("chief", lambda l: "[chief] RESULT " in l, timeout=300)
        assert run.procs["chief"].wait(timeout=60) == 0, "\n".join(run.lines[-60:])
        result = json.loads(line.split("RESULT ", 1)[1])
        assert result == {"iterations": STEPS, "batches": float(STEPS)}, result
        tasks = read_tasks(tmp_path / "chief" / "tasks.json")
        assert tasks["restarts"] == {}, tasks
        events = event_log.read(str(tmp_path / "chief" / "events.jsonl"))
        kinds = [e["event"] for e in events]
        assert "job_restart" not in kinds and "restart" not in kinds, kinds
        changes = [e["workers"] for e in events if e["event"] == "workers"]
        assert changes == [3, 2], changes  # worker-1's new address needed no new list
        for host in ("ps0", "w0", "w1b"):
            assert read_tasks(tmp_path / host / "tasks.json")["restarts"] == {}
        print(f"first step {joined_after:.1f} s after the name resolved; worker-1 back "
              f"{comeback:.1f} s after its host was released")
    finally:
        statuses = run.stop_all()
        print("\n".join(run.lines[-80:]))
    assert all(status == 128 + signal.SIGTERM for status in statuses.values()), statuses


ROSTER_STEPS = 2000


@pytest.mark.slow
def test_kfit_ps_scale_changes_a_multi_host_job_within_tf_config_s_workers(tmp_path):
    """`kfit-ps run --tasks chief:0,ps:0 --workers 1` with TF_CONFIG listing 2 workers, each
    under its own `kfit-ps run --tasks worker:I` on loopback: the chief starts on worker:0;
    `kfit-ps scale --workers 2` (worker:1's launcher started only after the request: the
    request waits for it to serve) brings worker:1 into the running fit, `--workers 1`
    drains it. Every step once, no restart anywhere."""
    from kfit_ps import net

    chief, ps, w0, w1 = (f"localhost:{port}" for port in net.distinct_ports("localhost", 4,
                                                                              set()))
    cluster = {"chief": [chief], "worker": [w0, w1], "ps": [ps]}
    env = dict(helpers.chief_env(), TF_CONFIG=json.dumps(
        {"cluster": cluster, "task": {"type": "chief", "index": 0}}))
    release = tmp_path / "release"
    (tmp_path / "job.py").write_text(JOB)
    hosts = netns.Processes()  # launchers on this machine's loopback
    run = Launchers(hosts, tmp_path, env)
    started = time.monotonic()
    try:
        run.start("w0", "--tasks", "worker:0")
        run.start("chief", "--tasks", "chief:0,ps:0", "--workers", "1", "--",
                  sys.executable, str(tmp_path / "job.py"), str(ROSTER_STEPS),
                  str(release))
        chief_events(tmp_path, lambda e: e["event"] == "fit_begin", 60, run)
        scaled = subprocess.run(
            [sys.executable, "-m", "kfit_ps.cli.main", "scale", "--run-dir",
             str(tmp_path / "chief"), "--workers", "2"], env=env, cwd=helpers.ROOT,
            capture_output=True, text=True, timeout=30)
        assert scaled.returncode == 0, scaled.stderr
        run.start("w1", "--tasks", "worker:1")
        chief_events(tmp_path, lambda e: e["event"] == "first_step" and e["task"] == "worker:1",
                     40, run)
        membership.request_scale(str(tmp_path / "chief"), 1)
        chief_events(tmp_path, lambda e: e["event"] == "task_removed"
                     and e["task"] == "worker:1", 30, run)
        release.write_text("")
        line = run.read_until("chief", lambda l: "[chief] RESULT " in l, timeout=60)
        assert run.procs["chief"].wait(timeout=30) == 0, "\n".join(run.lines[-60:])
        result = json.loads(line.split("RESULT ", 1)[1])
        assert result == {"iterations": ROSTER_STEPS, "batches": float(ROSTER_STEPS)}, result
        events = event_log.read(str(tmp_path / "chief" / "events.jsonl"))
        assert [e["workers"] for e in events if e["event"] == "workers"] == [2, 1], events
        assert [e["workers"] for e in events if e["event"] == "scale"] == [2, 1], events
        kinds = [e["event"] for e in events]
        assert "job_restart" not in kinds and "restart" not in kinds, kinds
        for host in ("chief", "w0", "w1"):
            assert read_tasks(tmp_path / host / "tasks.json")["restarts"] == {}, host
        print(f"scaled 1 -> 2 -> 1 in {time.monotonic() - started:.1f} s")
    finally:
        statuses = run.stop_all()
        hosts.close()
        print("\n".join(run.lines[-60:]))
    assert statuses == {"w0": 128 + signal.SIGTERM, "w1": 128 + signal.SIGTERM}, statuses
