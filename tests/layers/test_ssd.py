"""SSD's layers (layers/ssd.py): forward against naive loops written from the
fork's C++ (weiliu89/caffe branch ssd), gradients of Normalize and Permute,
the parameters' errors, and forward against OpenCV 4's DNN module on
one-layer and small nets and on OpenCV's res10 face detector (those skip, with
one reason each, where OpenCV 4 or the model's package is not here)."""
import math
from pathlib import Path

import numpy as np
import pytest

import cct
from cct.core.errors import ConfigError, ShapeError
from cct.testing.gradient_check import check_layer_gradient, make_layer
from helpers.layers import run_layer
from helpers.opencv4 import (assert_close, assert_same_detections, compare_with_opencv, detections_of,
                             opencv4_forward, require_opencv4)
from helpers.res10 import face_blob, res10_files, shared_images

RNG = np.random.default_rng(38)
F32 = np.float32


def rand(*shape):
    return RNG.standard_normal(shape)


# --- Normalize ----------------------------------------------------------------------
def naive_normalize(x, scale, across_spatial, eps=1e-10):
    """The fork's Forward_cpu, image by image and pixel by pixel."""
    n, c = x.shape[:2]
    x3 = x.reshape(n, c, -1)
    y = np.empty_like(x3)
    for i in range(n):
        if across_spatial:
            y[i] = x3[i] / math.sqrt(np.sum(x3[i] ** 2) + eps)
        else:
            for s in range(x3.shape[2]):
                y[i, :, s] = x3[i, :, s] / math.sqrt(np.sum(x3[i, :, s] ** 2) + eps)
        y[i] *= np.asarray(scale).reshape(-1, 1)
    return y.reshape(x.shape)


def normalize_text(across, shared, scale=None):
    filler = f"scale_filler {{ type: 'constant' value: {scale} }}" if scale is not None else ""
    return (f'type: "Normalize" norm_param {{ across_spatial: {str(across).lower()} '
            f'channel_shared: {str(shared).lower()} {filler} }}')


@pytest.mark.parametrize("across", [True, False])
@pytest.mark.parametrize("shared", [True, False])
def test_normalize_forward(across, shared):
    x = rand(2, 3, 4, 5)
    scale = [2.5] if shared else [0.5, 2.0, -1.5]
    layer = make_layer(normalize_text(across, shared))
    layer.blobs.append(cct.Blob(() if shared else (3,)))
    layer.blobs[0].data[...] = np.asarray(scale).reshape(layer.blobs[0].shape)
    _, _, tops = run_layer("", [x], layer=layer)
    np.testing.assert_allclose(tops[0].data, naive_normalize(x, scale, across), rtol=1e-12)


def test_normalize_defaults_and_two_axes():
    layer, _, tops = run_layer('type: "Normalize"', [rand(3, 4)])
    assert layer.blobs[0].shape == () and layer.blobs[0].data == 1.0    # channel_shared, constant 1
    np.testing.assert_allclose(np.sum(tops[0].data ** 2, axis=1), 1.0)   # across_spatial: one norm per image


@pytest.mark.parametrize("across", [True, False])
@pytest.mark.parametrize("shared", [True, False])
def test_normalize_gradient(across, shared):
    # equal per-channel scales: where the fork's backward is the exact gradient (see the next test)
    check_layer_gradient(make_layer(normalize_text(across, shared, 1.7)), [rand(2, 3, 2, 3)])


def test_normalize_backward_is_the_forks_with_distinct_scales():
    """With per-channel scales that differ, the fork's bottom gradient scales
    dy - x * sum(x * dy) / n^2 by s_c (normalize_layer.cpp); cct gives the same."""
    x, scale = rand(2, 3, 2, 2), np.array([0.5, 2.0, -1.5])
    layer = make_layer(normalize_text(False, False, 1.0))
    layer.blobs.append(cct.Blob((3,)))
    layer.blobs[0].data[...] = scale
    _, bottoms, tops = run_layer("", [x], layer=layer)
    dy = rand(*x.shape)
    tops[0].diff[...] = dy
    layer.blobs[0].diff[...] = 0
    layer.backward(tops, [True], bottoms)
    norm = np.sqrt(np.sum(x * x, axis=1, keepdims=True) + 1e-10)
    dot = np.sum(x * dy, axis=1, keepdims=True)
    want = (dy - x * dot / norm ** 2) / norm * scale.reshape(1, 3, 1, 1)
    np.testing.assert_allclose(bottoms[0].diff, want, rtol=1e-12)
    np.testing.assert_allclose(layer.blobs[0].diff, np.sum(dy * x / norm, axis=(0, 2, 3)), rtol=1e-12)


