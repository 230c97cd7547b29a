"""The metrics of a kfit_ps job: one table of names, kinds and labels.

Metric names are a contract with dashboards and alerts: this table defines
each one, `docs/observability.md` prints it, `tests/test_observability.py`
pins it. Every metric carries the labels `kfit_job`, `task_type` and
`task_index` and no other (not `job`: Prometheus sets `job` on every scraped
series itself, and under default scrape configs renames a `job` label of the
page to `exported_job`), except `kfit_ps_task_restarts_total`, whose
`reason` takes one of `RESTART_REASONS`: label sets stay bounded (no
per-step, per-id or per-pid label).

Who serves which:

- the chief (`kfit_ps.training.monitor`), at `KFIT_PS_METRICS_PORT`: what
  only the coordinator sees (steps and function latency per worker, ps load,
  diagnosis, backups, evaluation, tables);
- each launcher (`kfit-ps run`), at `--status-port`: the processes of its
  host (CPU, memory, up, restarts), and on the chief's host the chief's
  metrics too, so that one port per pod is scraped.
"""

import threading

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LABELS = ("kfit_job", "task_type", "task_index")
# Dispatched-function latency: 1 ms to 1000 s, three buckets per decade.
FUNCTION_BUCKETS = tuple(m * 10.0 ** e for e in range(-3, 3) for m in (1, 2, 5)) + (1000.0,)
SAVE_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1000.0)
# Why a task was restarted (the `reason` label): a bounded set.
RESTART_REASONS = ("killed", "cluster_error", "program_error", "signal", "not_ready", "wedged",
                   "job_restart", "chief_gone")

# name: (kind, help, extra labels, served by)
TABLE = {
    # The chief's view.
    "kfit_ps_steps": (Counter, "Training steps finished, per worker", (), "chief"),
    "kfit_ps_examples": (Counter, "Training examples finished, per worker (when the batch "
                         "size is static)", (), "chief"),
    "kfit_ps_function_seconds": (Histogram, "Latency of a dispatched function (dispatch to "
                                 "result on the chief), per worker; buckets 1 ms to 1000 s",
                                 (), "chief"),
    "kfit_ps_worker_steps_per_second": (Gauge, "Training steps per second over the diagnosis "
                                        "window, per worker", (), "chief"),
    "kfit_ps_straggler": (Gauge, "1 while the worker is named a straggler", (), "chief"),
    "kfit_ps_ps_cpu_cores": (Gauge, "CPU cores a ps used over the diagnosis window (read on "
                             "the ps itself)", (), "chief"),
    "kfit_ps_ps_cpu_quota_cores": (Gauge, "The ps' CPU quota in cores (its cgroup's cpu.max, "
                                   "else its host's CPUs)", (), "chief"),
    "kfit_ps_ps_rss_bytes": (Gauge, "Resident memory of a ps (read on the ps itself)", (),
                             "chief"),
    "kfit_ps_hot_ps": (Gauge, "1 while the ps is named hot", (), "chief"),
    "kfit_ps_table_rows": (Gauge, "Embedding rows a ps holds: Embedding tables (each shard "
                           "of a sharded one on its ps) and DynamicEmbedding shards, read at "
                           "each epoch end", (), "chief"),
    "kfit_ps_table_admitted": (Counter, "Keys admitted into the dynamic-table shards of a ps",
                               (), "chief"),
    "kfit_ps_table_evicted": (Counter, "Rows evicted from the dynamic-table shards of a ps", (),
                              "chief"),
    "kfit_ps_backup_seconds": (Histogram, "Duration of a backup (BackupAndRestore, kfit-ps "
                               "run --backup-dir)", (), "chief"),
    "kfit_ps_checkpoint_seconds": (Histogram, "Duration of a checkpoint (ModelCheckpoint)", (),
                                   "chief"),
    "kfit_ps_eval_steps": (Counter, "Evaluation steps (or shards) finished, per worker", (),
                           "chief"),
    "kfit_ps_eval_progress": (Gauge, "Fraction of the running evaluation finished", (),
                              "chief"),
    "kfit_ps_epoch": (Gauge, "Epochs finished in the current fit", (), "chief"),
    # The launcher's view of its host.
    "kfit_ps_task_up": (Gauge, "1 while the task's process runs", (), "launcher"),
    "kfit_ps_task_cpu_seconds": (Counter, "CPU seconds used by the task's current process",
                                 (), "launcher"),
    "kfit_ps_task_rss_bytes": (Gauge, "Resident memory of the task's process", (), "launcher"),
    "kfit_ps_task_restarts": (Counter, "Restarts of the task, by reason: "
                              + ", ".join(RESTART_REASONS), ("reason",), "launcher"),
}


class Metrics:
    """The metrics one process serves: those of `TABLE` served by `role`, in their own
    registry (never the global one: a script's own metrics stay its own)."""

    def __init__(self, job, role):
        self.job = job
        self.registry = CollectorRegistry(auto_describe=True)
        self._metrics = {}
        self._series = {}  # task -> {(metric name, label values)} of its series
        self._lock = threading.Lock()
        for name, (kind, help_text, extra, served_by) in TABLE.items():
            if served_by != role:
                continue
            kwargs = {}
            if kind is Histogram:
                kwargs["buckets"] = (FUNCTION_BUCKETS if name == "kfit_ps_function_seconds"
                                     else SAVE_BUCKETS)
            self._metrics[name] = kind(name, help_text, LABELS + extra, registry=self.registry,
                                       **kwargs)

    def child(self, name, task, **extra):
        """The time series of metric `name` for `task` (`"worker:1"`)."""
        task_type, index = task.split(":")
        values = (self.job, task_type, index, *extra.values())  # LABELS, then the extra ones
        with self._lock:
            self._series.setdefault(task, set()).add((name, values))
        return self._metrics[name].labels(*values)

    def forget(self, task):
        """Removes every series of `task`: a worker that left the job is no longer a task of
        it (neither "up" nor "down"), and alerts on `kfit_ps_task_up == 0` stay quiet."""
        with self._lock:
            series = self._series.pop(task, set())
        for name, values in series:
            self._metrics[name].remove(*values)

    def text(self):
        """The Prometheus text exposition of every metric."""
        return prometheus_client.generate_latest(self.registry)


CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST


def parse(text):
    """{(name, frozenset(labels.items())): value} of every sample of a metric page, parsed
    with `prometheus-client`'s own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples
