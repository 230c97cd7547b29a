"""Keras callbacks under parameter-server fit: epoch-level exact, batch-level documented."""

import csv

import keras
import numpy as np
import pytest
import tensorflow as tf

import kfit_ps
from tests import helpers


def model_and_data(strategy, lr=0.01, steps_per_execution=1):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse",
                      metrics=[helpers.counting_metric()],
                      steps_per_execution=steps_per_execution)
    return model, kfit_ps.DatasetCreator(helpers.regression_dataset_fn())


def test_early_stopping_csv_logger_and_custom_epoch_end(strategy, tmp_path):
    model, data = model_and_data(strategy)
    seen = []

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append((epoch, dict(logs)))

    path = tmp_path / "log.csv"
    history = model.fit(
        data, epochs=10, steps_per_epoch=5, verbose=0,
        validation_data=data, validation_steps=2,
        callbacks=[keras.callbacks.EarlyStopping(monitor="loss", min_delta=1e9, patience=1),
                   keras.callbacks.CSVLogger(str(path)), Record()])
    assert history.epoch == [0, 1]  # no improvement of 1e9: stops after patience + 1 epochs
    assert [epoch for epoch, _ in seen] == [0, 1]
    assert all(logs["batches"] == 5.0 and logs["val_batches"] == 2.0 for _, logs in seen)
    rows = list(csv.DictReader(path.open()))
    assert [row["epoch"] for row in rows] == ["0", "1"]
    assert float(rows[1]["loss"]) == pytest.approx(seen[1][1]["loss"])


def test_a_ps_restored_during_epoch_end_reruns_only_the_interrupted_callback(
        strategy, tmp_path, monkeypatch):
    """A ps lost and restored in place while an epoch-end callback ran (the launcher's backup
    mid-save, say): that callback runs again, the ones before it do not (they ran every epoch
    end twice: CSV rows 0,1,1,2, an epoch counted twice by EarlyStopping), and the backup's
    History holds each epoch once."""
    from kfit_ps.training import loop

    class Lost(Exception):
        pass

    class RestoredInPlace:  # What `PsRecovery` does for the dispatcher, without a ps to lose.
        restored = 0

        def __init__(self, *args, **kwargs):
            pass

        def iterations(self):
            return None

        def lost(self, error):
            return [0] if isinstance(error, Lost) else []

        def transient(self, error):
            return False

        def recover(self, tasks, iterations):
            RestoredInPlace.restored += 1

    monkeypatch.setattr(loop, "PsRecovery", RestoredInPlace)
    model, data = model_and_data(strategy)
    seen, calls = [], []

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append(epoch)

    class Interrupted(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            calls.append(epoch)
            if calls == [0, 1]:  # The first try at epoch 1's end: the ps went away.
                raise Lost()

    path = tmp_path / "log.csv"
    backup = kfit_ps.callbacks.BackupAndRestore(str(tmp_path / "backup"), delete_checkpoint=False)
    write, tries = backup._backup, []

    def backup_lost_once_at_the_last_epoch(epoch, step):
        tries.append(epoch)
        if tries.count(3) == 1 and epoch == 3:  # Mid-save: the ps went away.
            raise Lost()
        return write(epoch, step)

    monkeypatch.setattr(backup, "_backup", backup_lost_once_at_the_last_epoch)
    history = model.fit(data, epochs=3, steps_per_epoch=5, verbose=0, callbacks=[
        Record(), keras.callbacks.CSVLogger(str(path)), Interrupted(), backup])
    assert RestoredInPlace.restored == 2 and tries == [1, 2, 3, 3]
    assert seen == [0, 1, 2] and calls == [0, 1, 1, 2] and history.epoch == [0, 1, 2]
    assert [row["epoch"] for row in csv.DictReader(path.open())] == ["0", "1", "2"]
    assert backup._history["epoch"] == [0, 1, 2]


def test_learning_rate_callbacks_set_the_rate_on_the_ps(strategy):
    model, data = model_and_data(strategy, lr=0.1)
    model.fit(data, epochs=3, steps_per_epoch=2, verbose=0, callbacks=[
        keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.01 * (epoch + 1))])
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.03)
    model, data = model_and_data(strategy, lr=0.1)
    model.fit(data, epochs=3, steps_per_epoch=2, verbose=0, callbacks=[
        keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0,
                                          min_delta=1e9)])
    # Epoch 0 improves on +inf; epochs 1 and 2 halve the rate (stock Keras semantics).
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.1 * 0.5 ** 2)