def test_normalize_errors():
    with pytest.raises(ShapeError, match="2 to 4 axes"):
        run_layer('type: "Normalize"', [rand(3)])
    layer = make_layer(normalize_text(False, False))
    layer.blobs.append(cct.Blob((2,)))
    with pytest.raises(ConfigError, match=r"normalize.*norm_param.channel_shared.*2 values, expected 3"):
        run_layer("", [rand(1, 3, 2, 2)], layer=layer)


# --- Permute ------------------------------------------------------------------------
def naive_permute(x, order):
    """The fork's index arithmetic: top index i from the new steps to the old offset."""
    top_shape = [x.shape[a] for a in order]
    old_steps = [math.prod(x.shape[a + 1:]) for a in range(x.ndim)]
    new_steps = [math.prod(top_shape[a + 1:]) for a in range(x.ndim)]
    flat, out = x.reshape(-1), np.empty(math.prod(top_shape))
    for i in range(out.size):
        old, rest = 0, i
        for j, axis in enumerate(order):
            old += (rest // new_steps[j]) * old_steps[axis]
            rest %= new_steps[j]
        out[i] = flat[old]
    return out.reshape(top_shape)


@pytest.mark.parametrize("given, order", [((0, 2, 3, 1), (0, 2, 3, 1)), ((1, 0), (1, 0, 2, 3)),
                                          ((), (0, 1, 2, 3)), ((3, 1), (3, 1, 0, 2))])
def test_permute_forward_and_gradient(given, order):
    x = rand(2, 3, 4, 5)
    text = 'type: "Permute" permute_param { ' + " ".join(f"order: {a}" for a in given) + " }"
    layer, _, tops = run_layer(text, [x])
    assert layer.order == order
    np.testing.assert_array_equal(tops[0].data, naive_permute(x, order))
    check_layer_gradient(make_layer(text), [rand(2, 3, 2, 2)])


def test_permute_errors():
    with pytest.raises(ConfigError, match=r"permute_param.order: axis 4 is out of range"):
        run_layer('type: "Permute" permute_param { order: 4 }', [rand(1, 2, 3, 4)])
    with pytest.raises(ConfigError, match=r"permute_param.order: axis 1 is given twice"):
        run_layer('type: "Permute" permute_param { order: 1 order: 1 }', [rand(1, 2, 3, 4)])


# --- PriorBox -----------------------------------------------------------------------
def naive_prior_box(p, height, width, img_h, img_w):
    """The fork's Forward_cpu loop: (1, 2, H * W * P * 4), float math as the fork's."""
    ratios = [1.0]
    for ar in p.get("aspect_ratio", []):
        if all(abs(ar - r) >= 1e-6 for r in ratios):
            ratios.append(ar)
            if p.get("flip", True):
                ratios.append(float(F32(1.0 / F32(ar))))
    img_h, img_w = p.get("img_h", img_h), p.get("img_w", img_w)
    step_h = F32(p["step"]) if "step" in p else F32(img_h) / F32(height)
    step_w = F32(p["step"]) if "step" in p else F32(img_w) / F32(width)
    offset, boxes = F32(p.get("offset", 0.5)), []
    for h in range(height):
        for w in range(width):
            cx, cy = (F32(w) + offset) * step_w, (F32(h) + offset) * step_h
            for s, low in enumerate(p["min_size"]):
                low = int(low)
                sizes = [(low, low)]
                if p.get("max_size"):
                    side = F32(math.sqrt(low * int(p["max_size"][s])))
                    sizes.append((side, side))
                sizes += [(F32(low) * np.sqrt(F32(r)), F32(low) / np.sqrt(F32(r))) for r in ratios if abs(r - 1) >= 1e-6]
                for bw, bh in sizes:
                    boxes += [(float(cx) - float(bw) / 2) / img_w, (float(cy) - float(bh) / 2) / img_h,
                              (float(cx) + float(bw) / 2) / img_w, (float(cy) + float(bh) / 2) / img_h]
    boxes = np.array(boxes, F32)
    if p.get("clip"):
        boxes = np.clip(boxes, 0, 1)
    variance = p.get("variance", [0.1])
    return np.stack([boxes, np.resize(np.array(variance, F32), boxes.size)])[None]


def prior_box_text(p):
    fields = []
    for key, value in p.items():
        values = value if isinstance(value, list) else [value]
        fields += [f"{key}: {str(v).lower() if isinstance(v, bool) else v}" for v in values]
    return 'type: "PriorBox" prior_box_param { ' + " ".join(fields) + " }"


PRIOR_BOXES = [
    {"min_size": [30.0], "max_size": [60.0], "aspect_ratio": [2.0], "flip": True, "clip": False,
     "variance": [0.1, 0.1, 0.2, 0.2], "step": 8, "offset": 0.5},
    {"min_size": [10.5, 20.0], "aspect_ratio": [2.0, 3.0, 2.0], "flip": False, "clip": True, "variance": [0.1]},
    {"min_size": [16.0], "max_size": [40.0], "aspect_ratio": [0.5, 3.0], "clip": False, "variance": [0.2],
     "img_h": 90, "img_w": 120, "offset": 0.25},
    {"min_size": [12.0], "aspect_ratio": [1.0, 2.5], "step": 10},     # the default variance (OpenCV needs one)
]


@pytest.mark.parametrize("index", range(len(PRIOR_BOXES)))
def test_prior_box_forward(index):
    p = PRIOR_BOXES[index]
    _, _, tops = run_layer(prior_box_text(p), [rand(2, 4, 3, 5), rand(2, 3, 60, 100)])
    want = naive_prior_box(p, 3, 5, 60, 100)
    assert tops[0].shape == want.shape
    np.testing.assert_allclose(tops[0].data, want, rtol=1e-6, atol=1e-7)


def test_prior_box_gives_zero_gradients():
    layer, bottoms, tops = run_layer(prior_box_text(PRIOR_BOXES[0]), [rand(1, 2, 2, 2), rand(1, 3, 16, 16)])
    bottoms[0].diff[...] = 5
    layer.backward(tops, [True, False], bottoms)
    assert not bottoms[0].diff.any()


@pytest.mark.parametrize("fields, message", [
    ("", r"prior_box_param.min_size: give at least one"),
    ("min_size: 4 max_size: 3", r"prior_box_param.max_size: must be > its min_size"),
    ("min_size: 4 min_size: 5 max_size: 8", r"prior_box_param.max_size: give one per min_size"),
    ("min_size: 4 variance: 0.1 variance: 0.2", r"prior_box_param.variance: give none, one or 4"),
    ("min_size: 4 step: 8 step_h: 4 step_w: 4", r"prior_box_param.step: give either step or step_h/step_w"),
    ("min_size: 4 img_size: 8 img_h: 4 img_w: 4", r"prior_box_param.img_size: give either"),
])
def test_prior_box_errors(fields, message):
    with pytest.raises(ConfigError, match=message):
        run_layer(f'type: "PriorBox" prior_box_param {{ {fields} }}', [rand(1, 1, 2, 2), rand(1, 1, 8, 8)])


# --- DetectionOutput ----------------------------------------------------------------
def naive_iou(a, b):
    """The fork's JaccardOverlap in float32."""
    if b[0] > a[2] or b[2] < a[0] or b[1] > a[3] or b[3] < a[1]:
        return F32(0)
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    if not (w > 0 and h > 0):
        return F32(0)
    inter = F32(w * h)
    return F32(inter / (naive_area(a) + naive_area(b) - inter))


def naive_area(box):
    return F32(0) if box[2] < box[0] or box[3] < box[1] else F32((box[2] - box[0]) * (box[3] - box[1]))


def naive_decode(prior, var, loc, code):
    """CENTER_SIZE (2) or CORNER (1), variances in the box, float32 steps."""
    if code == 1:
        return [F32(prior[k] + var[k] * loc[k]) for k in range(4)]
    pw, ph = F32(prior[2] - prior[0]), F32(prior[3] - prior[1])
    cx, cy = F32((prior[0] + prior[2]) / F32(2)), F32((prior[1] + prior[3]) / F32(2))
    dcx, dcy = F32(var[0] * loc[0] * pw + cx), F32(var[1] * loc[1] * ph + cy)
    dw, dh = F32(np.exp(F32(var[2] * loc[2])) * pw), F32(np.exp(F32(var[3] * loc[3])) * ph)
    return [F32(dcx - dw / F32(2)), F32(dcy - dh / F32(2)), F32(dcx + dw / F32(2)), F32(dcy + dh / F32(2))]


def naive_detection_output(loc, conf, priors, classes, share, background, code, threshold, nms_threshold,
                           top_k, keep_top_k, eta=1.0):
    """The fork's Forward_cpu with ApplyNMSFast, in plain loops."""
    num, npri = loc.shape[0], priors.shape[2] // 4
    loc_classes = 1 if share else classes
    loc = loc.reshape(num, npri, loc_classes, 4).astype(F32)
    conf = conf.reshape(num, npri, classes).astype(F32)
    boxes, variances = priors[0, 0].reshape(npri, 4), priors[0, 1].reshape(npri, 4)
    rows = []
    for i in range(num):
        found = {}
        for c in range(classes):
            if c == background:
                continue
            lc = 0 if share else c
            decoded = [naive_decode(boxes[p], variances[p], loc[i, p, lc], code) for p in range(npri)]
            order = sorted([p for p in range(npri) if conf[i, p, c] > threshold], key=lambda p: -conf[i, p, c])
            order = order[:top_k] if top_k > -1 else order
            kept, adaptive = [], F32(nms_threshold)
            for p in order:
                if all(naive_iou(decoded[p], decoded[k]) <= adaptive for k in kept):
                    kept.append(p)
                    if eta < 1 and adaptive > 0.5:
                        adaptive = F32(adaptive * F32(eta))
            found[c] = [(p, decoded[p]) for p in kept]
        if -1 < keep_top_k < sum(len(v) for v in found.values()):
            pairs = sorted([(c, p, box) for c in found for p, box in found[c]], key=lambda t: -conf[i, t[1], t[0]])
            found = {c: [(p, box) for cc, p, box in pairs[:keep_top_k] if cc == c] for c in sorted(found)}
        for c in sorted(found):
            rows += [[i, c, conf[i, p, c], *box] for p, box in found[c]]
    if not rows:
        return np.array([[i, -1, -1, -1, -1, -1, -1] for i in range(num)], F32)[None, None]
    return np.array(rows, F32)[None, None]


def ssd_inputs(num, classes, share, grid=3):
    """loc, softmax conf and PriorBox priors for a grid x grid map of a 30 x 30 image."""
    layer, _, tops = run_layer(prior_box_text({"min_size": [8.0], "max_size": [16.0], "aspect_ratio": [2.0],
                                               "variance": [0.1, 0.1, 0.2, 0.2], "clip": False}),
                               [rand(1, 1, grid, grid), rand(1, 3, 30, 30)])
    priors = tops[0].data.astype(F32)
    npri = priors.shape[2] // 4
    loc = (rand(num, npri * (1 if share else classes) * 4) * 0.5).astype(F32)
    logits = rand(num, npri, classes) * 2
    conf = (np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)).reshape(num, -1).astype(F32)
    return loc, conf, priors


