"""The gradient step of kfit_ps' training functions: packed, and sparse for sharded tables.

Every model with Keras' own `train_step` trains with `GradientStep` inside
that step (`_tf_compat.train_step_with`):

- gradients bound for a ps travel in one packed transfer per ps
  (`transfers.Outbox`), and the forward pass read the model's small
  variables in one packed transfer per ps (`transfers.PackedReads`);
- a plain `Adam` updates each dense variable with one fused kernel on its ps
  (`_tf_compat.apply_adam`); other optimizers use Keras' own `apply`;
- sharded variables: only touched rows move (below);
- dynamic embeddings (`kfit_ps.embeddings`): the rows a lookup read are
  watched on the tape; their gradients (and each key's count in the batch)
  travel to the table's ps, where `DynamicTable.update` runs.

A sharded variable's gradient is taken with respect to its shards: for an
embedding lookup, each shard's gradient is an `IndexedSlices` of the rows the
batch touched. The update then reads and writes only those rows of the shard
and of its optimizer slots (which are sharded the same way, on the same ps
tasks). Duplicate ids are summed on the worker, so each unique row's gradient
is sent once; the update itself runs on the shard's ps task (gathers, the
formula, scatters), so no table or slot row leaves the ps:

- `SGD` (with or without momentum, Nesterov): Keras' formulas on the rows;
- `Adagrad`: Keras' formula on the rows;
- `Adam` / `AdamW` (and `amsgrad`): *lazy* Adam: moments of untouched rows
  are not decayed in that step (the dense formula would rewrite every row).
  Bias correction uses the global step, as Keras does.

Weight decay (`weight_decay=`, AdamW's default) is applied to the touched
rows only, before the update, as Keras applies it to whole variables.

Other Keras optimizers get the sharded variable's whole gradient in Keras'
own `optimizer.apply`, with the dense variables, so their per-step state
(Nadam's momentum schedule, ScheduleFree's averages, ...) advances as Keras
does it; every row and slot is then read and written each step: correct,
not sparse. Dense (unsharded) variables always take Keras' update formula,
and `iterations` is incremented once per step.

Options that need every gradient at once (`clipnorm`, `clipvalue`,
`global_clipnorm`) and `gradient_accumulation_steps` are refused at the start
of `fit` for models with sharded variables (`use_ema` for every model, see
`loop`).
"""

import keras
import tensorflow as tf

from kfit_ps import _tf_compat
from kfit_ps.training import transfers

_REFUSED = ("clipnorm", "clipvalue", "global_clipnorm", "gradient_accumulation_steps")


def has_sharded_variables(model):
    return any(_tf_compat.sharded_storage(v) is not None for v in model.trainable_variables)


def check_optimizer(model):
    """Raises ValueError if the model's optimizer cannot update its sharded variables."""
    optimizer = model.optimizer
    for option in _REFUSED:
        value = getattr(optimizer, option, None)
        if value:
            raise ValueError(
                f"Model {model.name!r} has sharded variables (variable_partitioner), and its "
                f"optimizer {type(optimizer).__name__} has {option}={value!r}, which needs "
                f"all gradients of a step at once. Received: {option}={value!r}. Remove "
                f"{option}, or create the model without a variable_partitioner.")


def _unique_rows(gradient, rows):
    """(unique row ids, summed gradient rows) of an IndexedSlices or dense gradient."""
    if isinstance(gradient, tf.IndexedSlices):
        ids, positions = tf.unique(gradient.indices)
        values = tf.math.unsorted_segment_sum(gradient.values, positions, tf.size(ids))
        return ids, values
    return tf.range(rows, dtype=tf.int64), gradient


def _with_counts(gradient, lookup):
    """A dynamic lookup's gradient rows (dense), with each key's batch count as a last column."""
    rows = tf.shape(lookup.rows)[0]
    if isinstance(gradient, tf.IndexedSlices):
        gradient = tf.math.unsorted_segment_sum(gradient.values, gradient.indices, rows)
    counts = tf.cast(lookup.counts, gradient.dtype)[:, None]
    return tf.concat([gradient, counts], axis=1)


def _scatter(variable, ids, values, op):
    getattr(variable, op)(tf.IndexedSlices(values, ids))


