"""`BackupAndRestore`: resume a parameter-server job where it stopped."""

import logging
import re

import keras
import tensorflow as tf

from kfit_ps import constants, validation
from kfit_ps.training import checkpoint_files
from kfit_ps.training.callbacks.base import SyncCallback, sync_every_from

log = logging.getLogger("kfit_ps.callbacks")

_NAME = re.compile(r"^backup-(\d{8})\.weights\.h5$")


def _backup_name(sequence):
    return f"backup-{sequence:08d}.weights.h5"


class BackupAndRestore(SyncCallback):
    """Backs up training state so that rerunning the script resumes it.

    Saves the weights, the optimizer state (slots and `iterations`) and the
    position (epoch and step within it) at every epoch end, or every
    `save_freq` global steps after a synchronisation (no step in flight). If the
    coordinator dies (even by SIGKILL), rerunning the same `fit` finds the
    last complete backup in `on_train_begin`, restores it on the ps tasks and
    continues from that position, so `optimizer.iterations` ends where an
    uninterrupted run ends. The input pipeline starts afresh on resume.

    Each backup is a new `backup-<n>.weights.h5` file, published by a marker
    written after it (`checkpoint_files`: "data, then marker", no rename, so
    `gs://` and other object stores work). A backup whose marker is missing,
    unreadable or does not match the file's bytes is not used: resuming falls
    back to the newest complete backup, with a warning. Older backups are
    deleted only once a newer one is complete. When `fit` completes, the
    directory is deleted (with `delete_checkpoint=True`), and a later `fit`
    starts normally.

    ```python
    backup = kfit_ps.callbacks.BackupAndRestore("/shared/backup", save_freq=100)
    model.fit(dc, epochs=10, steps_per_epoch=1000, callbacks=[backup])
    ```

    Args:
        backup_dir: directory for the backups (shared by reruns of the job); a
            local path or any `tf.io.gfile` URL (`gs://...`).
        save_freq: `"epoch"` or a positive number of steps. Defaults to `"epoch"`.
        delete_checkpoint: delete `backup_dir` when `fit` completes. Defaults to True.
    """

    def __init__(self, backup_dir, save_freq="epoch", delete_checkpoint=True):
        super().__init__()
        if not backup_dir:
            raise ValueError("BackupAndRestore: `backup_dir` must be a directory path. "
                             f"Received: backup_dir={backup_dir!r}.")
        self.backup_dir = validation.path(backup_dir)
        self.save_freq = save_freq
        self.sync_every = sync_every_from("BackupAndRestore", "save_freq", save_freq)
        self.delete_checkpoint = delete_checkpoint
        self._resume = None
        self._sequence = 0

    # Finding backups -----------------------------------------------------------------------

    def _sequences(self):
        """Sequence numbers of the backup files present, newest first."""
        if not tf.io.gfile.isdir(self.backup_dir):
            return []
        found = (_NAME.match(name) for name in tf.io.gfile.listdir(self.backup_dir))
        return sorted((int(m.group(1)) for m in found if m), reverse=True)

    def _path(self, sequence):
        return checkpoint_files.join(self.backup_dir, _backup_name(sequence))

    def _newest_complete(self, sequences):
        """(sequence, marker) of the newest backup whose marker describes its file."""
        skipped = []
        for sequence in sequences:
            path = self._path(sequence)
            try:
                marker = checkpoint_files.read_marker(path)
            except checkpoint_files.Unreadable as e:
                skipped.append(f"{path}: {e}")
                continue
            if marker is None:
                skipped.append(f"{path}: no marker (its write did not finish)")
                continue
            if checkpoint_files.fingerprint(path) != (marker.get("size"), marker.get("sha256")):
                skipped.append(f"{path}: the file does not match its marker")
                continue
            if skipped:
                log.warning("BackupAndRestore: resuming from %s, the newest complete backup; "
                            "skipped newer ones: %s", path, "; ".join(skipped))
            return sequence, marker
        if skipped:
            raise RuntimeError(
                f"BackupAndRestore found backups in {self.backup_dir!r} but none is complete: "
                f"{'; '.join(skipped)}. Nothing was deleted. Move the directory away (or delete "
                "it) to start training from scratch.")
        return None, None

    # Callback hooks ------------------------------------------------------------------------

    def on_train_begin(self, logs=None):
        self._resume = None
        sequences = self._sequences()
        self._sequence = sequences[0] if sequences else 0  # New backups never reuse a name.
        sequence, marker = self._newest_complete(sequences)
        if sequence is None:
            return
        path = self._path(sequence)
        self.model.load_weights(path)
        restored = checkpoint_files.training_step(self.model)
        if self.model.optimizer is not None and restored != marker["step"]:
            raise RuntimeError(
                f"BackupAndRestore restored {path} but the optimizer's iterations is "
                f"{restored}, not the {marker['step']} recorded with it: the optimizer "
                "state was not restored. Compile the model with the same optimizer as the "
                "run that wrote the backup.")
        self._resume = (marker["epoch"], marker["batch"])

    def resume_position(self):
        return self._resume

    def on_train_sync(self, epoch, step, logs):
        if step >= self.params["steps"]:
            epoch, step = epoch + 1, 0
        self._backup(epoch, step)

    def on_epoch_end(self, epoch, logs=None):
        if self.sync_every is None:
            self._backup(epoch + 1, 0)

    def on_train_end(self, logs=None):
        self._resume = None
        if self.delete_checkpoint and tf.io.gfile.exists(self.backup_dir):
            tf.io.gfile.rmtree(self.backup_dir)

    def _backup(self, epoch, step):
        tf.io.gfile.makedirs(self.backup_dir)
        self._sequence += 1
        path = self._path(self._sequence)
        self.model.save_weights(path, overwrite=True)
        checkpoint_files.publish(path, checkpoint_files.training_step(self.model), epoch, step)
        for older in self._sequences():  # Only now that a newer backup is complete.
            if older < self._sequence:
                checkpoint_files.remove(self._path(older) + checkpoint_files.MARKER_SUFFIX)
                checkpoint_files.remove(self._path(older))


def with_launcher_backup(callbacks):
    """`callbacks`, plus a `BackupAndRestore` when `kfit-ps run --backup-dir` asked for one.

    A script that has its own backup callback (kfit_ps's or Keras') keeps it, alone.
    """
    callbacks = list(callbacks or [])
    requested = constants.launcher_backup()
    if requested is None or any(isinstance(cb, (BackupAndRestore,
                                                keras.callbacks.BackupAndRestore))
                                for cb in callbacks):
        return callbacks
    backup_dir, save_freq = requested
    return callbacks + [BackupAndRestore(backup_dir, save_freq=save_freq)]
