"""Every setting kfit_ps reads from the environment, in one place.

Each setting has a documented default and is read through a function here;
`TF_CONFIG` is parsed by `kfit_ps.cluster.spec.ClusterConfig.from_tf_config`
(TensorFlow's convention). `import kfit_ps` sets `KERAS_BACKEND` when unset,
and `LocalCluster` passes the environment on to its servers.

| variable | default | meaning |
| --- | --- | --- |
| `TF_CONFIG` | unset | cluster spec + this task, TensorFlow's JSON format |
| `KERAS_BACKEND` | `tensorflow` | set by `import kfit_ps` when unset; another backend is an ImportError at the first training name a process uses (`kfit_ps._setup`) |
| `KFIT_PS_STARTUP_TIMEOUT` | `120` | seconds a `LocalCluster` waits for its servers to start serving (then `kfit-ps run` kills and restarts one that does not), and a chief waits for every worker and ps to accept connections before it connects |
| `KFIT_PS_PARENT_POLL` | `0.5` | seconds between a server's checks that its launcher is alive |
| `KFIT_PS_SERVER_FORK` | `1` | `0`: `LocalCluster` starts each server as a new Python process instead of forking it from its server template (`kfit_ps.cluster.fork_server`) |
| `KFIT_PS_WORKER_INTER_OP_THREADS` | `0` | inter-op threads of a worker server; 0 = max(4, workers + 1, cores) |
| `KFIT_PS_WORKER_TIMEOUT` | `300` | seconds `fit`/`evaluate`/`predict` wait while every worker is unreachable, then raise `WorkersLostError` |
| `KFIT_PS_LAUNCHED` | unset | set by `kfit-ps run` in the chief: an uncaught `ClusterError` exits with status 75; SIGTERM stops `fit` at a safe point after a last backup (status 143, `kfit_ps.exit_status`) |
| `KFIT_PS_BACKUP_DIR` | unset | set by `kfit-ps run --backup-dir`: `fit` adds a `BackupAndRestore` there when the script has none |
| `KFIT_PS_BACKUP_FREQ` | `epoch` | its `save_freq` (`epoch` or a number of steps) |
| `KFIT_PS_RUN_DIR` | unset | set by `kfit-ps run` in the chief: the run directory (logs, `tasks.json`) |
| `KFIT_PS_ISOLATED` | unset | set by `kfit-ps quickstart` / `kfit-ps run --isolated` in the private network namespace they re-execute in |
| `KFIT_PS_PACKED_READ_MAX_BYTES` | `262144` | unsharded variables up to this size are fetched whole, in one packed transfer per ps, at the start of each step (`kfit_ps.training.step.transfers`); 0 turns packed reads off |
| `KFIT_PS_SNAPSHOT_READ_MAX_BYTES` | `33554432` | in a sharded evaluation (worker-read, exact), variables up to this size, sharded ones included, are read whole once per evaluated shard, in one packed transfer per ps; larger ones keep their per-batch reads and lookups; 0 turns this off |
| `KFIT_PS_METRIC_RESULTS_PENDING` | `1024` | finished functions' metric results the coordinator keeps before adding the oldest to its running sum (bounds its memory in long epochs) |
| `KFIT_PS_TABLE_CHUNK_ROWS` | `65536` | rows of a dynamic table that saving (`save_weights`, `.keras`) fetches from a ps at a time, and loading sends at a time (`kfit_ps.embeddings`) |
| `KFIT_PS_PROGRESS_INTERVAL` | `0.25` | seconds between progress-bar updates during `fit` (no synchronisation) |
| `KFIT_PS_EVALUATOR_IDLE_TIMEOUT` | `1800` | seconds a side-car evaluator waits for a new checkpoint in a directory that kfit_ps training does not write |
| `KFIT_PS_LOG_LEVEL` | `WARNING` | log level of the `kfit_ps` logger in the `kfit-ps` commands (a program that imports kfit_ps sets its own) |
| `KFIT_PS_WORKERS` | `2` | default `--workers` of `kfit-ps quickstart` and `kfit-ps local` |
| `KFIT_PS_PS` | `2` (quickstart), `1` (local) | default `--ps` of those commands |
| `KFIT_PS_TF_LOGS` | unset | `1`: show TensorFlow's C++ log lines on standard error (`kfit_ps.tf_logs` drops them) |
| `KFIT_PS_JOB` | `kfit_ps` | the `job` label of every metric and the job named in events and on the status page (the manifests set the job's name) |
| `KFIT_PS_STATUS_PORT` | `0` | default `--status-port` of `kfit-ps run` (0: a free port) |
| `KFIT_PS_METRICS_PORT` | unset | the chief serves its metrics (`/metrics`, Prometheus text format) on this port of `KFIT_PS_METRICS_ADDRESS`; set by `kfit-ps run` (off in a plain script unless set) |
| `KFIT_PS_METRICS_ADDRESS` | `127.0.0.1` | the address the chief's metrics listen on |
| `KFIT_PS_EVENTS` | unset | the chief appends its events (JSON lines) to this local file; set by `kfit-ps run` to `events.jsonl` in the run directory |
| `KFIT_PS_DIAGNOSIS_INTERVAL` | `3` | seconds between the chief's samples of per-worker steps and per-ps CPU (straggler and hot-ps diagnosis) |
| `KFIT_PS_MONITOR` | `1` | `0`: the chief keeps no metrics, events or diagnosis (`kfit_ps.training.monitor`) |
| `KFIT_PS_PS_RECOVERY` | `restart` | set by `kfit-ps run --ps-recovery` in the chief: `in-place` restores a lost ps' variables from the last backup in the same chief process (`kfit_ps.training.resilience.ps_recovery`); `restart`: `fit` raises `ParameterServerError` and the job restarts |
| `KFIT_PS_MEMBERSHIP` | unset | set by `kfit-ps run` in the chief: the directory where the launcher publishes the job's worker list (`kfit_ps.membership`); `fit` takes a new list at its next safe point |
| `TF_CPP_MIN_LOG_LEVEL` | servers: `1` | TensorFlow's own C++ log filter (servers log to their files); set it to override |
"""