class GradientStep:
    """`apply_gradients(tape, loss)` for `_tf_compat.train_step_with`.

    `cached`: the (variable, tensor) pairs the forward pass read instead of
    the variables (`transfers.PackedReads`); their gradients are taken with
    respect to those tensors. Every gradient bound for a ps travels in one
    packed transfer per ps (`transfers.Outbox`); updates then run there.
    """

    def __init__(self, model, cached=(), lookups=()):
        self.model = model
        self.optimizer = model.optimizer
        self._cached = {id(variable): value for variable, value in cached}
        self._lookups = lookups  # Filled by the forward pass (`embeddings.recording`).

    def _sources(self, variable):
        if _tf_compat.sharded_storage(variable) is not None:
            return _tf_compat.shards(variable)
        return [self._cached.get(id(variable), variable)]

    def __call__(self, tape, loss):
        variables = self.model.trainable_variables
        groups = [self._sources(v) for v in variables]
        sources = [s for group in groups for s in group]
        lookups = list(self._lookups)
        flat = tape.gradient(loss, sources + [lookup.rows for lookup in lookups])
        outbox = transfers.Outbox()
        dynamic = [(lookup, outbox.put(lookup.device, lookup.keys),
                    outbox.put(lookup.device, _with_counts(grad, lookup)))
                   for lookup, grad in zip(lookups, flat[len(sources):]) if grad is not None]
        dense, sharded, position = [], [], 0
        for variable, group in zip(variables, groups):
            grads = flat[position:position + len(group)]
            position += len(group)
            if _tf_compat.sharded_storage(variable) is None:
                if grads[0] is not None:
                    device = _tf_compat.storage(variable).device
                    dense.append((variable, outbox.put(device, grads[0], variable.shape)))
                continue
            slots = _tf_compat.optimizer_slots(self.optimizer, variable)
            if slots is None:
                # No sparse path for this optimizer: Keras' own apply, dense, in step order.
                dense.append((variable, ("here", tf.concat(
                    [tf.convert_to_tensor(g) if g is not None else tf.zeros(s.shape, s.dtype)
                     for g, s in zip(grads, group)], axis=0))))
            elif any(g is not None for g in grads):
                rows = []
                for j, (shard, grad) in enumerate(zip(group, grads)):
                    if grad is not None:  # Duplicates summed on the worker: U rows leave it.
                        ids, g = _unique_rows(grad, shard.shape[0])
                        rows.append((j, shard, outbox.put(shard.device, ids),
                                     outbox.put(shard.device, g)))
                sharded.append((slots, rows))
        optimizer = self.optimizer
        # This step's learning rate and step number, read once and packed with the gradients.
        scalars = (tf.cast(optimizer.learning_rate, tf.float32),
                   tf.cast(optimizer.iterations, tf.float32) + 1.0)
        devices = {_tf_compat.storage(v).device for v, handle in dense if handle[0] != "here"}
        devices |= {shard.device for _, rows in sharded for _, shard, _, _ in rows}
        devices |= {lookup.device for lookup, _, _ in dynamic}
        scalar_handles = {device: [outbox.put(device, x) for x in scalars] for device in devices}
        outbox.deliver()

        def scalars_on(device):
            handles = scalar_handles.get(device)
            return scalars if handles is None else [outbox.get(h) for h in handles]

        for slots, rows in sharded:
            slot_shards = {name: _tf_compat.shards(slot) for name, slot in slots.items()}
            for j, shard, ids, g in rows:
                with tf.device(shard.device):  # The ps updates its rows and slots in place.
                    self._apply_shard(optimizer, shard, outbox.get(ids), outbox.get(g),
                                      slot_shards, j, *scalars_on(shard.device))
        for lookup, keys, packed in dynamic:
            with tf.device(lookup.device):  # The ps updates its rows, slots and counts.
                packed = outbox.get(packed)
                lookup.table.update(lookup.shard, outbox.get(keys), packed[:, :-1],
                                    tf.cast(packed[:, -1], tf.int64), optimizer,
                                    *scalars_on(lookup.device))
        dense_vars = [variable for variable, _ in dense]
        dense_grads = [outbox.get(handle) for _, handle in dense]
        if dense and _tf_compat.can_fuse_adam(optimizer, dense_vars):
            _tf_compat.apply_adam(optimizer, dense_grads, dense_vars, scalars_on)
        elif dense:
            optimizer.apply(dense_grads, dense_vars)
        else:
            optimizer.iterations.assign_add(1)

    def _apply_shard(self, optimizer, shard, ids, g, slot_shards, j, learning_rate, step):
        g = tf.cast(g, shard.dtype)
        lr = tf.cast(learning_rate, shard.dtype)
        local = {name: shards_[j] for name, shards_ in slot_shards.items()}
        if optimizer.weight_decay:  # Keras decays before the update; here touched rows.
            decay = tf.cast(optimizer.weight_decay, shard.dtype) * lr
            _scatter(shard, ids, tf.gather(shard, ids) * decay, "scatter_sub")
        if isinstance(optimizer, keras.optimizers.Adam):
            self._adam(shard, local, ids, g, lr, tf.cast(step, shard.dtype))
        elif isinstance(optimizer, keras.optimizers.Adagrad):
            acc = local["accumulator"]
            rows = tf.gather(acc, ids) + tf.square(g)
            _scatter(acc, ids, rows, "scatter_update")
            _scatter(shard, ids, lr * g / tf.sqrt(rows + optimizer.epsilon), "scatter_sub")
        else:  # SGD
            self._sgd(shard, local, ids, g, lr)

    def _sgd(self, shard, slots, ids, g, lr):
        optimizer = self.optimizer
        if "momentum" not in slots:
            _scatter(shard, ids, lr * g, "scatter_sub")
            return
        m = slots["momentum"]
        momentum = tf.cast(optimizer.momentum, shard.dtype)
        m_rows = tf.gather(m, ids) * momentum - lr * g
        _scatter(m, ids, m_rows, "scatter_update")
        delta = m_rows * momentum - lr * g if optimizer.nesterov else m_rows
        _scatter(shard, ids, delta, "scatter_add")

    def _adam(self, shard, slots, ids, g, lr, step):
        optimizer = self.optimizer
        beta_1 = tf.cast(optimizer.beta_1, shard.dtype)
        beta_2 = tf.cast(optimizer.beta_2, shard.dtype)
        alpha = lr * tf.sqrt(1 - tf.pow(beta_2, step)) / (1 - tf.pow(beta_1, step))
        m_rows = tf.gather(slots["m"], ids)
        v_rows = tf.gather(slots["v"], ids)
        m_rows = m_rows + (g - m_rows) * (1 - beta_1)
        v_rows = v_rows + (tf.square(g) - v_rows) * (1 - beta_2)
        _scatter(slots["m"], ids, m_rows, "scatter_update")
        _scatter(slots["v"], ids, v_rows, "scatter_update")
        if "v_hat" in slots:
            v_rows = tf.maximum(tf.gather(slots["v_hat"], ids), v_rows)
            _scatter(slots["v_hat"], ids, v_rows, "scatter_update")
        _scatter(shard, ids, m_rows * alpha / (tf.sqrt(v_rows) + optimizer.epsilon),
                 "scatter_sub")

