"""The supervisor behind `kfit-ps run`: the parent of every process of a job.

It starts the worker and ps servers (a `LocalCluster`, logs in the run
directory), then the user's script as the chief with `TF_CONFIG` set, and
watches them all. What it does when one ends is `policy.RestartPolicy`'s
decision; this module only carries it out:

- a worker is restarted at its address, and TensorFlow takes it back; workers
  join and leave on `kfit-ps scale` (`launch.scaling`; on the chief's host of a
  `--tasks` job, within `TF_CONFIG`'s workers: `launch.roster`), or, with
  `--discover-workers`, as their names resolve in DNS (`launch.discovery`);
- a lost ps is restarted alone and the chief restores it in place
  (`--ps-recovery in-place`, the default); with `restart`, or when the chief
  cannot, its `fit` stops (`ParameterServerError`; stopped after
  `ps_failure_grace`), then the job restarts. On a host of servers without the
  chief (`--tasks`), its ps is restarted alone too: the chief, elsewhere, learns
  of it through its connection and restores it in place or restarts the job;
- a job restart stops the chief, restarts every server of this host and
  starts the chief again, which resumes from its last backup;
- SIGTERM (a drain or preemption on Kubernetes) is forwarded to the chief,
  which finishes the steps in flight, writes a final backup and exits
  (`kfit_ps.training.resilience.preemption`); after `grace` seconds it is killed. Then
  every server stops and the supervisor exits with `exit_status.PREEMPTED`.
  Ctrl-C stops everything within seconds. If the supervisor is killed, the
  servers (which watch it) and the chief (parent-death signal) follow.
- when the chief finishes (status 0), the `--backup-dir` is deleted: backups belong
  to the whole script (a rerun skips the `fit`s that completed), not to one `fit`.

`run_dir/tasks.json` lists each task's current process and the status page's
address; `run_dir/events.jsonl` is the event log (`job_view`). The exit status
(`kfit_ps.exit_status`) is the chief's when it finished or failed,
`RESTARTS_EXHAUSTED` when a task failed more often than allowed, 128 + the
signal when stopped by one.
"""

import os
import signal
import sys
import tempfile
import threading
import time

from kfit_ps import constants, exit_status
from kfit_ps.cluster.local import LocalCluster
from kfit_ps.cluster.start_errors import ServerNotReady
from kfit_ps.cluster.spec import ClusterConfig
from kfit_ps.launch import chief_process, chief_watch, discovery, roster
from kfit_ps.launch.events import TaskExit
from kfit_ps.launch.job_view import JobView
from kfit_ps.launch.liveness import LivenessWatch
from kfit_ps.launch.policy import Action, RestartPolicy
from kfit_ps.launch.scaling import Scaler

CHIEF = "chief:0"
JOB = "the job"


class _StopRequested(Exception):
    """A stop signal arrived while the supervisor was busy starting processes."""


class _Failed(Exception):
    """The job cannot go on (a server never started within its budget)."""

    def __init__(self, status):
        super().__init__(status)
        self.status = status


