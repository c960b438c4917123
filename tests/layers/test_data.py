"""Data layers (layers/data.py) and the DataTransformer, on small files made
by helpers.data: an LMDB of raw, float and encoded Datums, PNG folders with list files,
HDF5 files with their list, window files. Expected values come from numpy /
OpenCV calls written in the test, never from the code under test."""
import gc
import os
import threading

import h5py
import numpy as np
import pytest

import cct
from cct.core.blob import Blob
from cct.core.errors import ConfigError, DataError
from cct.data.db import open_db, record_key
from cct.testing.gradient_check import make_layer
from cct.proto import caffe_pb2
from helpers.data import (data_layer, forward, images, opencv_read, opencv_resize, png_bytes, raw_datum, start,
                          write_hdf5_list, write_image_list, write_lmdb, write_window_file)
from helpers.requirements import require

RNG = np.random.default_rng(5)


@pytest.fixture
def raw_db(tmp_path):
    pixels = images(5)
    labels = [3, 1, 4, 0, 2]              # distinct: a label names its record
    path = write_lmdb(tmp_path / "raw_lmdb", [raw_datum(p, l) for p, l in zip(pixels, labels)])
    return path, pixels, np.array(labels, np.float32)


# --- Data: values, order, wrap-around ------------------------------------------------------
def test_data_reads_raw_datums_in_key_order_and_wraps(raw_db):
    path, pixels, labels = raw_db
    layer = data_layer(path, 3)
    tops = start(layer)
    assert tops[0].shape == (3, 3, 6, 7) and tops[1].shape == (3,)
    data, label = forward(layer, tops)
    np.testing.assert_array_equal(data, pixels[:3])
    np.testing.assert_array_equal(label, labels[:3])
    data, label = forward(layer, tops)          # records 3, 4, then back to 0
    np.testing.assert_array_equal(data, pixels[[3, 4, 0]])
    np.testing.assert_array_equal(label, labels[[3, 4, 0]])
    assert data.dtype == np.float32
    layer.close()


def test_data_without_label_top(raw_db):
    path, pixels, _ = raw_db
    layer = data_layer(path, 2)
    tops = start(layer, num_tops=1)
    np.testing.assert_array_equal(forward(layer, tops)[0], pixels[:2])
    layer.close()


def test_data_keys_sort_as_bytes(tmp_path):
    pixels = images(3, 1, 2, 2)
    keys = ["00000002_c.png", "00000000_a.png", "00000001_b.png"]
    path = write_lmdb(tmp_path / "k", [raw_datum(p, i) for i, p in enumerate(pixels)], keys)
    layer = data_layer(path, 3)
    tops = start(layer)
    _, label = forward(layer, tops)
    np.testing.assert_array_equal(label, [1, 2, 0])        # in key order a, b, c
    layer.close()


def test_data_float_datums(tmp_path):
    values = RNG.standard_normal((2, 2, 3, 3)).astype(np.float32)
    datums = []
    for v in values:
        d = caffe_pb2.Datum(channels=2, height=3, width=3, label=7)
        d.float_data.extend(v.ravel().tolist())
        datums.append(d)
    layer = data_layer(write_lmdb(tmp_path / "f", datums), 2, transform="scale: 2")
    tops = start(layer)
    data, label = forward(layer, tops)
    np.testing.assert_allclose(data, values * 2, rtol=1e-6)
    np.testing.assert_array_equal(label, [7, 7])
    layer.close()


