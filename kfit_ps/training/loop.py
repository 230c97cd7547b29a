"""Parameter-server `fit`, `evaluate` and `predict` for Keras 3 models.

Entered through the ordinary `model.fit` / `evaluate` / `predict` of a model
created under a kfit_ps strategy (see `kfit_ps.training.install`).

Who owns what:

- **Arguments** (`steps_per_epoch`, `steps`, `validation_steps`, input types):
  validated here and in `adapters.adapt`, before anything is scheduled.
- **Model state**: built here, under the strategy scope, from the input's
  element spec (`prepare`), then checked to live on the ps tasks.
- **Per-worker datasets**: created once per call with
  `ClusterCoordinator.create_per_worker_dataset`. A stream (`steps_per_epoch`
  given): their iterators continue across epochs, so an epoch is
  `steps_per_epoch` batches, not a pass. One-pass epochs (finite data, no
  `steps_per_epoch`): each function reads its own split's batches by index,
  and `kfit_ps.ledger.Ledger` records each split trained, re-run or lost.
- **Scheduling**: `ceil(steps / steps_per_execution)` functions per epoch
  (`functions.ScheduledFunctions`), each running on whichever worker is free.
- **Workers**: fixed, unless the launcher publishes others (`kfit-ps scale`):
  then `training.resilience.elastic` moves the coordinator to them at a safe point, and the
  steps dropped there are scheduled again.
- **`join()`**: once per epoch, once per evaluation, and at each step where a
  `kfit_ps.callbacks.SyncCallback` asked for one (`callbacks.base.SyncPoints`);
  it is the only synchronisation. TensorFlow re-runs a function whose worker
  died; `cluster_health.join` bounds the wait when every worker is gone.
- **Metric state**: each scheduled function returns its own; the coordinator
  adds each finished function's state once (`metric_state.Accumulator`) and
  writes it to the metric variables after `join()`: exactly-once metrics.
- **Metric reads**: after that, on the coordinator (`metric_logs`), converted to
  Python floats.
- **Callbacks**: a Keras `CallbackList`; batch-level semantics in
  `callback_policy`; resuming (`resume_position`) and N-step work in
  `callbacks.base`. **Progress**: `progress.Progress`.
"""

import functools
import itertools
import sys

import numpy as np
import tensorflow as tf
from keras.callbacks import CallbackList

from kfit_ps import _tf_compat, embeddings, validation
import kfit_ps.ledger as data_ledger
from kfit_ps.errors import Preempted, is_cluster_failure
from kfit_ps.strategy import is_kfit_strategy
from kfit_ps.training.inputs import adapters
from kfit_ps.training.resilience import cluster_health, elastic, preemption
from kfit_ps.training.step import functions, metric_state, moving_averages, sharded_updates
from kfit_ps.training.inputs import shipped as shipping
from kfit_ps.training.monitor import job_monitor, table_stats
from kfit_ps.training.evaluation import Evaluation, Stopped as ValidationStopped
from kfit_ps.training.dispatch import Dispatcher
from kfit_ps.training.resilience.ps_recovery import PsRecovery
from kfit_ps.training.inputs.scheduling import metric_logs, per_worker_iterator
from kfit_ps.training.callbacks.backup_and_restore import with_launcher_backup
from kfit_ps.training.callbacks.base import SyncPoints
from kfit_ps.training.callback_policy import check_callbacks
from kfit_ps.training.progress import Progress, resolve_verbose


def strategy_for(model):
    """The kfit_ps strategy that owns `model`, or None (stock Keras then runs)."""
    strategy = _tf_compat.model_strategy(model)
    if is_kfit_strategy(strategy):
        return strategy
    if strategy is None and tf.distribute.has_strategy():
        current = tf.distribute.get_strategy()
        if is_kfit_strategy(current):
            return current
    return None


# Preparation ---------------------------------------------------------------------------------


_TRAINING = ("fit", "train_on_batch")


