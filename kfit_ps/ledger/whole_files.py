"""Compressed files read whole: each file is one split, its own batches read from its start.

A GZIP or ZLIB stream cannot be entered at a record, so a pipeline over
compressed files (`TFRecordDataset(files, compression_type="GZIP")`, or
`TextLineDataset(path, compression_type="ZLIB")` in `interleave`) is cut by
file, not by record range (`files.FileSource` keeps record ranges for
uncompressed files):

- each file's records make batches of their own (the file's last batch short,
  or, when the batch drops its remainder, the file's last records short of a
  batch untrained): no batch holds records of two files;
- each file with a batch is one split, whatever `steps_per_execution` asks:
  one function reads it from its start with the pipeline's compression and
  trains its batches in turn, streamed through the pipeline's steps after its
  reader (held in memory: the reader's buffers and the pipeline's prefetch,
  not the file);
- a shuffled file list trains the files in a new order each epoch, seeded
  by the files and the epoch (a restarted chief draws the same);
- the index holds each file's number of records (`file_index`: one whole,
  decompressing read per file, kept by size and modification time).

A function started inside a file (never by `fit`, which starts whole splits)
reads the file from its start and skips the records before its first batch.
"""

import numpy as np
import tensorflow as tf

from kfit_ps.ledger.batched import WholeSplits, epoch_permutation
from kfit_ps.ledger.file_index import COMPRESSIONS, TFRECORD

_READ_BUFFER = 256 << 10


class WholeFiles:
    """The batches of compressed files: `counts[i]` records in file `i`, each file's own
    batches, each file with a batch one split."""

    def __init__(self, counts, batch_size, drop_remainder):
        counts = np.asarray(counts, np.int64)
        self.batch_size = int(batch_size)
        batches = counts // batch_size if drop_remainder else -(-counts // batch_size)
        self.files = np.flatnonzero(batches).astype(np.int64)  # The files with a batch.
        self.batches = batches[self.files]
        self.examples = np.minimum(counts, batches * batch_size)[self.files]
        self.num_batches = int(self.batches.sum())
        self.num_examples = int(self.examples.sum())

    def order(self, epoch, seed):
        """The splits (positions in `files`) in `epoch`'s order: the files' order, or with a
        `seed` (a shuffled file list) the epoch's permutation of them."""
        count = len(self.files)
        if seed is None or count < 2:
            return np.arange(count, dtype=np.int64)
        return epoch_permutation(tf.range(count, dtype=tf.int64), seed, epoch, count).numpy()

    def splits(self, epoch, seed):
        """`WholeSplits` of `epoch`: one per file with a batch."""
        order = self.order(epoch, seed)
        starts = np.concatenate([[0], np.cumsum(self.batches[order])]).astype(np.int64)
        return WholeSplits(starts, self.examples[order], self.batch_size)

    def tables(self):
        """What a worker locates a split's file by (added to the source's tables)."""
        return {"split_files": self.files, "split_batches": self.batches}

    def locate(self, tables, batch, epoch, seed):
        """`(file, batches)` inside a function: the file (an index into the paths) whose
        split holds batch `batch` of `epoch`, and how many of its batches come before it."""
        count = len(self.files)
        order = tf.range(count, dtype=tf.int64)
        if seed is not None and count > 1:
            order = epoch_permutation(order, seed, epoch, count)
        ends = tf.cumsum(tf.gather(tables["split_batches"], order))
        slot = tf.searchsorted(ends, tf.reshape(batch, [1]), side="right")[0]
        split = order[slot]
        start = ends[slot] - tables["split_batches"][split]
        return tables["split_files"][split], batch - start

    def split_reader(self, tables, first, epoch, seed, batches_from):
        """`next_batch(j)` inside the function that trains the split from batch `first` of
        `epoch`: its file's batches in turn, from one iterator over `batches_from(path,
        records)` (the file's batches after its first `records` records)."""
        file, before = self.locate(tables, tf.cast(first, tf.int64), epoch, seed)
        path = tables["paths"][file]
        return in_turn(batches_from(path, before * self.batch_size), path)


def in_turn(batches, where):
    """`next_batch(j)` inside a function: the dataset `batches`' next batch, each call (an
    assertion naming `where` when it has fewer than the index counted)."""
    iterator = iter(batches)

    def next_batch(j):
        del j  # The next one.
        batch = iterator.get_next_as_optional()
        found = tf.debugging.Assert(batch.has_value(), [
            "kfit_ps: the files hold fewer batches than their index counted (did one change "
            "after `fit` indexed it?):", where])
        with tf.control_dependencies([found]):
            return tf.nest.map_structure(tf.identity, batch.get_value())

    return next_batch


def files_kind(record_kind, compression):
    """"TFRecord", "text", or e.g. "GZIP-compressed TFRecord"."""
    return f"{compression}-compressed {record_kind}" if compression else record_kind


def refused(compression):
    """Why files read with the constant `compression_type` `compression` are not read once
    per epoch, or None ("" reads them by record range, `COMPRESSIONS` whole)."""
    if not compression or compression in COMPRESSIONS:
        return None
    return (f"its reader's compression_type is {compression!r}: files are read by record range "
            "when uncompressed (''), and whole when 'GZIP' or 'ZLIB'. Received: "
            f"compression_type={compression!r}. Write the files uncompressed or with GZIP or "
            "ZLIB, and pass that compression_type")


def computed_per_file(op, made_by):
    """Why a reader (`op`) whose `compression_type` a per-file function computes (with the op
    `made_by`, None when captured from the caller) is refused."""
    return (f"its {op}'s `compression_type` is computed per file (by "
            f"{'a ' + made_by if made_by else 'the per-file function'}), and a compressed "
            "file is read whole while an uncompressed one is read by record range. "
            "Received: compression_type=<a tensor computed per file>. Pass one constant "
            "compression_type for all the files of a pipeline ('', 'GZIP' or 'ZLIB'): "
            "write them with one compression, or train each kind in its own fit")


def records(path, kind, compression, skip):
    """The records of the file `path` (a string tensor) from its start, but its first `skip`
    (an int64 tensor), read with the pipeline's compression."""
    read = tf.data.TFRecordDataset if kind == TFRECORD else tf.data.TextLineDataset
    return read(path, compression_type=compression, buffer_size=_READ_BUFFER).skip(skip)
