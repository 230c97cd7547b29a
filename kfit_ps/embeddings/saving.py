"""Saving and loading a dynamic table through Keras: `save_weights`, `.keras`, and the callbacks.

Keras saves a layer by calling its `save_own_variables(store)` with a dict-like
store (an HDF5 group); kfit_ps' `ModelCheckpoint`, `BackupAndRestore` and
`export_saved_model` all go through it. A table is written as numbered
chunks of at most `KFIT_PS_TABLE_CHUNK_ROWS` rows, so the coordinator holds
one chunk at a time, never a whole table:

- each shard exports its rows on its own ps (the exported tensors stay
  there); the coordinator then fetches one slice at a time;
- `keys<c>`, `values<c>`, `meta<c>` (times seen, last step) and, when the
  table has optimizer slots, `slots<c>`; `layout` records the row width,
  the slot names and the chunk count.

Loading sends each chunk's rows to the shard their key hashes to *now*, so a
table saved with 2 ps tasks loads into 3 (or into 1 shard in a process
without a cluster). Ids seen in training but not admitted yet are not saved:
their counts start again after a restore.
"""

import json

import numpy as np
import tensorflow as tf

from kfit_ps import constants
from kfit_ps.embeddings import hashing


def _chunks(shard, slot_names, chunk_rows):
    with tf.device(shard.device):  # The export stays on the ps; slices travel.
        keys, values = shard.values.export()
        meta = shard.meta.lookup(keys)
        slots = shard.slots.lookup(keys) if slot_names else None
    total = int(tf.size(keys))
    for start in range(0, total, chunk_rows):
        with tf.device(shard.device):
            part = {"keys": keys[start:start + chunk_rows],
                    "values": values[start:start + chunk_rows],
                    "meta": meta[start:start + chunk_rows]}
            if slots is not None:
                part["slots"] = slots[start:start + chunk_rows]
        yield {name: tensor.numpy() for name, tensor in part.items()}


def save_table(table, store):
    chunk_rows = constants.table_chunk_rows()
    slot_names = list(table.slot_names or ())
    count = rows = 0
    for shard in table.shards:
        for chunk in _chunks(shard, slot_names, chunk_rows):
            for name, array in chunk.items():
                store[f"{name}{count}"] = array
            count += 1
            rows += len(chunk["keys"])
    layout = {"format": 1, "dim": table.dim, "slots": slot_names, "chunks": count, "rows": rows}
    store["layout"] = np.frombuffer(json.dumps(layout).encode(), dtype=np.uint8)


def read_layout(store):
    if "layout" not in store.keys():
        raise ValueError("This file holds no DynamicEmbedding table (no 'layout' entry): it was "
                         "written by another layer. Load the weights of the model that wrote it.")
    return json.loads(np.asarray(store["layout"]).tobytes().decode())


def load_table(table, store):
    layout = read_layout(store)
    if layout["dim"] != table.dim:
        raise ValueError(f"The saved table has rows of width {layout['dim']}, this layer "
                         f"{table.dim}. Received: output_dim={table.dim}. Build the layer with "
                         f"output_dim={layout['dim']}.")
    if layout["slots"] and table.slot_names is None:
        table.use_slots(layout["slots"])
    with_slots = bool(table.slot_names) and tuple(layout["slots"]) == tuple(table.slot_names)
    _clear(table)
    for c in range(layout["chunks"]):
        keys = np.asarray(store[f"keys{c}"])
        parts = {"values": np.asarray(store[f"values{c}"]), "meta": np.asarray(store[f"meta{c}"])}
        if with_slots:
            parts["slots"] = np.asarray(store[f"slots{c}"])
        _insert(table, tf.constant(keys, tf.int64),
                {k: tf.constant(v) for k, v in parts.items()})


def _clear(table):
    for shard in table.shards:
        with tf.device(shard.device):
            tables = [shard.values, shard.meta] + ([shard.slots] if shard.slots is not None else [])
            for t in tables:
                keys, _ = t.export()
                t.remove(keys)
            shard.counters.assign(tf.zeros([3], tf.int64))


def _insert(table, keys, parts):
    n = table.num_shards
    index = hashing.shard_of(keys, n)
    keys_by = tf.dynamic_partition(keys, index, n)
    parts_by = {name: tf.dynamic_partition(v, index, n) for name, v in parts.items()}
    for i, shard in enumerate(table.shards):
        with tf.device(shard.device):
            shard.values.insert(keys_by[i], parts_by["values"][i])
            shard.meta.insert(keys_by[i], parts_by["meta"][i])
            if "slots" in parts_by:
                shard.slots.insert(keys_by[i], parts_by["slots"][i])