def prepare(model, strategy, element_spec, method):
    """Checks `model` for `method` (`fit`, `predict_on_batch`, ...), then builds its state.

    Everything a function scheduled on workers needs is created here, under
    the strategy's scope, from `element_spec`; errors name the misplaced or
    unsupported object before anything is scheduled.
    """
    if getattr(model, "run_eagerly", False):
        raise ValueError(
            f"`{method}` under parameter-server training runs compiled functions on remote "
            "workers and cannot run eagerly. Received: run_eagerly=True. Compile with "
            "run_eagerly=False (the default)."
        )
    predicting = method.startswith("predict")
    if not predicting and not model.compiled:
        raise ValueError(
            f"You must call `compile()` before `{method}()`. Compile the model inside "
            "`with strategy.scope():` so its optimizer and metrics live on the ps tasks."
        )
    _check_placement(model, method)  # Before building: name the misplaced object, not TF.
    with strategy.scope():
        if predicting:  # Keras predicts with an uncompiled or unfitted model: build it only.
            _tf_compat.build_for_predict(model, element_spec)
        else:
            _tf_compat.symbolic_build(model, element_spec)
    _check_placement(model, method)
    if method in _TRAINING:
        _check_gradient_step(model)
        embeddings.prepare_training(model)


def _check_gradient_step(model):
    """Refuses a `train_step` override (and optimizer options) kfit_ps' gradient step needs.

    Sharded variables and dynamic embedding tables are updated only by
    kfit_ps' gradient step inside Keras' own `train_step`.
    """
    sharded = sharded_updates.has_sharded_variables(model)
    dynamic = embeddings.dynamic_layers(model)
    if (sharded or dynamic) and not _tf_compat.has_stock_train_step(model):
        owners = (["sharded variables (variable_partitioner)"] if sharded else []) + (
            [f"DynamicEmbedding layers ({', '.join(repr(layer.name) for layer in dynamic)})"]
            if dynamic else [])
        alternative = (", or take gradients with respect to `kfit_ps.shards(variable)` and "
                       "create the model without a variable_partitioner" if not dynamic else "")
        raise ValueError(
            f"Model {model.name!r} overrides `train_step` and has {' and '.join(owners)}. "
            "kfit_ps updates them with its own gradient step inside Keras' train_step. Remove "
            f"the override{alternative}.")
    if sharded or dynamic:
        sharded_updates.check_optimizer(model)


def _check_placement(model, method):
    groups = [("model", model.variables), ("metric", model.metrics_variables)]
    if getattr(model, "optimizer", None) is not None:
        groups.append(("optimizer", model.optimizer.variables))
    for kind, variables in groups:
        for v in variables:
            if not _tf_compat.is_kfit_variable(v):
                device = getattr(_tf_compat.storage(v), "device", "?")
                state = (" It is the state of a layer made before the model (an adapted "
                         "preprocessing layer's, e.g. `Normalization`): make and `adapt()` that "
                         "layer under the scope too, after the strategy line."
                         if kind == "model" and not v.trainable else "")
                raise ValueError(
                    f"`{method}` was called on model {model.name!r} whose {kind} variable "
                    f"{v.path!r} was created outside the kfit_ps strategy scope (it lives on "
                    f"{device}, not on a ps task). Create the model and call `compile()` inside "
                    f"`with strategy.scope():`, then call `fit`/`evaluate`/`predict`.{state}"
                )


# fit -----------------------------------------------------------------------------------------


def _unpack_validation(validation_data):
    if isinstance(validation_data, (tuple, list)) and len(validation_data) in (2, 3):
        return tuple(validation_data) + (None,) * (3 - len(validation_data))
    return validation_data, None, None


