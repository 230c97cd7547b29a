"""Saving and loading a dynamic table through Keras: `save_weights`, `.keras`, and the callbacks.

Keras saves a layer by calling its `save_own_variables(store)` with a dict-like
store (an HDF5 group); kfit_ps' `ModelCheckpoint`, `BackupAndRestore` and
`export_saved_model` all go through it. A table is written as numbered
chunks of at most `KFIT_PS_TABLE_CHUNK_ROWS` rows, so the coordinator holds
one chunk at a time, never a whole table:

- each shard lists its keys and counts on its ps (not its rows: no copy of
  a whole table is made there); the coordinator then reads the rows of one
  chunk of keys at a time;
- `keys<c>`, `values<c>`, `meta<c>` (times seen, clock when last seen) and,
  when the table has optimizer slots, `slots<c>`; `layout` records the row
  width, the slot names, the chunk count and the shards' clock.

Slots saved for another optimizer than the one loading are dropped, with a
message; the rows keep their values and start with fresh slots.

Loading sends each chunk's rows to the shard their key hashes to *now*, so a
table saved with 2 ps tasks loads into 3 (or into 1 shard in a process
without a cluster). Ids seen in training but not admitted yet are not saved:
their counts start again after a restore.
"""

import json

import numpy as np
import tensorflow as tf

from kfit_ps import _tf_compat, constants
from kfit_ps.embeddings import hashing
from kfit_ps.embeddings import table as table_lib


def _chunks(table, shard, chunk_rows):
    with tf.device(shard.device):  # Keys and counts only; rows are read a chunk at a time.
        keys, meta = shard.meta.export()
        meta = tf.reshape(meta, [-1, 3])
        has_row = meta[:, table_lib.HAS_ROW] > 0
        keys, meta = tf.boolean_mask(keys, has_row), tf.boolean_mask(meta, has_row)
    total = int(tf.size(keys))
    for start in range(0, total, chunk_rows):
        with tf.device(shard.device):
            part_keys = keys[start:start + chunk_rows]
            values = tf.reshape(shard.values.lookup(part_keys), [-1, table.width])
            part = {"keys": part_keys, "values": values[:, :table.dim],
                    "meta": meta[start:start + chunk_rows, :2]}
            if table.slot_names:
                part["slots"] = values[:, table.dim:]
        yield {name: tensor.numpy() for name, tensor in part.items()}


def save_table(table, store):
    chunk_rows = constants.table_chunk_rows()
    slot_names = list(table.slot_names or ())
    count = rows = 0
    for shard in table.shards:
        for chunk in _chunks(table, shard, chunk_rows):
            for name, array in chunk.items():
                store[f"{name}{count}"] = array
            count += 1
            rows += len(chunk["keys"])
    clocks = [int(shard.clock.numpy()) for shard in table.shards]
    layout = {"format": 2, "dim": table.dim, "slots": slot_names, "chunks": count, "rows": rows,
              "clock": max(clocks)}
    store["layout"] = np.frombuffer(json.dumps(layout).encode(), dtype=np.uint8)


def read_layout(store):
    if "layout" not in store.keys():
        raise ValueError("This file holds no DynamicEmbedding table (no 'layout' entry): it was "
                         "written by another layer. Load the weights of the model that wrote it.")
    return json.loads(np.asarray(store["layout"]).tobytes().decode())


def load_table(table, store, owner="DynamicEmbedding"):
    layout = read_layout(store)
    if layout["dim"] != table.dim:
        raise ValueError(f"The saved table has rows of width {layout['dim']}, this layer "
                         f"{table.dim}. Received: output_dim={table.dim}. Build the layer with "
                         f"output_dim={layout['dim']}.")
    saved = tuple(layout["slots"])
    if table.slot_names is None:
        table.use_slots(saved)
    with_slots = tuple(table.slot_names) == saved
    if saved and not with_slots:
        _tf_compat.print_msg(
            f"{owner}: the saved table has optimizer slots {list(saved)}, this optimizer keeps "
            f"{list(table.slot_names)}: the saved slots are dropped and every row starts with "
            "fresh slots.")
    _clear(table)
    # Format 1 measured "last seen" in optimizer steps; its largest value starts the clock.
    clock = layout.get("clock", 0)
    for c in range(layout["chunks"]):
        keys = np.asarray(store[f"keys{c}"])
        values = np.asarray(store[f"values{c}"], np.float32)
        if with_slots and saved:
            values = np.concatenate([values, np.asarray(store[f"slots{c}"], np.float32)], axis=1)
        meta = np.asarray(store[f"meta{c}"], np.int64)
        if "clock" not in layout and len(meta):
            clock = max(clock, int(meta[:, 1].max()))
        _insert(table, tf.constant(keys, tf.int64), tf.constant(values),
                tf.constant(meta), with_slots)
    for shard in table.shards:
        shard.clock.assign(clock)


def _clear(table):
    for shard in table.shards:
        with tf.device(shard.device):
            for t in (shard.values, shard.meta):
                keys, _ = t.export()
                t.remove(keys)
            shard.counters.assign(tf.zeros([3], tf.int64))


def _insert(table, keys, values, meta, with_slots):
    n = table.num_shards
    index = hashing.shard_of(keys, n)
    keys_by = tf.dynamic_partition(keys, index, n)
    values_by = tf.dynamic_partition(values, index, n)
    meta_by = tf.dynamic_partition(meta, index, n)
    for i, shard in enumerate(table.shards):
        with tf.device(shard.device):
            rows = values_by[i]
            if not with_slots:
                rows = tf.concat([rows[:, :table.dim], table.fresh_slots(tf.size(keys_by[i]))],
                                 axis=1)
            shard.values.insert(keys_by[i], rows)
            has_row = tf.ones([tf.size(keys_by[i]), 1], tf.int64)
            shard.meta.insert(keys_by[i], tf.concat([meta_by[i][:, :2], has_row], axis=1))
