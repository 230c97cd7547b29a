"""The side-car evaluator: each checkpoint evaluated once, summaries, stop conditions."""

import json
import os
import subprocess
import sys

import keras
import pytest
import tensorflow as tf

import kfit_ps
from kfit_ps.training import summaries
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


@pytest.mark.parametrize("args, env, fragment", [
    (["--model-fn", "nope", "--data-fn", "x:y"], None, "--model-fn: must be MODULE:FUNCTION"),
    (["--model-fn", "tests.test_sidecar_evaluator:missing", "--data-fn", "x:y"], None,
     "--model-fn: could not be loaded"),
    (["--model-fn", "a:b", "--data-fn", "c:d"], {"TF_CONFIG": json.dumps({
        "cluster": {"worker": ["localhost:1"], "ps": ["localhost:2"]},
        "task": {"type": "worker", "index": 0}})}, "runs the 'evaluator' task"),
])
def test_cli_evaluator_errors(tmp_path, args, env, fragment):
    proc = run_cli(["--checkpoint-dir", str(tmp_path), *args], env=env)
    assert proc.returncode == 2
    assert fragment in proc.stderr
