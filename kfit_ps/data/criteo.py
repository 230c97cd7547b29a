"""Criteo-shaped click logs: a generator with a learnable signal, and a reader.

The Criteo display-advertising logs are the standard workload for sharded
embeddings: one label, 13 integer features and 26 categorical features per
line, tab-separated, categorical values as 8-hex-digit hashes, any field
possibly empty. `generate()` writes files in exactly that layout:

- per-feature cardinalities shaped like Criteo's (`CRITEO_CARDINALITIES`, the
  Kaggle dataset's), multiplied by `scale`;
- Zipf-distributed ids (a few very frequent values, a long tail), as real
  click logs have;
- integer features drawn as counts, with missing values;
- a learnable signal: the click probability is a logistic function of a
  hidden weight per categorical value plus the log-counts.

`generate(..., format="tfrecord")` writes the same rows as `tf.train.Example`s
in TFRecord files (`part-NNNNN.tfrecord`: `label`, `dense` (13 floats, a missing
count as 0) and `C1`..`C26` (the 8-hex-digit hash, or the raw id with
`raw_ids`; a missing value as "" or -1)).

`dataset()` reads such files, generated or real (`train.txt` of the Kaggle
release, split into parts), and hashes each categorical value into
`buckets` rows, so table sizes are chosen by the model, not by the data.

```python
spec = CriteoSpec(scale=1e-3)
paths = generate("/tmp/criteo", rows=100_000, spec=spec)
data = dataset(paths, batch_size=512, spec=spec)   # ({"dense", "C1".."C26"}, label)
```
"""

import dataclasses
import os

import numpy as np

NUM_DENSE = 13
NUM_CATEGORICAL = 26
CATEGORICAL = tuple(f"C{i + 1}" for i in range(NUM_CATEGORICAL))

# Distinct values per categorical feature in the Criteo Kaggle dataset.
CRITEO_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
    14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)


@dataclasses.dataclass(frozen=True)
class CriteoSpec:
    """Table sizes of a Criteo-shaped dataset: Criteo's cardinalities x `scale`.

    Args:
        scale: factor on every cardinality (at least 2 values per feature).
            Defaults to 1e-3 (the largest table has about 10K rows).
        buckets: rows of each feature's table in the reader (hash buckets).
            Defaults to the scaled cardinality.
    """

    scale: float = 1e-3
    buckets: tuple = None

    def __post_init__(self):
        if not isinstance(self.scale, (int, float)) or not 0 < self.scale <= 1:
            raise ValueError(f"CriteoSpec: `scale` must be in (0, 1]. Received: "
                             f"scale={self.scale!r}.")
        if self.buckets is None:
            object.__setattr__(self, "buckets", self.cardinalities)
        elif len(self.buckets) != NUM_CATEGORICAL or min(self.buckets) < 1:
            raise ValueError(f"CriteoSpec: `buckets` must be {NUM_CATEGORICAL} positive "
                             f"integers. Received: buckets={self.buckets!r}.")

    @property
    def cardinalities(self):
        return tuple(max(2, int(round(c * self.scale))) for c in CRITEO_CARDINALITIES)


def _hidden_weight(feature, ids):
    """The click signal carried by value `ids` of categorical `feature` (deterministic)."""
    return np.sin(ids * 0.618034 + feature * 1.7) * (1.0 + 0.5 * np.cos(ids * 0.1 + feature))


FORMATS = {"tsv": ".tsv", "tfrecord": ".tfrecord"}  # format -> file suffix


