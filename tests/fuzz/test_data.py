"""Fuzzing what the data layers read (cct.data, layers/data.py): Datum records
in an LMDB or a LevelDB, binaryproto mean files, image files, image list files and HDF5Data
sources, each mutated, read through a net whose data layer runs two or three
forwards (so the prefetch thread and the wrap-around run too). Each ends as a
CctError or runs."""
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import cct
from cct.data.db import open_db, record_key
from cct.data.images import encode_image
from cct.data.transformer import array_to_datum
from cct.proto import caffe_pb2
from helpers.fuzz import attempt, byte_ops, fuzz_settings, hdf5_ops, message_ops, mutate_bytes, mutate_hdf5, \
    mutate_text, mutated_message_bytes, text_ops
from helpers.requirements import require

pytestmark = pytest.mark.fuzz

PIXELS = np.random.default_rng(15).integers(0, 256, (3, 6, 7), dtype=np.uint8)     # (C, H, W) BGR
# transform_param variants: plain, cropped and mirrored, scaled with mean values
TRANSFORMS = ["", "crop_size: 4 mirror: true", "scale: 0.5 mean_value: 10 mean_value: 20 mean_value: 30",
              "force_gray: true"]


def _datums():
    encoded = caffe_pb2.Datum(encoded=True, label=2, data=encode_image(PIXELS, "png"))
    floats = array_to_datum(PIXELS[:1].astype(np.float32) / 255, label=1)
    return [array_to_datum(PIXELS, label=3), floats, encoded]


DATUMS = _datums()


def _run(net_text, folder, forwards=2):
    path = folder / "net.prototxt"
    path.write_text(net_text)
    net = cct.Net(str(path), cct.TRAIN)
    try:
        for _ in range(forwards):
            net.forward()
    finally:
        for layer in net.layers:
            getattr(layer, "close", lambda: None)()


def _data_net(source, transform, backend="lmdb"):
    return f"""layer {{ name: "data" type: "Data" top: "data" top: "label"
  data_param {{ source: "{source}" backend: {backend.upper()} batch_size: 2 }} transform_param {{ {transform} }} }}"""


def _write_db(path, records, backend="lmdb"):
    with open_db(path, backend, "w") as db:
        for index, value in enumerate(records):
            db.put(record_key(index), value)


DATUM_CASES = dict(seed=st.integers(0, len(DATUMS) - 1), edits=message_ops(), raw=byte_ops(),
                   transform=st.sampled_from(TRANSFORMS), position=st.integers(0, 2))


def _read_datums(backend, seed, edits, raw, transform, position):
    """Three records, one of them mutated, through a Data layer."""
    records = [DATUMS[seed].SerializeToString()] * 3
    records[position] = mutated_message_bytes(DATUMS[seed], edits, raw)
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        _write_db(folder / "db", records, backend)
        attempt(f"{backend} datum", lambda: _run(_data_net(folder / "db", transform, backend), folder),
                lambda: f"{seed} {edits} {raw} {transform} at {position}")


@fuzz_settings()
@given(**DATUM_CASES)
def test_lmdb_datums(seed, edits, raw, transform, position):
    _read_datums("lmdb", seed, edits, raw, transform, position)


@fuzz_settings()
@given(**DATUM_CASES)
def test_leveldb_datums(seed, edits, raw, transform, position):
    require("plyvel")
    _read_datums("leveldb", seed, edits, raw, transform, position)


@pytest.fixture(scope="module")
def lmdb_source():
    folder = Path(tempfile.mkdtemp(prefix="cct-fuzz-lmdb-"))
    _write_db(folder / "db", [DATUMS[0].SerializeToString()] * 3)
    return folder / "db"


MEAN = caffe_pb2.BlobProto(num=1, channels=3, height=6, width=7, data=PIXELS.ravel().astype(float) / 2)


@fuzz_settings()
@given(edits=message_ops(), raw=byte_ops(), transform=st.sampled_from(TRANSFORMS[:2]))
def test_mean_file(lmdb_source, edits, raw, transform):
    data = mutated_message_bytes(MEAN, edits, raw)
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        (folder / "mean.binaryproto").write_bytes(data)
        text = _data_net(lmdb_source, f'{transform} mean_file: "{folder / "mean.binaryproto"}"')
        attempt("mean file", lambda: _run(text, folder), lambda: f"{edits} {raw} {transform}")


