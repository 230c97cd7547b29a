"""The strategy layer: scope, variable placement, atomic Keras variable updates."""

from kfit_ps.strategy.sharding import shards
from kfit_ps.strategy.strategy import ParameterServerStrategy, is_kfit_strategy

__all__ = ["ParameterServerStrategy", "is_kfit_strategy", "shards"]
