"""The embedded digits dataset: a first run needs no download.

cct/data/digits.npz holds the 1,797 8x8 handwritten digits of the UCI "Optical
Recognition of Handwritten Digits" set (pixel values 0..16; see
cct/data/README.md for provenance and license). From them this module renders
LeNet-shaped 28x28 digits, MNIST-like (a ~20x20 digit centered on black),
each a fresh random distortion of a source image: rotation, scale, shear,
shift, a smooth elastic warp and a stroke-weight change (milder for the test
images). Train and test images come from disjoint source images (a stratified
80/20 split), so test accuracy measures generalization to unseen handwriting.

    make_digits_lmdb("examples_out")   # -> digits_train_lmdb, digits_test_lmdb

convert_arrays_to_lmdb writes any uint8 image arrays already in memory the same way.
"""
from pathlib import Path

import numpy as np

from cct.core.errors import DataError
from cct.core.progress import Progress
from cct.data.db import open_db, record_key
from cct.formats.prototxt import atomic_path
from cct.proto import caffe_pb2

DATA_FILE = Path(__file__).with_name("digits.npz")
TRAIN_LMDB, TEST_LMDB = "digits_train_lmdb", "digits_test_lmdb"
SIZE = 28                 # output side, as MNIST
BOX = 20.0                # side of the box the 8x8 source grid is mapped onto
_UPSAMPLE = 4             # sources are upsampled once (cubic) before the per-image warp
TEST_STRENGTH = 0.5       # distortion strength of test images (train: 1)


def load_source_digits():
    """The embedded 8x8 digits: images uint8 (1797, 8, 8) in 0..16, labels uint8 (1797,)."""
    with np.load(DATA_FILE) as archive:
        return archive["images"], archive["labels"]


