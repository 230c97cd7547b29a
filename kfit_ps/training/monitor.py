"""The chief's view of a running job: per-worker steps, ps load, diagnosis, events.

One `JobMonitor` per chief process (`job_monitor()`), fed by `fit` and
`evaluate`:

- every scheduled function is expected (`expect`: its steps and examples);
  when a worker finishes it (`_tf_compat.observe_closures`), the worker's
  step and example counters and its function-latency histogram move;
- while a `fit` runs, a sampler thread reads, every
  `KFIT_PS_DIAGNOSIS_INTERVAL` seconds, each worker's steps and each ps'
  CPU seconds and memory. A ps is read on the ps itself: `tf.io.read_file`
  of `/proc/self/stat` placed on the ps runs in the ps' own process, on any
  host, with no agent there. `observe.diagnosis` then names stragglers and
  hot ps, which are said on the chief's output, logged as events and set in
  the `kfit_ps_straggler` / `kfit_ps_hot_ps` gauges;
- backups, checkpoints, evaluations and epochs are timed and logged.

Metrics are served at `KFIT_PS_METRICS_PORT` when it is set (`kfit-ps run`
sets it; a plain script serves none), events appended to `KFIT_PS_EVENTS`.
"""

import collections
import contextlib
import logging
import threading
import time

import tensorflow as tf

from kfit_ps import _tf_compat, constants
from kfit_ps.observe import diagnosis, events, usage
from kfit_ps.observe import metrics as observe_metrics
from kfit_ps.observe.http import Server

log = logging.getLogger("kfit_ps.monitor")

_monitor = None
_monitor_lock = threading.Lock()


def job_monitor():
    """This process's `JobMonitor` (created on first use); a `NullMonitor` when
    `KFIT_PS_MONITOR=0`."""
    global _monitor
    with _monitor_lock:
        if _monitor is None:
            _monitor = JobMonitor() if constants.monitor_enabled() else NullMonitor()
        return _monitor


def use_monitor(monitor):
    """Makes `monitor` this process's monitor; returns the previous one (benchmarks switch
    between a `JobMonitor` and a `NullMonitor` from one `fit` to the next)."""
    global _monitor
    with _monitor_lock:
        previous, _monitor = _monitor, monitor
        return previous


class NullMonitor:
    """What `KFIT_PS_MONITOR=0` leaves: no metrics, events or diagnosis (the baseline of
    `bench/observability_overhead.py`)."""

    def __getattr__(self, name):
        return _nothing

    @contextlib.contextmanager
    def timed(self, kind, reason, **fields):
        yield

    def task_figures(self):
        return {}


def _nothing(*args, **kwargs):
    return None


def _task(task_type, index):
    return f"{task_type}:{index}"


