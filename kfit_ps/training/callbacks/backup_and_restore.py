"""`BackupAndRestore`: resume a parameter-server job where it stopped."""

import itertools
import logging
import re

import keras
import numpy as np
import tensorflow as tf

from kfit_ps import _tf_compat, constants, validation
from kfit_ps.training.callbacks import checkpoint_files
from kfit_ps.training.callbacks.base import SyncCallback, sync_every_from
from kfit_ps.training.monitor import job_monitor

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
    uninterrupted run ends. A stream's input pipeline starts afresh on
    resume; a one-pass epoch (`kfit_ps.ledger`) resumes at its first
    untrained split, and a backup of one-pass epochs records the data's shape
    (batches, examples, batch size): resuming on other data is refused.

    Each backup is a new `backup-<n>.weights.h5` file, published by a marker
    written after it (`checkpoint_files`: "data, then marker", no rename, so
    `gs://` and other object stores work). A backup whose marker is missing,
    unreadable or does not match the file's bytes is not used: resuming falls
    back to the newest complete backup, with a warning. Older backups are
    deleted only once a newer one is complete. A directory whose backups are
    all incomplete (the job was killed while writing its first one) is not an
    error: training starts over, with a warning, and the files go once a new
    backup is complete. When `fit` completes, the directory is deleted (with
    `delete_checkpoint=True`), and a later `fit` starts normally. When the
    chief is asked to stop (SIGTERM under `kfit-ps run`), a last backup is
    written after the steps in flight (`on_train_preempt`): none is lost.

    **Scripts with several `fit`s** (`fit_id`): each `fit` of the script gets
    its own id (`kfit-ps run --backup-dir` numbers them 1, 2, 3, ... in the
    order the script calls them). A `fit` that completes leaves a *final*
    backup, `fit-<id>.weights.h5` (its weights, optimizer state and History),
    and the directory is kept. A rerun of the script then skips each `fit`
    whose final backup exists (it restores that state and returns its
    History), resumes the interrupted one at its step, and trains the rest:
    a crash in the second of three `fit`s never retrains the first, nor
    restores the second's progress into the first. Whoever runs the script
    deletes the directory when it exits with status 0 (`kfit-ps run` does).
    Each completed `fit` keeps one copy of the model's state there until then.

    ```python
    backup = kfit_ps.callbacks.BackupAndRestore("/shared/backup", save_freq=100)
    model.fit(dc, epochs=10, steps_per_epoch=1000, callbacks=[backup])
    ```

    Args:
        backup_dir: directory for the backups (shared by reruns of the job); a
            local path or any `tf.io.gfile` URL (`gs://...`).
        save_freq: `"epoch"` or a positive number of steps. Defaults to `"epoch"`.
        delete_checkpoint: delete `backup_dir` when `fit` completes. Defaults to
            True without `fit_id`; with one, the directory outlives the `fit`.
        fit_id: which `fit` of the script this is: a positive int or a name of
            letters, digits, '-' and '_'. Defaults to None (the backups belong
            to one `fit`, as in Keras).
    """

    def __init__(self, backup_dir, save_freq="epoch", delete_checkpoint=None, fit_id=None):
        super().__init__()
        if not backup_dir:
            raise ValueError("BackupAndRestore: `backup_dir` must be a directory path. "
                             f"Received: backup_dir={backup_dir!r}.")
        self.backup_dir = validation.path(backup_dir)
        self.save_freq = save_freq
        self.sync_every = sync_every_from("BackupAndRestore", "save_freq", save_freq)
        self.fit_id = _check_fit_id(fit_id)
        if delete_checkpoint and self.fit_id is not None:
            raise ValueError(
                "BackupAndRestore: `delete_checkpoint=True` would delete the final backups that "
                f"let a rerun skip completed fits (`fit_id={fit_id!r}`). Received: "
                "delete_checkpoint=True. Drop it (the directory is deleted by whoever runs the "
                "script, once it succeeds), or drop `fit_id`.")
        self.delete_checkpoint = self.fit_id is None if delete_checkpoint is None else bool(
            delete_checkpoint)
        self._resume = None
        self._skipped = None  # The final marker of a fit that a rerun skips.
        self._sequence = 0
        self._history = {"epoch": [], "history": {}}

    # Finding backups -----------------------------------------------------------------------

    def _sequences(self):
        """Sequence numbers of the backup files present, newest first."""
        if not tf.io.gfile.isdir(self.backup_dir):
            return []
        found = (_NAME.match(name) for name in tf.io.gfile.listdir(self.backup_dir))
        return sorted((int(m.group(1)) for m in found if m), reverse=True)

    def _path(self, sequence):
        return checkpoint_files.join(self.backup_dir, _backup_name(sequence))

    def _final_path(self):
        return checkpoint_files.join(self.backup_dir, f"fit-{self.fit_id}.weights.h5")

    def _newest_complete(self, sequences):
        """(sequence, marker) of this fit's newest backup whose marker describes its file.

        Backups of other `fit`s of the script are passed over. With none
        complete, training starts over (with a warning naming what was skipped).
        """
        skipped = []
        for sequence in sequences:
            path = self._path(sequence)
            marker, why_not = checkpoint_files.published_marker(path)
            if marker is None:
                skipped.append(why_not)
                continue
            if marker.get("fit") != self.fit_id:
                continue
            if skipped:
                log.warning("BackupAndRestore: resuming from %s, the newest complete backup; "
                            "skipped newer ones: %s", path, "; ".join(skipped))
            return sequence, marker
        if skipped:
            log.warning(
                "BackupAndRestore: no complete backup in %r (%s): training starts from the "
                "beginning. The incomplete files are removed once a new backup is complete.",
                self.backup_dir, "; ".join(skipped))
        return None, None

    def newest_backup(self):
        """`(path, marker)` of this fit's newest complete backup, or `(None, None)`."""
        sequence, marker = self._newest_complete(self._sequences())
        return (None, None) if sequence is None else (self._path(sequence), marker)

    def _restore(self, path, marker):
        saved = marker.get("ledger")
        if not _same_data(saved, self.ledger_state):
            raise ValueError(
                f"BackupAndRestore: the backup {path} was written while training on other "
                f"data: {_data_kind(saved)}; this fit trains {_data_kind(self.ledger_state)}. "
                f"{_changed_file(saved, self.ledger_state)}"
                "Resuming at its position would train other examples than the ones it "
                "skips. Train on the same data (and the same `steps_per_epoch`), or remove "
                f"{self.backup_dir!r} to start over.")
        self.model.load_weights(path)
        restored = checkpoint_files.training_step(self.model)
        if self.model.optimizer is not None and restored != marker["step"]:
            raise RuntimeError(
                f"BackupAndRestore restored {path} but the optimizer's iterations is "
                f"{restored}, not the {marker['step']} recorded with it: the optimizer "
                "state was not restored. Compile the model with the same optimizer as the "
                "run that wrote the backup.")
        self._history = marker.get("history") or {"epoch": [], "history": {}}

    # Callback hooks ------------------------------------------------------------------------

    def on_train_begin(self, logs=None):
        self._resume, self._skipped, self._written = None, None, None
        self._history = {"epoch": [], "history": {}}
        if self.fit_id is not None:
            final, _ = checkpoint_files.published_marker(self._final_path())
            if final is not None:  # This fit completed in an earlier run of the script.
                self._restore(self._final_path(), final)
                self._skipped = final
                self._resume = (self.params["epochs"], 0)
                log.warning("BackupAndRestore: fit %s completed in an earlier run of the "
                            "script (step %d): restored its final state; not training it again",
                            self.fit_id, final["step"])
                return
        sequences = self._sequences()
        self._sequence = sequences[0] if sequences else 0  # New backups never reuse a name.
        sequence, marker = self._newest_complete(sequences)
        if sequence is None:
            return
        self._restore(self._path(sequence), marker)
        self._resume = (marker["epoch"], marker["batch"])
        # A resume at an epoch's end: that backup's marker moves on once the end work is done.
        self._written = (marker["epoch"], marker["batch"], self._path(sequence))
        self._resume_logs = marker.get("epoch_logs")

    def resume_position(self):
        return self._resume

    def resume_logs(self):
        return getattr(self, "_resume_logs", None) if self._resume is not None else None

    def on_train_sync(self, epoch, step, logs):
        self._backup_after(epoch, step, logs)

    def on_train_preempt(self, epoch, step, logs):
        return self._backup_after(epoch, step, logs)

    def _backup_after(self, epoch, step, logs):
        """A backup after `step` steps of `epoch`. After its last step, the epoch's end work
        (validation, epoch-end callbacks) is still to do: the backup resumes there, with
        the epoch's training logs, so a chief lost during that work runs it on resume (it
        resumed at the next epoch: the lost epoch had no validation, History entry or CSV
        row). `on_epoch_end` then moves that backup to the next epoch's start (its marker:
        the weights are the same; what epoch-end callbacks change in the model, such as a
        learning rate, is saved by the next backup)."""
        if step >= self.params["steps"]:
            return self._backup(epoch, step, epoch_logs={
                k: _jsonable(v) for k, v in (logs or {}).items()})
        return self._backup(epoch, step)

    def on_epoch_end(self, epoch, logs=None):
        if self._history["epoch"][-1:] != [epoch]:  # Once, also when a failed backup is retried.
            self._history["epoch"].append(epoch)
            for key, value in (logs or {}).items():
                self._history["history"].setdefault(key, []).append(_jsonable(value))
        if self.sync_every is None:
            self._backup(epoch + 1, 0)
        elif self._written is not None and self._written[:2] == (epoch, self.params["steps"]):
            # The backup of the epoch's last step now resumes at the next epoch: its end work
            # is done, not to be run again. No step ran since: the same weights, a new marker.
            path = self._written[2]
            try:
                marker = checkpoint_files.read_marker(path)
            except checkpoint_files.Unreadable:
                marker = None
            if marker is None:  # Damaged or gone since it was written: a new backup instead.
                self._backup(epoch + 1, 0)
            else:
                checkpoint_files.republish(path, marker, epoch=epoch + 1, batch=0,
                                           history=self._history, epoch_logs=None)
                self._written = (epoch + 1, 0, path)

    def on_train_end(self, logs=None):
        resumed, self._resume = self._resume, None
        if resumed is not None and self._skipped is None and isinstance(
                getattr(self.model, "history", None), keras.callbacks.History):
            # The History `fit` returns holds the epochs of the runs before the resume too,
            # each once (Keras' holds this run's only).
            self.model.history.epoch = list(self._history["epoch"])
            self.model.history.history = {
                key: list(values) for key, values in self._history["history"].items()}
        if self._skipped is not None:
            self.model.history = _history_object(self.model, self._history)
        elif self.fit_id is not None:
            self._publish_final()
        elif self.delete_checkpoint and tf.io.gfile.exists(self.backup_dir):
            tf.io.gfile.rmtree(self.backup_dir)

    def _publish_final(self):
        """Writes this fit's final state, then drops its progress backups."""
        tf.io.gfile.makedirs(self.backup_dir)
        path = self._final_path()
        checkpoint_files.unpublish(path)
        self.model.save_weights(path, overwrite=True)
        checkpoint_files.publish(path, checkpoint_files.training_step(self.model),
                                 self.params["epochs"], 0, fit=self.fit_id, done=True,
                                 history=self._history, ledger=self.ledger_state)
        self._remove_backups_before(self._sequence + 1)

    def _backup(self, epoch, step, **extra):
        tf.io.gfile.makedirs(self.backup_dir)
        self._sequence += 1
        path = self._path(self._sequence)
        self._written = (epoch, step, path)
        iteration = checkpoint_files.training_step(self.model)
        with job_monitor().timed("backup", f"backup of step {iteration} written to {path}",
                                 step=iteration, epoch=epoch, batch=step):
            self.model.save_weights(path, overwrite=True)
            checkpoint_files.publish(path, iteration, epoch, step, fit=self.fit_id,
                                     history=self._history, ledger=self.ledger_state, **extra)
        self._remove_backups_before(self._sequence)  # Only now that a newer one is complete.
        return path

    def _remove_backups_before(self, sequence):
        for older in self._sequences():
            if older < sequence:
                checkpoint_files.remove(self._path(older) + checkpoint_files.MARKER_SUFFIX)
                checkpoint_files.remove(self._path(older))