def detection_text(classes, share=True, background=0, code="CENTER_SIZE", threshold=0.05, nms=0.45, top_k=40,
                   keep_top_k=20, eta=1.0):
    return (f'type: "DetectionOutput" detection_output_param {{ num_classes: {classes} '
            f'share_location: {str(share).lower()} background_label_id: {background} '
            f'nms_param {{ nms_threshold: {nms} top_k: {top_k} eta: {eta} }} code_type: {code} '
            f'keep_top_k: {keep_top_k} confidence_threshold: {threshold} }}')


CODES = {"CORNER": 1, "CENTER_SIZE": 2}
DETECTIONS = [  # (classes, share, background, code, keep_top_k, eta)
    (2, True, 0, "CENTER_SIZE", 20, 1.0), (4, True, 0, "CENTER_SIZE", 12, 1.0),
    (3, False, -1, "CORNER", -1, 1.0), (3, True, 1, "CENTER_SIZE", 30, 0.9), (3, False, 2, "CENTER_SIZE", 8, 1.0)]


@pytest.mark.parametrize("index", range(len(DETECTIONS)))
def test_detection_output_forward(index):
    classes, share, background, code, keep, eta = DETECTIONS[index]
    loc, conf, priors = ssd_inputs(2, classes, share)
    text = detection_text(classes, share, background, code, keep_top_k=keep, eta=eta)
    _, _, tops = run_layer(text, [loc, conf, priors])
    want = naive_detection_output(loc, conf, priors, classes, share, background, CODES[code], F32(0.05), 0.45,
                                  40, keep, eta)
    assert tops[0].shape == want.shape
    np.testing.assert_array_equal(tops[0].data.astype(F32), want)