def test_data_encoded_color_is_bgr_and_gray_stays_gray(tmp_path):
    color = images(2, 3, 5, 4)
    gray = images(2, 1, 5, 4)
    color_db = write_lmdb(tmp_path / "c", [caffe_pb2.Datum(data=png_bytes(p), encoded=True, label=i)
                                           for i, p in enumerate(color)])
    gray_db = write_lmdb(tmp_path / "g", [caffe_pb2.Datum(data=png_bytes(p), encoded=True, label=i)
                                          for i, p in enumerate(gray)])
    layer = data_layer(color_db, 2)
    tops = start(layer)
    np.testing.assert_array_equal(forward(layer, tops)[0], color)
    layer.close()
    layer = data_layer(gray_db, 2)
    tops = start(layer)
    assert tops[0].shape == (2, 1, 5, 4)
    np.testing.assert_array_equal(forward(layer, tops)[0], gray)
    layer.close()
    # force_color on gray: the channel is repeated; force_gray on color: ITU-R 601 luma.
    layer = data_layer(gray_db, 2, transform="force_color: true")
    tops = start(layer)
    np.testing.assert_array_equal(forward(layer, tops)[0], np.repeat(gray, 3, axis=1))
    layer.close()
    layer = data_layer(color_db, 2, transform="force_gray: true")
    tops = start(layer)
    b, g, r = (color[:, k].astype(np.float64) for k in range(3))
    luma = (r * 299 + g * 587 + b * 114) / 1000
    got = forward(layer, tops)[0][:, 0]
    # libpng's fixed-point grey conversion (OpenCV's grey PNG decode, as Caffe's) rounds to within
    # about 1.01 of the exact luma (1.009 over 262,144 random pixels); bit-exactness against
    # Caffe's own pipeline is tests/data/test_images.py's
    assert np.abs(got - luma).max() <= 1.02
    layer.close()


def test_data_legacy_data_param_scale_is_used(raw_db):
    path, pixels, _ = raw_db
    layer = data_layer(path, 2, extra="scale: 0.5")
    tops = start(layer)
    np.testing.assert_allclose(forward(layer, tops)[0], pixels[:2] * np.float32(0.5))
    layer.close()
    with pytest.raises(ConfigError, match="data_param.scale"):
        start(data_layer(path, 2, extra="scale: 0.5", transform="scale: 2"))


def test_data_rand_skip_starts_within_range(raw_db):
    path, _, labels = raw_db
    first_records = set()
    for seed in range(12):
        cct.set_random_seed(seed)
        layer = data_layer(path, 1, extra="rand_skip: 3")
        tops = start(layer)
        _, label = forward(layer, tops)
        layer.close()
        first_records.add(int(np.flatnonzero(labels == label[0])[0]))
    assert first_records <= {0, 1, 2} and len(first_records) > 1


# --- transforms ----------------------------------------------------------------------------
def naive_transform(image, top, left, crop, mirror, mean, scale):
    """Caffe's per-element loop: out[c, h, w] = (x[c, top+h, left+w'] - mean) * scale."""
    c_n = image.shape[0]
    out = np.zeros((c_n, crop, crop), np.float32)
    for c in range(c_n):
        for h in range(crop):
            for w in range(crop):
                src_w = left + (crop - 1 - w if mirror else w)
                m = 0.0 if mean is None else (mean[c, top + h, src_w] if mean.ndim == 3 else mean[c])
                out[c, h, w] = (np.float32(image[c, top + h, src_w]) - np.float32(m)) * np.float32(scale)
    return out


def write_mean(path, mean):
    proto = caffe_pb2.BlobProto(num=1, channels=mean.shape[0], height=mean.shape[1], width=mean.shape[2])
    proto.data.extend(mean.ravel().tolist())
    path.write_bytes(proto.SerializeToString())
    return str(path)


def test_test_phase_center_crop_with_mean_file_and_scale(raw_db, tmp_path):
    path, pixels, _ = raw_db
    mean = RNG.uniform(0, 255, (3, 6, 7)).astype(np.float32)
    mean_file = write_mean(tmp_path / "mean.binaryproto", mean)
    layer = data_layer(path, 5, transform=f'crop_size: 4 mean_file: "{mean_file}" scale: 0.25',
                       phase=cct.TEST)
    tops = start(layer)
    assert tops[0].shape == (5, 3, 4, 4)
    data, _ = forward(layer, tops)
    for n in range(5):     # center: top (6-4)//2 = 1, left (7-4)//2 = 1
        np.testing.assert_allclose(data[n], naive_transform(pixels[n], 1, 1, 4, False, mean, 0.25), rtol=1e-6)
    layer.close()


