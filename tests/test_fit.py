"""Parameter-server fit / evaluate / predict on a real 2-worker, 2-ps cluster."""

import contextlib
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import kfit_ps
from tests import helpers


def compiled_model(strategy, kind="sequential", steps_per_execution=1, metrics=None,
                   optimizer="sgd", features=4):
    with strategy.scope():
        if kind == "sequential":
            model = keras.Sequential([keras.Input((features,)),
                                      keras.layers.Dense(8, activation="relu"),
                                      keras.layers.Dense(1)])
        elif kind == "functional":
            inputs = keras.Input((features,))
            hidden = keras.layers.Dense(8, activation="relu")(inputs)
            model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
        else:
            class Subclassed(keras.Model):
                def __init__(self):
                    super().__init__()
                    self.hidden = keras.layers.Dense(8, activation="relu")
                    self.out = keras.layers.Dense(1)

                def call(self, x):
                    return self.out(self.hidden(x))

            model = Subclassed()
        model.compile(optimizer=optimizer() if callable(optimizer) else optimizer, loss="mse",
                      metrics=[helpers.counting_metric()] + (metrics() if metrics else []),
                      steps_per_execution=steps_per_execution)
    return model


def test_fit_learns_a_dataset_creators_spec_from_a_trace_not_an_eager_call(strategy):
    """Built eagerly, the dataset's functions would be registered with every server per `fit`."""
    base = helpers.regression_dataset_fn()
    eagerly = []

    def recording_fn(input_context):
        eagerly.append(tf.executing_eagerly())
        return base(input_context)

    offset = tf.constant(1.0)  # an eager tensor: a plain graph cannot capture it

    def capturing_fn(input_context):
        return base(input_context).map(lambda x, y: (x, y + offset))

    model = compiled_model(strategy)
    model.fit(kfit_ps.DatasetCreator(recording_fn), epochs=1, steps_per_epoch=4, verbose=0)
    assert eagerly and not any(eagerly), eagerly  # the coordinator's trace, the workers' function
    history = model.fit(kfit_ps.DatasetCreator(capturing_fn), epochs=1, steps_per_epoch=4,
                        verbose=0)  # the spec then comes from an eager call, as before
    assert history.history["batches"] == [4.0]
    assert int(model.optimizer.iterations.numpy()) == 8