class JobMonitor:
    """See the module doc."""

    def __init__(self):
        self.metrics = observe_metrics.Metrics(constants.job_name(), "chief")
        self.events = events.from_environment("chief")
        self.server = None
        port = constants.metrics_port()
        if port:
            try:
                self.server = Server(constants.metrics_address(), port, {
                    "/metrics": lambda: (observe_metrics.CONTENT_TYPE, self.metrics.text())})
            except OSError as e:  # Training goes on; the metrics are what is lost.
                _tf_compat.print_msg(f"kfit_ps: cannot serve metrics on port {port} "
                                     f"({constants.METRICS_PORT_ENV}): {e}")
        self.diagnosis = diagnosis.Diagnosis()
        self._lock = threading.Lock()
        self._expected = {}  # id(remote value) -> (steps, examples, phase)
        self._steps = collections.Counter()  # worker task -> training steps finished
        self._busy = collections.Counter()  # worker task -> seconds its training functions took
        self._children = {}
        self._ps = {}  # ps task -> its device
        self._eval = [0, 0]  # functions finished, functions scheduled in this evaluation
        self._quota_read = set()
        self._table_counts = {}  # (ps task, "admitted" / "evicted") -> last reading
        self._rss = {}  # ps task -> resident bytes at the last sample
        self._stop = None
        self._thread = None
        self._workers = []
        self._joined = {}  # worker task -> when the chief took it, until its first function ends

    # Scheduled functions ------------------------------------------------------------------

    def watch(self, strategy):
        """Observes the functions `strategy`'s coordinator runs (idempotent)."""
        _tf_compat.observe_closures(strategy.coordinator, self._finished)

    def expect(self, remote_value, steps, examples=None, phase="train"):
        """A function was scheduled: `steps` steps of `examples` examples each."""
        with self._lock:
            self._expected[id(remote_value)] = (steps, examples, phase)
            if phase == "eval":
                self._eval[1] += 1

    def _child(self, name, task):
        key = (name, task)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.metrics.child(name, task)
        return child

    def _finished(self, worker_index, remote_value, seconds):
        task = _task(constants.WORKER, worker_index)
        with self._lock:
            joined = self._joined.pop(task, None)
            if joined is not None:
                self.event("first_step", task, f"{task} finished its first function "
                           f"{time.monotonic() - joined:.2f} s after the chief took it",
                           seconds=round(time.monotonic() - joined, 3))
            steps, examples, phase = self._expected.pop(id(remote_value), (None, None, None))
            if phase == "train":
                self._steps[task] += steps
                self._busy[task] += seconds
            elif phase == "eval":
                self._eval[0] += 1
        self._child("kfit_ps_function_seconds", task).observe(seconds)
        if phase == "train":
            self._child("kfit_ps_steps", task).inc(steps)
            if examples:
                self._child("kfit_ps_examples", task).inc(steps * examples)
        elif phase == "eval":
            self._child("kfit_ps_eval_steps", task).inc(steps)
            done, total = self._eval
            self._child("kfit_ps_eval_progress", "chief:0").set(done / total if total else 1.0)

    def evaluation_begin(self):
        with self._lock:
            self._eval = [0, 0]
        self._child("kfit_ps_eval_progress", "chief:0").set(0.0)

    # Sampling and diagnosis ---------------------------------------------------------------

    def fit_begin(self, strategy, epochs, steps_per_epoch):
        self.watch(strategy)
        self.event("fit_begin", None, f"fit of {epochs} epochs of {steps_per_epoch} steps",
                   epochs=epochs, steps_per_epoch=steps_per_epoch)
        self._ps = {_task(constants.PS, i): f"/job:ps/replica:0/task:{i}/device:CPU:0"
                    for i in range(strategy.num_ps)}
        self._workers = workers = [_task(constants.WORKER, i) for i in range(strategy.num_workers)]
        quotas = self.diagnosis.quota
        self.diagnosis = diagnosis.Diagnosis()
        self.diagnosis.quota = quotas
        for task in workers:
            self._steps.setdefault(task, 0)
        self._quotas()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_loop, args=(self._stop,),
                                        name="kfit_ps-monitor", daemon=True)
        self._thread.start()

    def fit_end(self):
        if self._stop is not None:
            self._stop.set()
            self._thread.join(30)
            self._stop = self._thread = None
        for kind, task in sorted(self.diagnosis.named):
            self._child(f"kfit_ps_{kind}", task).set(0)
        with self._lock:
            self._expected.clear()

    def _read_on(self, device, path, optional=False):
        """The text of the file at `path` on the task of `device`. An `optional` file is looked
        up first and None where the task has none (a failed read on a server logs a gRPC error
        there and here)."""
        with tf.device(device):
            if optional and not tf.io.matching_files(path).numpy().size:
                return None
            return tf.io.read_file(path).numpy().decode()

    def _quotas(self):
        """Each ps' CPU quota, read on the ps once per ps in this process."""
        for task, device in self._ps.items():
            if task in self._quota_read:
                continue
            try:
                online = self._read_on(device, "/sys/devices/system/cpu/online", optional=True)
                cpu_max = self._read_on(device, "/sys/fs/cgroup/cpu.max", optional=True)
            except tf.errors.OpError:
                continue  # Not serving: read again in the next fit.
            self._quota_read.add(task)
            quota = usage.parse_cpu_quota(cpu_max, online)
            if quota:
                self._child("kfit_ps_ps_cpu_quota_cores", task).set(quota)
            # Only a real limit (a cgroup quota) is a share the ps can exhaust.
            if cpu_max and cpu_max.split()[0] != "max":
                self.diagnosis.quota[task] = quota

    def workers_changed(self, strategy, before, reason):
        """The coordinator's workers changed (`training.resilience.elastic`): observe the
        new coordinator, sample the new workers, forget the removed ones."""
        self.watch(strategy)
        self._workers = [_task(constants.WORKER, i) for i in range(strategy.num_workers)]
        with self._lock:
            for task in set(self._workers) - set(before):
                self._joined[task] = time.monotonic()
        for task in set(before) - set(self._workers):
            self.forget(task)
        self.event("workers", None, reason, workers=strategy.num_workers,
                   addresses=list(strategy.worker_addresses))

    def forget(self, task):
        """`task` (a worker) left the job: its series and diagnosis go; a worker added later
        at its index starts new series."""
        self.diagnosis.steps.forget(task)
        self.diagnosis.busy.forget(task)
        with self._lock:
            self._steps.pop(task, None)
            self._busy.pop(task, None)
            for key in [k for k in self._children if k[1] == task]:
                del self._children[key]
        self.metrics.forget(task)

    def _sample_loop(self, stop):
        interval = constants.diagnosis_interval()
        while not stop.wait(interval):
            try:
                self._sample(list(self._workers))
            except Exception as e:  # noqa: BLE001 - diagnosis must never stop training
                log.debug("kfit_ps: monitor sample failed: %s", e)

    def _sample(self, workers):
        now = time.monotonic()
        with self._lock:
            steps, busy = dict(self._steps), dict(self._busy)
        for task in workers:
            self.diagnosis.steps.add(task, now, steps.get(task, 0))
            self.diagnosis.busy.add(task, now, busy.get(task, 0.0))
        for task, device in self._ps.items():
            try:
                cpu, rss = usage.parse_proc_stat(self._read_on(device, "/proc/self/stat"))
            except (tf.errors.OpError, ValueError, IndexError):
                self.diagnosis.cpu.forget(task)  # Lost or restarting: no rate across it.
                continue
            self.diagnosis.cpu.add(task, now, cpu)
            self._rss[task] = rss
            self._child("kfit_ps_ps_rss_bytes", task).set(rss)
        workers_rates, ps_rates = self.diagnosis.rates(now)
        for task, rate in workers_rates.items():
            self._child("kfit_ps_worker_steps_per_second", task).set(rate)
        for task, cores in ps_rates.items():
            self._child("kfit_ps_ps_cpu_cores", task).set(cores)
        for finding in self.diagnosis.update(now):
            self._child(f"kfit_ps_{finding.kind}", finding.task).set(1 if finding.active else 0)
            kind = finding.kind if finding.active else f"{finding.kind}_cleared"
            self.event(kind, finding.task, finding.text, **finding.fields)
            _tf_compat.print_msg(f"\nkfit_ps: {finding.text}.")

    def task_figures(self):
        """{task: {figure: value}} of the last sample, for TensorBoard."""
        now = time.monotonic()
        workers, ps = self.diagnosis.rates(now)
        figures = {task: {"steps_per_second": rate} for task, rate in workers.items()}
        for task, cores in ps.items():
            figures.setdefault(task, {})["cpu_cores"] = cores
            if task in self._rss:
                figures[task]["rss_bytes"] = self._rss[task]
        return figures

    # Events and timings -------------------------------------------------------------------

    def event(self, kind, task=None, reason="", **fields):
        if self.events is not None:
            self.events.emit(kind, task, reason, **fields)

    @contextlib.contextmanager
    def timed(self, kind, reason, **fields):
        """Times a backup or checkpoint: its histogram, then its event."""
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        self._child(f"kfit_ps_{kind}_seconds", "chief:0").observe(seconds)
        self.event(kind, "chief:0", reason, seconds=round(seconds, 3), **fields)

    def epoch_end(self, epoch, logs):
        self._child("kfit_ps_epoch", "chief:0").set(epoch + 1)
        scalars = {k: float(v) for k, v in logs.items() if _is_scalar(v)}
        self.event("epoch", "chief:0", f"epoch {epoch + 1} ended", epoch=epoch, logs=scalars)

    def tables(self, stats_by_ps):
        """`table_stats(model)`: rows per ps set, admitted and evicted counted up by what
        grew since the last reading (a restored table starts its counters again)."""
        for task, stats in stats_by_ps.items():
            self._child("kfit_ps_table_rows", task).set(stats.get("rows", 0))
            for key in ("admitted", "evicted"):
                value = stats.get(key, 0)
                last = self._table_counts.get((task, key), 0)
                if value > last:
                    self._child(f"kfit_ps_table_{key}", task).inc(value - last)
                self._table_counts[(task, key)] = value