import os

TF_CONFIG = "TF_CONFIG"

# Environment variable names; the defaults follow.
STARTUP_TIMEOUT_ENV = "KFIT_PS_STARTUP_TIMEOUT"
PARENT_POLL_ENV = "KFIT_PS_PARENT_POLL"
SERVER_FORK_ENV = "KFIT_PS_SERVER_FORK"
WORKER_THREADS_ENV = "KFIT_PS_WORKER_INTER_OP_THREADS"
PROGRESS_INTERVAL_ENV = "KFIT_PS_PROGRESS_INTERVAL"
LOG_LEVEL_ENV = "KFIT_PS_LOG_LEVEL"
WORKER_TIMEOUT_ENV = "KFIT_PS_WORKER_TIMEOUT"
LAUNCHED_ENV = "KFIT_PS_LAUNCHED"
BACKUP_DIR_ENV = "KFIT_PS_BACKUP_DIR"
BACKUP_FREQ_ENV = "KFIT_PS_BACKUP_FREQ"
RUN_DIR_ENV = "KFIT_PS_RUN_DIR"
ISOLATED_ENV = "KFIT_PS_ISOLATED"
EVALUATOR_IDLE_TIMEOUT_ENV = "KFIT_PS_EVALUATOR_IDLE_TIMEOUT"
WORKERS_ENV = "KFIT_PS_WORKERS"
PS_ENV = "KFIT_PS_PS"
TF_LOGS_ENV = "KFIT_PS_TF_LOGS"
PACKED_READ_MAX_BYTES_ENV = "KFIT_PS_PACKED_READ_MAX_BYTES"
SNAPSHOT_READ_MAX_BYTES_ENV = "KFIT_PS_SNAPSHOT_READ_MAX_BYTES"
METRIC_RESULTS_PENDING_ENV = "KFIT_PS_METRIC_RESULTS_PENDING"
TABLE_CHUNK_ROWS_ENV = "KFIT_PS_TABLE_CHUNK_ROWS"
JOB_ENV = "KFIT_PS_JOB"
STATUS_PORT_ENV = "KFIT_PS_STATUS_PORT"
METRICS_PORT_ENV = "KFIT_PS_METRICS_PORT"
METRICS_ADDRESS_ENV = "KFIT_PS_METRICS_ADDRESS"
EVENTS_ENV = "KFIT_PS_EVENTS"
DIAGNOSIS_INTERVAL_ENV = "KFIT_PS_DIAGNOSIS_INTERVAL"
MONITOR_ENV = "KFIT_PS_MONITOR"
MEMBERSHIP_ENV = "KFIT_PS_MEMBERSHIP"
PS_RECOVERY_ENV = "KFIT_PS_PS_RECOVERY"
PS_RECOVERY_MODES = ("in-place", "restart")

