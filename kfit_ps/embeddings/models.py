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


def epoch_stats(model):
    """{"<layer>_rows": ..., "<layer>_admitted": ..., "<layer>_evicted": ...} for epoch logs."""
    logs = {}
    for layer in dynamic_layers(model):
        if layer.table is None:
            continue
        stats = layer.stats()
        for name in ("rows", "admitted", "evicted"):
            logs[f"{layer.name}_{name}"] = float(stats[name])
    return logs
