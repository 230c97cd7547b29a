"""`SidecarEvaluator`: evaluates each checkpoint a training job writes, once, in its own process.

The evaluator is not part of the training cluster: it needs no server and
never slows workers down. It watches a directory, loads each new complete
checkpoint into its own (ordinary Keras) model and evaluates it on its own
data. `kfit-ps evaluator` runs one from the command line (task type
`evaluator` in `TF_CONFIG`).

A checkpoint is a `.weights.h5` or `.keras` file in `checkpoint_dir` (a
local path or any `tf.io.gfile` URL). Files written by
`kfit_ps.callbacks.ModelCheckpoint` carry a marker written after the file is
complete, with the training step and the file's digest: such a file is
evaluated once its bytes match its marker, from those very bytes, so a file
being overwritten is never read half-written nor labelled with an old step.
In a directory that kfit_ps training writes, files without a marker are in
flight and skipped. Other directories' files (stock Keras callbacks) are
evaluated once they have not changed for `settle_seconds`; if loading still
fails (a partly written file), they are retried on later polls.

Each checkpoint's bytes are read when it is evaluated: one checkpoint at a
time is in memory, however many wait. With `export_best`, the export is
published with a marker holding the monitored value, and a restarted
evaluator starts from that value: it never overwrites a better export.

When does it stop? At `max_evaluations`; when kfit_ps training has written
its "training done" file and every checkpoint is evaluated; when kfit_ps
training has written its "training failed" file (the program failed in
`fit`; `training_failed` then holds the error); or after
`idle_timeout` seconds without a new checkpoint. Stock Keras callbacks write
no "done" file, so for a directory that kfit_ps training has not written,
`idle_timeout=None` means `KFIT_PS_EVALUATOR_IDLE_TIMEOUT` (30 minutes by
default), said in a log line, instead of waiting forever.
"""

import dataclasses
import io
import logging
import os
import shutil
import tempfile
import time

import h5py
import numpy as np
import tensorflow as tf

from kfit_ps import constants, validation
from kfit_ps.training.callbacks import checkpoint_files, summaries
from kfit_ps.training.inputs import adapters

logger = logging.getLogger("kfit_ps.evaluator")

_SUFFIXES = (".weights.h5", ".keras")


@dataclasses.dataclass(frozen=True)
class CheckpointEvaluation:
    """One evaluated checkpoint: its file, training step and metrics."""

    path: str
    step: int
    logs: dict


def _h5_step(data):
    """`iterations` saved in the bytes of a Keras weights file (None without an optimizer)."""
    try:
        with h5py.File(io.BytesIO(data), "r") as f:
            if "optimizer/vars/0" in f:
                return int(np.asarray(f["optimizer/vars/0"]))
    except (OSError, KeyError, ValueError, TypeError):
        return None
    return None


def _evaluation_data(data, steps):
    """What `model.evaluate` takes for `data`; a `DatasetCreator` is called once, here."""
    if not adapters.is_dataset_creator(data):
        return data
    dataset = adapters.as_dataset_creator(data)(tf.distribute.InputContext())
    if steps is None and dataset.cardinality() == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            f"SidecarEvaluator: `data` is {data!r}, whose dataset is infinite (repeated), and "
            "`steps` is None, so an evaluation would never end. Received: steps=None. Pass "
            "`steps=N` (batches per evaluation), or return a finite dataset from the function.")
    return dataset


