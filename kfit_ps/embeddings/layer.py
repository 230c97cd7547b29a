"""`DynamicEmbedding`: an embedding layer for unbounded id spaces, its rows on the ps tasks."""

import random
import uuid

import keras
import tensorflow as tf

from kfit_ps import _tf_compat
from kfit_ps import strategy as strategy_lib
from kfit_ps.embeddings import hashing, recording, saving, sparse_optimizer
from kfit_ps.embeddings.table import DynamicTable


def _check_count(name, value, minimum, allow_none=True):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"DynamicEmbedding: `{name}` must be an integer >= {minimum}"
                         f"{' or None' if allow_none else ''}. Received: {name}={value!r}.")
    return value


@keras.saving.register_keras_serializable(package="kfit_ps")
class DynamicEmbedding(keras.layers.Layer):
    """Embeds integer or string ids of any value, growing a row per new id.

    Unlike `keras.layers.Embedding(input_dim, output_dim)`, there is no
    vocabulary size: the rows live in hash tables split over the ps tasks by
    id hash, created as ids arrive in training. A new id's first vector comes
    from `embeddings_initializer`, the same for that id wherever and whenever
    it first appears (a function of the id and `seed`). Ids without a row
    (not admitted yet, evicted, or never seen) read as zeros outside training.

    The model's optimizer (or the layer's own `optimizer`) updates the rows a
    step touched, and only those, with their optimizer slots (`SGD`,
    `Adagrad`, `Adam`/`AdamW`, lazily, as for kfit_ps' sharded tables, with
    Keras' loss scaling, weight decay and `exclude_from_weight_decay`, and
    `embeddings_constraint`); this happens in kfit_ps' `fit` of a model built
    in a `kfit_ps.ParameterServerStrategy` scope. A layer with
    `trainable=False` is read and never written: its rows, slots and counts
    stay as they are. Without a cluster the layer serves: a `.keras` file
    loads and predicts anywhere.

    Multi-hot ids: with a `combiner`, ids of shape `(batch, n)` (or a 2-D
    `tf.RaggedTensor` or `tf.SparseTensor`) give one vector per example, the
    sum, mean or `sqrtn`-scaled sum of its ids' rows; padding ids count for
    nothing.

    Several features can share one layer: call it on a dict (or list) of id
    tensors and it returns a dict (list) of vectors. Their ids are salted
    with the feature's name (position), so equal ids of two features get two
    rows; each step then does one lookup and one update per ps for all
    features together, instead of one per feature, and `capacity` bounds them
    together (the least seen ids of any feature go first).

    ```python
    with strategy.scope():
        ids = keras.Input(shape=(1,), dtype="int64")
        vectors = kfit_ps.layers.DynamicEmbedding(16, capacity=1_000_000)(ids)
        ...
    ```

    Args:
        output_dim: width of each row.
        embeddings_initializer: a Keras `RandomUniform`, `RandomNormal`,
            `TruncatedNormal`, `Zeros`, `Ones` or `Constant` initializer (or its
            name). Defaults to `"uniform"`, as `keras.layers.Embedding`.
        min_count: times an id must be seen in training before it gets its
            own row; until then it reads as zeros and its gradient is dropped.
            Defaults to 1 (every id gets a row on first sight).
        max_age: evict ids not seen for this many training steps (checked
            every `max_age // 10` steps, on the ps). Defaults to None (never).
        capacity: the most rows to hold, over all ps tasks. Each shard evicts
            its least frequently seen ids when it holds more than
            `ceil(capacity / shards)` plus 10 % of that, back down to
            `ceil(capacity / shards)`. Defaults to None (unbounded).
        seed: seed of new ids' vectors. Defaults to the initializer's seed, or
            a random one chosen now (and saved with the layer's config).
        num_shards: hash-table shards. Defaults to the number of ps tasks
            (one per ps), or 1 without a cluster.
        mask_zero: as `keras.layers.Embedding`: id 0 is padding and the layer
            returns a mask (`ids != 0`; none with a `combiner`). The padding
            id reads as zeros and is never stored or trained. Defaults to False.
        padding_id: an id (integer, or string for string ids) that reads as
            zeros and is never stored or trained, without a mask. Defaults
            to None (0 with `mask_zero=True`).
        combiner: None, `"sum"`, `"mean"` or `"sqrtn"`: reduce each example's
            ids (the last axis, or a ragged row) to one vector. Defaults to
            None (one vector per id).
        optimizer: a Keras `SGD`, `Adagrad`, `Adam` or `AdamW` that updates
            this table instead of the model's optimizer (its own learning rate
            or schedule, read at the model's step). Defaults to None.
        embeddings_constraint: a row-wise Keras constraint applied to each
            updated row (`NonNeg`, or `MaxNorm`/`UnitNorm`/`MinMaxNorm` with
            `axis=-1`). Defaults to None.
    """

    COMBINERS = ("sum", "mean", "sqrtn")

    def __init__(self, output_dim, embeddings_initializer="uniform", min_count=1,
                 max_age=None, capacity=None, seed=None, num_shards=None, mask_zero=False,
                 padding_id=None, combiner=None, optimizer=None, embeddings_constraint=None,
                 **kwargs):
        super().__init__(**kwargs)
        self.output_dim = _check_count("output_dim", output_dim, 1, allow_none=False)
        self.min_count = _check_count("min_count", min_count, 1, allow_none=False)
        self.max_age = _check_count("max_age", max_age, 1)
        self.capacity = _check_count("capacity", capacity, 1)
        self.num_shards = _check_count("num_shards", num_shards, 1)
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        kind, config, initializer_seed = hashing.initializer_spec(self.embeddings_initializer)
        if seed is None:
            seed = initializer_seed if initializer_seed is not None else random.getrandbits(62)
        self.seed = _check_count("seed", seed, 0, allow_none=False)
        self._initializer = (kind, config)
        self.mask_zero = bool(mask_zero)
        if mask_zero and padding_id not in (None, 0):
            raise ValueError(f"DynamicEmbedding: `mask_zero=True` makes 0 the padding id. "
                             f"Received: padding_id={padding_id!r}. Drop padding_id, or set "
                             "mask_zero=False.")
        self.padding_id = 0 if mask_zero else padding_id
        if self.padding_id is not None and (isinstance(self.padding_id, bool) or
                                            not isinstance(self.padding_id, (int, str))):
            raise ValueError(f"DynamicEmbedding: `padding_id` must be an integer or a string. "
                             f"Received: padding_id={padding_id!r}.")
        if combiner is not None and combiner not in self.COMBINERS:
            raise ValueError(f"DynamicEmbedding: `combiner` must be one of "
                             f"{', '.join(self.COMBINERS)} or None. Received: "
                             f"combiner={combiner!r}.")
        self.combiner = combiner
        self.optimizer = keras.optimizers.get(optimizer) if optimizer is not None else None
        if self.optimizer is not None:
            sparse_optimizer.slot_names(self.optimizer)  # Names the supported ones.
            sparse_optimizer.check_optimizer(self.optimizer, f"DynamicEmbedding {self.name!r}")
        self.embeddings_constraint = keras.constraints.get(embeddings_constraint)
        if not sparse_optimizer.row_constraint(self.embeddings_constraint):
            raise ValueError(
                "DynamicEmbedding: `embeddings_constraint` must act on each row alone (each "
                "update changes only the rows it touched). Received: embeddings_constraint="
                f"{self.embeddings_constraint!r}. Use NonNeg, or MaxNorm / UnitNorm / "
                "MinMaxNorm with axis=-1.")
        self.supports_masking = self.mask_zero
        self.table = None

    def _devices(self):
        strategy = tf.distribute.get_strategy()
        if strategy_lib.is_kfit_strategy(strategy):
            n = self.num_shards or strategy.num_ps
            return [f"/job:ps/replica:0/task:{i % strategy.num_ps}/device:CPU:0"
                    for i in range(n)]
        return ["/device:CPU:0"] * (self.num_shards or 1)

    def build(self, input_shape=None):
        if self.table is None:
            self.table = DynamicTable(
                self.output_dim, self._devices(), self._initializer, self.seed,
                min_count=self.min_count, max_age=self.max_age, capacity=self.capacity,
                name=f"{self.name}_{uuid.uuid4().hex[:8]}")
            self.table.optimizer = self.optimizer
            self.table.constraint = self.embeddings_constraint
            # The name `exclude_from_weight_decay(var_names=...)` is matched against.
            self.table.variable_name = f"{self.name}/embeddings"
        self.built = True

    def compute_output_spec(self, ids, training=None):
        def spec(x):
            shape = tuple(x.shape)[:-1] if self.combiner else tuple(x.shape)
            return keras.KerasTensor(shape + (self.output_dim,), dtype=self.compute_dtype)

        return keras.tree.map_structure(spec, ids)

    def compute_mask(self, ids, mask=None):
        if not self.mask_zero or self.combiner:
            return None
        return keras.tree.map_structure(lambda x: keras.ops.not_equal(x, 0), ids)

    def _valid(self, ids):
        """Whether each id is not the padding id (None: no padding id)."""
        if self.padding_id is None:
            return None
        if (ids.dtype == tf.string) != isinstance(self.padding_id, str):
            raise ValueError(f"DynamicEmbedding {self.name!r}: padding_id={self.padding_id!r} "
                             f"cannot pad ids of dtype {ids.dtype.name}. Use a string padding "
                             "id for string ids, an integer one for integer ids.")
        return tf.not_equal(ids, tf.constant(self.padding_id, ids.dtype)
                            if ids.dtype != tf.string else self.padding_id)

    def call(self, ids, training=None):
        recorder = recording.current() if training and self.trainable else None
        if training and self.trainable and recorder is None:
            raise ValueError(
                f"DynamicEmbedding {self.name!r} was called with training=True outside kfit_ps' "
                "training step: its rows live in hash tables that only kfit_ps' fit updates "
                "(a model built in a kfit_ps.ParameterServerStrategy scope, with Keras' own "
                "train_step). Train it with kfit_ps, call it with training=False to read "
                "its rows, or freeze it (trainable=False).")
        # A 2-D tf.SparseTensor of ids (multi-hot, as `embedding_lookup_sparse` takes) is a
        # ragged row of ids per example.
        ids = keras.tree.map_structure(
            lambda x: tf.RaggedTensor.from_sparse(x) if isinstance(x, tf.SparseTensor) else x,
            ids)
        features = keras.tree.flatten_with_path(ids)
        values = [x.flat_values if isinstance(x, tf.RaggedTensor) else x for _, x in features]
        keys = [hashing.keys(x) for x in values]
        if len(features) > 1 or features[0][0]:  # Several features share the table: salted.
            keys = [hashing.salted(k, "/".join(map(str, path)))
                    for (path, _), k in zip(features, keys)]
        valid = [self._valid(x) for x in values]
        flat = tf.concat([tf.reshape(k, [-1]) for k in keys], axis=0)
        vectors = self._vectors(flat, valid, bool(recorder is not None or
                                                  (training and self.trainable)), recorder)
        outputs = []
        sizes = [tf.size(k) for k in keys]
        for (_, x), k, ok, part in zip(features, keys, valid, tf.split(vectors, sizes, axis=0)):
            outputs.append(tf.cast(self._shape(x, k, ok, part), self.compute_dtype))
        return keras.tree.pack_sequence_as(ids, outputs)

    def _vectors(self, flat, valid, training, recorder):
        """[len(flat), dim] rows of the keys `flat`; padding positions read zeros, unlooked-up."""
        kept = flat
        if self.padding_id is not None:
            mask = tf.concat([tf.reshape(v, [-1]) for v in valid], axis=0)
            kept = tf.boolean_mask(flat, mask)
        unique, position, counts = tf.unique_with_counts(kept, out_idx=tf.int32)
        n = self.table.num_shards
        shard = hashing.shard_of(unique, n)
        keys_by = tf.dynamic_partition(unique, shard, n)
        counts_by = tf.dynamic_partition(tf.cast(counts, tf.int64), shard, n)
        order = tf.dynamic_partition(tf.range(tf.size(unique)), shard, n)
        fresh = training and self.min_count <= 1
        rows = []
        for i in range(n):  # One lookup per shard, for every feature.
            found = self.table.lookup(i, keys_by[i], fresh)
            if recorder is not None:
                recorder.record(recording.Lookup(self.table, i, keys_by[i], counts_by[i], found))
            rows.append(found)
        where = tf.math.invert_permutation(tf.concat(order, axis=0))
        vectors = tf.gather(tf.concat(rows, axis=0), tf.gather(where, position))
        if self.padding_id is None:
            return vectors
        return tf.scatter_nd(tf.where(mask), vectors,
                             tf.stack([tf.size(flat, out_type=tf.int64),
                                       tf.constant(self.output_dim, tf.int64)]))

    def _shape(self, x, k, valid, part):
        """One feature's vectors in its ids' shape, or combined per example."""
        if isinstance(x, tf.RaggedTensor):
            if x.ragged_rank != 1 or x.shape.rank != 2:
                raise ValueError(f"DynamicEmbedding {self.name!r} takes 2-D ragged ids "
                                 f"(batch, None). Received: ids of shape {x.shape}.")
            if self.combiner is None:
                return tf.RaggedTensor.from_row_splits(part, x.row_splits)
            rows = x.value_rowids()
            count = tf.math.unsorted_segment_sum(
                tf.ones_like(rows, tf.float32) if valid is None else tf.cast(valid, tf.float32),
                rows, x.nrows())
            total = tf.math.unsorted_segment_sum(part, rows, x.nrows())
        else:
            part = tf.reshape(part, tf.concat([tf.shape(k), [self.output_dim]], axis=0))
            if self.combiner is None:
                return part
            if k.shape.rank is not None and k.shape.rank < 2:
                raise ValueError(
                    f"DynamicEmbedding {self.name!r} with combiner={self.combiner!r} combines the "
                    f"ids of each example (the last axis). Received: ids of shape {x.shape}. "
                    "Pass ids of shape (batch, n), ragged or sparse ids, or no combiner.")
            count = tf.reduce_sum(tf.ones_like(k, tf.float32) if valid is None
                                  else tf.cast(valid, tf.float32), axis=-1)
            total = tf.reduce_sum(part, axis=-2)
        count = tf.maximum(count, 1.0)[..., None]
        if self.combiner == "mean":
            return total / count
        if self.combiner == "sqrtn":
            return total / tf.sqrt(count)
        return total

    # The model's optimizer, statistics, saving ---------------------------------------------

    def use_optimizer(self, optimizer):
        """Keeps the slots the table's optimizer needs (kfit_ps' fit calls this first).

        The table's optimizer is the layer's own `optimizer`, else `optimizer`.
        """
        self._require_built()
        optimizer = self.optimizer or optimizer
        if not self.table.use_optimizer(optimizer):
            _tf_compat.print_msg(
                f"DynamicEmbedding {self.name!r}: optimizer slots reset for "
                f"{type(optimizer).__name__}.")

    def stats(self):
        """{"rows", "admitted", "evicted", "peak_rows_per_shard"} of this layer's table."""
        self._require_built()
        return self.table.stats()

    def _require_built(self):
        if self.table is None:
            raise ValueError(f"DynamicEmbedding {self.name!r} is not built yet: call it on "
                             "ids (or build the model) first.")

    def save_own_variables(self, store):
        self._require_built()
        saving.save_table(self.table, store)

    def load_own_variables(self, store):
        self._require_built()
        saving.load_table(self.table, store, owner=f"DynamicEmbedding {self.name!r}")

    def get_config(self):
        config = super().get_config()
        config.update({
            "output_dim": self.output_dim,
            "embeddings_initializer": keras.initializers.serialize(self.embeddings_initializer),
            "min_count": self.min_count,
            "max_age": self.max_age,
            "capacity": self.capacity,
            "seed": self.seed,
            "num_shards": self.num_shards,
            "mask_zero": self.mask_zero,
            "padding_id": None if self.mask_zero else self.padding_id,
            "combiner": self.combiner,
            "optimizer": (keras.optimizers.serialize(self.optimizer)
                          if self.optimizer is not None else None),
            "embeddings_constraint": keras.constraints.serialize(self.embeddings_constraint),
        })
        return config
