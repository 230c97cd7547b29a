"""Records shuffled within each split of one-pass epochs over files (opt-in).

A `shuffle` in the user's pipeline is refused: each worker would draw its own
order. `split_shuffle(dataset, buffer_size)` asks kfit_ps for the shuffle
instead: the function that trains a split reads the split's records as one
stream, passes them through a `buffer_size` shuffle (at most the split's
records) seeded by the seed, the epoch and the split's first batch (not by
TensorFlow's global seed), then through the pipeline's own steps
after its reader (`map`, `batch`, ...). A split holds the same records
whichever worker trains it and however often, so every record is still
trained once per epoch, and a re-run split trains the same records again.
The mixing reaches as far as a split: about `steps_per_execution` batches of
uncompressed files (a shuffled file list also permutes the batches each
epoch), a whole compressed file.
"""

import dataclasses

import tensorflow as tf

from kfit_ps import validation

_SEED2 = 0x6B66_6974  # The shuffle's second seed: fixed ("kfit").


@dataclasses.dataclass(frozen=True)
class SplitShuffle:
    """A file pipeline whose records are shuffled within each split (`split_shuffle`)."""

    dataset: object
    buffer_size: int
    seed: int

    def shuffled(self, records, epoch, first, limit):
        """`records` (the split from batch `first` of `epoch`: at most `limit` of them, an
        int64 tensor) through a shuffle buffer of `min(buffer_size, limit)` seeded by the
        seed, the epoch and the split only: the raw op, so that TensorFlow's global seed
        (`tf.random.set_seed`, `keras.utils.set_random_seed`) plays no part."""
        seed = (tf.cast(self.seed, tf.int64) * 1_000_003 + tf.cast(epoch, tf.int64)) \
            * 1_000_033 + tf.cast(first, tf.int64)
        spec = records.element_spec
        variant = tf.raw_ops.ShuffleDataset(
            input_dataset=tf.data.experimental.to_variant(records),
            buffer_size=tf.maximum(tf.minimum(tf.constant(self.buffer_size, tf.int64),
                                              tf.cast(limit, tf.int64)), 1),
            seed=tf.math.floormod(seed, (1 << 31) - 1), seed2=tf.constant(_SEED2, tf.int64),
            reshuffle_each_iteration=False, output_types=[spec.dtype],
            output_shapes=[spec.shape])
        return tf.data.experimental.from_variant(variant, spec)

    def describe(self):
        """What a backup records: a resume must shuffle the same way."""
        return {"buffer_size": self.buffer_size, "seed": self.seed}


def split_shuffle(dataset, buffer_size, seed=0):
    """Marks `dataset` (a file pipeline for one-pass epochs) to be trained with its records
    shuffled within each split, through a `buffer_size` shuffle seeded by `seed`, the epoch
    and the split: `model.fit(kfit_ps.ledger.split_shuffle(dataset, 4096), epochs=3)`.

    Every record is still trained once per epoch (docs/training_input.md). Only for
    pipelines over TFRecord or text files, given to `fit` without `steps_per_epoch`.
    """
    if not isinstance(dataset, tf.data.Dataset):
        raise ValueError(
            "kfit_ps.ledger.split_shuffle(dataset, buffer_size) takes a tf.data.Dataset over "
            f"TFRecord or text files. Received: dataset of type {type(dataset).__name__}. Pass "
            "the pipeline itself (arrays are shuffled by `fit(..., shuffle=True)`).")
    buffer_size = validation.check_int("buffer_size", buffer_size, 2, owner="split_shuffle")
    seed = validation.check_int("seed", seed, 0, owner="split_shuffle")
    return SplitShuffle(dataset, buffer_size, seed)
