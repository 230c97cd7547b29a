"""What the ledger's sources of batches share: how many examples a run of batches holds."""


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

