"""`LaunchConfig`: what `kfit-ps run` / `kfit_ps.run` starts and how it recovers."""

import dataclasses

from kfit_ps import constants, validation
from kfit_ps.launch.discovery import WorkerPattern


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """A job for the supervisor: the chief's command, the servers, the recovery budget.

    Args:
        command: the chief's command line, e.g. `("python", "train.py")`. May be
            empty only with `tasks` that hold no chief (a host of servers).
        num_workers: worker servers (local form). Defaults to 2. With `tasks` that
            hold `"chief", 0`, see `initial_workers`.
        num_ps: ps servers (local form). Defaults to 1.
        max_restarts: restarts allowed per task (each worker, each ps, the chief)
            before the job fails with a summary. Defaults to 3.
        backup_dir: where `fit` backs up and resumes from (it adds a
            `BackupAndRestore` when the script has none). Defaults to None: a
            restarted chief starts over, unless the script backs up itself.
        save_freq: backups every `save_freq` steps, or `"epoch"`. Defaults to "epoch".
        run_dir: directory for per-task logs and `tasks.json`. Defaults to None
            (a new temporary directory, kept and printed).
        tasks: the multi-host form: the `(type, index)` tasks of `TF_CONFIG`'s
            cluster to run on this host, e.g. `(("ps", 0), ("chief", 0))`.
            Defaults to None: the whole cluster on this machine.
        backoff: seconds before the first restart of a task; doubles with each
            further restart of it, up to `max_backoff`. Defaults to 1.0 and 30.0.
        ps_failure_grace: seconds the chief gets to stop by itself (its `fit`
            raises `ParameterServerError`) after a ps is lost. Defaults to 60.
        grace: seconds the chief gets, after a SIGTERM to the launcher, to
            finish its steps in flight and write a final backup before it is
            killed. Defaults to 20 (Kubernetes kills a pod 30 s after its
            SIGTERM unless `terminationGracePeriodSeconds` says otherwise).
        healthy_period: seconds after which a task's restart budget is full
            again if it has not failed since. Defaults to 600.
        liveness_timeout: seconds a server of this host may accept connections
            without answering (stopped, wedged) before it is killed and
            restarted; 0 turns the check off. Defaults to 60.
        status_port: port of the status page and metrics (`/`, `/status.json`,
            `/metrics`); 0 picks a free port (said at start and written to
            `tasks.json`). The chief serves its own metrics on the next port
            (on a free one with 0), on loopback. Defaults to 0.
        status_address: address the status page listens on. Defaults to
            "127.0.0.1" (this machine only); "0.0.0.0" lets a scraper in (the
            Kubernetes manifests do, behind their NetworkPolicy).
        ps_recovery: what a lost ps costs. `"in-place"`: the launcher restarts it
            and the chief restores its variables from the last backup in the same
            process, the other ps tasks keeping their state
            (`kfit_ps.training.resilience.ps_recovery`; where that is impossible, the job
            restarts). `"restart"`: the job restarts from the last backup. On many
            hosts (`tasks`) the chief's host's setting counts: a host of servers
            restarts its lost ps either way. Defaults to "in-place".
        discover_workers: where the workers are found through DNS, on the chief's host of
            a multi-host job (`tasks` with `"chief", 0` and no worker): `HOST:PORT` with
            `{i}` for the worker's index (the names of indices 0 .. `max_workers`-1 that
            resolve), or a headless Service's name and port (its A records). The chief
            trains on the workers that resolve and serve; `TF_CONFIG`'s worker list is
            not used (`launch.discovery`). Defaults to None: `TF_CONFIG`'s workers.
        max_workers: with `discover_workers`, the most workers (the indices asked).
            Defaults to 16.
        discovery_grace: with `discover_workers`, seconds a worker's name may stop
            resolving (a pod restarting under its name) before the worker is removed.
            Defaults to 30.
        initial_workers: on the chief's host of a multi-host job (`tasks` with
            `"chief", 0`, no `discover_workers`): the job starts on the first N of
            `TF_CONFIG`'s workers; `kfit-ps scale` then changes N within that list
            (`launch.roster`). Defaults to None: all of them.
    """

    command: tuple = ()
    num_workers: int = 2
    num_ps: int = 1
    max_restarts: int = 3
    backup_dir: str = None
    save_freq: object = "epoch"
    run_dir: str = None
    tasks: tuple = None
    backoff: float = 1.0
    max_backoff: float = 30.0
    ps_failure_grace: float = 60.0
    grace: float = 20.0
    healthy_period: float = 600.0
    liveness_timeout: float = 60.0
    status_port: int = 0
    status_address: str = "127.0.0.1"
    ps_recovery: str = "in-place"
    discover_workers: str = None
    max_workers: int = 16
    discovery_grace: float = 30.0
    initial_workers: int = None

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        set_("command", tuple(str(part) for part in self.command))
        set_("num_workers", validation.check_int("num_workers", self.num_workers, 1,
                                                 owner="LaunchConfig", hint="(--workers)"))
        set_("num_ps", validation.check_int("num_ps", self.num_ps, 1, owner="LaunchConfig",
                                            hint="(--ps)"))
        set_("max_restarts", validation.check_int("max_restarts", self.max_restarts, 0,
                                                  owner="LaunchConfig",
                                                  hint="(--max-restarts)"))
        if self.save_freq != "epoch":
            set_("save_freq", validation.check_int(
                "save_freq", self.save_freq, 1, owner="LaunchConfig",
                hint="(--save-freq) Pass 'epoch' or a number of steps."))
        set_("status_port", validation.check_int("status_port", self.status_port, 0,
                                                 owner="LaunchConfig", hint="(--status-port)"))
        if self.status_port > 65534:
            raise ValueError("LaunchConfig: `status_port` must be a port below 65535 (the "
                             f"chief takes the next one). Received: status_port="
                             f"{self.status_port}. Pass 0 for a free port.")
        for name in ("backoff", "max_backoff", "ps_failure_grace", "grace", "healthy_period",
                     "liveness_timeout", "discovery_grace"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"LaunchConfig: `{name}` must be a number of seconds >= 0. "
                                 f"Received: {name}={value!r}.")
        if self.run_dir is not None and "://" in str(self.run_dir):
            raise ValueError(
                "LaunchConfig: `run_dir` (--run-dir) must be a local directory: the launcher "
                "writes its logs, tasks.json, the event log and membership/ there with plain "
                f"file I/O. Received: run_dir={self.run_dir!r}. Pass a local path; backups can "
                "live on remote storage (--backup-dir gs://...).")
        if self.ps_recovery not in constants.PS_RECOVERY_MODES:
            modes = " or ".join(repr(mode) for mode in constants.PS_RECOVERY_MODES)
            raise ValueError(f"LaunchConfig: `ps_recovery` must be {modes} (--ps-recovery). "
                             f"Received: ps_recovery={self.ps_recovery!r}.")
        if self.tasks is not None:
            set_("tasks", tuple((str(t), int(i)) for t, i in self.tasks))
            if not self.tasks:
                raise ValueError("LaunchConfig: `tasks` must name at least one task. "
                                 "Received: tasks=(). Example: --tasks ps:0,worker:1")
        runs_chief = self.tasks is None or ("chief", 0) in self.tasks
        set_("max_workers", validation.check_int("max_workers", self.max_workers, 1,
                                                 owner="LaunchConfig", hint="(--max-workers)"))
        if self.discover_workers is not None:
            self._check_discovery(runs_chief)
        if self.initial_workers is not None:
            self._check_initial_workers(runs_chief)
        if runs_chief and not self.command:
            raise ValueError(
                "LaunchConfig: the chief needs a command. Received: command=(). Example: "
                "kfit-ps run --workers 2 --ps 1 -- python train.py")
        if not runs_chief and self.command:
            raise ValueError(
                f"LaunchConfig: a command runs as the chief, but tasks={self.tasks} has no "
                "'chief:0'. Add chief:0 to --tasks on the chief's host, or drop the command.")

    def _check_discovery(self, runs_chief):
        WorkerPattern.parse(self.discover_workers)  # Names the flag when it is malformed.
        workers_here = self.tasks and any(t == constants.WORKER for t, _ in self.tasks)
        if self.tasks is None or not runs_chief or workers_here:
            raise ValueError(
                "LaunchConfig: `discover_workers` (--discover-workers) finds the workers of a "
                "multi-host job for its chief: it needs tasks with chief:0 and no worker. "
                f"Received: tasks={self.tasks}. Example: kfit-ps run --tasks chief:0 "
                "--discover-workers job-worker-{i}.job-worker.default.svc:2222 -- python "
                "train.py")

    def _check_initial_workers(self, runs_chief):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        set_("initial_workers", validation.check_int(
            "initial_workers", self.initial_workers, 1, owner="LaunchConfig",
            hint="(--workers with --tasks chief:0: the first N of TF_CONFIG's workers)"))
        if self.tasks is None or not runs_chief or self.discover_workers is not None:
            raise ValueError(
                "LaunchConfig: `initial_workers` (--workers with --tasks) starts the chief of a "
                "multi-host job on the first N of TF_CONFIG's workers: it needs tasks with "
                f"chief:0 and no --discover-workers. Received: tasks={self.tasks}, "
                f"discover_workers={self.discover_workers!r}. Pass --workers on the chief's "
                "host only (with --discover-workers, --max-workers bounds the workers).")

    @property
    def runs_chief(self):
        return self.tasks is None or ("chief", 0) in self.tasks

    def __repr__(self):
        fields = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                  if getattr(self, f.name) != f.default or f.name == "command"]
        return f"LaunchConfig({', '.join(fields)})"


# Every launch default, from the fields above: `kfit-ps run`'s flags and the Kubernetes
# manifests (`launch.manifests`) take theirs from here.
LAUNCH_DEFAULTS = {f.name: f.default for f in dataclasses.fields(LaunchConfig)}
