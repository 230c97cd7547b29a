"""Every training example exactly once: one-pass epochs split and counted by a ledger.

`fit` on finite data (numpy arrays, a finite dataset that TensorFlow can
read by batch index, or a pipeline over TFRecord or text files, GZIP or ZLIB
ones read whole, a file a split) without `steps_per_epoch` trains one pass per
epoch: `sources`, `files` (its readers: `file_readers`) and `whole_files` say
what data qualifies, `ledger` what is counted and promised; `split_shuffle` shuffles a
file pipeline's records within each split.
`kfit_ps.ledger.reports(model)` returns the last `fit`'s per-epoch reports.
"""

from kfit_ps.ledger.files import FileSource
from kfit_ps.ledger.ledger import EpochReport, Ledger, Rerun
from kfit_ps.ledger.sources import ArraySource, DatasetSource, NotIndexable, dataset_source
from kfit_ps.ledger.split_shuffle import SplitShuffle, split_shuffle


def reports(model):
    """The `EpochReport`s of `model`'s last one-pass `fit`, oldest first ([] if none)."""
    ledger = getattr(model, "_kfit_ps_ledger", None)
    return list(ledger.reports) if ledger is not None else []


__all__ = ["ArraySource", "DatasetSource", "EpochReport", "FileSource", "Ledger", "NotIndexable",
           "Rerun", "SplitShuffle", "dataset_source", "reports", "split_shuffle"]
