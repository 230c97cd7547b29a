"""The private-API gate: every private TF/Keras use, checked against the installed versions."""

import os
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.backend.tensorflow import core as keras_tf_core
from keras.src.backend.tensorflow import trainer as keras_tf_trainer

from kfit_ps import _tf_compat
from tests import helpers
from kfit_ps._tf_compat import keras_trainer, versions


def test_versions_are_supported_and_guarded(monkeypatch):
    _tf_compat.check_versions()
    monkeypatch.setattr(tf, "__version__", "2.99.0")
    with pytest.raises(ImportError, match="tensorflow >=2.21,<2.22"):
        _tf_compat.check_versions()


def test_pyproject_pins_match_the_guard():
    text = open(f"{__import__('tests.helpers').helpers.ROOT}/pyproject.toml").read()
    for name, (low, high) in versions.SUPPORTED.items():
        assert f'"{name}>={low[0]}.{low[1]},<{high[0]}.{high[1]}"' in text


def test_private_keras_attributes_still_exist():
    assert hasattr(keras_tf_core.Variable, "_initialize")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(loss="mse")
    for name in ("_symbolic_build", "_flatten_metrics_in_order", "_distribute_strategy",
                 "_initial_epoch"):
        assert hasattr(model, name), name
    v = keras.Variable(1.0)
    assert isinstance(_tf_compat.storage(v), tf.Variable)


def test_atomic_updates_install_once_and_keep_stock_behaviour_elsewhere():
    _tf_compat.install_atomic_updates()
    _tf_compat.install_atomic_updates()
    method = keras_tf_core.Variable.assign_add
    assert hasattr(method, "_kfit_ps_stock")
    assert not hasattr(method._kfit_ps_stock, "_kfit_ps_stock")  # wrapped exactly once
    plain = keras.Variable(1.0)
    assert not _tf_compat.is_kfit_variable(plain)
    result = plain.assign_add(2.0)  # stock: returns the new value
    assert float(result) == 3.0
    marked = tf.Variable(1.0)
    _tf_compat.mark_kfit_variable(marked)
    assert _tf_compat.is_kfit_variable(marked)


def test_an_executor_whose_task_was_lost_ends_quietly_and_others_as_before():
    """`Executor.__del__` raised the lost task's gRPC error from its wait ("Exception ignored
    in", a wall of gRPC text after a SIGSTOPped ps was killed): it is dropped."""
    import gc

    from tensorflow.python.eager.executor import Executor

    for _ in range(2):
        _tf_compat.install_quiet_executor_teardown()
    assert hasattr(Executor.__del__, "_kfit_ps_stock")
    assert not hasattr(Executor.__del__._kfit_ps_stock, "_kfit_ps_stock")
    waited = []

    class LostTask(Executor):
        def wait(self):
            waited.append(self)
            raise tf.errors.UnavailableError(None, None, "recvmsg:Connection reset by peer")

    LostTask(None).__del__()  # Raised UnavailableError before.
    assert len(waited) == 1
    from tensorflow.python.eager import executor as executors

    real = executors.new_executor(enable_async=True)  # Waited for and deleted as before.
    del real
    gc.collect()


def test_stateful_layer_hooks_exist_and_keep_stock_keras_outside_a_kfit_ps_scope():
    import inspect

    from keras.src.layers.normalization.batch_normalization import BatchNormalization
    from keras.src.random.seed_generator import SeedGenerator

    for _ in range(2):
        _tf_compat.install_atomic_updates()
        _tf_compat.install_exact_batch_norm()
        _tf_compat.install_exact_seed_generator()
    for method in (BatchNormalization.call, BatchNormalization._moments, SeedGenerator.next,
                   keras_tf_core.Variable.assign):
        assert hasattr(method, "_kfit_ps_stock")
        assert not hasattr(method._kfit_ps_stock, "_kfit_ps_stock")  # wrapped exactly once
    layer = keras.layers.BatchNormalization(momentum=0.9, renorm=True)
    layer.build((None, 2))
    for name in ("moving_mean", "moving_variance", "moving_stddev", "renorm_mean",
                 "renorm_stddev", "momentum", "renorm_momentum", "epsilon", "renorm"):
        assert hasattr(layer, name), name
    assert list(inspect.signature(layer.call).parameters) == ["inputs", "training", "mask"]
    x = np.array([[1.0, 2.0], [3.0, 6.0]], "float32")  # mean [2, 4], variance [1, 4]
    plain = keras.layers.BatchNormalization(momentum=0.9)
    plain(x, training=True)
    np.testing.assert_allclose(plain.moving_mean.numpy(), [0.2, 0.4], rtol=1e-6)
    np.testing.assert_allclose(plain.moving_variance.numpy(), [1.0, 1.3], rtol=1e-6)
    seeds = keras.random.SeedGenerator(5)
    assert seeds.next().numpy().tolist() == [5, 0]
    assert seeds.state.numpy().tolist() == [5, 1]
    with _tf_compat.redirected_assigns({id(plain.moving_mean): lambda value: 1 / 0}):
        plain.moving_mean.assign([1.0, 1.0])  # not a kfit_ps variable: stock assign
    assert plain.moving_mean.numpy().tolist() == [1.0, 1.0]


