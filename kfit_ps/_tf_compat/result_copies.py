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
time. A change starts only once the copies inside have left, so a copy admitted as
known never instantiates beside another. Copies enter in the order they came. A copy
inside for `_STUCK_SECONDS` (a worker that stopped answering: TensorFlow's copy has no
deadline) no longer holds the others back: they go on as if it had left (as with
TensorFlow alone), and a warning names its worker.

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

import keras

from tensorflow.python.distribute import input_lib
from tensorflow.python.distribute.coordinator import values as coordinator_values
from tensorflow.python.eager import context
from tensorflow.python.framework import composite_tensor, ops
from tensorflow.python.ops import array_ops
from tensorflow.python.util import nest

from kfit_ps._tf_compat.keras_variables import storage
from kfit_ps._tf_compat.versions import check_versions

log = logging.getLogger("kfit_ps.cluster")

_STUCK_SECONDS = 10.0
_install_lock = threading.Lock()


class _Holder:
    """A copy inside the gate: alone or not, since when, of what kind, and whether it was
    said to be stuck."""

    __slots__ = ("exclusive", "since", "key", "said")

    def __init__(self, exclusive, key):
        self.exclusive, self.since, self.key, self.said = exclusive, time.monotonic(), key, False


class _Gate:
    """A readers-writer gate for copies: known kinds shared, new kinds exclusive, in the
    order they came (a writer waits for the copies before it, not after); a thread inside
    the gate passes again without waiting.

    A copy inside for `stuck` seconds (a worker that stopped answering: TensorFlow's copy
    has no deadline) no longer holds the others back: they enter as if it had left, and a
    warning names its device once per such copy.
    """

    def __init__(self, stuck=_STUCK_SECONDS):
        self.stuck = stuck
        self._cond = threading.Condition()
        self._holders = set()
        self._writers = []  # tickets of the copies of new kinds waiting, in order
        self._tickets = 0
        self._seen = set()
        self._generation = 0
        self._changing = 0
        self._inside = threading.local()

    def _active(self, now):
        """The holders not stuck."""
        return [holder for holder in self._holders if now - holder.since < self.stuck]

    def _wait_time(self, active, now):
        """How long until something can change without a notify: an active holder turning
        stuck."""
        if not active:
            return None
        return max(0.001, min(holder.since + self.stuck - now for holder in active))

    def _enter(self, key):
        """Waits until a copy of `key` may run; returns its `_Holder` and the generation."""
        stuck = []
        try:
            with self._cond:
                return self._admit(key, stuck)
        finally:
            for holder in stuck:  # (after the lock: logging may block)
                self._say_stuck(holder)

    def _admit(self, key, stuck):
        ticket, self._tickets = self._tickets, self._tickets + 1
        writer = False
        try:
            while True:
                now = time.monotonic()
                active = self._active(now)
                for holder in self._holders.difference(active):
                    if not holder.said:  # newly found stuck: said once, after the lock
                        holder.said = True
                        stuck.append(holder)
                new = self._changing > 0 or key not in self._seen
                if new != writer:
                    if new:
                        self._writers.append(ticket)
                    else:  # Another thread copied this kind meanwhile.
                        self._writers.remove(ticket)
                        self._cond.notify_all()
                    writer = new
                first_writer = min(self._writers, default=None)
                if new:
                    free = not active and first_writer == ticket
                else:
                    free = (not any(holder.exclusive for holder in active)
                            and (first_writer is None or first_writer > ticket))
                if free:
                    holder = _Holder(new, key)
                    self._holders.add(holder)
                    return holder, self._generation
                self._cond.wait(self._wait_time(active, now))
        finally:
            if writer:
                self._writers.remove(ticket)
                self._cond.notify_all()

    def _say_stuck(self, holder):
        devices = sorted({part[0] for part in holder.key or () if isinstance(part, tuple)})
        log.warning("kfit_ps: a copy of a result to the chief from %s has run for %.0f s (a "
                    "worker that stopped answering?); the other copies go on beside it",
                    ", ".join(devices) or "a worker", self.stuck)

    def _leave(self, holder):
        with self._cond:
            self._holders.discard(holder)
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
        holder = None
        try:
            holder, generation = self._enter(key)
            self._inside.depth = 1
            yield
            with self._cond:
                if generation == self._generation and not self._changing:
                    self._seen.add(key)
        finally:
            self._inside.depth = 0
            if holder is not None:
                self._leave(holder)

    @contextlib.contextmanager
    def new_generation(self):
        """Around what drops TensorFlow's instantiated parts: every kind is new during it
        and after it. It starts once the copies inside have left (or are stuck): a copy
        admitted as known must not instantiate beside others."""
        with self._cond:
            self._changing += 1
            self._generation += 1
            self._seen.clear()
            while True:
                now = time.monotonic()
                active = self._active(now)
                if not active:
                    break
                self._cond.wait(self._wait_time(active, now))
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
    """The value of `variable` (a Keras variable, or a TensorFlow one, held by one task) as
    a NumPy value, read on that task: nothing instantiates on the chief
    (`variable.numpy()` reads on the chief, through the parts the gate orders)."""
    held = storage(variable) if isinstance(variable, keras.Variable) else variable
    device = getattr(held, "device", None)
    if not isinstance(device, str) or not device:
        raise TypeError(f"read_where_it_lives: {variable!r} is not held by one task "
                        "(a sharded variable?); read it with `.numpy()`")
    with ops.device(device):
        return array_ops.identity(held).numpy()