def test_train_phase_random_crop_and_mirror(raw_db):
    path, pixels, labels = raw_db
    cct.set_random_seed(3)
    layer = data_layer(path, 5, transform="crop_size: 3 mirror: true mean_value: 10 mean_value: 20 "
                       "mean_value: 30 scale: 2")
    tops = start(layer)
    offsets, mirrors = set(), set()
    for _ in range(8):
        data, label = forward(layer, tops)
        for n in range(5):
            record = int(np.flatnonzero(labels == label[n])[0])
            matches = [(t, l, m) for t in range(4) for l in range(5) for m in (False, True)
                       if np.allclose(data[n], naive_transform(pixels[record], t, l, 3, m,
                                                              np.array([10, 20, 30.]), 2))]
            assert matches, "output is not a crop of its record"
            offsets.add(matches[0][:2])
            mirrors.add(matches[0][2])
    assert len(offsets) > 5 and mirrors == {False, True}
    layer.close()


def test_seeded_runs_repeat(raw_db):
    path, _, _ = raw_db
    runs = []
    for _ in range(2):
        cct.set_random_seed(42)
        layer = data_layer(path, 5, transform="crop_size: 3 mirror: true")
        tops = start(layer)
        runs.append(forward(layer, tops)[0])
        layer.close()
    np.testing.assert_array_equal(runs[0], runs[1])


def test_transformer_batch_equals_single_images():
    from cct.data.transformer import DataTransformer
    param = caffe_pb2.TransformationParameter(crop_size=3, mean_value=[5.0], scale=0.5)
    batch = images(4)
    transformer = DataTransformer(param, cct.TEST)
    together = transformer.transform_batch(batch)
    for n in range(4):
        np.testing.assert_array_equal(together[n], transformer.transform(batch[n]))
        np.testing.assert_allclose(together[n], naive_transform(batch[n], 1, 2, 3, False, np.array([5.] * 3), 0.5))


@pytest.mark.parametrize("transform, field", [
    ('mean_file: "m.binaryproto" mean_value: 3', "mean_file"),
    ("mean_value: 1 mean_value: 2", "mean_value"),
    ("crop_size: 9", "crop_size"),
    ("force_color: true force_gray: true", "force_color"),
])
def test_transform_param_errors(raw_db, tmp_path, monkeypatch, transform, field):
    monkeypatch.chdir(tmp_path)
    write_mean(tmp_path / "m.binaryproto", np.zeros((3, 6, 7), np.float32))
    path, _, _ = raw_db
    with pytest.raises(ConfigError, match=f"transform_param.{field}"):
        start(data_layer(path, 2, transform=transform))


def test_mean_file_shape_must_match(raw_db, tmp_path):
    path, _, _ = raw_db
    mean_file = write_mean(tmp_path / "m.binaryproto", np.zeros((3, 5, 5), np.float32))
    with pytest.raises(ConfigError, match=r"3x5x5 but the images are 3x6x7"):
        start(data_layer(path, 2, transform=f'mean_file: "{mean_file}"'))
    with pytest.raises(ConfigError, match="not found"):
        start(data_layer(path, 2, transform='mean_file: "nowhere.binaryproto"'))


# --- Data: bad input -------------------------------------------------------------------------
def test_missing_source_names_the_path(tmp_path):
    with pytest.raises(DataError, match="nowhere_lmdb: database not found"):
        start(data_layer(tmp_path / "nowhere_lmdb", 2))
    with pytest.raises(ConfigError, match="data_param.batch_size"):
        start(data_layer(tmp_path / "x", 0))


def test_empty_database(tmp_path):
    path = write_lmdb(tmp_path / "empty", [])
    with pytest.raises(DataError, match="holds no records"):
        start(data_layer(path, 2))


