"""Packed transfers: one gRPC call per ps and dtype per step, not one per variable.

Inside a scheduled function every tensor that crosses between the worker and
a ps is its own remote call (TensorFlow's `RecvTensor`). A model with many
small variables (a DLRM has 26 tables and an MLP) would make about a hundred
such calls per step, and on a small machine the ps tasks spend most of their
time answering them. So a training step moves values in bundles:

- **Reads** (`PackedReads`): the model's unsharded variables of at most
  `KFIT_PS_PACKED_READ_MAX_BYTES` are read whole, concatenated on their ps,
  fetched in one transfer per ps and dtype, and split on the worker; the
  forward pass reads them from there (`_tf_compat.CachedReadScope`). Larger
  variables (an unsharded embedding table) and sharded tables keep their
  per-use reads, so only the rows a batch touches move. A sharded evaluation
  reads every variable of at most `KFIT_PS_SNAPSHOT_READ_MAX_BYTES`, sharded
  tables included, once per evaluated shard instead (nothing changes them
  while it runs), so its batches make no call to a ps (except the lookups of
  a `DynamicEmbedding`, whose rows stay in its hash tables on the ps).
- **Gradients** (`Outbox`): every gradient bound for a ps (dense, or the
  rows and ids of an embedding's gradient) is packed on the worker and sent
  in one transfer per dtype; the update then runs on the ps from there.

Each ps still sees every read and update of its variables; only the number
of calls changes. Reads are taken once at the start of a step, where
TensorFlow's own function reads each variable when an op first needs it:
both are "some time during the step" under asynchronous training.
"""

import numpy as np
import tensorflow as tf

from kfit_ps import _tf_compat, constants


def _flat(tensors):
    flat = [tf.reshape(t, [-1]) for t in tensors]
    return flat[0] if len(flat) == 1 else tf.concat(flat, axis=0)


def _is_ps_device(device):
    return "/job:ps" in (device or "")


class PackedReads:
    """Whole-value reads of a model's small variables, one transfer per ps and dtype.

    `sharded=True` also reads sharded variables of at most `max_bytes` whole:
    each shard is read on its ps with that ps' other variables, and the
    shards are joined on the worker (a sharded evaluation's snapshot).
    """

    def __init__(self, variables, max_bytes=None, sharded=False):
        max_bytes = constants.packed_read_max_bytes() if max_bytes is None else max_bytes
        self._variables = []  # [(variable, [its tf.Variable parts])]
        self._groups = {}  # (device, dtype) -> [parts]
        for variable in variables:
            if not _tf_compat.is_kfit_variable(variable) or (
                    not sharded and _tf_compat.sharded_storage(variable) is not None):
                continue
            parts = _tf_compat.shards(variable)
            if any(p is None or not _is_ps_device(p.device) or not p.shape.is_fully_defined()
                   for p in parts):
                continue
            if sum(p.shape.num_elements() * p.dtype.size for p in parts) > max_bytes:
                continue
            self._variables.append((variable, parts))
            for part in parts:
                self._groups.setdefault((part.device, part.dtype), []).append(part)

    @property
    def variables(self):
        return [variable for variable, _ in self._variables]

    def read(self):
        """[(variable, tensor on this worker)], inside a traced function."""
        return self.read_and_gather(())[0]

    def read_and_gather(self, gathers):
        """`(read(), rows)`: the reads, and rows of sharded tables gathered with them.

        `gathers`: [(a variable's shard on a ps, int64 row ids made on this
        worker)]. Their ids go to each ps in one transfer, and the rows come
        back in that ps' packed read; `rows` are the gathered rows on this
        worker, in the order of `gathers`.
        """
        groups = {key: [(part, None) for part in parts] for key, parts in self._groups.items()}
        by_device = {}
        for i, (part, ids) in enumerate(gathers):
            by_device.setdefault(part.device, []).append(i)
        for device, indices in by_device.items():  # One transfer of ids per ps.
            arrived = send(device, [gathers[i][1] for i in indices])
            for i, ids in zip(indices, arrived):
                part = gathers[i][0]
                groups.setdefault((device, part.dtype), []).append((part, (i, ids)))
        values, rows = {}, [None] * len(gathers)  # id(part) -> its value on this worker
        for (device, _), members in groups.items():
            with tf.device(device):  # Concatenated on the ps: one tensor leaves it.
                packed = _flat([part.read_value() if gather is None
                                else tf.gather(part, gather[1]) for part, gather in members])
            if len(members) == 1:
                pieces = [packed]
            elif all(gather is None for _, gather in members):
                pieces = tf.split(packed, [part.shape.num_elements() for part, _ in members])
            else:
                pieces = tf.split(packed, tf.stack([
                    tf.constant(part.shape.num_elements(), tf.int64) if gather is None
                    else tf.size(gathers[gather[0]][1], out_type=tf.int64)
                    * part.shape[1:].num_elements() for part, gather in members]),
                    num=len(members))
            for (part, gather), piece in zip(members, pieces):
                if gather is None:
                    values[id(part)] = tf.reshape(piece, part.shape)
                else:
                    rows[gather[0]] = tf.reshape(piece, [-1] + part.shape[1:].as_list())
        values = [(variable, values[id(parts[0])] if len(parts) == 1
                   else tf.concat([values[id(p)] for p in parts], axis=0))
                  for variable, parts in self._variables]
        return values, rows


