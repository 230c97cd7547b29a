"""Evaluation under parameter servers: shipped batches, per-worker steps, or exact shards.

Shared by `evaluate` and `fit`'s validation. Which path runs follows from the
input (`adapters.adapt`) and `steps`:

- **Shipped** (numpy arrays, a finite `tf.data.Dataset`): the coordinator
  reads each batch and sends it with its function; exact and in order, but
  the coordinator's reading speed bounds it.
- **Sharded** (a `DatasetCreator` without `steps`, or
  `kfit_ps.shardable(dataset)`): each worker builds the dataset itself; it is
  split into shards, and each scheduled function evaluates one whole shard
  with local metric state that it returns. TensorFlow re-runs the function of
  a worker that died on another worker, from the shard's start, and the
  coordinator adds each finished function's state once: every batch counts
  exactly once, with no batch travelling through the coordinator.
- **Per-worker steps** (a `DatasetCreator` or infinite dataset with
  `steps`): `steps` batches of whichever workers are free.

`fit`'s validation stops early when a stop is requested (SIGTERM): no more
functions are scheduled, those no worker started are dropped, the running ones
finish, and `Stopped` is raised; its partial metrics are thrown away (the
whole validation runs again when the fit resumes).
"""

import itertools

import tensorflow as tf

from kfit_ps.training.inputs import adapters
from kfit_ps.training.resilience import cluster_health, elastic
from kfit_ps.training.step import functions, metric_state
from kfit_ps.training.monitor import job_monitor
from kfit_ps.training.inputs.scheduling import (metric_logs, per_worker_dataset,
                                         per_worker_iterator, quiet_options_warning,
                                         schedule_steps)


class Stopped(Exception):
    """A validation stopped early because a stop was requested (see the module doc)."""


class Evaluation:
    """Evaluation input of one `evaluate` call or one `fit` call's validation."""

    def __init__(self, model, strategy, eval_input, steps, arg):
        self.model, self.strategy, self.input = model, strategy, eval_input
        worker_input = isinstance(eval_input, adapters.WorkerInput)
        if worker_input and eval_input.sharded and steps is not None:
            raise ValueError(
                f"`{arg}` cannot be combined with kfit_ps.shardable(...): a sharded "
                f"evaluation reads every batch of the data once. Received: {arg}={steps!r}. "
                f"Remove `{arg}`, or pass the dataset without kfit_ps.shardable to evaluate "
                "its first batches.")
        self.sharded = worker_input and steps is None and eval_input.finite
        self.steps = adapters.check_steps(
            arg, steps, required_because=(
                "for an infinite dataset (a DatasetCreator whose dataset repeats, or a "
                "repeated tf.data.Dataset)" if worker_input and not self.sharded else None))
        self.num_shards = None
        if self.sharded:
            self.num_shards = eval_input.num_shards or adapters.default_num_shards(
                strategy.num_workers)
        self._iterator = None
        self._dataset = self._policy = None

    @property
    def num_steps(self):
        """Steps shown by progress bars and callbacks (shards, for a sharded evaluation)."""
        return self.num_shards or self.steps or self.input.num_batches

    def run(self, callbacks, stop_when=None):
        """Evaluates once; returns the logs. With `stop_when`, raises `Stopped` as soon as
        `stop_when()` is true, after the functions running on workers finished."""
        model, strategy = self.model, self.strategy
        stop_when = stop_when or (lambda: False)
        monitor = job_monitor()
        workers = elastic.elastic()
        if workers.pending(strategy):  # Nothing in flight before an evaluation: a safe point.
            workers.apply(strategy, monitor)
        coordinator = strategy.coordinator
        fns = functions.for_model(model, strategy, "test_function")
        accumulator = metric_state.Accumulator(
            fns.metric_state, fetch=cluster_health.result_fetcher(strategy))
        model.reset_metrics()
        callbacks.on_test_begin()
        monitor.watch(strategy)
        monitor.evaluation_begin()
        last = -1
        if self.sharded:
            if self._dataset is None:
                self._dataset, self._policy = per_worker_dataset(strategy, self.input,
                                                                 self.num_shards)
            shard_fn = fns.test_shard(self.num_shards, self._policy)
            for shard in range(self.num_shards):
                if stop_when():
                    break
                callbacks.on_test_batch_begin(shard)
                with quiet_options_warning():  # The first call traces the function.
                    result = coordinator.schedule(
                        shard_fn, args=(self._dataset, tf.constant(shard, tf.int64)))
                monitor.expect(result, 1, phase="eval")
                accumulator.add(result)
                if shard < self.num_shards - 1:
                    callbacks.on_test_batch_end(shard, {})
            last = self.num_shards - 1
        elif isinstance(self.input, adapters.WorkerInput):
            if self._iterator is None:
                self._iterator = per_worker_iterator(strategy, self.input)
            schedule_steps(coordinator, 0, self.steps, model.steps_per_execution, fns.test,
                           (self._iterator,), callbacks.on_test_batch_begin,
                           callbacks.on_test_batch_end, accumulator, should_stop=stop_when,
                           observe=lambda value, n: monitor.expect(value, n, phase="eval"))
            last = self.steps - 1
        else:
            step_fn = fns.test_batch()
            for step, batch in enumerate(itertools.islice(self.input.dataset, self.steps)):
                if stop_when():
                    break
                callbacks.on_test_batch_begin(step)
                result = coordinator.schedule(step_fn, args=(batch,))
                monitor.expect(result, 1, phase="eval")
                accumulator.add(result)
                callbacks.on_test_batch_end(step, {})
        cluster_health.join(strategy, cancel_when=stop_when)
        if stop_when():
            monitor.event("evaluation", "chief:0", "an evaluation stopped early (a stop was "
                          "requested); its partial metrics were dropped")
            raise Stopped()
        accumulator.commit()
        logs = metric_logs(model)
        if last >= 0:  # Worker-read input: the last batch end comes after the join.
            callbacks.on_test_batch_end(last, dict(logs))
        callbacks.on_test_end(logs)
        monitor.event("evaluation", "chief:0", "an evaluation ended",
                      logs={k: v for k, v in logs.items() if isinstance(v, float)})
        return logs