def generate(directory, rows, spec=CriteoSpec(), files=1, seed=0, zipf_a=1.2,
             missing=0.03, raw_ids=False, growth=0.0, format="tsv"):
    """Writes `rows` lines of Criteo-layout TSV into `files` files; returns their paths.

    `format="tfrecord"` writes the same rows as `tf.train.Example` records.

    `raw_ids=True` writes each categorical value as its raw id in decimal
    (unhashed, unbounded: read them with `dataset(..., raw_ids=True)`).
    `growth` > 0 makes the id space grow over the file's lines, as new users
    and items arrive: line r draws from `cardinality * (1 + growth * r / rows)`
    ids, so later lines (and files) bring ids earlier ones never had.
    """
    if rows < 1 or files < 1:
        raise ValueError(f"generate: `rows` and `files` must be >= 1. Received: rows={rows!r}, "
                         f"files={files!r}.")
    if format not in FORMATS:
        raise ValueError(f"generate: `format` must be one of {sorted(FORMATS)}. Received: "
                         f"format={format!r}.")
    import tensorflow as tf

    directory = os.fspath(directory)
    tf.io.gfile.makedirs(directory)  # Any TensorFlow file system: gs://, ram://, local.
    rng = np.random.default_rng(seed)
    cardinalities = np.array(spec.cardinalities)
    ids = np.empty((rows, NUM_CATEGORICAL), dtype=np.int64)
    logit = np.full(rows, -1.0)
    if growth < 0:
        raise ValueError(f"generate: `growth` must be >= 0. Received: growth={growth!r}.")
    time = 1.0 + growth * np.arange(rows) / rows
    for j, cardinality in enumerate(cardinalities):
        space = np.maximum(2, (cardinality * time).astype(np.int64))
        ids[:, j] = (rng.zipf(zipf_a, rows) - 1) % space
        logit += 4.0 * _hidden_weight(j, ids[:, j]) / np.sqrt(NUM_CATEGORICAL)
    counts = rng.poisson(rng.gamma(1.0, 3.0, (rows, NUM_DENSE))).astype(np.int64)
    logit += 0.15 * (np.log1p(counts[:, 0]) - np.log1p(counts[:, 1]))
    labels = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    hashed = (ids * 2654435761 + np.arange(NUM_CATEGORICAL) * 40503) % (1 << 32)
    dense_text = counts.astype(str)
    dense_text[rng.random(counts.shape) < missing] = ""
    cat_text = ids.astype(str) if raw_ids else _hex8(hashed)
    cat_text[rng.random(ids.shape) < missing] = ""
    table = np.concatenate([labels[:, None].astype(str), dense_text, cat_text], axis=1)
    paths = []
    for index, part in enumerate(np.array_split(table, files)):
        path = f"{directory.rstrip('/')}/part-{index:05d}{FORMATS[format]}"
        if format == "tfrecord":
            with tf.io.TFRecordWriter(path) as writer:
                for row in part:
                    writer.write(_example(row, raw_ids))
        else:
            with tf.io.gfile.GFile(path, "w") as f:
                f.write("\n".join("\t".join(row) for row in part))
                f.write("\n")
        paths.append(path)
    return paths


_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", np.uint8)


def _hex8(values):
    """`np.char.mod("%08x", values)` for values below 2**32, a third of its time."""
    nibbles = (values[..., None] >> np.arange(28, -1, -4)) & 0xF
    return (np.frombuffer(_HEX_DIGITS[nibbles].tobytes(), dtype="S8")
            .reshape(values.shape).astype("U8"))


def _example(row, raw_ids):
    """One TSV row (strings, "" where missing) as a serialized `tf.train.Example`."""
    import tensorflow as tf

    train = tf.train
    feature = {"label": train.Feature(float_list=train.FloatList(value=[float(row[0])])),
               "dense": train.Feature(float_list=train.FloatList(
                   value=[float(v) if v else 0.0 for v in row[1:1 + NUM_DENSE]]))}
    for name, value in zip(CATEGORICAL, row[1 + NUM_DENSE:]):
        feature[name] = (train.Feature(int64_list=train.Int64List(value=[int(value or -1)]))
                         if raw_ids else
                         train.Feature(bytes_list=train.BytesList(value=[value.encode()])))
    return train.Example(features=train.Features(feature=feature)).SerializeToString()