class SidecarEvaluator:
    """Evaluates every new checkpoint in `checkpoint_dir` exactly once.

    ```python
    model = build_model()                      # same architecture as in training
    model.compile(loss="mse", metrics=["mae"])
    kfit_ps.SidecarEvaluator(model, val_dataset, "ckpt", max_evaluations=10).start()
    ```

    Args:
        model: a compiled Keras model with the trained model's architecture.
        data: what `model.evaluate` accepts (a finite dataset, or with `steps`),
            or the training job's `kfit_ps.DatasetCreator`, which is called once
            with a single-pipeline input context.
        checkpoint_dir: directory that training's `ModelCheckpoint` writes.
        steps: evaluation steps per checkpoint (None: the whole `data`).
        max_evaluations: stop after this many evaluations. Defaults to None:
            stop when training has finished and its last checkpoint is evaluated.
        callbacks: Keras callbacks for each `evaluate`.
        log_dir: TensorBoard summaries go to `log_dir/validation` (scalars
            `evaluation_<metric>_vs_iterations`, step = training step).
            Defaults to `checkpoint_dir`.
        export_best: path (`.keras`) to save the model whenever `monitor`
            improves. Defaults to None (no export).
        monitor, mode: metric and direction (`"min"`/`"max"`) for `export_best`.
        poll_interval: seconds between directory scans. Defaults to 1.
        idle_timeout: stop after this many seconds without a new checkpoint.
            Defaults to None: wait for kfit_ps training to finish, or, in a
            directory kfit_ps training has not written, for
            `KFIT_PS_EVALUATOR_IDLE_TIMEOUT` seconds (1800 by default).
        settle_seconds: how long a file without a kfit_ps marker must stay
            unchanged before it is read. Defaults to 2.
    """

    def __init__(self, model, data, checkpoint_dir, steps=None, max_evaluations=None,
                 callbacks=None, log_dir=None, export_best=None, monitor="loss", mode="min",
                 poll_interval=1.0, idle_timeout=None, settle_seconds=2.0):
        if not getattr(model, "compiled", False):
            raise ValueError("SidecarEvaluator: `model` must be compiled with the loss and "
                             "metrics to report. Call model.compile(loss=..., metrics=[...]).")
        max_evaluations = validation.check_optional_int("max_evaluations", max_evaluations, 1,
                                                        owner="SidecarEvaluator")
        if mode not in ("min", "max"):
            raise ValueError(f"SidecarEvaluator: `mode` must be 'min' or 'max'. "
                             f"Received: mode={mode!r}.")
        if export_best is not None and not os.fspath(export_best).endswith(".keras"):
            raise ValueError("SidecarEvaluator: `export_best` must be a path ending in "
                             f"'.keras'. Received: export_best={export_best!r}.")
        self.model, self.steps = model, steps
        self.data = _evaluation_data(data, steps)
        self.checkpoint_dir = validation.path(checkpoint_dir)
        self.max_evaluations = max_evaluations
        self.callbacks = callbacks
        self.log_dir = validation.path(log_dir) if log_dir is not None else self.checkpoint_dir
        self.export_best, self.monitor, self.mode = export_best, monitor, mode
        self.poll_interval, self.idle_timeout = poll_interval, idle_timeout
        self.settle_seconds = settle_seconds
        self.evaluations = []
        self.best = self._best_so_far()
        self.training_failed = None  # The training job's error, once it failed.
        self._seen = set()
        self._writer = None
        self._scratch = None

    # Discovery ---------------------------------------------------------------------------

    def _candidates(self):
        """Checkpoints not yet evaluated, as (key, path, marker or None), in training order.

        Only names, markers and sizes are read here; each file's bytes are read when
        it is evaluated (`_read`), so one checkpoint at a time is in memory.
        """
        try:
            names = tf.io.gfile.listdir(self.checkpoint_dir)
        except tf.errors.NotFoundError:
            return [], 0
        managed = checkpoint_files.managed_by_kfit_ps(self.checkpoint_dir)
        found = []
        now = time.time()
        for name in names:
            name = name.rstrip("/")
            if not name.endswith(_SUFFIXES) or name.startswith("."):
                continue
            path = checkpoint_files.join(self.checkpoint_dir, name)
            if self.export_best is not None and os.path.abspath(path) == os.path.abspath(
                    self.export_best):
                continue  # Our own export, not a training checkpoint.
            try:
                stat = tf.io.gfile.stat(path)
                marker = checkpoint_files.read_marker(path)
            except tf.errors.NotFoundError:
                continue
            except checkpoint_files.Unreadable:
                marker = None  # A marker being written: its file is not published yet.
            if marker is not None:
                key = (path, marker.get("sha256"))
                if key in self._seen or stat.length != marker.get("size"):
                    continue  # Evaluated, or rewritten since its marker: wait for a new one.
                step = marker["step"]
            elif managed or now - stat.mtime_nsec / 1e9 < self.settle_seconds:
                continue  # In flight (kfit_ps publishes with a marker), or still changing.
            else:
                key = (path, "file", stat.mtime_nsec, stat.length)
                if key in self._seen:
                    continue
                step = None
            found.append((stat.mtime_nsec, key, path, marker, step))
        # In training order: by step where a marker gives it (file times may tie), then time.
        found.sort(key=lambda item: (item[4] is None, item[4] or 0, item[0], item[2]))
        return [(key, path, marker) for _, key, path, marker, _ in found]

    @staticmethod
    def _read(path, marker):
        """The checkpoint's bytes: those its marker describes (None if it was rewritten)."""
        if marker is not None:
            return checkpoint_files.read_verified(path, marker)
        try:
            with tf.io.gfile.GFile(path, "rb") as f:
                return f.read()
        except tf.errors.NotFoundError:
            return None

    # One evaluation ----------------------------------------------------------------------

    def _load(self, path, data):
        """Loads the weights from `data` (the checked bytes of `path`), not from `path` again."""
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.model.trainable_variables)  # Loads its state quietly too.
        if self._scratch is None:
            self._scratch = tempfile.mkdtemp(prefix="kfit_ps-evaluator-")
        local = os.path.join(self._scratch, os.path.basename(path))
        with open(local, "wb") as f:
            f.write(data)
        try:
            self.model.load_weights(local)
        finally:
            os.remove(local)

    def _evaluate(self, path, data, step):
        self._load(path, data)
        if step is None:
            step = _h5_step(data) if path.endswith(".h5") else None
        if step is None:
            optimizer = getattr(self.model, "optimizer", None)
            step = int(optimizer.iterations.numpy()) if optimizer is not None else 0
        logs = self.model.evaluate(self.data, steps=self.steps, callbacks=self.callbacks,
                                   verbose=0, return_dict=True)
        logs = {k: float(np.asarray(v)) for k, v in logs.items() if np.ndim(v) == 0}
        evaluation = CheckpointEvaluation(path=path, step=int(step), logs=logs)
        self.evaluations.append(evaluation)
        logger.info("evaluated %s at training step %d: %s", os.path.basename(path), step,
                    ", ".join(f"{k}={v:.6g}" for k, v in logs.items()))
        self._summarise(evaluation)
        self._maybe_export(evaluation)
        return evaluation

    def _summarise(self, evaluation):
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(
                checkpoint_files.join(self.log_dir, "validation"))
        summaries.write_scalars(self._writer, "evaluation_{}_vs_iterations", evaluation.logs,
                                evaluation.step)

    def _best_so_far(self):
        """The monitored value of an export an earlier run of this evaluator published."""
        if self.export_best is None:
            return None
        marker, _ = checkpoint_files.published_marker(self.export_best)
        if (marker is None or marker.get("monitor") != self.monitor
                or marker.get("mode") != self.mode):
            return None
        logger.info("SidecarEvaluator: %s already holds the best model so far (%s=%.6g)",
                    self.export_best, self.monitor, marker["value"])
        return float(marker["value"])

    def _maybe_export(self, evaluation):
        if self.export_best is None or self.monitor not in evaluation.logs:
            return
        value = evaluation.logs[self.monitor]
        if self.best is None or (value < self.best if self.mode == "min" else value > self.best):
            self.best = value
            checkpoint_files.unpublish(self.export_best)
            self.model.save(self.export_best, overwrite=True)
            checkpoint_files.publish(self.export_best, evaluation.step, 0, monitor=self.monitor,
                                     mode=self.mode, value=value)  # Read back on a restart.
            logger.info("exported best model (%s=%.6g) to %s", self.monitor, value,
                        self.export_best)

    # The loop ----------------------------------------------------------------------------

    def _done(self):
        return self.max_evaluations is not None and len(
            self.evaluations) >= self.max_evaluations

    def start(self):
        """Evaluates checkpoints until a stop condition; returns every
        `CheckpointEvaluation` so far."""
        for _ in self.evaluate_as_they_come():
            pass
        return list(self.evaluations)

    def _idle_timeout(self):
        """Seconds without a new checkpoint after which to stop (None: wait for training)."""
        if self.idle_timeout is not None:
            return self.idle_timeout
        if checkpoint_files.managed_by_kfit_ps(self.checkpoint_dir):
            return None  # kfit_ps training writes a "done" file when it ends.
        return constants.evaluator_idle_timeout()

    def evaluate_as_they_come(self):
        """Like `start`, but yields each new `CheckpointEvaluation` as soon as it is done."""
        last_new = time.monotonic()
        announced = None
        try:
            while not self._done():
                finished = checkpoint_files.training_done(self.checkpoint_dir) is not None
                progressed = False
                failed = checkpoint_files.training_failed(self.checkpoint_dir)
                candidates = self._candidates()
                for key, path, marker in candidates:
                    data = self._read(path, marker)
                    if data is None:
                        continue  # Rewritten since it was listed: its new marker comes next.
                    step = None if marker is None else marker["step"]
                    try:
                        evaluation = self._evaluate(path, data, step)
                    except (OSError, ValueError) as e:
                        if step is not None:
                            raise  # A marked checkpoint is complete: a real error.
                        logger.warning("could not read %s yet (%s); will retry", path, e)
                        continue
                    self._seen.add(key)
                    progressed = True
                    yield evaluation
                    if self._done():
                        break
                if progressed:
                    last_new = time.monotonic()
                    continue
                if finished:
                    # kfit_ps training marks itself done after publishing its last
                    # checkpoint, so this scan saw them all; unpublished files never will be.
                    break
                if failed is not None:
                    self.training_failed = failed
                    logger.error("SidecarEvaluator: training in %s failed (%s); no new "
                                 "checkpoint will come. Stopping after %d evaluations.",
                                 self.checkpoint_dir, failed, len(self.evaluations))
                    break
                idle_timeout = self._idle_timeout()
                if idle_timeout is not None and self.idle_timeout is None and (
                        announced != idle_timeout):
                    announced = idle_timeout
                    logger.warning(
                        "SidecarEvaluator: %s is not written by kfit_ps.callbacks."
                        "ModelCheckpoint, so no 'training done' file will end the evaluation; "
                        "stopping after %.0f s without a new checkpoint (pass idle_timeout or "
                        "set %s to change this).", self.checkpoint_dir, idle_timeout,
                        constants.EVALUATOR_IDLE_TIMEOUT_ENV)
                if idle_timeout is not None and time.monotonic() - last_new > idle_timeout:
                    logger.warning("SidecarEvaluator: no new checkpoint in %s for %.0f s; "
                                   "stopping after %d evaluations.", self.checkpoint_dir,
                                   idle_timeout, len(self.evaluations))
                    break
                time.sleep(self.poll_interval)
        finally:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            if self._scratch is not None:
                shutil.rmtree(self._scratch, ignore_errors=True)
                self._scratch = None