def test_bad_records_are_named_in_forward(tmp_path):
    good = images(2, 1, 3, 3)
    bad_shape = caffe_pb2.Datum(channels=1, height=3, width=3, data=b"\x00" * 5)
    undecodable = caffe_pb2.Datum(data=b"not a png", encoded=True)
    other_size = raw_datum(images(1, 1, 4, 4)[0], 0)
    for bad, message in ((bad_shape, "datum shape mismatch: channels x height x width = 1x3x3 but it holds 5"),
                         (undecodable, "cannot decode image"),
                         (other_size, "image is 1x4x4 but the batch's first is 1x3x3")):
        path = write_lmdb(tmp_path / f"bad{len(message)}", [raw_datum(good[0], 0), raw_datum(good[1], 1), bad])
        layer = data_layer(path, 3)
        tops = start(layer)
        with pytest.raises(DataError, match="record '00000002'") as info:
            forward(layer, tops)
        assert message in str(info.value) and "layer 'd' (Data)" in str(info.value)
        with pytest.raises(DataError):          # the failure stays: every later forward reports it
            forward(layer, tops)
        layer.close()



@pytest.mark.parametrize("backend", ["lmdb", "leveldb"])
def test_a_refused_data_layer_closes_its_database(tmp_path, backend):
    """Found by the fuzzer: a Data layer whose first record was refused kept
    its database open, so many refused nets ran out of file descriptors."""
    if backend == "leveldb":
        require("plyvel")
    open_before = len(os.listdir("/proc/self/fd"))
    for index in range(20):
        source = tmp_path / f"db{index}"
        with open_db(source, backend, "w") as db:
            db.put(record_key(0), b"\xff not a datum")
        text = (f'layer {{ name: "d" type: "Data" top: "data" data_param {{ source: "{source}" '
                f'backend: {backend.upper()} batch_size: 2 }} }}')
        with pytest.raises(DataError, match="not a serialized Datum"):
            cct.Net(text, cct.TRAIN)
    assert len(os.listdir("/proc/self/fd")) <= open_before + 2


def test_leveldb_needs_plyvel(tmp_path):
    try:
        import plyvel  # noqa: F401
        pytest.skip("plyvel is installed")
    except ImportError:
        pass
    (tmp_path / "ldb").mkdir()
    with pytest.raises(DataError, match="LevelDB needs plyvel: pip install plyvel"):
        start(data_layer(tmp_path / "ldb", 2, backend="LEVELDB"))


# --- prefetch thread ---------------------------------------------------------------------------
def prefetch_threads():
    return [t for t in threading.enumerate() if t.name.startswith("cct-prefetch-")]


def test_prefetch_thread_stops_on_close_and_on_collection(raw_db):
    path, _, _ = raw_db
    before = len(prefetch_threads())
    layer = data_layer(path, 2, extra="prefetch: 2")
    tops = start(layer)
    forward(layer, tops)
    assert layer.prefetch_alive and len(prefetch_threads()) == before + 1
    layer.close()
    assert not layer.prefetch_alive
    layer = data_layer(path, 2)
    tops = start(layer)
    thread = prefetch_threads()[-1]
    del layer
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()


def test_net_with_data_layer(raw_db, tmp_path):
    path, pixels, labels = raw_db
    proto = tmp_path / "net.prototxt"
    proto.write_text(f'layer {{ name: "d" type: "Data" top: "data" top: "label" '
                     f'data_param {{ source: "{path}" batch_size: 4 backend: LMDB }} }}')
    net = cct.Net(str(proto), cct.TRAIN)
    out = net.forward()
    np.testing.assert_array_equal(out["data"], pixels[:4])
    np.testing.assert_array_equal(out["label"], labels[:4])


# --- ImageData ---------------------------------------------------------------------------------
@pytest.fixture
def png_folder(tmp_path):
    pixels = images(5, 3, 8, 6)
    names = [f"sub/im {index}.png" for index in range(5)]        # a space in the name: split at the last space
    root, listing = write_image_list(tmp_path, pixels, [index * 10 for index in range(5)], names)
    return root, listing, pixels


def image_layer(listing, root, batch, extra="", transform="", phase=cct.TRAIN):
    return make_layer(f'name: "im" type: "ImageData" transform_param {{ {transform} }} image_data_param {{ '
                      f'source: "{listing}" root_folder: "{root}" batch_size: {batch} {extra} }}', phase)