def test_detection_output_nothing_found():
    """No score above the threshold (a softmax score is at most 1): the fork's row of -1 per image."""
    loc, conf, priors = ssd_inputs(3, 2, True)
    _, _, tops = run_layer(detection_text(2, threshold=1), [loc, conf, priors])
    want = np.full((1, 1, 3, 7), -1.0)
    want[0, 0, :, 0] = [0, 1, 2]
    np.testing.assert_array_equal(tops[0].data, want)


def test_detection_output_errors():
    loc, conf, priors = ssd_inputs(1, 2, True)
    with pytest.raises(ConfigError, match="detection_output_param.num_classes: must be given"):
        run_layer('type: "DetectionOutput"', [loc, conf, priors])
    with pytest.raises(ShapeError, match=r"conf \(bottom\[1\]\).*3 classes"):
        run_layer(detection_text(3), [loc, conf, priors])
    with pytest.raises(ConfigError, match="background_label_id: -1 .*share_location"):
        run_layer(detection_text(2, background=-1), [loc, conf, priors])
    with pytest.raises(ConfigError, match="nms_param.eta"):
        run_layer(detection_text(2, eta=1.5), [loc, conf, priors])
    with pytest.raises(NotImplementedError, match="no backward"):
        layer, bottoms, tops = run_layer(detection_text(2), [loc, conf, priors])
        layer.backward(tops, [True, False, False], bottoms)


