"""The `tf.function`s the coordinator schedules on workers.

Each function runs `k` steps (the model's `steps_per_execution`, or the
remainder at the end of an epoch) of the model's own `train_step`,
`test_step` or `predict_step`, so custom steps of subclassed models are
honoured. Functions are traced once per model compilation and per `k`: they
are kept in the slots Keras itself uses (`model.train_function`, ...), which
`compile()` resets.

Training and evaluation functions keep metric state local and return it
(`metric_state`): the coordinator counts each finished function once.

The functions are traced without autograph, as Keras 3's own (its
`train_step`, `test_step` and `predict_step` run as plain Python: a tensor in
an `if` fails, as it does in Keras): converting kfit_ps' step code took about
3 s of CPU of the first `fit` in a process (docs/performance.md).
Their loops are written as graph loops (`_repeat`, `_for_each`).

Up to `MAX_UNROLLED_STEPS` steps are unrolled in the traced function rather
than looped: a loop whose body runs ops on the ps tasks becomes a
distributed while loop, whose per-iteration control messages between the
worker and every ps cost more than the larger graph (measured on the DLRM
job: about 15 % fewer steps/s with the loop at 5 steps per function). Steps
still run in order: TensorFlow orders each variable's reads after the
previous step's writes to it.
"""

import tensorflow as tf

from kfit_ps import _tf_compat, constants, embeddings
from kfit_ps.training.step import fetched_lookups, sharded_updates, transfers
from kfit_ps.training.step.metric_state import MetricState

MAX_UNROLLED_STEPS = 10


def _traced(run, **options):
    """`run` as a `tf.function`, traced as Keras 3 traces its own: without autograph."""
    return tf.function(run, jit_compile=False, autograph=False, **options)


def _repeat(k, body, state):
    """`state = body(index, state)` for each index of a `k`-step function: Python ints (the
    steps unrolled) up to `MAX_UNROLLED_STEPS`, else an int64 graph loop (its index adds to a
    batch index). `k`: an integer (Keras keeps `steps_per_execution` as given: a numpy one
    too), or an int64 tensor (always a loop)."""
    if not tf.is_tensor(k) and k <= MAX_UNROLLED_STEPS:
        for index in range(int(k)):
            state = body(index, state)
        return state
    _, state = tf.while_loop(lambda index, _: index < k,
                             lambda index, state: (index + 1, body(index, state)),
                             (tf.constant(0, tf.int64), state))
    return state


def _for_each(iterator, body, state):
    """`state = body(element, state)` for each element of a dataset's `iterator` (inside a
    traced function): a graph loop over `get_next_as_optional`, as autograph writes one."""

    def next_state(more, state):
        element = iterator.get_next_as_optional()
        return tf.cond(element.has_value(),
                       lambda: (tf.constant(True), body(element.get_value(), state)),
                       lambda: (tf.constant(False), state))

    _, state = tf.while_loop(lambda more, _: more, next_state, (tf.constant(True), state))
    return state