_FIT_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _check_fit_id(fit_id):
    if fit_id is None:
        return None
    if isinstance(fit_id, int) and not isinstance(fit_id, bool) and fit_id >= 1:
        return str(fit_id)
    if isinstance(fit_id, str) and _FIT_ID.match(fit_id):
        return fit_id
    raise ValueError(
        "BackupAndRestore: `fit_id` must be a positive int or a name of at most 64 letters, "
        f"digits, '-' and '_'. Received: fit_id={fit_id!r}. Example: fit_id='pretrain'.")


def _same_data(saved, now):
    """Whether a backup's data (`saved`, `Ledger.state()`) is this fit's: every entry the
    backup recorded agrees (older backups recorded fewer; files recorded without `shuffle`
    were read in their order, without `split_shuffle` unshuffled within splits)."""
    if saved is None or now is None:
        return saved == now
    if saved.get("kind") == "files":
        saved = {"shuffle": False, "split_shuffle": None, **saved}
    return all(now.get(key) == value for key, value in saved.items())


def _changed_file(saved, now):
    """For one-pass epochs over files: the first file that differs, as a sentence, or ""."""
    if not (saved and now and "file_list" in saved and "file_list" in now):
        return ""
    for before, after in zip(saved["file_list"], now["file_list"]):
        if list(before) != list(after):
            return (f"The first file that differs: {before[0]} (size {before[1]}, modified "
                    f"{before[2]} ns) in the backup, {after[0]} (size {after[1]}, modified "
                    f"{after[2]} ns) now. ")
    if len(saved["file_list"]) != len(now["file_list"]):
        return (f"The backup's data is {len(saved['file_list'])} files, this fit's "
                f"{len(now['file_list'])}. ")
    return ""