# --- against OpenCV 4 ---------------------------------------------------------------
# (OpenCV 4 refuses per-channel scales across space: its scale must then be one value)
@pytest.mark.parametrize("across, shared", [(True, True), (False, True), (False, False)])
def test_normalize_against_opencv(tmp_path, across, shared):
    text = ('layer { name: "y" type: "Normalize" bottom: "x" top: "y" norm_param { '
            f'across_spatial: {str(across).lower()} channel_shared: {str(shared).lower()} }} }}\n')

    def scales(net):
        blob = net.params["y"][0]
        if shared:
            blob.reshape((1,))        # OpenCV 4 cannot read the fork's 0-d blob (a Mat of no axes)
        blob.data[...] = 20.0 if shared else RNG.uniform(1, 20, 4)
    ours, theirs = compare_with_opencv(tmp_path, text, {"x": rand(2, 4, 5, 3).astype(F32)}, ["y"], scales)
    assert_close(ours["y"], theirs["y"])


@pytest.mark.parametrize("order", [(0, 2, 3, 1), (0, 3, 1, 2), (1, 0, 2, 3)])
def test_permute_against_opencv(tmp_path, order):
    text = ('layer { name: "y" type: "Permute" bottom: "x" top: "y" permute_param { '
            + " ".join(f"order: {a}" for a in order) + " } }\n")
    ours, theirs = compare_with_opencv(tmp_path, text, {"x": rand(2, 3, 4, 5).astype(F32)}, ["y"])
    np.testing.assert_array_equal(ours["y"], theirs["y"])


