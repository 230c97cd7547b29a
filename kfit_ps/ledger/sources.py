"""Training data a one-pass epoch can be cut from: sources read by batch index.

A ledgered epoch (`kfit_ps.ledger.Ledger`) is cut into splits of batches, and
each scheduled function reads its own split's batches on its worker, by
index: no pipeline is rebuilt, skipped through or shared between workers per
split. Two kinds of source allow that:

- `ArraySource`: numpy arrays or tensors given to `fit` as `(x, y,
  sample_weight)`. Batch `b` of an epoch holds the examples at positions
  `[b * batch_size, (b + 1) * batch_size)` of the epoch's order: the arrays'
  order, or with `shuffle=True` (Keras' default) a permutation per epoch
  (`tf.random.experimental.index_shuffle`), as Keras shuffles arrays. The
  permutation is a function of the epoch and the data's size, the same in a
  restarted chief: a resumed epoch's remaining splits are its untrained ones.
- `DatasetSource`: a finite `tf.data.Dataset` of batches, or a
  `DatasetCreator` that builds one on each worker, whose number of batches
  TensorFlow knows and whose batches it can read by index
  (`tf.data.experimental.at`): pipelines of `range`, `from_tensor_slices`,
  `map`, `batch`, `zip`, `cache`, `prefetch`. Refused, with what to do
  instead: an unknown length (`filter`: stream it with `steps_per_epoch`)
  and `shuffle` (each worker would draw its own order).
- `files.FileSource`: a pipeline over TFRecord or text files, whose length
  follows from an index of the files' records (`files`); compressed files are
  read whole, each one split (`whole_files`).

A source's data reaches each worker once (`worker_data`); `read(data, batch,
epoch)` runs inside the scheduled function.
"""

import zlib

import numpy as np
import tensorflow as tf

from kfit_ps import _tf_compat
from kfit_ps.ledger.batched import Batched, epoch_permutation
from kfit_ps._tf_compat import dataset_graph
from kfit_ps.ledger import files

class NotIndexable(ValueError):
    """A finite dataset that workers cannot read by batch index (it shuffles, has no random
    access, or uses state of the coordinator); `fit` can still read it on the coordinator.
    `reason`: why, in a few words."""

    def __init__(self, message, reason):
        super().__init__(message)
        self.reason = reason


STREAM = "stream it: repeat it and pass `steps_per_epoch` (batches per epoch)."


def _random_access(dataset):
    """`dataset` with the one tf.data rewrite that removes random access turned off.

    tf.data fuses `map` followed by `batch` into one op that cannot read a
    batch by index; unfused, each batch is read by index as before.
    """
    options = tf.data.Options()
    options.experimental_optimization.map_and_batch_fusion = False
    return dataset.with_options(options)


def _rows(structure):
    leaf = tf.nest.flatten(structure)[0]
    return int(leaf.shape[0]) if len(leaf.shape) else 1


_SAMPLED_ROWS = 64  # rows of each array a fingerprint reads, evenly spaced, first and last


def _fingerprint(structure, rows=None):
    """A hex CRC32 of the dtypes, shapes and rows of every array of `structure` (all rows, or
    the row positions `rows`): a resume on other content is told from it."""
    crc = 0
    for leaf in tf.nest.flatten(structure):
        array = np.asarray(leaf)
        part = array if rows is None or not array.ndim else array[rows]
        crc = zlib.crc32(f"{array.dtype.str}{array.shape}".encode(), crc)
        if array.dtype.kind == "O":  # Strings: their values (the bytes would be addresses).
            crc = zlib.crc32("\x1f".join(map(repr, part.ravel().tolist())).encode(), crc)
        else:
            crc = zlib.crc32(np.ascontiguousarray(part).tobytes(), crc)
    return f"{crc:08x}"


