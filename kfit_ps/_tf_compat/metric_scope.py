"""A Keras scope that keeps chosen variables local to one traced function.

Keras 3's `StatelessScope` redirects *every* variable: reads come from a
mapping, writes are recorded instead of applied. Parameter-server training
needs that for metric state only: a scheduled function must compute its
metric updates without touching the metric variables on the ps (so that a
function TensorFlow re-runs after a worker died is not counted twice), while
its optimizer updates, `iterations`, seed and batch-norm state go to the ps
as usual.

`LocalStateScope(mapping)` is a `StatelessScope` whose mapping holds the
local variables; every other variable reads its real storage and writes
through to it. It relies on how Keras 3.15's `Variable.value`, `assign` and
`Layer` loss collection consult the active scope, hence its place here.
"""

from keras import StatelessScope
from keras.src.backend.common.stateless_scope import get_stateless_scope

from kfit_ps._tf_compat.versions import check_versions


class LocalStateScope(StatelessScope):
    """Variables in `state_mapping` stay local; all others behave normally.

    Use as `with LocalStateScope([(var, tensor), ...]) as scope:` inside a
    traced function; afterwards `scope.get_current_value(var)` is the local
    variable's new value. Layer losses (`add_loss`) are collected as usual.
    """

    def __init__(self, state_mapping):
        check_versions()
        super().__init__(state_mapping, collect_losses=True, initialize_variables=False)
        self._local_ids = frozenset(self.state_mapping)

    def is_local(self, variable):
        return id(variable) in self._local_ids

    def add_update(self, update):
        variable, value = update
        if self.is_local(variable):
            self.state_mapping[id(variable)] = value
        else:
            variable._direct_assign(value)

    def get_current_value(self, variable):
        if self.is_local(variable):
            return self.state_mapping[id(variable)]
        # Not None: Keras' regularization losses use this value directly.
        return getattr(variable, "_value", None)


def writes_through(variable):
    """Whether an update of `variable` now goes to its real storage.

    True outside any Keras stateless scope, and inside a `LocalStateScope`
    for every variable it does not keep local.
    """
    scope = get_stateless_scope()
    if scope is None:
        return True
    return isinstance(scope, LocalStateScope) and not scope.is_local(variable)