def _data_kind(ledger_state):
    if ledger_state is None:
        return "a stream (`steps_per_epoch` batches per epoch)"
    text = "one-pass epochs of {batches} batches ({examples} examples of {kind}, batch size " \
        "{batch_size}".format(**ledger_state)
    if "shuffle" in ledger_state:
        text += (f", shuffled with seed {ledger_state['seed']}" if ledger_state["shuffle"]
                 else ", not shuffled")
    shuffle = ledger_state.get("split_shuffle")
    if shuffle:
        text += (f", records shuffled within splits (buffer {shuffle['buffer_size']}, seed "
                 f"{shuffle['seed']})")
    if "files" in ledger_state:
        text += f", {ledger_state['files']}"
    if "fingerprint" in ledger_state:
        text += f", content fingerprint {ledger_state['fingerprint']}"
    return text + ")"


def _jsonable(value):
    """A log value as JSON: a float, an int, or nested lists for non-scalar metrics."""
    array = np.asarray(value)
    if array.ndim:
        return array.tolist()
    return int(array) if np.issubdtype(array.dtype, np.integer) else float(array)


def _history_object(model, saved):
    """A Keras `History` holding a skipped fit's epochs and logs, as its first run returned."""
    history = keras.callbacks.History()
    history.set_model(model)
    history.epoch = list(saved.get("epoch", []))
    history.history = {key: list(values) for key, values in saved.get("history", {}).items()}
    return history