def split_sources(labels, test_fraction=0.2, seed=0):
    """Stratified, disjoint (train indices, test indices) of the source images."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for digit in range(10):
        members = rng.permutation(np.flatnonzero(labels == digit))
        cut = int(round(len(members) * test_fraction))
        test.append(members[:cut])
        train.append(members[cut:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def _upsampled(images):
    """(K, 8, 8) in 0..16 -> (K, 8*_UPSAMPLE + 8, same) float32 in ~0..1: bicubic,
    with a zero border. A loop over the (at most 1797) sources, not the outputs."""
    from PIL import Image
    padded = np.pad(images.astype(np.float32) / 16.0, ((0, 0), (1, 1), (1, 1)))      # (K, 10, 10)
    side = padded.shape[1] * _UPSAMPLE
    big = np.stack([np.asarray(Image.fromarray(image, "F").resize((side, side), Image.BICUBIC))
                    for image in padded])
    return np.clip(big, 0.0, 1.0)


def render(sources, labels, count, rng, strength=1.0, chunk=2000, what="digits"):
    """`count` 28x28 digits drawn from `sources` (K, 8, 8), classes balanced
    (count // 10 each, the remainder to the first classes), in random order;
    `strength` scales every distortion (0: none); progress is shown as `what`
    (cct.core.progress). Returns images uint8 (count, 1, 28, 28) and labels
    uint8 (count,)."""
    classes = np.arange(count) % 10
    rng.shuffle(classes)
    by_class = [np.flatnonzero(labels == digit) for digit in range(10)]
    choice = np.empty(count, np.int64)
    for digit in range(10):
        slots = np.flatnonzero(classes == digit)
        choice[slots] = rng.choice(by_class[digit], size=len(slots), replace=len(slots) > len(by_class[digit]))
    big = _upsampled(sources)
    images = np.empty((count, 1, SIZE, SIZE), np.uint8)
    with Progress(what, count, "images") as shown:
        for start in range(0, count, chunk):
            stop = min(start + chunk, count)
            images[start:stop, 0] = _warp(big, choice[start:stop], rng, strength)
            shown.update(stop - start)
    return images, labels[choice].astype(np.uint8)


def _warp(big, index, rng, strength):
    """Random affine + elastic distortions of big[index] sampled into 28x28 uint8."""
    from scipy import ndimage
    n = len(index)
    side = big.shape[1]
    # Affine map from output pixel offsets (from the center) to source offsets.
    jitter = lambda spread, size=n: 1.0 + rng.uniform(-spread, spread, size) * strength  # noqa: E731
    angle = rng.uniform(-0.25, 0.25, n) * strength          # radians, about +-14 degrees
    scale = jitter(0.12) - 0.02 * strength
    aspect = jitter(0.15)
    shear = rng.uniform(-0.25, 0.25, n) * strength
    to_source = (side - 2 * _UPSAMPLE) / BOX                # source pixels per output pixel
    cos, sin = np.cos(angle), np.sin(angle)
    # Inverse transform: output -> source = R(-angle) S^-1 H^-1, per image (n, 2, 2).
    inverse = np.empty((n, 2, 2))
    inverse[:, 0, 0], inverse[:, 0, 1] = cos, sin
    inverse[:, 1, 0], inverse[:, 1, 1] = -sin, cos
    stretch = np.zeros((n, 2, 2))
    stretch[:, 0, 0] = to_source / (scale * aspect)
    stretch[:, 1, 1] = to_source * aspect / scale
    stretch[:, 1, 0] = -shear * to_source / scale
    inverse = stretch @ inverse
    shift = rng.uniform(-1.5, 1.5, (n, 2)) * strength        # output pixels
    grid = np.mgrid[0:SIZE, 0:SIZE].reshape(2, -1).T - (SIZE - 1) / 2.0          # (784, 2) as (y, x)
    # Elastic warp: smooth random displacements (Simard et al. 2003), in output pixels.
    field = ndimage.gaussian_filter(rng.standard_normal((n, 2, SIZE, SIZE)), sigma=(0, 0, 4, 4))
    field *= 1.2 * strength / (field.std(axis=(2, 3), keepdims=True) + 1e-8) * rng.uniform(0.3, 1.0, (n, 1, 1, 1))
    offsets = grid[None] - shift[:, None, :] + field.reshape(n, 2, -1).transpose(0, 2, 1)   # (n, 784, 2)
    source = np.einsum("nij,npj->npi", inverse, offsets) + (side - 1) / 2.0
    coords = np.stack([np.broadcast_to(index[:, None].astype(np.float64), source.shape[:2]),
                       source[..., 0], source[..., 1]])                         # (3, n, 784)
    # Bilinear; the image coordinate is an exact integer, so images never blend.
    values = ndimage.map_coordinates(big, coords, order=1, mode="constant", cval=0.0)
    values = values.reshape(n, SIZE, SIZE)
    gamma = 0.95 + rng.uniform(-0.35, 0.35, (n, 1, 1)) * strength      # stroke weight: < 1 bolder
    values = np.clip(values * 1.25, 0.0, 1.0) ** gamma
    return np.round(values * 255.0).astype(np.uint8)


def make_digits(train_count=10000, test_count=2000, seed=0):
    """Rendered (train_images, train_labels, test_images, test_labels); images
    uint8 (N, 1, 28, 28), labels uint8. The same seed gives the same arrays."""
    sources, labels = load_source_digits()
    train_index, test_index = split_sources(labels, seed=seed)
    rng = np.random.default_rng(seed + 1)
    train = render(sources[train_index], labels[train_index], train_count, rng, what="digits: train")
    # Test digits are milder distortions of unseen writers, as MNIST's test set is undistorted.
    test = render(sources[test_index], labels[test_index], test_count, rng, strength=TEST_STRENGTH,
                  what="digits: test")
    return train + test


def make_digits_lmdb(out_dir, train_count=10000, test_count=2000, seed=0, overwrite=False):
    """Write out_dir/digits_train_lmdb and out_dir/digits_test_lmdb (raw uint8
    Datums, keys %08d) for models/lenet. Existing ones are kept unless
    overwrite. Returns the two paths."""
    out_dir = Path(out_dir)
    paths = out_dir / TRAIN_LMDB, out_dir / TEST_LMDB
    if not overwrite and all((p / "data.mdb").exists() for p in paths):
        return tuple(str(p) for p in paths)
    train_x, train_y, test_x, test_y = make_digits(train_count, test_count, seed)
    for path, images, labels in zip(paths, (train_x, test_x), (train_y, test_y)):
        # Written aside and renamed into place: a crash leaves no half-written database.
        with atomic_path(path) as temp_path:
            convert_arrays_to_lmdb(images, labels, temp_path)
    return tuple(str(p) for p in paths)


def convert_arrays_to_lmdb(images, labels, path):
    """uint8 (N, C, H, W) images and N integer labels -> a new LMDB of raw Datums
    keyed %08d (what a Data layer reads). Returns the number of records."""
    images = np.asarray(images)
    labels = np.asarray(labels)
    if images.ndim != 4:
        raise DataError(f"{path}: images must be (N, C, H, W), got shape {images.shape}")
    if labels.shape != (images.shape[0],):
        raise DataError(f"{path}: need one label per image ({images.shape[0]}), got shape {labels.shape}")
    if images.dtype != np.uint8:
        raise DataError(f"{path}: images must be uint8, got {images.dtype}")
    n, channels, height, width = images.shape
    with open_db(path, "lmdb", "w") as db:
        for index in range(n):
            datum = caffe_pb2.Datum(channels=channels, height=height, width=width,
                                    data=images[index].tobytes(), label=int(labels[index]))
            db.put(record_key(index), datum.SerializeToString())
    return n
