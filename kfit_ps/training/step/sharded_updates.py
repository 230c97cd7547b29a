"""The gradient step of kfit_ps' training functions: it collects and sends; updaters apply.

Every model with Keras' own `train_step` trains with `GradientStep` inside
that step (`_tf_compat.train_step_with`). It takes the step's gradients and:

- packs every gradient bound for a ps in one transfer per ps
  (`transfers.Outbox`; the forward pass read the model's small variables in
  one packed transfer per ps, `transfers.PackedReads`), with this step's
  learning rate and step number;
- takes the gradient of a sharded table whose rows the step fetched before
  its forward pass (`fetched_lookups`) with respect to those rows: one
  summed row per unique id, joined with any other lookup's rows of the table;
- hands each sparse table to its updater (`sparse_updaters`): a sharded
  variable whose optimizer has a sparse update (`SGD`, `Adagrad`, `Adam`,
  `AdamW`) and every `DynamicEmbedding` table. Updaters update the touched
  rows only, on their ps, with Keras' `apply` for those rows
  (`embeddings.sparse_optimizer`): loss-scale division, weight decay and its
  exclusions, the formula, constraints;
- updates dense variables with Keras' own `apply` (or, for a plain `Adam`,
  one fused kernel per variable on its ps, `_tf_compat.apply_adam`). A
  sharded variable whose optimizer has no sparse update (RMSprop, Nadam,
  ...) is updated there too, whole: correct, not sparse;
- with `use_ema=True`, updates every moving average after the step, as
  Keras does, on the average's own ps (shard by shard for a sharded
  variable), and overwrites the variables with them every
  `ema_overwrite_frequency` steps (`moving_averages`). Dynamic tables keep
  no average.

`iterations` is incremented once per step. Options that need every gradient
of a step at once (`clipnorm`, `clipvalue`, `global_clipnorm`) and
`gradient_accumulation_steps` are refused at the start of `fit` for every
model with a sparse table (`sparse_optimizer.check_optimizer`).
"""

import tensorflow as tf

from kfit_ps import _tf_compat
from kfit_ps.embeddings import sparse_optimizer
from kfit_ps.training.step import moving_averages, sparse_updaters, transfers


def has_sharded_variables(model):
    return any(_tf_compat.sharded_storage(v) is not None for v in model.trainable_variables)


def check_optimizer(model):
    """Raises ValueError if the model's optimizer has an option no sparse update honours."""
    sparse_optimizer.check_optimizer(model.optimizer, f"Model {model.name!r}")


def _merged(gradient, fetched):
    """A shard's gradient from the tape (a lookup in the forward pass) and from its fetched
    rows ((ids, rows), unique): one, or both as one `IndexedSlices` (summed by the update)."""
    if fetched is None or gradient is None:
        return fetched if gradient is None else gradient
    if not isinstance(gradient, tf.IndexedSlices):
        gradient = tf.IndexedSlices(gradient, tf.range(tf.shape(gradient)[0]))
    ids, rows = fetched
    return tf.IndexedSlices(tf.concat([gradient.values, rows], axis=0),
                            tf.concat([tf.cast(gradient.indices, tf.int64), ids], axis=0))