def test_image_data_values_labels_and_wraparound(png_folder):
    root, listing, pixels = png_folder
    layer = image_layer(listing, root, 3)
    tops = start(layer)
    data, label = forward(layer, tops)
    np.testing.assert_array_equal(data, pixels[:3])
    np.testing.assert_array_equal(label, [0, 10, 20])
    data, label = forward(layer, tops)
    np.testing.assert_array_equal(data, pixels[[3, 4, 0]])
    np.testing.assert_array_equal(label, [30, 40, 0])
    layer.close()


def test_image_data_gray_and_resize(png_folder):
    root, listing, pixels = png_folder
    layer = image_layer(listing, root, 2, "is_color: false new_height: 4 new_width: 5")
    tops = start(layer)
    assert tops[0].shape == (2, 1, 4, 5)
    data, _ = forward(layer, tops)
    for n in range(2):
        expected = opencv_read(f"{root}sub/im {n}.png", color=False, height=4, width=5)
        np.testing.assert_array_equal(data[n], expected)
    layer.close()


def test_image_data_crops_images_of_several_sizes_each_on_its_own(tmp_path):
    pixels = [images(1, 3, 8, 6)[0], images(1, 3, 5, 9)[0]]
    root, listing = write_image_list(tmp_path, pixels, [1, 2])
    layer = image_layer(listing, root, 2, transform="crop_size: 4", phase=cct.TEST)
    data, _ = forward(layer, start(layer))
    # As Caffe: each image centre-cropped at its own offsets, ((H - 4) // 2, (W - 4) // 2).
    np.testing.assert_array_equal(data, [pixels[0][:, 2:6, 1:5], pixels[1][:, 0:4, 2:6]])
    layer.close()
    layer = image_layer(listing, root, 2)
    with pytest.raises(cct.DataError, match=r"list.txt:2 \(im1.png\): image is 3x5x9 but the batch's first "
                                            r"is 3x8x6; resize them to one size or crop them"):
        forward(layer, start(layer))
    layer.close()


def test_image_data_shuffles_every_epoch(png_folder):
    root, listing, _ = png_folder
    cct.set_random_seed(1)
    layer = image_layer(listing, root, 5, "shuffle: true")
    tops = start(layer)
    orders = [tuple(forward(layer, tops)[1]) for _ in range(4)]
    for order in orders:
        assert sorted(order) == [0, 10, 20, 30, 40]
    assert len(set(orders)) > 1
    layer.close()


def test_image_data_errors(png_folder, tmp_path):
    root, listing, _ = png_folder
    with pytest.raises(ConfigError, match="new_height and new_width together"):
        start(image_layer(listing, root, 2, "new_height: 4"))
    with pytest.raises(DataError, match="image list .*missing.txt.* not found"):
        start(image_layer(tmp_path / "missing.txt", root, 2))
    broken = tmp_path / "broken.txt"
    broken.write_text("sub/im 0.png 0\nsub/gone.png 1\n")
    layer = image_layer(broken, root, 2)
    tops = start(layer)
    with pytest.raises(DataError, match=r"broken.txt:2: .*gone.png: could not open or find file"):
        forward(layer, tops)
    layer.close()
    bad = tmp_path / "bad.txt"
    bad.write_text("sub/im 0.png zero\n")
    with pytest.raises(DataError, match="bad.txt:1: expected 'path label'"):
        start(image_layer(bad, root, 1))
    (tmp_path / "images" / "junk.png").write_bytes(b"junk")
    junk = tmp_path / "junk.txt"
    junk.write_text("junk.png 3\n")
    with pytest.raises(DataError, match="junk.txt:1: .*junk.png: cannot decode image"):
        start(image_layer(junk, root, 1))



