"""kfit_ps' Keras layers: `DynamicEmbedding` (tables of unbounded id spaces on the ps tasks)."""

from kfit_ps.embeddings import DynamicEmbedding

__all__ = ["DynamicEmbedding"]
