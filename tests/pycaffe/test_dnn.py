"""cct.dnn, OpenCV 4's Caffe API (cct/dnn.py): blobFromImage(s) bit for bit
against OpenCV 5's own (in this process) and OpenCV 4.14's (in a child: two
OpenCV builds do not load into one process), an OpenCV 4 face-detection
script run with cv2.dnn replaced by cct.dnn against the same script under
OpenCV 4.14, and the net's API on a small net. The OpenCV 4 comparisons skip,
with one reason, where OpenCV 4 (or the face detector's wheel) is absent."""
import json
import subprocess
import sys

import cv2
import numpy as np
import pytest

import cct
from cct.core.errors import ConfigError, ShapeError
from helpers.opencv4 import OPENCV4_PATH, compare_scripts, require_opencv4
from helpers.res10 import res10_files, shared_images

RNG = np.random.default_rng(38)


# --- blobFromImage(s) -------------------------------------------------------------
def image(height, width, channels, dtype, rng=RNG):
    """channels 0: a 2-d (grey) image."""
    shape = (height, width) if channels == 0 else (height, width, channels)
    if dtype == np.uint8:
        return rng.integers(0, 256, shape, dtype=np.uint8)
    return (rng.random(shape) * 300 - 20).astype(dtype)


# (image shape and type, blobFromImage's arguments after the image)
CASES = [
    ((7, 9, 3, np.uint8), dict(scalefactor=1.0, size=(4, 4))),
    ((37, 50, 3, np.uint8), dict(scalefactor=1.0, size=(300, 300), mean=(104.0, 177.0, 123.0))),
    ((37, 50, 3, np.uint8), dict(scalefactor=1 / 255, size=(224, 224), mean=(0.485, 0.456, 0.406), swapRB=True)),
    ((61, 97, 3, np.uint8), dict(scalefactor=0.017, size=(32, 24), mean=(103.94, 116.78, 123.68), swapRB=True,
                                 crop=True)),
    ((61, 97, 3, np.float32), dict(scalefactor=0.5, size=(40, 30), mean=100.0, crop=True)),
    ((61, 97, 3, np.float32), dict(size=(61, 97))),
    ((120, 160, 0, np.uint8), dict(scalefactor=2.0, size=(33, 17), mean=(12.5,), swapRB=True)),
    ((120, 160, 1, np.float32), dict(scalefactor=1.5, size=(50, 50), mean=7.0, crop=True)),
    ((45, 33, 4, np.uint8), dict(size=(20, 30), mean=(1, 2, 3, 4), swapRB=True, crop=True)),
    ((45, 33, 3, np.float64), dict(scalefactor=0.25, size=(16, 16), mean=(3.0, 2.0, 1.0))),
    ((45, 33, 3, np.uint8), dict(size=(300, 300), ddepth=cv2.CV_8U)),
    ((45, 33, 3, np.uint8), dict(size=(64, 64), swapRB=True, crop=True, ddepth=cv2.CV_8U)),
    ((45, 33, 3, np.uint8), dict()),
]


def case_images(index):
    """Case `index`'s image, the same at every call."""
    return image(*CASES[index][0], rng=np.random.default_rng(index))


def ours(index):
    return cct.dnn.blobFromImage(case_images(index), **CASES[index][1])


@pytest.mark.parametrize("index", range(len(CASES)))
def test_blob_from_image_against_opencv5(index):
    theirs = cv2.dnn.blobFromImage(case_images(index), **CASES[index][1])
    mine = ours(index)
    assert mine.dtype == theirs.dtype and mine.shape == theirs.shape
    np.testing.assert_array_equal(mine, theirs)


def test_blob_from_images_against_opencv5():
    images = [image(37, 50, 3, np.uint8), image(61, 97, 3, np.uint8), image(20, 20, 3, np.uint8)]
    for kwargs in (dict(), dict(scalefactor=0.5, size=(31, 23), mean=(1, 2, 3), swapRB=True, crop=True)):
        np.testing.assert_array_equal(cct.dnn.blobFromImages(images, **kwargs),
                                      cv2.dnn.blobFromImages(images, **kwargs))


# argv: the OpenCV 4 folder, the cases as JSON, the images' .npz, the blobs' .npz
_BLOB_CHILD = r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import cv2
cases, images = json.loads(sys.argv[2]), np.load(sys.argv[3])
blobs = {str(k): cv2.dnn.blobFromImage(images[str(k)], **kwargs) for k, kwargs in enumerate(cases)}
blobs["batch"] = cv2.dnn.blobFromImages([images["0"], images["1"], images["2"]], 0.5, (31, 23), (1, 2, 3),
                                        True, True)