# OpenCV 4 needs a variance, takes min_size and max_size as floats where the
# fork truncates them to ints, and sizes by the image where img_h/img_w say otherwise
OPENCV_PRIOR_BOXES = [PRIOR_BOXES[0],
                      {"min_size": [10.0, 20.0], "aspect_ratio": [2.0, 3.0, 2.0], "flip": False, "clip": True,
                       "variance": [0.1]},
                      {"min_size": [16.0], "max_size": [40.0], "aspect_ratio": [0.5, 3.0], "clip": False,
                       "variance": [0.2], "offset": 0.25}]


@pytest.mark.parametrize("index", range(len(OPENCV_PRIOR_BOXES)))
def test_prior_box_against_opencv(tmp_path, index):
    text = f'layer {{ name: "y" {prior_box_text(OPENCV_PRIOR_BOXES[index])} bottom: "f" bottom: "img" top: "y" }}\n'
    inputs = {"f": rand(1, 4, 3, 5).astype(F32), "img": rand(1, 3, 60, 100).astype(F32)}
    ours, theirs = compare_with_opencv(tmp_path, text, inputs, ["y"])
    assert_close(ours["y"], theirs["y"])


# DETECTIONS[2] (share_location false, no background) ends OpenCV 4's process
@pytest.mark.parametrize("index", [0, 1, 3, 4])
def test_detection_output_against_opencv(tmp_path, index):
    classes, share, background, code, keep, eta = DETECTIONS[index]
    loc, conf, priors = ssd_inputs(2, classes, share)
    text = f'layer {{ name: "y" {detection_text(classes, share, background, code, keep_top_k=keep)} ' \
           'bottom: "loc" bottom: "conf" bottom: "priors" top: "y" }\n'
    ours, theirs = compare_with_opencv(tmp_path, text, {"loc": loc, "conf": conf, "priors": priors}, ["y"])
    count, _ = assert_same_detections(ours["y"], theirs["y"])
    assert count > 0


# A small SSD: a convolution's features normalized, location and confidence
# heads permuted and flattened, priors from two maps, softmax, DetectionOutput.
SMALL_SSD = """
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 8 kernel_size: 3 stride: 2 pad: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "norm" type: "Normalize" bottom: "conv" top: "norm"
  norm_param { across_spatial: false channel_shared: false scale_filler { type: "constant" value: 10 } } }
layer { name: "pool" type: "Pooling" bottom: "norm" top: "pool" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
LOC_CONF_PRIOR(norm, 8)
LOC_CONF_PRIOR(pool, 16)
layer { name: "loc" type: "Concat" bottom: "norm_loc_flat" bottom: "pool_loc_flat" top: "loc" concat_param { axis: 1 } }
layer { name: "conf" type: "Concat" bottom: "norm_conf_flat" bottom: "pool_conf_flat" top: "conf" }
layer { name: "priors" type: "Concat" bottom: "norm_prior" bottom: "pool_prior" top: "priors" concat_param { axis: 2 } }
layer { name: "conf_reshape" type: "Reshape" bottom: "conf" top: "conf_reshape"
  reshape_param { shape { dim: 0 dim: -1 dim: 3 } } }
layer { name: "conf_softmax" type: "Softmax" bottom: "conf_reshape" top: "conf_softmax" softmax_param { axis: 2 } }
layer { name: "conf_flat" type: "Flatten" bottom: "conf_softmax" top: "conf_flat" }
layer { name: "det" type: "DetectionOutput" bottom: "loc" bottom: "conf_flat" bottom: "priors" top: "det"
  detection_output_param { num_classes: 3 share_location: true background_label_id: 0
    nms_param { nms_threshold: 0.45 top_k: 100 } code_type: CENTER_SIZE keep_top_k: 50 confidence_threshold: 0.2 } }
"""

