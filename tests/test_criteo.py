"""The Criteo-shaped generator and reader, and the DLRM model of the main job."""

import collections

import numpy as np
import pytest
import tensorflow as tf

from kfit_ps.data import criteo


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return criteo.generate(str(tmp_path_factory.mktemp("criteo")), rows=20_000, files=2,
                           spec=criteo.CriteoSpec(scale=1e-3))


def test_files_have_criteo_layout(files):
    lines = [line.rstrip("\n").split("\t") for f in files for line in open(f)]
    assert len(lines) == 20_000
    assert all(len(fields) == 1 + 13 + 26 for fields in lines)
    assert {fields[0] for fields in lines} == {"0", "1"}
    values = [v for fields in lines for v in fields[14:] if v]
    assert all(len(v) == 8 and int(v, 16) >= 0 for v in values[:5000])
    missing = sum(1 for fields in lines for v in fields[1:] if v == "") / (len(lines) * 39)
    assert 0.02 < missing < 0.04  # 3 % of fields are empty, as in real logs


def test_ids_are_zipf_and_bounded_by_the_scaled_cardinalities(files):
    spec = criteo.CriteoSpec(scale=1e-3)
    column = [line.split("\t")[14 + 2] for f in files for line in open(f)]  # C3: 10131 values
    counts = collections.Counter(v for v in column if v)
    assert len(counts) <= spec.cardinalities[2] == 10131
    top = counts.most_common(1)[0][1] / sum(counts.values())
    assert top > 0.15  # Zipf(1.2) head: 1/zeta(1.2) = 0.18, far above 1/10131
    assert len(counts) > 500  # and a long tail


def test_reader_parses_generated_and_real_style_lines(files):
    spec = criteo.CriteoSpec(scale=1e-3)
    features, labels = next(iter(criteo.dataset(files, 64, spec, shuffle=False)))
    assert features["dense"].shape == (64, 13) and features["dense"].dtype == tf.float32
    assert labels.shape == (64, 1)
    for j, name in enumerate(criteo.CATEGORICAL):
        assert features[name].dtype == tf.int64
        assert int(tf.reduce_max(features[name])) < spec.buckets[j]
    # A line as in the Kaggle release, with empty integer and categorical fields.
    real = "1\t1\t\t5\t0\t1382\t4\t15\t2\t181\t1\t2\t\t2\t68fd1e64" + "\t" * 25 + "\n"
    parsed, label = criteo.parse_lines(tf.constant([real.rstrip("\n")]), spec)
    assert float(label[0, 0]) == 1.0
    np.testing.assert_allclose(parsed["dense"].numpy()[0, :3], np.log1p([1, 0, 5]), rtol=1e-6)


@pytest.mark.parametrize("raw_ids", [False, True])
def test_the_tfrecord_variant_reads_as_the_same_batches(tmp_path, raw_ids):
    """`generate(format="tfrecord")` writes the TSV rows of the same seed as Examples;
    `dataset()` reads them to the same features and labels."""
    spec = criteo.CriteoSpec(scale=1e-3)
    tsv = criteo.generate(str(tmp_path / "tsv"), 3000, spec, files=2, raw_ids=raw_ids)
    tfrecord = criteo.generate(str(tmp_path / "tfrecord"), 3000, spec, files=2,
                               raw_ids=raw_ids, format="tfrecord")
    assert [p.rsplit(".", 1)[1] for p in tsv + tfrecord] == ["tsv"] * 2 + ["tfrecord"] * 2
    batches = [list(criteo.dataset(paths, 1000, spec, shuffle=False, repeat=False,
                                   raw_ids=raw_ids)) for paths in (tsv, tfrecord)]
    assert len(batches[0]) == len(batches[1]) == 3
    for (features, labels), (other, other_labels) in zip(*batches):
        np.testing.assert_array_equal(labels, other_labels)
        assert features.keys() == other.keys()
        for name in features:
            np.testing.assert_array_equal(features[name], other[name], err_msg=name)
    with pytest.raises(ValueError, match="must all be TSV or all"):
        criteo.dataset(tsv[:1] + tfrecord[:1], 10, spec)


def test_labels_carry_a_learnable_signal(files):
    spec = criteo.CriteoSpec(scale=1e-3)
    lines = [line.split("\t") for line in open(files[0])]
    labels = np.array([int(f[0]) for f in lines])
    assert 0.2 < labels.mean() < 0.6
    # The most frequent C1 value has a click rate far from the others' (the hidden weight).
    c7 = np.array([f[14 + 6] for f in lines])
    rates = [labels[c7 == v].mean() for v, n in collections.Counter(c7).most_common(4) if v]
    assert max(rates) - min(rates) > 0.1
    assert spec.cardinalities[6] == 13


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="scale=2"):
        criteo.CriteoSpec(scale=2)
    with pytest.raises(ValueError, match="rows=0"):
        criteo.generate(str(tmp_path), rows=0)
    with pytest.raises(ValueError, match="format='csv'"):
        criteo.generate(str(tmp_path), rows=10, format="csv")
    with pytest.raises(ValueError, match="shuffle='lines'"):
        criteo.dataset([], 10, shuffle="lines")


def test_dlrm_saves_and_loads_with_its_custom_layers(files, tmp_path):
    import keras

    from kfit_ps.jobs.dlrm import build_dlrm

    spec = criteo.CriteoSpec(scale=1e-3)
    model = build_dlrm(spec, embedding_dim=4)
    features, _ = next(iter(criteo.dataset(files, 16, spec, shuffle=False)))
    expected = model.predict(features, verbose=0)
    model.save(str(tmp_path / "dlrm.keras"))
    loaded = keras.models.load_model(str(tmp_path / "dlrm.keras"))
    np.testing.assert_allclose(loaded.predict(features, verbose=0), expected, rtol=1e-6)
    assert expected.shape == (16, 1)


def test_raw_ids_grow_over_time_and_read_back_as_int64(tmp_path):
    spec = criteo.CriteoSpec(scale=1e-3)
    paths = criteo.generate(str(tmp_path), rows=20_000, files=4, spec=spec, raw_ids=True,
                            growth=3.0)
    columns = [[int(line.split("\t")[14 + 2] or -1) for line in open(p)] for p in paths]
    assert max(columns[0]) < spec.cardinalities[2] * 1.75  # C3 at a quarter of the way
    assert max(columns[-1]) > spec.cardinalities[2] * 2.5  # ... and at its end: new ids
    first = set(columns[0])
    assert len(set(columns[-1]) - first) > 1000  # the last period brings unseen ids
    features, _ = next(iter(criteo.dataset(paths[-1:], 50_000, spec, shuffle=False,
                                           repeat=False, raw_ids=True)))
    assert features["C3"].dtype == tf.int64
    assert sorted(set(features["C3"].numpy().tolist())) == sorted(set(columns[-1]))
    with pytest.raises(ValueError, match="growth"):
        criteo.generate(str(tmp_path / "x"), rows=10, growth=-1)
