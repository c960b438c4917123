"""Caffe's image pipeline before the DataTransformer: decode, colour or grey,
resize, encode, through OpenCV (the `opencv-python-headless` wheel), the library
Caffe itself calls, so that the pixels are Caffe's bit for bit:

    read_image    Caffe's ReadImageToCVMat: cv::imread with IMREAD_COLOR (3 channels
                  BGR) or IMREAD_GRAYSCALE (1 channel, grey made by OpenCV's
                  decoders), then cv::resize INTER_LINEAR when both sizes are set
    decode_image  Caffe's DecodeDatumToCVMat (color / gray) and
                  DecodeDatumToCVMatNative (native: IMREAD_UNCHANGED)
    resize_image  cv::resize INTER_LINEAR: no antialiasing, OpenCV's fixed-point
                  rounding (Pillow's bilinear antialiases when shrinking)
    encode_image  cv::imencode, as convert_imageset --encode_type

IMREAD_COLOR and IMREAD_GRAYSCALE apply a JPEG's EXIF orientation, as Caffe's
OpenCV 4 build did; IMREAD_UNCHANGED does not (nor did Caffe's native decode).
Arrays cross this module as uint8 (channels, height, width), BGR or grey;
OpenCV's (height, width[, channels]) stays inside.
pycaffe's caffe.io (cct.io) follows scikit-image instead and does not use this.
"""
import os

import numpy as np

from cct.core.errors import ConfigError, DataError

READ_FLAGS = {"color": "IMREAD_COLOR", "gray": "IMREAD_GRAYSCALE", "native": "IMREAD_UNCHANGED"}


def _cv2():
    import cv2                  # on first use: importing OpenCV costs ~0.1 s
    return cv2


def read_image(path, new_height=0, new_width=0, is_color=True):
    """The image file at `path` as uint8 (C, H, W), BGR (is_color) or grey,
    resized to new_height x new_width when both are non-zero."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except (FileNotFoundError, IsADirectoryError, ValueError):      # ValueError: a null byte in the name
        raise DataError(f"{path}: could not open or find file") from None
    except OSError as error:
        raise DataError(f"{path}: cannot read: {error.strerror}") from None
    image = _decode_hwc(data, "color" if is_color else "gray", path)
    if new_height > 0 and new_width > 0:
        image = _resize_hwc(image, new_height, new_width)
    return _to_chw(image)


def decode_image(data, color="native", what="image"):
    """Encoded bytes (JPEG, PNG, BMP, ...) -> uint8 (C, H, W). color: "color"
    (3 channels BGR), "gray" (1) or "native" (as stored: 1 for grey, 3 for colour,
    4 for an alpha PNG, no EXIF rotation)."""
    return _to_chw(_decode_hwc(data, color, what))


def resize_image(image, new_height, new_width):
    """uint8 (C, H, W) -> (C, new_height, new_width) by cv::resize INTER_LINEAR."""
    image = np.asarray(image)
    hwc = np.ascontiguousarray(image.transpose(1, 2, 0))
    return _to_chw(_resize_hwc(hwc, new_height, new_width))


def encode_image(image, encode_type, what="image"):
    """uint8 (C, H, W) BGR or grey -> bytes by cv::imencode in the format named by
    `encode_type` (a file extension: png, jpg, bmp, ...)."""
    cv2 = _cv2()
    image = np.asarray(image, dtype=np.uint8)
    hwc = image[0] if image.shape[0] == 1 else np.ascontiguousarray(image.transpose(1, 2, 0))
    ext = "." + encode_type.lower().lstrip(".")
    try:
        ok, buffer = cv2.imencode(ext, hwc)
    except cv2.error:
        ok = False              # OpenCV raises for an extension it has no encoder for
    if not ok:
        raise ConfigError(f"{what}: cannot encode as {encode_type!r} (OpenCV has no such encoder)")
    return buffer.tobytes()


def _decode_hwc(data, color, what):
    cv2 = _cv2()
    if color not in READ_FLAGS:
        raise ConfigError(f"{what}: unknown color mode {color!r}; use one of {sorted(READ_FLAGS)}")
    buffer = np.frombuffer(data, np.uint8)
    try:
        image = cv2.imdecode(buffer, getattr(cv2, READ_FLAGS[color])) if buffer.size else None
    except cv2.error as error:              # a header OpenCV refuses, such as a width past its limit
        raise DataError(f"{what}: cannot decode image ({len(data)} bytes): "
                        f"{str(error).strip().splitlines()[-1]}") from None
    if image is None:
        raise DataError(f"{what}: cannot decode image ({len(data)} bytes: not an image format OpenCV reads)")
    if image.dtype != np.uint8:
        # Caffe's DataTransformer checks the same (16-bit PNG, float TIFF read natively).
        raise DataError(f"{what}: image data type must be unsigned char (8 bits), got {image.dtype}")
    return image


def _resize_hwc(image, new_height, new_width):
    """(H, W[, C]) -> (new_height, new_width[, C]): OpenCV takes the size as (width, height)."""
    cv2 = _cv2()
    resized = cv2.resize(image, (int(new_width), int(new_height)), interpolation=cv2.INTER_LINEAR)
    return resized.reshape(new_height, new_width, *image.shape[2:])     # OpenCV drops a channel axis of 1


def _to_chw(image):
    """OpenCV's (H, W) or (H, W, C) -> contiguous (C, H, W)."""
    if image.ndim == 2:
        return image[None]
    return np.ascontiguousarray(image.transpose(2, 0, 1))
