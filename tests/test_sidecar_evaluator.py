"""The side-car evaluator: each checkpoint evaluated once, summaries, stop conditions."""

import json
import os
import subprocess
import sys

import keras
import pytest
import tensorflow as tf

import kfit_ps
from kfit_ps.training.callbacks import summaries
from tests import helpers


def build_model():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    return model


def eval_data():
    x = tf.random.stateless_normal((64, 4), seed=(3, 4))
    return tf.data.Dataset.from_tensor_slices((x, tf.reduce_sum(x, 1, keepdims=True))).batch(16)


@pytest.fixture(scope="module")
def checkpoints(strategy, tmp_path_factory):
    """A directory with 4 checkpoints (steps 5, 10, 15, 20) and the training-done marker."""
    directory = tmp_path_factory.mktemp("ckpt")
    with strategy.scope():
        model = build_model()
    model.fit(kfit_ps.DatasetCreator(helpers.regression_dataset_fn()), epochs=2,
              steps_per_epoch=10, verbose=0, callbacks=[kfit_ps.callbacks.ModelCheckpoint(
                  str(directory / "ckpt-{epoch}-{batch:02d}.weights.h5"),
                  save_weights_only=True, save_freq=5)])
    return directory


def direct_loss(path):
    model = build_model()
    model.load_weights(str(path))
    return model.evaluate(eval_data(), verbose=0, return_dict=True)["loss"]


def test_each_checkpoint_is_evaluated_once_with_its_step(checkpoints, tmp_path):
    evaluator = kfit_ps.SidecarEvaluator(build_model(), eval_data(), str(checkpoints),
                                         log_dir=str(tmp_path), poll_interval=0.1)
    evaluations = evaluator.start()  # Stops by itself: training has finished.
    assert [e.step for e in evaluations] == [5, 10, 15, 20]
    assert [os.path.basename(e.path) for e in evaluations] == [
        "ckpt-1-05.weights.h5", "ckpt-1-10.weights.h5", "ckpt-2-05.weights.h5",
        "ckpt-2-10.weights.h5"]
    for e in evaluations:
        assert e.logs["loss"] == pytest.approx(direct_loss(e.path), rel=1e-6)
    events = list((tmp_path / "validation").glob("events.*"))
    assert len(events) == 1
    scalars = summaries.read_scalars(str(events[0]))
    assert [step for step, _ in scalars["evaluation_loss_vs_iterations"]] == [5, 10, 15, 20]
    assert evaluator.start() == evaluations  # Nothing new: nothing evaluated twice.


def test_max_evaluations_and_best_export(checkpoints, tmp_path):
    best = tmp_path / "best.keras"
    evaluator = kfit_ps.SidecarEvaluator(build_model(), eval_data(), str(checkpoints),
                                         max_evaluations=2, log_dir=str(tmp_path),
                                         export_best=str(best), poll_interval=0.1)
    evaluations = evaluator.start()
    assert len(evaluations) == 2
    assert best.exists()
    exported = keras.models.load_model(str(best))
    losses = [e.logs["loss"] for e in evaluations]
    assert exported.evaluate(eval_data(), verbose=0, return_dict=True)["loss"] == \
        pytest.approx(min(losses), rel=1e-6)


def test_partly_written_and_unmarked_files(checkpoints, tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "broken.weights.h5").write_bytes(b"\x89HDF\r\n half a file")
    # A stock Keras checkpoint (no kfit_ps marker): read once it stopped changing.
    source = checkpoints / "ckpt-2-10.weights.h5"
    (directory / "stock.weights.h5").write_bytes(source.read_bytes())
    past = os.path.getmtime(source) - 60
    for name in ("broken.weights.h5", "stock.weights.h5"):
        os.utime(directory / name, (past, past))
    evaluator = kfit_ps.SidecarEvaluator(build_model(), eval_data(), str(directory),
                                         idle_timeout=1.0, poll_interval=0.2)
    evaluations = evaluator.start()
    assert [os.path.basename(e.path) for e in evaluations] == ["stock.weights.h5"]
    assert evaluations[0].step == 20  # read from the optimizer state in the file


def test_constructor_errors_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="must be compiled"):
        kfit_ps.SidecarEvaluator(keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]),
                                 eval_data(), str(tmp_path))
    with pytest.raises(ValueError, match="max_evaluations=0"):
        kfit_ps.SidecarEvaluator(build_model(), eval_data(), str(tmp_path), max_evaluations=0)
    with pytest.raises(ValueError, match="export_best='best.h5'"):
        kfit_ps.SidecarEvaluator(build_model(), eval_data(), str(tmp_path),
                                 export_best="best.h5")


def run_cli(args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "kfit_ps.cli.main", "evaluator", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=helpers.ROOT,
                          env=dict(helpers.chief_env(), **(env or {})))