def send(device, parts):
    """`parts` (tensors made on this worker) as tensors on `device`; one transfer per dtype.

    Shapes known when tracing are kept. The others travel in a small int64 header
    with the int64 parts: each such part's element count (the sizes its pack is
    split by), then the whole shape of a part that one count cannot rebuild (more
    than one unknown dimension, or a known one of 0). The header is split once on
    `device`, so a part costs no op of its own there beyond its reshape.
    """
    dynamic = [i for i, p in enumerate(parts) if not p.shape.is_fully_defined()]
    whole = [i for i in dynamic if not _one_count_rebuilds(parts[i].shape)]
    by_dtype = {}
    for i, part in enumerate(parts):
        by_dtype.setdefault(part.dtype, []).append(i)
    packs = {dtype: _flat([parts[i] for i in indices]) for dtype, indices in by_dtype.items()}
    ranks = [parts[i].shape.rank for i in whole]
    if dynamic:
        header = _flat([tf.stack([tf.size(parts[i], out_type=tf.int64) for i in dynamic])]
                       + [tf.shape(parts[i], out_type=tf.int64) for i in whole])
        packs[tf.int64] = tf.concat([header, packs[tf.int64]], 0) if tf.int64 in packs \
            else header
    received = [None] * len(parts)
    with tf.device(device):
        arrived = {dtype: tf.identity(pack) for dtype, pack in packs.items()}
        counts, shapes = None, {}
        if dynamic:
            widths = [len(dynamic)] + ranks  # SplitV infers the rest's static length.
            pieces = tf.split(arrived[tf.int64], widths + [-1], num=len(widths) + 1)
            counts, arrived[tf.int64] = pieces[0], pieces[-1]
            shapes = dict(zip(whole, pieces[1:-1]))
        position = {i: k for k, i in enumerate(dynamic)}
        for dtype, indices in by_dtype.items():
            if len(indices) == 1:
                split = [arrived[dtype]]
            elif any(i in position for i in indices):
                split = tf.split(arrived[dtype], _sizes(indices, parts, position, counts),
                                 num=len(indices))
            else:
                split = tf.split(arrived[dtype], [parts[i].shape.num_elements() for i in indices])
            for i, piece in zip(indices, split):
                received[i] = _shaped(piece, parts[i].shape, shapes.get(i))
    return received


def _one_count_rebuilds(shape):
    """Whether a part of `shape` is rebuilt from its element count alone: one unknown
    dimension, and no known one of 0 (a reshape to -1 there is ambiguous)."""
    if shape.rank is None:
        raise ValueError(f"transfers.send: a part of unknown rank cannot travel; received a "
                         f"part of shape {shape}. Give it a known rank (tf.ensure_shape).")
    dims = shape.as_list()
    return dims.count(None) == 1 and 0 not in dims


def _sizes(indices, parts, position, counts):
    """The element counts of `indices`' parts, as one int64 vector on this device: a slice of
    `counts` where they are its consecutive entries, else gathered beside the static ones."""
    wanted = [position.get(i) for i in indices]
    if None not in wanted and wanted == list(range(wanted[0], wanted[0] + len(wanted))):
        return counts if len(wanted) == counts.shape[0] else \
            counts[wanted[0]:wanted[0] + len(wanted)]
    static = [parts[i].shape.num_elements() if position.get(i) is None else 0 for i in indices]
    table = tf.concat([counts, tf.constant(static, tf.int64)], 0)
    offset = len(position)
    return tf.gather(table, [offset + k if w is None else w for k, w in enumerate(wanted)])


def _shaped(piece, shape, whole_shape):
    """`piece` (flat) with `shape`; `whole_shape`: its travelled shape, where one count could
    not rebuild it."""
    if whole_shape is not None:
        value = tf.reshape(piece, whole_shape)
    elif shape.rank == 1:
        value = piece
    else:
        value = tf.reshape(piece, [-1 if d is None else d for d in shape.as_list()])
    value.set_shape(shape)
    return value


class Outbox:
    """Values bound for ps devices, delivered in one packed transfer per device and dtype."""

    def __init__(self):
        self._parts = {}
        self._received = None

    def _put(self, device, tensor):
        parts = self._parts.setdefault(device, [])
        parts.append(tensor)
        return device, len(parts) - 1

    def put(self, device, value, dense_shape=None):
        """Queues a tensor or `IndexedSlices` for `device`; returns a handle for `get`.

        `dense_shape`: the static shape of an `IndexedSlices`' variable (so it
        does not travel).
        """
        if not _is_ps_device(device):
            return ("here", value)
        if isinstance(value, tf.IndexedSlices):
            shape = value.dense_shape if dense_shape is None else tf.constant(
                np.asarray(dense_shape, np.int64))
            return ("slices", self._put(device, value.values),
                    self._put(device, tf.cast(value.indices, tf.int64)), shape)
        return ("tensor", self._put(device, tf.convert_to_tensor(value)))

    def deliver(self):
        self._received = {device: send(device, parts) for device, parts in self._parts.items()}

    def get(self, handle):
        kind = handle[0]
        if kind == "here":
            return handle[1]
        if kind == "tensor":
            device, index = handle[1]
            return self._received[device][index]
        (device, values), (_, indices), shape = handle[1], handle[2], handle[3]
        with tf.device(device):
            return tf.IndexedSlices(self._received[device][values],
                                    self._received[device][indices], shape)
