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
from kfit_ps.ledger.file_index import TFRECORD

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


def records(path, kind, compression, skip):
    """The records of the file `path` (a string tensor) from its start, but its first `skip`
    (an int64 tensor), read with the pipeline's compression."""
    read = tf.data.TFRecordDataset if kind == TFRECORD else tf.data.TextLineDataset
    return read(path, compression_type=compression, buffer_size=_READ_BUFFER).skip(skip)