@preemption.stops_at_a_safe_point
def fit(model, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
        validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
        sample_weight=None, initial_epoch=0, steps_per_epoch=None, validation_steps=None,
        validation_batch_size=None, validation_freq=1):
    """Parameter-server `Model.fit`; same arguments and return value as Keras'."""
    strategy = strategy_for(model)
    (x, y, sample_weight), validation_data = adapters.split_for_validation(
        x, y, sample_weight, validation_split, validation_data)
    x, sample_weight = adapters.with_class_weight(x, y, sample_weight, class_weight)
    epochs = validation.check_int("epochs", epochs, 0)
    initial_epoch = validation.check_int("initial_epoch", initial_epoch, 0)
    validation_freq = validation.check_int("validation_freq", validation_freq, 1)
    verbose = resolve_verbose(verbose)

    train_input = adapters.adapt(x, y, sample_weight, batch_size=batch_size, shuffle=shuffle,
                               training=True)
    source = shipped = None
    if steps_per_epoch is not None and train_input.split_shuffle is not None:
        raise ValueError(
            "kfit_ps.ledger.split_shuffle(...) shuffles the splits of one-pass epochs, and "
            f"`steps_per_epoch` streams. Received: steps_per_epoch={steps_per_epoch!r}. Leave "
            "out `steps_per_epoch`, or shuffle in the pipeline and stream it.")
    if steps_per_epoch is None and train_input.one_pass is not None:
        # One pass per epoch: read by index on the workers, else shipped by the coordinator,
        # else an error saying why neither.
        source, shipped = shipping.refusal_or_shipped(train_input, "x")
        steps_per_epoch = (source if source is not None else shipped).num_batches
    steps_per_epoch = adapters.check_steps(
        "steps_per_epoch", steps_per_epoch,
        required_because="with a DatasetCreator or a tf.data.Dataset")
    evaluation = None
    if validation_data is not None:
        vx, vy, vw = _unpack_validation(validation_data)
        val_input = adapters.adapt(vx, vy, vw, batch_size=validation_batch_size or batch_size,
                                 shuffle=False, training=False, arg="validation_data")
        evaluation = Evaluation(model, strategy, val_input, validation_steps,
                                 "validation_steps")
    callbacks = with_launcher_backup(callbacks)  # First: a replaced callback is not checked.
    check_callbacks(callbacks)
    prepare(model, strategy, train_input.element_spec, "fit")

    monitor = job_monitor()
    workers = elastic.elastic()
    if workers.pending(strategy):  # Between fits nothing is in flight: a safe point.
        workers.apply(strategy, monitor)
    fns = functions.for_model(model, strategy, "train_function")
    if shipped is not None:  # Batches read here and sent with their functions.
        ledger = None
        train_for = lambda: functions.for_model(  # noqa: E731
            model, strategy, "train_function").train_batches
    elif source is None:  # A stream: each worker's own repeated pipeline.
        iterator = per_worker_iterator(strategy, train_input)
        ledger = None
        train_for = lambda: functions.for_model(model, strategy, "train_function").train  # noqa
    else:
        ledger = _one_pass_ledger(model, strategy, source)
        train_for = lambda: functools.partial(fns.train_split, ledger=ledger)  # noqa: E731
        data = _tf_compat.track_per_worker(source.worker_data(strategy.coordinator))
    callbacks = CallbackList(callbacks, add_history=True, add_progbar=False, model=model,
                             verbose=verbose, epochs=epochs, steps=steps_per_epoch)
    sync = SyncPoints(callbacks.callbacks, steps_per_epoch,
                      ledger.state() if ledger is not None else None,
                      every=shipping.WINDOW if shipped is not None else None)
    progress = Progress(verbose, epochs, steps_per_epoch)
    iterations = model.optimizer.iterations if model.optimizer is not None else None
    observe = functools.partial(monitor.expect, examples=adapters.static_batch_size(train_input))
    dispatcher = Dispatcher(model, strategy, train_for, callbacks, observe, workers,
                            PsRecovery(model, strategy, callbacks.callbacks, ledger, monitor,
                                       shipped=shipped is not None),
                            monitor, ledger, positional=shipped is not None)

    try:
        monitor.fit_begin(strategy, epochs, steps_per_epoch)
        model.stop_training = False
        callbacks.on_train_begin()
        initial_epoch = _tf_compat.initial_epoch_override(model) or initial_epoch
        first_step = 0
        resume = sync.resume_position()
        if resume is not None:
            initial_epoch, first_step = resume
            monitor.event("resumed", "chief:0", f"fit resumed from a backup at epoch "
                          f"{initial_epoch + 1}, step {first_step}", epoch=initial_epoch,
                          step=first_step)
            if ledger is not None and initial_epoch < epochs:
                _tf_compat.print_msg(
                    f"kfit_ps: resuming one-pass epoch {initial_epoch + 1} at batch "
                    f"{first_step} of {steps_per_epoch}: the batches before it were trained "
                    "before the restart (their updates are in the restored state).")
        logs = {}
        for epoch in range(initial_epoch, epochs):
            first = first_step if epoch == initial_epoch else 0
            dispatcher.guarded(model.reset_metrics)  # A ps lost meanwhile: restored first.
            accumulator = metric_state.Accumulator(
                fns.metric_state, fetch=cluster_health.result_fetcher(strategy))
            callbacks.on_epoch_begin(epoch)
            counter = None
            if progress.verbose == 1 and iterations is not None:
                # Read on its ps: a read on the chief instantiates beside result copies.
                read = lambda: int(_tf_compat.read_where_it_lives(iterations))  # noqa: E731
                start = dispatcher.guarded(read) - first  # Before dispatch: no step missed.
                counter = lambda start=start: read() - start  # noqa: E731
            progress.epoch_begin(epoch, counter)
            if shipped is not None:
                args = shipped.args
                if first < steps_per_epoch:  # At the epoch's end: only its end work is left.
                    shipped.begin_epoch(first)
                if 0 < first < steps_per_epoch and shipped.shuffles:
                    _tf_compat.print_msg(
                        f"kfit_ps: resuming epoch {epoch + 1} at batch {first}: `x` shuffles, "
                        "so its remaining batches are drawn from a new pass (not the ones "
                        "the stopped run had left).")
            elif ledger is None:
                args = (iterator,)
            else:
                ledger.begin_epoch(epoch, first)
                epoch_tensor = tf.constant(epoch, tf.int64)
                args = lambda step, n, e=epoch_tensor: (  # noqa: E731
                    data, tf.constant(step, tf.int64), e, tf.constant(n, tf.int64))
            with progress.joining():
                step = first
                if first >= steps_per_epoch:  # Stopped in its validation: trained, logs saved.
                    logs = sync.resume_logs() or {}
                since = first
                # A compressed file's split is trained whole: a window ends after it.
                for stop in sync.stops(epoch, first,
                                       ledger.sync_point if ledger is not None else None):
                    step = dispatcher.run(step, stop, args, accumulator)
                    if shipped is not None:
                        shipped.forget_before(step)
                    guarded = dispatcher.guarded  # A ps restored in place: run it again.
                    logs = guarded(lambda: accumulator.commit() or metric_logs(model))
                    if step < stop:
                        _stop_preempted(sync, epoch, step, logs, steps_per_epoch)
                    guarded(callbacks.on_train_batch_end, stop - 1, dict(logs))
                    guarded(sync.synchronised, epoch, stop, dict(logs), since)
                    step = since = stop
                    if model.stop_training:
                        break
            if evaluation is not None and (epoch + 1) % validation_freq == 0:
                try:
                    val_logs = dispatcher.guarded(evaluation.run, callbacks,
                                                  preemption.requested)
                except ValidationStopped:  # Resumes at this epoch's end work.
                    _stop_preempted(sync, epoch, step, logs, steps_per_epoch,
                                    during="validation")
                logs.update({f"val_{k}": v for k, v in val_logs.items()})
            progress.epoch_end(logs)
            readings = dispatcher.guarded(embeddings.read_tables, model)  # Dynamic tables.
            logs.update(embeddings.epoch_stats(readings))
            if ledger is not None and step >= steps_per_epoch:
                report = ledger.end_epoch()
                if verbose and report.summary():  # Said aloud when a split re-ran.
                    _tf_compat.print_msg(report.summary())
                logs.update(report.logs())
            monitor.epoch_end(epoch, logs)
            monitor.tables(table_stats(model, readings))
            _each_once(dispatcher, callbacks, "on_epoch_end", epoch, dict(logs))
            if model.stop_training:
                break
        if epochs > initial_epoch:  # As Keras: the moving averages become the weights.
            moving_averages.finalize(model.optimizer)
        callbacks.on_train_end(logs)
        monitor.event("done", "chief:0", "fit ended", status=0)
        return model.history
    except Exception as e:
        if not (is_cluster_failure(e) or cluster_health.is_ps_loss(e)):
            sync.failed(e)  # The program failed: no restart resumes this training.
        raise
    finally:
        monitor.fit_end()


