"""What the fit loop asks of a model's dynamic embedding layers."""

from kfit_ps import _tf_compat
from kfit_ps.embeddings.layer import DynamicEmbedding
from kfit_ps.embeddings import sparse_optimizer


def dynamic_layers(model):
    """The model's `DynamicEmbedding` layers, nested ones included."""
    return [layer for layer in _tf_compat.sublayers(model)
            if isinstance(layer, DynamicEmbedding)]


def prepare_training(model):
    """Checks the model's optimizer against its dynamic tables and creates their slot tables.

    Raises ValueError naming the supported optimizers. (The fit loop checks
    that the model keeps Keras' own `train_step`.)
    """
    layers = dynamic_layers(model)
    if not layers:
        return
    for layer in layers:
        if layer.optimizer is None:  # The error names the supported optimizers.
            sparse_optimizer.slot_names(model.optimizer)
    for layer in layers:
        if layer.table is not None:
            layer.use_optimizer(model.optimizer)


def read_tables(model):
    """[(layer name, `Table.shard_stats()`)] of the model's built `DynamicEmbedding` tables,
    read on their ps tasks once: the reading serves the epoch's logs (`epoch_stats`) and the
    job's metrics (`training.monitor.table_stats`)."""
    return [(layer.name, layer.table.shard_stats()) for layer in dynamic_layers(model)
            if layer.table is not None]


def epoch_stats(readings):
    """{"<layer>_rows": ..., "<layer>_admitted": ..., "<layer>_evicted": ...} for epoch logs,
    from `read_tables(model)`."""
    return {f"{name}_{key}": float(sum(shard[key] for shard in shards))
            for name, shards in readings for key in ("rows", "admitted", "evicted")}
