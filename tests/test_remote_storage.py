"""Checkpoints, backups and the side-car evaluator on a non-local TensorFlow file system.

TensorFlow's in-memory `ram://` file system stands in for object stores such as `gs://`: every
file goes through `tf.io.gfile`, and publication never relies on a rename.
"""

import uuid

import keras
import numpy as np
import pytest
import tensorflow as tf

import kfit_ps
from kfit_ps.training.callbacks import checkpoint_files
from tests import helpers


def compiled(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("adam", "mse", metrics=[helpers.counting_metric()])
    return model


def eval_model():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    return model


def eval_data():
    x = tf.random.stateless_normal((64, 4), seed=(3, 4))
    return tf.data.Dataset.from_tensor_slices((x, tf.reduce_sum(x, 1, keepdims=True))).batch(16)


@pytest.fixture
def root():
    path = f"ram://kfit_ps_test_{uuid.uuid4().hex}"
    yield path
    if tf.io.gfile.exists(path):
        tf.io.gfile.rmtree(path)


def test_checkpoints_backup_resume_and_evaluator_on_ram(strategy, root):
    data = kfit_ps.DatasetCreator(helpers.regression_dataset_fn())
    ckpt_dir, backup_dir = f"{root}/ckpt", f"{root}/backup"

    class Crash(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("simulated crash")

    def callbacks():
        return [kfit_ps.callbacks.ModelCheckpoint(
                    ckpt_dir + "/ckpt-{epoch}-{batch:02d}.weights.h5", save_weights_only=True,
                    save_freq=5),
                kfit_ps.callbacks.BackupAndRestore(backup_dir, save_freq=3)]

    with pytest.raises(RuntimeError, match="simulated crash"):
        compiled(strategy).fit(data, epochs=3, steps_per_epoch=5, verbose=0,
                               callbacks=callbacks() + [Crash()])
    assert sorted(tf.io.gfile.listdir(backup_dir)) == [
        "backup-00000003.weights.h5", "backup-00000003.weights.h5.kfit_ps.json"]
    assert not tf.io.gfile.exists("ram:")  # nothing on the local disk by that name
    fresh = compiled(strategy)
    history = fresh.fit(data, epochs=3, steps_per_epoch=5, verbose=0, callbacks=callbacks())
    assert history.epoch == [0, 1, 2] and history.history["batches"] == [5.0, 1.0, 5.0]
    assert int(fresh.optimizer.iterations.numpy()) == 15
    assert not tf.io.gfile.exists(backup_dir)  # deleted when fit completed

    names = sorted(n for n in tf.io.gfile.listdir(ckpt_dir) if n.endswith(".h5"))
    # Global steps 5, 10, 15; the resumed run wrote step 10 (ckpt-2-05) again.
    assert names == ["ckpt-1-05.weights.h5", "ckpt-2-05.weights.h5", "ckpt-3-05.weights.h5"]
    # A checkpoint whose write never finished: bytes, no marker. Never read.
    with tf.io.gfile.GFile(f"{ckpt_dir}/ckpt-9-99.weights.h5", "wb") as f:
        f.write(b"\x89HDF\r\n half a file")
    evaluations = kfit_ps.SidecarEvaluator(eval_model(), eval_data(), ckpt_dir,
                                           log_dir=f"{root}/logs", poll_interval=0.1).start()
    assert [e.step for e in evaluations] == [5, 10, 15]
    assert [e.path.rsplit("/", 1)[1] for e in evaluations] == names
    assert checkpoint_files.training_done(ckpt_dir) == 15
    assert tf.io.gfile.glob(f"{root}/logs/validation/events.*")


def test_export_and_criteo_files_on_ram(strategy, root):
    from kfit_ps.data import criteo

    paths = criteo.generate(f"{root}/criteo", 100, criteo.CriteoSpec(scale=1e-4), files=2)
    assert [p.rsplit("/", 1)[1] for p in paths] == ["part-00000.tsv", "part-00001.tsv"]
    features, labels = next(iter(criteo.dataset(paths, 8, criteo.CriteoSpec(scale=1e-4))))
    assert labels.shape == (8, 1) and features["dense"].shape == (8, 13)
    model = compiled(strategy)
    model.fit(np.ones((8, 4), "float32"), np.ones((8, 1), "float32"), epochs=1, verbose=0)
    path = kfit_ps.export_saved_model(model, f"{root}/export/1")
    assert tf.io.gfile.exists(f"{path}/saved_model.pb")
    with pytest.raises(ValueError, match="already exists"):
        kfit_ps.export_saved_model(model, path)