HEAD = """
layer { name: "BLOB_loc" type: "Convolution" bottom: "BLOB" top: "BLOB_loc"
  convolution_param { num_output: 12 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "BLOB_loc_perm" type: "Permute" bottom: "BLOB_loc" top: "BLOB_loc_perm" permute_param { order: 0 order: 2 order: 3 order: 1 } }
layer { name: "BLOB_loc_flat" type: "Flatten" bottom: "BLOB_loc_perm" top: "BLOB_loc_flat" }
layer { name: "BLOB_conf" type: "Convolution" bottom: "BLOB" top: "BLOB_conf"
  convolution_param { num_output: 9 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.05 } } }
layer { name: "BLOB_conf_perm" type: "Permute" bottom: "BLOB_conf" top: "BLOB_conf_perm" permute_param { order: 0 order: 2 order: 3 order: 1 } }
layer { name: "BLOB_conf_flat" type: "Flatten" bottom: "BLOB_conf_perm" top: "BLOB_conf_flat" }
layer { name: "BLOB_prior" type: "PriorBox" bottom: "BLOB" bottom: "data" top: "BLOB_prior"
  prior_box_param { min_size: SIZE aspect_ratio: 2 flip: true clip: false variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 } }
"""


def small_ssd():
    text = SMALL_SSD
    for blob, size in (("norm", 8), ("pool", 16)):
        text = text.replace(f"LOC_CONF_PRIOR({blob}, {size})", HEAD.replace("BLOB", blob).replace("SIZE", str(size)))
    return text


def test_small_ssd_against_opencv(tmp_path):
    ours, theirs = compare_with_opencv(tmp_path, small_ssd(), {"data": rand(2, 3, 32, 32).astype(F32)},
                                       ["norm", "norm_loc_perm", "priors", "det"])
    for name in ("norm", "norm_loc_perm", "priors"):
        assert_close(ours[name], theirs[name])
    count, _ = assert_same_detections(ours["det"], theirs["det"])
    assert count > 0


def test_a_plan_runs_the_net_while_the_detection_count_changes(tmp_path):
    """DetectionOutput reshapes its top to the detections' count in every
    forward; that top feeds no layer, so the execution plan made after two
    forwards stays in use (no per-layer path for SSD nets) and each forward
    gives what a fresh net gives for its input."""
    path = tmp_path / "ssd.prototxt"
    text = small_ssd().replace("confidence_threshold: 0.2", "confidence_threshold: 0.95")   # counts below keep_top_k
    path.write_text('input: "data" input_shape { dim: 1 dim: 3 dim: 32 dim: 32 }\n' + text)
    inputs = [rand(1, 3, 32, 32).astype(F32) for _ in range(4)]
    inputs = [inputs[0], inputs[0]] + inputs
    expected = []
    for data in inputs:                         # each a fresh net's (building one changes every layout)
        cct.set_random_seed(5)
        expected.append(cct.Net(str(path), cct.TEST).forward(data=data)["det"].copy())
    assert len({rows.shape[2] for rows in expected}) > 1      # the detections' count does change
    cct.set_random_seed(5)
    net = cct.Net(str(path), cct.TEST)
    executor = net.executor
    for step, (data, rows) in enumerate(zip(inputs, expected)):
        np.testing.assert_array_equal(net.forward(data=data)["det"], rows)
        if step >= 1:                           # made after the second forward, used from the third on
            assert executor._plan is not None and executor._plan.current(executor.settings.version), step


# --- OpenCV's res10 face detector ----------------------------------------------------
# Its 1-3 px stripes give neighbouring priors scores equal to within 5e-8, so
# the convolutions' rounding (cct's against OpenCV's, 1e-7) decides which of two
# such boxes NMS keeps first: there the layer is checked on OpenCV's own heads
# (as on every image) and the whole net for its count only.
NEAR_TIES = {"stripes_gray.png"}


