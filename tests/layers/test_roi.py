"""ROIPooling and PSROIPooling (layers/roi.py): forward and backward against
loops written here from the forks' code (caffe-fast-rcnn's CPU forward and
GPU backward, caffe-rfcn's GPU forward and backward), their gradients, their
errors, and forward against OpenCV 4's DNN module on one-layer and small nets."""
import math

import numpy as np
import pytest

from cct.core.errors import ConfigError, ShapeError
from cct.testing.gradient_check import check_layer_gradient, make_layer
from helpers.layers import run_layer
from helpers.opencv4 import assert_close, compare_with_opencv

RNG = np.random.default_rng(38)
F32 = np.float32
FLT_MAX = float(np.finfo(F32).max)


def c_round(value):
    return math.floor(value + 0.5) if value >= 0 else -math.floor(-value + 0.5)


def rois_for(batch, count, width, height):
    """Random ROIs in image pixels (some malformed: x2 < x1), as float32."""
    rows = []
    for _ in range(count):
        x1, y1 = RNG.uniform(-8, width), RNG.uniform(-8, height)
        rows.append([RNG.integers(batch), x1, y1, x1 + RNG.uniform(-10, width), y1 + RNG.uniform(-10, height)])
    return np.array(rows, F32)


# --- ROIPooling ---------------------------------------------------------------------
def roi_geometry(roi, scale, pooled_h, pooled_w):
    start_w, start_h = c_round(F32(roi[1] * scale)), c_round(F32(roi[2] * scale))
    end_w, end_h = c_round(F32(roi[3] * scale)), c_round(F32(roi[4] * scale))
    bin_h = F32(max(end_h - start_h + 1, 1)) / F32(pooled_h)
    bin_w = F32(max(end_w - start_w + 1, 1)) / F32(pooled_w)
    return start_h, start_w, end_h, end_w, bin_h, bin_w


def naive_roi_pool(x, rois, pooled_h, pooled_w, scale):
    """The fork's Forward_cpu."""
    _, c, height, width = x.shape
    top = np.full((len(rois), c, pooled_h, pooled_w), -FLT_MAX, F32)
    argmax = np.full(top.shape, -1)
    for n, roi in enumerate(rois):
        start_h, start_w, _, _, bin_h, bin_w = roi_geometry(roi, scale, pooled_h, pooled_w)
        for ph in range(pooled_h):
            for pw in range(pooled_w):
                hs = min(max(math.floor(F32(ph) * bin_h) + start_h, 0), height)
                he = min(max(math.ceil(F32(ph + 1) * bin_h) + start_h, 0), height)
                ws = min(max(math.floor(F32(pw) * bin_w) + start_w, 0), width)
                we = min(max(math.ceil(F32(pw + 1) * bin_w) + start_w, 0), width)
                if he <= hs or we <= ws:
                    top[n, :, ph, pw] = 0
                for h in range(hs, he):
                    for w in range(ws, we):
                        better = x[int(roi[0]), :, h, w] > top[n, :, ph, pw]
                        top[n, better, ph, pw] = x[int(roi[0]), better, h, w]
                        argmax[n, better, ph, pw] = h * width + w
    return top, argmax


def naive_roi_pool_backward(dy, argmax, rois, shape, scale):
    """The fork's ROIPoolBackward kernel: per bottom element, over every ROI."""
    num, channels, height, width = shape
    pooled_h, pooled_w = dy.shape[2:]
    dx = np.zeros(shape, F32)
    for n in range(num):
        for h in range(height):
            for w in range(width):
                gradient = np.zeros(channels, F32)
                for r, roi in enumerate(rois):
                    if int(roi[0]) != n:
                        continue
                    start_h, start_w, end_h, end_w, bin_h, bin_w = roi_geometry(roi, scale, pooled_h, pooled_w)
                    if not (start_w <= w <= end_w and start_h <= h <= end_h):
                        continue
                    phs = min(max(math.floor(F32(h - start_h) / bin_h), 0), pooled_h)
                    phe = min(max(math.ceil(F32(h - start_h + 1) / bin_h), 0), pooled_h)
                    pws = min(max(math.floor(F32(w - start_w) / bin_w), 0), pooled_w)
                    pwe = min(max(math.ceil(F32(w - start_w + 1) / bin_w), 0), pooled_w)
                    for ph in range(phs, phe):
                        for pw in range(pws, pwe):
                            hit = argmax[r, :, ph, pw] == h * width + w
                            gradient[hit] += dy[r, hit, ph, pw]
                dx[n, :, h, w] = gradient
    return dx


ROI_TEXT = 'type: "ROIPooling" roi_pooling_param {{ pooled_h: {} pooled_w: {} spatial_scale: {} }}'


