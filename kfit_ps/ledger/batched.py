"""What the ledger's sources of batches share: how many examples a run of batches holds, the
epoch's permutation a shuffling source reads in, and the splits a source has trained whole."""

import dataclasses

import numpy as np
import tensorflow as tf


class Batched:
    """`num_batches` batches of `batch_size` examples; the last holds `last_size`. A source
    reads batch `b` of an epoch with `read(data, b, epoch)` inside a traced function."""

    num_batches: int
    batch_size: int
    last_size: int

    def examples_in(self, first, count):
        """Examples in batches `[first, first + count)`."""
        stop = min(first + count, self.num_batches)
        if stop <= first:
            return 0
        full = stop - first - (1 if stop == self.num_batches else 0)
        return full * self.batch_size + (self.last_size if stop == self.num_batches else 0)

    def whole_splits(self, epoch):
        """`WholeSplits` of `epoch` when the source's batches come in runs that one function
        must train whole (a compressed file's), else None: a split may start at any batch."""
        del epoch
        return None

    def split_reader(self, data, first, epoch, count):
        """`next_batch(j)`: batch `first + j` of `epoch`, inside the function that trains the
        `count` batches of the split from batch `first` (`j` an int or an int64 scalar
        tensor, 0, 1, ... in turn)."""
        del count  # Each batch read by its index.
        return lambda j: self.read(data, first + j, epoch)


@dataclasses.dataclass(frozen=True)
class WholeSplits:
    """An epoch's splits, each trained whole by one function, in the epoch's order: split `i`
    is batches `[starts[i], starts[i + 1])` (the last start is the number of batches) and
    holds `examples[i]` examples, in batches of `batch_size` but its last."""

    starts: np.ndarray  # int64, ascending, from 0
    examples: np.ndarray  # int64, one per split
    batch_size: int

    def _split(self, batch):
        return int(np.searchsorted(self.starts, batch, side="right")) - 1

    def end(self, batch):
        """The end (exclusive) of the split that holds batch `batch`."""
        return int(self.starts[self._split(batch) + 1])

    def boundary(self, step):
        """The first split boundary at or after `step` (a step where a window may end)."""
        return int(self.starts[np.searchsorted(self.starts, step, side="left")])

    def examples_in(self, first, count):
        """Examples in batches `[first, first + count)`, all of one split."""
        split = self._split(first)
        after = int(self.examples[split]) - (first - int(self.starts[split])) * self.batch_size
        return max(0, min(count * self.batch_size, after))

    def splits_holding(self, batches):
        """How many splits hold the batch indices `batches` (an int array)."""
        return len(np.unique(np.searchsorted(self.starts, batches, side="right")))


def epoch_permutation(index, seed, epoch, size):
    """Where `index` (int64 tensor, in `[0, size)`) goes in `epoch`'s permutation of `size`
    items: a function of `seed` and the epoch only, so a restarted chief draws the same."""
    key = tf.stack([tf.constant(seed, tf.int64), tf.cast(epoch, tf.int64)])
    return tf.random.experimental.index_shuffle(index, key, tf.constant(size - 1, tf.int64))
