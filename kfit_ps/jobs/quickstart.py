"""The main job: a recommendation-style model trained on a local PS cluster.

Synthetic click data with a learnable signal: each user and item has a hidden
taste vector; the click probability is a logistic function of their dot
product plus two dense features. The model (user and item embeddings + an MLP)
has to recover that signal; AUC well above 0.5 on held-out data shows it did.
"""

import dataclasses
import time

import numpy as np

HIDDEN_DIM = 8


@dataclasses.dataclass(frozen=True)
class QuickstartConfig:
    """Settings of the main job (each is a `kfit-ps quickstart` flag)."""

    num_workers: int = 2
    num_ps: int = 2
    epochs: int = 3
    steps_per_epoch: int = 100
    batch_size: int = 256
    num_users: int = 1000
    num_items: int = 500
    num_examples: int = 100_000
    steps_per_execution: int = 5
    verbose: int = 1
    seed: int = 0

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            minimum = 0 if field.name in ("verbose", "seed") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"QuickstartConfig.{field.name} must be an integer >= {minimum}. "
                                 f"Received: {field.name}={value!r}.")


def make_click_data(config, num_examples, seed):
    """Returns ((user, item, dense), clicked) numpy arrays with a learnable signal."""
    truth = np.random.default_rng(config.seed)
    user_taste = truth.normal(size=(config.num_users, HIDDEN_DIM)) / np.sqrt(HIDDEN_DIM)
    item_taste = truth.normal(size=(config.num_items, HIDDEN_DIM)) / np.sqrt(HIDDEN_DIM)
    dense_weight = np.array([1.0, -1.0])
    rng = np.random.default_rng(seed)
    users = rng.integers(0, config.num_users, num_examples)
    items = rng.integers(0, config.num_items, num_examples)
    dense = rng.normal(size=(num_examples, 2)).astype("float32")
    logits = 3.0 * np.sum(user_taste[users] * item_taste[items], axis=1) + dense @ dense_weight
    clicked = (rng.random(num_examples) < 1 / (1 + np.exp(-logits))).astype("float32")
    features = {"user": users.astype("int32"), "item": items.astype("int32"),
                "dense_features": dense}
    return features, clicked[:, None]


def build_model(config):
    import keras

    user = keras.Input(shape=(), dtype="int32", name="user")
    item = keras.Input(shape=(), dtype="int32", name="item")
    dense = keras.Input(shape=(2,), name="dense_features")
    user_vec = keras.layers.Embedding(config.num_users, 16, name="user_embedding")(user)
    item_vec = keras.layers.Embedding(config.num_items, 16, name="item_embedding")(item)
    x = keras.layers.Concatenate()([user_vec, item_vec, user_vec * item_vec, dense])
    x = keras.layers.Dense(64, activation="relu")(x)
    x = keras.layers.Dense(32, activation="relu")(x)
    out = keras.layers.Dense(1, activation="sigmoid", name="click")(x)
    return keras.Model({"user": user, "item": item, "dense_features": dense}, out, name="recsys")


def run(config=QuickstartConfig()):
    """Trains on a fresh LocalCluster; returns the held-out metrics dict."""
    import keras
    import tensorflow as tf

    import kfit_ps

    features, clicked = make_click_data(config, config.num_examples, seed=config.seed + 1)
    test_features, test_clicked = make_click_data(config, 10_000, seed=config.seed + 2)

    def dataset_fn(input_context):
        batch = input_context.get_per_replica_batch_size(config.batch_size)
        dataset = tf.data.Dataset.from_tensor_slices((features, clicked))
        return dataset.shuffle(20_000).repeat().batch(batch).prefetch(tf.data.AUTOTUNE)

    started = time.monotonic()
    with kfit_ps.LocalCluster(num_workers=config.num_workers, num_ps=config.num_ps) as cluster:
        print(f"kfit_ps quickstart: {config.num_workers} workers + {config.num_ps} ps started "
              f"in {time.monotonic() - started:.1f}s ({cluster.config!r})", flush=True)
        strategy = kfit_ps.ParameterServerStrategy(cluster.cluster_resolver)
        with strategy.scope():
            model = build_model(config)
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy",
                          metrics=[keras.metrics.AUC(name="auc")],
                          steps_per_execution=config.steps_per_execution)
        model.fit(kfit_ps.DatasetCreator(dataset_fn), epochs=config.epochs,
                  steps_per_epoch=config.steps_per_epoch, verbose=config.verbose)
        results = model.evaluate(test_features, test_clicked, batch_size=1024,
                                 return_dict=True, verbose=0)
        results["iterations"] = int(model.optimizer.iterations.numpy())
    results["seconds"] = time.monotonic() - started
    print(f"held-out: auc={results['auc']:.3f} loss={results['loss']:.3f} "
          f"(steps trained: {results['iterations']}, {results['seconds']:.1f}s)", flush=True)
    return results
