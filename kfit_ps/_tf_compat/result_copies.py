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
host, where a thread is preempted inside `Run`. Reproduced with TensorFlow alone
(threads copying worker tensors to the chief while new remote parts instantiate).

`install_safe_result_copies()` wraps `_copy_to_local` with a gate: a copy whose kind
(each tensor's device and dtype: what the copy instantiates for) was copied before in
this generation runs beside others (shared); a copy of a new kind, which may
instantiate, runs alone (exclusive), after the copies in flight and before any other
starts. The decision is taken once the copy may enter, so a change that makes kinds
new while it waits is seen. A generation ends where TensorFlow drops what it
instantiated: a change of the eager cluster (`Context.set_server_def` /
`update_server_def`, TensorFlow's recovery of a worker included) and a clear of its
kernel cache (`clear_kernel_cache`, a global seed set); while a cluster change runs
(a recovery waits for its worker), every copy counts as new: copies go on, one at a
time. Each wait is bounded (`_WAIT_SECONDS`): behind a copy stuck on a stopped worker a
copy waits that long, then runs beside it (as with TensorFlow alone), with a warning.

The chief's own reads of ps variables go through the same parts (a Keras variable's
`numpy()` reads it on the chief); `read_where_it_lives` reads on the variable's task
instead, which instantiates nothing on the chief: the progress bar polls with it while
functions run. A user's callback that reads ps variables during `fit` is not gated.
"""

import contextlib
import functools
import logging
import threading
import time

from tensorflow.python.distribute import input_lib
from tensorflow.python.distribute.coordinator import values as coordinator_values
from tensorflow.python.eager import context
from tensorflow.python.framework import composite_tensor, ops
from tensorflow.python.ops import array_ops
from tensorflow.python.util import nest

from kfit_ps._tf_compat.versions import check_versions

log = logging.getLogger("kfit_ps.cluster")

_WAIT_SECONDS = 30.0
_install_lock = threading.Lock()


class _Gate:
    """A readers-writer gate for copies: known kinds shared, new kinds exclusive, writers
    first; bounded waits; a thread inside the gate passes again without waiting."""

    def __init__(self, wait=_WAIT_SECONDS):
        self.wait = wait
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._writers_waiting = 0
        self._seen = set()
        self._generation = 0
        self._changing = 0
        self._warned = False
        self._inside = threading.local()

    def _enter(self, key):
        """Waits until a copy of `key` may run; returns `(exclusive, generation)`, the
        generation None when the bound passed (the copy then runs shared)."""
        deadline = time.monotonic() + self.wait
        writer = False
        with self._cond:
            try:
                while True:
                    new = self._changing > 0 or key not in self._seen
                    if new != writer:
                        self._writers_waiting += 1 if new else -1
                        writer = new
                    if not self._exclusive and not (self._shared if new
                                                    else self._writers_waiting):
                        if new:
                            self._exclusive = True
                        else:
                            self._shared += 1
                        return new, self._generation
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self._shared += 1
                        self._warn()
                        return False, None
                    self._cond.wait(left)
            finally:
                if writer:
                    self._writers_waiting -= 1

    def _warn(self):
        if not self._warned:
            self._warned = True
            log.warning("kfit_ps: a copy of a result to the chief waited %.0f s for another "
                        "copy (a worker that stopped answering?); it runs beside it (said once)",
                        self.wait)

    def _leave(self, exclusive):
        with self._cond:
            if exclusive:
                self._exclusive = False
            else:
                self._shared -= 1
            self._cond.notify_all()

    @contextlib.contextmanager
    def passage(self, key):
        """Runs its block as a copy of kind `key`; `key` is known from then on in this
        generation, once the block ran without error."""
        if getattr(self._inside, "depth", 0):
            self._inside.depth += 1
            try:
                yield
            finally:
                self._inside.depth -= 1
            return
        exclusive, generation = self._enter(key)
        self._inside.depth = 1
        try:
            yield
            with self._cond:
                if generation == self._generation and not self._changing:
                    self._seen.add(key)
        finally:
            self._inside.depth = 0
            self._leave(exclusive)

    @contextlib.contextmanager
    def new_generation(self):
        """Around what drops TensorFlow's instantiated parts: every kind is new during it
        and after it."""
        with self._cond:
            self._changing += 1
            self._generation += 1
            self._seen.clear()
        try:
            yield
        finally:
            with self._cond:
                self._changing -= 1
                self._generation += 1
                self._seen.clear()
                self._cond.notify_all()


_gate = _Gate()


def _tensor_kind(tensor):
    return tensor.device, str(tensor.dtype)  # (a new shape instantiates nothing)


def _kind(remote_value):
    """The device and dtype of each tensor a remote value holds (what its copy
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


def _new_generation(stock):
    @functools.wraps(stock)
    def drop(self, *args, **kwargs):
        with _gate.new_generation():
            return stock(self, *args, **kwargs)

    drop._kfit_ps_stock = stock
    return drop


# What makes TensorFlow instantiate every part again: a new cluster, a cleared kernel cache.
_GENERATION_ENDS = ("set_server_def", "update_server_def", "clear_kernel_cache",
                    "_set_global_seed")


def install_safe_result_copies():
    """Installs the gate once per process; idempotent and thread-safe."""
    with _install_lock:
        impl = coordinator_values.RemoteValueImpl
        if hasattr(impl._copy_to_local, "_kfit_ps_stock"):
            return
        check_versions()
        impl._copy_to_local = _safe_copy(impl._copy_to_local)
        for name in _GENERATION_ENDS:
            setattr(context.Context, name, _new_generation(getattr(context.Context, name)))


def read_where_it_lives(variable):
    """The value of `variable` (a Keras or TensorFlow variable) as a NumPy value, read on
    the task that holds it: nothing instantiates on the chief (`variable.numpy()` reads on
    the chief, through the parts the gate orders)."""
    value = getattr(variable, "value", variable)
    with ops.device(value.device):
        return array_ops.identity(value).numpy()
