"""Caffe's DataTransformer and the image/Datum conversions the data layers share.

Images are numpy arrays shaped (channels, height, width): uint8 pixels (or
float32 from a Datum's float_data), color channels in BGR order, because Caffe
decodes with OpenCV and every Caffe model and mean file expects BGR.

TransformationParameter, applied in Caffe's order per image:
    crop_size   crop a crop_size x crop_size window: random offsets in TRAIN,
                centered in TEST
    mirror      flip left-right with probability 1/2 (Caffe flips at random in
                both phases when mirror is set)
    mean_file   subtract a mean image (binaryproto, same shape as the uncropped
                image, cropped at the same offsets) ... or
    mean_value  ... one value for all channels or one per channel
    scale       multiply after mean subtraction
    force_color / force_gray   decode encoded images to 3 / 1 channels (else as
                stored, Caffe's native decode)
Output: float32 (channels, crop or height, crop or width).

Decoding, grey conversion and resizing are OpenCV's, as in Caffe (cct.data.images).
"""
import os

import numpy as np

from cct.core.errors import ConfigError, DataError, ShapeError
from cct.core.layer import TRAIN
from cct.data.images import decode_image
from cct.formats.prototxt import atomic_write
from cct.formats.text import read_text_file
from cct.proto import caffe_pb2


# --- image lists and Datums ------------------------------------------------------------
def read_image_list(path, what):
    """Lines `path label` (split at the last space, so paths may hold spaces)
    -> [(path, label, line number)]."""
    text = read_text_file(path, DataError, f"{what}: image list")
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        name, _, label = line.rpartition(" ")
        try:
            entries.append((name.strip(), int(label), number))
        except ValueError:
            raise DataError(f"{path}:{number}: expected 'path label', got {line!r}") from None
        if not name.strip():
            raise DataError(f"{path}:{number}: expected 'path label', got {line!r}")
    if not entries:
        raise DataError(f"{what}: image list {path!r} is empty")
    return entries


def datum_to_array(datum, what="datum", color="native"):
    """A Datum's image as (C, H, W): uint8 from `data`, float32 from `float_data`,
    decoded when `encoded` (color as in cct.data.images.decode_image)."""
    if datum.encoded:
        return decode_image(datum.data, color, what)
    shape = (datum.channels, datum.height, datum.width)
    count = shape[0] * shape[1] * shape[2]
    if datum.data:
        array = np.frombuffer(datum.data, dtype=np.uint8)
    elif len(datum.float_data):
        array = np.array(datum.float_data, dtype=np.float32)
    else:
        raise DataError(f"{what}: datum holds no data (neither data nor float_data)")
    if min(shape) <= 0 or array.size != count:
        raise DataError(f"{what}: datum shape mismatch: channels x height x width = "
                        f"{shape[0]}x{shape[1]}x{shape[2]} but it holds {array.size} values")
    return array.reshape(shape)


def array_to_datum(array, label=None):
    """(C, H, W) -> Datum: uint8 arrays into `data`, others into `float_data`
    (pycaffe's caffe.io.array_to_datum)."""
    array = np.asarray(array)
    if array.ndim != 3:
        raise ShapeError(f"array_to_datum: need a (channels, height, width) array, got shape {array.shape}")
    datum = caffe_pb2.Datum(channels=array.shape[0], height=array.shape[1], width=array.shape[2])
    if array.dtype == np.uint8:
        datum.data = array.tobytes()
    else:
        datum.float_data.extend(array.astype(np.float32).ravel().tolist())
    if label is not None:
        datum.label = int(label)
    return datum


def load_mean_file(path, what="mean_file"):
    """A binaryproto mean (1, C, H, W) as a float32 (C, H, W) array."""
    from cct.formats.weights import blob_proto_to_array
    path = os.fspath(path)
    try:
        with open(path, "rb") as handle:
            proto = caffe_pb2.BlobProto.FromString(handle.read())
    except FileNotFoundError:
        raise ConfigError(f"{what}: mean file {path!r} not found") from None
    except Exception as error:                  # protobuf's DecodeError and friends
        raise ConfigError(f"{what}: {path} is not a BlobProto: {error}") from None
    try:
        mean = blob_proto_to_array(proto)
    except Exception as error:
        raise ConfigError(f"{what}: {path}: {error}") from None
    if mean.ndim == 4 and mean.shape[0] == 1:
        mean = mean[0]
    if mean.ndim != 3:
        raise ConfigError(f"{what}: {path} holds a blob of shape {mean.shape}; a mean is 1 x C x H x W")
    return mean