def _is_scalar(value):
    try:
        float(value)
        return True
    except (TypeError, ValueError):
        return False


def _ps_task(device):
    spec = tf.DeviceSpec.from_string(device or "")
    if spec.job == constants.PS and spec.task is not None:
        return _task(constants.PS, spec.task)
    return None


def table_stats(model, readings=None):
    """{ps task: {"rows", "admitted", "evicted"}} over the model's embedding tables: each
    shard of a sharded `Embedding` on its ps, and each shard of a `DynamicEmbedding`'s table
    (rows held, and keys admitted and rows evicted since it was created), from `readings`
    (`embeddings.read_tables(model)`, read now when not given)."""
    import keras

    from kfit_ps import embeddings

    stats = collections.defaultdict(collections.Counter)
    for layer in _tf_compat.sublayers(model):
        if isinstance(layer, keras.layers.Embedding):
            for shard in _tf_compat.shards(layer.embeddings):
                task = _ps_task(shard.device)
                if task is not None:
                    stats[task]["rows"] += int(shard.shape[0])
    if readings is None:
        readings = embeddings.read_tables(model)
    for _, shards in readings:
        for shard in shards:
            task = _ps_task(shard["device"])
            if task is not None:
                for key in ("rows", "admitted", "evicted"):
                    stats[task][key] += shard[key]
    return {task: dict(counts) for task, counts in stats.items()}