def test_terminate_on_nan_stops_training(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    bad = kfit_ps.DatasetCreator(lambda ctx: tf.data.Dataset.from_tensors(
        (tf.ones((4, 4)), tf.fill((4, 1), np.nan))).repeat())
    history = model.fit(bad, epochs=5, steps_per_epoch=3, verbose=0,
                        callbacks=[keras.callbacks.TerminateOnNaN()])
    assert history.epoch == [0]
    assert np.isnan(history.history["loss"][0])
    assert model.stop_training


def test_model_checkpoint_each_epoch_writes_consistent_weights(strategy, tmp_path):
    model, data = model_and_data(strategy)
    pattern = str(tmp_path / "ckpt-{epoch:02d}.weights.h5")
    model.fit(data, epochs=2, steps_per_epoch=5, verbose=0, callbacks=[
        keras.callbacks.ModelCheckpoint(pattern, save_weights_only=True)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-01.weights.h5",
                                                          "ckpt-02.weights.h5"]
    restored = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    restored.load_weights(str(tmp_path / "ckpt-02.weights.h5"))
    for a, b in zip(restored.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_batch_hooks_once_per_scheduled_function(strategy):
    model, data = model_and_data(strategy, steps_per_execution=3)
    calls = []

    class Batches(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            calls.append(("begin", batch, dict(logs or {})))

        def on_train_batch_end(self, batch, logs=None):
            calls.append(("end", batch, dict(logs or {})))

    model.fit(data, epochs=1, steps_per_epoch=10, verbose=0, callbacks=[Batches()])
    assert [(kind, batch) for kind, batch, _ in calls] == [
        ("begin", 0), ("end", 2), ("begin", 3), ("end", 5), ("begin", 6), ("end", 8),
        ("begin", 9), ("end", 9)]
    assert all(logs == {} for _, _, logs in calls[:-1])
    assert calls[-1][2]["batches"] == 10.0  # the epoch's last end carries the epoch logs


@pytest.mark.parametrize("callback, fragment", [
    (lambda d: keras.callbacks.ModelCheckpoint(str(d / "m.keras"), save_freq=5),
     "ModelCheckpoint(save_freq=5)"),
    (lambda d: keras.callbacks.BackupAndRestore(str(d / "b"), save_freq=3),
     "BackupAndRestore(save_freq=3)"),
    (lambda d: keras.callbacks.TensorBoard(str(d / "tb"), update_freq="batch"),
     "TensorBoard(update_freq=1)"),
])
def test_per_batch_callbacks_are_refused_at_start(strategy, tmp_path, callback, fragment):
    model, data = model_and_data(strategy)
    with pytest.raises(ValueError) as info:
        model.fit(data, epochs=1, steps_per_epoch=2, verbose=0, callbacks=[callback(tmp_path)])
    assert fragment in str(info.value) and 'Use ' in str(info.value)
    assert int(model.optimizer.iterations.numpy()) == 0  # nothing ran


@pytest.mark.parametrize("verbose", [0, 1, 2])
def test_verbose_modes(strategy, capsys, verbose):
    model, data = model_and_data(strategy)
    model.fit(data, epochs=2, steps_per_epoch=4, verbose=verbose)
    out = capsys.readouterr().out
    if verbose == 0:
        assert out == ""
    else:
        assert "Epoch 1/2" in out and "Epoch 2/2" in out
        assert out.count("loss:") == 2 and "4/4" in out


def test_stock_keras_tensorboard_at_epoch_frequency(strategy, tmp_path):
    """TensorFlow 2.21 does not install TensorBoard; kfit_ps does, so Keras' callback works."""
    from kfit_ps.training.callbacks import summaries

    model, data = model_and_data(strategy)
    model.fit(data, epochs=2, steps_per_epoch=4, verbose=0, validation_data=data,
              validation_steps=2, callbacks=[keras.callbacks.TensorBoard(str(tmp_path))])
    [train_events] = (tmp_path / "train").glob("events.*")
    [val_events] = (tmp_path / "validation").glob("events.*")
    assert [step for step, _ in summaries.read_scalars(str(train_events))["epoch_loss"]] == [0, 1]
    assert "epoch_loss" in summaries.read_scalars(str(val_events))
