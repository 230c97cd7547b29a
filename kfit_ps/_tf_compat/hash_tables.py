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
UUID as well.
"""

import uuid

import tensorflow as tf

from kfit_ps._tf_compat.versions import check_versions


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


def critical_section(device, name):
    """A `tf.CriticalSection` on `device` whose mutex no other critical section shares."""
    with tf.init_scope(), tf.device(device):
        return tf.CriticalSection(name=name, shared_name=_unique(name))