def test_dispatch_routes_only_matching_models():
    calls = []
    keras_trainer.install_dispatch("test", lambda m: getattr(m, "_route_me", False),
                                   fit=lambda m, *a, **k: calls.append("fit") or "routed",
                                   evaluate=None, predict=None)
    try:
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        model._route_me = True
        assert model.fit() == "routed" and calls == ["fit"]
        model._route_me = False
        import numpy as np

        history = model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)
        assert len(history.history["loss"]) == 1
        assert keras_trainer.stock_method("fit") is not keras_tf_trainer.TensorFlowTrainer.fit
    finally:
        keras_trainer._handlers.pop("test")


def test_symbolic_build_from_specs_and_metric_order():
    model = keras.Sequential([keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    spec = (tf.TensorSpec((None, 3)), tf.TensorSpec((None, 1)))
    _tf_compat.symbolic_build(model, spec)
    assert model.built and model.optimizer.built and len(model.metrics_variables) > 0
    assert _tf_compat.flatten_metrics_in_order(model, {"mae": 2.0, "loss": 1.0}) == [1.0, 2.0]
    assert _tf_compat.initial_epoch_override(model) is None
    assert _tf_compat.model_strategy(model) is None


def test_forget_servers_ignores_clusters_this_process_is_not_connected_to():
    # This test process may be connected to the session cluster; these addresses are not in it.
    assert _tf_compat.forget_servers(["localhost:1", "localhost:2"]) is False


def test_local_state_scope_keeps_only_the_mapped_variables_local():
    metric = keras.metrics.Mean()
    kept = keras.Variable(0.0, name="kept")
    counter = keras.Variable(0, dtype="int64", name="counter")
    regularized = keras.layers.Dense(1, kernel_regularizer="l2")
    regularized.build((None, 2))
    _tf_compat.mark_kfit_variable(_tf_compat.storage(counter))

    @tf.function
    def step(state):
        with _tf_compat.LocalStateScope(list(zip(metric.variables, state))) as scope:
            metric.update_state(4.0)
            kept.assign(7.0)  # not mapped: written through
            counter.assign_add(1)  # marked, not mapped: the atomic in-place op
            losses = regularized.losses  # regularizers read the real kernel
        return [scope.get_current_value(v) for v in metric.variables], len(losses)

    state, n_losses = step([tf.constant(1.0), tf.constant(1.0)])
    assert [float(v) for v in state] == [5.0, 2.0]  # 1 + 4, 1 + 1: local values
    assert [float(v.numpy()) for v in metric.variables] == [0.0, 0.0]  # untouched
    assert float(kept.numpy()) == 7.0 and int(counter.numpy()) == 1
    assert int(n_losses) == 1
    assert _tf_compat.metric_scope.writes_through(kept)


def test_private_apis_of_the_sharding_support_still_exist():
    from keras.src.backend.tensorflow import numpy as keras_tf_numpy
    from keras.src.backend.tensorflow import optimizer as keras_tf_optimizer
    from tensorflow.python.distribute.sharded_variable import ShardedVariable

    from kfit_ps._tf_compat import keras_sharding

    assert hasattr(ShardedVariable, "variables")
    for name in ("_initialize_with_initializer", "_map_aggregation", "_map_synchronization",
                 "_serialize_to_tensors", "_restore_from_tensors", "__array__"):
        assert hasattr(keras_tf_core.Variable, name), name
    assert hasattr(keras_tf_optimizer.TFOptimizer, "add_variable_from_reference")
    assert callable(keras_tf_numpy.take)
    variables = [keras.Variable(tf.zeros((3, 2)))]
    for optimizer, slots in [(keras.optimizers.Adam(amsgrad=True), {"m", "v", "v_hat"}),
                             (keras.optimizers.Adagrad(), {"accumulator"}),
                             (keras.optimizers.SGD(momentum=0.5), {"momentum"}),
                             (keras.optimizers.SGD(), set()),
                             (keras.optimizers.RMSprop(), None)]:
        optimizer.build(variables)
        found = _tf_compat.optimizer_slots(optimizer, variables[0])
        assert (None if found is None else set(found)) == slots
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(loss="mse")
    for name in ("_compute_loss", "_loss_tracker", "_call_has_training_arg"):
        assert hasattr(model, name), name
    assert _tf_compat.has_stock_train_step(model)
    assert keras_sharding.variable_partitioner(tf.distribute.get_strategy()) is None


def test_private_apis_of_this_issue_still_exist():
    """Sharded initial values, weight decay, predict-only build, Keras' monitor direction,
    io_utils output and the coordinator internals `forget_servers` quiesces."""
    import inspect

    from keras.src.backend.tensorflow import optimizer as keras_tf_optimizer
    from keras.src.initializers.random_initializers import compute_fans
    from tensorflow.python.distribute.coordinator import cluster_coordinator

    assert compute_fans((4, 6), input_axes=None, output_axes=None) == (4, 6)
    for name in ("mode", "scale", "input_axes", "output_axes", "seed"):
        assert hasattr(keras.initializers.GlorotUniform(), name), name
    assert isinstance(keras.initializers.RandomUniform().seed, int)  # unseeded: a fixed int
    assert hasattr(keras_tf_optimizer.TFOptimizer, "_apply_weight_decay")
    assert hasattr(keras.optimizers.Nadam(), "_use_weight_decay")

    model = keras.Sequential([keras.layers.Dense(1)])
    _tf_compat.build_for_predict(model, tf.TensorSpec((None, 3)))
    assert model.built and model.variables[0].shape == (3, 1)

    model.compile(loss="mse", metrics=[keras.metrics.CosineSimilarity(), "mae"])
    model._symbolic_build(data_batch=(tf.TensorSpec((None, 3)), tf.TensorSpec((None, 1))))
    better = _tf_compat.improvement_test(model, "val_cosine_similarity", "auto")
    assert better(0.9, 0.5) and not better(0.5, 0.9)  # maximised, though not named "acc"
    assert _tf_compat.improvement_test(model, "mae", "auto")(0.1, 0.2)
    with pytest.raises(ValueError, match="mode='max'"):
        _tf_compat.improvement_test(model, "something_else", "auto")

    handler_attrs = inspect.getsource(cluster_coordinator.WorkerPreemptionHandler)
    for name in ("_cluster_update_lock", "_should_preemption_thread_run",
                 "_cluster_due_for_update_or_finish", "_preemption_handler_thread"):
        assert f"self.{name}" in handler_attrs, name
    cluster_source = inspect.getsource(cluster_coordinator.Cluster)
    for name in ("failure_handler", "workers", "closure_queue", "resource_cancellation_mgr"):
        assert f"self.{name}" in cluster_source, name
    # What `datasets.shard_dataset` rebuilds a coordinator-built dataset's copies with.
    from tensorflow.python.distribute import input_lib
    distributed_source = inspect.getsource(input_lib.DistributedDataset)
    for name in ("_cloned_datasets", "_input_workers", "_strategy", "_element_spec", "_options",
                 "_enable_get_next_as_optional"):
        assert f"self.{name}" in distributed_source, name
    assert "components=" in inspect.getsource(input_lib.DistributedDataset.__init__)
    assert "context.context().update_server_def" in handler_attrs
    # What `worker_set.resize_workers` (elastic workers) relies on.
    worker_source = inspect.getsource(cluster_coordinator.Worker)
    for name in ("_resource_tracking_lock", "def _register_resource", "def create_resource"):
        assert name in worker_source, name
    closure_source = inspect.getsource(cluster_coordinator.Closure)
    for name in ("self._function", "self._concrete_function", "self._args", "self._kwargs"):
        assert name in closure_source, name
    assert "self._num_workers = strategy._num_workers" in cluster_source
    assert "strategy._cluster_coordinator" in inspect.getsource(
        cluster_coordinator.ClusterCoordinator.__new__)
    from tensorflow.core.protobuf import tensorflow_server_pb2
    assert "cluster_device_filters" in tensorflow_server_pb2.ServerDef.DESCRIPTOR.fields_by_name
    # What `ps_restore` (in-place ps recovery) relies on.
    from keras.src.saving import saving_lib
    from tensorflow.python.distribute.coordinator import values as coordinator_values
    from tensorflow.python.ops import resource_variable_ops
    assert list(inspect.signature(
        resource_variable_ops._variable_handle_from_shape_and_dtype).parameters)[:5] == [
            "shape", "dtype", "shared_name", "name", "graph_mode"]
    variable_source = inspect.getsource(resource_variable_ops.BaseResourceVariable)
    for name in ("self._handle =", "self._cached_value =", "self._handle_name ="):
        assert name in variable_source, name
    assert "safe_get_h5_dataset(self._h5_entry_group, key)" in inspect.getsource(
        saving_lib.H5IOStore.__getitem__)
    remote_source = inspect.getsource(coordinator_values.RemoteValueImpl)
    assert "def _set_error" in remote_source and "self._error = error" in remote_source


def test_print_msg_honours_keras_interactive_logging(capsys):
    _tf_compat.print_msg("shown")
    keras.config.disable_interactive_logging()
    try:
        _tf_compat.print_msg("hidden")
    finally:
        keras.config.enable_interactive_logging()
    out = capsys.readouterr().out
    assert "shown" in out and "hidden" not in out


def test_cached_read_scope_reads_the_cache_and_writes_through():
    cached, other = keras.Variable(1.0), keras.Variable(5.0)
    with _tf_compat.CachedReadScope([(cached, tf.constant(10.0))]):
        assert float(cached.value) == 10.0
        assert float(other.value) == 5.0  # not cached: its real storage
        cached.assign(3.0)  # written through, and later reads in the scope see it
        assert float(cached.value) == 3.0
    assert float(cached.value) == 3.0
    metric, param = keras.Variable(0.0), keras.Variable(2.0)
    with _tf_compat.LocalStateScope([(metric, tf.constant(0.0))]) as outer:
        with _tf_compat.CachedReadScope([(param, tf.constant(7.0))]) as inner:
            assert inner.is_local(metric) and not inner.is_local(param)
            metric.assign(float(param.value))  # local to the outer scope
        assert float(outer.get_current_value(metric)) == 7.0
    assert float(metric.value) == 0.0 and float(param.value) == 2.0
    with keras.StatelessScope():
        with pytest.raises(RuntimeError, match="cannot nest in a Keras StatelessScope"):
            with _tf_compat.CachedReadScope([]):
                pass


@pytest.mark.parametrize("optimizer", [
    lambda: keras.optimizers.Adam(0.01),
    lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
])
def test_fused_adam_matches_keras_adam(optimizer):
    keras.utils.set_random_seed(1)
    kernel = keras.random.normal((5, 3))
    bias = keras.random.normal((3,))
    grads = [[keras.random.normal((5, 3)), keras.random.normal((3,))] for _ in range(4)]
    results = []
    for fused in (False, True):
        variables = [keras.Variable(kernel, name="kernel"), keras.Variable(bias, name="bias")]
        opt = optimizer()
        opt.build(variables)
        assert _tf_compat.can_fuse_adam(opt, variables)
        for step_grads in grads:
            if fused:
                scalars = (tf.convert_to_tensor(opt.learning_rate),
                           tf.cast(opt.iterations, tf.float32) + 1.0)
                _tf_compat.apply_adam(opt, step_grads, variables, lambda device: scalars)
            else:
                opt.apply(step_grads, variables)
        results.append(([v.numpy() for v in variables], int(opt.iterations.numpy())))
    (stock, stock_steps), (fused, fused_steps) = results
    assert stock_steps == fused_steps == 4
    for a, b in zip(stock, fused):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_fused_adam_declines_what_it_does_not_compute():
    variables = [keras.Variable(tf.ones((2,)))]
    for opt in (keras.optimizers.Adam(amsgrad=True), keras.optimizers.Adam(clipnorm=1.0),
                keras.optimizers.Adam(gradient_accumulation_steps=2), keras.optimizers.SGD(),
                keras.optimizers.Nadam()):
        assert not _tf_compat.can_fuse_adam(opt, variables), opt
    overwritten = keras.Variable(tf.ones((2,)))
    overwritten.overwrite_with_gradient = True
    assert not _tf_compat.can_fuse_adam(keras.optimizers.Adam(), [overwritten])


def test_shard_dataset_puts_every_element_in_exactly_one_shard(tmp_path):
    files = []
    for i in range(3):
        files.append(str(tmp_path / f"part-{i}.txt"))
        with open(files[-1], "w") as f:
            f.write("".join(f"{i * 100 + j}\n" for j in range(20)))
    from_files = tf.data.TextLineDataset(tf.data.Dataset.from_tensor_slices(files)).map(
        lambda line: tf.strings.to_number(line, tf.int64)).batch(4)
    in_memory = tf.data.Dataset.range(103).batch(4)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    policy = tf.data.experimental.AutoShardPolicy
    cases = [(in_memory, 5, policy.DATA), (in_memory.with_options(options), 5, policy.DATA),
             (from_files, 3, policy.FILE), (from_files.with_options(options), 2, policy.FILE),
             (from_files, 5, policy.DATA)]  # fewer files than shards: by element
    for source, shards, expected in cases:
        assert _tf_compat.shard_policy(source, shards) == expected, (shards, expected)
        source = _tf_compat.with_shard_policy(source, expected)
        seen = []
        for index in range(shards):
            shard = _tf_compat.shard_dataset(source, shards, tf.constant(index, tf.int64),
                                             expected)
            seen += [int(v) for batch in shard for v in batch.numpy()]
        everything = [int(v) for batch in _tf_compat.with_shard_policy(source, expected)
                      for v in batch.numpy()]
        assert sorted(seen) == sorted(everything) and len(everything) in (103, 60)


def test_named_hash_tables_critical_sections_and_pinned_variables(strategy):
    """A table gets a UUID shared name (not `table_<n>`), and so does a critical section's mutex
    (not its `name`); a pinned variable keeps its ps even in the strategy's scope, where
    `tf.Variable` would be placed round-robin."""
    device = "/job:ps/replica:0/task:1/device:CPU:0"
    first = _tf_compat.hash_table(tf.int64, tf.float32, tf.constant(-1.0), device, "t")
    second = _tf_compat.hash_table(tf.int64, tf.float32, tf.constant(-1.0), device, "t")
    assert first._shared_name.startswith("kfit_ps_t_") and first._shared_name != second._shared_name
    assert first.resource_handle.device == device
    locks = [_tf_compat.critical_section(device, "lock_0") for _ in range(2)]
    mutexes = [lock._signature[1] for lock in locks]  # (container, shared name, device)
    assert mutexes[0].startswith("kfit_ps_lock_0_") and mutexes[0] != mutexes[1]
    assert locks[0]._handle.device == device
    with strategy.scope():
        counters = _tf_compat.pinned_variable(tf.zeros([3], tf.int64), device, "c")
    assert counters.device == device and not counters.trainable
    with tf.device(device):
        first.insert(tf.constant([7], tf.int64), tf.constant([2.0]))

    @tf.function
    def read_in_tf_data():  # tf.data's runtime finds a named table (an anonymous one: no).
        data = tf.data.Dataset.from_tensor_slices(tf.constant([7, 8], tf.int64))
        return data.reduce(tf.constant(0.0), lambda total, key: total + first.lookup(key))

    result = strategy.coordinator.schedule(read_in_tf_data)
    assert result.fetch() == 1.0


def test_remove_autograph_files_removes_this_process_generated_sources():
    def clipped(x):
        if tf.reduce_sum(x) > 0:  # Python control flow on a tensor: autograph converts it
            return x
        return -x

    assert float(tf.function(clipped)(tf.constant([1.0, -3.0]))[0]) == -1.0
    generated = [m.__file__ for name, m in sys.modules.items()
                 if name.startswith("__autograph_generated_file")]
    assert generated and all(os.path.exists(path) for path in generated)
    assert _tf_compat.remove_autograph_files() >= 1
    assert not any(os.path.exists(path) for path in generated)


# A fresh interpreter, as a server starts: kfit_ps' packages bare, TensorFlow not imported.
BARE_SERVER_API = """
import json, os, sys, types
sys.path.insert(0, {root!r})
for name in ("kfit_ps", "kfit_ps._tf_compat"):
    package = types.ModuleType(name)
    package.__path__ = [os.path.join({root!r}, *name.split("."))]
    sys.modules[name] = package
sys.modules["keras"] = None
from kfit_ps._tf_compat import server_lib
reason = server_lib.bare_import_reason()
server, cluster_spec, config_proto, how = server_lib.server_api(bare=True)
local = server.create_local_server()
print(json.dumps({{"reason": reason, "how": how, "target": local.target,
                   "config": type(config_proto(inter_op_parallelism_threads=3)).__name__,
                   "python_api": any(m.startswith("tensorflow._api") for m in sys.modules)}}))
"""


def _bare_server_api(tmp_path, **env):
    import json
    import subprocess

    from tests import helpers

    script = tmp_path / "bare.py"
    script.write_text(BARE_SERVER_API.format(root=helpers.ROOT))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env={**helpers.chief_env(), **env}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_server_api_imports_only_the_server_classes_where_that_loads_the_same_runtime(
        tmp_path):
    from kfit_ps._tf_compat import server_lib

    bare = _bare_server_api(tmp_path)
    assert bare["reason"] is None and bare["how"] == server_lib.BARE
    assert bare["target"].startswith("grpc://") and bare["config"] == "ConfigProto"
    assert not bare["python_api"]

    # Where `import tensorflow` would load more into the runtime, a server takes it whole.
    plugins = tmp_path / "site" / "tensorflow-plugins"
    plugins.mkdir(parents=True)
    with_plugins = _bare_server_api(tmp_path, PYTHONPATH=str(plugins.parent))
    assert with_plugins["reason"] == "a tensorflow-plugins folder is installed"
    assert with_plugins["how"] == server_lib.FULL and with_plugins["python_api"]
    pluggable = _bare_server_api(tmp_path, TF_PLUGGABLE_DEVICE_LIBRARY_PATH=str(plugins))
    assert pluggable["reason"] == "TF_PLUGGABLE_DEVICE_LIBRARY_PATH is set"

    # In a process that has TensorFlow already (`kfit-ps server`): the ordinary classes.
    assert server_lib.bare_import_reason() == "TensorFlow is already imported"
    assert server_lib.server_api(bare=True)[:2] == (tf.distribute.Server, tf.train.ClusterSpec)


def test_queued_functions_are_cancelled_and_results_are_ready_only_once_copied(strategy):
    """`cancel_queued_closures` (a SIGTERM in fit) and `remote_value_ready` (bounded waits)
    on TensorFlow's coordinator: queued functions are dropped, the running ones finish."""
    coordinator = strategy.coordinator

    @tf.function
    def slow():
        x = tf.random.stateless_normal((400, 400), seed=(1, 2))
        return tf.reduce_sum(tf.foldl(lambda acc, _: tf.matmul(acc, x) / 400.0,
                                      tf.range(40), initializer=x))

    results = [coordinator.schedule(slow) for _ in range(24)]
    # A loaded host may not have handed any function to a worker yet: wait until one runs.
    closures = coordinator._cluster.closure_queue  # TensorFlow's, as _tf_compat reads it
    deadline = time.monotonic() + 60
    while closures._inflight_closure_count == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    cancelled = _tf_compat.cancel_queued_closures(coordinator)
    assert 0 < len(cancelled) < 24  # the running ones (one per worker at least) not dropped
    coordinator.join()  # returns once the running ones finished
    done, dropped = results[:24 - len(cancelled)], results[24 - len(cancelled):]
    assert [id(v) for v in cancelled] == [id(v) for v in dropped]  # In queue order.
    for remote in done:
        assert _tf_compat.remote_value_ready(remote, 10.0)
        assert np.isfinite(remote.fetch())
    for remote in dropped:
        assert _tf_compat.remote_value_ready(remote, 0.0)  # an error is there at once
        with pytest.raises(tf.errors.CancelledError):
            remote.fetch()
    pending = coordinator.schedule(slow)
    assert not _tf_compat.remote_value_ready(pending, 0.0)  # not finished yet
    assert _tf_compat.remote_value_ready(pending, 60.0)
    coordinator.join()


def test_optimizer_internals_of_the_sparse_updates_still_exist():
    """Weight-decay exclusion, learning rates at a step, the scalars read with the packed
    reads, and the moving-average switch and pairs of Keras 3.15's optimizers."""
    kernel, embeddings = keras.Variable(tf.ones((2, 2)), name="kernel"), keras.Variable(
        tf.ones((3, 2)), name="embeddings")
    optimizer = keras.optimizers.AdamW(0.1, weight_decay=0.5)
    optimizer.exclude_from_weight_decay(var_names=["embeddings"])
    optimizer.build([kernel, embeddings])
    assert _tf_compat.uses_weight_decay(optimizer, kernel)
    assert not _tf_compat.uses_weight_decay(optimizer, embeddings)
    assert not _tf_compat.uses_weight_decay(optimizer, "tower/embeddings")
    assert _tf_compat.uses_weight_decay(optimizer, "tower/kernel")
    assert not _tf_compat.uses_weight_decay(keras.optimizers.Adam(), kernel)

    scalars = _tf_compat.optimizer_scalars(optimizer)
    assert scalars[0] is optimizer.iterations and len(scalars) == 2
    assert float(_tf_compat.learning_rate_at(optimizer, tf.constant(7, tf.int64))) == \
        pytest.approx(0.1)
    schedule = keras.optimizers.schedules.ExponentialDecay(1.0, decay_steps=1, decay_rate=0.5)
    scheduled = keras.optimizers.SGD(schedule)
    assert _tf_compat.optimizer_scalars(scheduled) == [scheduled.iterations]
    assert float(_tf_compat.learning_rate_at(scheduled, tf.constant(3, tf.int64))) == 0.125

    averaged = keras.optimizers.SGD(0.1, use_ema=True)
    averaged.build([kernel])
    (variable, average), = _tf_compat.moving_average_pairs(averaged)
    assert variable is kernel and tuple(average.shape) == (2, 2)
    with _tf_compat.keras_averages_off(averaged):
        assert not averaged.use_ema
        averaged.apply([tf.ones((2, 2))], [kernel])
    assert averaged.use_ema
    np.testing.assert_array_equal(average.numpy(), np.zeros((2, 2)))  # Not updated by Keras.


def test_observed_closures_report_the_worker_that_finished_each_function(strategy):
    """`observe_closures` wraps TensorFlow's per-worker closure processing: every scheduled
    function is reported once, with its worker and its result, after it finished."""
    from tensorflow.python.distribute.coordinator import cluster_coordinator, remote_value

    assert hasattr(cluster_coordinator.Worker, "_process_closure")
    assert remote_value.RemoteValueStatus.READY
    seen = []
    observe = lambda index, value, seconds: seen.append((index, value, seconds))  # noqa: E731
    coordinator = strategy.coordinator
    _tf_compat.observe_closures(coordinator, observe)
    _tf_compat.observe_closures(coordinator, observe)  # idempotent: reported once

    @tf.function
    def add(x):
        return x + 1

    results = [coordinator.schedule(add, args=(tf.constant(i),)) for i in range(20)]
    coordinator.join()
    assert sorted(int(r.fetch()) for r in results) == list(range(1, 21))
    mine = [s for s in seen if any(s[1] is r for r in results)]
    assert len(mine) == 20
    assert {index for index, _, _ in mine} <= {0, 1}
    assert all(seconds >= 0 for _, _, seconds in mine)
    _tf_compat.observe_closures(coordinator, lambda *args: None)  # leave the shared one quiet


def test_dataset_ops_and_external_state_are_read_from_the_serialized_pipeline():
    """`shuffle_ops` names a pipeline's shuffles; `external_state` says why a pipeline that
    uses this process's state (a variable a `map` reads, a Python generator) cannot be copied to
    another task, and None for one that can (a lookup layer's table is rebuilt from its
    initializer, Keras 3 preprocessing layers map with their values)."""
    import keras

    plain = tf.data.Dataset.range(10).map(lambda x: x * 2).batch(2)
    assert _tf_compat.shuffle_ops(plain) == []
    assert _tf_compat.shuffle_ops(plain.shuffle(4)) == ["ShuffleDatasetV3"]
    assert _tf_compat.external_state(plain) is None
    assert _tf_compat.external_state(plain.shuffle(4)) is None  # a seed, not external state
    lookup = keras.layers.StringLookup(vocabulary=["a", "b"])
    assert _tf_compat.external_state(tf.data.Dataset.from_tensor_slices(["a", "c"]).map(
        lookup)) is None
    scale = tf.Variable(2, dtype=tf.int64)
    read = _tf_compat.external_state(plain.map(lambda x: x * scale))
    assert "ReadVariableOp is stateful" in read  # TensorFlow's first line
    generated = tf.data.Dataset.from_generator(lambda: iter([1, 2]),
                                               output_signature=tf.TensorSpec((), tf.int64))
    assert _tf_compat.external_state(generated)


def test_a_pipeline_graph_is_read_evaluated_in_part_and_replayed_on_another_source():
    """`dataset_graph`: the serialized pipeline without its return node, a constant of it, the
    dataset of one of its nodes, and its steps after a node replayed on another dataset inside
    a traced function, after the pipeline's own functions are gone."""
    import gc

    from kfit_ps._tf_compat import dataset_graph

    graph, output = dataset_graph.pipeline_graph(
        tf.data.Dataset.range(10).map(lambda x: x * 2).batch(3))
    nodes = {node.name: node for node in graph.node}
    batch = nodes[output]
    assert batch.op == "BatchDatasetV2" and "_Retval" not in {n.op for n in graph.node}
    assert int(dataset_graph.constant(graph, batch.input[1])) == 3
    mapped = nodes[batch.input[0].split(":")[0]]
    assert mapped.op == "MapDataset"
    spec = tf.TensorSpec([], tf.int64)
    assert list(dataset_graph.evaluate(graph, mapped.name, spec).as_numpy_iterator()) == \
        list(range(0, 20, 2))
    gc.collect()  # The map's function now lives on in the eager context only.

    @tf.function
    def replayed():
        dataset = dataset_graph.replay(graph, output, mapped.input[0].split(":")[0],
                                       tf.data.Dataset.range(100, 104),
                                       tf.TensorSpec([None], tf.int64))
        return dataset.reduce(tf.constant(0, tf.int64), lambda total, b: total + tf.reduce_sum(b))

    assert int(replayed()) == 2 * (100 + 101 + 102 + 103)
    with pytest.raises(dataset_graph.Unserializable, match="ReadVariableOp is stateful"):
        scale = tf.Variable(2, dtype=tf.int64)
        dataset_graph.pipeline_graph(tf.data.Dataset.range(3).map(lambda x: x * scale))


def test_coordinators_are_quiesced_before_exit_and_a_held_recovery_lock_cannot_hang_it():
    """A chief that printed its result never exited: at finalization a worker-recovery thread
    was frozen holding its lock, and the coordinator's `__del__` waited on it. `quiesce_all`
    (an atexit hook) ends the recovery threads first, and never waits without bound."""
    result = helpers.run_chief("""
        import threading
        from kfit_ps._tf_compat import eager_context
        with kfit_ps.LocalCluster(num_workers=1, num_ps=1) as cluster:
            strategy = kfit_ps.ParameterServerStrategy(cluster.cluster_resolver)
            handler = strategy.coordinator._cluster.failure_handler
            thread = handler._preemption_handler_thread
            held, release = threading.Event(), threading.Event()

            def hold():  # A recovery that does not end (a thread frozen in it).
                with handler._cluster_update_lock:
                    held.set()
                    release.wait()

            threading.Thread(target=hold, daemon=True).start()
            held.wait()
            started = time.monotonic()
            eager_context.quiesce_all(wait=1.0)
            waited = time.monotonic() - started
            started = time.monotonic()
            strategy.coordinator._cluster.stop()  # What its __del__ runs at exit.
            stopped = time.monotonic() - started
            release.set()
            registered = bool(eager_context._at_exit)
            report(waited=waited, stopped=stopped, registered=registered,
                   thread_alive=thread.is_alive())
        os._exit(0)
    """)
    assert result["registered"]
    assert 1.0 <= result["waited"] < 5 and result["stopped"] < 1, result


def test_critical_sections_of_a_function_are_taken_one_at_a_time():
    """Each section's lock waits for the previous section's release (its `ConsumeMutexLock`)
    in the same graph, and the marker that chains them keeps no traced graph alive (nor does
    autograph: converting the sections' `execute` kept the graph)."""
    import gc
    import weakref

    first = _tf_compat.critical_section("/cpu:0", "first")
    second = _tf_compat.critical_section("/cpu:0", "second")
    a, b = tf.Variable(0), tf.Variable(0)

    @tf.function
    def step():
        x = first.execute(lambda: a.assign_add(1))
        y = second.execute(lambda: b.assign_add(1))
        return x + y

    graph = step.get_concrete_function().graph
    locks = [op for op in graph.get_operations() if op.type == "MutexLock"]
    [release] = [op for op in graph.get_operations() if op.type == "ConsumeMutexLock"
                 and op.inputs[0].op is locks[0]]

    def ancestors(op, seen):
        for parent in list(op.control_inputs) + [t.op for t in op.inputs]:
            if parent not in seen:
                seen.add(parent)
                ancestors(parent, seen)
        return seen

    assert len(locks) == 2 and release in ancestors(locks[1], set())
    assert int(step()) == 2 and int(step()) == 4  # eager-side: the function still runs
    assert [int(first.execute(lambda: a.assign_add(1)))] == [3]
    traced = weakref.ref(graph)
    del graph, step, locks, release
    gc.collect()
    assert traced() is None


def test_a_copy_of_a_new_kind_never_runs_beside_another_copy(strategy, monkeypatch):
    """TensorFlow's coordinator copies results to the chief from several threads; a copy of a
    new kind (a dtype not copied from that worker yet) instantiates a remote part, which can
    move the part another copy is reading (`result_copies`: a use-after-free in TensorFlow,
    seen as a chief SIGSEGV in `identity` and "Unable to parse request"). With the gate, a
    first copy of its kind overlaps no other copy; known kinds still copy side by side."""
    import threading

    from tensorflow.python.distribute.coordinator import values as coordinator_values
    from tensorflow.python.eager import context

    from kfit_ps._tf_compat import result_copies

    wrapped = coordinator_values.RemoteValueImpl._copy_to_local
    assert hasattr(wrapped, "_kfit_ps_stock")  # installed by the strategy, once
    assert not hasattr(wrapped._kfit_ps_stock, "_kfit_ps_stock")
    for name in result_copies._GENERATION_ENDS:
        assert hasattr(getattr(context.Context, name), "_kfit_ps_stock"), name
    intervals, lock = [], threading.Lock()

    def probed(self):  # TensorFlow's copy, timed, under the gate as installed
        start = time.perf_counter()
        time.sleep(0.002)  # widen each copy: overlaps would show
        try:
            return wrapped._kfit_ps_stock(self)
        finally:
            with lock:
                intervals.append((start, time.perf_counter(), result_copies._kind(self)))

    monkeypatch.setattr(coordinator_values.RemoteValueImpl, "_copy_to_local",
                        result_copies._safe_copy(probed))
    context.context().clear_kernel_cache()  # TensorFlow instantiates every part again
    dtypes = [tf.float16, tf.float32, tf.float64, tf.int16, tf.int32, tf.int64, tf.uint8,
              tf.bool, tf.complex64]
    functions = [tf.function(lambda i, dt=dt: tf.cast(i, dt)) for dt in dtypes]
    results = []
    for round_ in range(4):
        for function in functions:
            results += [strategy.coordinator.schedule(function, args=(tf.constant(k),))
                        for k in range(3)]
    strategy.coordinator.join()
    assert len(intervals) == len(results) == 4 * 3 * len(dtypes)
    intervals.sort()
    firsts, seen = [], set()
    for interval in intervals:
        if interval[2] not in seen:
            seen.add(interval[2])
            firsts.append(interval)
    assert len(seen) >= len(dtypes)  # one kind per dtype and worker that ran it
    for first in firsts:
        beside = [other for other in intervals if other is not first
                  and other[0] < first[1] and first[0] < other[1]]
        assert not beside, (first, beside[:3])
    overlapping = sum(1 for a, b in zip(intervals, intervals[1:]) if b[0] < a[1])
    assert overlapping > 0  # known kinds are not serialized
    assert [r.fetch().dtype for r in results[:len(dtypes) * 3:3]] == [
        dt.as_numpy_dtype for dt in dtypes]
    with strategy.scope():
        counter = keras.Variable(7, dtype="int64", name="counter")
    assert "/job:ps/" in counter.value.device
    assert int(_tf_compat.read_where_it_lives(counter)) == 7 == int(counter.numpy())


def test_the_result_copy_gate_decides_after_waiting_and_keeps_copies_flowing_in_a_change():
    """A copy that found its kind known, then waited behind a change that made kinds new,
    runs alone; a change starts once the copies inside have left; while it runs
    (TensorFlow's recovery waits for its worker), copies go on one at a time instead of
    waiting for it; a copy stuck on a stopped worker holds the others back for `stuck`
    seconds once, then they go on beside it; a thread inside passes again."""
    import threading

    from kfit_ps._tf_compat.result_copies import _Gate

    gate = _Gate(stuck=0.3)
    with gate.passage("known"):
        with gate.passage("other"):  # re-entry: no wait on itself
            pass
    log, lock = [], threading.Lock()

    def copy(key, hold=0.05):
        with gate.passage(key):
            with lock:
                log.append(("in", key, any(h.exclusive for h in gate._holders)))
            time.sleep(hold)
            with lock:
                log.append(("out", key, None))

    with gate.new_generation():  # a change in progress: "known" is new now
        threads = [threading.Thread(target=copy, args=("known",)) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
    assert [entry[2] for entry in log if entry[0] == "in"] == [True] * 3  # each alone
    assert all(log[i][0] == "in" and log[i + 1][0] == "out" for i in range(0, 6, 2))
    log.clear()
    copy("known")  # a new generation: known again once copied
    threads = [threading.Thread(target=copy, args=("known", 0.2)) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert [entry[0] for entry in log[2:]][:3] == ["in"] * 3  # known: side by side

    def holding(key):
        """A thread inside the gate as a copy of `key` until the returned event is set."""
        inside, release = threading.Event(), threading.Event()

        def hold():
            with gate.passage(key):
                inside.set()
                release.wait(10)

        thread = threading.Thread(target=hold)
        thread.start()
        assert inside.wait(10)
        return thread, release

    holder, release = holding("fresh")
    waiter = threading.Thread(target=copy, args=("known",))
    waiter.start()  # known: waits behind the new kind as a reader
    time.sleep(0.05)
    with gate.new_generation():  # meanwhile its kind became new: it must run alone
        release.set()
        waiter.join(10)
    holder.join(10)
    assert log[-2] == ("in", "known", True)

    copy("known")
    thread, release = holding("known")  # admitted as known; then a change begins
    changed = []

    def change():
        with gate.new_generation():
            changed.append(time.monotonic())

    changer = threading.Thread(target=change)
    start = time.monotonic()
    changer.start()
    time.sleep(0.1)
    assert not changed  # it waits for the copy inside
    release.set()
    changer.join(10)
    thread.join(10)
    assert changed and changed[0] - start < 0.3

    copy("known")
    thread, release = holding("known")  # a copy stuck on a stopped worker
    start = time.monotonic()
    with gate.passage("new"):
        waited = time.monotonic() - start
    assert 0.25 < waited < 5
    start = time.monotonic()
    for key in ("newer", "known", "newest"):  # said stuck: the others go on without waiting
        with gate.passage(key):
            pass
    assert time.monotonic() - start < 0.2
    release.set()
    thread.join(10)
    start = time.monotonic()
    with gate.passage("new"):  # nobody inside: no wait
        pass
    assert time.monotonic() - start < 0.2
