"""One-pass epochs over files: a pipeline's reader replaced, batch by batch, by a seek.

A finite pipeline that reads files — `TFRecordDataset(files)`,
`TextLineDataset(files)`, or either inside `interleave`/`flat_map` over
`from_tensor_slices(files)` or `Dataset.list_files(...)` (a per-file
`skip(n)`, e.g. a CSV header, included) — followed by per-record and
per-batch steps (`map`, one `batch` or `padded_batch`, `prefetch`) is read by
batch index like the ledger's other sources:

- the records are the files' records in the files' order (the pipeline's
  file list), and batch `b` holds records `[b * batch_size, (b + 1) *
  batch_size)`; a shuffled file list (`list_files`' default) is sorted, and
  each epoch trains the full batches in a permutation of its own (seeded by
  the files and the epoch: a restarted chief draws the same one);
- `file_index` finds where each record starts, once per file and size and
  modification time (kept beside `kfit-ps run --backup-dir`'s backups: a
  restarted chief does not read the files again);
- on the worker, batch `b`'s reader starts at its first record's byte offset
  (`TFRecordDatasetV2`'s `byte_offsets`, a seek; a byte range of a text file
  read as one fixed-length record, which TensorFlow reads through up to the
  range, and split into lines), and the pipeline's own steps after its
  reader (`_tf_compat.dataset_graph.replay`) make the batch, without its
  `prefetch` steps: a batch read alone has nothing to read ahead, and each
  prefetch would start a thread per batch (15 % of the examples/s of
  `bench/data_ledger.py`'s files, docs/benchmarks.md).

Compressed files (the reader's `compression_type` "GZIP" or "ZLIB") cannot be
entered mid-file: each is one split of its own batches, read whole from its
start (`whole_files`). With a `split_shuffle` (`kfit_ps.ledger.split_shuffle`),
a split's records are read as one stream and shuffled before the pipeline's
steps make its batches.

Refused, with the reason (`NotFiles`): a `compression_type` other than "",
"GZIP" and "ZLIB", or one computed per file; steps after the reader other
than `map`, one batch and `prefetch` (`filter`, `take`, `skip`, `cache`,
`unbatch`...), a shuffle of records or batches, a batched file list.
"""

import os
import posixpath
import zlib

import numpy as np
import tensorflow as tf

from kfit_ps import _tf_compat, constants
from kfit_ps.ledger import whole_files
from kfit_ps.ledger.batched import Batched, epoch_permutation
from kfit_ps._tf_compat import dataset_graph
from kfit_ps.ledger.file_index import TEXT, TFRECORD, index_files
from kfit_ps.ledger.file_readers import (PER_FILE, NotFiles, node_name, ops_below,
                                         per_file_reader)

_BATCHES = {"BatchDataset", "BatchDatasetV2", "ParallelBatchDataset", "PaddedBatchDataset",
            "PaddedBatchDatasetV2"}
_STEPS = _BATCHES | {
    "MapDataset", "ParallelMapDataset", "ParallelMapDatasetV2", "PrefetchDataset",
    "OptionsDataset", "ModelDataset", "OptimizeDataset", "OptimizeDatasetV2",
    "MaxIntraOpParallelismDataset", "PrivateThreadPoolDataset",
    "ExperimentalMaxIntraOpParallelismDataset", "ExperimentalPrivateThreadPoolDataset"}
_SHUFFLES = ("ShuffleDataset", "ShuffleDatasetV2", "ShuffleDatasetV3")
_REPORTED_BYTES = 64 << 20  # Indexing inputs this large is said, with its cost.
_READ_BUFFER = 256 << 10
_LISTED_FILES = 1000  # A backup lists up to this many files (beyond: the fingerprint only).