def test_cli_evaluator_evaluates_each_checkpoint(checkpoints):
    proc = run_cli(["--checkpoint-dir", str(checkpoints), "--model-fn",
                    "tests.test_sidecar_evaluator:build_model", "--data-fn",
                    "tests.test_sidecar_evaluator:eval_data"],
                   env={"TF_CONFIG": json.dumps({
                       "cluster": {"worker": ["localhost:1"], "ps": ["localhost:2"]},
                       "task": {"type": "evaluator", "index": 0}})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [row["step"] for row in rows] == [5, 10, 15, 20]
    assert "kfit-ps evaluator: checkpoint_dir=" in proc.stderr


WORKER_TF_CONFIG = json.dumps({"cluster": {"worker": ["localhost:1"], "ps": ["localhost:2"]},
                               "task": {"type": "worker", "index": 0}})
CLI_ERRORS = [
    (("--model-fn", "nope", "--data-fn", "x:y"), None, "--model-fn: must be MODULE:FUNCTION"),
    (("--model-fn", "tests.test_sidecar_evaluator:missing", "--data-fn", "x:y"), None,
     "--model-fn: could not be loaded"),
    (("--model-fn", "a:b", "--data-fn", "c:d"), WORKER_TF_CONFIG, "runs the 'evaluator' task"),
]


@pytest.fixture(scope="module")
def evaluator_failures(tmp_path_factory):
    """`kfit-ps evaluator` with each of CLI_ERRORS' flags -> (exit status, stderr)."""
    directory = str(tmp_path_factory.mktemp("evaluator_cli"))
    cases = [(("evaluator", "--checkpoint-dir", directory, *args),
              {"TF_CONFIG": tf_config} if tf_config else None) for args, tf_config, _ in CLI_ERRORS]
    return dict(zip([args for args, _, _ in CLI_ERRORS], helpers.cli_failures(cases)))


@pytest.mark.parametrize("args, tf_config, fragment", CLI_ERRORS)
def test_cli_evaluator_errors(evaluator_failures, args, tf_config, fragment):
    status, err = evaluator_failures[args]
    assert status == 2
    assert fragment in err


def test_a_file_rewritten_under_its_old_marker_is_not_evaluated(checkpoints, tmp_path):
    """ModelCheckpoint with a fixed filepath rewrites the file: an evaluator must never take
    the new (or half-written) bytes with the old marker's step."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    path = directory / "latest.weights.h5"
    old, new = checkpoints / "ckpt-1-05.weights.h5", checkpoints / "ckpt-2-10.weights.h5"
    path.write_bytes(old.read_bytes())
    (directory / "latest.weights.h5.kfit_ps.json").write_text(
        (checkpoints / "ckpt-1-05.weights.h5.kfit_ps.json").read_text())
    (directory / "kfit_ps_training.json").write_text('{"state": "running"}')
    evaluator = kfit_ps.SidecarEvaluator(build_model(), eval_data(), str(directory),
                                         idle_timeout=0.5, poll_interval=0.1)
    first = evaluator.start()
    assert [e.step for e in first] == [5]
    assert first[0].logs["loss"] == pytest.approx(direct_loss(old), rel=1e-6)

    path.write_bytes(new.read_bytes()[:5000])  # Being rewritten, old marker still there,
    assert evaluator.start() == first          # then complete, marker not yet rewritten:
    path.write_bytes(new.read_bytes())
    assert evaluator.start() == first          # neither is evaluated as step 5.
    (directory / "latest.weights.h5.kfit_ps.json").write_text(
        (checkpoints / "ckpt-2-10.weights.h5.kfit_ps.json").read_text())
    second = evaluator.start()
    assert [e.step for e in second] == [5, 20]
    assert second[1].logs["loss"] == pytest.approx(direct_loss(new), rel=1e-6)


def test_model_checkpoint_with_a_fixed_filepath_publishes_each_rewrite(strategy, tmp_path):
    with strategy.scope():
        model = build_model()
    path = tmp_path / "latest.weights.h5"
    marker = tmp_path / "latest.weights.h5.kfit_ps.json"
    seen = []

    class Watch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):  # after each synchronised save
            if marker.exists():
                seen.append(json.loads(marker.read_text()))

    model.fit(kfit_ps.DatasetCreator(helpers.regression_dataset_fn()), epochs=1,
              steps_per_epoch=9, verbose=0, callbacks=[kfit_ps.callbacks.ModelCheckpoint(
                  str(path), save_weights_only=True, save_freq=3), Watch()])
    import hashlib
    final = json.loads(marker.read_text())
    assert final["step"] == 9
    assert final["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert final["size"] == path.stat().st_size


def test_stock_keras_checkpoints_and_no_idle_timeout_stop_after_the_default(
        checkpoints, tmp_path, monkeypatch, caplog):
    """Stock Keras callbacks write no 'training done' file: the wait is bounded."""
    directory = tmp_path / "stock"
    directory.mkdir()
    (directory / "stock.weights.h5").write_bytes(
        (checkpoints / "ckpt-2-10.weights.h5").read_bytes())
    past = os.path.getmtime(checkpoints / "ckpt-2-10.weights.h5") - 60
    os.utime(directory / "stock.weights.h5", (past, past))
    monkeypatch.setenv("KFIT_PS_EVALUATOR_IDLE_TIMEOUT", "1.5")
    evaluator = kfit_ps.SidecarEvaluator(build_model(), eval_data(), str(directory),
                                         poll_interval=0.1)
    import time
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="kfit_ps"):
        evaluations = evaluator.start()
    assert time.monotonic() - started < 30
    assert [e.step for e in evaluations] == [20]
    assert "no 'training done' file" in caplog.text
    assert "KFIT_PS_EVALUATOR_IDLE_TIMEOUT" in caplog.text


def test_evaluator_accepts_the_training_dataset_creator(checkpoints, tmp_path):
    def dataset_fn(input_context):
        x = tf.random.stateless_normal((64, 4), seed=(3, 4))
        return tf.data.Dataset.from_tensor_slices(
            (x, tf.reduce_sum(x, 1, keepdims=True))).batch(16)

    evaluator = kfit_ps.SidecarEvaluator(build_model(), kfit_ps.DatasetCreator(dataset_fn),
                                         str(checkpoints), max_evaluations=1)
    [evaluation] = evaluator.start()
    assert evaluation.logs["loss"] == pytest.approx(direct_loss(evaluation.path), rel=1e-6)
    repeated = kfit_ps.DatasetCreator(lambda ctx: dataset_fn(ctx).repeat())
    with pytest.raises(ValueError, match="infinite .* Pass `steps=N`"):
        kfit_ps.SidecarEvaluator(build_model(), repeated, str(checkpoints))
    evaluator = kfit_ps.SidecarEvaluator(build_model(), repeated, str(checkpoints), steps=4,
                                         max_evaluations=1)
    assert len(evaluator.start()) == 1


def test_stock_keras_tensorboard_in_the_evaluator(checkpoints, tmp_path):
    board = keras.callbacks.TensorBoard(str(tmp_path / "tb"))
    evaluator = kfit_ps.SidecarEvaluator(build_model(), eval_data(), str(checkpoints),
                                         max_evaluations=2, callbacks=[board])
    assert len(evaluator.start()) == 2
    assert list((tmp_path / "tb" / "validation").glob("events.*"))


def test_a_restarted_evaluator_keeps_its_best_and_never_overwrites_a_better_export(
        checkpoints, tmp_path):
    best = tmp_path / "best.keras"
    first = kfit_ps.SidecarEvaluator(build_model(), eval_data(), str(checkpoints),
                                     log_dir=str(tmp_path), export_best=str(best),
                                     poll_interval=0.1)
    losses = {os.path.basename(e.path): e.logs["loss"] for e in first.start()}
    exported = best.read_bytes()
    # The evaluator restarts (its pod was rescheduled) and sees two earlier checkpoints
    # again (written anew): one worse than the best so far must not replace the export.
    later = tmp_path / "later"
    later.mkdir()
    for name in ("ckpt-1-05.weights.h5", "ckpt-1-10.weights.h5"):
        for suffix in ("", ".kfit_ps.json"):
            (later / (name + suffix)).write_bytes((checkpoints / (name + suffix)).read_bytes())
    (later / "kfit_ps_training_done.json").write_text('{"step": 20}')
    restarted = kfit_ps.SidecarEvaluator(build_model(), eval_data(), str(later),
                                         log_dir=str(tmp_path), export_best=str(best),
                                         poll_interval=0.1)
    assert restarted.best == pytest.approx(min(losses.values()), rel=1e-6)
    restarted.start()
    if min(losses.values()) < min(losses[n] for n in ("ckpt-1-05.weights.h5",
                                                      "ckpt-1-10.weights.h5")):
        assert best.read_bytes() == exported  # the better export stays
    assert keras.models.load_model(str(best)).evaluate(
        eval_data(), verbose=0, return_dict=True)["loss"] == pytest.approx(
            min(losses.values()), rel=1e-6)


def test_the_evaluator_stops_with_the_error_when_training_failed(strategy, tmp_path):
    directory = tmp_path / "ckpt"

    class Bug(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                raise ValueError("a bug in the training script")

    with strategy.scope():
        model = build_model()
    with pytest.raises(ValueError, match="a bug in the training script"):
        model.fit(kfit_ps.DatasetCreator(helpers.regression_dataset_fn()), epochs=3,
                  steps_per_epoch=10, verbose=0, callbacks=[kfit_ps.callbacks.ModelCheckpoint(
                      str(directory / "ckpt-{epoch}.weights.h5"), save_weights_only=True),
                      Bug()])
    evaluator = kfit_ps.SidecarEvaluator(build_model(), eval_data(), str(directory),
                                         log_dir=str(tmp_path), poll_interval=0.1)
    evaluations = evaluator.start()  # Returns: no "done" file will ever come.
    assert [e.step for e in evaluations] == [10]  # what was published before the failure
    assert evaluator.training_failed == "ValueError: a bug in the training script"
    proc = run_cli(["--checkpoint-dir", str(directory), "--model-fn",
                    "tests.test_sidecar_evaluator:build_model", "--data-fn",
                    "tests.test_sidecar_evaluator:eval_data"])
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "training failed (ValueError: a bug in the training script)" in proc.stderr
