"""Mutable hash tables with a name of our own, so every runtime on their ps finds them.

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


def hash_table(key_dtype, value_dtype, default_value, device, name):
    """A `MutableHashTable` on `device` with a unique shared name, created eagerly."""
    check_versions()
    with tf.init_scope(), tf.device(device):
        return _NamedMutableHashTable(
            key_dtype, value_dtype, default_value=default_value, name=name,
            unique_name=f"kfit_ps_{name}_{uuid.uuid4().hex}")
