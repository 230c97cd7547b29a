"""One-pass epochs: every training example exactly once, counted apart from the ledger.

Each example carries its index; the model's training step adds 1 to a
per-index counter on a ps (`helpers.counting_model`), so the tests count
what was trained independently of `kfit_ps.ledger`'s own report.
"""

import json
import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import kfit_ps
from tests import helpers

N, BATCH = 10_000, 256


@pytest.fixture(scope="module")
def model(strategy):
    with strategy.scope():
        model = helpers.counting_model(N)
        model.compile(optimizer="adam", loss="mse", steps_per_execution=5)
    return model


def _counts_after(model, fit):
    model.counts.assign(tf.zeros([N], tf.int32))
    history = fit()
    return model.counts.numpy(), history.history


def _dataset():
    (x, index), y = helpers.indexed_arrays(N)
    return tf.data.Dataset.from_tensor_slices(((x, index), y)).map(
        lambda f, t: (f, t)).batch(BATCH)


def test_a_finite_dataset_trains_every_example_once_per_epoch(model):
    counts, logs = _counts_after(model, lambda: model.fit(_dataset(), epochs=2, verbose=0))
    assert np.bincount(counts).tolist() == [0, 0, N]
    assert logs["ledger_splits"] == [8.0, 8.0]  # ceil(40 batches / 5)
    assert logs["ledger_splits_rerun"] == logs["ledger_splits_lost"] == [0.0, 0.0]
    assert logs["ledger_examples_rerun"] == [0.0, 0.0]
    reports = kfit_ps.ledger.reports(model)
    assert [r.trained_once for r in reports] == [8, 8]
    assert reports[0].batches == 40


def test_arrays_are_shuffled_and_trained_once_per_epoch(model):
    (x, index), y = helpers.indexed_arrays(N)
    counts, logs = _counts_after(model, lambda: model.fit(
        (x, index), y, batch_size=BATCH, epochs=3, verbose=0))
    assert np.bincount(counts).tolist() == [0, 0, 0, N]
    assert len(logs["loss"]) == 3 and logs["loss"][-1] < logs["loss"][0]


def test_a_dataset_creator_with_a_finite_dataset_is_one_pass(model):
    (x, index), y = helpers.indexed_arrays(N)

    def dataset_fn(context):
        return tf.data.Dataset.from_tensor_slices(((x, index), y)).batch(BATCH).prefetch(2)

    counts, logs = _counts_after(model, lambda: model.fit(
        kfit_ps.DatasetCreator(dataset_fn), epochs=1, verbose=0))
    assert np.bincount(counts).tolist() == [0, N]


@pytest.mark.parametrize("kind", ["tfrecord", "csv", "list_files", "tfrecord-gzip",
                                  "csv-gzip"])
def test_files_train_every_record_once_per_epoch(model, kind, tmp_path):
    """TFRecord files, CSV files with a header read by `interleave`, and TFRecord files of a
    shuffled `list_files` (a new order of batches each epoch), of uneven sizes (one empty,
    batches across file boundaries): each worker reads a batch from its first record's byte
    offset, and every record is trained once per epoch. GZIP-compressed TFRecord and CSV
    files (one empty) are whole-file splits: each file with a record is one split of its own
    batches, read from its start, whatever `steps_per_execution` (5) asks."""
    kind, _, compression = kind.partition("-")
    compression = compression.upper()
    paths = helpers.indexed_files(str(tmp_path), "csv" if kind == "csv" else "tfrecord",
                                  compression=compression)
    dataset = helpers.indexed_file_dataset(paths, BATCH, compression=compression)
    if kind == "list_files":
        dataset = helpers.indexed_file_dataset(
            tf.data.Dataset.list_files(str(tmp_path / "*.tfrecord")), BATCH)

    class Synced(kfit_ps.callbacks.SyncCallback):
        sync_every, steps = 5, []

        def on_train_sync(self, epoch, step, logs):
            self.steps.append((epoch, step))

    callbacks = [Synced()] if compression else []
    counts, logs = _counts_after(model, lambda: model.fit(dataset, epochs=2, verbose=0,
                                                          callbacks=callbacks))
    assert np.bincount(counts).tolist() == [0, 0, N]
    assert logs["ledger_splits_rerun"] == logs["ledger_splits_lost"] == [0.0, 0.0]
    reports = kfit_ps.ledger.reports(model)
    if not compression:
        assert logs["ledger_splits"] == [8.0, 8.0]  # ceil(40 batches / 5)
        return
    # 7 files with records: 7 splits of 12, 1, 17, 1, 10, 1 and 2 batches (ceil(records /
    # 256) each: no batch across files), where 5 batches a split would make 9 of 44.
    assert logs["ledger_splits"] == [7.0, 7.0]
    assert [(r.batches, r.trained_once) for r in reports] == [(44, 7), (44, 7)]
    # A synchronisation every 5 steps waits for the end of the file it falls in (splits end
    # at 12, 13, 30, 31, 41, 42, 44): never inside a split.
    assert Synced.steps == [(0, 12), (0, 30), (0, 41), (1, 12), (1, 30), (1, 31), (1, 41)]