def _each_once(dispatcher, callbacks, hook, *args):
    """Calls `hook` of each callback once. A ps restored in place while one of them ran
    (`dispatcher.guarded`) runs that one again, not the callbacks before it: their epoch-end
    work (a CSV row, a History entry, `EarlyStopping`'s patience) would count twice. As
    Keras' `CallbackList`, every callback gets the same copy of the logs."""
    for callback in callbacks.callbacks:
        dispatcher.guarded(getattr(callback, hook), *args)


def _one_pass_ledger(model, strategy, source):
    """The ledger of this `fit`'s one-pass epochs (`kfit_ps.ledger.reports(model)` reads it)."""
    ledger = data_ledger.Ledger(source, strategy, model.steps_per_execution)
    model._kfit_ps_ledger = ledger  # noqa: SLF001 - kfit_ps' own attribute on the model
    return ledger


def _stop_preempted(sync, epoch, step, logs, steps_per_epoch, during=None):
    """Every step scheduled is applied: lets callbacks save, then stops the script.

    `during="validation"`: the epoch was trained and its validation stopped early; a
    resume runs the validation and the epoch-end callbacks again, once."""
    backups = sync.preempted(epoch, step, dict(logs))
    saved = (f"and a backup of them was written ({', '.join(backups)}). Rerun the script to "
             "resume." if backups else
             "but no backup was written (no kfit_ps.callbacks.BackupAndRestore, and no "
             "kfit-ps run --backup-dir): a rerun starts this fit over.")
    where = (" during its validation (dropped" + (
        ": a resume runs it and the epoch-end callbacks)" if backups else ")")
        if during == "validation" else "")
    stopped = Preempted(
        f"fit stopped on SIGTERM after step {step} of epoch {epoch + 1} (of "
        f"{steps_per_epoch} steps){where}; every step scheduled was applied, {saved}")
    print(f"kfit_ps: {stopped}", file=sys.stderr, flush=True)
    raise stopped


