"""The embedded digits dataset (cct.data.digits, cct/data/digits.npz), its
LMDB writer, and the LeNet model files that read it."""
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

import cct
from cct.core.errors import DataError
from cct.data import digits
from cct.data.digits import convert_arrays_to_lmdb
from cct.proto import caffe_pb2
from helpers.data import read_db, read_with_data_layer
from helpers.paths import MODELS

LENET = MODELS / "lenet"
RNG = np.random.default_rng(9)


def test_embedded_sources():
    images, labels = digits.load_source_digits()
    assert images.shape == (1797, 8, 8) and images.dtype == np.uint8
    assert labels.shape == (1797,) and set(labels.tolist()) == set(range(10))
    assert images.max() == 16 and images.min() == 0
    assert np.bincount(labels).min() >= 170


def test_split_is_disjoint_stratified_and_seeded():
    _, labels = digits.load_source_digits()
    train, test = digits.split_sources(labels, seed=3)
    assert not set(train) & set(test) and len(train) + len(test) == 1797
    for digit in range(10):
        share = np.sum(labels[test] == digit) / np.sum(labels == digit)
        assert abs(share - 0.2) < 0.01
    again = digits.split_sources(labels, seed=3)
    np.testing.assert_array_equal(train, again[0])


@pytest.fixture(scope="module")
def small_set():
    return digits.make_digits(train_count=205, test_count=100, seed=7)


def test_rendered_shapes_balance_and_ink(small_set):
    train_x, train_y, test_x, test_y = small_set
    assert train_x.shape == (205, 1, 28, 28) and train_x.dtype == np.uint8
    assert test_x.shape == (100, 1, 28, 28) and test_y.shape == (100,)
    assert np.bincount(test_y, minlength=10).tolist() == [10] * 10
    counts = np.bincount(train_y, minlength=10)
    assert counts.min() == 20 and counts.max() == 21
    assert len(set(train_y[:20].tolist())) > 3                  # shuffled, not sorted by class
    ink = train_x[:, 0].astype(np.float64)
    assert ink.max() == 255 and 0.05 < (ink > 128).mean() < 0.35
    # MNIST-like framing: the ink sits in the middle, the border is (almost) empty.
    assert ink[:, :2].mean() < 0.1 * ink.mean() and ink[:, :, :2].mean() < 0.1 * ink.mean()
    ys, xs = np.mgrid[0:28, 0:28]
    center_y = (ink * ys).sum(axis=(1, 2)) / ink.sum(axis=(1, 2))
    center_x = (ink * xs).sum(axis=(1, 2)) / ink.sum(axis=(1, 2))
    assert np.all(np.abs(center_y - 13.5) < 5) and np.all(np.abs(center_x - 13.5) < 5)


def test_rendering_is_seeded(small_set):
    again = digits.make_digits(train_count=205, test_count=100, seed=7)
    for a, b in zip(small_set, again):
        np.testing.assert_array_equal(a, b)
    other = digits.make_digits(train_count=205, test_count=100, seed=8)
    assert not np.array_equal(small_set[0], other[0])


def test_same_class_images_differ_more_across_classes(small_set):
    """A sanity check that labels match pictures: nearest class means classify most images."""
    train_x, train_y, test_x, test_y = small_set
    means = np.stack([train_x[train_y == d, 0].astype(np.float64).mean(axis=0) for d in range(10)])
    distances = ((test_x[:, 0, None].astype(np.float64) - means[None]) ** 2).sum(axis=(2, 3))
    assert np.mean(distances.argmin(axis=1) == test_y) > 0.5


def test_convert_arrays_to_lmdb_round_trip(tmp_path):
    pixels = RNG.integers(0, 256, (7, 2, 3, 4)).astype(np.uint8)
    labels = RNG.integers(0, 10, 7)
    assert convert_arrays_to_lmdb(pixels, labels, tmp_path / "arr") == 7
    keys, _ = read_db(tmp_path / "arr")
    assert keys == [f"{i:08d}" for i in range(7)]
    data, got = read_with_data_layer(tmp_path / "arr", 7)
    np.testing.assert_array_equal(data, pixels)
    np.testing.assert_array_equal(got, labels)
    with pytest.raises(DataError, match="one label per image"):
        convert_arrays_to_lmdb(pixels, labels[:3], tmp_path / "bad")
    with pytest.raises(DataError, match="must be uint8"):
        convert_arrays_to_lmdb(pixels.astype(np.float32), labels, tmp_path / "bad2")


def test_make_digits_lmdb_feeds_lenet(tmp_path, monkeypatch):
    train_path, test_path = digits.make_digits_lmdb(tmp_path / "examples_out", 120, 50, seed=1)
    assert Path(train_path).name == "digits_train_lmdb" and Path(test_path).name == "digits_test_lmdb"
    # Existing databases are kept (no rewrite) unless overwrite=True.
    stamp = (Path(train_path) / "data.mdb").stat().st_mtime_ns
    digits.make_digits_lmdb(tmp_path / "examples_out", 120, 50, seed=1)
    assert (Path(train_path) / "data.mdb").stat().st_mtime_ns == stamp
    train_x, train_y, test_x, test_y = digits.make_digits(120, 50, seed=1)
    # The LeNet prototxt's TEST data layer reads examples_out/digits_test_lmdb relative to the cwd.
    monkeypatch.chdir(tmp_path)
    net_param = text_format.Parse((LENET / "lenet_train_test.prototxt").read_text(), caffe_pb2.NetParameter())
    data_layers = [layer for layer in net_param.layer if layer.type == "Data"]
    assert [layer.data_param.source for layer in data_layers] == ["examples_out/digits_train_lmdb",
                                                                  "examples_out/digits_test_lmdb"]
    only_data = caffe_pb2.NetParameter()
    only_data.layer.add().CopyFrom(data_layers[1])
    net = cct.Net(only_data, cct.TEST)
    out = net.forward()
    assert out["data"].shape == (100, 1, 28, 28)
    expected = np.concatenate([test_x, test_x[:50]]).astype(np.float32) * np.float32(0.00390625)
    np.testing.assert_array_equal(out["data"], expected)           # 50 records, wrapped around
    np.testing.assert_array_equal(out["label"], np.concatenate([test_y, test_y]))


def test_lenet_files_parse():
    for name in ("lenet_train_test.prototxt", "lenet.prototxt"):
        net = text_format.Parse((LENET / name).read_text(), caffe_pb2.NetParameter())
        types = [layer.type for layer in net.layer]
        assert types.count("Convolution") == 2 and types.count("InnerProduct") == 2
    solver = text_format.Parse((LENET / "lenet_solver.prototxt").read_text(), caffe_pb2.SolverParameter())
    assert solver.net == "models/lenet/lenet_train_test.prototxt" and solver.test_iter == [20]
