"""One updater per kind of sparse table: gather the touched rows' gradients, update on the ps.

`GradientStep` (`sharded_updates`) takes a step's gradients and hands each
sparse table to its updater, which has two halves around the step's packed
transfer (`transfers.Outbox`):

- `send(outbox)`, on the worker: sums the gradient rows of each touched id
  (an id used twice in a batch, or a layer called twice in a step, gives one
  row) and queues the ids and rows for the shard's ps;
- `apply(outbox, scalars_on)`, built under the shard's device: reads the
  touched rows and their slots there, runs
  `embeddings.sparse_optimizer.SparseOptimizer.apply` (Keras' `apply` for
  those rows) and writes them back. No row or slot leaves its ps.

The two kinds:

- `ShardedVariableUpdater`: a Keras variable split over the ps tasks (a
  `variable_partitioner`); its slots are Keras' own slot variables, sharded
  the same way. Rows move by `scatter_add` of their change, so two workers'
  updates of one row both land, as `assign_sub` does for a dense variable.
  A constraint that spans rows (`MaxNorm()` over axis 0) is applied to the
  whole variable afterwards, as Keras does.
- `DynamicTableUpdater`: a `DynamicEmbedding`'s table; the update of a shard
  runs in that shard's lock (`embeddings.table`).
"""

import tensorflow as tf

from kfit_ps import _tf_compat
from kfit_ps.embeddings import sparse_optimizer


def unique_rows(gradient, rows):
    """(unique row ids, summed gradient rows) of an IndexedSlices or dense gradient, or of
    such a pair already (a fetched lookup's, `fetched_lookups`)."""
    if isinstance(gradient, tuple):
        return gradient
    if isinstance(gradient, tf.IndexedSlices):
        ids, positions = tf.unique(tf.cast(gradient.indices, tf.int64))
        values = tf.math.unsorted_segment_sum(gradient.values, positions, tf.size(ids))
        return ids, values
    return tf.range(rows, dtype=tf.int64), gradient


def _dense_rows(gradient, rows):
    if isinstance(gradient, tf.IndexedSlices):
        return tf.math.unsorted_segment_sum(gradient.values, gradient.indices, rows)
    return gradient


class ShardedVariableUpdater:
    """The touched rows of one sharded Keras variable, with Keras' slot variables."""

    def __init__(self, optimizer, variable, slots, gradients):
        self.variable = variable
        self.optimizer = sparse_optimizer.SparseOptimizer.for_variable(optimizer, variable)
        self.whole_constraint = (None if sparse_optimizer.row_constraint(variable.constraint)
                                 else variable.constraint)
        self.shards = _tf_compat.shards(variable)
        self.slot_shards = {name: _tf_compat.shards(slot) for name, slot in slots.items()}
        self.gradients = gradients  # One per shard, None where no row was touched.
        self._sent = []

    @property
    def devices(self):
        return {shard.device for shard, g in zip(self.shards, self.gradients) if g is not None}

    def send(self, outbox):
        for j, (shard, grad) in enumerate(zip(self.shards, self.gradients)):
            if grad is not None:  # Duplicates summed on the worker: U rows leave it.
                ids, g = unique_rows(grad, shard.shape[0])
                self._sent.append((j, outbox.put(shard.device, ids),
                                   outbox.put(shard.device, g)))

    def apply(self, outbox, scalars_on):
        for j, ids, g in self._sent:
            shard = self.shards[j]
            with tf.device(shard.device):  # The ps updates its rows and slots in place.
                ids, g = outbox.get(ids), outbox.get(g)
                learning_rate, step = scalars_on(shard.device)
                slots = {name: parts[j] for name, parts in self.slot_shards.items()}
                old = {name: tf.gather(slot, ids) for name, slot in slots.items()}
                if self.optimizer.needs_rows:  # Decay or constraint: the rows are read.
                    rows = tf.gather(shard, ids)
                    new_rows, new_slots = self.optimizer.apply(rows, old, g, learning_rate,
                                                               step)
                    change = new_rows - rows
                else:
                    change, new_slots = self.optimizer.change(old, g, learning_rate, step,
                                                              shard.dtype)
                for name, slot in slots.items():
                    slot.scatter_update(tf.IndexedSlices(new_slots[name], ids))
                shard.scatter_add(tf.IndexedSlices(change, ids))
        if self.whole_constraint is not None and self._sent:
            value = tf.concat([tf.convert_to_tensor(shard) for shard in self.shards], axis=0)
            value = self.whole_constraint(value)
            start = 0
            for shard in self.shards:
                rows = shard.shape[0]
                with tf.device(shard.device):
                    shard.assign(value[start:start + rows])
                start += rows


class DynamicTableUpdater:
    """The touched rows of one `DynamicEmbedding` table, every lookup of the step merged.

    `lookups`: the step's `embeddings.recording.Lookup`s of this table with
    their gradient rows; a layer called several times in a step gives several
    lookups of one shard, whose rows are summed per key here, so each id gets
    one update per step, as Keras' summed gradient would.
    """

    def __init__(self, optimizer, table, lookups):
        self.table = table
        optimizer = table.optimizer or optimizer  # The layer's own, else the model's.
        self.optimizer = sparse_optimizer.SparseOptimizer(
            optimizer, decay=_tf_compat.uses_weight_decay(optimizer, table.variable_name),
            constraint=table.constraint)
        self.lookups = lookups  # [(Lookup, gradient)]
        self._sent = []

    @property
    def devices(self):
        return {lookup.device for lookup, _ in self.lookups}

    def send(self, outbox):
        by_shard = {}
        for lookup, gradient in self.lookups:
            by_shard.setdefault(lookup.shard, []).append((lookup, gradient))
        for index, pairs in sorted(by_shard.items()):
            keys = tf.concat([lookup.keys for lookup, _ in pairs], axis=0)
            rows = tf.concat([_dense_rows(g, tf.shape(lookup.rows)[0]) for lookup, g in pairs],
                             axis=0)
            counts = tf.concat([lookup.counts for lookup, _ in pairs], axis=0)
            if len(pairs) > 1:
                keys, position = tf.unique(keys)
                rows = tf.math.unsorted_segment_sum(rows, position, tf.size(keys))
                counts = tf.math.unsorted_segment_sum(counts, position, tf.size(keys))
            packed = tf.concat([rows, tf.cast(counts, rows.dtype)[:, None]], axis=1)
            device = self.table.shards[index].device
            self._sent.append((index, outbox.put(device, keys), outbox.put(device, packed)))

    def apply(self, outbox, scalars_on):
        for index, keys, packed in self._sent:
            device = self.table.shards[index].device
            with tf.device(device):  # The ps updates its rows, slots and counts.
                packed = outbox.get(packed)
                learning_rate, step = scalars_on(device)
                self.table.update(index, outbox.get(keys), packed[:, :-1],
                                  tf.cast(packed[:, -1], tf.int64), self.optimizer,
                                  self._learning_rate(learning_rate, step), step)

    def _learning_rate(self, model_rate, step):
        """The model's rate, or the table's own optimizer's (a schedule read at this step)."""
        own = self.table.optimizer
        if own is None:
            return model_rate
        return _tf_compat.learning_rate_at(own, tf.cast(step, tf.int64) - 1)