@pytest.mark.slow
def test_res10_face_detector_against_opencv(tmp_path, one_arithmetic):
    require_opencv4()
    files = res10_files(tmp_path)
    images = shared_images()
    runs = [{"data": face_blob(path)} for path in images]
    runs.append({"data": np.zeros((1, 3, 300, 300), F32)})           # a face-free, flat image
    heads = ["mbox_loc", "mbox_conf_flatten", "mbox_priorbox"]
    theirs = opencv4_forward(files["prototxt"], files["caffemodel"], runs, heads + ["detection_out"])
    net = cct.Net(files["prototxt"], cct.TEST, weights=files["caffemodel"])
    detect = make_layer(str(net.layer_dict["detection_out"].layer_param))
    for path, run, reference in zip(images + ["zeros"], runs, theirs):
        net.blobs["data"].data[...] = run["data"]
        found = net.forward()["detection_out"]
        for name in heads:
            assert_close(net.blobs[name].data, reference[name])
        # the layer on OpenCV's own heads: OpenCV's detections
        _, _, tops = run_layer("", [reference[name] for name in heads], layer=detect)
        assert_same_detections(tops[0].data, reference["detection_out"])
        if Path(path).name in NEAR_TIES:
            assert detections_of(found).shape == detections_of(reference["detection_out"]).shape
            continue
        count, worst = assert_same_detections(found, reference["detection_out"])
        print(f"{Path(path).name}: {count} detections, boxes within {worst:.2g} of OpenCV 4's")


@pytest.mark.parametrize("eta, top_k", [(1.0, -1), (0.7, -1), (1.0, 50), (0.9, 5)])
def test_compiled_nms_keeps_the_reference_boxes(eta, top_k):
    """The compiled NMS (one pair's overlap at a time) keeps exactly what the
    plain one on the whole overlap matrix keeps: overlapping clusters, tied
    scores, boxes inverted or of zero area, NaN coordinates and scores."""
    from cct.layers import ssd
    rng = np.random.default_rng(11)
    for trial in range(20):
        count = 300
        centers = rng.uniform(0, 1, (count // 10, 2)).repeat(10, axis=0) + rng.normal(0, 0.02, (count, 2))
        sides = rng.uniform(0.01, 0.3, (count, 2))
        boxes = np.concatenate([centers - sides / 2, centers + sides / 2], axis=1).astype(np.float32)
        boxes[::37] = boxes[::37, [2, 3, 0, 1]]              # inverted: area 0, never overlapping
        boxes[::53, 2] = boxes[::53, 0]                     # zero width
        boxes[::61, 1] = np.nan
        scores = rng.choice(rng.uniform(0, 1, 40), count).astype(np.float32)     # many ties
        scores[::71] = np.nan
        sizes = ssd.box_sizes(boxes)
        for threshold in (0.3, 0.45, 0.8, 0.0):      # above 0.5, eta shrinks it
            got = ssd.nms(boxes, sizes, scores, np.float32(0.05), threshold, eta, top_k)
            expected = ssd.nms_reference(boxes, sizes, scores, np.float32(0.05), threshold, eta, top_k)
            np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("eta, top_k", [(1.0, -1), (0.7, -1), (1.0, 50), (0.9, 5)])
@pytest.mark.parametrize("shared", [True, False])
def test_every_class_in_one_call_keeps_what_each_class_alone_keeps(eta, top_k, shared):
    """nms_every_class (DetectionOutput's one compiled call) gives each class
    the indices nms() gives it alone, in the same order: a background class
    skipped, shared or per-class boxes, ties, NaN scores and coordinates."""
    from cct.layers import ssd
    rng = np.random.default_rng(12)
    classes, count = 6, 240
    labels = np.array([-1] + ([0] * (classes - 1) if shared else list(range(classes - 1))), np.int64)
    sets = 1 if shared else classes - 1
    centers = rng.uniform(0, 1, (sets, count // 8, 2)).repeat(8, axis=1) + rng.normal(0, 0.02, (sets, count, 2))
    sides = rng.uniform(0.01, 0.3, (sets, count, 2))
    boxes = np.concatenate([centers - sides / 2, centers + sides / 2], axis=2).astype(np.float32)
    boxes[:, ::41, 1] = np.nan
    sizes = ssd.box_sizes(boxes)
    scores = rng.choice(rng.uniform(0, 1, 30), (count, classes)).astype(np.float32)     # many ties
    scores[::43] = np.nan
    for threshold in (0.3, 0.45, 0.8):
        got = ssd.nms_every_class(boxes, sizes, scores, labels, np.float32(0.1), threshold, eta, top_k)
        assert sorted(got) == list(range(1, classes))
        for c in range(1, classes):
            alone = ssd.nms(boxes[labels[c]], sizes[labels[c]], scores[:, c], np.float32(0.1), threshold, eta, top_k)
            np.testing.assert_array_equal(got[c], alone)