def test_image_lists_that_are_not_utf8_or_name_a_null_byte_are_clean_errors(png_folder, tmp_path):
    """Found by the fuzzer (issue 15): a list with bytes that are not UTF-8
    raised UnicodeDecodeError, a name with a null byte ValueError."""
    root, _, _ = png_folder
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"sub/im 0.png 0\nsub/\xe9t\xe9.png 1\n")
    with pytest.raises(DataError, match=r"image list: .*latin.txt:2:5: not UTF-8 text \(byte 0xe9\)"):
        start(image_layer(latin, root, 1))
    null = tmp_path / "null.txt"
    null.write_bytes(b"sub/im\x00 0.png 0\n")
    with pytest.raises(DataError, match=r"null.txt:1: .*could not open or find file"):
        start(image_layer(null, root, 1))


# --- HDF5Data ------------------------------------------------------------------------------------
@pytest.fixture
def h5_files(tmp_path):
    arrays = []
    for index, rows in enumerate((4, 3)):
        data = RNG.standard_normal((rows, 2, 3)).astype(np.float32)
        label = np.arange(rows, dtype=np.float32) + 100 * index
        arrays.append((data, label))
    # labels stored as int64 and read as float, as Caffe does
    listing = write_hdf5_list(tmp_path, [{"data": data, "label": label.astype(np.int64)} for data, label in arrays])
    return listing, arrays


def hdf5_layer(listing, batch, extra=""):
    return make_layer(f'name: "h" type: "HDF5Data" top: "data" top: "label" hdf5_data_param {{ '
                      f'source: "{listing}" batch_size: {batch} {extra} }}')


def test_hdf5_data_rows_across_files_and_wraparound(h5_files):
    listing, arrays = h5_files
    all_data = np.concatenate([a[0] for a in arrays])
    all_label = np.concatenate([a[1] for a in arrays])
    layer = hdf5_layer(listing, 5)
    tops = start(layer)
    assert tops[0].shape == (5, 2, 3) and tops[1].shape == (5,)
    order = np.arange(15) % 7                   # 7 rows in all, read 3 batches of 5
    for batch in range(3):
        data, label = forward(layer, tops)
        rows = order[batch * 5:(batch + 1) * 5]
        np.testing.assert_array_equal(data, all_data[rows])
        np.testing.assert_array_equal(label, all_label[rows])


def test_hdf5_data_shuffle_visits_every_row_each_pass(h5_files):
    listing, arrays = h5_files
    cct.set_random_seed(0)
    layer = hdf5_layer(listing, 7, "shuffle: true")
    tops = start(layer)
    passes = [tuple(forward(layer, tops)[1]) for _ in range(4)]
    for labels in passes:
        assert sorted(labels) == [0, 1, 2, 3, 100, 101, 102]
    assert len(set(passes)) > 1


def test_hdf5_data_errors(h5_files, tmp_path):
    listing, _ = h5_files
    layer = make_layer(f'name: "h" type: "HDF5Data" top: "data" top: "weights" '
                       f'hdf5_data_param {{ source: "{listing}" batch_size: 2 }}')
    with pytest.raises(DataError, match="has no dataset 'weights' \\(top 1\\); it holds: data, label"):
        start(layer)
    with pytest.raises(DataError, match="list file .*nolist.txt.* not found"):
        start(hdf5_layer(tmp_path / "nolist.txt", 2))
    missing = tmp_path / "missing.txt"
    missing.write_text("gone.h5\n")
    with pytest.raises(DataError, match="HDF5 file 'gone.h5' not found"):
        start(hdf5_layer(missing, 2))
    with h5py.File(tmp_path / "uneven.h5", "w") as handle:
        handle["data"] = np.zeros((3, 2))
        handle["label"] = np.zeros(2)
    uneven = tmp_path / "uneven.txt"
    uneven.write_text(str(tmp_path / "uneven.h5"))
    with pytest.raises(DataError, match="dataset 'label' has 2 rows, 'data' has 3"):
        start(hdf5_layer(uneven, 2))



