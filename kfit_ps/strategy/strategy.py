"""`ParameterServerStrategy`: TensorFlow's PS strategy, made correct for Keras 3.

It *is* a `tf.distribute.ParameterServerStrategy` (placement, partitioning,
`ClusterCoordinator` and fault tolerance are TensorFlow's). What it adds:

- cluster validation with errors that say what to fix;
- an evaluator task in the resolver's spec is dropped (the evaluator is not
  part of the training cluster);
- `scope()` marks every variable created in it, so that Keras 3 variables
  stored on a ps update atomically (`assign_add` / `assign_sub` become one
  in-place op on the ps; see `kfit_ps._tf_compat.keras_variables`);
- `coordinator`: the strategy's `ClusterCoordinator`, created on first use.
"""

import contextlib

import tensorflow as tf

from kfit_ps import _tf_compat, constants, net, validation
from kfit_ps.errors import ClusterError

_ALLOWED = (constants.CHIEF, constants.WORKER, constants.PS)


def _resolver_from_tf_config():
    if not constants.tf_config():
        raise ValueError(
            "ParameterServerStrategy() without `cluster_resolver` reads the cluster from the "
            f"{constants.TF_CONFIG} environment variable, which is not set. Received: "
            "cluster_resolver=None. Run the script under `kfit-ps run`, set TF_CONFIG, or pass "
            "`cluster_resolver=kfit_ps.LocalCluster(...).cluster_resolver`.")
    return _validated_resolver(tf.distribute.cluster_resolver.TFConfigClusterResolver(),
                               source=constants.TF_CONFIG)


def _is_local_cluster(value):
    """A `kfit_ps.LocalCluster` (known by its interface: the strategy layer does not import
    the cluster layer above it)."""
    return all(hasattr(type(value), name) for name in ("start", "stop", "cluster_resolver",
                                                       "server_tasks", "kill"))


def _validated_resolver(cluster_resolver, source="ParameterServerStrategy cluster_resolver"):
    """The resolver (without an evaluator), once its cluster obeys every rule.

    Runs before anything waits on the network: a misconfigured cluster is
    refused at once, naming the rule, not after the startup timeout.
    """
    if not isinstance(cluster_resolver, tf.distribute.cluster_resolver.ClusterResolver):
        raise ValueError(
            "ParameterServerStrategy: `cluster_resolver` must be a "
            "tf.distribute.cluster_resolver.ClusterResolver. Received: "
            f"cluster_resolver={cluster_resolver!r} of type {type(cluster_resolver).__name__}. "
            "Pass a `kfit_ps.LocalCluster(...)` or its `.cluster_resolver`, "
            "`ClusterConfig.from_tf_config().cluster_resolver()` or "
            "`tf.distribute.cluster_resolver.TFConfigClusterResolver()`."
        )
    spec = cluster_resolver.cluster_spec().as_dict()
    unknown = sorted(set(spec) - set(_ALLOWED) - {constants.EVALUATOR})
    if unknown:
        raise ValueError(
            f"ParameterServerStrategy: the cluster has task type(s) {unknown}; a parameter-server "
            f"cluster has only {', '.join(_ALLOWED)} (and an evaluator outside it). "
            f"Received cluster spec: {spec}. Remove or rename those jobs."
        )
    for required in (constants.WORKER, constants.PS):
        if not spec.get(required):
            raise ValueError(
                f"ParameterServerStrategy: the cluster has no {required!r} task; parameter-server "
                f"training needs at least one worker and one ps. Received cluster spec: {spec}. "
                f"Add a {required!r} job to the cluster (TF_CONFIG \"cluster\")."
            )
    task_type = cluster_resolver.task_type
    if task_type not in (None, constants.CHIEF):
        raise ValueError(
            f"ParameterServerStrategy runs on the chief (coordinator), but this process is task "
            f"{task_type!r}:{cluster_resolver.task_id}. Run servers for worker and ps tasks with "
            "`kfit-ps server`, and the training script with TF_CONFIG task type 'chief'."
        )
    validation.check_cluster(spec, task_type, cluster_resolver.task_id or 0, source=source)
    if constants.EVALUATOR not in spec:
        return cluster_resolver
    del spec[constants.EVALUATOR]  # The evaluator reads checkpoints; it is not trained on.
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(spec), task_type=task_type, task_id=cluster_resolver.task_id or 0,
        rpc_layer=cluster_resolver.rpc_layer or "grpc")


