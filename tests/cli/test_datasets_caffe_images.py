"""convert_imageset and compute_image_mean (cct.cli.datasets) against BVLC Caffe,
bit for bit, on tests/data/caffe_images: every flag set of its manifest, every
Datum's pixels (or, for --encoded, the SHA-256 of its bytes) and label, and
every mean. Decoding, grey and INTER_LINEAR resizing are OpenCV's, as in Caffe."""
import hashlib

import numpy as np
import pytest

from cct.data.transformer import load_mean_file
from helpers.caffe_images import MANIFEST, REFERENCE, assert_bits_equal, build_workspace
from helpers.data import read_db

CONVERTS = {c["flagset"]: c for c in MANIFEST["convert"]}
WITH_PIXELS = sorted(f for f in CONVERTS if f"convert/{f}/0" in REFERENCE)
MEANS = [m["flagset"] for m in MANIFEST["mean"]]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return build_workspace(tmp_path_factory.mktemp("caffe_images"))


def datum_pixels(datum):
    return np.frombuffer(datum.data, np.uint8).reshape(datum.channels, datum.height, datum.width)


@pytest.mark.parametrize("flagset", WITH_PIXELS)
def test_convert_imageset_pixels_and_labels(workspace, flagset):
    keys, datums = read_db(workspace / "db" / flagset)
    # DB keys are %08d_<file>: their order is the list's, and the index is its line.
    assert [int(key[:8]) for key in keys] == list(range(len(keys)))
    assert not any(d.encoded for d in datums)
    for index, datum in enumerate(datums):
        assert_bits_equal(datum_pixels(datum), f"convert/{flagset}/{index}")
    assert_bits_equal(np.array([d.label for d in datums], np.int64), f"convert/{flagset}/labels")


def test_convert_imageset_encoded_keeps_the_files_bytes(workspace):
    _, datums = read_db(workspace / "db" / "encoded")
    assert all(d.encoded for d in datums)
    digests = np.array([np.frombuffer(hashlib.sha256(d.data).digest(), np.uint8) for d in datums])
    assert_bits_equal(digests, "convert/encoded/sha256")
    assert_bits_equal(np.array([d.label for d in datums], np.int64), "convert/encoded/labels")


@pytest.mark.parametrize("flagset", MEANS)
def test_compute_image_mean(workspace, flagset):
    assert_bits_equal(load_mean_file(workspace / "mean" / f"{flagset}.binaryproto"), f"mean/{flagset}")


def test_every_reference_key_is_checked():
    """The keys these tests and tests/layers/test_data_caffe_images.py compare are all of them."""
    checked = {"convert/encoded/sha256", "convert/encoded/labels"}
    for flagset in WITH_PIXELS:
        checked |= {k for k in REFERENCE if k.startswith(f"convert/{flagset}/")}
    checked |= {f"mean/{flagset}" for flagset in MEANS}
    for net in MANIFEST["nets"]:
        checked |= {net["key"]} | ({net["label_key"]} if net["label_key"] else set())
    assert checked == set(REFERENCE) and len(REFERENCE) == 63