# 5: steps unrolled in one function; 12: a loop (functions.MAX_UNROLLED_STEPS is 10).
@pytest.mark.parametrize("steps_per_execution", [1, 5, 12])
def test_counts_are_exact(strategy, steps_per_execution):
    assert 5 <= kfit_ps.training.step.functions.MAX_UNROLLED_STEPS < 12
    model = compiled_model(strategy, steps_per_execution=steps_per_execution)
    vx, vy = helpers.regression_arrays(rows=64)
    val = kfit_ps.DatasetCreator(helpers.regression_dataset_fn())
    history = model.fit(kfit_ps.DatasetCreator(helpers.regression_dataset_fn()), epochs=3,
                        steps_per_epoch=20, validation_data=val, validation_steps=7,
                        verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 60
    assert history.history["batches"] == [20.0, 20.0, 20.0]
    assert history.history["val_batches"] == [7.0, 7.0, 7.0]
    assert history.epoch == [0, 1, 2]
    for values in history.history.values():
        assert all(type(v) is float for v in values)
    # Shipped (numpy) validation: every batch exactly once.
    history = model.fit(kfit_ps.DatasetCreator(helpers.regression_dataset_fn()), epochs=1,
                        steps_per_epoch=3, validation_data=(vx, vy), validation_batch_size=10,
                        verbose=0)
    assert history.history["val_batches"] == [7.0]
    assert int(model.optimizer.iterations.numpy()) == 63


@pytest.mark.parametrize("k, loops", [(5, False), (np.int64(5), False), (12, True),
                                      (tf.constant(3, tf.int64), True)])
def test_a_functions_steps_are_unrolled_up_to_the_limit_and_a_graph_loop_beyond(k, loops):
    """A numpy step count (Keras keeps `steps_per_execution` as given) unrolls as an int does;
    a graph loop (a distributed while loop, slower) only past `MAX_UNROLLED_STEPS` or for a
    tensor count."""
    from kfit_ps.training.step import functions

    run = tf.function(lambda: functions._repeat(k, lambda i, n: n + 1, tf.constant(0, tf.int64)),
                      autograph=False)
    ops = run.get_concrete_function().graph.get_operations()
    assert any(op.type in ("While", "StatelessWhile") for op in ops) == loops
    assert int(run()) == int(k)


def test_metric_results_are_folded_during_the_epoch_and_stay_exact(strategy, monkeypatch):
    monkeypatch.setenv(kfit_ps.constants.METRIC_RESULTS_PENDING_ENV, "3")
    model = compiled_model(strategy, steps_per_execution=2,
                           metrics=lambda: [keras.metrics.MeanAbsoluteError(name="mae")])
    folded = []
    stock_fold = kfit_ps.training.step.metric_state.Accumulator._fold_one

    def counting_fold(self, remote):
        folded.append(len(self._pending))
        return stock_fold(self, remote)

    monkeypatch.setattr(kfit_ps.training.step.metric_state.Accumulator, "_fold_one", counting_fold)
    history = model.fit(kfit_ps.DatasetCreator(helpers.regression_dataset_fn()), epochs=2,
                        steps_per_epoch=41, verbose=0)
    assert history.history["batches"] == [41.0, 41.0]  # 21 functions per epoch, each once
    assert int(model.optimizer.iterations.numpy()) == 82
    # Folded while scheduling (3 pending kept), the rest after each epoch's join.
    assert folded.count(3) == 2 * (21 - 3)
    assert len(folded) == 2 * 21


@pytest.mark.parametrize("kind", ["sequential", "functional", "subclassed"])
def test_model_kinds_learn(strategy, kind):
    model = compiled_model(strategy, kind=kind, optimizer=lambda: keras.optimizers.Adam(0.02))
    history = model.fit(kfit_ps.DatasetCreator(helpers.regression_dataset_fn()), epochs=4,
                        steps_per_epoch=25, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < losses[0] * 0.5, losses
    assert int(model.optimizer.iterations.numpy()) == 100
    # All state lives on the ps tasks.
    for v in model.variables + model.optimizer.variables + model.metrics_variables:
        assert kfit_ps._tf_compat.storage(v).device.startswith("/job:ps/")


def test_numpy_and_dataset_inputs(strategy):
    model = compiled_model(strategy)
    x, y = helpers.regression_arrays(rows=100)
    history = model.fit(x, y, batch_size=10, epochs=2, verbose=0)
    assert history.history["batches"] == [10.0, 10.0]  # ceil(100 / 10) steps per epoch
    weights = np.ones((100, 1), "float32")
    history = model.fit(x, y, sample_weight=weights, batch_size=25, epochs=1,
                        steps_per_epoch=6, verbose=0)
    assert history.history["batches"] == [6.0]
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(20)  # finite: repeated
    history = model.fit(dataset, epochs=2, steps_per_epoch=8, verbose=0)
    assert history.history["batches"] == [8.0, 8.0]
    assert int(model.optimizer.iterations.numpy()) == 20 + 6 + 16


def test_evaluate_returns_what_keras_returns(strategy):
    model = compiled_model(strategy, metrics=lambda: [keras.metrics.MeanAbsoluteError(name="mae")])
    x, y = helpers.regression_arrays(rows=95)
    result = model.evaluate(x, y, batch_size=10, verbose=0)
    assert isinstance(result, list) and len(result) == 3
    logs = model.evaluate(x, y, batch_size=10, verbose=0, return_dict=True)
    assert logs["batches"] == 10.0  # ceil(95 / 10), each batch exactly once
    assert set(logs) == {"loss", "batches", "mae"}
    # Same numbers as single-machine Keras with the same weights.
    reference = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(1)])
    reference.compile(loss="mse", metrics=[keras.metrics.MeanAbsoluteError(name="mae")])
    reference.set_weights(model.get_weights())
    expected = reference.evaluate(x, y, batch_size=10, verbose=0, return_dict=True)
    assert logs["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert logs["mae"] == pytest.approx(expected["mae"], rel=1e-5)
    # Steps from per-worker input.
    logs = model.evaluate(kfit_ps.DatasetCreator(helpers.regression_dataset_fn()), steps=9,
                          verbose=0, return_dict=True)
    assert logs["batches"] == 9.0
    logs = model.evaluate(x, y, batch_size=10, steps=4, verbose=0, return_dict=True)
    assert logs["batches"] == 4.0


def test_single_output_evaluate_is_a_scalar(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    x, y = helpers.regression_arrays(rows=20)
    assert isinstance(model.evaluate(x, y, verbose=0), float)


def test_predict_equals_single_machine_keras(strategy):
    model = compiled_model(strategy, kind="functional")
    model.fit(kfit_ps.DatasetCreator(helpers.regression_dataset_fn()), epochs=1,
              steps_per_epoch=5, verbose=0)
    x, _ = helpers.regression_arrays(rows=70, seed=3)
    predictions = model.predict(x, batch_size=16, verbose=0)
    inputs = keras.Input((4,))
    reference = keras.Model(inputs, keras.layers.Dense(1)(
        keras.layers.Dense(8, activation="relu")(inputs)))
    reference.set_weights(model.get_weights())
    expected = reference.predict(x, batch_size=16, verbose=0)
    assert predictions.shape == (70, 1)
    np.testing.assert_allclose(predictions, expected, rtol=1e-6, atol=1e-6)
    ordered = model.predict(tf.data.Dataset.from_tensor_slices(x).batch(16), verbose=0)
    np.testing.assert_allclose(ordered, expected, rtol=1e-6, atol=1e-6)
    from_workers = model.predict(kfit_ps.DatasetCreator(
        lambda ctx: tf.data.Dataset.from_tensor_slices(x).repeat().batch(10)), steps=3,
        verbose=0)
    assert from_workers.shape == (30, 1)


def test_models_outside_kfit_keep_stock_keras(strategy):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = helpers.regression_arrays(rows=32)
    history = model.fit(x, y, epochs=2, batch_size=8, verbose=0)
    assert len(history.history["loss"]) == 2
    assert int(model.optimizer.iterations.numpy()) == 8
    assert model.train_function is not None and not isinstance(
        model.train_function, kfit_ps.training.step.functions.ScheduledFunctions)
    assert model.variables[0].value.device.endswith("CPU:0")
    assert "/job:ps" not in model.variables[0].value.device


def test_a_custom_step_runs_as_plain_python_as_in_keras(strategy):
    """Keras 3 traces `train_step` without autograph (`do_not_convert`), and so does kfit_ps: a
    step that branches on a Python value trains; one that branches on a tensor fails with the
    error single-process Keras raises."""

    def model_with(step_body):
        class Stepping(keras.Sequential):
            def train_step(self, data):
                return step_body(self, data)

        model = Stepping([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        return model

    def python_branch(model, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = model.compute_loss(x, y, model(x, training=True))
        if model.trainable:  # a Python bool: a branch of the trace
            model.optimizer.apply(tape.gradient(loss, model.trainable_variables),
                                  model.trainable_variables)
        return {"loss": loss}

    def tensor_branch(model, data):
        if tf.reduce_sum(data[1]) > 0:  # a tensor in `if`: plain Python cannot branch on it
            return {"loss": tf.constant(0.0)}
        return {"loss": tf.constant(1.0)}

    x, y = helpers.regression_arrays(rows=32)
    with strategy.scope():
        model = model_with(python_branch)
    model.fit(x, y, epochs=1, batch_size=8, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 4
    with pytest.raises(tf.errors.OperatorNotAllowedInGraphError) as local:
        model_with(tensor_branch).fit(x, y, epochs=1, batch_size=8, verbose=0)
    with strategy.scope():
        model = model_with(tensor_branch)
    with pytest.raises(tf.errors.OperatorNotAllowedInGraphError) as distributed:
        model.fit(x, y, epochs=1, batch_size=8, verbose=0)
    assert str(distributed.value) == str(local.value), (distributed.value, local.value)


def test_recompile_retraces(strategy):
    model = compiled_model(strategy, steps_per_execution=2)
    fit_args = dict(x=kfit_ps.DatasetCreator(helpers.regression_dataset_fn()), epochs=1,
                    steps_per_epoch=5, verbose=0)
    model.fit(**fit_args)
    first = model.train_function
    model.fit(**fit_args)
    assert model.train_function is first  # traced functions are reused
    with strategy.scope():
        model.compile(optimizer="sgd", loss="mae", metrics=[helpers.counting_metric()],
                      steps_per_execution=3)
    history = model.fit(**fit_args)
    assert model.train_function is not first
    assert history.history["batches"] == [5.0]


def test_initial_epoch_and_zero_epochs(strategy):
    model = compiled_model(strategy)
    history = model.fit(kfit_ps.DatasetCreator(helpers.regression_dataset_fn()), epochs=3,
                        initial_epoch=1, steps_per_epoch=4, verbose=0)
    assert history.epoch == [1, 2]
    assert int(model.optimizer.iterations.numpy()) == 8
    assert math.isfinite(history.history["loss"][-1])


@pytest.mark.slow
def test_step_error_surfaces_and_stops_progress_polling():
    # A fresh chief: after a failed step TensorFlow's coordinator keeps the cancelled
    # closures (and their functions) for the life of the process.
    result = helpers.run_chief("""
        import threading
        from tests import helpers as h
        def failing_dataset(ctx):
            def check(x, y):
                tf.debugging.assert_less(tf.reduce_sum(x), -1e9, message="bad batch")
                return x, y
            return tf.data.Dataset.from_tensors((tf.ones((8, 4)), tf.ones((8, 1)))).repeat(
                ).map(check)
        with kfit_ps.LocalCluster(num_workers=2, num_ps=1) as cluster:
            strategy = kfit_ps.ParameterServerStrategy(cluster.cluster_resolver)
            with strategy.scope():
                model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
                model.compile(optimizer="sgd", loss="mse", metrics=[h.counting_metric()])
            try:
                model.fit(kfit_ps.DatasetCreator(failing_dataset), epochs=1, steps_per_epoch=5,
                          verbose=1)
                error = None
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
            pollers = [t.name for t in threading.enumerate() if t.name == "kfit_ps-progress"]
            history = model.fit(kfit_ps.DatasetCreator(h.regression_dataset_fn()), epochs=1,
                                steps_per_epoch=4, verbose=0)
            report(error=error, pollers=pollers, batches=history.history["batches"])
        os._exit(0)
    """)
    assert result["error"].startswith("InvalidArgumentError") and "bad batch" in result["error"]
    assert result["pollers"] == []
    assert result["batches"] == [4.0]  # the strategy stays usable after a failed fit


def test_a_stuck_progress_poll_does_not_hang_the_epoch_end(monkeypatch, caplog, capsys):
    """The progress thread's read of `iterations` can hang on a dead ps: joining it is bounded."""
    import threading
    import time

    from kfit_ps.training import progress

    monkeypatch.setattr(progress, "_JOIN_SECONDS", 0.5)
    stuck = threading.Event()
    release = threading.Event()

    def counter():
        stuck.set()
        release.wait(30)  # like an RPC to a ps that never answers
        return 5

    bar = progress.Progress(verbose=1, epochs=1, steps=10)
    monkeypatch.setattr("kfit_ps.constants.progress_interval", lambda: 0.01)
    bar.epoch_begin(0, counter)
    assert stuck.wait(10)
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="kfit_ps"):
        bar.epoch_end({"loss": 1.0})
    assert time.monotonic() - started < 5
    assert "did not return" in caplog.text
    release.set()
    assert "10/10" in capsys.readouterr().out


def _classifier(learning_rate, strategy=None):
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, activation="sigmoid")])
        model.compile(keras.optimizers.SGD(learning_rate), "binary_crossentropy",
                      metrics=["accuracy"], weighted_metrics=["accuracy"])
    return model


def test_class_weight_and_validation_split_as_keras_means_them(strategy):
    """`class_weight` (Keras' per-example weights from the labels) and `validation_split`
    (the last rows, before shuffling) give the History single-process Keras gives: the same
    keys, and with a learning rate of 0 the same values; with training, a learning model.
    The same weights reach a tf.data.Dataset and a DatasetCreator's dataset."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 4)).astype("float32")
    y = (x[:, :1] + 0.3 * rng.normal(size=(400, 1)) > 0.8).astype("float32")  # imbalanced
    class_weight = {0: 0.3, 1: 2.5}
    frozen, reference = _classifier(0.0, strategy), _classifier(0.0)
    reference.set_weights(frozen.get_weights())
    arguments = dict(batch_size=20, epochs=2, verbose=0, class_weight=class_weight,
                     validation_split=0.2)
    ours = frozen.fit(x, y, **arguments).history
    keras_ = reference.fit(x, y, **arguments).history
    assert {k for k in ours if not k.startswith("ledger_")} == set(keras_)  # + one-pass figures
    for key in keras_:
        np.testing.assert_allclose(ours[key], keras_[key], rtol=1e-5, err_msg=key)
    assert ours["loss"][0] != pytest.approx(frozen.evaluate(x[:320], y[:320], verbose=0)[0])

    def one_batch(context=None):
        return tf.data.Dataset.from_tensor_slices((x[:40], y[:40])).batch(40)

    expected = reference.evaluate(x[:40], y[:40], verbose=0, return_dict=True,
                                  sample_weight=np.where(y[:40, 0] > 0, 2.5, 0.3))["loss"]
    from_dataset = frozen.fit(one_batch(), class_weight=class_weight, verbose=0).history
    from_creator = frozen.fit(kfit_ps.DatasetCreator(lambda context: one_batch().repeat()),
                              steps_per_epoch=6, class_weight=class_weight, verbose=0).history
    np.testing.assert_allclose([from_dataset["loss"][0], from_creator["loss"][0]],
                               [expected, expected], rtol=1e-5)

    learning = _classifier(0.5, strategy)
    history = learning.fit(x, y, **dict(arguments, epochs=4)).history
    assert {k for k in history if not k.startswith("ledger_")} == set(keras_)
    assert history["val_loss"][-1] < history["val_loss"][0]


def test_a_long_window_keeps_no_finished_functions_results(strategy, monkeypatch):
    """1,200 steps with no synchronisation in between: the chief holds the results not yet
    folded (at most KFIT_PS_METRIC_RESULTS_PENDING, here 64) and those of the functions in
    flight, not of every function the window scheduled (it held all of them, ~13 KB a step
    with an AUC metric, until the window's end)."""
    import gc

    monkeypatch.setenv("KFIT_PS_METRIC_RESULTS_PENDING", "64")

    from tensorflow.python.distribute.coordinator import remote_value  # the public interface

    live = []

    class Count(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1000:
                gc.collect()
                live.append(sum(isinstance(o, remote_value.RemoteValue)
                                for o in gc.get_objects()))

    model = compiled_model(strategy)
    model.fit(kfit_ps.DatasetCreator(helpers.regression_dataset_fn()), epochs=1,
              steps_per_epoch=1200, verbose=0, callbacks=[Count()])
    assert live and live[0] < 700, live