_launched_fits = itertools.count(1)


def with_launcher_backup(callbacks):
    """`callbacks`, with the `BackupAndRestore` that `kfit-ps run --backup-dir` asked for.

    The launcher's backups belong to the script: each `fit` call gets the next
    `fit_id` (1, 2, 3, ... in call order), so a rerun skips the `fit`s that
    completed and resumes the interrupted one. A job has one backup, in the
    launcher's directory: a backup callback the script brings (Keras' or
    kfit_ps') is replaced by it, and the chief says so, once per callback. (Kept,
    Keras' would have displaced the launcher's: no backup in `--backup-dir`, and
    no in-place ps recovery, which restores from kfit_ps' backup.)
    """
    callbacks = list(callbacks or [])
    requested = constants.launcher_backup()
    if requested is None:
        return callbacks
    fit_id = next(_launched_fits)  # Counts every fit, so ids do not depend on callbacks.
    backup_dir, save_freq = requested
    own = [cb for cb in callbacks
           if isinstance(cb, (BackupAndRestore, keras.callbacks.BackupAndRestore))]
    for cb in own:
        if id(cb) not in _told_replaced:
            _told_replaced.add(id(cb))
            kind = ("kfit_ps.callbacks" if isinstance(cb, BackupAndRestore)
                    else "keras.callbacks")
            _tf_compat.print_msg(
                f"kfit_ps: the script's {kind}.BackupAndRestore({cb.backup_dir!r}) is replaced "
                f"by the launcher's backup in {backup_dir!r} (kfit-ps run --backup-dir, "
                f"save_freq {save_freq!r}): one backup, to resume from and to restore a lost "
                "ps in place.")
    return [cb for cb in callbacks if cb not in own] + [
        BackupAndRestore(backup_dir, save_freq=save_freq, fit_id=fit_id)]


_told_replaced = set()