class ParameterServerStrategy(tf.distribute.ParameterServerStrategy):
    """Asynchronous parameter-server training for Keras 3 models.

    Build and compile the model under `strategy.scope()`, then call the
    ordinary `model.fit`, as in one process:

    ```python
    strategy = kfit_ps.ParameterServerStrategy(kfit_ps.LocalCluster(num_workers=2, num_ps=1))
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    model.fit(kfit_ps.DatasetCreator(dataset_fn), epochs=2, steps_per_epoch=100)
    ```

    Args:
        cluster_resolver: a `tf.distribute.cluster_resolver.ClusterResolver`
            whose spec has at least one `worker` and one `ps` (and optionally a
            `chief`); this process is the chief. Or a `kfit_ps.LocalCluster`:
            started here if it was not, its servers then run until the process
            ends (or `strategy.cluster.stop()`); under `kfit-ps run` it is the
            launcher's cluster. Defaults to None: the cluster and this task
            from `TF_CONFIG` (what `kfit-ps run` sets).
        variable_partitioner: a `tf.distribute.experimental.partitioners`
            partitioner to shard variables along axis 0 across ps tasks.
            Defaults to None (no sharding: variables go round-robin to the ps
            tasks).
        worker_timeout: seconds `fit`/`evaluate`/`predict` wait while every
            worker is unreachable before raising `kfit_ps.errors.WorkersLostError`.
            Defaults to None: `KFIT_PS_WORKER_TIMEOUT`, else 300.
    """

    def __init__(self, cluster_resolver=None, variable_partitioner=None, worker_timeout=None):
        if variable_partitioner is not None and not callable(variable_partitioner):
            raise ValueError(
                "ParameterServerStrategy: `variable_partitioner` must be callable (shape, dtype) "
                f"-> list of partitions. Received: variable_partitioner={variable_partitioner!r}. "
                "Use e.g. tf.distribute.experimental.partitioners.MinSizePartitioner()."
            )
        if worker_timeout is not None and (isinstance(worker_timeout, bool) or not isinstance(
                worker_timeout, (int, float)) or worker_timeout <= 0):
            raise ValueError(
                "ParameterServerStrategy: `worker_timeout` must be a positive number of seconds "
                f"or None. Received: worker_timeout={worker_timeout!r}.")
        self.cluster = None  # The LocalCluster given instead of a resolver, if one was.
        if _is_local_cluster(cluster_resolver):
            self.cluster = cluster_resolver
            if self.cluster.config is None:
                self.cluster.start()  # Stopped at exit (LocalCluster's atexit hook).
            cluster_resolver = self.cluster.cluster_resolver
        _tf_compat.install_atomic_updates()
        _tf_compat.install_exact_batch_norm()
        _tf_compat.install_exact_seed_generator()
        _tf_compat.install_quiet_executor_teardown()
        _tf_compat.install_safe_result_copies()
        if variable_partitioner is not None:
            _tf_compat.install_sharding_support()
        resolver = (_resolver_from_tf_config() if cluster_resolver is None
                    else _validated_resolver(cluster_resolver))
        spec = resolver.cluster_spec().as_dict()
        self._num_workers = len(spec[constants.WORKER])
        self._num_ps = len(spec[constants.PS])
        self._worker_addresses = tuple(spec[constants.WORKER])
        self._worker_timeout = float(worker_timeout or constants.worker_timeout())
        wait_for_servers(spec, constants.startup_timeout())
        super().__init__(resolver, variable_partitioner)
        check_one_replica_per_worker(self.num_replicas_in_sync)

    @contextlib.contextmanager
    def scope(self):
        """Variables created in this scope live on the ps tasks and update atomically."""
        with super().scope(), tf.variable_creator_scope(_marking_creator):
            yield self

    @property
    def coordinator(self):
        """This strategy's `tf.distribute.experimental.coordinator.ClusterCoordinator`."""
        return _tf_compat.track_coordinator(
            tf.distribute.experimental.coordinator.ClusterCoordinator(self))

    def resize_workers(self, addresses):
        """Trains on the workers at `addresses` from now on (elastic workers).

        The variables stay on the ps tasks; a kept worker keeps its per-worker
        datasets (its iterator continues), a new one builds its own, a removed
        one is no longer used (stop its server afterwards). Call it with no
        function in flight: between `fit`s, or let `fit` call it at a safe point
        (`kfit_ps.training.resilience.elastic`, what `kfit-ps scale` drives). The new workers
        must accept connections. Returns the new `ClusterCoordinator`.
        """
        addresses = tuple(addresses)
        if not addresses or not all(isinstance(a, str) and ":" in a for a in addresses):
            raise ValueError(
                "ParameterServerStrategy.resize_workers: `addresses` must be a non-empty list "
                f"of 'host:port' strings. Received: addresses={list(addresses)!r}.")
        wait_for_servers({constants.WORKER: addresses, constants.PS: []},
                         constants.startup_timeout())
        try:
            coordinator = _tf_compat.resize_workers(self, addresses)
        except _tf_compat.RecoveryInProgress as e:
            raise ClusterError(
                f"ParameterServerStrategy.resize_workers: {e} (a lost worker is not back), so "
                "the workers could not be changed: a second cluster update beside TensorFlow's "
                "would crash this process. This coordinator has stopped; rerun the script to "
                "resume from its last backup (kfit-ps run restarts the job by itself).",
                tasks=[f"{constants.WORKER}:{i}" for i in range(self._num_workers)]) from None
        self._num_workers = len(addresses)
        self._worker_addresses = addresses
        return _tf_compat.track_coordinator(coordinator)

    num_workers = property(lambda self: self._num_workers,
                           doc="Number of worker tasks in the cluster.")
    num_ps = property(lambda self: self._num_ps, doc="Number of ps tasks in the cluster.")
    worker_addresses = property(lambda self: self._worker_addresses,
                                doc="The workers' `host:port` addresses, in task order.")
    worker_timeout = property(lambda self: self._worker_timeout,
                              doc="Seconds to wait while every worker is unreachable "
                                  "(see `__init__`).")


