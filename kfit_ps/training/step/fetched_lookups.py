"""Sharded tables' lookups fetched with a training step's packed reads.

A `keras.layers.Embedding` whose table is sharded over the ps tasks looks its
rows up with one gather per shard, on that shard's ps: two transfers per
table and ps in every step (the ids there, the rows back). On the DLRM job (5
sharded tables, 2 ps) those were 20 of a step's 26 transfers. When the model
calls such a layer once, on one of its own inputs
(`_tf_compat.embedding_inputs`), its ids are known before the forward pass,
so a training step (`FetchedRows`; evaluation and prediction steps too, without
the gradient):

- takes each table's unique ids in the batch on the worker (Criteo's ids
  repeat within a batch) and splits them by shard ("div" layout);
- sends every table's ids bound for a ps in one transfer, and gathers their
  rows there into that ps' packed read (`transfers.PackedReads.
  read_and_gather`), which comes back in one transfer;
- answers a lookup of those very ids (the batch's tensor, or it cast or
  reshaped) from those rows on the worker
  (`_tf_compat.CachedReadScope.fetched_lookup`), and takes the gradient
  with respect to them: one summed row per unique id, which the table's
  sparse update (`sparse_updaters.ShardedVariableUpdater`)
  sends to its ps. Any other lookup of the table (another layer's `ops.take`
  on it) reads the table as before, and its gradient rows join these.

The rows are read at the start of the step, as the packed reads are. Tables
whose optimizer has no sparse update, and any other lookup, keep the
per-shard lookup of the forward pass.
"""

import keras
import numpy as np
import tensorflow as tf

from kfit_ps import _tf_compat


def fetched_tables(model, training=True, held=()):
    """[(index in the model's flat inputs, Keras variable)] of the tables a step fetches
    rows of. In training: trainable ones with a sparse update by the model's optimizer.
    Otherwise all, except those in `held` (a snapshot's variables, read whole)."""
    trainable = {id(v) for v in model.trainable_variables}
    held = {id(v) for v in held}
    tables = []
    for index, layer in _tf_compat.embedding_inputs(model):
        variable = _tf_compat.embedding_table(layer)
        if training:
            fetched = (id(variable) in trainable and _tf_compat.optimizer_slots(
                model.optimizer, variable) is not None)
        else:
            fetched = id(variable) not in held
        if fetched:
            tables.append((index, variable))
    return tables


def _same_ids_as_input(tensor):
    """Whether `tensor` holds its op's first input's ids, in order: a model's or a layer's
    conversion of ids (`Functional._standardize_inputs`, `Embedding.call`): a reshape, or a
    cast to integers (of integers, or of floats, truncated as `Embedding.call` does)."""
    op = getattr(tensor, "op", None)
    if op is None or op.control_inputs:
        return False
    return op.type in ("Identity", "ExpandDims", "Squeeze", "Reshape") or (
        op.type == "Cast" and tensor.dtype.is_integer)


class _Table:
    """One table's unique ids of the batch, split by shard, and the rows that come back."""

    def __init__(self, variable, ids):
        self.variable = variable
        self.input = ids  # The batch's tensor: only lookups of its values are answered here.
        self.shards = _tf_compat.shards(variable)
        self.width = self.shards[0].shape[1:]
        ends = np.cumsum([shard.shape[0] for shard in self.shards]).astype(np.int64)
        ids = tf.reshape(ids, [-1])
        if ids.dtype != tf.int64:
            ids = tf.cast(ids, tf.int64)
        unique, self.where = tf.unique(ids)
        self.unique = unique
        self.size = int(ends[-1])
        shard = tf.minimum(tf.searchsorted(ends, unique, side="right"), len(ends) - 1)
        starts = tf.constant(np.concatenate([[0], ends[:-1]]), tf.int64)
        count = len(self.shards)
        self.ids = tf.dynamic_partition(unique - tf.gather(starts, shard), shard, count)
        self.smallest, self.largest = tf.reduce_min(unique), tf.reduce_max(unique)
        self.in_range = tf.logical_and(self.smallest >= 0,  # (No ids: true.)
                                       self.largest < self.size)
        self.positions = tf.dynamic_partition(tf.range(tf.size(unique)), shard, count)
        self.rows = None  # One tensor per shard, on this worker.

    def lookup(self, indices):
        """The rows of `indices`, or None unless they are this table's batch ids: the tensor
        itself, or it cast or reshaped (as a model and `Embedding.call` may convert it)."""
        if _source(indices) is not self.input:  # (`self.input` is a source itself.)
            return None
        indices = tf.convert_to_tensor(indices)
        rows = tf.gather(tf.dynamic_stitch(self.positions, self.rows), self.where)
        shape = indices.shape.concatenate(self.width)
        rows = tf.reshape(rows, tf.concat([tf.shape(indices), self.width.as_list()], axis=0))
        rows.set_shape(shape)
        return rows


def _checked(tables):
    """A check, for the ids' transfer to wait for, that every id is a row of its table; it
    fails as Keras' own lookup would, naming each table with its rows and the batch's
    smallest and largest id in it."""
    data = ["kfit_ps: Embedding ids must be in [0, input_dim); the batch's smallest and "
            "largest id of each table:"]
    for table in tables:
        data += [f"{table.variable.path} ({table.size} rows):", table.smallest, table.largest]
    in_range = tf.reduce_all(tf.stack([table.in_range for table in tables]))
    return tf.raw_ops.Assert(condition=in_range, data=data, summarize=2)


def _source(ids):
    """The batch's tensor that `ids` (a model input as the model converts it) comes from."""
    while _same_ids_as_input(ids):
        ids = ids.op.inputs[0]
    return ids


class FetchedRows:
    """A training step's fetched lookups (`train_step_with(..., fetched=)`).

    `gathers` go to `PackedReads.read_and_gather`; `arrived(rows)` takes what
    it returned. Then `lookups` serve the forward pass, the tape watches
    `rows`, and `gradients(grads)` gives each table's unique ids and summed
    gradient rows per shard.
    """

    def __init__(self, model, tables, data):
        self._tables = []
        if tables:
            x = keras.utils.unpack_x_y_sample_weight(data)[0]
            flat = _tf_compat.standardized_inputs(model, x)
            self._tables = [_Table(variable, _source(flat[index])) for index, variable in tables
                            if isinstance(flat[index], tf.Tensor)]  # Not sparse or ragged.
        self.gathers = []
        if self._tables:
            with tf.control_dependencies([_checked(self._tables)]):
                self.gathers = [(shard, tf.identity(ids)) for table in self._tables
                                for shard, ids in zip(table.shards, table.ids)]
        self.lookups = {}
        self.rows = []

    def arrived(self, rows):
        position = 0
        for table in self._tables:
            table.rows = rows[position:position + len(table.shards)]
            position += len(table.shards)
            self.lookups[id(table.variable)] = table.lookup
        self.rows = list(rows)

    def gradients(self, grads):
        """{id(variable): [(unique shard row ids, their summed gradient rows) or None] per
        shard}, from `grads`, the tape's gradients with respect to `rows` (None: the
        lookup was not used)."""
        found, position = {}, 0
        for table in self._tables:
            count = len(table.shards)
            found[id(table.variable)] = [None if g is None else (ids, tf.convert_to_tensor(g))
                                         for ids, g in zip(table.ids,
                                                           grads[position:position + count])]
            position += count
        return found
