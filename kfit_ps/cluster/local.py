"""`LocalCluster`: real worker and ps server processes on this machine.

Each worker and ps is its own OS process running a gRPC
`tf.distribute.Server` on a free localhost port; this process plays the
chief (coordinator). `start()` waits for each server's own "ready" line
(printed once it has bound its port; a probe of the port could be answered by
another process), and retries with new ports if a port was taken after we
picked it. The cluster owns its processes:

- `stop()` (and leaving the `with` block, normally or by exception or Ctrl-C)
  terminates them, then kills what is left;
- an `atexit` hook stops clusters the program forgot;
- every server watches its launcher and exits within
  `KFIT_PS_PARENT_POLL` seconds (0.5 by default) when the launcher dies,
  even by SIGKILL, so no server is ever orphaned (a server forked from the
  cluster's server template, `fork_server.py`, watches the template, which
  watches the launcher: twice that).

Example:

```python
with kfit_ps.LocalCluster(num_workers=2, num_ps=1) as cluster:
    strategy = kfit_ps.ParameterServerStrategy(cluster.cluster_resolver)
    ...
```
"""

import atexit
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import weakref

from kfit_ps import constants, net, validation
from kfit_ps.cluster import fork_server, worker_count
from kfit_ps.cluster.logs import READY_LINE, read_tail
from kfit_ps.cluster.spec import ClusterConfig
from kfit_ps.cluster.start_errors import PortTaken, ServerNotReady

log = logging.getLogger("kfit_ps.cluster")

_LIVE_CLUSTERS = weakref.WeakSet()
# Run by path: a server skips kfit_ps' __init__ and Keras (see the script's doc), and runs the
# same kfit_ps code as this process whatever else is installed (the script puts its tree first).
_SERVER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_server_main.py")
_STOP_GRACE_SECONDS = 5.0
_KILL_WAIT_SECONDS = 30.0
_START_ATTEMPTS = 3
# What a TensorFlow server logs when its port is taken.
_BIND_FAILURES = ("Failed to add port", "Could not start gRPC server", "Address already in use")


_free_port = net.free_port  # (a module attribute: tests make it hand out a taken port)


