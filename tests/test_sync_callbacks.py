"""kfit_ps.callbacks: N-step checkpoints, backups and summaries on a consistent state."""

import json

import h5py
import keras
import numpy as np
import pytest

import kfit_ps
from kfit_ps import _tf_compat
from kfit_ps.training.callbacks import summaries
from tests import helpers


def model_and_data(strategy, steps_per_execution=1, optimizer="sgd"):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=optimizer, loss="mse", metrics=[helpers.counting_metric()],
                      steps_per_execution=steps_per_execution)
    return model, kfit_ps.DatasetCreator(helpers.regression_dataset_fn())


def saved_iterations(path):
    with h5py.File(path, "r") as f:
        return int(np.asarray(f["optimizer/vars/0"]))


def test_model_checkpoint_every_n_steps_is_a_consistent_snapshot(strategy, tmp_path):
    # 2 workers, 3 steps per function: the loop must cut functions at the save points.
    model, data = model_and_data(strategy, steps_per_execution=3)
    seen = []

    class Batches(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if logs:
                seen.append((batch, logs["batches"]))

    checkpoint = kfit_ps.callbacks.ModelCheckpoint(
        str(tmp_path / "ckpt-{epoch:02d}-{batch:03d}.weights.h5"), save_weights_only=True,
        save_freq=4)
    model.fit(data, epochs=2, steps_per_epoch=10, verbose=0, callbacks=[checkpoint, Batches()])
    names = sorted(p.name for p in tmp_path.glob("*.weights.h5"))
    assert names == ["ckpt-01-004.weights.h5", "ckpt-01-008.weights.h5",
                     "ckpt-02-002.weights.h5", "ckpt-02-006.weights.h5",
                     "ckpt-02-010.weights.h5"]
    # Global steps 4, 8, 12, 16, 20: the file's iterations equal the steps applied,
    # so no step was in flight while the weights were read.
    for name, step in zip(names, [4, 8, 12, 16, 20]):
        assert saved_iterations(tmp_path / name) == step
        marker = json.loads((tmp_path / (name + ".kfit_ps.json")).read_text())
        assert marker["step"] == step
    # The batch ends after a synchronisation carry the epoch's exact counts so far.
    assert seen == [(3, 4.0), (7, 8.0), (9, 10.0), (1, 2.0), (5, 6.0), (9, 10.0)]
    assert json.loads((tmp_path / "kfit_ps_training_done.json").read_text()) == {"step": 20}
    restored = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    restored.load_weights(str(tmp_path / names[-1]))
    for a, b in zip(restored.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_model_checkpoint_keras_format_best_only_loads_without_a_cluster(strategy, tmp_path):
    model, data = model_and_data(strategy)
    path = tmp_path / "best.keras"
    checkpoint = kfit_ps.callbacks.ModelCheckpoint(str(path), monitor="loss",
                                                   save_best_only=True)
    model.fit(data, epochs=3, steps_per_epoch=20, verbose=0, callbacks=[checkpoint])
    assert checkpoint.best is not None and checkpoint.last_saved == str(path)
    x = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
    code = f"""
        import keras, numpy as np
        m = keras.models.load_model({str(path)!r}, compile=False)
        report(pred=m.predict(np.array({x.tolist()!r}, dtype="float32"), verbose=0).tolist())
        """
    result = helpers.run_chief(code)  # A plain process: no cluster, no strategy.
    np.testing.assert_allclose(result["pred"], model.predict(x, verbose=0), rtol=1e-6)


def test_backup_and_restore_resumes_mid_epoch(strategy, tmp_path):
    backup_dir = tmp_path / "backup"
    model, data = model_and_data(strategy, optimizer="adam")

    class Crash(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("simulated crash")

    backup = kfit_ps.callbacks.BackupAndRestore(str(backup_dir), save_freq=3)
    with pytest.raises(RuntimeError, match="simulated crash"):
        model.fit(data, epochs=3, steps_per_epoch=5, verbose=0, callbacks=[backup, Crash()])
    # Global steps 3, 6, 9: only the last backup is left, after step 4 of epoch 1.
    assert sorted(p.name for p in backup_dir.iterdir()) == [
        "backup-00000003.weights.h5", "backup-00000003.weights.h5.kfit_ps.json"]
    state = json.loads((backup_dir / "backup-00000003.weights.h5.kfit_ps.json").read_text())
    assert (state["epoch"], state["batch"], state["step"]) == (1, 4, 9)
    saved = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    saved.load_weights(str(backup_dir / "backup-00000003.weights.h5"))

    fresh, data = model_and_data(strategy, optimizer="adam")  # new variables, same cluster
    seen = {}

    class Begin(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if "weights" not in seen:
                seen["weights"] = fresh.get_weights()
                seen["slots"] = [v.numpy() for v in fresh.optimizer.variables]

    history = fresh.fit(data, epochs=3, steps_per_epoch=5, verbose=0,
                        callbacks=[kfit_ps.callbacks.BackupAndRestore(str(backup_dir),
                                                                       save_freq=3), Begin()])
    for a, b in zip(seen["weights"], saved.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert int(seen["slots"][0]) == 9 and any(np.any(s != 0) for s in seen["slots"][2:])
    # The History holds every epoch once: epoch 0 from the backup, the rest of epoch 1 (its
    # metrics count this run's batches), then epoch 2.
    assert history.epoch == [0, 1, 2]
    assert history.history["batches"] == [5.0, 1.0, 5.0]
    assert int(fresh.optimizer.iterations.numpy()) == 15
    assert not backup_dir.exists()  # deleted when fit completed
    history = fresh.fit(data, epochs=1, steps_per_epoch=5, verbose=0, callbacks=[
        kfit_ps.callbacks.BackupAndRestore(str(backup_dir), save_freq=3)])
    assert history.epoch == [0] and int(fresh.optimizer.iterations.numpy()) == 20


def test_tensorboard_step_and_epoch_scalars(strategy, tmp_path):
    model, data = model_and_data(strategy, steps_per_execution=2)
    board = kfit_ps.callbacks.TensorBoard(str(tmp_path), update_freq=5)
    model.fit(data, epochs=2, steps_per_epoch=10, verbose=0, validation_data=data,
              validation_steps=3, callbacks=[board])
    train = summaries.read_scalars(str(next((tmp_path / "train").glob("events.*"))))
    val = summaries.read_scalars(str(next((tmp_path / "validation").glob("events.*"))))
    assert [step for step, _ in train["batch_batches"]] == [5, 10, 15, 20]
    assert [value for _, value in train["batch_batches"]] == [5.0, 10.0, 5.0, 10.0]
    assert [step for step, _ in train["epoch_loss"]] == [0, 1]
    assert [value for _, value in val["epoch_batches"]] == [3.0, 3.0]
    assert [step for step, _ in val["evaluation_loss_vs_iterations"]] == [10, 20]


def test_early_stopping_restores_best_weights_on_the_ps(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    data = kfit_ps.DatasetCreator(helpers.regression_dataset_fn())
    best = {}

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                best["weights"] = model.get_weights()

    # Epochs 0-1 learn; from epoch 2 a huge rate makes the loss explode.
    schedule = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.05 if epoch < 2
                                                     else 5.0)
    stop = keras.callbacks.EarlyStopping(monitor="loss", patience=2, restore_best_weights=True)
    history = model.fit(data, epochs=10, steps_per_epoch=10, verbose=0,
                        callbacks=[schedule, Record(), stop])
    assert history.epoch == [0, 1, 2, 3]
    assert np.argmin(history.history["loss"]) == 1
    # Read back from the ps tasks: the variables there hold epoch 1's weights.
    on_ps = [v.numpy() for v in model.trainable_variables]
    for a, b in zip(on_ps, best["weights"]):
        np.testing.assert_array_equal(a, b)
    assert all("/job:ps/" in _tf_compat.storage(v).device for v in model.trainable_variables)


@pytest.mark.parametrize("make, fragment", [
    (lambda d: kfit_ps.callbacks.ModelCheckpoint(str(d / "m.h5")), "must end in '.keras'"),
    (lambda d: kfit_ps.callbacks.ModelCheckpoint(str(d / "m.keras"), save_weights_only=True),
     "must end in '.weights.h5'"),
    (lambda d: kfit_ps.callbacks.ModelCheckpoint(str(d / "m.keras"), save_freq=0),
     "save_freq=0"),
    (lambda d: kfit_ps.callbacks.BackupAndRestore(str(d), save_freq="batch"),
     "save_freq='batch'"),
    (lambda d: kfit_ps.callbacks.TensorBoard(str(d), update_freq=-1), "update_freq=-1"),
])
def test_bad_callback_arguments_are_named(tmp_path, make, fragment):
    with pytest.raises(ValueError, match="Received") as info:
        make(tmp_path)
    assert fragment in str(info.value)


def test_sync_points_cover_every_multiple_and_the_epoch_end():
    from kfit_ps.training.callbacks.base import SyncCallback, SyncPoints

    class Every(SyncCallback):
        def __init__(self, n):
            super().__init__()
            self.sync_every = n

    points = SyncPoints([Every(4), Every(6), keras.callbacks.Callback()], steps_per_epoch=10)
    assert points.stops(0, 0) == [4, 6, 8, 10]
    assert points.stops(1, 0) == [2, 6, 8, 10]  # global 12, 16, 18, 20
    assert points.stops(1, 6) == [8, 10]  # resumed after step 6 of epoch 1
    assert SyncPoints([], 7).stops(3, 0) == [7]
    # Splits trained whole (compressed files: batches [0, 5), [5, 9), [9, 10)) move each
    # point to the end of its split, and a callback whose point was passed is told there.
    every4, every6 = Every(4), Every(6)
    told = []
    every4.on_train_sync = every6.on_train_sync = lambda e, step, logs: told.append(step)
    points = SyncPoints([every4, every6], steps_per_epoch=10)
    stops = points.stops(0, 0, sync_point=lambda step: 5 if step <= 5 else 9 if step <= 9
                         else 10)
    assert stops == [5, 9, 10]
    for since, stop in zip([0] + stops, stops):
        points.synchronised(0, stop, {}, since)
    assert told == [5, 9, 9]  # every4: 4 at 5, 8 at 9; every6: 6 at 9


def crashed_backup(strategy, backup_dir):
    """A backup directory left by a run that crashed in epoch 2 (backups at steps 3, 6, 9)."""
    model, data = model_and_data(strategy, optimizer="adam")

    class Crash(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        model.fit(data, epochs=3, steps_per_epoch=5, verbose=0, callbacks=[
            kfit_ps.callbacks.BackupAndRestore(str(backup_dir), save_freq=3), Crash()])
    return data


def resume_from(strategy, data, backup_dir):
    """A fresh model's 3-epoch fit with a BackupAndRestore on `backup_dir`; returns its History
    and what it found as its first epoch began: iterations, the directory's files, the model."""
    fresh, _ = model_and_data(strategy, optimizer="adam")
    seen = {"model": fresh}

    class Begin(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            seen.setdefault("iterations", int(fresh.optimizer.iterations.numpy()))
            seen.setdefault("files", sorted(p.name for p in backup_dir.iterdir()))

    history = fresh.fit(data, epochs=3, steps_per_epoch=5, verbose=0, callbacks=[
        kfit_ps.callbacks.BackupAndRestore(str(backup_dir), save_freq=3,
                                           delete_checkpoint=False), Begin()])
    return history, seen


def test_backup_with_a_corrupt_marker_falls_back_to_the_previous_one(strategy, tmp_path,
                                                                     caplog):
    backup_dir = tmp_path / "backup"
    data = crashed_backup(strategy, backup_dir)
    good = sorted(backup_dir.iterdir())
    # A newer backup whose marker was cut short (a crash while writing it).
    (backup_dir / "backup-00000004.weights.h5").write_bytes(
        (backup_dir / "backup-00000003.weights.h5").read_bytes())
    (backup_dir / "backup-00000004.weights.h5.kfit_ps.json").write_text('{"step": 12, "ep')
    with caplog.at_level("WARNING", logger="kfit_ps"):
        history, resumed = resume_from(strategy, data, backup_dir)
    assert resumed["iterations"] == 9  # the complete backup, not a start from scratch
    assert resumed["files"] == sorted([p.name for p in good] + [
        "backup-00000004.weights.h5", "backup-00000004.weights.h5.kfit_ps.json"])
    assert "backup-00000004.weights.h5" in caplog.text and "not valid JSON" in caplog.text
    assert history.epoch == [0, 1, 2]
    # New backups never reuse a name, and older ones go only once a newer one is complete.
    assert sorted(p.name for p in backup_dir.iterdir()) == [
        "backup-00000006.weights.h5", "backup-00000006.weights.h5.kfit_ps.json"]
    # 6 was written at global step 15, epoch 2's last step; that epoch's end work done, its
    # marker resumes after it.
    marker = json.loads((backup_dir / "backup-00000006.weights.h5.kfit_ps.json").read_text())
    assert (marker["epoch"], marker["batch"], marker["step"]) == (3, 0, 15)
    assert marker["history"]["epoch"] == [0, 1, 2]


def test_backup_dir_without_any_complete_backup_starts_over_with_a_warning(strategy, tmp_path,
                                                                          caplog):
    # A job killed while writing its first backup: a restart must train, not fail.
    backup_dir = tmp_path / "backup"
    data = crashed_backup(strategy, backup_dir)
    marker = backup_dir / "backup-00000003.weights.h5.kfit_ps.json"
    marker.write_text("not json")
    with caplog.at_level("WARNING", logger="kfit_ps"):
        history, seen = resume_from(strategy, data, backup_dir)
    assert seen["iterations"] == 0 and history.epoch == [0, 1, 2]
    assert "backup-00000003.weights.h5" in seen["files"]  # nothing removed before a new one
    assert str(marker) in caplog.text and "starts from the beginning" in caplog.text
    assert seen["model"].optimizer.iterations.numpy() == 15
    assert "backup-00000003.weights.h5" not in [p.name for p in backup_dir.iterdir()]


def test_a_backup_whose_write_never_finished_is_skipped(strategy, tmp_path):
    backup_dir = tmp_path / "backup"
    data = crashed_backup(strategy, backup_dir)
    (backup_dir / "backup-00000004.weights.h5").write_bytes(b"half a file")  # no marker
    fresh, _ = model_and_data(strategy, optimizer="adam")
    history = fresh.fit(data, epochs=3, steps_per_epoch=5, verbose=0, callbacks=[
        kfit_ps.callbacks.BackupAndRestore(str(backup_dir), save_freq=3)])
    assert history.epoch == [0, 1, 2] and int(fresh.optimizer.iterations.numpy()) == 15


def test_a_fit_resumed_at_an_epoch_end_moves_that_backup_to_the_next_epoch(strategy, tmp_path):
    """A backup of an epoch's last step (a stop during its validation) resumes at the epoch's
    end work with its training logs; once that work is done in the resumed run, the backup's
    marker moves to the next epoch, so a later loss does not run that work again."""
    model, data = model_and_data(strategy, optimizer="adam")
    model.fit(data, epochs=1, steps_per_epoch=5, verbose=0)  # built, 5 steps trained
    backup_dir = str(tmp_path / "backup")

    def callback():
        backup = kfit_ps.callbacks.BackupAndRestore(backup_dir, save_freq=5,
                                                    delete_checkpoint=False)
        backup.set_model(model)
        backup.set_params({"epochs": 2, "steps": 5})
        backup.on_train_begin()
        return backup

    path = callback().on_train_preempt(0, 5, {"loss": 1.5})
    resumed = callback()
    assert resumed.resume_position() == (0, 5) and resumed.resume_logs() == {"loss": 1.5}
    resumed.on_epoch_end(0, {"loss": 1.5, "val_loss": 2.5})
    marker = json.loads(open(path + ".kfit_ps.json").read())
    assert (marker["epoch"], marker["batch"], marker["step"]) == (1, 0, 5), marker
    assert marker["history"] == {"epoch": [0], "history": {"loss": [1.5], "val_loss": [2.5]}}
    assert callback().resume_position() == (1, 0)


def test_under_backup_dir_a_scripts_own_keras_backup_is_replaced_not_refused(
        strategy, tmp_path, monkeypatch, capsys):
    """`kfit-ps run --backup-dir`: Keras' BackupAndRestore with an integer `save_freq` (refused
    on its own: it acts every N batches) is replaced by the launcher's before the callbacks
    are checked, and the chief says so."""
    from kfit_ps import constants

    monkeypatch.setenv(constants.BACKUP_DIR_ENV, str(tmp_path / "launcher"))
    monkeypatch.setenv(constants.BACKUP_FREQ_ENV, "5")
    model, data = model_and_data(strategy)
    own = keras.callbacks.BackupAndRestore(str(tmp_path / "own"), save_freq=10)
    model.fit(data, epochs=1, steps_per_epoch=5, verbose=0, callbacks=[own])
    assert "keras.callbacks.BackupAndRestore(" in capsys.readouterr().out
    assert not (tmp_path / "own").exists() and (tmp_path / "launcher").exists()