np.savez(sys.argv[4], **blobs)
"""


def test_blob_from_image_against_opencv4(tmp_path):
    require_opencv4()
    images = {str(k): case_images(k) for k in range(len(CASES))}
    np.savez(tmp_path / "in.npz", **images)
    run = subprocess.run([sys.executable, "-c", _BLOB_CHILD, OPENCV4_PATH, json.dumps([c[1] for c in CASES]),
                          str(tmp_path / "in.npz"), str(tmp_path / "out.npz")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    with np.load(tmp_path / "out.npz") as theirs:
        for k in range(len(CASES)):
            mine = ours(k)
            assert mine.dtype == theirs[str(k)].dtype, CASES[k]
            np.testing.assert_array_equal(mine, theirs[str(k)], err_msg=str(CASES[k]))
        batch = cct.dnn.blobFromImages([images["0"], images["1"], images["2"]], 0.5, (31, 23), (1, 2, 3), True, True)
        np.testing.assert_array_equal(batch, theirs["batch"])


def test_blob_from_image_refuses():
    with pytest.raises(ValueError, match="CV_8U allows no scalefactor"):
        cct.dnn.blobFromImage(image(5, 5, 3, np.uint8), 2.0, ddepth=cct.dnn.CV_8U)
    with pytest.raises(ShapeError, match="1, 3 or 4 channels"):
        cct.dnn.blobFromImage(image(5, 5, 2, np.uint8))
    with pytest.raises(ValueError, match="ddepth must be"):
        cct.dnn.blobFromImage(image(5, 5, 3, np.uint8), ddepth=cct.dnn.CV_64F)


def test_constants_are_opencvs():
    for name in ("DNN_BACKEND_DEFAULT", "DNN_BACKEND_OPENCV", "DNN_BACKEND_CUDA", "DNN_TARGET_CPU",
                 "DNN_TARGET_OPENCL", "DNN_TARGET_OPENCL_FP16", "DNN_TARGET_CUDA"):
        assert getattr(cct.dnn, name) == getattr(cv2.dnn, name), name
    assert (cct.dnn.CV_32F, cct.dnn.CV_8U) == (cv2.CV_32F, cv2.CV_8U)
    assert cct.dnn.getTickFrequency() == cv2.getTickFrequency()


# --- the net's API on a small net ----------------------------------------------------
SMALL = """name: "small"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 dim: 4 dim: 4 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 3 kernel_size: 3 weight_filler { type: "gaussian" std: 1 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool" pooling_param { pool: MAX kernel_size: 2 } }
layer { name: "scale" type: "Scale" bottom: "conv" top: "scaled" scale_param { bias_term: false } }
"""


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "small.prototxt"
    path.write_text(SMALL)
    return cct.dnn.readNetFromCaffe(str(path))


def test_names_ids_and_outputs(small):
    assert small.getLayerNames() == ("conv", "relu", "pool", "scale")
    assert small.getLayerId("pool") == 3 and small.getLayerId("data") == -1
    outs = small.getUnconnectedOutLayers()
    assert outs.dtype == np.int32 and outs.tolist() == [3, 4]
    assert small.getUnconnectedOutLayersNames() == ("pool", "scale")
    assert small.getLayer(0).name == "_input" and small.getLayer(0).blobs == ()
    layer = small.getLayer(1)
    assert (layer.name, layer.type) == ("conv", "Convolution")
    assert [b.shape for b in layer.blobs] == [(3, 2, 3, 3), (3, 1)]          # a 1-d blob as OpenCV's N x 1 Mat
    assert small.getLayer("scale").type == "Scale"


def test_blobs_write_and_forward_names(small):
    x = RNG.standard_normal((1, 2, 4, 4)).astype(np.float32)
    weights = RNG.standard_normal((3, 2, 3, 3)).astype(np.float32)
    small.getLayer(small.getLayerId("conv")).blobs = [weights, np.array([1.0, -2.0, 0.5])]
    small.getLayer(4).blobs = [np.full((1, 3), 2.5, np.float32)]                # count, not shape, must fit
    small.setInput(x)
    pre, post, scaled = small.forward(["conv", "relu", "scale"])
    want = np.zeros((1, 3, 2, 2), np.float32)
    for o in range(3):
        for i in range(2):
            for j in range(2):
                want[0, o, i, j] = (x[0, :, i:i + 3, j:j + 3] * weights[o]).sum() + [1.0, -2.0, 0.5][o]
    np.testing.assert_allclose(pre, want, rtol=1e-5, atol=1e-5)          # before the in-place ReLU, as OpenCV
    np.testing.assert_allclose(post, np.maximum(want, 0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(scaled, 2.5 * np.maximum(want, 0), rtol=1e-5, atol=1e-5)
    assert small.forward("pool").shape == (1, 3, 1, 1)
    assert small.forward().shape == (1, 3, 2, 2)                          # the last layer's output
    total, per_layer = small.getPerfProfile()
    assert isinstance(total, int) and per_layer.shape == (4,) and per_layer.dtype == np.float64
    assert total == int(per_layer.sum()) and per_layer[0] > 0
    with pytest.raises(ShapeError, match="blobs\\[0\\]"):
        small.getLayer(1).blobs = [np.zeros(5)]
    with pytest.raises(ConfigError, match="'nope' not found"):
        small.forward("nope")


def test_set_input_scale_mean_and_shape(small):
    x = RNG.standard_normal((2, 2, 5, 5)).astype(np.float32) * 10
    small.setInput(x, "data", 0.5, (3.0, -1.0))
    np.testing.assert_allclose(small.net.blobs["data"].data, (x - np.array([3.0, -1.0]).reshape(1, 2, 1, 1)) * 0.5,
                               rtol=1e-6, atol=1e-5)
    assert small.forward("conv").shape == (2, 3, 3, 3)                   # a new shape reshapes the net
    small.setInput(x, scalefactor=2.0, mean=1.0)
    np.testing.assert_allclose(small.net.blobs["data"].data, (x - 1.0) * 2.0, rtol=1e-6, atol=1e-5)
    with pytest.raises(ConfigError, match="not an input"):
        small.setInput(x, "conv")


def test_read_net_either_order_and_refusals(tmp_path):
    proto = tmp_path / "net.prototxt"
    proto.write_text(SMALL)
    weights = tmp_path / "net.caffemodel"
    cct.Net(str(proto), cct.TEST).save(str(weights))
    for model, config in ((weights, proto), (proto, weights)):
        assert cct.dnn.readNet(str(model), str(config)).getLayerNames() == ("conv", "relu", "pool", "scale")
    with pytest.raises(ConfigError, match="model.onnx"):
        cct.dnn.readNet(str(tmp_path / "model.onnx"))
    with pytest.raises(ConfigError, match="caffeModel .*missing.caffemodel"):
        cct.dnn.readNetFromCaffe(str(proto), str(tmp_path / "missing.caffemodel"))


def test_detections_in_opencv_layout():
    rows = np.array([[0, 1, 0.9, 0.1, 0.1, 0.5, 0.5], [1, 1, 0.8, 0.2, 0.2, 0.4, 0.4]], np.float32)
    out = cct.dnn._opencv_detections(rows.reshape(1, 1, 2, 7), 5, 2)
    assert out.shape == (1, 1, 10, 7) and np.array_equal(out[0, 0, :2], rows) and not out[0, 0, 2:].any()
    none = cct.dnn._opencv_detections(np.array([[0, -1, -1, -1, -1, -1, -1]], np.float32), 3, 1)
    assert none.shape == (1, 1, 3, 7) and not none.any()


# --- an OpenCV 4 face-detection script, with cv2.dnn replaced by cct.dnn -----------------
FACE_SCRIPT = """
import sys
import cv2
import numpy as np
net = cv2.dnn.readNetFromCaffe(sys.argv[1], sys.argv[2])
threshold = float(sys.argv[3])          # the samples' --confidence
for path in sys.argv[4:]:
    image = cv2.imread(path)
    (h, w) = image.shape[:2]
    blob = cv2.dnn.blobFromImage(image, 1.0, (300, 300), (104.0, 177.0, 123.0))
    net.setInput(blob)
    detections = net.forward()
    for i in range(0, detections.shape[2]):
        confidence = detections[0, 0, i, 2]
        if confidence > threshold:
            box = detections[0, 0, i, 3:7] * np.array([w, h, w, h])
            (startX, startY, endX, endY) = box.astype("int")
            print(path, float(confidence), *[float(v) for v in detections[0, 0, i, 3:7]], startX, startY, endX, endY,
                  sep="\t")
"""


@pytest.mark.slow
def test_opencv4_face_script_with_cct_dnn(tmp_path):
    require_opencv4()
    files = res10_files(tmp_path)
    images = shared_images()
    # 0.1, not the samples' 0.5: these images hold no face, so only low-confidence boxes are found
    args = [files["prototxt"], files["caffemodel"], "0.1", *images]
    faces, worst = compare_scripts(FACE_SCRIPT, args)
    assert faces > 0
    print(f"face script: {faces} faces, as OpenCV 4.14's; boxes within {worst:.2g}")