DEFAULT_STARTUP_TIMEOUT = 120.0
DEFAULT_PARENT_POLL = 0.5
DEFAULT_PROGRESS_INTERVAL = 0.25
DEFAULT_EVALUATOR_IDLE_TIMEOUT = 1800.0
DEFAULT_WORKER_TIMEOUT = 300.0
DEFAULT_PACKED_READ_MAX_BYTES = 256 << 10
DEFAULT_SNAPSHOT_READ_MAX_BYTES = 32 << 20
DEFAULT_METRIC_RESULTS_PENDING = 1024
DEFAULT_TABLE_CHUNK_ROWS = 1 << 16
DEFAULT_JOB = "kfit_ps"
DEFAULT_DIAGNOSIS_INTERVAL = 3.0

# Task types understood by kfit_ps, in TensorFlow's naming.
CHIEF = "chief"
WORKER = "worker"
PS = "ps"
EVALUATOR = "evaluator"
TASK_TYPES = (CHIEF, WORKER, PS, EVALUATOR)
SERVER_TASK_TYPES = (WORKER, PS)


def _float(name, default):
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(
            f"Environment variable {name} must be a number of seconds. "
            f"Received: {name}={raw!r}. Unset it to use the default {default}."
        ) from None
    if value <= 0:
        raise ValueError(
            f"Environment variable {name} must be positive. Received: {name}={raw!r}."
        )
    return value


def env_int(name, default):
    """An integer setting from the environment, or `default` when unset."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"Environment variable {name} must be an integer. Received: {name}={raw!r}."
        ) from None


def startup_timeout():
    return _float(STARTUP_TIMEOUT_ENV, DEFAULT_STARTUP_TIMEOUT)


def parent_poll_interval():
    return _float(PARENT_POLL_ENV, DEFAULT_PARENT_POLL)


def progress_interval():
    return _float(PROGRESS_INTERVAL_ENV, DEFAULT_PROGRESS_INTERVAL)


def _env_int_at_least(name, default, minimum):
    value = env_int(name, default)
    if value < minimum:
        raise ValueError(f"Environment variable {name} must be >= {minimum}. Received: "
                         f"{name}={value}. Unset it to use the default {default}.")
    return value


def packed_read_max_bytes():
    """Bytes up to which a variable is read in the step's packed read (0: none)."""
    return _env_int_at_least(PACKED_READ_MAX_BYTES_ENV, DEFAULT_PACKED_READ_MAX_BYTES, 0)


def snapshot_read_max_bytes():
    """Bytes up to which a variable is read once per shard of a sharded evaluation (0: none)."""
    return _env_int_at_least(SNAPSHOT_READ_MAX_BYTES_ENV, DEFAULT_SNAPSHOT_READ_MAX_BYTES, 0)


def metric_results_pending():
    return _env_int_at_least(METRIC_RESULTS_PENDING_ENV, DEFAULT_METRIC_RESULTS_PENDING, 1)


