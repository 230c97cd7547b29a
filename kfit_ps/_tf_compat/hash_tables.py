"""Resources on a ps with names of our own: mutable hash tables and critical sections.

Dynamic embedding tables live on the ps tasks and are read by functions that
run on the workers, some inside tf.data (the worker-read evaluation's
`reduce`). An *anonymous* table is known only to the eager runtime that
created it: tf.data's function runtime, reaching the ps through its worker
service, reports "Resource Anonymous/... does not exist". A named table sits
in the device's resource manager, which both runtimes share. TensorFlow names
eager tables `table_<n>` with a per-process counter, so a new chief could
reach a table an earlier chief left on a ps that kept running; this class
names each table with a UUID instead (`_shared_name`, read by
`MutableHashTable._create_resource`).

A `tf.CriticalSection` created eagerly takes its mutex's shared name from its
`name`, as given (eager name scopes are not made unique): two tables' `lock_0`
on one ps, or a rebuilt model's, were one mutex, and a step that updated two
tables waited on itself for ever. `critical_section` names each mutex with a
UUID as well. `section_for` keeps one per owner (a layer, a seed generator) and
makes a new one once the guarded variable's resource is new (a ps recovered in
place makes its variables, and with them its resources, again).

Each section `critical_section` makes runs (`execute`) only after the previous
one traced into the same graph has released its lock, so a function holds one of its own
locks at a time. Without it, `tf.function`'s automatic control dependencies
chain every release (`ConsumeMutexLock`, stateful with no resource input) in
trace order, but a lock (`MutexLock`) only after earlier uses of its own
mutex: an unrolled step k+1 took one section's lock early and its release
then waited for step k's release of another section's, whose lock the other
worker held, waiting likewise. With two sections in a step (two seed
generators, a renorm layer and a Dropout) two workers at
`steps_per_execution=10` hung in 3 of 4 runs, with nothing printed. Every
critical section of kfit_ps is made by `critical_section`, so each is in the
chain by construction.
"""

import threading
import uuid

import tensorflow as tf

from kfit_ps._tf_compat.versions import check_versions

_sections_lock = threading.Lock()
_RELEASED = "_kfit_ps_section_released"  # on a graph: a tensor after its last section's release


class _NamedMutableHashTable(tf.lookup.experimental.MutableHashTable):
    def __init__(self, *args, unique_name, **kwargs):
        self._kfit_shared_name = unique_name
        super().__init__(*args, **kwargs)

    def _create_resource(self):
        self._shared_name = self._kfit_shared_name
        return super()._create_resource()


def _unique(name):
    return f"kfit_ps_{name}_{uuid.uuid4().hex}"


def hash_table(key_dtype, value_dtype, default_value, device, name):
    """A `MutableHashTable` on `device` with a unique shared name, created eagerly."""
    check_versions()
    with tf.init_scope(), tf.device(device):
        return _NamedMutableHashTable(
            key_dtype, value_dtype, default_value=default_value, name=name,
            unique_name=_unique(name))


class _OrderedSection(tf.CriticalSection):
    """A `tf.CriticalSection` whose `execute` takes its lock after the previous section of
    the graph being traced released its own (eagerly: at once, as execution is in order).

    The marker lives on the graph itself: a table keyed by graph whose values are
    tensors of that graph would keep every traced graph alive."""

    @tf.autograph.experimental.do_not_convert  # TensorFlow's own `execute` is not converted
    def execute(self, fn, exclusive_resource_access=True, name=None):
        run = super().execute
        if tf.executing_eagerly():
            return run(fn, exclusive_resource_access=exclusive_resource_access, name=name)
        graph = tf.compat.v1.get_default_graph()
        previous = getattr(graph, _RELEASED, None)
        with tf.control_dependencies([] if previous is None else [previous]):
            outputs = run(fn, exclusive_resource_access=exclusive_resource_access, name=name)
        # TensorFlow returns fn's results through identities made after the release.
        after = [t for t in tf.nest.flatten(outputs, expand_composites=True)
                 if isinstance(t, (tf.Tensor, tf.Operation))]
        if after:
            setattr(graph, _RELEASED, after[0])
        return outputs


def critical_section(device, name):
    """A `tf.CriticalSection` on `device` whose mutex no other critical section shares, and
    whose `execute` is in order with the other sections of the function being traced."""
    with tf.init_scope(), tf.device(device):
        return _OrderedSection(name=name, shared_name=_unique(name))


def section_for(owner, inner, name):
    """`owner`'s critical section on `inner`'s device, made once per resource of `inner`
    (whichever thread traces first)."""
    attribute = f"_kfit_ps_section_{name}"
    with _sections_lock:
        cached = owner.__dict__.get(attribute)
        if cached is None or cached[0] is not inner.handle:
            cached = (inner.handle, critical_section(inner.device, name))
            owner.__dict__[attribute] = cached
    return cached[1]
