"""`DynamicTable`: one layer's rows, slots and counts, in hash tables split over the ps tasks.

Who owns what:

- the *layer* (`layer.DynamicEmbedding`) turns ids into keys, splits them by
  shard and reads rows;
- the *table* (here) owns the storage and everything that runs next to it,
  per shard, on that shard's ps task:
  - `values`: key -> the row (`dim` floats) and its optimizer slots after it,
    in `slot_names` order: one insert writes an id's row and slots, one
    remove drops both. A missing key reads as NaN in every element;
  - `meta`: key -> (times seen, "clock" when last seen, whether it has a
    row), for every id seen in training, admitted or not yet;
  - `clock`: the shard's count of training updates: "last seen" and
    `max_age` are measured on it, so a fresh optimizer (its `iterations`
    back to 0) changes neither;
  - `counters`: rows admitted, rows evicted, most rows held at once;
  - `lock`: a `tf.CriticalSection` of its own (no other shard, table or
    model shares its mutex). An update and its eviction run in it, so
    two workers' updates of one shard never interleave: no update is lost,
    no id keeps slots or a count without its row, and `evicted` counts each
    removed row once;
- `update` (one shard, one step, eviction included) runs on the shard's ps:
  it is built inside the worker's training function under `tf.device(ps)`,
  so no row, slot or count leaves the ps;
- saving and loading (`saving`) read and write the table in chunks.

A forward lookup runs outside the lock: it reads each row as one whole write
of it (the hash table's own lock), the row before or after a concurrent
update, never a mix.
"""

import math

import tensorflow as tf

from kfit_ps import _tf_compat
from kfit_ps.embeddings import hashing, sparse_optimizer

ADMITTED, EVICTED, PEAK = 0, 1, 2
SEEN, LAST, HAS_ROW = 0, 1, 2
SLACK_FRACTION = 0.1


class Shard(tf.Module):
    """One shard's tables, clock, counters and lock, all on `device`."""

    def __init__(self, dim, device, index, unique):
        super().__init__(name=f"shard_{index}")
        self.device = device
        self.index = index
        self.unique = unique
        self.meta = _tf_compat.hash_table(tf.int64, tf.int64, tf.constant([0, -1, 0], tf.int64),
                                          device, f"meta_{index}")
        self.counters = _tf_compat.pinned_variable(
            tf.zeros([3], tf.int64), device, name=f"{unique}_counters_{index}")
        self.clock = _tf_compat.pinned_variable(
            tf.zeros([], tf.int64), device, name=f"{unique}_clock_{index}")
        self.lock = _tf_compat.critical_section(device, f"lock_{index}")
        self.values = None
        self.make_values(dim)

    def make_values(self, width):
        self.values = _tf_compat.hash_table(tf.int64, tf.float32, tf.fill([width], float("nan")),
                                            self.device, f"values_{self.index}")


def exclusive(lock, body):
    """Runs `body()` (which returns the ops it ran) inside `lock`; returns a tensor after them.

    `tf.CriticalSection` releases its lock once the tensors `body` returns
    exist, so every write must be among them or before them.
    """
    def run():
        ops = body()
        with tf.control_dependencies(ops):
            return tf.constant(True)

    return lock.execute(run, exclusive_resource_access=False)