class GradientStep:
    """`apply_gradients(tape, loss)` for `_tf_compat.train_step_with`.

    `cached`: the (variable, tensor) pairs the forward pass read instead of
    the variables (`transfers.PackedReads`); their gradients are taken with
    respect to those tensors. Every gradient bound for a ps travels in one
    packed transfer per ps (`transfers.Outbox`); updates then run there.
    """

    def __init__(self, model, cached=(), lookups=(), fetched=None):
        self.model = model
        self.optimizer = model.optimizer
        self._cached = {id(variable): value for variable, value in cached}
        self._lookups = lookups  # Filled by the forward pass (`embeddings.recording`).
        self._fetched = fetched  # `fetched_lookups.FetchedRows`, or None.

    def _sources(self, variable):
        if _tf_compat.sharded_storage(variable) is not None:
            return _tf_compat.shards(variable)
        return [self._cached.get(id(variable), variable)]

    def _scalars(self):
        """(learning rate as float32, step number `iterations + 1` as int64) of this step."""
        optimizer = self.optimizer
        iterations = self._cached.get(id(optimizer.iterations), optimizer.iterations)
        iterations = tf.cast(iterations, tf.int64)
        scalars = _tf_compat.optimizer_scalars(optimizer)
        if len(scalars) > 1:  # A fixed rate's variable (a callback may change it).
            rate = tf.cast(self._cached.get(id(scalars[1]), scalars[1]), tf.float32)
        else:
            rate = _tf_compat.learning_rate_at(optimizer, iterations)
        return rate, iterations + 1

    def __call__(self, tape, loss):
        optimizer = self.optimizer
        variables = self.model.trainable_variables
        groups = [self._sources(v) for v in variables]
        sources = [s for group in groups for s in group]
        lookups = list(self._lookups)
        fetched_rows = self._fetched.rows if self._fetched is not None else []
        flat = tape.gradient(loss, sources + [lookup.rows for lookup in lookups] + fetched_rows)
        fetched = (self._fetched.gradients(flat[len(flat) - len(fetched_rows):])
                   if fetched_rows else {})
        flat = flat[:len(flat) - len(fetched_rows)]
        updaters, dense, position = [], [], 0
        for variable, group in zip(variables, groups):
            grads = flat[position:position + len(group)]
            position += len(group)
            if id(variable) in fetched:
                grads = [_merged(g, rows) for g, rows in zip(grads, fetched[id(variable)])]
            if _tf_compat.sharded_storage(variable) is None:
                if grads[0] is not None:
                    dense.append((variable, grads[0]))
                continue
            slots = _tf_compat.optimizer_slots(optimizer, variable)
            if slots is None:
                # No sparse update for this optimizer: Keras' own apply, dense, in step order.
                dense.append((variable, tf.concat(
                    [tf.convert_to_tensor(g) if g is not None else tf.zeros(s.shape, s.dtype)
                     for g, s in zip(grads, group)], axis=0)))
            elif any(g is not None for g in grads):
                updaters.append(sparse_updaters.ShardedVariableUpdater(
                    optimizer, variable, slots, grads))
        by_table = {}
        for lookup, grad in zip(lookups, flat[len(sources):]):
            if grad is not None:
                by_table.setdefault(id(lookup.table), []).append((lookup, grad))
        updaters += [sparse_updaters.DynamicTableUpdater(optimizer, pairs[0][0].table, pairs)
                     for pairs in by_table.values()]
        outbox = transfers.Outbox()
        dense = [(variable, ("here", grad) if _tf_compat.sharded_storage(variable) is not None
                  else outbox.put(_tf_compat.storage(variable).device, grad, variable.shape))
                 for variable, grad in dense]
        for updater in updaters:
            updater.send(outbox)
        # This step's learning rate and step number: read once, with the packed reads of the
        # forward pass, and packed with the gradients for the ps tasks.
        scalars = self._scalars()
        devices = {_tf_compat.storage(v).device for v, handle in dense if handle[0] != "here"}
        for updater in updaters:
            devices |= updater.devices
        scalar_handles = {device: [outbox.put(device, x) for x in scalars] for device in devices}
        outbox.deliver()

        def scalars_on(device):
            handles = scalar_handles.get(device)
            return scalars if handles is None else [outbox.get(h) for h in handles]

        for updater in updaters:
            updater.apply(outbox, scalars_on)
        dense_vars = [variable for variable, _ in dense]
        dense_grads = [outbox.get(handle) for _, handle in dense]
        with _tf_compat.keras_averages_off(optimizer):
            if dense and _tf_compat.can_fuse_adam(optimizer, dense_vars):
                _tf_compat.apply_adam(optimizer, dense_grads, dense_vars, scalars_on)
            elif dense:
                optimizer.apply(dense_grads, dense_vars)
            else:
                optimizer.iterations.assign_add(1)
        if optimizer.use_ema:
            moving_averages.update(optimizer, scalars[1])
