"""Dynamic embeddings: tables of unbounded id spaces on the ps tasks.

`DynamicEmbedding` (the layer) owns a `DynamicTable` (hash tables split over
the ps tasks, with optimizer slots and counts); `recording` carries a training
step's lookups to kfit_ps' gradient step; `sparse_optimizer` is Keras'
optimizer `apply` for the touched rows of every sparse table (dynamic and
sharded); `saving` writes and reads tables in chunks; `hashing` maps ids to
keys, shards and initial vectors.
"""

from kfit_ps.embeddings import recording
from kfit_ps.embeddings.layer import DynamicEmbedding
from kfit_ps.embeddings.models import dynamic_layers, epoch_stats, prepare_training, read_tables

__all__ = ["DynamicEmbedding", "dynamic_layers", "epoch_stats", "prepare_training", "read_tables",
           "recording"]