class LocalCluster:
    """A parameter-server cluster of real server processes on this machine.

    Args:
        num_workers: number of worker processes. Defaults to 2.
        num_ps: number of parameter-server processes. Defaults to 1.
        host: host name the servers are addressed by. Defaults to "localhost".
            Note that TensorFlow servers listen on all interfaces regardless.
        worker_threads: inter-op threads per worker; None picks a value that
            cannot deadlock on small machines. Defaults to None.
        startup_timeout: seconds to wait for all servers to start serving.
            Defaults to `KFIT_PS_STARTUP_TIMEOUT` or 120.
        env: extra environment variables for the server processes.
        log_dir: directory for the servers' logs (`<type>-<index>.log`), kept
            after `stop()`. Defaults to None: a temporary directory, removed.

    In a chief started by `kfit-ps run` the servers already run: `start()`
    starts none and the cluster is the launcher's (`TF_CONFIG`; its
    `--workers` / `--ps` decide, and the chief says so once). Its servers
    are the launcher's to stop, restart and scale, so `kill`, `restart` and
    `resize_workers` refuse.
    """

    def __init__(self, num_workers=2, num_ps=1, *, host="localhost", worker_threads=None,
                 startup_timeout=None, env=None, log_dir=None):
        num_workers = validation.check_int("num_workers", num_workers, 1, owner="LocalCluster")
        num_ps = validation.check_int("num_ps", num_ps, 1, owner="LocalCluster")
        worker_threads = validation.check_optional_int("worker_threads", worker_threads, 1,
                                                       owner="LocalCluster")
        self.num_workers = num_workers
        self.num_ps = num_ps
        self.host = host
        self._threads = worker_threads or constants.worker_inter_op_threads(num_workers)
        self._startup_timeout = startup_timeout or constants.startup_timeout()
        self._env = dict(env or {})
        self._procs = {}
        self._logs = {}
        self._log_start = {}
        self._log_dir = None
        self._kept_log_dir = None if log_dir is None else validation.path(log_dir)
        self._given = None  # (ClusterConfig, tasks) for `for_tasks`
        self.adopted = False  # The launcher's servers (see the class doc).
        self._lock = threading.Lock()  # Guards _procs, _logs and _stopped.
        self._stopped = False
        self._template = None  # fork_server.ForkServer, made by the first server
        self.config = None

    @classmethod
    def for_tasks(cls, config, tasks, **kwargs):
        """A cluster that runs only `tasks` of `config`, at `config`'s fixed addresses.

        This is one host's share of a multi-host cluster (`kfit-ps run --tasks`):
        `config` is the whole cluster (a `ClusterConfig`), `tasks` the
        `(task_type, index)` server tasks to run here.
        """
        tasks = tuple((t, int(i)) for t, i in tasks)
        for task_type, index in tasks:
            if task_type not in constants.SERVER_TASK_TYPES or not (
                    0 <= index < config.num_tasks(task_type)):
                raise ValueError(
                    f"LocalCluster.for_tasks: {task_type}:{index} is not a worker or ps task of "
                    f"the cluster {config.training_cluster()} ({config.source}). Received: "
                    f"tasks={list(tasks)}.")
        cluster = cls(num_workers=config.num_tasks(constants.WORKER),
                      num_ps=config.num_tasks(constants.PS), **kwargs)
        cluster._given = (config, tasks)
        return cluster

    # Lifecycle -------------------------------------------------------------------------------

    def start(self):
        """Starts every server and returns once each has announced it is serving."""
        if self.config is not None:
            raise RuntimeError("LocalCluster.start() was already called; create a new cluster.")
        if constants.launched() and not self._given:
            return self._adopt_the_launchers_servers()
        attempts = 1 if self._given else _START_ATTEMPTS  # Fixed addresses: no new ports.
        for attempt in range(1, attempts + 1):
            self.config = self._given[0] if self._given else ClusterConfig(
                cluster=self._pick_addresses(), task_type=constants.CHIEF, task_index=0,
                source="LocalCluster")
            if self._kept_log_dir:
                os.makedirs(self._kept_log_dir, exist_ok=True)
            self._log_dir = self._kept_log_dir or tempfile.mkdtemp(prefix="kfit_ps-cluster-")
            with self._lock:
                self._stopped = False
            _LIVE_CLUSTERS.add(self)
            try:
                for task_type, index in self.server_tasks():
                    self._spawn(task_type, index)
                self._wait_ready(self.server_tasks())
                break
            except PortTaken as e:
                self.stop()
                if attempt == attempts:
                    raise RuntimeError(f"{e} (after {attempt} attempts with new ports)") from None
                log.info("LocalCluster: %s; retrying with new ports", e)
            except BaseException:
                self.stop()
                raise
        log.info("LocalCluster started: %r (logs in %s)", self.config, self._log_dir)
        _warn_once_about_interfaces()
        return self

    def _adopt_the_launchers_servers(self):
        self.config = ClusterConfig.from_tf_config()
        self.adopted = True
        workers, ps = self.config.num_tasks(constants.WORKER), self.config.num_tasks(constants.PS)
        self.num_workers, self.num_ps = workers, ps
        if not _told_adopted:
            _told_adopted.append(True)
            log.warning("kfit_ps: LocalCluster under kfit-ps run trains on the launcher's %d "
                        "worker(s) and %d ps (its --workers / --ps); it starts no servers.",
                        workers, ps)
        return self

    def stop(self):
        """Terminates every server process and waits for them; idempotent.

        A `restart()` running in another thread either finishes before (and its
        server is stopped here) or fails with a RuntimeError: no server outlives
        the cluster.
        """
        with self._lock:
            self._stopped = True
            procs = list(self._procs.values())
            self._procs.clear()
            logs = list(self._logs.values())
            self._logs.clear()
        try:
            if procs and self.config is not None and "tensorflow" in sys.modules:
                # Release what this process registered on the servers while they can still
                # answer, then stop talking to them; otherwise TensorFlow logs gRPC errors for
                # each function released later. Waits (bounded) for a worker recovery in
                # progress, which must not overlap (see _tf_compat.forget_servers). A process
                # without TensorFlow (the launcher) never talked to them.
                from kfit_ps import _tf_compat

                _tf_compat.forget_servers(
                    [self.config.address(t, i) for t, i in self.server_tasks()])
        finally:  # Also when the disconnect is interrupted (a second Ctrl-C).
            worker_count.terminate(procs, _STOP_GRACE_SECONDS)
            with self._lock:
                template, self._template = self._template, None
            if template:
                template.close()
        for f in logs:
            f.close()
        if self._log_dir is not None and self._kept_log_dir is None:
            shutil.rmtree(self._log_dir, ignore_errors=True)
            self._log_dir = None
        _LIVE_CLUSTERS.discard(self)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False

    # Fault injection -----------------------------------------------------------------------

    def kill(self, task_type, index, sig=signal.SIGKILL, timeout=_KILL_WAIT_SECONDS):
        """Sends `sig` (SIGKILL by default) to one server and waits until it is gone.

        Raises TimeoutError if the process still runs after `timeout` seconds
        (it ignores or handles `sig`); it is then left running, and `stop()`
        ends it.
        """
        proc = self._proc(task_type, index)
        if proc.poll() is None:
            proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(
                f"LocalCluster.kill: server {task_type}:{index} (pid {proc.pid}) still runs "
                f"{timeout:g} s after {signal.Signals(sig).name}: it ignores or handles that "
                "signal. Use the default sig=SIGKILL, or pass a longer timeout.") from None

    def restart(self, task_type, index):
        """Starts a killed server again at the same address; waits until it serves."""
        proc = self._proc(task_type, index)
        if proc.poll() is None:
            raise RuntimeError(
                f"LocalCluster.restart: {task_type}:{index} (pid {proc.pid}) is still running. "
                f"Call kill({task_type!r}, {index}) first."
            )
        self._spawn(task_type, index)
        self._wait_ready([(task_type, index)])

    def restart_all(self):
        """Kills every server (SIGKILL) and starts each again at its address; waits for all."""
        tasks = self.server_tasks()
        for task_type, index in tasks:
            self.kill(task_type, index)
        for task_type, index in tasks:
            self._spawn(task_type, index)
        self._wait_ready(tasks)

    def resize_workers(self, num_workers):
        """Starts or stops workers so that the cluster has `num_workers`; returns once each new
        one serves. Removing stops the highest-numbered ones: tell the chief first
        (`ParameterServerStrategy.resize_workers`; `kfit-ps scale` does)."""
        self._refuse_if_adopted("resize_workers")
        worker_count.resize(self, num_workers, _free_port, _STOP_GRACE_SECONDS)

    def exited(self):
        """`{(task_type, index): exit status}` of the servers that are not running.

        A negative status is the signal that ended the process (as in `subprocess`).
        """
        with self._lock:
            return {key: p.returncode for key, p in self._procs.items() if p.poll() is not None}

    def log_tail(self, task_type, index, lines=20):
        """The last `lines` lines of a server's log (all its incarnations)."""
        if self._log_dir is None:
            return "(no log)"
        return read_tail(self._log_path(task_type, index), lines)

    def pid(self, task_type, index):
        """The process id of a server."""
        return self._proc(task_type, index).pid

    def pids(self):
        """Process ids of every live server."""
        with self._lock:
            return [p.pid for p in self._procs.values() if p.poll() is None]

    # Views -----------------------------------------------------------------------------------

    @property
    def cluster_resolver(self):
        """A `ClusterResolver` for the chief (this process)."""
        self._require_started("cluster_resolver")
        return self.config.cluster_resolver()

    @property
    def resizable(self):
        """Whether `resize_workers` can change this cluster (it picked its own addresses)."""
        return self.config is not None and not self._given and not self.adopted

    def address(self, task_type, index):
        self._require_started("address")
        return self.config.address(task_type, index)

    def __repr__(self):
        state = repr(self.config) if self.config else "not started"
        return f"LocalCluster(num_workers={self.num_workers}, num_ps={self.num_ps}; {state})"

    # Internals ------------------------------------------------------------------------------

    def _require_started(self, what):
        if self.config is None:
            raise RuntimeError(f"LocalCluster.{what} needs a started cluster: use "
                               "`with LocalCluster(...) as cluster:` or call start().")

    def _pick_addresses(self):
        taken = set()  # Ports picked for this attempt: no two tasks share one.

        def addresses(n):
            return [f"{self.host}:{port}" for port in net.distinct_ports(
                self.host, n, taken, probe=_free_port)]

        return {constants.CHIEF: addresses(1), constants.WORKER: addresses(self.num_workers),
                constants.PS: addresses(self.num_ps)}

    def server_tasks(self):
        """The `(task_type, index)` servers this cluster runs."""
        if self._given:
            return list(self._given[1])
        return [(t, i) for t in constants.SERVER_TASK_TYPES
                for i in range(self.config.num_tasks(t))]

    def _proc(self, task_type, index):
        self._require_started("kill/restart")
        self._refuse_if_adopted("kill/restart")
        key = (task_type, index)
        with self._lock:
            self._check_not_stopped()
            if key not in self._procs:
                raise ValueError(
                    f"LocalCluster has no server {task_type}:{index}. Servers: "
                    f"{', '.join(f'{t}:{i}' for t, i in self.server_tasks())}."
                )
            return self._procs[key]

    def _refuse_if_adopted(self, what):
        if self.adopted:
            raise RuntimeError(
                f"LocalCluster.{what}: under kfit-ps run the servers are the launcher's; this "
                "cluster did not start them. Use `kfit-ps scale` to change the workers.")

    def _check_not_stopped(self):
        if self._stopped:
            raise RuntimeError("LocalCluster was stopped: its servers cannot be killed or "
                               "restarted any more. Start a new LocalCluster.")

    def _spawn(self, task_type, index):
        key = (task_type, index)
        path = self._log_path(task_type, index)
        env = dict(os.environ)
        env.pop(constants.TF_CONFIG, None)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
        env[constants.TF_LOGS_ENV] = "1"  # A server's log file keeps TensorFlow's own lines.
        env.update(self._env)
        argv = [self.config.to_tf_config(task_type, index), str(os.getpid()),
                str(self._threads), path]
        with self._lock:  # With stop(): a server is spawned before it, or not at all.
            self._check_not_stopped()
            if key not in self._logs:
                self._logs[key] = open(path, "ab")
            if not os.path.exists(path):  # removed by a server that outlived its template
                self._logs[key].close()
                self._logs[key] = open(path, "ab")
            self._logs[key].flush()
            self._log_start[key] = os.path.getsize(path)  # this incarnation's log starts here
            template = self._fork_server(env)
            if template is not None:  # Forked from the cluster's server template.
                try:
                    self._procs[key] = template.spawn(argv, path, f"{task_type}:{index}")
                    return
                except RuntimeError as e:  # This server then starts on its own.
                    log.warning("kfit_ps: %s; starting it as a process of its own", e)
            # A session of its own: a signal to this process' group (Ctrl-C, `timeout`,
            # systemd) leaves the servers to `stop()`, after the chief's final backup.
            self._procs[key] = subprocess.Popen(
                [sys.executable, _SERVER_SCRIPT, *argv], stdin=subprocess.DEVNULL,
                stdout=self._logs[key], stderr=subprocess.STDOUT, env=env,
                start_new_session=True)

    def _fork_server(self, env):
        """The server template that forks a server with `env`, started by the first server
        (`fork_server.py`); None where a server is started as a process of its own: forking
        is off or impossible here, or `env` differs from the template's (TensorFlow read the
        template's at import)."""
        if self._template and not self._template.alive():  # Killed: its servers went too.
            self._template.close()
            self._template = None
        if self._template is None and fork_server.enabled():
            path = os.path.join(self._log_dir, "server-template.log")
            try:
                self._template = fork_server.ForkServer(_SERVER_SCRIPT, env, path)
            except (OSError, RuntimeError) as e:  # Each server then starts on its own.
                log.warning("kfit_ps: LocalCluster starts its servers one process each: %s", e)
                self._template = False
        if not self._template or self._template.env != env:
            return None
        return self._template

    def _log_path(self, task_type, index):
        return os.path.join(self._log_dir, f"{task_type}-{index}.log")

    def _announced_ready(self, task_type, index):
        try:
            with open(self._log_path(task_type, index), "rb") as f:
                f.seek(self._log_start[(task_type, index)])
                return READY_LINE.encode() in f.read()
        except OSError:
            return False

    def _wait_ready(self, tasks):
        def ready(name, address):  # Its own line, then a connection; an exit ends the wait.
            task_type, index = tasks[name]
            proc = self._proc(task_type, index)
            if proc.poll() is not None:
                self._raise_exited(task_type, index, proc.returncode)
            return self._announced_ready(task_type, index) and net.accepts_connections(address)

        tasks = {f"{t}:{i}": (t, i) for t, i in tasks}
        missing = net.wait_for_servers(
            [(name, self.config.address(*task)) for name, task in tasks.items()],
            self._startup_timeout, ready=ready)
        if missing:
            names = ", ".join(f"{name} ({self.config.address(*tasks[name])})" for name in missing)
            logs = "\n".join(f"The log of {name}:\n{self.log_tail(*tasks[name])}"
                             for name in missing)
            raise ServerNotReady(
                f"LocalCluster: server{'s' if len(missing) > 1 else ''} {names} did not start "
                f"serving within {self._startup_timeout:.0f}s (set "
                f"{constants.STARTUP_TIMEOUT_ENV} to wait longer).\n{logs}", task=missing[0])

    def _raise_exited(self, task_type, index, returncode):
        tail = self.log_tail(task_type, index)
        message = (f"LocalCluster: server {task_type}:{index} "
                   f"({self.config.address(task_type, index)}) exited with code {returncode} "
                   f"during start-up. Its log:\n{tail}")
        if any(marker in tail for marker in _BIND_FAILURES):
            raise PortTaken(message)
        raise RuntimeError(message)


_warned = []
_told_adopted = []


def _warn_once_about_interfaces():
    if not _warned and not constants.isolated_network():  # Isolated: nothing else can reach us.
        _warned.append(True)
        log.warning("kfit_ps: LocalCluster servers listen on all network interfaces and accept "
                    "unauthenticated connections (TensorFlow servers always do); run on a "
                    "trusted network. See docs/security.md.")


@atexit.register
def _stop_live_clusters():
    for cluster in list(_LIVE_CLUSTERS):
        cluster.stop()