# evaluate / predict --------------------------------------------------------------------------


def evaluate(model, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None,
             steps=None, callbacks=None, return_dict=False, **kwargs):
    """Parameter-server `Model.evaluate`; same arguments and return value as Keras'."""
    if kwargs:
        raise ValueError(f"Arguments not recognised by `evaluate`: {sorted(kwargs)}.")
    strategy = strategy_for(model)
    verbose = resolve_verbose(verbose)
    eval_input = adapters.adapt(x, y, sample_weight, batch_size=batch_size, shuffle=False,
                              training=False)
    evaluation = Evaluation(model, strategy, eval_input, steps, "steps")
    check_callbacks(callbacks)
    prepare(model, strategy, eval_input.element_spec, "evaluate")
    callbacks = CallbackList(callbacks, add_progbar=False, model=model, verbose=verbose,
                             epochs=1, steps=evaluation.num_steps)
    progress = Progress(verbose, 1, evaluation.num_steps or 1)
    progress.epoch_begin(0)
    logs = evaluation.run(callbacks)
    progress.epoch_end(logs)
    if return_dict:
        return logs
    return _tf_compat.flatten_metrics_in_order(model, logs)


def predict(model, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
    """Parameter-server `Model.predict`; returns numpy outputs like Keras'.

    Finite inputs (numpy, finite datasets) are shipped batch by batch and the
    outputs keep their order. With a DatasetCreator or an infinite dataset each
    function predicts the next batch of the worker it runs on; outputs are in
    scheduling order, which does not follow any one worker's data order.
    """
    strategy = strategy_for(model)
    verbose = resolve_verbose(verbose)
    pred_input = adapters.adapt(x, batch_size=batch_size, shuffle=False, training=False)
    if getattr(pred_input, "sharded", False):
        raise ValueError(
            "`predict` does not take kfit_ps.shardable(...): predictions come back in the "
            "data's order, so a finite dataset is read on the coordinator and shipped. "
            "Received: x=kfit_ps.shardable(...). Pass the dataset itself.")
    steps = adapters.check_steps("steps", steps, required_because=(
        "for a DatasetCreator or an infinite dataset" if isinstance(
            pred_input, adapters.WorkerInput) else None))
    check_callbacks(callbacks)
    prepare(model, strategy, pred_input.element_spec, "predict")
    coordinator = strategy.coordinator
    fns = functions.for_model(model, strategy, "predict_function")
    num_steps = steps or pred_input.num_batches
    callbacks = CallbackList(callbacks, add_progbar=False, model=model, verbose=verbose,
                             epochs=1, steps=num_steps)
    progress = Progress(verbose, 1, num_steps or 1)
    callbacks.on_predict_begin()
    progress.epoch_begin(0)
    results = []
    if isinstance(pred_input, adapters.WorkerInput):
        iterator = per_worker_iterator(strategy, pred_input)
        for step in range(steps):
            callbacks.on_predict_batch_begin(step)
            results.append(coordinator.schedule(fns.predict_next(), args=(iterator,)))
            callbacks.on_predict_batch_end(step, {})
    else:
        step_fn = fns.predict_batch()
        for step, batch in enumerate(itertools.islice(pred_input.dataset, steps)):
            callbacks.on_predict_batch_begin(step)
            results.append(coordinator.schedule(step_fn, args=(batch,)))
            callbacks.on_predict_batch_end(step, {})
    cluster_health.join(strategy)
    outputs = [r.fetch() for r in results]
    progress.epoch_end({})
    callbacks.on_predict_end()
    if not outputs:
        raise ValueError("`predict` received no data: the input has no batches.")
    return tf.nest.map_structure(lambda *parts: np.concatenate(parts, axis=0), *outputs)
