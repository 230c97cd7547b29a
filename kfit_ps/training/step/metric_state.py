"""Exactly-once metric state for scheduled functions.

TensorFlow re-runs a scheduled function whose worker died, so anything the
function wrote to the ps before the failure is written again: updates are
at-least-once. For parameters that is the nature of asynchronous training;
for metrics it would make counts wrong (a batch counted twice).

So metric state is never written on the ps by a scheduled function. Each
function starts from zero metric state, runs its steps with the metric
variables kept local (`_tf_compat.LocalStateScope`), and *returns* the state
it accumulated. The coordinator adds the returned state of each function
exactly once, when that function has finished (`Accumulator`), and writes
the sum to the metric variables after synchronising (`Accumulator.commit`).
A re-run function returns one result, so each step's metrics count once.

This is exact for metric variables with `aggregation="sum"` (every Keras 3
built-in metric: totals, counts, confusion matrices), which Keras defines as
additive across replicas starting from zero. A variable with any other
aggregation keeps being updated in place on the ps (at-least-once).

Returned state is packed into one flat tensor per dtype, so fetching a
function's result is one small transfer.
"""

import collections

import numpy as np
import tensorflow as tf

from kfit_ps import _tf_compat, constants


class MetricState:
    """Which metric variables a model's scheduled functions keep local."""

    def __init__(self, model):
        self.variables = [v for v in model.metrics_variables if v.aggregation == "sum"]
        self._groups = {}
        for index, v in enumerate(self.variables):
            self._groups.setdefault(v.dtype, []).append(index)

    def zeros(self):
        """Zero state (inside a traced function)."""
        return [tf.zeros(v.shape, v.dtype) for v in self.variables]

    def run_replica(self, strategy, step, batch, state):
        """`strategy.run(step, (batch,))` with the metric variables local; returns their values.

        The scope is entered inside the replica function: strategies may run
        it on their own thread, and Keras scopes are per thread.
        """

        def replica_fn(batch, state):
            if not self.variables:
                step(batch)
                return state
            with _tf_compat.LocalStateScope(list(zip(self.variables, state))) as scope:
                step(batch)
            return [tf.convert_to_tensor(scope.get_current_value(v)) for v in self.variables]

        result = strategy.run(replica_fn, args=(batch, state))
        return [strategy.experimental_local_results(part)[0] for part in result]

    def pack(self, state):
        """One flat tensor per dtype (inside a traced function)."""
        return tuple(tf.concat([tf.reshape(state[i], [-1]) for i in indices], axis=0)
                     for indices in self._groups.values())

    def unpack(self, packed):
        """Numpy arrays in variable order from `pack`'s (fetched) output."""
        values = [None] * len(self.variables)
        for flat, indices in zip(packed, self._groups.values()):
            offset = 0
            for i in indices:
                shape = self.variables[i].shape
                size = int(np.prod(shape, dtype=np.int64))
                values[i] = np.reshape(flat[offset:offset + size], shape)
                offset += size
        return values


def _widened(array):
    """Floating state is summed in float64, so adding many results loses nothing."""
    return array.astype(np.float64) if np.issubdtype(array.dtype, np.floating) else array


class Accumulator:
    """Adds the metric state of finished functions, each exactly once.

    Results are folded into a running sum while the epoch goes on, oldest
    first, whenever more than `max_pending` are waiting: the coordinator
    keeps a bounded number of results however long the epoch (an epoch of
    20,000 steps would otherwise hold 20,000 results until its `join()`).
    Functions finish roughly in scheduling order and TensorFlow bounds how
    many are in flight, so the oldest result is almost always ready by then;
    if not, fetching it waits for that one function, through `fetch` (which
    raises `WorkersLostError` when every worker is gone too long).
    """

    def __init__(self, metric_state, max_pending=None, fetch=None):
        self._state = metric_state
        self._pending = collections.deque()
        self._sum = None
        self._max_pending = max_pending or constants.metric_results_pending()
        # Bounds the wait for a result (`cluster_health.result_fetcher`).
        self._fetch = fetch or (lambda remote: remote.fetch())

    def add(self, remote_value):
        """Registers a scheduled function's result (a RemoteValue of `pack` output)."""
        if self._state.variables:
            self._pending.append(remote_value)
            while len(self._pending) > self._max_pending:
                self._fold_one(self._pending.popleft())

    def discard(self, remote_values):
        """Forgets the results of `remote_values` (functions that failed or were dropped:
        run again)."""
        dropped = {id(v) for v in remote_values}
        kept = [v for v in self._pending if id(v) not in dropped]
        self._pending.clear()
        self._pending.extend(kept)

    def _fold_one(self, remote):
        packed = [_widened(np.asarray(part)) for part in self._fetch(remote)]
        if self._sum is None:
            self._sum = packed
        else:
            self._sum = [a + b for a, b in zip(self._sum, packed)]

    def fold(self):
        """Fetches every registered result; call after `join()`."""
        while self._pending:
            self._fold_one(self._pending.popleft())

    def commit(self):
        """Folds, then writes the accumulated state to the metric variables."""
        self.fold()
        if self._sum is None:
            return
        for variable, value in zip(self._state.variables, self._state.unpack(self._sum)):
            variable.assign(value.astype(variable.dtype))
