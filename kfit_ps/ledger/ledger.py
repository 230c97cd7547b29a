"""The ledger of a one-pass epoch: which splits of the data were trained, and how often.

`fit` on finite data without `steps_per_epoch` cuts each epoch into splits of
`steps_per_execution` batches of a `sources` source (`split_at`), except where
the source has runs of batches that one function must train whole (a
compressed file's, `Batched.whole_splits`): each such run is one split,
whatever its length, and a synchronisation due inside it waits for its end
(`sync_point`). The coordinator hands each split to one scheduled function
(`dispatched`); a split counts as trained once its function finished, which
`fit` knows at its next synchronisation (`joined`). TensorFlow re-runs the
function of a worker that died; the ps-side `Attempts` counters tell which
splits ran more than once.

What is exact and what is bounded (docs/training_input.md):

- every split of the epoch is trained: `lost` is 0 whenever the epoch ends;
- a split is *re-run* when its function started more than once. Only the
  examples of re-run splits can have had updates applied twice, at most once
  per extra start: `examples_rerun` bounds the re-trained examples, and the
  others were trained exactly once;
- metrics count every batch exactly once (each finished function's state is
  added once).

`state()` is what backups record with the model's state: a resumed run with
different data (another number of batches, examples or batch size) is
refused (`kfit_ps.callbacks.BackupAndRestore`).
"""

import dataclasses

import numpy as np

from kfit_ps.ledger.attempts import Attempts


@dataclasses.dataclass(frozen=True)
class Rerun:
    """A split whose function started more than once."""

    first_batch: int
    batches: int
    starts: int
    examples: int

    def positions(self, batch_size):
        """Example positions `(start, stop)` of this split in the epoch's order, when every
        batch before it holds `batch_size` examples (not after a compressed file's short
        last batch: `examples` is exact either way)."""
        return self.first_batch * batch_size, self.first_batch * batch_size + self.examples


# The keys `EpochReport.logs` adds to each one-pass epoch's logs: the report's attribute each
# reports, and what it means (docs/training_input.md prints this).
LOG_KEYS = {
    "ledger_splits": ("splits", "splits this run trained in the epoch"),
    "ledger_splits_rerun": ("splits_rerun", "splits whose function started more than once"),
    "ledger_examples_rerun": ("examples_rerun",
                              "at most this many examples were trained twice"),
    "ledger_splits_lost": ("lost", "splits of the epoch that no finished function trained: 0"),
}


@dataclasses.dataclass(frozen=True)
class EpochReport:
    """What one epoch trained, split by split."""

    epoch: int
    splits: int  # Splits dispatched by this run in this epoch.
    batches: int  # Batches of the data (the epoch's length).
    first_batch: int  # 0, or where a resumed epoch started.
    trained_once: int  # Splits whose function started exactly once.
    reruns: tuple  # `Rerun`s, by first batch.
    lost: int  # Splits of the epoch that no finished function trained (0).

    @property
    def examples_rerun(self):
        """At most this many examples had their updates applied more than once."""
        return sum(r.examples * (r.starts - 1) for r in self.reruns)

    def summary(self):
        """One line for the user when a split re-ran or was lost, else ""."""
        if not (self.reruns or self.lost):
            return ""
        return (f"kfit_ps: epoch {self.epoch + 1}: {len(self.reruns)} split(s) re-run after a "
                f"worker loss (at most {self.examples_rerun} examples trained twice), "
                f"{self.lost} lost; every other split trained exactly once.")

    @property
    def splits_rerun(self):
        """Splits whose function started more than once."""
        return len(self.reruns)

    def logs(self):
        """The report as epoch logs (History, TensorBoard): `LOG_KEYS`."""
        return {key: float(getattr(self, name)) for key, (name, _) in LOG_KEYS.items()}


class Ledger:
    """Splits of one `fit`'s one-pass epochs, dispatched, finished and re-run."""

    def __init__(self, source, strategy, split_size):
        self.source = source
        self.split_size = int(split_size)
        self.attempts = Attempts(strategy, source.num_batches)
        self._whole = source.whole_splits(0)  # Each epoch's from `begin_epoch` on.
        # Whether functions train splits whole, of any length (read in one stream).
        self.whole = self._whole is not None
        self.reports = []
        self._epoch = None
        self._first = 0
        self._pending = []  # (first batch, batches) dispatched since the last join.
        self._done = []  # (first batch, batches) whose function finished.

    def state(self):
        """What a backup records: the data's shape (a resume must cut the same splits)."""
        return self.source.describe()

    def begin_epoch(self, epoch, first_batch):
        self._epoch, self._first = epoch, first_batch
        self._pending, self._done = [], []
        self._whole = self.source.whole_splits(epoch)
        self.attempts.reset()

    def split_at(self, first):
        """The batches of the split that starts at batch `first`: `split_size`, or the rest
        of the whole split that holds it (the epoch's end bounds both)."""
        if self._whole is None:
            return min(self.split_size, self.source.num_batches - first)
        return self._whole.end(first) - first

    def sync_point(self, step):
        """Where a synchronisation asked for after `step` batches can be: the first split
        boundary at or after it (`step` itself but inside a whole split)."""
        return step if self._whole is None else self._whole.boundary(step)

    def dispatched(self, first_batch, sizes):
        """Records functions scheduled for consecutive splits from `first_batch`."""
        for n in sizes:
            self._pending.append((first_batch, n))
            first_batch += n

    def joined(self, dropped=()):
        """Every pending function finished, except those at positions `dropped` (in
        dispatch order: they never started)."""
        dropped = set(dropped)
        self._done.extend(p for i, p in enumerate(self._pending) if i not in dropped)
        self._pending = []

    def end_epoch(self):
        """The report of the epoch just joined; kept in `reports`."""
        starts = self.attempts.read()
        covered = np.zeros(self.source.num_batches, bool)
        covered[:self._first] = True  # Trained before a resume (restored with the state).
        reruns, once = [], 0
        for first, n in self._done:
            covered[first:first + n] = True
            count = int(starts[first])
            if count > 1:
                examples = (self.source.examples_in(first, n) if self._whole is None
                            else self._whole.examples_in(first, n))
                reruns.append(Rerun(first, n, count, examples))
            else:
                once += 1
        lost_batches = np.flatnonzero(~covered)
        report = EpochReport(
            epoch=self._epoch, splits=len(self._done), batches=self.source.num_batches,
            first_batch=self._first, trained_once=once, reruns=tuple(reruns),
            lost=_splits(lost_batches, self.split_size) if self._whole is None
            else self._whole.splits_holding(lost_batches))
        self.reports.append(report)
        return report


def _splits(batches, split_size):
    """Splits of at most `split_size` that the sorted batch indices `batches` make up."""
    if len(batches) == 0:
        return 0
    breaks = np.flatnonzero(np.diff(batches) > 1)
    lengths = np.diff(np.concatenate([[0], breaks + 1, [len(batches)]]))
    return int(sum(-(-length // split_size) for length in lengths))
