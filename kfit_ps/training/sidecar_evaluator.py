"""`SidecarEvaluator`: evaluates each checkpoint a training job writes, once, in its own process.

The evaluator is not part of the training cluster: it needs no server and
never slows workers down. It watches a directory, loads each new complete
checkpoint into its own (ordinary Keras) model and evaluates it on its own
data. `kfit-ps evaluator` runs one from the command line (task type
`evaluator` in `TF_CONFIG`).

A checkpoint is a `.weights.h5` or `.keras` file in `checkpoint_dir`. Files
written by `kfit_ps.callbacks.ModelCheckpoint` carry a marker written after
the file is complete, with the training step: those are evaluated as soon
as the marker appears. Other files (stock Keras callbacks) are evaluated once
they have not changed for `settle_seconds`; if loading still fails (a
partly written file), they are retried on later polls.
"""

import dataclasses
import logging
import os
import time

import h5py
import numpy as np
import tensorflow as tf

from kfit_ps.training import checkpoint_files, summaries

logger = logging.getLogger("kfit_ps.evaluator")

_SUFFIXES = (".weights.h5", ".keras")


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """One evaluated checkpoint: its file, training step and metrics."""

    path: str
    step: int
    logs: dict


def _h5_step(path):
    """`iterations` saved in a Keras weights file (None if it has no optimizer)."""
    try:
        with h5py.File(path, "r") as f:
            if "optimizer/vars/0" in f:
                return int(np.asarray(f["optimizer/vars/0"]))
    except (OSError, KeyError, ValueError, TypeError):
        return None
    return None