class Supervisor:
    """Runs one `LaunchConfig` to the end; see the module doc."""

    def __init__(self, config, policy=None, out=None):
        self.config = config
        self.policy = policy or RestartPolicy(config.max_restarts, config.backoff,
                                              config.max_backoff, config.healthy_period,
                                              config.ps_failure_grace)
        self.out = out or sys.stdout
        self.run_dir = config.run_dir or tempfile.mkdtemp(prefix="kfit_ps-run-")
        self.cluster = None
        self.chief = None
        self._stop_signal = None
        self._seen = set()  # (task, pid) of every exit already decided on
        self._server_lost = False  # a ps was lost since the current chief started
        self._ps_lost_at = None
        self._due = {}  # task (or JOB) -> when to restart it: back-offs never block the loop
        self._busy = False  # starting processes: a stop signal interrupts at once
        self._chief_due = False  # a job restart waits for its servers before its chief
        self._chief_watch = None  # a host of ps tasks without the chief watches it
        self._liveness = LivenessWatch(config.liveness_timeout)
        self.view = None  # Metrics, events, the status page: from the start of the run.
        self._scaler = None  # `kfit-ps scale` requests, or DNS (a job with the chief here)

    def say(self, message):
        print(f"kfit-ps run: {message}", file=self.out, flush=True)

    # The whole run ---------------------------------------------------------------------------

    def run(self):
        """Starts the job and supervises it; returns its exit status."""
        previous = self._catch_stop_signals()
        status = None
        try:
            self._interruptible(self._start_all)
            status = self._loop()
        except _StopRequested:  # While servers were starting: the chief may be running.
            status = self._stop_on_signal(self._stop_signal)
        except _Failed as e:
            status = e.status
        finally:
            self._shutdown()
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            if self.view is not None:
                self.view.finish(status)
        return status

    def _catch_stop_signals(self):
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {}
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, self._on_stop_signal)
        return previous

    def _on_stop_signal(self, signum, frame):
        self._stop_signal = signum
        if self._busy:
            self._busy = False
            raise _StopRequested()

    def _interruptible(self, start, *args):
        """Runs `start(*args)` (which may wait for servers) so that a stop signal ends it."""
        if self._stop_signal is not None:
            raise _StopRequested()
        self._busy = True
        try:
            return start(*args)
        finally:
            self._busy = False

    def _start_all(self):
        os.makedirs(self.run_dir, exist_ok=True)
        self.say(f"{self.config!r}; logs in {self.run_dir}")
        self.view = JobView.open(self.config, self.run_dir, self.say)
        self._scaler = self._make_scaler()
        if self.config.runs_chief and not self.config.backup_dir:
            self.say("no --backup-dir: if the chief or a ps is lost, the job starts over from "
                     "the beginning (unless the script uses kfit_ps.callbacks.BackupAndRestore)")
        self._start_servers()
        if isinstance(self._scaler, discovery.DiscoveredWorkers):
            workers = self._scaler.wait_for_workers()
            self.say(f"workers from {self._scaler.source}: {', '.join(workers)}")
        if self.config.runs_chief:
            self._start_chief()
        else:
            self._chief_watch = chief_watch.for_host(self.cluster, self.config.tasks)
        self._write_tasks()

    def _make_scaler(self):
        """Who publishes the chief's workers: `Scaler` when this launcher starts them (one
        host); on the chief's host of a `--tasks` job, DNS or `TF_CONFIG`'s list; else none."""
        if not self.config.runs_chief:
            return None
        if self.config.tasks is None:
            return Scaler(self.run_dir, self.say, self.view)
        if self.config.discover_workers:
            return discovery.DiscoveredWorkers.through_dns(
                self.run_dir, self.say, self.view, self.config.discover_workers,
                self.config.max_workers, self.config.discovery_grace)
        listed = ClusterConfig.from_tf_config().cluster.get(constants.WORKER, [])
        return discovery.DiscoveredWorkers(
            self.run_dir, self.say, self.view,
            roster.ListedWorkers(listed, self.config.initial_workers))

    def _start_servers(self):
        """Starts this host's servers; one that does not start serving in time is killed and
        every server started again after a back-off, within its restart budget."""
        while True:
            self.cluster = self._make_cluster()
            if self.cluster is None:
                return
            try:
                self.cluster.start()  # On failure it stops every server it started.
                self.say(f"servers ready: {self.cluster.config!r}")
                self._servers_started()
                return
            except ServerNotReady as e:
                decision = self.policy.not_ready(e.task, str(e))
            self.say(decision.reason)
            if decision.action is Action.FAIL:
                raise _Failed(decision.exit_status)
            time.sleep(decision.delay)  # A stop signal ends the wait (_StopRequested).

    def _servers_started(self):
        for task_type, index in self.cluster.server_tasks():
            self.view.started_task(f"{task_type}:{index}", self.cluster.pid(task_type, index))

    def _make_cluster(self):
        if self.config.tasks is None:
            return LocalCluster(self.config.num_workers, self.config.num_ps,
                                log_dir=self.run_dir)
        servers = [t for t in self.config.tasks if t[0] in constants.SERVER_TASK_TYPES]
        if not servers:
            return None
        return LocalCluster.for_tasks(ClusterConfig.from_tf_config(), servers,
                                      log_dir=self.run_dir)

    def _start_chief(self):
        if self.config.tasks is None:
            tf_config = self.cluster.config.to_tf_config(constants.CHIEF, 0)
        else:
            config = ClusterConfig.from_tf_config()
            # The workers from DNS or TF_CONFIG's list (--workers, kfit-ps scale), as last
            # published.
            config = ClusterConfig(dict(config.cluster, worker=self._scaler.workers),
                                   source=f"{config.source} and {self._scaler.source}")
            tf_config = config.to_tf_config(constants.CHIEF, 0)
        env = chief_process.environment(tf_config, self.config.backup_dir,
                                        self.config.save_freq, self.run_dir,
                                        metrics_port=self.view.chief_metrics_port,
                                        events=self.view.events_path,
                                        membership=self._scaler and self._scaler.directory,
                                        ps_recovery=self.config.ps_recovery)
        self.chief = chief_process.ChiefProcess(
            self.config.command, env, os.path.join(self.run_dir, "chief-0.log"), out=self.out)
        self.view.started_task(CHIEF, self.chief.pid)
        self._server_lost, self._ps_lost_at = False, None

    # Supervision ----------------------------------------------------------------------------

    def _loop(self):
        while True:
            if self._stop_signal is not None:
                return self._stop_on_signal(self._stop_signal)
            event = self._next_exit()
            if event is None:
                self.view.tick()
                self._stop_chief_if_ps_grace_passed()
                self._restart_what_is_due()
                self._start_chief_once_servers_serve()
                self._restart_ps_when_the_chief_went_away()
                self._kill_wedged_servers()
                self._scale()
                time.sleep(0.1)
                continue
            decision = self.policy.decide(
                event, self._server_lost,
                ps_in_place=self._chief_runs() and self.config.ps_recovery == "in-place",
                chief_elsewhere=not self.config.runs_chief)
            self.say(decision.reason)
            self.view.record_exit(event, decision)
            if decision.action is Action.FINISH:
                chief_process.remove_backups(self.config.backup_dir)
            if decision.action in (Action.FINISH, Action.FAIL):
                return decision.exit_status
            if decision.action is Action.WAIT_FOR_CHIEF and self.chief is not None:
                self._server_lost, self._ps_lost_at = True, time.monotonic()
                continue
            # RESTART_JOB; RESTART_TASK for a worker, or a ps (restored in place by the chief,
            # which exits 75 if it cannot: the job restarts; or on a host without the chief).
            task = JOB if decision.action is Action.RESTART_JOB else event.task
            self._due[task] = time.monotonic() + decision.delay

    def _scale(self):  # A `kfit-ps scale` request (`launch.scaling`), never in a restart.
        if self._scaler and not (self._due or self._chief_due or self._stop_signal) and \
                self._interruptible(self._scaler.poll, self.cluster, self._chief_runs()):
            self._write_tasks()

    def _chief_runs(self):
        return self.chief is not None and self.chief.poll() is None

    def _stop_on_signal(self, signum):
        """SIGTERM: the chief saves and stops within `grace`; then everything stops."""
        name = signal.Signals(signum).name
        if self.view is not None:
            self.view.emit("stop", None, f"{name} received", signal=name)
        if signum == signal.SIGTERM and self._chief_runs():
            self.say(f"{name} received: the chief finishes its steps in flight and writes a "
                     f"final backup (up to {self.config.grace:g} s), then every task stops")
            self._seen.add((CHIEF, self.chief.pid))
            status = self.chief.stop(grace=self.config.grace)
            self.say(f"the chief stopped with {exit_status.describe(status)}")
        elif self._chief_runs():  # SIGINT: the chief stops as a Ctrl-C stops a script.
            self.say(f"{name} received: stopping every task")
            self._seen.add((CHIEF, self.chief.pid))
            self.chief.stop(signum=signum)
        else:
            self.say(f"{name} received: stopping every task")
        return exit_status.for_signal(signum)

    def _restart_what_is_due(self):
        now = time.monotonic()
        if JOB in self._due:
            if self._due[JOB] <= now:
                self._due.clear()  # A job restart restarts every server too.
                self._restart_job()
            return
        for task, due in sorted(self._due.items()):
            if due <= now:
                del self._due[task]
                self._restart_server(task)

    def _next_exit(self):
        """The next process end not decided on yet (servers first), or None."""
        if self.cluster is not None:
            for (task_type, index), status in sorted(self.cluster.exited().items()):
                key = (f"{task_type}:{index}", self.cluster.pid(task_type, index))
                if key not in self._seen:
                    self._seen.add(key)
                    return TaskExit(key[0], status, self.cluster.log_tail(task_type, index))
        if self.chief is not None:
            status = self.chief.poll()
            key = (CHIEF, self.chief.pid)
            if status is not None and key not in self._seen:
                self._seen.add(key)
                return TaskExit(CHIEF, status, self.chief.log_tail())
        return None

    def _stop_chief_if_ps_grace_passed(self):
        if self._ps_lost_at is None or self.chief is None or self.chief.poll() is not None:
            return
        decision = self.policy.chief_overdue(time.monotonic() - self._ps_lost_at)
        if decision is not None:
            self.say(decision.reason)
            self._carry_out(decision, CHIEF)

    def _restart_server(self, task):
        if self._stop_signal is not None:
            return
        task_type, index = task.split(":")
        try:
            self._interruptible(self.cluster.restart, task_type, int(index))
            news = f"{task} is back (pid {self.cluster.pid(task_type, int(index))})"
            self.view.started_task(task, self.cluster.pid(task_type, int(index)))
        except ServerNotReady as e:
            news = self._not_ready(e)
        except RuntimeError as e:  # It exited while starting: its exit is the next event.
            news = f"{task} did not start: {str(e).splitlines()[0]}"
        self._write_tasks()  # Before the news: whoever reads "is back" finds tasks.json current.
        self.say(news)

    def _restart_ps_when_the_chief_went_away(self):
        """Restarts this host's ps tasks once the chief they served is gone (not counted
        against their budget): a ps never keeps a dead chief's variables."""
        if self._chief_watch is None or not self._chief_watch.gone():
            return
        decision = self.policy.chief_gone(self._chief_watch.address)
        self.say(decision.reason)
        for task_type, index in self.cluster.server_tasks():
            task = f"{task_type}:{index}"
            if task_type == constants.PS and task not in self._due:
                self._carry_out(decision, task, "chief_gone")

    def _kill_wedged_servers(self):
        """SIGKILLs a server that accepts connections but has stopped answering; its exit is
        then decided on like any other (a worker is restarted, TensorFlow re-runs its work)."""
        if self.cluster is None or self.cluster.config is None:
            return
        exited = self.cluster.exited()
        servers = {f"{t}:{i}": (self.cluster.pid(t, i), self.cluster.config.address(t, i))
                   for t, i in self.cluster.server_tasks() if (t, i) not in exited}
        for task in self._liveness.wedged(servers):
            decision = self.policy.wedged(task, self._liveness.timeout)
            self.say(decision.reason)
            self._carry_out(decision, task, "wedged")

    def _carry_out(self, decision, task, why=None):
        """Carries out a decision taken beside a task's exit, on `task`: `STOP_CHIEF` stops
        the chief; `KILL_TASK` kills a server, whose exit is then decided on like any other;
        `RESTART_TASK` kills it and starts it again at once, its exit not decided on (nor
        counted). `why` names the restart in the metrics and events."""
        if decision.action is Action.STOP_CHIEF:
            self.chief.stop()
            return
        if decision.action not in (Action.KILL_TASK, Action.RESTART_TASK):
            raise ValueError(f"the supervisor cannot carry out {decision.action} on {task} "
                             f"beside a task's exit (decision: {decision.reason!r})")
        task_type, index = task.split(":")
        if decision.action is Action.RESTART_TASK:
            self._seen.add((task, self.cluster.pid(task_type, int(index))))
        self.view.restart_is_due(task, why)
        self.cluster.kill(task_type, int(index))  # (returns at once if it already ended)
        if decision.action is Action.RESTART_TASK:
            self._restart_server(task)

    def _not_ready(self, error):
        """Kills a server that runs but does not serve; its restart is due after a back-off."""
        task_type, index = error.task.split(":")
        self._seen.add((error.task, self.cluster.pid(task_type, int(index))))
        self.view.restart_is_due(error.task, "not_ready")
        self.cluster.kill(task_type, int(index))
        decision = self.policy.not_ready(error.task, str(error))
        if decision.action is Action.FAIL:
            raise _Failed(decision.exit_status)
        self._due[error.task] = time.monotonic() + decision.delay
        return decision.reason

    def _restart_job(self):
        if self._stop_signal is not None:
            return
        if self.chief is not None:
            self._seen.add((CHIEF, self.chief.pid))
            self.chief.stop()
            self.chief = None
        if self.cluster is not None:
            try:
                self._interruptible(self.cluster.restart_all)
                self._servers_started()
            except ServerNotReady as e:
                self.say(self._not_ready(e))
            except RuntimeError as e:  # It exited while starting: its exit is the next event.
                self.say(f"a server did not start: {str(e).splitlines()[0]}")
        self._chief_due = self.config.runs_chief
        self._start_chief_once_servers_serve()
        self._write_tasks()

    def _start_chief_once_servers_serve(self):
        """Starts the chief of a job restart once no server is down or due: never against a
        half-started cluster."""
        if not self._chief_due or self._due or self._stop_signal is not None:
            return
        if self.cluster is not None and self.cluster.exited():
            return  # Its exit is decided on first (a restart becomes due).
        self._chief_due = False
        self._start_chief()
        self._write_tasks()

    def _write_tasks(self):
        tasks = {}
        if self.cluster is not None and self.cluster.config is not None:
            for task_type, index in self.cluster.server_tasks():
                tasks[f"{task_type}:{index}"] = self.cluster.pid(task_type, index)
        if self.chief is not None:
            tasks[CHIEF] = self.chief.pid
        self.view.write_tasks(tasks, dict(self.policy.failures))

    def _shutdown(self):
        if self._scaler is not None:
            self._scaler.close()
        if self.chief is not None:
            self.chief.stop()
            self.chief.close()
        if self.cluster is not None:
            self.cluster.stop()

