"""A restarted ps's variables, made again in the same chief process (in-place ps recovery).

A ps that dies takes the variables it held with it; the chief's handles to them
name resources of the dead process, and every traced function captured those
handles. TensorFlow has no way back from that but a new chief. In place, once the
ps runs again (`kfit_ps.training.resilience.ps_recovery` drives these steps):

1. `drain`: no scheduled function is left in flight (those that failed with the
   ps are reported as failed, the queued ones as cancelled);
2. `reconnect`: the eager context re-applies its server def under the
   coordinator's cluster-update lock, as TensorFlow's own worker recovery does:
   it finds the ps' new incarnation and makes a new remote context there. Other
   tasks keep theirs, and their variables;
3. `recreate`: each variable (or shard) that lived on the ps gets a new, empty
   resource on it; the Python object keeps its identity, so the model, the
   optimizer and their slots need no change;
4. the caller loads the backup under `restoring_only(tasks)`: Keras' own loading
   then writes only those variables (and shards), reading only their part of the
   file; then it drops its traced functions, which hold the old handles.
"""

import contextlib
import time
import weakref

import numpy as np
import tensorflow as tf
from keras.src.backend.tensorflow import core as _tf_core
from keras.src.saving import saving_lib
from tensorflow.python.distribute.coordinator import remote_value as remote_value_lib
from tensorflow.python.eager import context
from tensorflow.python.ops import resource_variable_ops

from kfit_ps._tf_compat.keras_sharding import sharded_storage, shards
from kfit_ps._tf_compat.versions import check_versions

_variables = weakref.WeakValueDictionary()  # id -> each tf.Variable of a kfit_ps scope


def remember(tf_variable):
    """Registers a variable made under a kfit_ps strategy scope (for `variables_on`)."""
    _variables[id(tf_variable)] = tf_variable  # (variables are not hashable)
    return tf_variable


def _resource(variable):
    """The `ResourceVariable` behind TensorFlow's ps wrappers (caching, aggregating)."""
    while hasattr(variable, "_v"):
        variable = variable._v
    return variable


def _task_of(device):
    spec = tf.DeviceSpec.from_string(device or "")
    return (spec.job, spec.task)


def variables_on(task):
    """The resource variables (shards included) on ps `task` (an int), each once."""
    found = {}
    for variable in list(_variables.values()):
        inner = _resource(variable)
        if hasattr(inner, "_handle") and _task_of(inner.device) == ("ps", task):
            found[id(inner)] = inner
    return list(found.values())


def ps_address(task):
    """The address of ps `task` in this process's cluster connection."""
    for job in context.get_server_def().cluster.job:
        if job.name == "ps":
            return job.tasks[task]
    raise ValueError(f"ps_address: no ps job in this process's cluster. Received: task={task}.")


def readable(variable):
    """Whether `variable`'s resource still answers (its ps runs the same incarnation).

    The op must look the resource up on the ps: once the eager context has been updated
    to a ps's new incarnation (TensorFlow's own worker recovery does so when a worker is
    lost too), `VariableShape` of a stale handle still answers from the handle, while
    `VarIsInitializedOp` fails ("Resource input tensor contains an invalid device"). Its
    answer is not the test: a restored ps's metric variables stay empty until results are
    folded, and they answer."""
    try:
        with tf.device(variable.device):
            resource_variable_ops.var_is_initialized_op(variable.handle).numpy()
        return True
    except (tf.errors.OpError, ValueError):
        return False


def finished(remote_value):
    """Whether a scheduled function's result is in (it ran to its end on a worker)."""
    return (remote_value._status is remote_value_lib.RemoteValueStatus.READY
            and remote_value._error is None)  # (a failed function is READY with its error)


def drain(coordinator, deadline):
    """Waits (until `deadline`) until no scheduled function is queued or running; the errors
    of the functions that failed meanwhile are dropped. Returns whether it drained."""
    closures = coordinator._cluster.closure_queue
    while time.monotonic() < deadline:
        try:
            if closures.wait(timeout=1.0):
                return True
        except Exception:  # noqa: BLE001 - a failed function's error: it is counted as failed
            continue
    return False


def reconnect(coordinator, deadline):
    """Re-applies the eager context's server def (a restarted task gets a new remote
    context) under the coordinator's cluster-update lock; retried until `deadline`."""
    check_versions()
    handler = coordinator._cluster.failure_handler
    ctx = context.context()
    while True:
        try:
            with handler._cluster_update_lock:
                ctx.update_server_def(ctx.get_server_def())
            return
        except (tf.errors.UnavailableError, tf.errors.InvalidArgumentError,
                tf.errors.AbortedError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def holds_value(variable):
    """Whether `variable`'s resource holds a value (one that `recreate` made holds none until
    something writes it)."""
    with tf.device(variable.device):
        return bool(resource_variable_ops.var_is_initialized_op(variable.handle))


def resources_of(keras_variables):
    """The ids of the resource variables (shards included) behind `keras_variables`, as
    `variables_on` lists them."""
    return {id(_resource(part)) for v in keras_variables for part in shards(v)}


def recreate(variable):
    """Gives `variable` a new, uninitialized resource on its device (same shape, dtype)."""
    inner = _resource(variable)
    with tf.init_scope(), tf.device(inner.device):
        inner._handle = resource_variable_ops._variable_handle_from_shape_and_dtype(
            shape=inner.shape, dtype=inner.dtype, shared_name=None, name=inner._handle_name,
            graph_mode=False)
    inner._cached_value = None


@contextlib.contextmanager
def restoring_only(tasks):
    """Keras' loading (`load_weights`) writes only the parts of each variable that live on
    ps `tasks`, reading only those parts of the file; yields a dict whose "bytes" counts
    what was written. Every other variable, and every other shard, keeps its value."""
    written = {"bytes": 0}
    cls, store = _tf_core.Variable, saving_lib.H5IOStore
    stock_assign, stock_get = cls.__dict__.get("assign"), store.__getitem__

    def assign(self, value):
        for task in tasks:
            written["bytes"] += assign_on_task(self, value, task)

    def lazy_get(self, key):  # The h5py dataset, read by the slices `assign` takes of it.
        value = saving_lib.safe_get_h5_dataset(self._h5_entry_group, key)
        if getattr(value, "attrs", {}).get("dtype") == "bfloat16":
            return stock_get(self, key)
        return value

    cls.assign, store.__getitem__ = assign, lazy_get
    try:
        yield written
    finally:
        store.__getitem__ = stock_get
        if stock_assign is None:
            del cls.assign
        else:
            cls.assign = stock_assign


def assign_on_task(keras_variable, value, task):
    """Writes the part of `value` (an array or an h5py dataset) that lives on ps `task`;
    returns how many bytes."""
    written = 0
    sharded = sharded_storage(keras_variable) is not None
    offset = 0
    for part in shards(keras_variable):
        rows = part.shape[0] if part.shape.rank else 0
        if _task_of(_resource(part).device) == ("ps", task):
            piece = np.asarray(value[offset:offset + rows] if sharded else value[()])
            _resource(part).assign(tf.cast(piece, part.dtype))
            written += piece.nbytes
        offset += rows
    return written
