"""Copies of remote results to the chief that never run beside a first copy of their kind.

TensorFlow's `ClusterCoordinator` copies each finished function's result to the chief
(`RemoteValue.get` -> `_copy_to_local`: an `identity` placed on the chief of a tensor
that lives on a worker) from the worker thread that ran the function, so several copies
run at once. An op on the chief with an input on a worker is a multi-device function:
the chief sends the worker its part through `EagerClusterFunctionLibraryRuntime`, which
keeps one entry per instantiated part in a `std::vector` (`function_data_`). `Run`
takes a pointer into that vector under the vector's mutex, releases the mutex, and only
then reads the entry (its target device, its op); `Instantiate`'s completion appends to
the vector under the same mutex. An append that outgrows the vector's storage moves
every entry and frees the old storage, so a `Run` in between reads freed memory: its
request names a garbage device (the worker refuses it: "String field
'tensorflow.eager.Operation.device' contains invalid UTF-8", and the chief's `fit`
fails with "Unable to parse request" on `__wrapped__Identity_device_/job:chief/...`),
or the chief crashes (SIGSEGV in that `identity`). Seen in a job's first steps and
after a worker restart, when copies of new kinds (a dtype from a worker the chief has
not copied it from yet) instantiate while other threads copy; more often on a loaded
host, where a thread is preempted inside `Run`. `tests/test_tf_compat.py` reproduces
it with TensorFlow alone.

`install_safe_result_copies()` wraps `_copy_to_local` with a gate: a copy whose kind
(each tensor's device, dtype and shape) was copied before since the eager cluster last
changed runs beside others (shared); a copy of a new kind, which may instantiate, runs
alone (exclusive), after the copies in flight and before any other starts. A change of
the eager cluster (`Context.set_server_def` / `update_server_def`, TensorFlow's
recovery of a worker included) runs alone too and makes every kind new again. Each wait
is bounded (`_WAIT_SECONDS`): a copy stuck on a stopped worker delays the others by at
most that, never for good (then the waiter goes on, as TensorFlow alone would).
"""

import contextlib
import functools
import logging
import threading
import time

from tensorflow.python.distribute import input_lib
from tensorflow.python.distribute.coordinator import values as coordinator_values
from tensorflow.python.eager import context
from tensorflow.python.framework import composite_tensor
from tensorflow.python.util import nest

from kfit_ps._tf_compat.versions import check_versions

log = logging.getLogger("kfit_ps.cluster")

_WAIT_SECONDS = 30.0
_install_lock = threading.Lock()


class _Gate:
    """A readers-writer gate that prefers writers, with bounded waits and per-thread
    re-entry (a thread inside the gate passes again without waiting)."""

    def __init__(self, wait=_WAIT_SECONDS):
        self.wait = wait
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._writers_waiting = 0
        self._seen = set()
        self._inside = threading.local()

    def _enter(self, exclusive):
        deadline = time.monotonic() + self.wait
        with self._cond:
            if exclusive:
                self._writers_waiting += 1
                try:
                    free = self._cond.wait_for(
                        lambda: not self._exclusive and not self._shared,
                        max(0.0, deadline - time.monotonic()))
                finally:
                    self._writers_waiting -= 1
                if free:
                    self._exclusive = True
                else:
                    log.debug("kfit_ps: a copy in flight did not end within %.0f s; copying "
                              "beside it", self.wait)
                    self._shared += 1
                return free
            self._cond.wait_for(lambda: not self._exclusive and not self._writers_waiting,
                                max(0.0, deadline - time.monotonic()))
            self._shared += 1
            return False

    def _leave(self, exclusive):
        with self._cond:
            if exclusive:
                self._exclusive = False
            else:
                self._shared -= 1
            self._cond.notify_all()

    @contextlib.contextmanager
    def passage(self, key=None):
        """Shared for a `key` seen since the last `reset`, exclusive for a new one (or for
        `key=None`, a cluster change); `key` is seen once its block ran without error."""
        if getattr(self._inside, "depth", 0):
            self._inside.depth += 1
            try:
                yield
            finally:
                self._inside.depth -= 1
            return
        with self._cond:
            exclusive = key is None or key not in self._seen
        exclusive = self._enter(exclusive)
        self._inside.depth = 1
        try:
            yield
            if key is not None:
                with self._cond:
                    self._seen.add(key)
        finally:
            self._inside.depth = 0
            self._leave(exclusive)

    def reset(self):
        with self._cond:
            self._seen.clear()


_gate = _Gate()


def _tensor_kind(tensor):
    try:
        shape = tensor.shape
        dims = None if shape.rank is None else tuple(shape.as_list())
    except (AttributeError, ValueError, RuntimeError):
        dims = None
    return (tensor.device, str(tensor.dtype), dims)


def _kind(remote_value):
    """The device, dtype and shape of each tensor a remote value holds (what its copy
    instantiates for), or None when it holds none: what `_copy_to_local` copies, an
    iterator left out as TensorFlow leaves it, a composite tensor by its components."""
    found = []
    for leaf in nest.flatten(remote_value._values):
        if isinstance(leaf, input_lib.DistributedIterator):
            continue
        if isinstance(leaf, composite_tensor.CompositeTensor):
            found.append(type(leaf).__name__)
            found.extend(_tensor_kind(part) for part in nest.flatten(leaf, expand_composites=True)
                         if hasattr(part, "device"))
        elif hasattr(leaf, "device") and hasattr(leaf, "dtype"):
            found.append(_tensor_kind(leaf))
    return tuple(found) or None


def _safe_copy(stock):
    @functools.wraps(stock)
    def _copy_to_local(self):
        key = _kind(self)
        if key is None:
            return stock(self)
        with _gate.passage(key):
            return stock(self)

    _copy_to_local._kfit_ps_stock = stock
    return _copy_to_local


def _cluster_change(stock):
    @functools.wraps(stock)
    def change(self, *args, **kwargs):
        with _gate.passage(None):
            try:
                return stock(self, *args, **kwargs)
            finally:
                _gate.reset()

    change._kfit_ps_stock = stock
    return change


def install_safe_result_copies():
    """Installs the gate once per process; idempotent and thread-safe."""
    with _install_lock:
        impl = coordinator_values.RemoteValueImpl
        if hasattr(impl._copy_to_local, "_kfit_ps_stock"):
            return
        check_versions()
        impl._copy_to_local = _safe_copy(impl._copy_to_local)
        for name in ("set_server_def", "update_server_def"):
            setattr(context.Context, name, _cluster_change(getattr(context.Context, name)))
