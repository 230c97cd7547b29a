"""Every listed bad input raises a clear error naming the argument, and runs nothing."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kfit_ps
from tests import helpers


@pytest.fixture
def model(strategy):
    with strategy.scope():
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        m.compile(optimizer="sgd", loss="mse")
    return m


def data():
    return kfit_ps.DatasetCreator(helpers.regression_dataset_fn())


def check(exc_info, *fragments):
    message = str(exc_info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_an_infinite_input_without_steps_per_epoch(model):
    # A finite input trains one pass per epoch (tests/test_data_ledger.py); a stream needs
    # `steps_per_epoch`.
    with pytest.raises(ValueError) as info:
        model.fit(data(), epochs=1)
    check(info, "`steps_per_epoch` is required", "Received: steps_per_epoch=None",
          "remove `.repeat()`")
    dataset = tf.data.Dataset.from_tensors((tf.ones((2, 4)), tf.ones((2, 1)))).repeat()
    with pytest.raises(ValueError) as info:
        model.fit(dataset, epochs=1)
    check(info, "`steps_per_epoch` is required")


@pytest.mark.parametrize("steps", [0, -3, 2.5, "10"])
def test_bad_steps_per_epoch(model, steps):
    with pytest.raises(ValueError) as info:
        model.fit(data(), epochs=1, steps_per_epoch=steps)
    check(info, "`steps_per_epoch` must be a positive integer", f"steps_per_epoch={steps!r}")


def test_evaluate_and_predict_on_infinite_input_without_steps(model):
    with pytest.raises(ValueError) as info:
        model.evaluate(data())
    check(info, "`steps` is required", "Received: steps=None")
    infinite = tf.data.Dataset.from_tensors(tf.ones((2, 4))).repeat()
    with pytest.raises(ValueError) as info:
        model.evaluate(infinite)
    check(info, "`steps` is required")
    with pytest.raises(ValueError) as info:
        model.predict(infinite)
    check(info, "`steps` is required")
    with pytest.raises(ValueError) as info:
        model.fit(data(), epochs=1, steps_per_epoch=2, validation_data=data())
    check(info, "`validation_steps` is required")


def test_non_callable_dataset_fn():
    with pytest.raises(ValueError) as info:
        kfit_ps.DatasetCreator([1, 2, 3])
    check(info, "`dataset_fn` must be a callable", "Received: dataset_fn=[1, 2, 3]")


def test_dataset_fn_returning_no_dataset(model):
    def dataset_fn(input_context):
        return np.ones((4, 4))

    with pytest.raises(ValueError) as info:
        model.fit(kfit_ps.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=2)
    check(info, "`dataset_fn` (dataset_fn) must return a tf.data.Dataset", "ndarray")


def test_run_eagerly(strategy):
    with strategy.scope():
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        m.compile(optimizer="sgd", loss="mse", run_eagerly=True)
    with pytest.raises(ValueError) as info:
        m.fit(data(), epochs=1, steps_per_epoch=2)
    check(info, "run_eagerly=True", "run_eagerly=False")


@pytest.mark.parametrize("bad", ["a string", {"a", "set"}, object(), [object()]])
def test_unsupported_input_type_lists_supported_inputs(model, bad):
    with pytest.raises(ValueError) as info:
        model.fit(bad, epochs=1, steps_per_epoch=2)
    check(info, "does not support `x`", "DatasetCreator", "tf.data.Dataset", "numpy")


def test_fit_in_scope_on_model_built_outside(strategy):
    outside = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    outside.compile(optimizer="sgd", loss="mse")
    with strategy.scope():
        with pytest.raises(ValueError) as info:
            outside.fit(data(), epochs=1, steps_per_epoch=2)
    check(info, "created outside the kfit_ps strategy scope", "with strategy.scope():",
          "/job:chief")


def test_a_preprocessing_layer_adapted_before_the_scope_is_refused_at_fit_start(strategy):
    """Its state lives on the chief: refused when `fit` starts (not after training), naming
    the variable and saying to adapt it under the scope."""
    norm = keras.layers.Normalization()
    norm.adapt(np.ones((8, 4), "float32"))
    with strategy.scope():
        inputs = keras.Input((4,))
        model = keras.Model(inputs, keras.layers.Dense(1)(norm(inputs)))
        model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError) as info:
        model.fit(np.ones((8, 4), "float32"), np.ones((8, 1), "float32"), epochs=1, verbose=0)
    check(info, "variable 'normalization", "/mean' was created outside the kfit_ps strategy "
          "scope", "make and `adapt()` that layer under the scope too")


def test_other_unsupported_fit_arguments(model):
    x, y = helpers.regression_arrays(rows=10)
    with pytest.raises(ValueError) as info:
        model.fit(x, y, validation_split=1.5)
    check(info, "`validation_split` must be a float between 0 and 1", "validation_split=1.5")
    with pytest.raises(ValueError) as info:
        model.fit(data(), steps_per_epoch=2, validation_split=0.2)
    check(info, "`validation_split` is only supported for arrays", "DatasetCreator",
          "`validation_data`")
    with pytest.raises(ValueError) as info:
        model.fit(x, y, class_weight={0: 1.0}, sample_weight=np.ones(10))
    check(info, "`class_weight` and `sample_weight` at the same time")
    with pytest.raises(ValueError) as info:
        model.fit(x, y, class_weight=[1.0, 2.0])
    check(info, "`class_weight` must be a dict", "class_weight=[1.0, 2.0]")
    with pytest.raises(ValueError) as info:
        model.fit(data(), y, steps_per_epoch=2)
    check(info, "`y` must be None when `x` is a DatasetCreator")
    with pytest.raises(ValueError) as info:
        model.fit(x, y, verbose=3)
    check(info, "`verbose`", "verbose=3")
    with pytest.raises(ValueError) as info:
        model.fit(x, y, batch_size=0)
    check(info, "`batch_size`", "batch_size=0")
    with pytest.raises(ValueError) as info:
        model.fit(x, y[:5])
    check(info, "same number of rows")


def test_fit_before_compile(strategy):
    with strategy.scope():
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError) as info:
        m.fit(data(), epochs=1, steps_per_epoch=2)
    check(info, "call `compile()` before `fit()`")


def test_use_ema_trains_on_two_workers_with_overwrites(strategy):
    """Once refused (Keras' overwrite runs in a conditional strategies reject): kfit_ps now
    updates the averages and overwrites the weights itself (tests/test_sparse_options.py
    compares them with Keras)."""
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.002, use_ema=True, ema_overwrite_frequency=1),
                      "mse")
    model.fit(data(), epochs=1, steps_per_epoch=4, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 4
    averages = model.optimizer._model_variables_moving_average
    for weight, average in zip(model.trainable_weights, averages):
        np.testing.assert_array_equal(weight.numpy(), average.numpy())


def test_workers_with_several_replicas_are_refused():
    from kfit_ps.strategy.strategy import check_one_replica_per_worker

    check_one_replica_per_worker(1)
    with pytest.raises(ValueError) as e:
        check_one_replica_per_worker(2)
    check(e, "2 replicas each", "num_replicas_in_sync=2", "CUDA_VISIBLE_DEVICES")


def test_strategy_on_cpu_workers_has_one_replica(strategy):
    assert strategy.num_replicas_in_sync == 1  # what the check above is applied to


def test_a_remote_error_without_recorded_stacks_keeps_tensorflows_first_line():
    """TensorFlow sometimes writes "<stack traces unavailable>" where a node's "defined at"
    listing goes (seen under load); the condensed error still names the root error's text."""
    import tensorflow as tf

    from kfit_ps.training import user_errors

    listing = ("Detected at node assert_less/Assert defined at (most recent call last):\n"
               "<stack traces unavailable>\n")
    message = ("Graph execution error:\n\n" + listing * 2 + "2 root error(s) found.\n"
               "  (0) INVALID_ARGUMENT: bad batch\n\t [[{{node assert_less/Assert}}]]\n"
               "  (1) INVALID_ARGUMENT: bad batch\n"
               "Additional GRPC error information from remote target "
               "/job:worker/replica:0/task:1 while calling /tensorflow.eager.EagerService")
    error = user_errors.condensed(tf.errors.InvalidArgumentError(None, None, message))
    assert type(error) is tf.errors.InvalidArgumentError
    assert error.message == "A step failed on worker:1: bad batch\n  at node assert_less/Assert"


def test_a_restarted_tasks_lost_context_is_a_cluster_failure_others_are_the_programs():
    """A ps its host's launcher brought back under the chief: a read outside `fit` fails
    with TensorFlow's AbortedError for the lost remote context, which exits 75 (the job
    restarts) like an unreachable task; other AbortedErrors stay the program's."""
    from kfit_ps import errors

    lost = tf.errors.AbortedError(None, None, "Unable to find a context_id matching the "
                                  "specified one (123). Perhaps the worker was restarted, or "
                                  "the context was GC'd? [Op:ReadVariableOp]")
    assert errors.is_cluster_failure(lost)
    assert errors.is_cluster_failure(tf.errors.UnavailableError(None, None, "ps:0 down"))
    assert not errors.is_cluster_failure(tf.errors.AbortedError(None, None, "a queue closed"))
    assert not errors.is_cluster_failure(ValueError("the user's own"))