class DynamicTable(tf.Module):
    """The hash tables of one `DynamicEmbedding`, one shard per device.

    Args:
        dim: row width.
        devices: one device per shard (the ps tasks, or this process' CPU).
        initializer: `hashing.initializer_spec` of the layer's initializer.
        seed: the seed of new ids' vectors.
        min_count: times an id is seen in training before it gets a row.
        max_age: training updates of a shard without seeing an id after which
            it is evicted (None: never).
        capacity: ids the table tracks (over all shards); beyond it, the least
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
        self.slot_values = {}
        self.optimizer = None  # The layer's own optimizer, if any (else the model's).
        self.constraint = None  # A row-wise constraint of the updated rows.
        self.variable_name = "embeddings"  # Matched by `exclude_from_weight_decay`.
        self.shards = [Shard(dim, device, i, name) for i, device in enumerate(devices)]

    @property
    def num_shards(self):
        return len(self.shards)

    @property
    def width(self):
        return self.dim * (1 + len(self.slot_names or ()))

    def use_optimizer(self, optimizer):
        """Keeps `optimizer`'s slots next to each row; False if other slots were dropped."""
        names = sparse_optimizer.slot_names(optimizer)
        values = {name: sparse_optimizer.initial_slot_value(optimizer, name) for name in names}
        return self.use_slots(names, values)

    def use_slots(self, names, initial_values=None):
        """Stores the slots `names` next to each row (rows kept; other slots dropped).

        Returns False if slots of other names were dropped. `initial_values`:
        {name: value} of the slots added to rows that exist (default 0).
        """
        names = tuple(names)
        initial_values = dict(initial_values or {})
        if self.slot_names == names:
            self.slot_values = initial_values or self.slot_values
            return True
        dropped = bool(self.slot_names)
        self.slot_names, self.slot_values = names, initial_values
        for shard in self.shards:
            with tf.device(shard.device):
                keys, old = shard.values.export()
                rows = tf.reshape(old, [tf.size(keys), -1])[:, :self.dim]
                shard.make_values(self.width)
                shard.values.insert(keys, tf.concat([rows, self.fresh_slots(tf.size(keys))],
                                                    axis=1))
        return not dropped

    def fresh_slots(self, n):
        """[n, dim * len(slot_names)] slots of new rows."""
        return tf.concat([tf.zeros([n, 0])] + [
            tf.fill([n, self.dim], tf.constant(self.slot_values.get(name, 0.0), tf.float32))
            for name in self.slot_names or ()], axis=1)

    # Reads ---------------------------------------------------------------------------------

    def initial_rows(self, keys):
        return hashing.initial_rows(keys, self.dim, *self.initializer, self.seed)

    def _with_initial(self, rows, keys, missing):
        """`rows` with each `missing` key's initial vector: computed for those keys only."""
        where = tf.where(missing)
        return tf.tensor_scatter_nd_update(rows, where,
                                           self.initial_rows(tf.gather_nd(keys, where)))

    def read_rows(self, index, keys):
        """[n, dim] rows of `keys` in shard `index`, NaN where missing; run on the shard's ps."""
        values = self.shards[index].values.lookup(keys)
        return tf.reshape(values, [-1, self.width])[:, :self.dim]

    def lookup(self, index, keys, fresh):
        """Rows of `keys` (unique, all of shard `index`); missing keys get a fallback.

        Only rows travel from the ps (no slots, no "found" flag: a missing
        row is all NaN). The fallback of a missing key is its own initial
        vector when `fresh` (it is being admitted in this training step),
        else zeros (the default vector).
        """
        with tf.device(self.shards[index].device):
            rows = self.read_rows(index, keys)
        missing = tf.reduce_all(tf.math.is_nan(rows), axis=1)
        rows = tf.where(missing[:, None], tf.zeros_like(rows), rows)
        return self._with_initial(rows, keys, missing) if fresh else rows

    # The update, on the shard's ps ---------------------------------------------------------

    def update(self, index, keys, gradients, counts, optimizer, learning_rate, step):
        """One training step's update of shard `index`; call under `tf.device(shard.device)`.

        `keys` are unique; `gradients` their summed gradient rows; `counts`
        how often each occurred in the batch; `optimizer` a
        `sparse_optimizer.SparseOptimizer`. Returns a tensor that exists once
        the update (and any eviction) is done.
        """
        if self.slot_names is None:
            raise RuntimeError("DynamicTable.update before use_optimizer()")
        shard = self.shards[index]
        keys = tf.reshape(keys, [-1])  # Shapes are lost in the packed transfer.
        gradients = tf.reshape(gradients, [-1, self.dim])
        counts = tf.reshape(counts, [-1])

        def body():
            now = shard.clock.assign_add(1)
            meta = tf.reshape(shard.meta.lookup(keys), [-1, 3])
            seen = meta[:, SEEN] + counts
            found = meta[:, HAS_ROW] > 0
            admitted = tf.logical_or(found, seen >= self.min_count)
            values = tf.reshape(shard.values.lookup(keys), [-1, self.width])
            rows = self._with_initial(values[:, :self.dim], keys, tf.logical_not(found))
            slots = tf.where(found[:, None], values[:, self.dim:],
                             self.fresh_slots(tf.size(keys)))
            names = self.slot_names
            parts = dict(zip(names, tf.split(slots, len(names), axis=1))) if names else {}
            new_rows, new_parts = optimizer.apply(rows, parts, gradients, learning_rate, step)
            new = tf.concat([new_rows] + [new_parts[name] for name in names], axis=1)
            # With min_count > 1 the worker read zeros for a new id: its gradient is not its
            # row's, and the row starts from its initial vector (first trained next step).
            trained = found if self.min_count > 1 else tf.ones_like(found)
            new = tf.where(trained[:, None], new, tf.concat([rows, slots], axis=1))
            written = [
                shard.meta.insert(keys, tf.stack(
                    [seen, tf.fill(tf.shape(seen), now), tf.cast(admitted, tf.int64)], axis=1)),
                shard.values.insert(tf.boolean_mask(keys, admitted),
                                    tf.boolean_mask(new, admitted))]
            newly = tf.math.count_nonzero(tf.logical_and(admitted, tf.logical_not(found)))
            with tf.control_dependencies(written):
                written.append(shard.counters.scatter_add(
                    tf.IndexedSlices(tf.stack([newly]), tf.constant([ADMITTED]))))
                written.append(shard.counters.scatter_max(tf.IndexedSlices(
                    tf.stack([shard.values.size()]), tf.constant([PEAK]))))
            with tf.control_dependencies(written):
                written.append(self._evict(shard, now))
            return written

        return exclusive(shard.lock, body)

    def _evict(self, shard, now):
        """Drops ids past `max_age` and, past capacity + slack, the least seen ones."""
        if self.capacity is None and self.max_age is None:
            return tf.constant(False)
        due = tf.constant(False)
        if self.capacity is not None:
            due = shard.meta.size() > self.shard_capacity + self.slack
        if self.max_age is not None:
            interval = max(1, self.max_age // 10)
            due = tf.logical_or(due, tf.equal(tf.math.floormod(now, interval), 0))

        def evict():
            keys, meta = shard.meta.export()  # Keys and counts only: rows are not copied.
            meta = tf.reshape(meta, [-1, 3])
            old = (now - meta[:, LAST] > self.max_age if self.max_age is not None
                   else tf.zeros_like(keys, tf.bool))
            excess = tf.math.count_nonzero(old, dtype=tf.int32)
            if self.capacity is not None:
                over = tf.cast(tf.size(keys) - self.shard_capacity, tf.int32)
                excess = tf.maximum(excess, over)
            # Old ids first, then the least seen, the longest unseen first among equals.
            score = (tf.cast(meta[:, SEEN], tf.float64)
                     + tf.cast(meta[:, LAST], tf.float64) / tf.cast(now + 1, tf.float64))
            score = tf.where(old, tf.constant(-1.0, tf.float64), score)
            chosen = tf.math.top_k(-score, excess).indices
            victims = tf.gather(keys, chosen)
            rows = tf.math.count_nonzero(tf.gather(meta[:, HAS_ROW], chosen))
            removed = [shard.meta.remove(victims), shard.values.remove(victims)]
            with tf.control_dependencies(removed):
                counted = shard.counters.scatter_add(
                    tf.IndexedSlices(tf.stack([rows]), tf.constant([EVICTED])))
            with tf.control_dependencies([counted]):
                return tf.constant(True)

        return tf.cond(due, evict, lambda: tf.constant(False))

    # Reports -------------------------------------------------------------------------------

    def shard_stats(self):
        """[{"device", "rows", "admitted", "evicted", "peak_rows"}] per shard, read on its ps."""
        stats = []
        for shard in self.shards:
            with tf.device(shard.device):
                rows = int(shard.values.size())
            counters = shard.counters.numpy()
            stats.append({"device": shard.device, "rows": rows,
                          "admitted": int(counters[ADMITTED]),
                          "evicted": int(counters[EVICTED]), "peak_rows": int(counters[PEAK])})
        return stats

    def stats(self):
        """{"rows", "admitted", "evicted", "peak_rows_per_shard"}: read from the ps tasks."""
        shards = self.shard_stats()
        return {"rows": sum(s["rows"] for s in shards),
                "admitted": sum(s["admitted"] for s in shards),
                "evicted": sum(s["evicted"] for s in shards),
                "peak_rows_per_shard": max((s["peak_rows"] for s in shards), default=0)}
