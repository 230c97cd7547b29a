"""One pass per epoch over a dataset that only the coordinator can read: shipped batches.

A finite `tf.data.Dataset` given to `fit` without `steps_per_epoch` normally
trains one-pass epochs read by index on the workers (`kfit_ps.ledger`). Some
datasets cannot be read so: they shuffle (each worker would draw its own
order), they have no random access, or they use state of this process that a
copy cannot carry (a variable a `map` reads, a Python generator). Keras
scripts build such datasets: keras-io's `FeatureSpace` example shuffles. For them the coordinator iterates the
dataset once per epoch, in its own order, and sends each function its
batches as arguments, as `evaluate` does with shipped batches:

- every batch of the pass is scheduled once, in the dataset's order; a batch
  whose worker was lost is run again by TensorFlow on another worker (its
  update is at-least-once, its metrics count once), as for any function;
- the coordinator's reading bounds the throughput (the price of reading data
  that lives in this process);
- the batches of the functions not yet known to be finished are kept (at most
  `WINDOW` steps: `fit` joins every `WINDOW` steps), so that a function dropped
  by a stop, a scale change or a ps restored in place is scheduled again with
  the same batches;
- a resume at batch `b` of an epoch (a backup written mid-epoch) skips the
  first `b` batches of a new pass: exact for a dataset whose order is fixed; a
  shuffling one draws a new order, so the rest of that epoch is a new sample
  (said when it happens).
"""

from kfit_ps import _tf_compat

WINDOW = 64  # Steps between joins: bounds the batches kept on the coordinator.


class ShippedEpochs:
    """The coordinator's pass over `dataset` in the current epoch (see the module doc)."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.num_batches = int(dataset.cardinality())
        self.shuffles = bool(_tf_compat.shuffle_ops(dataset))
        self._iterator, self._next, self._kept = None, 0, {}

    def begin_epoch(self, first):
        """Starts a new pass; batches before `first` were trained before a resume."""
        self._iterator, self._next, self._kept = iter(self.dataset), 0, {}
        for _ in range(first):
            next(self._iterator)
        self._next = first

    def args(self, step, n):
        """The arguments of the function of steps `step..step+n-1`: its `n` batches."""
        while self._next < step + n:
            self._kept[self._next] = next(self._iterator)
            self._next += 1
        return (tuple(self._kept[s] for s in range(step, step + n)),)

    def forget_before(self, step):
        """Drops the batches of steps before `step`: their functions finished."""
        for s in [s for s in self._kept if s < step]:
            del self._kept[s]


def refusal_or_shipped(train_input, arg):
    """The ledger's source for `train_input`'s one-pass epochs, or a `ShippedEpochs` when
    workers cannot read it by index but the coordinator can; raises the ledger's refusal
    otherwise. Says once per fit which it chose, and why."""
    import kfit_ps.ledger as ledger

    try:
        return train_input.one_pass(), None
    except ledger.NotIndexable as refusal:
        if train_input.shippable is None:
            raise
        reason = refusal.reason
    shipped = ShippedEpochs(train_input.shippable)
    _tf_compat.print_msg(
        f"kfit_ps: `{arg}` is read on the coordinator and each batch shipped with its step "
        f"({reason}): one pass per epoch in the dataset's order, {shipped.num_batches} "
        "batches; the coordinator's reading bounds the speed.")
    return None, shipped