IMAGES = {ext: encode_image(PIXELS, ext) for ext in ("png", "jpg", "bmp")}
IMAGES["gray.png"] = encode_image(PIXELS[:1], "png")
IMAGE_NAMES = sorted(IMAGES)
RESIZES = ["", "new_height: 5 new_width: 8", "is_color: false", "shuffle: true"]


def _image_net(listing, options, transform=""):
    return f"""layer {{ name: "data" type: "ImageData" top: "data" top: "label"
  image_data_param {{ source: "{listing}" batch_size: 2 {options} }} transform_param {{ {transform} }} }}"""


@fuzz_settings()
@given(seed=st.integers(0, len(IMAGE_NAMES) - 1), raw=byte_ops(), more=byte_ops(),
       options=st.sampled_from(RESIZES), transform=st.sampled_from(TRANSFORMS))
def test_image_files(seed, raw, more, options, transform):
    data = mutate_bytes(mutate_bytes(IMAGES[IMAGE_NAMES[seed]], raw), more)
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        (folder / "image").write_bytes(data)
        (folder / "list.txt").write_text(f"{folder / 'image'} 1\n{folder / 'image'} 0\n")
        attempt("image file", lambda: _run(_image_net(folder / "list.txt", options, transform), folder),
                lambda: f"{IMAGE_NAMES[seed]} {raw} {more} {options} {transform}")


LISTING = "a.png 0\nb.jpg 1\nsub dir/c.bmp 2\nd.gray.png 3\n"


@fuzz_settings()
@given(edits=text_ops(["a.png", "b.jpg", "sub dir/c.bmp", "d.gray.png", "sub dir"]), raw=byte_ops(),
       options=st.sampled_from(RESIZES))
def test_image_lists(edits, raw, options):
    # the listing's lines, mutated as prototxt text is (numbers, names, lines)
    text = "\n".join(f'path: "{name}" label: {label}' for name, label in
                     (line.rsplit(" ", 1) for line in LISTING.splitlines()))
    mutated = mutate_text(text, edits)
    listing = "\n".join(line.replace('path: "', "", 1).replace('" label: ', " ", 1) for line in mutated.split("\n"))
    data = mutate_bytes(listing.encode(), raw)
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        (folder / "sub dir").mkdir()
        for name, ext in (("a.png", "png"), ("b.jpg", "jpg"), ("sub dir/c.bmp", "bmp"), ("d.gray.png", "gray.png")):
            (folder / name).write_bytes(IMAGES[ext])
        (folder / "list.txt").write_bytes(data)
        options += f' root_folder: "{folder}/"'
        attempt("image list", lambda: _run(_image_net(folder / "list.txt", options), folder, 3),
                lambda: data.decode(errors="replace"))


@pytest.fixture(scope="module")
def hdf5_source():
    import h5py
    folder = Path(tempfile.mkdtemp(prefix="cct-fuzz-hdf5-"))
    with h5py.File(folder / "train.h5", "w") as out:
        out.create_dataset("data", data=PIXELS.reshape(3, 2, 3, 7).astype(np.float32))
        out.create_dataset("label", data=np.arange(3, dtype=np.float32))
    return folder / "train.h5"


@fuzz_settings()
@given(edits=hdf5_ops(), raw=byte_ops(), listed=st.sampled_from([1, 2]))
def test_hdf5_data(hdf5_source, edits, raw, listed):
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        path = folder / "train.h5"
        path.write_bytes(hdf5_source.read_bytes())
        mutate_hdf5(path, edits)
        path.write_bytes(mutate_bytes(path.read_bytes(), raw))
        (folder / "list.txt").write_text(f"{path}\n" * listed)
        text = f"""layer {{ name: "data" type: "HDF5Data" top: "data" top: "label"
  hdf5_data_param {{ source: "{folder / 'list.txt'}" batch_size: 2 }} }}"""
        attempt("hdf5 data", lambda: _run(text, folder, 3), lambda: f"{edits} {raw}")