def parse_lines(lines, spec=CriteoSpec(), raw_ids=False):
    """Parses a batch of Criteo TSV lines into (features, label) tensors.

    Categorical values are hashed into `spec.buckets` rows, or, with
    `raw_ids`, parsed as the raw int64 ids `generate(raw_ids=True)` wrote
    (an empty value reads as -1).
    """
    import tensorflow as tf

    defaults = [[0.0]] + [[0.0]] * NUM_DENSE + [[""]] * NUM_CATEGORICAL
    fields = tf.io.decode_csv(lines, record_defaults=defaults, field_delim="\t",
                              use_quote_delim=False)
    categorical = fields[1 + NUM_DENSE:]
    if raw_ids:
        categorical = [tf.strings.to_number(tf.where(tf.equal(text, ""), "-1", text),
                                            out_type=tf.int64) for text in categorical]
    return _features(fields[0], tf.stack(fields[1:1 + NUM_DENSE], axis=1), categorical,
                     spec, raw_ids)


def parse_examples(records, spec=CriteoSpec(), raw_ids=False):
    """Parses a batch of `generate(format="tfrecord")` records as `parse_lines` parses lines."""
    import tensorflow as tf

    kind = tf.int64 if raw_ids else tf.string
    features = {"label": tf.io.FixedLenFeature([], tf.float32),
                "dense": tf.io.FixedLenFeature([NUM_DENSE], tf.float32),
                **{name: tf.io.FixedLenFeature([], kind) for name in CATEGORICAL}}
    parsed = tf.io.parse_example(records, features)
    return _features(parsed["label"], parsed["dense"], [parsed[n] for n in CATEGORICAL],
                     spec, raw_ids)


def _features(label, dense, categorical, spec, raw_ids):
    """(features, label) of a batch: log1p counts, and hashed (or raw) categorical ids."""
    import tensorflow as tf

    features = {"dense": tf.math.log1p(tf.maximum(dense, 0.0))}
    for j, (name, values) in enumerate(zip(CATEGORICAL, categorical)):
        features[name] = (values if raw_ids else
                          tf.strings.to_hash_bucket_fast(values, spec.buckets[j]))
    return features, tf.expand_dims(label, 1)


def dataset(paths, batch_size, spec=CriteoSpec(), shuffle=True, repeat=True, seed=None,
            raw_ids=False):
    """A `tf.data.Dataset` of (features, label) batches from Criteo-layout files.

    `features` is `{"dense": float32 [B, 13] (log1p of counts), "C1".."C26":
    int64 [B] (hash bucket, or the raw id with `raw_ids`)}`; `label` is
    float32 [B, 1]. Files ending in `.tfrecord` are read as `generate(format="tfrecord")`
    wrote them, others as TSV lines (all `paths` of one kind).

    `shuffle`: True shuffles the files and the lines (for a stream: `repeat=True` and
    `fit(..., steps_per_epoch=...)`); "files" shuffles the file list only, which
    kfit_ps' one-pass epochs (`repeat=False`, no `steps_per_epoch`) turn into a new
    seeded order of batches each epoch, every line trained once (a shuffle of lines
    would give each worker its own order); False keeps the files' order.
    """
    import tensorflow as tf

    if shuffle not in (True, False, "files"):
        raise ValueError(f"dataset: `shuffle` must be True, False or 'files'. Received: "
                         f"shuffle={shuffle!r}.")
    paths = [os.fspath(path) for path in paths]
    kinds = {path.endswith(FORMATS["tfrecord"]) for path in paths}
    if len(kinds) != 1:
        raise ValueError(f"dataset: `paths` must all be TSV or all `.tfrecord` files. "
                         f"Received: {paths!r}.")
    tfrecord = kinds.pop()
    files = tf.data.Dataset.from_tensor_slices(paths)
    if shuffle:
        files = files.shuffle(len(paths), seed=seed)
    reader = tf.data.TFRecordDataset if tfrecord else tf.data.TextLineDataset
    records = files.interleave(reader, cycle_length=max(1, min(4, len(paths))))
    if shuffle is True:
        records = records.shuffle(16 * batch_size, seed=seed)
    if repeat:
        records = records.repeat()
    parse = parse_examples if tfrecord else parse_lines
    return records.batch(batch_size).map(
        lambda batch: parse(batch, spec, raw_ids),
        num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)