def save_mean_file(mean, path):
    """Write a (C, H, W) mean as Caffe's binaryproto (legacy 1 x C x H x W dims,
    as compute_image_mean writes it)."""
    mean = np.asarray(mean, dtype=np.float32)
    proto = caffe_pb2.BlobProto(num=1, channels=mean.shape[0], height=mean.shape[1], width=mean.shape[2])
    proto.data.extend(mean.ravel().tolist())
    atomic_write(path, proto.SerializeToString())


# --- the transformer ------------------------------------------------------------------
class DataTransformer:
    """Caffe's DataTransformer for one TransformationParameter and phase.
    `rng` (a numpy Generator) draws crops and mirrors; data layers give each
    prefetch thread its own, seeded from cct.core.rng, so runs repeat under a seed."""

    def __init__(self, param, phase=TRAIN, rng=None, where="transform_param"):
        self.param = param
        self.phase = phase
        self.where = where
        self.rng = rng if rng is not None else np.random.default_rng()
        self.scale = np.float32(param.scale)
        self.crop_size = int(param.crop_size)
        self.mirror = bool(param.mirror)
        if param.force_color and param.force_gray:
            raise self._error("force_color", "force_color and force_gray cannot both be set")
        self.color = "color" if param.force_color else "gray" if param.force_gray else "native"
        if param.mean_file and len(param.mean_value):
            raise self._error("mean_file", "give mean_file or mean_value, not both")
        self.mean_image = load_mean_file(param.mean_file, f"{where}: transform_param.mean_file") \
            if param.mean_file else None
        self.mean_values = np.array(param.mean_value, dtype=np.float32) if len(param.mean_value) else None

    def _error(self, field, message):
        return ConfigError(f"{self.where}: transform_param.{field}: {message}")

    def decode(self, datum, what="datum"):
        """A Datum's image (C, H, W), decoded as force_color/force_gray say."""
        return datum_to_array(datum, what, self.color)

    def infer_shape(self, image_shape):
        """The (C, h, w) that transform gives for a (C, H, W) image."""
        channels, height, width = image_shape
        self._check_image_shape(image_shape)
        if self.crop_size:
            return channels, self.crop_size, self.crop_size
        return channels, height, width

    def _check_image_shape(self, image_shape):
        channels, height, width = image_shape
        if self.crop_size and (height < self.crop_size or width < self.crop_size):
            raise self._error("crop_size", f"{self.crop_size} is larger than the {height}x{width} image")
        if self.mean_image is not None and self.mean_image.shape != tuple(image_shape):
            raise self._error("mean_file", f"{self.param.mean_file} is {_dims(self.mean_image.shape)} "
                              f"but the images are {_dims(image_shape)}")
        if self.mean_values is not None and self.mean_values.size not in (1, channels):
            raise self._error("mean_value", f"give one value or one per channel ({channels}), "
                              f"got {self.mean_values.size}")

    def transform(self, image):
        """One (C, H, W) image -> float32 (C, h, w)."""
        return self.transform_batch(np.asarray(image)[None])[0]

    def transform_batch(self, images, out=None):
        """(N, C, H, W) images -> float32 (N, C, h, w), each with its own crop and
        mirror draw. `out` (float32, the output shape) is filled when given."""
        n, channels, height, width = images.shape
        self._check_image_shape((channels, height, width))
        mean = self.mean_image
        if self.mean_values is not None:
            mean = np.broadcast_to(self.mean_values, (channels,)).reshape(channels, 1, 1)
        crop = self.crop_size
        if crop and self.phase == TRAIN and (height > crop or width > crop):
            # Per-image random offsets: gather every image's window in one indexing op.
            rows = self.rng.integers(0, height - crop + 1, n)[:, None] + np.arange(crop)    # (N, crop)
            cols = self.rng.integers(0, width - crop + 1, n)[:, None] + np.arange(crop)
            c_index = np.arange(channels)[None, :, None, None]
            r_index, c_cols = rows[:, None, :, None], cols[:, None, None, :]
            pixels = images[np.arange(n)[:, None, None, None], c_index, r_index, c_cols]
            if self.mean_image is not None:
                mean = self.mean_image[c_index, r_index, c_cols]                       # (N, C, crop, crop)
        else:
            if crop:
                top, left = (height - crop) // 2, (width - crop) // 2
                window = (slice(top, top + crop), slice(left, left + crop))
                pixels = images[(slice(None), slice(None)) + window]
                if self.mean_image is not None:
                    mean = self.mean_image[(slice(None),) + window]
            else:
                pixels = images
        if out is None:
            out = np.empty(pixels.shape, np.float32)
        np.copyto(out, pixels, casting="unsafe")
        if mean is not None:
            out -= mean
        if self.scale != 1:
            out *= self.scale
        if self.mirror:
            flip = self.rng.integers(0, 2, n).astype(bool)
            out[flip] = out[flip, :, :, ::-1]
        return out


def _dims(shape):
    return "x".join(str(d) for d in shape)