class SidecarEvaluator:
    """Evaluates every new checkpoint in `checkpoint_dir` exactly once.

    ```python
    model = build_model()                      # same architecture as in training
    model.compile(loss="mse", metrics=["mae"])
    kfit_ps.SidecarEvaluator(model, val_dataset, "ckpt", max_evaluations=10).start()
    ```

    Args:
        model: a compiled Keras model with the trained model's architecture.
        data: what `model.evaluate` accepts (a finite dataset, or with `steps`).
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
            Defaults to None (wait for training to finish).
        settle_seconds: how long a file without a kfit_ps marker must stay
            unchanged before it is read. Defaults to 2.
    """

    def __init__(self, model, data, checkpoint_dir, steps=None, max_evaluations=None,
                 callbacks=None, log_dir=None, export_best=None, monitor="loss", mode="min",
                 poll_interval=1.0, idle_timeout=None, settle_seconds=2.0):
        if not getattr(model, "compiled", False):
            raise ValueError("SidecarEvaluator: `model` must be compiled with the loss and "
                             "metrics to report. Call model.compile(loss=..., metrics=[...]).")
        if max_evaluations is not None and (not isinstance(max_evaluations, int)
                                            or max_evaluations < 1):
            raise ValueError("SidecarEvaluator: `max_evaluations` must be None or an integer "
                             f">= 1. Received: max_evaluations={max_evaluations!r}.")
        if mode not in ("min", "max"):
            raise ValueError(f"SidecarEvaluator: `mode` must be 'min' or 'max'. "
                             f"Received: mode={mode!r}.")
        if export_best is not None and not os.fspath(export_best).endswith(".keras"):
            raise ValueError("SidecarEvaluator: `export_best` must be a path ending in "
                             f"'.keras'. Received: export_best={export_best!r}.")
        self.model, self.data, self.steps = model, data, steps
        self.checkpoint_dir = os.fspath(checkpoint_dir)
        self.max_evaluations = max_evaluations
        self.callbacks = callbacks
        self.log_dir = os.fspath(log_dir) if log_dir is not None else self.checkpoint_dir
        self.export_best, self.monitor, self.mode = export_best, monitor, mode
        self.poll_interval, self.idle_timeout = poll_interval, idle_timeout
        self.settle_seconds = settle_seconds
        self.evaluations = []
        self.best = None
        self._seen = set()
        self._writer = None

    # Discovery ---------------------------------------------------------------------------

    def _candidates(self):
        """(complete, not yet evaluated checkpoints as (key, path, step or None), oldest
        first; how many files may still be being written)."""
        try:
            names = os.listdir(self.checkpoint_dir)
        except FileNotFoundError:
            return [], 0
        found, unsettled = [], 0
        now = time.time()
        for name in names:
            if not name.endswith(_SUFFIXES) or name.startswith("."):
                continue
            path = os.path.join(self.checkpoint_dir, name)
            if self.export_best is not None and os.path.abspath(path) == os.path.abspath(
                    self.export_best):
                continue  # Our own export, not a training checkpoint.
            try:
                stat = os.stat(path)
            except FileNotFoundError:
                continue
            marker = checkpoint_files.read_marker(path)
            if marker is not None:
                key = (path, "step", marker["step"], stat.st_mtime_ns)
                step = marker["step"]
            elif now - stat.st_mtime >= self.settle_seconds:
                key = (path, "file", stat.st_mtime_ns, stat.st_size)
                step = None
            else:
                unsettled += 1  # Possibly still being written.
                continue
            if key not in self._seen:
                found.append((stat.st_mtime_ns, key, path, step))
        return [(key, path, step) for _, key, path, step in sorted(found)], unsettled

    # One evaluation ----------------------------------------------------------------------

    def _load(self, path):
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.model.trainable_variables)  # Loads its state quietly too.
        self.model.load_weights(path)

    def _evaluate(self, path, step):
        self._load(path)
        if step is None:
            step = _h5_step(path) if path.endswith(".h5") else None
        if step is None:
            optimizer = getattr(self.model, "optimizer", None)
            step = int(optimizer.iterations.numpy()) if optimizer is not None else 0
        logs = self.model.evaluate(self.data, steps=self.steps, callbacks=self.callbacks,
                                   verbose=0, return_dict=True)
        logs = {k: float(np.asarray(v)) for k, v in logs.items() if np.ndim(v) == 0}
        evaluation = Evaluation(path=path, step=int(step), logs=logs)
        self.evaluations.append(evaluation)
        logger.info("evaluated %s at training step %d: %s", os.path.basename(path), step,
                    ", ".join(f"{k}={v:.6g}" for k, v in logs.items()))
        self._summarise(evaluation)
        self._maybe_export(evaluation)
        return evaluation

    def _summarise(self, evaluation):
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(
                os.path.join(self.log_dir, "validation"))
        summaries.write_scalars(self._writer, "evaluation_{}_vs_iterations", evaluation.logs,
                                evaluation.step)

    def _maybe_export(self, evaluation):
        if self.export_best is None or self.monitor not in evaluation.logs:
            return
        value = evaluation.logs[self.monitor]
        if self.best is None or (value < self.best if self.mode == "min" else value > self.best):
            self.best = value
            self.model.save(self.export_best, overwrite=True)
            logger.info("exported best model (%s=%.6g) to %s", self.monitor, value,
                        self.export_best)

    # The loop ----------------------------------------------------------------------------

    def _done(self):
        return self.max_evaluations is not None and len(
            self.evaluations) >= self.max_evaluations

    def start(self):
        """Evaluates checkpoints until a stop condition; returns all `Evaluation`s so far."""
        for _ in self.evaluate_as_they_come():
            pass
        return list(self.evaluations)

    def evaluate_as_they_come(self):
        """Like `start`, but yields each new `Evaluation` as soon as it is done."""
        last_new = time.monotonic()
        try:
            while not self._done():
                finished = checkpoint_files.training_done(self.checkpoint_dir) is not None
                progressed = False
                candidates, unsettled = self._candidates()
                for key, path, step in candidates:
                    try:
                        evaluation = self._evaluate(path, step)
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
                if finished and not unsettled:
                    break  # Training ended before this scan: nothing more will come.
                if self.idle_timeout is not None and (
                        time.monotonic() - last_new > self.idle_timeout):
                    logger.info("no new checkpoint for %.0f s; stopping", self.idle_timeout)
                    break
                time.sleep(self.poll_interval)
        finally:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