def test_hdf5_data_checks_a_dataset_before_reading_it(tmp_path, memory_limit):
    """Found by the fuzzer (issue 15): a dataset declared as 2^31 floats (no
    bytes on disk) was read whole, 8 GiB; a damaged file, or a group where
    a dataset belongs, raised h5py's own errors."""
    memory_limit(1 << 30)
    with h5py.File(tmp_path / "huge.h5", "w") as handle:
        handle.create_dataset("data", shape=(2, 1 << 30), dtype="float32")     # never written
        handle["label"] = np.zeros(2)
        handle.create_group("group")
    (tmp_path / "huge.txt").write_text(str(tmp_path / "huge.h5"))
    with pytest.raises(MemoryError, match=r"layer 'h' \(HDF5Data\): .*huge.h5: dataset 'data' of shape "
                                          r"\(2, 1073741824\) needs 8 GiB, more than the memory limit of 1 GiB"):
        start(hdf5_layer(tmp_path / "huge.txt", 2))
    grouped = make_layer(f'name: "h" type: "HDF5Data" top: "group" hdf5_data_param {{ '
                         f'source: "{tmp_path / "huge.txt"}" batch_size: 2 }}')
    with pytest.raises(DataError, match="has no dataset 'group' \\(top 0\\)"):
        start(grouped)
    (tmp_path / "damaged.h5").write_bytes((tmp_path / "huge.h5").read_bytes()[:600])
    (tmp_path / "damaged.txt").write_text(str(tmp_path / "damaged.h5"))
    with pytest.raises(DataError, match="damaged.h5: not a readable HDF5 file"):
        start(hdf5_layer(tmp_path / "damaged.txt", 2))


# --- HDF5Output ------------------------------------------------------------------------------------
def test_hdf5_output_writes_data_and_label(tmp_path):
    out = tmp_path / "out.h5"
    layer = make_layer(f'name: "o" type: "HDF5Output" hdf5_output_param {{ file_name: "{out}" }}')
    bottoms = [Blob((2, 3, 2, 2)), Blob((2,))]
    batches = []
    layer.check_blob_counts(bottoms, [])
    layer.setup(bottoms, [])
    for _ in range(2):
        bottoms[0].data[...] = RNG.standard_normal((2, 3, 2, 2))
        bottoms[1].data[...] = RNG.integers(0, 9, 2)
        batches.append((bottoms[0].data.copy(), bottoms[1].data.copy()))
        layer.reshape(bottoms, [])
        layer.forward(bottoms, [])
    with h5py.File(out, "r") as handle:
        np.testing.assert_array_equal(handle["data"][...], np.concatenate([b[0] for b in batches]))
        # Caffe writes legacy 4-d datasets: labels (n,) become (n, 1, 1, 1).
        np.testing.assert_array_equal(handle["label"][...],
                                      np.concatenate([b[1] for b in batches]).reshape(-1, 1, 1, 1))
    with pytest.raises(ConfigError, match="bottom"):
        layer.check_blob_counts(bottoms[:1], [])
    bad = [Blob((2, 3)), Blob((3,))]
    with pytest.raises(cct.ShapeError, match="same num"):
        layer.reshape(bad, [])


# --- WindowData -------------------------------------------------------------------------------------
@pytest.fixture
def window_setup(tmp_path):
    image = images(1, 3, 40, 40)[0]
    (tmp_path / "scene.png").write_bytes(png_bytes(image))
    windows = write_window_file(tmp_path / "windows.txt", "scene.png", (3, 40, 40), [
        (2, 0.9, 10, 10, 19, 29),          # foreground, label 2
        (5, 0.1, 0, 0, 9, 9),              # background: label forced to 0
        (7, 0.3, 5, 5, 30, 30)])           # background too (overlap < 0.5)
    return image, windows, str(tmp_path) + "/"


def window_layer(windows, root, batch, window_extra="", transform="crop_size: 16", fg_fraction=0.5):
    return make_layer(f'name: "w" type: "WindowData" top: "data" top: "label" transform_param {{ {transform} }} '
                      f'window_data_param {{ source: "{windows}" root_folder: "{root}" batch_size: {batch} '
                      f'fg_fraction: {fg_fraction} {window_extra} }}')


