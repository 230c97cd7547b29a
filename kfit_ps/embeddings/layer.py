"""`DynamicEmbedding`: an embedding layer for unbounded id spaces, its rows on the ps tasks."""

import random
import uuid

import keras
import tensorflow as tf

from kfit_ps import _tf_compat
from kfit_ps import strategy as strategy_lib
from kfit_ps.embeddings import hashing, recording, saving
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

    The model's optimizer updates the rows a step touched, and only those,
    with their optimizer slots (`SGD`, `Adagrad`, `Adam`/`AdamW`, lazily, as
    for kfit_ps' sharded tables); this happens in kfit_ps' `fit` of a model
    built in a `kfit_ps.ParameterServerStrategy` scope. Without a cluster the
    layer serves: a `.keras` file loads and predicts anywhere.

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
    """

    def __init__(self, output_dim, embeddings_initializer="uniform", min_count=1,
                 max_age=None, capacity=None, seed=None, num_shards=None, **kwargs):
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
        self.built = True

    def compute_output_spec(self, ids, training=None):
        return keras.tree.map_structure(
            lambda x: keras.KerasTensor(tuple(x.shape) + (self.output_dim,),
                                        dtype=self.compute_dtype), ids)

    def call(self, ids, training=None):
        recorder = recording.current() if training else None
        if training and recorder is None:
            raise ValueError(
                f"DynamicEmbedding {self.name!r} was called with training=True outside kfit_ps' "
                "training step: its rows live in hash tables that only kfit_ps' fit updates "
                "(a model built in a kfit_ps.ParameterServerStrategy scope, with Keras' own "
                "train_step). Train it with kfit_ps, or call it with training=False to read "
                "its rows.")
        features = keras.tree.flatten_with_path(ids)
        keys = [hashing.keys(x) for _, x in features]
        if len(features) > 1 or features[0][0]:  # Several features share the table: salted.
            keys = [hashing.salted(k, "/".join(map(str, path)))
                    for (path, _), k in zip(features, keys)]
        flat = [tf.reshape(k, [-1]) for k in keys]
        unique, position, counts = tf.unique_with_counts(tf.concat(flat, axis=0),
                                                         out_idx=tf.int32)
        n = self.table.num_shards
        shard = hashing.shard_of(unique, n)
        keys_by = tf.dynamic_partition(unique, shard, n)
        counts_by = tf.dynamic_partition(tf.cast(counts, tf.int64), shard, n)
        order = tf.dynamic_partition(tf.range(tf.size(unique)), shard, n)
        fresh = bool(training) and self.min_count <= 1
        rows = []
        for i in range(n):  # One lookup per shard, for every feature.
            found = self.table.lookup(i, keys_by[i], fresh)
            if recorder is not None:
                recorder.record(recording.Lookup(self.table, i, keys_by[i], counts_by[i], found))
            rows.append(found)
        where = tf.math.invert_permutation(tf.concat(order, axis=0))
        vectors = tf.gather(tf.concat(rows, axis=0), tf.gather(where, position))
        outputs = []
        for k, part in zip(keys, tf.split(vectors, [tf.size(f) for f in flat], axis=0)):
            shape = tf.concat([tf.shape(k), [self.output_dim]], axis=0)
            outputs.append(tf.cast(tf.reshape(part, shape), self.compute_dtype))
        return keras.tree.pack_sequence_as(ids, outputs)

    # The model's optimizer, statistics, saving ---------------------------------------------

    def use_optimizer(self, optimizer):
        """Prepares the slot tables `optimizer` needs (kfit_ps' fit calls this first)."""
        self._require_built()
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
        saving.load_table(self.table, store)

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
        })
        return config
