"""Collaborative filtering as keras-io's MovieLens example does it, on generated ratings.

The steps of that example (which downloads `ratings.csv`; here rows of its schema
`userId, movieId, rating` are generated, with a taste structure to learn): ids
re-encoded with pandas, the rating scaled to [0, 1], a 90/10 split of numpy
arrays, a subclassed `keras.Model` with regularised `Embedding`s and biases, and
`fit(x=..., y=..., validation_data=(...))` on the arrays, then `predict` for one
user. Usage: `python movielens_ratings.py RESULT.json`. `tests/test_keras_scripts.py`
runs it as written and with the two lines a kfit_ps user adds.
"""

import json
import sys

import keras
import numpy as np
import pandas as pd
from keras import layers, ops

# Ratings of the MovieLens schema: sparse ids, half-star ratings.
rng = np.random.default_rng(7)
users, movies, rows = 300, 400, 20_000
user_taste, movie_taste = rng.normal(size=(users, 4)), rng.normal(size=(movies, 4))
u, m = rng.integers(0, users, rows), rng.integers(0, movies, rows)
raw = np.clip(np.round(2 * (2.75 + (user_taste[u] * movie_taste[m]).sum(1))) / 2, 0.5, 5.0)
df = pd.DataFrame({"userId": u * 7 + 1, "movieId": m * 3 + 10, "rating": raw})

user_ids = df["userId"].unique().tolist()
user_encoded = {x: i for i, x in enumerate(user_ids)}
movie_ids = df["movieId"].unique().tolist()
movie_encoded = {x: i for i, x in enumerate(movie_ids)}
df["user"] = df["userId"].map(user_encoded)
df["movie"] = df["movieId"].map(movie_encoded)
df["rating"] = df["rating"].values.astype(np.float32)
min_rating, max_rating = min(df["rating"]), max(df["rating"])

df = df.sample(frac=1, random_state=42)
x = df[["user", "movie"]].values
y = df["rating"].apply(lambda r: (r - min_rating) / (max_rating - min_rating)).values
split = int(0.9 * df.shape[0])
x_train, x_val, y_train, y_val = x[:split], x[split:], y[:split], y[split:]


class RecommenderNet(keras.Model):
    def __init__(self, num_users, num_movies, embedding_size, **kwargs):
        super().__init__(**kwargs)
        regularizer = keras.regularizers.l2(1e-6)
        self.user_embedding = layers.Embedding(num_users, embedding_size,
                                               embeddings_initializer="he_normal",
                                               embeddings_regularizer=regularizer)
        self.user_bias = layers.Embedding(num_users, 1)
        self.movie_embedding = layers.Embedding(num_movies, embedding_size,
                                                embeddings_initializer="he_normal",
                                                embeddings_regularizer=regularizer)
        self.movie_bias = layers.Embedding(num_movies, 1)

    def call(self, inputs):
        user, movie = inputs[:, 0], inputs[:, 1]
        dot = ops.sum(self.user_embedding(user) * self.movie_embedding(movie), axis=1,
                      keepdims=True)
        return ops.sigmoid(dot + self.user_bias(user) + self.movie_bias(movie))


# MODEL
model = RecommenderNet(len(user_encoded), len(movie_encoded), 32)
model.compile(loss=keras.losses.BinaryCrossentropy(),
              optimizer=keras.optimizers.Adam(learning_rate=0.002))
# END MODEL

history = model.fit(x=x_train, y=y_train, batch_size=64, epochs=4, verbose=2,
                    validation_data=(x_val, y_val))

user = 0
unseen = sorted(set(range(len(movie_encoded))) - set(df[df.user == user].movie))
ratings = model.predict(np.hstack(([[user]] * len(unseen), np.array(unseen)[:, None])),
                        verbose=0).flatten()
with open(sys.argv[1], "w") as f:
    json.dump({"val_loss": history.history["val_loss"], "epochs": history.epoch,
               "top": [int(unseen[i]) for i in ratings.argsort()[-10:][::-1]],
               "predictions": len(ratings)}, f)