def warp(image, y1, y2, x1, x2, height, width):
    """Region [y1..y2] x [x1..x2] (inclusive) resized as Caffe does (cv::resize INTER_LINEAR)."""
    return opencv_resize(image[:, y1:y2 + 1, x1:x2 + 1], height, width).astype(np.float32)


def test_window_data_warp_labels_and_order(window_setup):
    image, windows, root = window_setup
    layer = window_layer(windows, root, 4)
    tops = start(layer)
    assert tops[0].shape == (4, 3, 16, 16)
    data, label = forward(layer, tops)
    np.testing.assert_array_equal(label, [0, 0, 2, 2])        # background first, then foreground
    fg = warp(image, 10, 29, 10, 19, 16, 16)
    np.testing.assert_array_equal(data[2], fg)
    bgs = [warp(image, 0, 9, 0, 9, 16, 16), warp(image, 5, 30, 5, 30, 16, 16)]
    for n in range(2):
        assert any(np.array_equal(data[n], bg) for bg in bgs)
    layer.close()


def test_window_data_square_context_pad(window_setup):
    image, windows, root = window_setup
    layer = window_layer(windows, root, 2, "context_pad: 2 crop_mode: \"square\" scale: 0.5", fg_fraction=1.0)
    tops = start(layer)
    data, label = forward(layer, tops)
    # Window (10,10)-(19,29), crop 16, pad 2: context scale 16/12, square half-size 10
    # around center (15, 20) -> x 2..28, y 7..33, inside the image: no clipping.
    np.testing.assert_array_equal(label, [2, 2])
    np.testing.assert_allclose(data[0], warp(image, 7, 33, 2, 28, 16, 16) * 0.5)
    layer.close()


def test_window_data_clipped_context_pads_with_zeros(tmp_path):
    image = images(1, 3, 40, 40)[0]
    (tmp_path / "a.png").write_bytes(png_bytes(image))
    windows = tmp_path / "w.txt"
    windows.write_text("# 0\na.png\n3\n40\n40\n1\n1 0.8 0 0 9 9\n")
    layer = window_layer(windows, str(tmp_path) + "/", 1, "context_pad: 1",
                         transform="crop_size: 12 mean_value: 100", fg_fraction=1.0)
    tops = start(layer)
    data, _ = forward(layer, tops)
    # Grown to -1..11 (13 px), clipped to 0..11, warped to round(12 * 12/13) = 11 px,
    # placed after round(1 * 12/13) = 1 pixel of zero padding.
    expected = np.zeros((3, 12, 12), np.float32)
    expected[:, 1:, 1:] = warp(image, 0, 11, 0, 11, 11, 11) - 100
    np.testing.assert_array_equal(data[0], expected)
    layer.close()


def test_window_data_errors(window_setup, tmp_path):
    _, windows, root = window_setup
    with pytest.raises(ConfigError, match="crop_size"):
        start(window_layer(windows, root, 2, transform=""))
    with pytest.raises(DataError, match="window file .* not found"):
        start(window_layer(tmp_path / "none.txt", root, 2))
    with pytest.raises(ConfigError, match="crop_mode"):
        start(window_layer(windows, root, 2, 'crop_mode: "stretch"'))
    only_bg = tmp_path / "bg.txt"
    only_bg.write_text("# 0\nscene.png\n3\n40\n40\n1\n0 0.1 0 0 5 5\n")
    with pytest.raises(DataError, match="no foreground windows"):
        start(window_layer(only_bg, root, 2))
    truncated = tmp_path / "cut.txt"
    truncated.write_text("# 0\nscene.png\n3\n40\n40\n2\n1 0.9 0 0 5 5\n")
    with pytest.raises(DataError, match="file ends inside"):
        start(window_layer(truncated, root, 2))
    missing = tmp_path / "missing.txt"
    missing.write_text("# 0\nnothere.png\n3\n40\n40\n2\n1 0.9 0 0 5 5\n0 0.1 0 0 5 5\n")
    layer = window_layer(missing, root, 2)
    tops = start(layer)
    with pytest.raises(DataError, match="nothere.png: could not open or find file"):
        forward(layer, tops)
    layer.close()
