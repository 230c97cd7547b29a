"""`ModelCheckpoint` for parameter-server training: consistent snapshots every epoch or N steps."""

import numpy as np
import tensorflow as tf

from kfit_ps import _tf_compat, validation
from kfit_ps.training.callbacks import checkpoint_files
from kfit_ps.training.callbacks.base import SyncCallback, sync_every_from
from kfit_ps.training.monitor import job_monitor


class ModelCheckpoint(SyncCallback):
    """Saves the model or its weights at epoch ends or every `save_freq` steps.

    Same arguments and file conventions as `keras.callbacks.ModelCheckpoint`
    (`.keras` for the whole model, `.weights.h5` with `save_weights_only`,
    `{epoch}`, `{batch}` and metric names in `filepath`). Under parameter-server
    training each save is a consistent snapshot: an integer `save_freq` makes
    `fit` synchronise at every multiple of `save_freq` global steps, so no step
    is in flight while the weights are read, and `{batch}`/metrics refer to
    exactly the steps applied. Each saved file is published by a marker
    (`<file>.kfit_ps.json`, with the training step and the file's digest)
    written once it is complete; a file about to be overwritten loses its
    marker first (`checkpoint_files`). In one-pass epochs (`kfit_ps.ledger`)
    the marker also records the data's shape (batches, examples, batch
    size), so its epoch and batch name the examples trained. The directory gets
    `kfit_ps_training.json` when `fit` starts and
    `kfit_ps_training_done.json` when it ends; the side-car evaluator reads
    them all. Paths may be any `tf.io.gfile` URL (`gs://...`).

    ```python
    ckpt = kfit_ps.callbacks.ModelCheckpoint("ckpt/{epoch:02d}-{batch:04d}.weights.h5",
                                             save_weights_only=True, save_freq=100)
    model.fit(dc, epochs=3, steps_per_epoch=500, callbacks=[ckpt])
    ```

    Args:
        filepath: where to save; may contain `{epoch}`, `{batch}` (1-based
            steps into the epoch) and metric names from the logs.
        monitor: metric for `save_best_only`. Defaults to `"val_loss"`.
        verbose: 1 prints a line per save. Defaults to 0.
        save_best_only: save only when `monitor` improves. Defaults to False.
        save_weights_only: `model.save_weights` (path ends in `.weights.h5`)
            instead of `model.save` (path ends in `.keras`). Defaults to False.
        mode: `"min"`, `"max"` or `"auto"` (Keras' rule: the direction of
            the compiled metric named by `monitor`; min for losses).
        save_freq: `"epoch"` or a positive number of steps. Defaults to `"epoch"`.
        initial_value_threshold: best value to beat at first. Defaults to None.
    """

    def __init__(self, filepath, monitor="val_loss", verbose=0, save_best_only=False,
                 save_weights_only=False, mode="auto", save_freq="epoch",
                 initial_value_threshold=None):
        super().__init__()
        self.filepath = validation.path(filepath)
        suffixes = (".weights.h5",) if save_weights_only else (".keras",)
        if not self.filepath.endswith(suffixes):
            raise ValueError(
                f"ModelCheckpoint: with save_weights_only={save_weights_only}, `filepath` must "
                f"end in {suffixes[0]!r}. Received: filepath={self.filepath!r}.")
        if mode not in ("auto", "min", "max"):
            raise ValueError(f"ModelCheckpoint: `mode` must be 'auto', 'min' or 'max'. "
                             f"Received: mode={mode!r}.")
        self.monitor, self.verbose = monitor, verbose
        self.save_best_only, self.save_weights_only = save_best_only, save_weights_only
        self.save_freq = save_freq
        self.sync_every = sync_every_from("ModelCheckpoint", "save_freq", save_freq)
        self.mode = mode
        self.best = initial_value_threshold
        self.last_saved = None
        self._better = None

    @property
    def directory(self):
        return checkpoint_files.dirname(self.filepath)

    def on_train_begin(self, logs=None):
        if self.save_best_only:
            self._better = _tf_compat.improvement_test(self.model, self.monitor, self.mode)
        checkpoint_files.mark_training_started(self.directory)

    def on_train_sync(self, epoch, step, logs):
        self._save(epoch, step, logs)

    def on_epoch_end(self, epoch, logs=None):
        if self.sync_every is None:
            self._save(epoch, None, logs or {})

    def on_train_failed(self, error):
        checkpoint_files.mark_training_failed(self.directory, error)

    def on_train_end(self, logs=None):
        checkpoint_files.mark_training_done(self.directory,
                                            checkpoint_files.training_step(self.model))

    def _improved(self, logs):
        current = logs.get(self.monitor)
        if current is None or np.ndim(current) != 0:
            return True  # As Keras: without a scalar to compare, save.
        if self.best is None or self._better(float(current), self.best):
            self.best = float(current)
            return True
        return False

    def _save(self, epoch, step, logs):
        fields = dict(logs)
        fields.setdefault("batch", step)
        try:
            path = self.filepath.format(epoch=epoch + 1, **fields)
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"ModelCheckpoint could not format filepath={self.filepath!r} with epoch, "
                f"batch and the logged metrics {sorted(logs)}: {e!r}. Use only those names, "
                "and {batch} only with an integer save_freq.") from None
        if self.save_best_only and not self._improved(logs):
            return
        tf.io.gfile.makedirs(checkpoint_files.dirname(path))
        checkpoint_files.unpublish(path)  # A reader must not match the old marker to new bytes.
        with job_monitor().timed("checkpoint", f"checkpoint written to {path}", path=path):
            if self.save_weights_only:
                self.model.save_weights(path, overwrite=True)
            else:
                self.model.save(path, overwrite=True)
            checkpoint_files.publish(path, checkpoint_files.training_step(self.model), epoch,
                                     step, ledger=self.ledger_state)
        self.last_saved = path
        if self.verbose:
            _tf_compat.print_msg(f"\nEpoch {epoch + 1}: saved {path}")