class ScheduledFunctions:
    """The scheduled functions of one compiled model under one strategy."""

    def __init__(self, model, strategy):
        self._model = model
        self._strategy = strategy
        self._cache = {}
        self.metric_state = MetricState(model)

    def _get(self, key, build):
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def _steps_from_iterator(self, step, k):
        strategy, metric_state = self._strategy, self.metric_state

        def run(iterator):
            state = _repeat(k, lambda _, state: metric_state.run_replica(
                strategy, step, next(iterator), state), metric_state.zeros())
            return metric_state.pack(state)

        return _traced(run)

    def _train_step(self):
        model = self._model
        if not _tf_compat.has_stock_train_step(model):
            return model.train_step  # A user's step reads and updates the variables itself.
        # The step number and learning rate travel with the model's small variables.
        reads = transfers.PackedReads(model.variables
                                      + _tf_compat.optimizer_scalars(model.optimizer))

        def step(data):
            # Sharded tables' rows for the batch's ids come with the packed reads.
            fetched = fetched_lookups.FetchedRows(
                model, fetched_lookups.fetched_tables(model), data)
            cached, rows = reads.read_and_gather(fetched.gathers)
            fetched.arrived(rows)
            with embeddings.recording.Recorder() as recorder:  # Dynamic tables' lookups.
                return _tf_compat.train_step_with(
                    model, data,
                    sharded_updates.GradientStep(model, cached, recorder.lookups, fetched),
                    cached, watcher=recorder, fetched=fetched)

        return step

    def _reading_step(self, step, snapshot=None):
        """`step` (test or predict) with the model's small variables read in packed transfers.

        `snapshot`: a `PackedReads` whose values the caller read once (`run(data,
        snapshot_values)`); the variables it holds are not read again per call.
        """
        model = self._model
        held = snapshot.variables if snapshot is not None else []
        held_ids = {id(v) for v in held}
        reads = transfers.PackedReads([v for v in model.variables if id(v) not in held_ids])
        # Keras' own step calls the model on the batch's inputs; a user's may not.
        stock = _tf_compat.has_stock_step(model, step.__name__)

        def run(data, snapshot_values=()):
            # Sharded tables' rows for the batch's ids come with the packed reads.
            fetched = fetched_lookups.FetchedRows(
                model, fetched_lookups.fetched_tables(model, training=False, held=held)
                if stock else [], data)
            values, rows = reads.read_and_gather(fetched.gathers)
            fetched.arrived(rows)
            with _tf_compat.CachedReadScope(list(snapshot_values) + values, fetched.lookups):
                return step(data)

        return run

    def train(self, k):
        """`fn(iterator) -> packed metric state`: `k` training steps on the worker's data."""
        return self._get(("train", k), lambda: self._steps_from_iterator(
            self._train_step(), k))

    def train_split(self, k, ledger):
        """`fn(data, first, epoch, count) -> packed metric state`: training on the `k`
        (`count`) batches of a one-pass epoch's split from batch `first`, read from
        `ledger.source`'s worker data.

        The split's start is counted on a ps (`ledger.attempts`) while its
        first batch is read; every step waits for that write. A ledger whose
        splits are trained whole (`ledger.whole`: compressed files) has one
        function for every split, its `count` steps a graph loop.
        """
        strategy, metric_state, source = self._strategy, self.metric_state, ledger.source
        k = None if ledger.whole else k

        def build():
            train_step = self._train_step()

            def run(data, first, epoch, count):
                marked = ledger.attempts.mark(first)
                next_batch = source.split_reader(data, first, epoch, count)

                def one(j, state):
                    batch = next_batch(j)
                    with tf.control_dependencies([marked]):
                        batch = tf.nest.map_structure(tf.identity, batch)
                    return metric_state.run_replica(strategy, train_step, batch, state)

                state = _repeat(k if k is not None else tf.cast(count, tf.int64), one,
                                metric_state.zeros())
                return metric_state.pack(state)

            return _traced(run)

        for key in [key for key in self._cache if key[0] == "train_split" and key[2] is not ledger]:
            del self._cache[key]  # Another fit's ledger: its counters are gone.
        return self._get(("train_split", k, ledger), build)

    def test(self, k):
        """`fn(iterator) -> packed metric state`: `k` evaluation steps on the worker's data."""
        return self._get(("test", k), lambda: self._steps_from_iterator(
            self._reading_step(self._model.test_step), k))

    def test_shard(self, num_shards, policy):
        """`fn(dataset, shard) -> packed metric state`: every batch of one shard of the
        worker's finite dataset, split by `policy` (`evaluation`'s sharded path).

        Nothing updates the variables while an evaluation runs, so the function
        reads them once, at its start (variables up to
        `KFIT_PS_SNAPSHOT_READ_MAX_BYTES`, sharded tables included): the shard
        is evaluated against one snapshot, and its batches make no call to a ps
        (except a `DynamicEmbedding`'s lookups: its rows stay in its hash tables).
        """
        strategy, metric_state, model = self._strategy, self.metric_state, self._model

        def build():
            snapshot = transfers.PackedReads(model.variables,
                                             constants.snapshot_read_max_bytes(), sharded=True)
            reading_step = self._reading_step(model.test_step, snapshot)

            def run(dataset, shard):
                values = snapshot.read()

                def step(data):
                    return reading_step(data, values)

                # A loop over an iterator is a while loop of this function's graph, optimised
                # once per worker; a loop over the dataset would be a `Dataset.reduce`, whose
                # body (the whole model) TensorFlow instantiates and optimises again per call.
                state = _for_each(
                    iter(_tf_compat.shard_dataset(dataset, num_shards, shard, policy)),
                    lambda batch, state: tuple(metric_state.run_replica(
                        strategy, step, batch, list(state))), tuple(metric_state.zeros()))
                return metric_state.pack(list(state))

            return _traced(run)

        return self._get(("test_shard", num_shards, policy), build)

    def _on_shipped_batch(self, key, step, return_outputs):
        strategy, metric_state = self._strategy, self.metric_state

        def build():
            def run(batch):
                if return_outputs:
                    return strategy.run(step, args=(batch,))
                return metric_state.pack(
                    metric_state.run_replica(strategy, step, batch, metric_state.zeros()))

            return _traced(run, reduce_retracing=True)

        return self._get(key, build)

    def train_batch(self):
        """`fn(batch) -> packed metric state`: one training step on a shipped batch."""
        return self._on_shipped_batch(("train_batch",), self._train_step(), False)

    def train_batches(self, k):
        """`fn(batches) -> packed metric state`: `k` training steps on `k` shipped batches."""
        strategy, metric_state = self._strategy, self.metric_state

        def build():
            train_step = self._train_step()

            def run(batches):
                state = metric_state.zeros()
                for batch in batches:  # A Python loop over a tuple: unrolled, k steps.
                    state = metric_state.run_replica(strategy, train_step, batch, state)
                return metric_state.pack(state)

            return _traced(run)

        return self._get(("train_batches", k), build)

    def test_batch(self):
        """`fn(batch) -> packed metric state`: one evaluation step on a shipped batch."""
        return self._on_shipped_batch(("test_batch",), self._reading_step(self._model.test_step),
                                      False)

    def predict_batch(self):
        """`fn(batch) -> outputs`: predictions for a batch shipped with the call."""
        return self._on_shipped_batch(("predict_batch",),
                                      self._reading_step(self._model.predict_step), True)

    def predict_next(self):
        """`fn(iterator) -> outputs`: predictions for the worker's next batch."""
        strategy, model = self._strategy, self._model

        def build():
            predict_step = self._reading_step(model.predict_step)

            def run(iterator):
                return strategy.run(predict_step, args=(next(iterator),))

            return _traced(run)

        return self._get(("predict_next",), build)


def for_model(model, strategy, slot):
    """The model's `ScheduledFunctions`, kept in Keras' `slot` (`train_function`, ...)."""
    functions = getattr(model, slot, None)
    if not isinstance(functions, ScheduledFunctions) or functions._strategy is not strategy:
        functions = ScheduledFunctions(model, strategy)
        setattr(model, slot, functions)
    return functions
