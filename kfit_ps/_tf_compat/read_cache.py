"""A Keras scope that answers variable reads from values fetched once per step.

Inside a scheduled function every read of a variable on a ps is its own
transfer (one gRPC call per variable per step). kfit_ps instead fetches the
model's small variables in one packed transfer per ps
(`kfit_ps.training.step.transfers`) and runs the forward pass in a
`CachedReadScope`: Keras' `Variable.value` then returns the fetched tensor.
A sharded variable's cached value is its whole value (a sharded evaluation's
snapshot), and `ops.take` on it gathers from that value on the worker
(`keras_sharding`). A training step may also hand it the rows of sharded
tables it fetched for the batch's ids (`lookups`): an `ops.take` of such a
table with those very ids then gathers from those rows on the worker
(`keras_sharding`).
Writes (batch-norm statistics, seed state) still go to
the variable's real storage, and later reads in the same scope see the
written value.

It nests inside a `LocalStateScope` (metric state): metric variables stay
local to that scope, and losses added by layers are collected here. It
relies on how Keras 3.15's `Variable.value`, `assign` and `Layer.add_loss`
consult the active scope, hence its place here.
"""

from keras.src.backend.common.stateless_scope import get_stateless_scope

from kfit_ps._tf_compat.metric_scope import LocalStateScope


class CachedReadScope(LocalStateScope):
    """Reads of the variables in `cache` ((variable, tensor) pairs) return those tensors."""

    def __init__(self, cache, lookups=None):
        super().__init__([])
        self._cache = {id(variable): value for variable, value in cache}
        # id(variable) -> fn(ids) -> rows, or None for ids it has no rows for.
        self._lookups = dict(lookups or {})
        self._parent = None

    def __enter__(self):
        parent = get_stateless_scope()
        if parent is not None and not isinstance(parent, LocalStateScope):
            raise RuntimeError(
                f"kfit_ps: a CachedReadScope cannot nest in a Keras {type(parent).__name__}.")
        self._parent = parent
        return super().__enter__()

    def caches(self, variable):
        """Whether reads of `variable` come from this scope's values."""
        return id(variable) in self._cache

    def fetched_lookup(self, variable, ids):
        """The rows of `ids` in `variable` from the rows the step fetched for those very ids,
        or None: any other lookup reads the table itself."""
        lookup = self._lookups.get(id(variable))
        return lookup(ids) if lookup is not None else None

    def is_local(self, variable):
        return self._parent is not None and self._parent.is_local(variable)

    def add_update(self, update):
        variable, value = update
        if id(variable) in self._cache:
            self._cache[id(variable)] = value
        if self._parent is not None:
            self._parent.add_update(update)
        else:
            variable._direct_assign(value)

    def get_current_value(self, variable):
        if id(variable) in self._cache:
            return self._cache[id(variable)]
        if self._parent is not None:
            return self._parent.get_current_value(variable)
        return getattr(variable, "_value", None)


def cached_read(variable):
    """Whether the active scope answers reads of `variable` from a fetched value."""
    scope = get_stateless_scope()
    return isinstance(scope, CachedReadScope) and scope.caches(variable)