@pytest.mark.parametrize("pooled, scale", [((2, 3), 0.25), ((3, 3), 0.0625), ((4, 2), 0.5)])
def test_roi_pooling_forward_and_backward(pooled, scale):
    x = RNG.standard_normal((2, 3, 9, 11)).astype(F32)
    rois = rois_for(2, 6, 11 / scale, 9 / scale)
    layer, bottoms, tops = run_layer(ROI_TEXT.format(*pooled, scale), [x, rois], dtype=F32)
    want, argmax = naive_roi_pool(x, rois, *pooled, scale)
    np.testing.assert_array_equal(tops[0].data, want)
    np.testing.assert_array_equal(layer.argmax, argmax)
    dy = RNG.standard_normal(tops[0].shape).astype(F32)
    tops[0].diff[...] = dy
    layer.backward(tops, [True, True], bottoms)
    np.testing.assert_array_equal(bottoms[0].diff, naive_roi_pool_backward(dy, argmax, rois, x.shape, scale))
    assert not bottoms[1].diff.any()


def test_roi_pooling_gradient():
    x = RNG.permutation(2 * 2 * 6 * 7).reshape(2, 2, 6, 7) * 0.1       # distinct values: no tied maxima
    rois = np.array([[0, 0, 0, 20, 16], [1, 4, 6, 27, 23], [1, 8, 3, 12, 5]])
    check_layer_gradient(make_layer(ROI_TEXT.format(2, 2, 0.25)), [x, rois], check_bottoms=[0])


# --- PSROIPooling -------------------------------------------------------------------
def fused(a, b, c):
    """The GPU's fmaf(a, b, c): exact, then rounded once to float32."""
    return F32(float(a) * float(b) + float(c))


def naive_psroi_bins(roi, scale, group, height, width):
    """The fork's kernel's bin bounds: [(hs, he, ws, we)] by (ph, pw)."""
    scale = F32(scale)
    start_w, start_h = F32(c_round(roi[1])) * scale, F32(c_round(roi[2])) * scale
    end_w, end_h = F32(c_round(roi[3]) + 1.0) * scale, F32(c_round(roi[4]) + 1.0) * scale
    roi_w = F32(max(float(end_w - start_w), 0.1))
    roi_h = F32(max(float(end_h - start_h), 0.1))
    bin_h, bin_w = roi_h / F32(group), roi_w / F32(group)
    bins = {}
    for ph in range(group):
        for pw in range(group):
            hs = min(max(math.floor(fused(ph, bin_h, start_h)), 0), height)
            he = min(max(math.ceil(fused(ph + 1, bin_h, start_h)), 0), height)
            ws = min(max(math.floor(fused(pw, bin_w, start_w)), 0), width)
            we = min(max(math.ceil(fused(pw + 1, bin_w, start_w)), 0), width)
            bins[ph, pw] = hs, he, ws, we
    return bins


def naive_psroi(x, rois, scale, dims, group):
    """The fork's PSROIPoolingForward kernel, and its backward's spread."""
    _, _, height, width = x.shape
    top = np.zeros((len(rois), dims, group, group), F32)
    for n, roi in enumerate(rois):
        for (ph, pw), (hs, he, ws, we) in naive_psroi_bins(roi, scale, group, height, width).items():
            for d in range(dims):
                c = (d * group + ph) * group + pw
                total = F32(0)
                for h in range(hs, he):
                    for w in range(ws, we):
                        total = F32(total + x[int(roi[0]), c, h, w])
                area = (he - hs) * (we - ws)
                top[n, d, ph, pw] = 0 if area == 0 else total / F32(area)
    return top


def naive_psroi_backward(dy, rois, shape, scale, group):
    dx = np.zeros(shape, F32)
    for n, roi in enumerate(rois):
        for (ph, pw), (hs, he, ws, we) in naive_psroi_bins(roi, scale, group, *shape[2:]).items():
            area = (he - hs) * (we - ws)
            for d in range(dy.shape[1]):
                if area:
                    dx[int(roi[0]), (d * group + ph) * group + pw, hs:he, ws:we] += dy[n, d, ph, pw] / F32(area)
    return dx


PSROI_TEXT = 'type: "PSROIPooling" psroi_pooling_param {{ spatial_scale: {} output_dim: {} group_size: {} }}'


@pytest.mark.parametrize("scale, dims, group", [(0.25, 2, 3), (0.0625, 3, 2), (0.5, 1, 7)])
def test_psroi_pooling_forward_and_backward(scale, dims, group):
    x = RNG.standard_normal((2, dims * group * group, 9, 11)).astype(F32)
    rois = rois_for(2, 5, 11 / scale, 9 / scale)
    layer, bottoms, tops = run_layer(PSROI_TEXT.format(scale, dims, group), [x, rois], dtype=F32)
    np.testing.assert_array_equal(tops[0].data, naive_psroi(x, rois, scale, dims, group))
    dy = RNG.standard_normal(tops[0].shape).astype(F32)
    tops[0].diff[...] = dy
    layer.backward(tops, [True, False], bottoms)
    np.testing.assert_allclose(bottoms[0].diff, naive_psroi_backward(dy, rois, x.shape, scale, group),
                               rtol=1e-6, atol=1e-7)