@pytest.mark.parametrize("kind", ["tfrecord", "csv"])
def test_a_file_source_reads_each_batch_from_its_first_record(kind, tmp_path):
    paths = helpers.indexed_files(str(tmp_path), kind)
    source = kfit_ps.ledger.dataset_source(helpers.indexed_file_dataset(paths, BATCH), "x")
    assert isinstance(source, kfit_ps.ledger.FileSource)
    assert (source.num_batches, source.num_examples, source.batch_size) == (40, N, BATCH)
    data = tf.data.Dataset.from_tensors(source.tables)
    read = tf.function(lambda b: source.read(data, b, tf.constant(0, tf.int64)))
    batches = [read(tf.constant(b, tf.int64)) for b in range(source.num_batches)]
    assert [len(batch[1]) for batch in batches] == [BATCH] * 39 + [N - 39 * BATCH]
    (x, index), y = helpers.indexed_arrays(N)
    # The files' records in order, each with its own features and target.
    np.testing.assert_array_equal(np.concatenate([b[0][1] for b in batches]), index)
    np.testing.assert_array_equal(np.concatenate([b[0][0] for b in batches]), x)
    np.testing.assert_array_equal(np.concatenate([b[1] for b in batches]), y)
    assert source.examples_in(38, 5) == BATCH + N - 39 * BATCH


