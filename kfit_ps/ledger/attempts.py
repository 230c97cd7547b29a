"""How many times each split's function started, counted on a ps.

TensorFlow re-runs a scheduled function whose worker died, on another
worker, without telling the coordinator. Each ledgered function therefore
adds 1 to its split's counter on a ps before its first step (every step
takes its batch through a control dependency on that write): a split
counted more than once was started more than once, and only such a split
can have had part of its updates applied twice. A function that died before
the write applied nothing.
"""

import tensorflow as tf


class Attempts:
    """One int32 counter per batch index, on a ps (indexed by a split's first batch)."""

    def __init__(self, strategy, num_batches):
        self._size = int(num_batches)
        with strategy.scope():
            self.variable = tf.Variable(tf.zeros([self._size], tf.int32), trainable=False,
                                        name="kfit_ps_ledger_attempts")

    def mark(self, first):
        """Counts a start of the split beginning at batch `first` (inside a traced function);
        returns the write, for control dependencies."""
        index = tf.reshape(tf.cast(first, tf.int64), [1])
        return self.variable.scatter_add(tf.IndexedSlices(tf.ones([1], tf.int32), index))

    def read(self):
        """The counters, as a numpy array (whole, also when a partitioner sharded them)."""
        return tf.convert_to_tensor(self.variable).numpy()

    def reset(self):
        self.variable.assign(tf.zeros([self._size], tf.int32))