def test_psroi_pooling_gradient():
    x = RNG.standard_normal((2, 2 * 2 * 2, 5, 6))
    rois = np.array([[0, 0, 0, 20, 16], [1, 4, 6, 27, 23], [1, 8, 3, 12, 5]])
    check_layer_gradient(make_layer(PSROI_TEXT.format(0.25, 2, 2)), [x, rois], check_bottoms=[0])


@pytest.mark.parametrize("text", [ROI_TEXT.format(2, 3, 0.5), PSROI_TEXT.format(0.5, 2, 2)])
def test_roi_layers_without_rois(text):
    """No ROI (a proposal layer that kept none): an empty top, a zero gradient, as the forks' loops."""
    x = RNG.standard_normal((1, 8, 5, 5)).astype(F32)
    layer, bottoms, tops = run_layer(text, [x, np.zeros((0, 5))], dtype=F32)
    assert tops[0].shape[0] == 0
    bottoms[0].diff[...] = 1
    layer.backward(tops, [True, True], bottoms)
    assert not bottoms[0].diff.any()


@pytest.mark.parametrize("text, arrays, error, message", [
    (ROI_TEXT.format(0, 2, 1), None, ConfigError, r"\(ROIPooling\): roi_pooling_param.pooled_h: must be > 0, got 0"),
    ('type: "PSROIPooling" psroi_pooling_param { output_dim: 1 group_size: 1 }', None, ConfigError,
     r"psroi_pooling_param.spatial_scale: must be given"),
    (PSROI_TEXT.format(1, 0, 2), None, ConfigError, r"psroi_pooling_param.output_dim: must be > 0"),
    (PSROI_TEXT.format(1, 2, 2), None, ShapeError, r"must have output_dim x group_size\^2 = 2 x 2\^2 = 8 channels"),
    (ROI_TEXT.format(2, 2, 1), [np.zeros((1, 4, 5, 5)), np.zeros((3, 4))], ShapeError, r"must be \(R, 5"),
    (ROI_TEXT.format(2, 2, 1), [np.zeros((1, 4, 5, 5)), np.array([[0, 0, 0, 1, 1], [1, 0, 0, 1, 1]])], ShapeError,
     r"ROI 1 names image 1; the features \(bottom\[0\]\) hold 1"),
])
def test_roi_errors(text, arrays, error, message):
    arrays = arrays or [np.zeros((1, 4, 5, 5)), np.zeros((2, 5))]
    with pytest.raises(error, match=message):
        run_layer(text, arrays, dtype=F32)


# --- against OpenCV 4 ---------------------------------------------------------------
@pytest.mark.parametrize("kind, fields, channels", [
    ("ROIPooling", "roi_pooling_param { pooled_h: 2 pooled_w: 3 spatial_scale: 0.25 }", 8),
    ("ROIPooling", "roi_pooling_param { pooled_h: 7 pooled_w: 7 spatial_scale: 0.0625 }", 4),
    ("PSROIPooling", "psroi_pooling_param { spatial_scale: 0.25 output_dim: 2 group_size: 2 }", 8),
    ("PSROIPooling", "psroi_pooling_param { spatial_scale: 0.0625 output_dim: 2 group_size: 3 }", 18),
])
def test_roi_layers_against_opencv(tmp_path, kind, fields, channels):
    x = RNG.standard_normal((2, channels, 10, 12)).astype(F32)
    scale = float(fields.split("spatial_scale: ")[1].split()[0])
    inputs = {"x": x, "rois": rois_for(2, 12, 12 / scale, 10 / scale)}
    text = f'layer {{ name: "y" type: "{kind}" bottom: "x" bottom: "rois" top: "y" {fields} }}\n'
    ours, theirs = compare_with_opencv(tmp_path, text, inputs, ["y"])
    print(f"{kind} {fields}: max relative difference {assert_close(ours['y'], theirs['y']):.2g}")


# A Fast R-CNN head and an R-FCN head in small, on a convolution's features
SMALL_HEADS = """
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 8 kernel_size: 3 stride: 2 pad: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "pool5" type: "ROIPooling" bottom: "conv" bottom: "rois" top: "pool5"
  roi_pooling_param { pooled_h: 3 pooled_w: 3 spatial_scale: 0.5 } }
layer { name: "fc" type: "InnerProduct" bottom: "pool5" top: "fc"
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "ps" type: "PSROIPooling" bottom: "conv" bottom: "rois" top: "ps"
  psroi_pooling_param { spatial_scale: 0.5 output_dim: 2 group_size: 2 } }
layer { name: "vote" type: "Pooling" bottom: "ps" top: "vote" pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
"""


def test_small_rcnn_heads_against_opencv(tmp_path):
    inputs = {"data": RNG.standard_normal((2, 3, 20, 24)).astype(F32), "rois": rois_for(2, 8, 24, 20)}
    ours, theirs = compare_with_opencv(tmp_path, SMALL_HEADS, inputs, ["pool5", "fc", "ps", "vote"])
    for name in ("pool5", "fc", "ps", "vote"):
        print(f"{name}: max relative difference {assert_close(ours[name], theirs[name]):.2g}")