def test_compressed_files_are_whole_file_splits_of_their_own_batches(tmp_path, monkeypatch):
    """ZLIB-compressed TFRecord files of a shuffled `list_files` (`fit` over GZIP ones: above):
    each file with a record is one split of its own batches (its last short; with
    `drop_remainder` its last records untrained), read from its start, the files in a new
    order each epoch. The index holds each file's record count, kept beside the launcher's
    backup (a changed file is counted again)."""
    from kfit_ps import constants
    from kfit_ps.ledger import file_index

    paths = helpers.indexed_files(str(tmp_path / "data"), "tfrecord", compression="ZLIB")
    monkeypatch.setenv(constants.BACKUP_DIR_ENV, str(tmp_path / "backup"))
    files = tf.data.Dataset.list_files(str(tmp_path / "data" / "*"))
    make = lambda: kfit_ps.ledger.dataset_source(  # noqa: E731
        helpers.indexed_file_dataset(files, BATCH, compression="ZLIB"), "x")
    source = make()
    assert (source.num_batches, source.num_examples, source.shuffle) == (44, N, True)
    assert source.describe()["files"].startswith("8 ZLIB-compressed TFRecord files")
    bounds = np.cumsum([0] + [size for size in helpers.FILE_SIZES if size])  # Files' ids.
    data = tf.data.Dataset.from_tensors(source.tables)

    @tf.function
    def split(first, count, epoch):  # As `fit`'s function: `count` steps, one reader.
        next_batch = source.split_reader(data, first, epoch, count)
        ids = tf.TensorArray(tf.int64, size=0, dynamic_size=True, infer_shape=False)
        for j in tf.range(count):
            ids = ids.write(tf.cast(j, tf.int32), next_batch(j)[0][1])
        return ids.concat()

    def trained_order(epoch):
        """The files in the order `epoch`'s splits train them, each split one file whole."""
        splits, order = source.whole_splits(epoch), []
        for first, end in zip(splits.starts[:-1], splits.starts[1:]):
            ids = split(first, end - first, epoch).numpy()
            file = int(np.searchsorted(bounds, ids[0], "right")) - 1
            assert ids.tolist() == list(range(bounds[file], bounds[file + 1])), (epoch, file)
            assert end - first == -(-len(ids) // BATCH)  # The file's own batches.
            order.append(file)
        assert sorted(order) == list(range(7))
        return order

    orders = [trained_order(0), trained_order(1)]
    if orders[0] == orders[1]:  # By chance, for one seed (the paths') in 7! = 5,040.
        orders.append(trained_order(2))
    assert len({tuple(order) for order in orders}) > 1, orders
    splits = source.whole_splits(1)
    # A function started inside a file (never by `fit`) skips the batches before its first.
    longest = int(np.argmax(np.diff(splits.starts)))
    first, end = splits.starts[longest] + 3, splits.starts[longest + 1]
    file = orders[1][longest]
    assert split(first, end - first, 1).numpy().tolist() == list(
        range(bounds[file] + 3 * BATCH, bounds[file + 1]))

    dropping = kfit_ps.ledger.dataset_source(tf.data.TFRecordDataset(paths, "ZLIB").batch(
        BATCH, drop_remainder=True), "x")  # In the files' order (not shuffled).
    assert dropping.whole_splits(0).starts.tolist() == [0, 11, 27, 36, 37]
    assert dropping.num_examples == 37 * BATCH

    cached = os.listdir(tmp_path / "backup" / "file-index")
    assert len(cached) == 8, cached
    monkeypatch.setattr(file_index, "_cache", {})  # A restarted chief reads no file...

    def uncounted(count, path, kind, compression):
        raise AssertionError(f"{path} was read again")

    monkeypatch.setattr(file_index, "_count_records", uncounted)
    assert make().describe() == source.describe()  # ...but the counts beside the backup.
    stat = os.stat(paths[0])
    os.utime(paths[0], ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(AssertionError, match="part-00000.* was read again"):
        make()


def test_a_compression_type_given_as_a_tensor_reads_as_its_constant(tmp_path):
    """A `compression_type` given as a constant tensor (captured by the per-file function of
    `TFRecordDataset(files, ...)` or of `interleave`) is one compression for every file: GZIP
    files are whole-file splits, '' reads by record range (one computed per file: refused)."""
    gzipped = helpers.indexed_files(str(tmp_path / "gz"), "tfrecord", sizes=(300, 7),
                                    compression="GZIP")
    plain = helpers.indexed_files(str(tmp_path / "plain"), "tfrecord", sizes=(300, 7))
    gzip, none = tf.constant("GZIP"), tf.constant("")
    for dataset in [tf.data.TFRecordDataset(gzipped, compression_type=gzip),
                    tf.data.Dataset.from_tensor_slices(gzipped).interleave(
                        lambda path: tf.data.TFRecordDataset(path, gzip))]:
        source = kfit_ps.ledger.dataset_source(dataset.batch(BATCH), "x")
        assert source.describe()["files"].startswith("2 GZIP-compressed TFRecord files")
        assert source.whole_splits(0).starts.tolist() == [0, 2, 3]
    source = kfit_ps.ledger.dataset_source(
        tf.data.TFRecordDataset(plain, compression_type=none).batch(BATCH), "x")
    assert (source.whole_splits(0), source.num_batches) == (None, 2)


def test_steps_per_epoch_still_streams(model):
    stream = _dataset().repeat()
    counts, logs = _counts_after(model, lambda: model.fit(
        stream, epochs=1, steps_per_epoch=10, verbose=0))
    assert counts.sum() == 10 * BATCH
    assert "ledger_splits" not in logs


@pytest.mark.parametrize("make, fragments", [
    (lambda: _dataset().filter(lambda f, t: True),
     ["does not know how many batches", "unknown cardinality", "steps_per_epoch"]),
    (lambda: kfit_ps.DatasetCreator(lambda context: tf.data.Dataset.from_tensor_slices(
        helpers.indexed_arrays(N)).shuffle(100).batch(BATCH)),
     ["shuffles (ShuffleDataset", "shuffle=True", "steps_per_epoch"]),
    (lambda: _dataset().repeat(), ["`steps_per_epoch` is required", "infinite",
                                   "steps_per_epoch=None"]),
    (lambda: _dataset().take(0), ["has no batches", "cardinality 0"]),
])
def test_data_without_one_pass_epochs_is_refused_clearly(model, make, fragments):
    with pytest.raises(ValueError) as info:
        model.fit(make(), epochs=1, verbose=0)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_a_dataset_workers_cannot_address_is_shipped_one_pass_per_epoch(model, capsys):
    """A shuffling dataset (and one from a Python generator) is read by the chief and shipped,
    each batch once per epoch, in a new order each epoch; said once per `fit`. (Both were
    refused before: Keras scripts shuffle their datasets.)"""
    shuffled = tf.data.Dataset.from_tensor_slices(helpers.indexed_arrays(N)).shuffle(
        N).batch(BATCH)
    counts, logs = _counts_after(model, lambda: model.fit(shuffled, epochs=2, verbose=0))
    assert np.bincount(counts).tolist() == [0, 0, N]  # every example once per epoch
    assert "ledger_splits" not in logs and len(logs["loss"]) == 2
    said = capsys.readouterr().out
    assert said.count("is read on the coordinator and each batch shipped with its step "
                      "(it shuffles)") == 1, said
    (x, index), y = helpers.indexed_arrays(N)
    batches = lambda: (((x[i:i + BATCH], index[i:i + BATCH]), y[i:i + BATCH])  # noqa: E731
                       for i in range(0, N, BATCH))
    generated = tf.data.Dataset.from_generator(
        batches, output_signature=_dataset().element_spec).apply(
        tf.data.experimental.assert_cardinality(-(-N // BATCH)))
    counts, logs = _counts_after(model, lambda: model.fit(generated, epochs=1, verbose=0))
    assert np.bincount(counts).tolist() == [0, N]
    # A Python generator is this process's: workers cannot run a copy of it.
    assert "(it uses state of this process: a variable or a Python function)" in \
        capsys.readouterr().out


# 200,000 indexed examples, batch 256, 5 steps per function, 2 workers; a first epoch without
# failures, then one with 5 SIGKILLs of workers at seeded random points, each killed worker
# restarted. The kills wait for training progress, so all 5 land inside the epoch. Then, on
# the same cluster, the same over 8 TFRecord files and over 8 CSV files
# (`helpers.indexed_files`: 10,000 records, uneven, one file empty), batch 32: one epoch each,
# with 5 seeded worker SIGKILLs.
KILLED_EPOCH = """
import random, tempfile
from tests import chaos, helpers as h

N, BATCH = 200_000, 256
(x, index), y = h.indexed_arrays(N)
rng = random.Random(2026)
with kfit_ps.LocalCluster(num_workers=2, num_ps=1) as cluster:
    strategy = kfit_ps.ParameterServerStrategy(cluster.cluster_resolver)
    dataset = tf.data.Dataset.from_tensor_slices(((x, index), y)).batch(BATCH)
    with strategy.scope():
        model = h.counting_model(N, saved=False)
        model.compile(optimizer="adam", loss="mse", steps_per_execution=5)
    clean = model.fit(dataset, epochs=1, verbose=0).history
    clean_counts = model.counts.numpy()
    killed = chaos.killed_one_pass_epoch(cluster, model, dataset, rng, 40, -(-N // BATCH) - 200)
    files = {}
    for kind in ("tfrecord", "csv"):  # Records 0..9,999: the first 10,000 counts.
        records = h.indexed_file_dataset(h.indexed_files(tempfile.mkdtemp(), kind), 32)
        run = chaos.killed_one_pass_epoch(cluster, model, records, rng, 20, -(-10_000 // 32) - 60)
        assert not any(run["counts"][10_000:])
        files[kind] = dict(run, counts=run["counts"][:10_000])
    report(clean=clean, clean_counts=np.bincount(clean_counts).tolist(), pids=cluster.pids(),
           files=files, **killed)
os._exit(0)
"""


@pytest.mark.chaos
@pytest.mark.slow
def test_five_worker_kills_lose_no_example_and_the_ledger_names_the_retrained():
    """Arrays, then TFRecord and CSV files on the same cluster (merged into this test:
    test_five_worker_kills_over_files_lose_no_record_and_the_ledger_names_the_retrained)."""
    result = helpers.run_chief(KILLED_EPOCH, timeout=600)
    n, batch = 200_000, 256
    # Without failures: every example exactly once.
    assert result["clean_counts"] == [0, n]
    assert result["clean"]["ledger_splits_rerun"] == [0.0]
    _check_killed_epoch(result, n, batch)
    assert sorted(result["files"]) == ["csv", "tfrecord"]
    for run in result["files"].values():
        _check_killed_epoch(run, 10_000, 32)
    assert helpers.wait_for_no_servers(result["pids"], timeout=10) == []


def _check_killed_epoch(run, n, batch, spe=5, kills=5):
    """A one-pass epoch of `n` examples (batches of `batch`, `spe` per function) with `kills`
    worker SIGKILLs in it: none lost, counted apart from the ledger (`run["counts"]`)."""
    assert len(run["kills"]) == kills, run["kills"]
    assert all(at < -(-n // batch) for _, at in run["kills"]), run["kills"]  # in the fit
    counts = np.asarray(run["counts"])
    assert counts.min() >= 1
    assert run["lost"] == 0 and run["killed"]["ledger_splits_lost"] == [0.0]
    assert run["splits"] == -(-(-(-n // batch)) // spe)
    # Examples trained more than once lie in splits the ledger reports as re-run, at most
    # once per extra start, and those are at most a split (spe x batch examples) per kill.
    allowed = np.ones(n, np.int64)
    for first, batches, starts, examples in run["reruns"]:
        assert examples == min((first + batches) * batch, n) - first * batch
        allowed[first * batch:first * batch + examples] = starts
    assert (counts <= allowed).all(), np.flatnonzero(counts > allowed)[:20]
    retrained = int((counts > 1).sum())
    reported = sum(examples * (starts - 1) for _, _, starts, examples in run["reruns"])
    assert retrained <= reported <= kills * spe * batch
    assert run["killed"]["ledger_examples_rerun"] == [float(reported)]
    assert run["killed"]["ledger_splits_rerun"] == [float(len(run["reruns"]))]
    assert run["once"] + len(run["reruns"]) == run["splits"]


def test_array_epochs_are_different_permutations_of_every_example():
    (x, index), y = helpers.indexed_arrays(1000)
    source = kfit_ps.ledger.ArraySource(((x, index), y), 1000, 64, shuffle=True, seed=7)
    data = tf.data.Dataset.from_tensors(source.arrays)
    orders = []
    for epoch in range(2):
        batches = [source.read(data, tf.constant(b, tf.int64), tf.constant(epoch, tf.int64))
                   for b in range(source.num_batches)]
        order = np.concatenate([batch[0][1].numpy() for batch in batches])
        assert sorted(order.tolist()) == list(range(1000))
        assert [len(batch[1]) for batch in batches] == [64] * 15 + [40]
        # Each example keeps its own features and target.
        np.testing.assert_array_equal(np.concatenate([b[0][0].numpy() for b in batches]),
                                      x[order])
        orders.append(order)
    assert (orders[0] != orders[1]).mean() > 0.9
    assert source.examples_in(14, 5) == 64 + 40
    unshuffled = kfit_ps.ledger.ArraySource(((x, index), y), 1000, 64, shuffle=False)
    first = unshuffled.read(data, tf.constant(3, tf.int64), tf.constant(1, tf.int64))
    assert first[0][1].numpy().tolist() == list(range(192, 256))


def test_a_backup_resumes_only_on_the_same_data(model, tmp_path):
    (x, index), y = helpers.indexed_arrays(N)
    backup = str(tmp_path / "backup")

    def fit(examples, epochs, checkpoint=None, **kwargs):
        callbacks = [kfit_ps.callbacks.BackupAndRestore(backup, delete_checkpoint=False)]
        if checkpoint:
            callbacks.append(kfit_ps.callbacks.ModelCheckpoint(checkpoint,
                                                               save_weights_only=True))
        return model.fit((x[:examples], index[:examples]), y[:examples], batch_size=BATCH,
                         epochs=epochs, verbose=0, callbacks=callbacks, **kwargs)

    checkpoint = str(tmp_path / "ckpt.weights.h5")
    fit(N, 1, checkpoint=checkpoint)  # leaves a backup at the end of epoch 1, with the counts
    saved = model.counts.numpy()
    with open(checkpoint + ".kfit_ps.json") as f:  # the data's shape, order and content
        recorded = json.load(f)["ledger"]
    fingerprint = recorded.pop("fingerprint")
    assert len(fingerprint) == 8 and recorded.pop("seed") >= 0
    assert recorded == {"kind": "arrays", "batches": 40, "examples": N, "batch_size": BATCH,
                        "shuffle": True}
    logs = fit(N, 2).history  # restores them and trains epoch 2 only
    assert (model.counts.numpy() == saved + 1).all()
    assert logs["ledger_splits"] == [8.0, 8.0]  # epoch 1 from the backup's History, epoch 2
    with pytest.raises(ValueError) as info:
        fit(N - 1000, 3)
    assert "written while training on other data" in str(info.value)
    assert "one-pass epochs of 40 batches (10000 examples of arrays" in str(info.value)
    assert "this fit trains one-pass epochs of 36 batches (9000 examples" in str(info.value)
    with pytest.raises(ValueError) as info:
        fit(N, 3, steps_per_epoch=4)
    assert "this fit trains a stream (`steps_per_epoch` batches per epoch)" in str(info.value)
    with pytest.raises(ValueError) as info:  # Another order: other examples after the split.
        fit(N, 3, shuffle=False)
    assert "shuffled with seed" in str(info.value) and "not shuffled" in str(info.value)
    x[0, 0] += 1.0  # Same shape, other content (a sampled row: the first).
    with pytest.raises(ValueError) as info:
        fit(N, 3)
    assert str(info.value).count("content fingerprint") == 2, str(info.value)
    assert f"content fingerprint {fingerprint}" in str(info.value)


def test_a_shuffled_file_list_trains_a_new_seeded_order_of_batches_each_epoch(tmp_path):
    paths = helpers.indexed_files(str(tmp_path), "tfrecord")
    pattern = str(tmp_path / "*.tfrecord")
    source = kfit_ps.ledger.dataset_source(helpers.indexed_file_dataset(
        tf.data.Dataset.list_files(pattern), BATCH), "x")
    assert source.shuffle and source.files == sorted(paths)
    data = tf.data.Dataset.from_tensors(source.tables)
    read = tf.function(lambda b, e: source.read(data, b, e)[0][1])
    orders = [np.concatenate([read(tf.constant(b, tf.int64), tf.constant(e, tf.int64))
                              for b in range(source.num_batches)]) for e in (0, 1)]
    for order in orders:
        assert sorted(order.tolist()) == list(range(N))
        # Whole batches of the files' order move; the short last one stays last.
        assert order[-(N % BATCH):].tolist() == list(range(N - N % BATCH, N))
        assert all(order[i + 1] == order[i] + 1 for i in range(0, N - 1) if (i + 1) % BATCH)
    # The seed follows from the files' paths (tmp_path's), so this holds for any seed: in two
    # random orders of the 39 whole batches about one keeps its place (Poisson(1)); 10 or more
    # would be a 1e-7 chance.
    starts = [order[:N - N % BATCH:BATCH] for order in orders]
    assert (starts[0] == starts[1]).sum() < 10, starts
    # The same order in a restarted chief (another source of the same files).
    again = kfit_ps.ledger.dataset_source(helpers.indexed_file_dataset(
        tf.data.Dataset.list_files(pattern, shuffle=True), BATCH), "x")
    assert again.seed == source.seed and again.describe() == source.describe()
    records = tf.data.TFRecordDataset(paths)
    with pytest.raises(ValueError, match=r"it shuffles its records or batches \(ShuffleDataset"):
        kfit_ps.ledger.dataset_source(records.shuffle(100).batch(BATCH), "x")


@pytest.mark.parametrize("kind, compression", [("tfrecord", ""), ("csv", ""),
                                               ("tfrecord", "GZIP")])
def test_a_split_shuffle_mixes_each_splits_records_and_keeps_every_record_once(
        model, tmp_path, kind, compression):
    """`kfit_ps.ledger.split_shuffle(dataset, buffer_size)`: a split's records (5 batches; a
    compressed file) in a seeded order of their own per epoch, the same on a re-run, the
    split's records unchanged; `fit` trains every record once per epoch."""
    paths = helpers.indexed_files(str(tmp_path), kind, compression=compression)
    dataset = helpers.indexed_file_dataset(paths, BATCH, compression=compression)
    plain = kfit_ps.ledger.dataset_source(dataset, "x")
    shuffled = kfit_ps.ledger.split_shuffle(dataset, 1000, seed=7)
    source = kfit_ps.ledger.dataset_source(dataset, "x", split_shuffle=shuffled)
    assert source.describe() == dict(plain.describe(),
                                     split_shuffle={"buffer_size": 1000, "seed": 7})
    data = tf.data.Dataset.from_tensors(source.tables)

    @tf.function
    def split(source, first, count, epoch):
        next_batch = source.split_reader(data, first, epoch, count)
        return tf.concat([next_batch(j)[0][1] for j in range(count)], 0)

    starts = (plain.whole_splits(0).starts[:2] if compression else [0, 5])
    first, count = int(starts[0]), int(starts[1] - starts[0])
    order = split(plain, first, count, 0).numpy()
    mixed = [split(source, first, count, e).numpy() for e in (0, 0, 1)]
    assert sorted(mixed[0]) == sorted(order)
    assert len(set(order)) == plain.examples_in(first, count)
    assert (mixed[0] != order).mean() > 0.9  # mixed across the split's batches
    assert (mixed[0] == mixed[1]).all() and (mixed[0] != mixed[2]).mean() > 0.9
    keras.utils.set_random_seed(0)  # TensorFlow's global seed plays no part in the order.
    assert (split(source, first, count, 0).numpy() == mixed[0]).all()
    # A backup records the shuffle; a resume with another seed is refused, naming both.
    other = kfit_ps.ledger.dataset_source(dataset, "x", split_shuffle=kfit_ps.ledger.
                                          split_shuffle(dataset, 1000, seed=8))
    from kfit_ps.training.callbacks import backup_and_restore as backups
    assert not backups._same_data(source.describe(), other.describe())
    assert "buffer 1000, seed 7" in backups._data_kind(source.describe())
    counts, logs = _counts_after(model, lambda: model.fit(shuffled, epochs=2, verbose=0))
    assert (counts == 2).all() and logs["ledger_splits_lost"] == [0, 0]
    with pytest.raises(ValueError, match="`steps_per_epoch` streams"):
        model.fit(shuffled, epochs=1, steps_per_epoch=3, verbose=0)


def test_a_split_shuffle_is_only_for_file_pipelines_in_fit(model):
    with pytest.raises(ValueError, match="another source"):
        model.fit(kfit_ps.ledger.split_shuffle(_dataset(), 100), epochs=1, verbose=0)
    with pytest.raises(ValueError, match="shuffles training data"):
        model.evaluate(kfit_ps.ledger.split_shuffle(_dataset(), 100), verbose=0)
    with pytest.raises(ValueError, match="buffer_size=1"):
        kfit_ps.ledger.split_shuffle(_dataset(), 1)


def test_a_split_shuffle_buffer_holds_at_most_a_splits_records(tmp_path):
    """A buffer larger than the split (5 batches) shuffles the split alone, with the memory
    of the split's records (TensorFlow reserves the whole buffer when it starts)."""
    paths = helpers.indexed_files(str(tmp_path), "tfrecord")
    dataset = helpers.indexed_file_dataset(paths, BATCH)
    source = kfit_ps.ledger.dataset_source(
        dataset, "x", split_shuffle=kfit_ps.ledger.split_shuffle(dataset, 1 << 40))
    data = tf.data.Dataset.from_tensors(source.tables)

    @tf.function
    def split():
        next_batch = source.split_reader(data, 5, 0, 5)
        return tf.concat([next_batch(j)[0][1] for j in range(5)], 0)

    assert sorted(split().numpy()) == list(range(5 * BATCH, 10 * BATCH))


def test_text_batches_hold_exactly_the_lines_textlinedataset_reads(tmp_path):
    """Empty lines, "\\r" anywhere (TextLineDataset removes each), a last line without a
    newline (followed by another file), a file of only "\\r" (no line), empty files."""
    contents = [b"a\r\n\r\nb", b"\r", b"", b"c\nd\n\r\n", b"\n", b"e\rf", b"\r\r\n\r"]
    paths = []
    for i, content in enumerate(contents):
        paths.append(str(tmp_path / f"{i}.txt"))
        with open(paths[-1], "wb") as f:
            f.write(content)
    expected = list(tf.data.TextLineDataset(paths).as_numpy_iterator())
    assert expected == [b"a", b"", b"b", b"c", b"d", b"", b"", b"ef", b""]
    for batch_size in (1, 2, 4):
        source = kfit_ps.ledger.dataset_source(
            tf.data.TextLineDataset(paths).batch(batch_size), "x")
        assert source.num_examples == len(expected)
        data = tf.data.Dataset.from_tensors(source.tables)
        zero = tf.constant(0, tf.int64)
        read = tf.function(lambda b: source.read(data, b, zero))
        one_by_one = [read(tf.constant(b, tf.int64)).numpy() for b in range(source.num_batches)]
        assert np.concatenate(one_by_one).tolist() == expected, batch_size


def test_a_truncated_tfrecord_file_is_refused_naming_it(tmp_path):
    paths = helpers.indexed_files(str(tmp_path), "tfrecord", sizes=(3, 2))
    with open(paths[1], "ab") as f:
        f.write(b"\x05\x00\x00")  # 3 bytes: less than a record header
    with pytest.raises(ValueError, match=f"{paths[1]} is not a TFRecord file .* its record "
                                         "headers end at byte"):
        kfit_ps.ledger.dataset_source(helpers.indexed_file_dataset(paths, 4), "x")


def test_a_backup_over_files_resumes_only_on_the_same_files(model, tmp_path):
    """A backup records the files (names, sizes, modification times): a resume after one
    of them changed is refused, naming both; unchanged, it trains the next epoch only."""
    paths = helpers.indexed_files(str(tmp_path / "data"), "tfrecord")
    backup = str(tmp_path / "backup")

    def fit(epochs):
        return model.fit(helpers.indexed_file_dataset(paths, BATCH), epochs=epochs, verbose=0,
                         callbacks=[kfit_ps.callbacks.BackupAndRestore(
                             backup, delete_checkpoint=False)])

    model.counts.assign(tf.zeros([N], tf.int32))
    fit(1)
    saved = model.counts.numpy()
    assert fit(2).history["ledger_splits"] == [8.0, 8.0]  # epoch 2 only, then the History's
    assert (model.counts.numpy() == saved + 1).all()
    before = tf.io.gfile.stat(paths[3])  # Its modification time: to the second.
    stat = os.stat(paths[3])
    os.utime(paths[3], ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # same bytes
    with pytest.raises(ValueError) as info:
        fit(3)
    message = str(info.value)
    size, mtime = before.length, before.mtime_nsec
    assert "written while training on other data" in message
    kind = "examples of files, batch size 256, not shuffled, 8 TFRecord files"
    assert message.count(kind) == 2, message
    assert f"The first file that differs: {paths[3]} (size {size}, modified {mtime} ns) in " \
        f"the backup, {paths[3]} (size {size}, modified {mtime + 10**9} ns) now." in message
    assert message.count("content fingerprint") == 2 and len(set(re.findall(
        r"content fingerprint (\w+)", message))) == 2, message


def test_the_file_index_is_kept_beside_the_launchers_backup_and_read_back(tmp_path,
                                                                         monkeypatch):
    """Under `kfit-ps run --backup-dir`, a restarted chief reads each file's index from the
    backup folder instead of the file; a file that changed is indexed again."""
    from kfit_ps import constants
    from kfit_ps.ledger import file_index

    paths = helpers.indexed_files(str(tmp_path / "data"), "csv", sizes=(300, 0, 7))
    monkeypatch.setenv(constants.BACKUP_DIR_ENV, str(tmp_path / "backup"))
    first = kfit_ps.ledger.dataset_source(helpers.indexed_file_dataset(paths, 64), "x")
    cached = sorted(os.listdir(tmp_path / "backup" / "file-index"))
    assert len(cached) == 3 and all(name.endswith(".npz") for name in cached), cached
    monkeypatch.setattr(file_index, "_cache", {})  # As in a restarted chief...

    def unread(path, size):
        raise AssertionError(f"{path} was read again")

    monkeypatch.setattr(file_index, "_line_offsets", unread)  # ...that reads no file.
    again = kfit_ps.ledger.dataset_source(helpers.indexed_file_dataset(paths, 64), "x")
    np.testing.assert_array_equal(again.tables["batch_offset"], first.tables["batch_offset"])
    assert again.describe() == first.describe()
    stat = os.stat(paths[0])
    os.utime(paths[0], ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(AssertionError, match="part-00000.csv was read again"):
        kfit_ps.ledger.dataset_source(helpers.indexed_file_dataset(paths, 64), "x")
    # An emptied cache file (a crash before its data reached the disk) is indexed again.
    os.utime(paths[0], ns=(stat.st_atime_ns, stat.st_mtime_ns))
    monkeypatch.setattr(file_index, "_cache", {})
    for name in cached:
        open(tmp_path / "backup" / "file-index" / name, "wb").close()
    with pytest.raises(AssertionError, match="was read again"):
        kfit_ps.ledger.dataset_source(helpers.indexed_file_dataset(paths, 64), "x")


def test_other_compressions_and_record_filters_are_refused_with_the_reason(model, tmp_path):
    paths = helpers.indexed_files(str(tmp_path), "tfrecord", sizes=(10, 20))
    gzipped = helpers.indexed_files(str(tmp_path), "tfrecord", sizes=(3,), compression="GZIP")
    per_file = lambda path: tf.data.TFRecordDataset(path, tf.where(  # noqa: E731
        tf.strings.regex_full_match(path, ".*gz"), "GZIP", ""))
    for dataset, reasons in [
            (tf.data.TFRecordDataset(paths, compression_type="SNAPPY").batch(4),
             ["compression_type is 'SNAPPY'", "Received: compression_type='SNAPPY'",
              "with GZIP or ZLIB, and pass that compression_type", "steps_per_epoch"]),
            (tf.data.Dataset.from_tensor_slices(paths + gzipped).interleave(per_file).batch(4),
             ["`compression_type` is computed per file (by the per-file function)",
              "Received: compression_type=<a tensor", "Pass one constant compression_type",
              "steps_per_epoch"]),
            (tf.data.TFRecordDataset(paths, compression_type="GZIP").batch(4),
             [f"{paths[0]} cannot be read as a GZIP-compressed TFRecord file",
              "Received: compression_type='GZIP'", "Pass the compression its files were"]),
            (tf.data.TFRecordDataset(gzipped).batch(4),
             [f"{gzipped[0]} is not a TFRecord file (or it is compressed",
              "Received: compression_type='' (none)", "compression_type='GZIP'"]),
            (tf.data.TFRecordDataset(paths).filter(lambda r: True).batch(4),
             ["it has a FilterDataset where a file reader", "steps_per_epoch"]),
            (tf.data.Dataset.from_tensor_slices(paths).batch(2).flat_map(
                tf.data.TFRecordDataset).batch(4),
             ["is not one file name per element", "steps_per_epoch"])]:
        with pytest.raises(ValueError) as info:
            model.fit(dataset, epochs=1, verbose=0)
        for reason in reasons:
            assert reason in str(info.value), str(info.value)


# Shuffled arrays, stopped by SIGTERM mid-epoch (a backup at the step reached), then resumed
# by a second `fit`: the resumed epoch draws the same permutation, so its remaining splits are
# exactly the untrained examples.
RESUMED_SHUFFLED_EPOCH = """
import signal
from kfit_ps.training.resilience import preemption
from tests import helpers as h

N = 10_000
preemption.install()
(x, index), y = h.indexed_arrays(N)
with kfit_ps.LocalCluster(num_workers=2, num_ps=1) as cluster:
    strategy = kfit_ps.ParameterServerStrategy(cluster.cluster_resolver)
    with strategy.scope():
        model = h.counting_model(N)
        model.compile(optimizer="adam", loss="mse", steps_per_execution=5)

    class Stop(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 20:
                os.kill(os.getpid(), signal.SIGTERM)

    def fit(*callbacks):
        backup = kfit_ps.callbacks.BackupAndRestore(sys.argv[1], save_freq=10)
        return model.fit((x, index), y, batch_size=256, epochs=1, verbose=1,
                         callbacks=[backup, *callbacks])

    try:
        fit(Stop())
        stopped = False
    except kfit_ps.errors.Preempted:
        stopped = True
    preemption.reset()
    partial = np.bincount(model.counts.numpy()).tolist()
    logs = fit().history
    report(stopped=stopped, partial=partial, counts=np.bincount(model.counts.numpy()).tolist(),
           logs=logs)
os._exit(0)
"""


@pytest.mark.slow
def test_a_shuffled_epoch_stopped_by_sigterm_resumes_with_its_untrained_examples(tmp_path):
    code = RESUMED_SHUFFLED_EPOCH.replace("sys.argv[1]", repr(str(tmp_path / "backup")))
    result = helpers.run_chief(code, timeout=300)
    assert result["stopped"], result["_stdout"][-2000:]
    trained = result["partial"][1]
    assert 0 < trained < N and trained % (5 * 256) == 0
    assert f"resuming one-pass epoch 1 at batch {trained // 256} of 40" in result["_stdout"]
    assert result["counts"] == [0, N]
    assert result["logs"]["ledger_splits_lost"] == [0.0]


def test_a_fingerprint_reads_the_values_of_strings_not_their_addresses():
    """Arrays of strings (object arrays) fingerprint by their values: the same text in another
    process (other objects) resumes; other text does not."""
    from kfit_ps.ledger import sources

    words = np.array([f"word {i}" for i in range(100)], dtype=object)
    again = np.array(["".join(["word ", str(i)]) for i in range(100)], dtype=object)
    assert words[3] is not again[3]
    assert sources._fingerprint(words) == sources._fingerprint(again)
    again[50] = "another word"
    assert sources._fingerprint(words) != sources._fingerprint(again)


def test_the_ledger_counts_splits_never_finished_as_lost(strategy):
    (x, index), y = helpers.indexed_arrays(1000)
    source = kfit_ps.ledger.ArraySource(((x, index), y), 1000, 64, shuffle=False)
    ledger = kfit_ps.ledger.Ledger(source, strategy, split_size=5)  # 16 batches
    ledger.begin_epoch(0, first_batch=0)
    ledger.dispatched(0, [5, 5, 5, 1])
    ledger.joined(dropped=[2, 3])  # the two newest never started: batches 10..15
    report = ledger.end_epoch()
    assert (report.splits, report.lost, report.reruns) == (2, 2, ())
    assert report.logs()["ledger_splits_lost"] == 2.0
    ledger.begin_epoch(1, first_batch=10)  # resumed: batches before 10 were trained before
    ledger.dispatched(10, [5, 1])
    ledger.joined()
    assert ledger.end_epoch().lost == 0


SHIPPED_WITH_KILLS = """
import threading
from tests import helpers as h

N, BATCH = 20_000, 64
with kfit_ps.LocalCluster(num_workers=2, num_ps=1) as cluster:
    strategy = kfit_ps.ParameterServerStrategy(cluster.cluster_resolver)
    shuffled = tf.data.Dataset.from_tensor_slices(h.indexed_arrays(N)).shuffle(N).batch(BATCH)
    with strategy.scope():
        model = h.counting_model(N)
        model.compile(optimizer="adam", loss="mse", steps_per_execution=2,
                      metrics=[h.counting_metric()])
    kills = []

    class Kill(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch in (40, 200) and len(kills) < 2 and batch not in kills:
                kills.append(batch)
                index = len(kills) % 2
                cluster.kill("worker", index)
                threading.Timer(0.5, cluster.restart, ("worker", index)).start()

    history = model.fit(shuffled, epochs=1, verbose=0, callbacks=[Kill()])
    report(counts=np.bincount(model.counts.numpy()).tolist(), kills=kills,
           batches=history.history["batches"],
           iterations=int(model.optimizer.iterations.numpy()))
os._exit(0)
"""


@pytest.mark.chaos
@pytest.mark.slow
def test_a_shipped_epoch_with_workers_killed_trains_every_example(tmp_path):
    """A shuffling dataset is shipped; two workers are SIGKILLed mid-epoch (and restarted):
    every example is trained, those trained twice lie within the functions in flight on the
    killed workers (TensorFlow re-runs them), and the epoch's metrics count each batch once."""
    result = helpers.run_chief(SHIPPED_WITH_KILLS, timeout=300)
    counts, batches = result["counts"], -(-20_000 // 64)
    assert result["kills"] == [40, 200]
    assert counts[0] == 0  # none lost
    assert sum(counts[2:]) <= 2 * 2 * 64, counts  # at most one function (2 batches) per kill
    assert result["batches"] == [float(batches)]  # metrics exactly once per batch
    assert batches <= result["iterations"] <= batches + 2 * 2
