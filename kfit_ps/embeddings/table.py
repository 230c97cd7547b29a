"""`DynamicTable`: one layer's rows, slots and counts, in hash tables split over the ps tasks.

Who owns what:

- the *layer* (`layer.DynamicEmbedding`) turns ids into keys, splits them by
  shard and reads rows;
- the *table* (here) owns the storage and everything that runs next to it:
  per shard, on that shard's ps task,
  - `values`: key -> the row (`dim` floats); a missing key reads as NaN, so
    one lookup says both "found" and "what";
  - `slots`: key -> the row's optimizer slots side by side (created when the
    optimizer is known, `use_optimizer`);
  - `meta`: key -> (times seen, last step seen), for every id seen in
    training, admitted or not yet;
  - `counters`: rows admitted, rows evicted, most rows held at once;
- `update` (one shard, one step) and `_evict` run on the shard's ps: they are
  built inside the worker's training function under `tf.device(ps)`, so no
  row, slot or count leaves the ps;
- saving and loading (`saving`) read and write the table in chunks.

Each hash-table operation holds that table's lock, so a row (or its slots)
is always one whole write. A step's read-update-write of a row is not one
operation: two workers updating the same id at once may lose one of the two
updates (the row is then one of them, never a mix), as sparse updates of a
`tf.Variable` do under asynchronous training. Likewise an eviction that
races with an update of the same id may leave that id's count without its
row (the id starts again from its initial vector when next seen) or its row
without its count (the next eviction takes it first): nothing leaks.
"""

import math

import tensorflow as tf

from kfit_ps import _tf_compat
from kfit_ps.embeddings import hashing, updates

ADMITTED, EVICTED, PEAK = 0, 1, 2
SLACK_FRACTION = 0.1


class Shard(tf.Module):
    """One shard's tables and counters, all on `device`."""

    def __init__(self, dim, device, index, unique):
        super().__init__(name=f"shard_{index}")
        self.device = device
        self.values = _tf_compat.hash_table(tf.int64, tf.float32, tf.fill([dim], float("nan")),
                                            device, f"values_{index}")
        self.meta = _tf_compat.hash_table(tf.int64, tf.int64, tf.constant([0, -1], tf.int64),
                                          device, f"meta_{index}")
        self.counters = _tf_compat.pinned_variable(
            tf.zeros([3], tf.int64), device, name=f"{unique}_counters_{index}")
        self.slots = None

    def make_slots(self, width):
        self.slots = _tf_compat.hash_table(tf.int64, tf.float32, tf.fill([width], float("nan")),
                                           self.device, "slots")