class ArraySource(Batched):
    """Arrays read by example position: batch `b` gathers its `batch_size` rows."""

    kind = "arrays"

    def __init__(self, arrays, num_examples, batch_size, shuffle, seed=None):
        self.arrays = arrays
        self.num_examples = int(num_examples)
        self.batch_size = int(batch_size)
        self.num_batches = -(-self.num_examples // self.batch_size)
        self.shuffle = bool(shuffle)
        # Each epoch's permutation follows from the seed and the epoch. The default seed
        # follows from the data's size: a restarted chief resuming an epoch at a split
        # draws the same permutation, so the splits after it hold the untrained examples.
        self.seed = int(zlib.crc32(f"{self.num_examples}/{self.batch_size}".encode())
                        if seed is None else seed)
        self.element_spec = tf.nest.map_structure(
            lambda a: tf.TensorSpec((None,) + tuple(a.shape[1:]), tf.as_dtype(a.dtype)), arrays)

    def worker_data(self, coordinator):
        """Each worker's copy of the arrays (sent once, read by every split)."""
        arrays = self.arrays
        return coordinator.create_per_worker_dataset(
            lambda: tf.data.Dataset.from_tensors(arrays)).build()

    def read(self, data, batch, epoch):
        """The examples of `batch` (int64 scalar tensor) in `epoch`'s order, inside a function."""
        arrays = tf.data.experimental.at(data, 0)
        start = batch * self.batch_size
        stop = tf.minimum(start + self.batch_size, self.num_examples)
        positions = tf.range(start, stop, dtype=tf.int64)
        if self.shuffle:
            positions = epoch_permutation(positions, self.seed, epoch, self.num_examples)
        return tf.nest.map_structure(lambda a: tf.gather(a, positions), arrays)

    def examples_in(self, first, count):
        """Examples in batches `[first, first + count)`."""
        return max(0, min((first + count) * self.batch_size, self.num_examples)
                   - first * self.batch_size)

    def describe(self):
        """What identifies the data: a resumed run must cut the same splits, in the same
        order, of the same examples (rows sampled for the content's fingerprint)."""
        rows = np.unique(np.linspace(0, self.num_examples - 1,
                                     min(self.num_examples, _SAMPLED_ROWS)).astype(np.int64))
        return {"kind": self.kind, "batches": self.num_batches, "examples": self.num_examples,
                "batch_size": self.batch_size, "shuffle": self.shuffle, "seed": self.seed,
                "fingerprint": _fingerprint(self.arrays, rows)}


class DatasetSource(Batched):
    """A finite dataset of batches with random access, read batch by batch by index."""

    kind = "dataset"

    def __init__(self, sample, build=None):
        """`sample`: the dataset (built on the coordinator); `build`: a function that
        builds it on a worker (a DatasetCreator's), or None to send `sample`'s copy."""
        self.sample = _random_access(sample)
        self._build = build
        self.element_spec = sample.element_spec
        self.num_batches = int(sample.cardinality())
        first = tf.data.experimental.at(self.sample, 0)
        last = tf.data.experimental.at(self.sample, self.num_batches - 1)
        self.batch_size = _rows(first)
        self.last_size = _rows(last)
        self.num_examples = self.batch_size * (self.num_batches - 1) + self.last_size
        # The first and the last batch; a pipeline that reads differently each time (an
        # unseeded random `map`) has no content fingerprint, only its shape.
        again = tf.data.experimental.at(self.sample, 0)
        self._fingerprint = (_fingerprint((first, last))
                             if _fingerprint(again) == _fingerprint(first) else None)

    def worker_data(self, coordinator):
        if self._build is None:
            return coordinator.create_per_worker_dataset(self.sample).build()
        build = self._build
        return coordinator.create_per_worker_dataset(
            lambda: _random_access(build())).build()

    def read(self, data, batch, epoch):
        del epoch  # The dataset's own order, every epoch.
        return tf.data.experimental.at(data, batch)

    def describe(self):
        described = {"kind": self.kind, "batches": self.num_batches,
                     "examples": self.num_examples, "batch_size": self.batch_size}
        if self._fingerprint is not None:
            described["fingerprint"] = self._fingerprint
        return described


def dataset_source(dataset, arg, build=None, split_shuffle=None):
    """A `DatasetSource` for the finite `dataset`, or a ValueError saying why not.

    Args:
        dataset: the dataset of batches (for a DatasetCreator: one it built on
            the coordinator).
        arg: the argument's name, for errors.
        build: builds the dataset on a worker; None sends a copy of `dataset`.
        split_shuffle: a `SplitShuffle` (`kfit_ps.ledger.split_shuffle`): only a file
            pipeline takes one.
    """
    cardinality = int(dataset.cardinality())
    prefix = (f"`fit` without `steps_per_epoch` trains one pass over `{arg}` per epoch, every "
              "example once, reading each batch by its index on the worker that trains it.")
    if cardinality == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            "`steps_per_epoch` is required for an infinite dataset (it repeats): workers read "
            "their own datasets, so the end of the data does not end the epoch. Received: "
            "steps_per_epoch=None. Pass e.g. steps_per_epoch=100, or remove `.repeat()` to "
            "train one pass per epoch.")
    if split_shuffle is not None and cardinality != tf.data.UNKNOWN_CARDINALITY:
        raise ValueError(
            f"kfit_ps.ledger.split_shuffle(...) shuffles the records of a pipeline over "
            f"TFRecord or text files, and `{arg}` is a dataset of {cardinality} batches of "
            f"another source. Received: split_shuffle(buffer_size={split_shuffle.buffer_size}). "
            f"Pass the dataset unwrapped (pass numpy arrays to have them shuffled every epoch "
            f"with shuffle=True).")
    if cardinality == tf.data.UNKNOWN_CARDINALITY:
        try:
            return files.FileSource(dataset, split_shuffle)
        except files.NotFiles as refusal:
            reason = refusal.reason
        except dataset_graph.Unserializable as refusal:
            reason = f"it uses state of this process (TensorFlow says {refusal.reason!r})"
        raise ValueError(
            f"{prefix} TensorFlow does not know how many batches `{arg}` has, and kfit_ps "
            f"cannot count them in its files: {reason}. Received: a dataset of unknown "
            f"cardinality and steps_per_epoch=None. Read the files with TFRecordDataset or "
            f"TextLineDataset followed by `map` and `batch` (docs/training_input.md), build "
            f"it from `range` or `from_tensor_slices` with `map` and `batch`, or {STREAM}")
    if cardinality == 0:
        raise ValueError(f"`{arg}` has no batches: there is nothing to train on. Received an "
                         "empty dataset (cardinality 0). Pass data with at least one batch "
                         "(check `take`, `skip` and `batch(..., drop_remainder=True)`).")
    shuffles = _tf_compat.shuffle_ops(dataset)
    if shuffles:
        raise NotIndexable(
            f"{prefix} `{arg}` shuffles ({', '.join(shuffles)}): each worker would draw its own "
            "order, so splits would not hold the same examples everywhere. Received: a dataset "
            "with `shuffle` and steps_per_epoch=None. Remove `shuffle` (shuffle the source "
            "once, or pass numpy arrays with shuffle=True: they are shuffled every epoch), or "
            f"{STREAM}", reason="it shuffles")
    state = _tf_compat.external_state(dataset) if build is None else None
    if state is not None:  # A copy sent to the workers would lack this process's state.
        raise NotIndexable(
            f"{prefix} `{arg}` uses state of this process (a variable a `map` reads, a Python "
            f"generator, a stateful op), so workers cannot build a copy of it: "
            f"TensorFlow says {state!r}. Build the pipeline in a DatasetCreator (each "
            f"worker then makes its own), or {STREAM}",
            reason="it uses state of this process: a variable or a Python function")
    try:
        return DatasetSource(dataset, build)
    except (tf.errors.UnimplementedError, tf.errors.OutOfRangeError) as e:
        reason = str(e).strip().splitlines()[0][:200]
        raise NotIndexable(
            f"{prefix} `{arg}` cannot be read by batch index: TensorFlow says {reason!r}. "
            f"Received: a dataset without random access and steps_per_epoch=None. Build it "
            f"from `range` or `from_tensor_slices` with `map` and `batch`, or "
            f"{STREAM}", reason="it has no random access") from None