def wait_for_servers(spec, timeout):
    """Returns once every worker and ps of `spec` accepts connections; `ClusterError` after
    `timeout` seconds, naming those that do not.

    TensorFlow connects to every task at once and fails outright when one is not
    there yet (a rescheduled pod, a host still booting); a chief restarted before
    its ps host is back waits here instead, and, past the timeout, stops with a
    cluster error that `kfit-ps run` and Kubernetes retry.
    """
    servers = [(f"{t}:{i}", a) for t in (constants.WORKER, constants.PS)
               for i, a in enumerate(spec[t])]
    where = dict(servers)

    def names(tasks):
        return ", ".join(f"{task} ({where[task]})" for task in tasks)

    missing = net.wait_for_servers(servers, timeout, on_first_wait=lambda tasks: (
        _tf_compat.print_msg(f"kfit_ps: waiting up to {timeout:g} s for {names(tasks)} to "
                             "accept connections")))
    if missing:
        raise ClusterError(
            f"ParameterServerStrategy: {names(missing)} did not accept connections within "
            f"{timeout:g} s, so the chief cannot connect to the cluster. Start those servers "
            f"(kfit-ps run --tasks ...), or wait longer: set {constants.STARTUP_TIMEOUT_ENV}.",
            tasks=missing)


def check_one_replica_per_worker(num_replicas):
    """Refuses workers with more than one replica (e.g. GPUs, which TensorFlow finds itself).

    kfit_ps keeps one metric state and adds one `iterations` per step and worker; with
    several replicas per worker it would silently drop replicas' metrics.
    """
    if num_replicas > 1:
        raise ValueError(
            f"ParameterServerStrategy: the workers have {num_replicas} replicas each (TensorFlow "
            "found that many GPUs on each worker), and kfit_ps supports one replica per worker "
            f"for now. Received: num_replicas_in_sync={num_replicas}. Give each worker one "
            "device, e.g. start its server with CUDA_VISIBLE_DEVICES set to a single GPU (or "
            "to '' for CPU only).")


def _marking_creator(next_creator, **kwargs):
    variable = next_creator(**kwargs)
    for component in getattr(variable, "variables", (variable,)):
        _tf_compat.mark_kfit_variable(component)
        _tf_compat.ps_restore.remember(component)
    _tf_compat.mark_kfit_variable(variable)
    return variable


def is_kfit_strategy(strategy):
    return isinstance(strategy, ParameterServerStrategy)
