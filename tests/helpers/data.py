"""Small data sources on disk, written here with lmdb, Pillow and h5py (never
with the code under test), and the data layers that read them back.

    write_lmdb / raw_datum / png_bytes   an LMDB of Datums (raw, float or encoded)
    read_db                              an LMDB's (keys, Datums), read with lmdb itself
    write_image_list                     PNGs under a folder and ImageData's list file
    write_hdf5_list                      HDF5 files and HDF5Data's list file
    write_window_file                    WindowData's window file
    data_layer / start / forward         a Data layer made, set up, run
    read_with_data_layer                 one batch of a database through a Data layer
    opencv_read / opencv_resize          the expected pixels: OpenCV's own imread and
                                         resize INTER_LINEAR, as Caffe calls them
Images are (C, H, W) uint8 in BGR order (OpenCV's and Caffe's)."""
import io

import cv2
import h5py
import lmdb
import numpy as np
from PIL import Image

import cct
from cct.core.blob import Blob
from cct.proto import caffe_pb2
from cct.testing.gradient_check import make_layer

RNG = np.random.default_rng(5)


# --- images -----------------------------------------------------------------------------------
def images(n, c=3, h=6, w=7):
    """n random uint8 images (n, c, h, w)."""
    return RNG.integers(0, 256, (n, c, h, w)).astype(np.uint8)


def rgb_to_bgr_chw(rgb):
    """An (H, W, 3) RGB array, as Pillow reads it, as Caffe's (3, H, W) BGR."""
    return np.ascontiguousarray(rgb[:, :, ::-1].transpose(2, 0, 1))


def png_bytes(image_chw):
    """Encode a (C, H, W) BGR/gray uint8 image as PNG (RGB on disk, as OpenCV writes)."""
    if image_chw.shape[0] == 1:
        pil = Image.fromarray(image_chw[0], "L")
    else:
        pil = Image.fromarray(np.ascontiguousarray(image_chw[::-1].transpose(1, 2, 0)), "RGB")
    buffer = io.BytesIO()
    pil.save(buffer, format="PNG")
    return buffer.getvalue()


def opencv_read(path, color=True, height=0, width=0):
    """Caffe's ReadImageToCVMat, in OpenCV's own calls: (C, H, W) BGR or grey."""
    image = cv2.imread(str(path), cv2.IMREAD_COLOR if color else cv2.IMREAD_GRAYSCALE)
    if height and width:
        image = cv2.resize(image, (width, height), interpolation=cv2.INTER_LINEAR)
    return image[None] if image.ndim == 2 else np.ascontiguousarray(image.transpose(2, 0, 1))


def opencv_resize(image_chw, height, width):
    """(C, H, W) -> (C, height, width) by cv2.resize INTER_LINEAR (three channels)."""
    hwc = np.ascontiguousarray(image_chw.transpose(1, 2, 0))
    return cv2.resize(hwc, (width, height), interpolation=cv2.INTER_LINEAR).transpose(2, 0, 1)


# --- LMDB --------------------------------------------------------------------------------------
def raw_datum(image, label):
    c, h, w = image.shape
    return caffe_pb2.Datum(channels=c, height=h, width=w, data=image.astype(np.uint8).tobytes(), label=label)


def write_lmdb(path, datums, keys=None):
    """An LMDB at `path` holding `datums` (Datums or serialized bytes) under
    `keys` (default 00000000, 00000001, ...). Returns the path as a string."""
    env = lmdb.open(str(path), map_size=1 << 26)
    with env.begin(write=True) as txn:
        for index, datum in enumerate(datums):
            key = keys[index] if keys else f"{index:08d}"
            txn.put(key.encode(), datum if isinstance(datum, bytes) else datum.SerializeToString())
    env.close()
    return str(path)


def read_db(path):
    """(keys, datums) straight from LMDB, independent of cct.data.db."""
    env = lmdb.open(str(path), readonly=True, lock=False)
    with env.begin() as txn:
        items = [(k.decode(), caffe_pb2.Datum.FromString(v)) for k, v in txn.cursor()]
    env.close()
    return [k for k, _ in items], [d for _, d in items]


# --- list files ----------------------------------------------------------------------------------
def write_image_list(folder, pixels, labels, names=None):
    """Each image of `pixels` as a PNG under folder/images/ (names relative to
    it, default im<i>.png) and folder/list.txt with 'name label' lines.
    Returns (root folder with a trailing slash, list file), as ImageData's
    root_folder and source take them."""
    root = folder / "images"
    names = names or [f"im{index}.png" for index in range(len(pixels))]
    for name, image in zip(names, pixels):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(png_bytes(image))
    listing = folder / "list.txt"
    listing.write_text("".join(f"{name} {label}\n" for name, label in zip(names, labels)))
    return str(root) + "/", str(listing)


def write_hdf5_list(folder, parts):
    """One HDF5 file per {dataset name: array} in `parts` and the list file
    naming them, one per line (HDF5Data's source). Returns the list file."""
    names = []
    for index, datasets in enumerate(parts):
        path = folder / f"part{index}.h5"
        with h5py.File(path, "w") as handle:
            for name, values in datasets.items():
                handle[name] = values
        names.append(str(path))
    listing = folder / "h5list.txt"
    listing.write_text("\n".join(names) + "\n")
    return str(listing)


def write_window_file(path, image_name, shape, windows):
    """WindowData's window file for one image: `shape` (C, H, W) and windows
    (label, overlap, x1, y1, x2, y2), corners inclusive."""
    lines = ["# 0", image_name, *map(str, shape), str(len(windows))]
    lines += [" ".join(map(str, window)) for window in windows]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


# --- data layers -------------------------------------------------------------------------------
def data_layer(source, batch, extra="", transform="", phase=cct.TRAIN, backend="LMDB"):
    return make_layer(f'name: "d" type: "Data" transform_param {{ {transform} }} '
                      f'data_param {{ source: "{source}" batch_size: {batch} backend: {backend} {extra} }}', phase)


def start(layer, num_tops=2):
    """The layer set up (Caffe's SetUp) with no bottoms and `num_tops` tops; returns the tops."""
    tops = [Blob() for _ in range(num_tops)]
    layer.set_up([], tops)
    return tops


def forward(layer, tops):
    """One batch: reshape and forward; returns copies of the tops' data."""
    layer.reshape([], tops)
    layer.forward([], tops)
    return [t.data.copy() for t in tops]


def read_with_data_layer(path, batch, transform="", backend="LMDB"):
    """(data, label) of the first batch a TEST-phase Data layer reads from `path`."""
    layer = data_layer(path, batch, transform=transform, phase=cct.TEST, backend=backend)
    data, label = forward(layer, start(layer))
    layer.close()
    return data, label
