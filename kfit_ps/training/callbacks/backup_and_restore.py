"""`BackupAndRestore`: resume a parameter-server job where it stopped."""

import glob
import os
import shutil

from kfit_ps.training import checkpoint_files
from kfit_ps.training.callbacks.base import SyncCallback, sync_every_from

_STATE = "latest.json"


class BackupAndRestore(SyncCallback):
    """Backs up training state so that rerunning the script resumes it.

    Saves the weights, the optimizer state (slots and `iterations`) and the
    position (epoch and step within it) at every epoch end, or every
    `save_freq` global steps after a synchronisation (no step in flight). If the
    coordinator dies (even by SIGKILL), rerunning the same `fit` finds the
    last backup in `on_train_begin`, restores it on the ps tasks and continues
    from that position, so `optimizer.iterations` ends where an uninterrupted
    run ends. The input pipeline starts afresh on resume.

    Each backup is a new `.weights.h5` file; `latest.json`, which names it,
    is replaced atomically afterwards, so a crash mid-write leaves the
    previous backup in force. When `fit` completes, the directory is deleted
    (with `delete_checkpoint=True`), and a later `fit` starts normally.

    ```python
    backup = kfit_ps.callbacks.BackupAndRestore("/shared/backup", save_freq=100)
    model.fit(dc, epochs=10, steps_per_epoch=1000, callbacks=[backup])
    ```

    Args:
        backup_dir: directory for the backups (shared by reruns of the job).
        save_freq: `"epoch"` or a positive number of steps. Defaults to `"epoch"`.
        delete_checkpoint: delete `backup_dir` when `fit` completes. Defaults to True.
    """

    def __init__(self, backup_dir, save_freq="epoch", delete_checkpoint=True):
        super().__init__()
        if not backup_dir:
            raise ValueError("BackupAndRestore: `backup_dir` must be a directory path. "
                             f"Received: backup_dir={backup_dir!r}.")
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.sync_every = sync_every_from("BackupAndRestore", "save_freq", save_freq)
        self.delete_checkpoint = delete_checkpoint
        self._resume = None
        self._sequence = 0

    def on_train_begin(self, logs=None):
        self._resume = None
        state = checkpoint_files.read_json(os.path.join(self.backup_dir, _STATE))
        if state is None:
            return
        path = os.path.join(self.backup_dir, state["weights"])
        self.model.load_weights(path)
        restored = checkpoint_files.training_step(self.model)
        if self.model.optimizer is not None and restored != state["iterations"]:
            raise RuntimeError(
                f"BackupAndRestore restored {path} but the optimizer's iterations is "
                f"{restored}, not the {state['iterations']} recorded with it: the optimizer "
                "state was not restored. Compile the model with the same optimizer as the "
                "run that wrote the backup.")
        self._sequence = state["sequence"]
        self._resume = (state["epoch"], state["step"])

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
        if self.delete_checkpoint:
            shutil.rmtree(self.backup_dir, ignore_errors=True)

    def _backup(self, epoch, step):
        os.makedirs(self.backup_dir, exist_ok=True)
        self._sequence += 1
        name = f"backup-{self._sequence:08d}.weights.h5"
        self.model.save_weights(os.path.join(self.backup_dir, name), overwrite=True)
        checkpoint_files.write_json_atomically(
            os.path.join(self.backup_dir, _STATE),
            {"weights": name, "epoch": epoch, "step": step, "sequence": self._sequence,
             "iterations": checkpoint_files.training_step(self.model)})
        for old in glob.glob(os.path.join(self.backup_dir, "backup-*.weights.h5")):
            if os.path.basename(old) != name:
                os.remove(old)
