"""BVLC Caffe's image-pipeline reference (tests/data/caffe_images, see its
README.md): the reference arrays, the manifest of commands and nets, and a
workspace where cct has run the manifest's convert_imageset and
compute_image_mean commands, as Caffe did, so that the nets find their
databases and means at the same relative paths.

    REFERENCE, MANIFEST       the arrays of reference.npz and manifest.json
    build_workspace(folder)   copy images, lists and nets there and run the commands
    inside(folder)            a context with `folder` as the working directory
    assert_bits_equal         equal dtype, shape and bits, else the largest difference
"""
import contextlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

from cct.cli.datasets import compute_image_mean, convert_imageset

FOLDER = Path(__file__).resolve().parents[1] / "data" / "caffe_images"
MANIFEST = json.loads((FOLDER / "manifest.json").read_text())
with np.load(FOLDER / "reference.npz") as _archive:
    REFERENCE = {key: _archive[key] for key in _archive.files}


@contextlib.contextmanager
def inside(folder):
    """Caffe resolves `source`, `root_folder` and `mean_file` against the working directory."""
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield Path(folder)
    finally:
        os.chdir(before)


def build_workspace(folder):
    """`folder` with the reference's images, lists and nets, then db/ and mean/ made by
    cct from the manifest's command lines (the README's "How to reproduce")."""
    folder = Path(folder)
    for name in ("images", "nets"):
        shutil.copytree(FOLDER / name, folder / name)
    for name in ("list.txt", "list-small.txt", "list-large.txt"):
        shutil.copy(FOLDER / name, folder / name)
    with inside(folder):
        os.makedirs("db")
        os.makedirs("mean")
        for command in MANIFEST["convert"]:
            assert convert_imageset(command["args"]) == 0, command
        for command in MANIFEST["mean"]:
            assert compute_image_mean(command["args"]) == 0, command
    return folder


def assert_bits_equal(ours, key):
    """cct's array equals reference key `key` in dtype, shape and every bit."""
    expected = REFERENCE[key]
    ours = np.asarray(ours)
    assert ours.dtype == expected.dtype and ours.shape == expected.shape, \
        f"{key}: cct gives {ours.dtype} {ours.shape}, Caffe {expected.dtype} {expected.shape}"
    same = ours.tobytes() == expected.tobytes()
    if not same:
        differ = ours != expected
        largest = np.abs(ours.astype(np.float64) - expected).max()
        raise AssertionError(f"{key}: {differ.sum()} of {differ.size} values differ from Caffe's, "
                             f"by up to {largest}")
