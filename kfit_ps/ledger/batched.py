"""What the ledger's sources of batches share: how many examples a run of batches holds, and
the epoch's permutation a shuffling source reads in."""

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


def epoch_permutation(index, seed, epoch, size):
    """Where `index` (int64 tensor, in `[0, size)`) goes in `epoch`'s permutation of `size`
    items: a function of `seed` and the epoch only, so a restarted chief draws the same."""
    key = tf.stack([tf.constant(seed, tf.int64), tf.cast(epoch, tf.int64)])
    return tf.random.experimental.index_shuffle(index, key, tf.constant(size - 1, tf.int64))