class FileSource(Batched):
    """Records of files read by batch index: each batch's reader seeks to its first record
    (compressed files: each file one split, read from its start)."""

    kind = "files"

    def __init__(self, dataset, split_shuffle=None):
        """`split_shuffle`: a `kfit_ps.ledger.SplitShuffle`, or None (records in order)."""
        self.split_shuffle = split_shuffle
        graph, output = dataset_graph.pipeline_graph(dataset)
        nodes = {node.name: node for node in graph.node}
        steps, node = [], nodes[output]
        while node.op in _STEPS:
            steps.append(node)
            node = nodes[node_name(node.input[0])]
        reader = per_file_reader(graph, nodes, node)
        if node.op in _SHUFFLES:
            raise NotFiles(
                f"it shuffles its records or batches ({node.op}): each worker would draw its "
                "own order. Shuffle the file list instead (`Dataset.list_files(pattern)`, or "
                "`from_tensor_slices(files).shuffle(len(files))`): each epoch then trains the "
                "batches in a new seeded order" + (
                    "; and remove this shuffle: kfit_ps.ledger.split_shuffle already shuffles "
                    "the records within each split" if split_shuffle is not None else
                    ", or mix records too with kfit_ps.ledger.split_shuffle(dataset, "
                    "buffer_size)"))
        if reader is None:
            raise NotFiles(
                f"it has a {node.op} where a file reader over a list of files, then only "
                "`map`, one `batch` or `padded_batch` and `prefetch` were expected (a step such "
                "as `filter`, `take`, `skip`, `cache` or `unbatch` changes which records or "
                "batches there are), so its batches cannot be found in the files"
                if node.op not in PER_FILE else
                "its per-file function is not a TFRecordDataset or TextLineDataset of the "
                "file name (with at most a `skip(n)` of header records)")
        self.record_kind, self.compression, self.skip = reader
        refused = whole_files.refused(self.compression)
        if refused:
            raise NotFiles(refused)
        batches = [step for step in steps if step.op in _BATCHES]
        if len(batches) != 1:
            raise NotFiles(f"it batches {len(batches)} times after its reader (one `batch` "
                           "makes each batch from its records)")
        self.batch_size = int(dataset_graph.constant(graph, batches[0].input[1]))
        drop_remainder = bool(dataset_graph.constant(graph, batches[0].input[-1]))
        self._graph, self._output, self._root = graph, output, node.name
        self._batch_graph, self._batch_output = _without_prefetch(graph, output, steps)
        self.element_spec = dataset.element_spec

        files_node = node_name(node.input[0])
        shapes = nodes[files_node].attr["output_shapes"].list.shape
        if len(shapes) != 1 or len(shapes[0].dim) or shapes[0].unknown_rank:
            raise NotFiles(f"its file list ({nodes[files_node].op}) is not one file name per "
                           "element (a batched list?)")
        names = [_normalized(n.decode()) for n in dataset_graph.evaluate(
            graph, files_node, tf.TensorSpec([], tf.string)).as_numpy_iterator()]
        # A shuffled file list (`list_files`' default, or `shuffle` of the names) asks for a
        # new order each epoch: the names are sorted, and the batches permuted per epoch.
        self.shuffle = bool(ops_below(nodes, files_node) & set(_SHUFFLES))
        if self.shuffle:
            names.sort()
        if not names:
            raise NotFiles("its file list is empty")
        backup = constants.launcher_backup()  # A restarted chief reads the index there.
        indexes, seconds = index_files(
            names, self.record_kind, self.skip, compression=self.compression,
            cache_dir=os.path.join(backup[0], "file-index") if backup else None)
        self._indexes = indexes
        sizes = np.asarray([index.size for index in indexes], np.int64)
        counts = np.asarray([index.records for index in indexes], np.int64)
        self.num_examples = int(counts.sum())
        self._whole = None
        if self.compression:  # Each file its own batches, one split.
            self._whole = whole_files.WholeFiles(counts, self.batch_size, drop_remainder)
            self.num_examples = self._whole.num_examples
        elif drop_remainder:
            self.num_examples -= self.num_examples % self.batch_size
        if self.num_examples == 0:
            each = " (each compressed file makes its own batches)" if self.compression else ""
            raise NotFiles(f"its {len(names)} file(s) hold {int(counts.sum())} records, no "
                           f"batch of {self.batch_size}{each}" if drop_remainder else
                           f"its {len(names)} file(s) hold no record")
        self.seed = zlib.crc32(f"{names}/{self.num_examples}/{self.batch_size}".encode())
        self.files = names
        self._say_costs(sizes, counts, seconds)
        if self._whole is not None:
            self.num_batches = self._whole.num_batches
            self.last_size = int(self.whole_splits(0).examples[-1] % self.batch_size
                                 or self.batch_size)
            self.tables = {"paths": np.asarray(names, object), **self._whole.tables()}
            return
        self.num_batches = -(-self.num_examples // self.batch_size)
        self.last_size = self.num_examples - (self.num_batches - 1) * self.batch_size
        # Permuted each epoch when shuffled: the full batches (a short last one stays last).
        self._full_batches = self.num_batches - (self.last_size < self.batch_size)

        # Where each batch's first record is (file, byte), and the end of the data after them.
        offsets = np.concatenate([index.offsets for index in indexes])
        ends = np.cumsum(counts)
        starts = np.arange(self.num_batches + 1, dtype=np.int64) * self.batch_size
        starts[-1] = self.num_examples
        batch_file = np.searchsorted(ends, starts, side="right").astype(np.int64)
        inside = starts < counts.sum()
        batch_offset = np.where(inside, offsets[np.minimum(starts, len(offsets) - 1)], 0)
        if not inside[-1]:  # The data's end: past the last file.
            batch_file[-1] = len(names)
        first = np.asarray([index.offsets[0] if index.records else index.size
                            for index in indexes], np.int64)
        self.tables = {"paths": np.asarray(names, object), "sizes": sizes, "first": first,
                        "batch_file": batch_file, "batch_offset": batch_offset}

    def _say_costs(self, sizes, counts, seconds):
        """Says what indexing took, and what reading a large uncompressed text file costs."""
        names = self.files
        largest = int(sizes.argmax())
        if self.record_kind == TEXT and not self.compression and \
                sizes[largest] >= _REPORTED_BYTES:
            _tf_compat.print_msg(
                f"kfit_ps: reading a batch of a text file reads the file from its start to the "
                f"batch (TensorFlow's readers cannot seek in text): {names[largest]} "
                f"({sizes[largest] / 2**20:.0f} MB) costs up to that much per batch. Split "
                "large text files into files of a few MB, or write TFRecord files (read from "
                "each batch's byte offset).")
        if sizes.sum() >= _REPORTED_BYTES and seconds:
            gigabytes = sizes.sum() / 1e9
            whole = (": each compressed file is read whole, decompressed, to count its records"
                     if self.compression else "")
            kind = whole_files.files_kind(self.record_kind, self.compression)
            _tf_compat.print_msg(
                f"kfit_ps: indexed {len(names)} {kind} files ({gigabytes:.2f} GB, "
                f"{counts.sum():,} records) in {seconds:.1f} s ({seconds / gigabytes:.1f} s/GB)"
                f"{whole}.")

    def whole_splits(self, epoch):
        """Compressed files: `epoch`'s splits, one per file with a batch (in the epoch's
        order of files); None for uncompressed files (record ranges, cut anywhere)."""
        if self._whole is None:
            return None
        return self._whole.splits(epoch, self._seed_if_shuffled())

    def _seed_if_shuffled(self):
        return self.seed if self.shuffle else None

    def examples_in(self, first, count):
        """Examples in batches `[first, first + count)` (compressed files: of one file, in
        epoch 0's order of files: `whole_splits(epoch)` has each epoch's)."""
        if self._whole is None:
            return super().examples_in(first, count)
        return self.whole_splits(0).examples_in(first, count)

    def worker_data(self, coordinator):
        """Each worker's copy of the file list and the batch table (sent once)."""
        tables = self.tables
        return coordinator.create_per_worker_dataset(
            lambda: tf.data.Dataset.from_tensors(tables)).build()

    def split_reader(self, data, first, epoch, count):
        """`next_batch(j)` for the function that trains the `count` batches of the split from
        batch `first`: for compressed files, the batches of the split's file in turn, read
        from its start by one reader (see `whole_files`); with a `split_shuffle`, the
        split's records shuffled, then batched; else each batch read by its index."""
        first = tf.cast(first, tf.int64)
        limit = tf.cast(count, tf.int64) * self.batch_size  # The split's records, at most.
        if self._whole is not None:
            return self._whole.split_reader(
                tf.data.experimental.at(data, 0), first, epoch, self._seed_if_shuffled(),
                lambda path, records: self._batches(whole_files.records(
                    path, self.record_kind, self.compression, self.skip + records),
                    epoch, first, limit, self._graph, self._output))
        if self.split_shuffle is None:
            return super().split_reader(data, first, epoch, count)
        tables = tf.data.experimental.at(data, 0)
        records = tf.data.Dataset.range(first, first + tf.cast(count, tf.int64)).flat_map(
            lambda batch: self._records(tables, batch, epoch))
        return whole_files.in_turn(
            self._batches(records, epoch, first, limit, self._batch_graph, self._batch_output),
            "a split of the files")

    def _batches(self, records, epoch, first, limit, graph, output):
        """The pipeline's batches of `records` (the split from batch `first`'s, at most
        `limit`; shuffled first with a `split_shuffle`): its steps after the reader."""
        if self.split_shuffle is not None:
            records = self.split_shuffle.shuffled(records, epoch, first, limit)
        return dataset_graph.replay(graph, output, self._root, records, self.element_spec)

    def read(self, data, batch, epoch):
        """Batch `batch` (int64 scalar tensor) of epoch `epoch`, inside a function: its
        records from their byte offset, through the pipeline's steps after its reader (a
        compressed file's: read from the file's start)."""
        batch = tf.cast(batch, tf.int64)
        if self._whole is not None:
            return self.split_reader(data, batch, epoch, 1)(0)
        # Each batch read alone (one iterator over a function's batches was slower).
        records = self._records(tf.data.experimental.at(data, 0), batch, epoch)
        return dataset_graph.replay(self._batch_graph, self._batch_output, self._root,
                                    records, self.element_spec).get_single_element()

    def _records(self, tables, batch, epoch):
        """The records of batch `batch` of `epoch` (uncompressed files), from their byte
        offset: the epoch's permutation of batches applied when the file list shuffles."""
        if self.shuffle and self._full_batches > 1:  # The epoch's permutation of batches.
            permuted = epoch_permutation(tf.minimum(batch, self._full_batches - 1), self.seed,
                                         epoch, self._full_batches)
            batch = tf.where(batch < self._full_batches, permuted, batch)
        records = tf.minimum(tf.constant(self.batch_size, tf.int64),
                             self.num_examples - batch * self.batch_size)
        file, offset = tables["batch_file"][batch], tables["batch_offset"][batch]
        if self.record_kind == TFRECORD:
            reader = self._tfrecords(tables, file, offset)
        else:
            reader = self._lines(tables, file, offset, tables["batch_file"][batch + 1],
                                 tables["batch_offset"][batch + 1])
        return reader.take(records)

    @staticmethod
    def _tfrecords(tables, file, offset):
        """Records from `offset` of file `file` on, through the files after it."""
        offsets = tf.concat([[offset], tables["first"][file + 1:]], 0)
        variant = tf.raw_ops.TFRecordDatasetV2(
            filenames=tables["paths"][file:], compression_type="", buffer_size=_READ_BUFFER,
            byte_offsets=offsets)
        return tf.data.experimental.from_variant(variant, tf.TensorSpec([], tf.string))

    @staticmethod
    def _lines(tables, file, offset, end_file, end_offset):
        """Lines from `offset` of file `file` to `end_offset` of file `end_file`: each file's
        byte range read as one record, split at its newlines ('\\r' removed, as
        TextLineDataset does)."""
        last = tf.minimum(end_file, tf.size(tables["paths"], tf.int64) - 1)
        files = tf.range(file, last + 1)
        starts = tf.where(files == file, offset, tf.gather(tables["first"], files))
        sizes = tf.gather(tables["sizes"], files)
        ends = tf.where(files == end_file, end_offset, sizes)
        keep = ends > starts
        segments = tf.data.Dataset.from_tensor_slices(tuple(
            tf.boolean_mask(t, keep) for t in (tf.gather(tables["paths"], files), starts,
                                                ends, sizes)))

        def lines(path, start, end, size):
            chunks = tf.data.FixedLengthRecordDataset(
                path, end - start, header_bytes=start, footer_bytes=size - end,
                buffer_size=_READ_BUFFER)
            return chunks.map(_split_lines).unbatch()

        return segments.flat_map(lines)

    def describe(self):
        """What identifies the data: the files (names, sizes, modification times: a
        fingerprint, and up to `_LISTED_FILES` of them listed), their compression, the records
        skipped per file, the batch size, the shuffle and its seed, a `split_shuffle`'s."""
        crc = zlib.crc32(f"{self.record_kind}/{self.skip}".encode())
        if self.compression:  # (Uncompressed: the fingerprint of earlier backups.)
            crc = zlib.crc32(self.compression.encode(), crc)
        for index in self._indexes:
            crc = zlib.crc32(f"{index.path}\x1f{index.size}\x1f{index.mtime_ns}\x1e".encode(),
                             crc)
        total = sum(index.size for index in self._indexes)
        kind = whole_files.files_kind(self.record_kind, self.compression)
        return {"kind": self.kind, "batches": self.num_batches, "examples": self.num_examples,
                "batch_size": self.batch_size, "shuffle": self.shuffle, "seed": self.seed,
                **({"split_shuffle": self.split_shuffle.describe()}
                   if self.split_shuffle is not None else {}),
                "files": f"{len(self._indexes)} {kind} files, {total} bytes",
                "fingerprint": f"{crc:08x}",
                **({"file_list": [[i.path, i.size, i.mtime_ns] for i in self._indexes]}
                   if len(self._indexes) <= _LISTED_FILES else {})}


def _without_prefetch(graph, output, steps):
    """`(graph, output)`: a copy of the pipeline's `graph` whose tail `steps` (from `output`
    down to the reader) skip their `prefetch` steps, and the node that then makes the
    dataset. A prefetch changes no element; read batch by batch, it only starts a thread."""
    skipped = {step.name: node_name(step.input[0]) for step in steps
               if step.op == "PrefetchDataset"}
    if not skipped:
        return graph, output

    def below(name):
        while name in skipped:
            name = skipped[name]
        return name

    copy = tf.compat.v1.GraphDef()
    copy.CopyFrom(graph)
    kept = [node for node in copy.node if node.name not in skipped]
    for node in kept:
        if node.input and node_name(node.input[0]) in skipped:
            node.input[0] = below(node_name(node.input[0]))
    del copy.node[:]
    copy.node.extend(kept)
    return copy, below(output)


def _normalized(path):
    """`path` with `.` and `..` removed (a URL's scheme kept): the name a backup records."""
    scheme, sep, rest = path.rpartition("://")
    return f"{scheme}{sep}{posixpath.normpath(rest)}" if rest else path


def _split_lines(chunk):
    """The lines of a byte range that ends at a line's end."""
    chunk = tf.strings.regex_replace(chunk, "\r", "")
    return tf.strings.split(tf.strings.regex_replace(chunk, "\n$", ""), "\n")