class DynamicTable(tf.Module):
    """The hash tables of one `DynamicEmbedding`, one shard per device.

    Args:
        dim: row width.
        devices: one device per shard (the ps tasks, or this process' CPU).
        initializer: `hashing.initializer_spec` of the layer's initializer.
        seed: the seed of new ids' vectors.
        min_count: times an id is seen in training before it gets a row.
        max_age: steps without being seen after which an id is evicted (None: never).
        capacity: rows the table holds (over all shards); beyond it, the least
            frequently seen ids are evicted (None: unbounded).
    """

    def __init__(self, dim, devices, initializer, seed, min_count=1, max_age=None,
                 capacity=None, name="table"):
        super().__init__(name=name)
        self.dim = dim
        self.initializer = initializer
        self.seed = seed
        self.min_count = min_count
        self.max_age = max_age
        self.capacity = capacity
        self.shard_capacity = None if capacity is None else math.ceil(capacity / len(devices))
        self.slack = (None if capacity is None
                      else max(1, math.ceil(SLACK_FRACTION * self.shard_capacity)))
        self.slot_names = None
        self.shards = [Shard(dim, device, i, name) for i, device in enumerate(devices)]

    @property
    def num_shards(self):
        return len(self.shards)

    def use_optimizer(self, optimizer):
        """Creates (or keeps) the slot tables `optimizer` needs; False if old slots were dropped."""
        names = updates.slot_names(optimizer)
        return self.use_slots(names)

    def use_slots(self, names):
        names = tuple(names)
        if self.slot_names == names:
            return True
        dropped = bool(self.slot_names)
        self.slot_names = names
        for shard in self.shards:
            shard.slots = None
            if names:
                shard.make_slots(self.dim * len(names))
        return not dropped

    # Reads ---------------------------------------------------------------------------------

    def _read(self, shard, keys):
        """(rows of `keys` in `shard`, NaN where missing; whether each was found)."""
        rows = tf.reshape(shard.values.lookup(keys), [-1, self.dim])
        return rows, tf.logical_not(tf.math.is_nan(rows[:, 0]))

    def initial_rows(self, keys):
        return hashing.initial_rows(keys, self.dim, *self.initializer, self.seed)

    def lookup(self, index, keys, fresh):
        """Rows of `keys` (unique, all of shard `index`); missing keys get a fallback.

        The lookup runs on the shard's device; the fallback of a missing key
        is its own initial vector when `fresh` (it is being admitted in this
        training step), else zeros (the default vector).
        """
        with tf.device(self.shards[index].device):
            rows, found = self._read(self.shards[index], keys)
        fallback = self.initial_rows(keys) if fresh else tf.zeros_like(rows)
        return tf.where(found[:, None], rows, fallback)

    # The update, on the shard's ps ---------------------------------------------------------

    def update(self, index, keys, gradients, counts, optimizer, learning_rate, step):
        """One training step's update of shard `index`; call under `tf.device(shard.device)`.

        `keys` are unique; `gradients` their summed gradient rows; `counts`
        how often each occurred in the batch.
        """
        if self.slot_names is None:
            raise RuntimeError("DynamicTable.update before use_optimizer()")
        shard = self.shards[index]
        keys = tf.reshape(keys, [-1])  # Shapes are lost in the packed transfer.
        gradients = tf.reshape(gradients, [-1, self.dim])
        counts = tf.reshape(counts, [-1])
        step_ = tf.cast(step, tf.int64)
        meta = tf.reshape(shard.meta.lookup(keys), [-1, 2])
        seen = meta[:, 0] + counts
        shard.meta.insert(keys, tf.stack([seen, tf.fill(tf.shape(seen), step_)], axis=1))
        rows, found = self._read(shard, keys)
        base = tf.where(found[:, None], rows, self.initial_rows(keys))
        trained = found if self.min_count > 1 else tf.ones_like(found)
        admitted = tf.logical_or(found, seen >= self.min_count)
        if self.slot_names:
            slots = tf.reshape(shard.slots.lookup(keys), [-1, self.dim * len(self.slot_names)])
            fresh = updates.initial_slots(optimizer, tf.size(keys), self.dim)
            slots = tf.where(tf.math.is_nan(slots[:, :1]), fresh, slots)
        else:
            slots = tf.zeros([tf.size(keys), 0])
        new_rows, new_slots = updates.apply(optimizer, base, slots, gradients, learning_rate,
                                            tf.cast(step, tf.float32))
        new_rows = tf.where(trained[:, None], new_rows, base)
        kept = tf.boolean_mask(keys, admitted)
        shard.values.insert(kept, tf.boolean_mask(new_rows, admitted))
        if self.slot_names:
            new_slots = tf.where(trained[:, None], new_slots, slots)
            shard.slots.insert(kept, tf.boolean_mask(new_slots, admitted))
        newly = tf.math.count_nonzero(tf.logical_and(admitted, tf.logical_not(found)))
        shard.counters.scatter_add(tf.IndexedSlices(tf.stack([newly]), tf.constant([ADMITTED])))
        shard.counters.scatter_max(tf.IndexedSlices(tf.stack([shard.values.size()]),
                                                    tf.constant([PEAK])))
        self._evict(shard, step_)

    def _evict(self, shard, step):
        """Drops ids past `max_age` and, past capacity + slack, the least seen ones."""
        if self.capacity is None and self.max_age is None:
            return
        due = tf.constant(False)
        if self.capacity is not None:
            held = tf.maximum(shard.meta.size(), shard.values.size())
            due = held > self.shard_capacity + self.slack
        if self.max_age is not None:
            interval = max(1, self.max_age // 10)
            due = tf.logical_or(due, tf.equal(tf.math.floormod(step, interval), 0))

        def evict():
            # Every id with a count or a row: a row whose count a concurrent eviction removed
            # (see the module doc) reads as count 0, never seen, and goes first.
            keys = tf.unique(tf.concat([tf.reshape(shard.meta.export()[0], [-1]),
                                        tf.reshape(shard.values.export()[0], [-1])], 0))[0]
            meta = tf.reshape(shard.meta.lookup(keys), [-1, 2])
            old = (step - meta[:, 1] > self.max_age if self.max_age is not None
                   else tf.zeros_like(keys, tf.bool))
            excess = tf.math.count_nonzero(old, dtype=tf.int32)
            if self.capacity is not None:
                over = tf.cast(tf.size(keys) - self.shard_capacity, tf.int32)
                excess = tf.maximum(excess, over)
            # Old ids first, then the least seen, the longest unseen first among equals.
            score = (tf.cast(meta[:, 0], tf.float64)
                     + tf.cast(meta[:, 1], tf.float64) / tf.cast(step + 1, tf.float64))
            score = tf.where(old, tf.constant(-1.0, tf.float64), score)
            victims = tf.gather(keys, tf.math.top_k(-score, excess).indices)
            held = tf.math.count_nonzero(self._read(shard, victims)[1])
            shard.meta.remove(victims)
            shard.values.remove(victims)
            if shard.slots is not None:
                shard.slots.remove(victims)
            shard.counters.scatter_add(tf.IndexedSlices(tf.stack([held]),
                                                        tf.constant([EVICTED])))
            return tf.constant(True)

        tf.cond(due, evict, lambda: tf.constant(False))

    # Reports -------------------------------------------------------------------------------

    def stats(self):
        """{"rows", "admitted", "evicted", "peak_rows_per_shard"}: read from the ps tasks."""
        rows = admitted = evicted = peak = 0
        for shard in self.shards:
            with tf.device(shard.device):
                rows += int(shard.values.size())
            counters = shard.counters.numpy()
            admitted += int(counters[ADMITTED])
            evicted += int(counters[EVICTED])
            peak = max(peak, int(counters[PEAK]))
        return {"rows": rows, "admitted": admitted, "evicted": evicted,
                "peak_rows_per_shard": peak}