def table_chunk_rows():
    """Rows of a dynamic table moved per transfer when saving or loading it."""
    return _env_int_at_least(TABLE_CHUNK_ROWS_ENV, DEFAULT_TABLE_CHUNK_ROWS, 1)


def tf_config():
    """The raw `TF_CONFIG` JSON, or None when unset or empty."""
    return os.environ.get(TF_CONFIG) or None


def isolated_network():
    """Whether this process runs in kfit_ps's private network namespace (loopback only)."""
    return os.environ.get(ISOLATED_ENV) == "1"


def launched():
    """Whether this process is a chief started by `kfit-ps run`."""
    return os.environ.get(LAUNCHED_ENV, "") not in ("", "0")


def launcher_backup():
    """(backup_dir, save_freq) that `kfit-ps run --backup-dir` asked for, or None."""
    directory = os.environ.get(BACKUP_DIR_ENV)
    if not directory:
        return None
    raw = os.environ.get(BACKUP_FREQ_ENV, "epoch") or "epoch"
    if raw == "epoch":
        return directory, "epoch"
    try:
        return directory, int(raw)
    except ValueError:
        raise ValueError(
            f"Environment variable {BACKUP_FREQ_ENV} must be 'epoch' or a number of steps. "
            f"Received: {BACKUP_FREQ_ENV}={raw!r}.") from None


def worker_timeout():
    return _float(WORKER_TIMEOUT_ENV, DEFAULT_WORKER_TIMEOUT)


def evaluator_idle_timeout():
    return _float(EVALUATOR_IDLE_TIMEOUT_ENV, DEFAULT_EVALUATOR_IDLE_TIMEOUT)


def worker_inter_op_threads(num_workers):
    """Inter-op threads for a worker server.

    A worker runs one closure per coordinator thread plus the dataset
    iterator and the remote variable reads; with fewer threads than
    `num_workers + 1` a 2-core machine can deadlock (measured).
    """
    value = env_int(WORKER_THREADS_ENV, 0)
    if value > 0:
        return value
    return max(4, num_workers + 1, os.cpu_count() or 1)


def show_tf_logs():
    """Whether TensorFlow's C++ log lines should reach standard error."""
    return os.environ.get(TF_LOGS_ENV, "") not in ("", "0")


def log_level():
    return os.environ.get(LOG_LEVEL_ENV, "WARNING").upper()


def job_name():
    """The job's name: the `job` label of metrics (`KFIT_PS_JOB`)."""
    return os.environ.get(JOB_ENV) or DEFAULT_JOB


def metrics_port():
    """The port of the chief's metrics, or None: not served (`KFIT_PS_METRICS_PORT`)."""
    port = env_int(METRICS_PORT_ENV, 0)
    if not 0 <= port < 65536:
        raise ValueError(f"Environment variable {METRICS_PORT_ENV} must be a port (1-65535), or "
                         f"unset to serve no metrics. Received: {METRICS_PORT_ENV}={port}.")
    return port or None


def metrics_address():
    return os.environ.get(METRICS_ADDRESS_ENV) or "127.0.0.1"


def events_path():
    """The local file the chief appends events to, or None (`KFIT_PS_EVENTS`)."""
    return os.environ.get(EVENTS_ENV) or None


def diagnosis_interval():
    return _float(DIAGNOSIS_INTERVAL_ENV, DEFAULT_DIAGNOSIS_INTERVAL)


def monitor_enabled():
    """Whether the chief monitors its job (`KFIT_PS_MONITOR`, on unless `0`)."""
    return os.environ.get(MONITOR_ENV, "1").strip() != "0"


def membership_dir():
    """The launcher's worker-list directory (`KFIT_PS_MEMBERSHIP`), or None."""
    return os.environ.get(MEMBERSHIP_ENV) or None


def ps_recovery_in_place():
    """Whether a lost ps is restored in the same chief process (`KFIT_PS_PS_RECOVERY`)."""
    return os.environ.get(PS_RECOVERY_ENV) == "in-place"
