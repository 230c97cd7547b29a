"""Keras scripts as their authors wrote them, moved onto kfit_ps with two lines.

`tests/scripts/` holds scripts that take the steps of two keras-io examples
(collaborative filtering on MovieLens ratings; structured data with
`FeatureSpace`) on generated data of the same schema (there is no network here).
Each runs as written, in one process, and as a kfit_ps user would move it: the
strategy line after the imports and `with strategy.scope():` around the model;
the data, preprocessing (a `FeatureSpace` adapted outside any scope, datasets
mapped through it and shuffled), `fit`, and the inference model are untouched.
"""

import difflib
import json
import sys

import pytest

from tests import helpers
from tests.test_main_job import run_and_watch

STRATEGY = ("strategy = kfit_ps.ParameterServerStrategy(kfit_ps.LocalCluster(num_workers=2, "
            "num_ps=1))")


def on_kfit_ps(source):
    """`source` with the two lines a kfit_ps user adds (and `import kfit_ps`)."""
    lines = source.splitlines()
    last_import = max(i for i, line in enumerate(lines)
                      if line.startswith(("import ", "from ")))
    out = lines[:last_import + 1] + ["import kfit_ps", STRATEGY]
    inside = False
    for line in lines[last_import + 1:]:
        if line == "# MODEL":
            out.append("with strategy.scope():")
            inside = True
        elif line == "# END MODEL":
            inside = False
        else:
            out.append(("    " + line if line else line) if inside else line)
    return "\n".join(out) + "\n"


def run(tmp_path, name, distributed):
    source = open(f"{helpers.ROOT}/tests/scripts/{name}.py").read()
    if distributed:
        moved = on_kfit_ps(source)
        changed = [line for line in difflib.ndiff(source.splitlines(), moved.splitlines())
                   if line.startswith(("+ ", "- "))]
        added = {line[2:] for line in changed if line.startswith("+ ")
                 and line[2:].strip() not in {l.strip() for l in source.splitlines()}}
        assert added == {"import kfit_ps", STRATEGY, "with strategy.scope():"}, added
        source = moved
    script = tmp_path / f"{name}{'_ps' if distributed else ''}.py"
    script.write_text(source)
    result = tmp_path / f"{script.stem}.json"
    proc, out, pids = run_and_watch([sys.executable, str(script), str(result)], timeout=400)
    assert proc.returncode == 0, out[-4000:]
    assert len(pids) == (3 if distributed else 0)  # 2 workers and a ps, or none
    assert helpers.wait_for_no_servers(pids, timeout=10) == []  # stopped when it ended
    return json.loads(result.read_text()), out


@pytest.mark.slow
def test_movielens_collaborative_filtering_runs_with_two_lines_changed(tmp_path):
    """Numpy arrays, a subclassed model, `validation_data`, `predict`: the same curve."""
    alone, _ = run(tmp_path, "movielens_ratings", False)
    moved, out = run(tmp_path, "movielens_ratings", True)
    assert moved["epochs"] == alone["epochs"] == [0, 1, 2, 3]
    assert moved["predictions"] == alone["predictions"]
    assert moved["val_loss"][-1] < moved["val_loss"][0] - 0.1  # it learned
    assert abs(moved["val_loss"][-1] - alone["val_loss"][-1]) < 0.03, (moved, alone)


@pytest.mark.slow
def test_feature_space_classification_runs_with_two_lines_changed(tmp_path):
    """A `FeatureSpace` adapted outside the scope and datasets that shuffle and map through
    it: the coordinator reads them and ships each batch (said once), validation included;
    the inference model built after `fit` predicts a raw example."""
    alone, _ = run(tmp_path, "feature_space_classification", False)
    moved, out = run(tmp_path, "feature_space_classification", True)
    assert "kfit_ps: `x` is read on the coordinator and each batch shipped" in out, out[-3000:]
    assert moved["epochs"] == alone["epochs"] == list(range(12))
    assert min(moved["val_accuracy"][-1], alone["val_accuracy"][-1]) > 0.85, (moved, alone)
    assert abs(moved["val_accuracy"][-1] - alone["val_accuracy"][-1]) < 0.07, (moved, alone)
    assert moved["probability"] > 0.5 and alone["probability"] > 0.5


DATA_FIRST = '''
import json, sys
import numpy as np
import keras
import tensorflow as tf
import kfit_ps

x = np.arange(3000, dtype="float32").reshape(1000, 3) / 3000
y = x.sum(axis=1, keepdims=True)
data = tf.data.Dataset.from_tensor_slices((x, y)).map(lambda a, b: (a * 2, b)).batch(64)
lookup = keras.layers.StringLookup(vocabulary=["a", "b"])
stateful = tf.data.Dataset.from_tensor_slices((["a", "b"] * 64, [[1.0]] * 128)).map(
    lambda s, t: (tf.cast(lookup(s), tf.float32)[None] * tf.ones(3), t)).batch(64)
strategy = kfit_ps.ParameterServerStrategy(kfit_ps.LocalCluster(num_workers=1, num_ps=1))
with strategy.scope():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=5)
logs = model.fit(data, validation_data=data, epochs=2, verbose=0).history
result = {"iterations": int(model.optimizer.iterations.numpy()),
          "splits": logs["ledger_splits"], "val_loss": logs["val_loss"],
          "evaluate": model.evaluate(data, verbose=0),
          "predicted": model.predict(data, verbose=0).shape[0]}
try:
    model.fit(stateful, epochs=1, verbose=0)
except ValueError as e:
    result["refused"] = str(e)
json.dump(result, open(sys.argv[1], "w"))
'''


def test_data_made_before_the_strategy_trains_or_is_refused_with_the_fix(tmp_path):
    """A script that builds its datasets first and the strategy later: a dataset made before
    the strategy connected to the cluster lives on a device the cluster's context no longer
    has. A pure pipeline is rebuilt on the chief (one-pass epochs, evaluate, predict); one
    with a lookup table of this process is refused, naming the fix."""
    script = tmp_path / "data_first.py"
    script.write_text(DATA_FIRST)
    proc, out, pids = run_and_watch([sys.executable, str(script), str(tmp_path / "r.json")])
    assert proc.returncode == 0, out[-4000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["iterations"] == 2 * 16  # 1,000 examples in batches of 64, twice, exactly
    assert result["splits"] == [4, 4] and len(result["val_loss"]) == 2
    assert result["predicted"] == 1000 and result["evaluate"] > 0
    assert result["refused"].startswith("`x` was made before the strategy connected")
    assert "Create the strategy first" in result["refused"]
    assert "function_node" not in result["refused"]
    assert len(pids) == 2 and helpers.wait_for_no_servers(pids, timeout=10) == []
