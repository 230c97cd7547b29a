"""Training on a parameter-server cluster with a side-car evaluator process.

The chief trains on a local cluster and writes a checkpoint every 50 steps
(`kfit_ps.callbacks.ModelCheckpoint`). At the same time, an evaluator process
(`kfit-ps evaluator`, task type "evaluator" in TF_CONFIG) evaluates each
checkpoint once on held-out data, writes TensorBoard summaries under
CHECKPOINT_DIR/validation, exports the best model, and stops when training
has finished.

Run: python examples/train_with_evaluator.py [CHECKPOINT_DIR]
Or, supervised: kfit-ps run --workers 2 --ps 1 -- python examples/train_with_evaluator.py
"""

import json
import os
import subprocess
import sys
import tempfile

# kfit_ps first: imported before TensorFlow, it keeps TensorFlow's C++ start-up log lines
# off the terminal (KFIT_PS_TF_LOGS=1 brings them back).
import kfit_ps  # isort: skip

import keras
import numpy as np
import tensorflow as tf

HERE = os.path.abspath(__file__)


def make_data(seed, n):
    rng = np.random.default_rng(seed)
    users, items = rng.integers(0, 1000, n), rng.integers(0, 500, n)
    taste = np.sin(users * 0.37) * np.cos(items * 0.73)
    clicks = (rng.random(n) < 1 / (1 + np.exp(-4 * taste))).astype("float32")
    return {"user": users, "item": items}, clicks


def dataset_fn(input_context):
    features, clicks = make_data(0, 50_000)
    data = tf.data.Dataset.from_tensor_slices((features, clicks))
    return data.shuffle(10_000).repeat().batch(256)


def build_model():
    """The model, compiled; the evaluator calls this too (without a strategy)."""
    user = keras.Input(shape=(), dtype="int64", name="user")
    item = keras.Input(shape=(), dtype="int64", name="item")
    u = keras.layers.Embedding(1000, 16)(user)
    i = keras.layers.Embedding(500, 16)(item)
    x = keras.layers.Dense(32, activation="relu")(keras.layers.Concatenate()([u, i, u * i]))
    model = keras.Model({"user": user, "item": item}, keras.layers.Dense(1, "sigmoid")(x))
    model.compile(keras.optimizers.Adam(0.01), "binary_crossentropy",
                  metrics=[keras.metrics.AUC(name="auc")])
    return model


def held_out_data():
    """Evaluation data for the evaluator: a finite dataset it reads whole each time."""
    features, clicks = make_data(1, 8192)
    return tf.data.Dataset.from_tensor_slices((features, clicks)).batch(1024)


def start_evaluator(cluster_resolver, checkpoint_dir):
    # The evaluator task is outside the training cluster: it only reads checkpoints.
    tf_config = {"cluster": cluster_resolver.cluster_spec().as_dict(),
                 "task": {"type": "evaluator", "index": 0}}
    env = dict(os.environ, TF_CONFIG=json.dumps(tf_config))
    return subprocess.Popen(
        [sys.executable, "-m", "kfit_ps.cli.main", "evaluator", "--checkpoint-dir",
         checkpoint_dir, "--model-fn", f"{HERE}:build_model", "--data-fn",
         f"{HERE}:held_out_data", "--export-best", os.path.join(checkpoint_dir, "best.keras"),
         "--monitor", "auc", "--mode", "max"], env=env, stdout=subprocess.PIPE, text=True)


def main(checkpoint_dir):
    evaluator = None
    try:
        with kfit_ps.job_cluster(num_workers=2, num_ps=1) as resolver:
            evaluator = start_evaluator(resolver, checkpoint_dir)
            strategy = kfit_ps.ParameterServerStrategy(resolver)
            with strategy.scope():
                model = build_model()
            checkpoint = kfit_ps.callbacks.ModelCheckpoint(
                os.path.join(checkpoint_dir, "ckpt-{epoch:02d}-{batch:03d}.weights.h5"),
                save_weights_only=True, save_freq=50)
            model.fit(kfit_ps.DatasetCreator(dataset_fn), epochs=2, steps_per_epoch=100,
                      callbacks=[checkpoint], verbose=2)
        output, _ = evaluator.communicate(timeout=600)
    finally:
        if evaluator is not None and evaluator.poll() is None:
            evaluator.kill()
    results = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    for r in results:
        print(f"evaluator: {r['checkpoint']} at step {r['step']}: auc={r['auc']:.3f}")
    return results


if __name__ == "__main__":
    directory = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="kfit_ps_ckpt_")
    evaluations = main(directory)
    print(f"{len(evaluations)} checkpoints evaluated; best model: "
          f"{os.path.join(directory, 'best.keras')}")
    sys.exit(0 if len(evaluations) == 4 else 1)
