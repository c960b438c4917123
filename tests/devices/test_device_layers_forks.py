"""The forks' layers' device paths against their host forward and backward,
on the numpy CPU device and on OpenCL: SSD's Normalize, Permute and PriorBox,
the segmentation forks' BN, Interp and Upsample, the YOLOv2 port's Reorg,
Fast R-CNN's ROIPooling and R-FCN's PSROIPooling; SSD's DetectionOutput
(boxes decoded on the device, NMS on the host: the same rows, CENTER_SIZE's
boxes within float32 rounding of exp).
Bit for bit where the device computes in the host's order; within 1e-6 of the
largest value where a sum runs in another order (Normalize's norms, BN's batch
statistics) or a square root or power is the device's (BN's); parameter
gradients, sums whose terms cancel, within 3e-5."""
import numpy as np
import pytest

import cct

from cct.core.blob import Blob
from cct.devices.cpu import CPU
from cct.testing.gradient_check import make_layer
from helpers.devices import OPENCL, assert_close_both_ways, opencl_or_skip, run_both_ways

RNG = np.random.default_rng(205)


def rand(*shape):
    return RNG.standard_normal(shape)


def assert_close_but_sums(results, sums, tolerance=1e-6, sum_tolerance=3e-5):
    """As assert_close_both_ways, the results named in `sums` (parameter
    gradients: sums of many terms of both signs, in another order on the
    device, that cancel) within sum_tolerance of their largest value."""
    assert_close_both_ways({k: v for k, v in results.items() if k not in sums}, tolerance)
    assert_close_both_ways({k: v for k, v in results.items() if k in sums}, sum_tolerance)


@pytest.fixture(params=["cpu", OPENCL])
def device(request):
    return CPU if request.param == "cpu" else opencl_or_skip()


# --- SSD ------------------------------------------------------------------------------
@pytest.mark.parametrize("across", [True, False])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("in_place", [False, True])
def test_normalize_on_device_matches_the_host(device, across, shared, in_place):
    text = (f'type: "Normalize" norm_param {{ across_spatial: {str(across).lower()} '
            f'channel_shared: {str(shared).lower()} scale_filler {{ type: "gaussian" std: 2 }} }}')
    results = run_both_ways(device, text, [rand(2, 3, 4, 5)], in_place=in_place)
    assert set(results) == {"top0", "bottom0.diff", "param0.diff"}
    assert_close_but_sums(results, {"param0.diff"})


def test_normalize_on_device_two_axes(device):
    assert_close_but_sums(run_both_ways(device, 'type: "Normalize"', [rand(3, 7)]), {"param0.diff"})


@pytest.mark.parametrize("order, shape", [((0, 2, 3, 1), (2, 3, 4, 5)), ((1, 0), (2, 3, 4, 5)),
                                          ((), (2, 3, 4)), ((3, 1), (2, 3, 4, 5)), ((2, 0, 1), (3, 4, 5))])
def test_permute_on_device_matches_the_host(device, order, shape):
    text = 'type: "Permute" permute_param { ' + " ".join(f"order: {a}" for a in order) + " }"
    assert_close_both_ways(run_both_ways(device, text, [rand(*shape)]), 0)


def test_permute_identity_in_place_on_device(device):
    assert_close_both_ways(run_both_ways(device, 'type: "Permute"', [rand(2, 3)], in_place=True), 0)


def test_permute_with_too_many_axes_stays_on_the_host(device):
    layer = make_layer('type: "Permute" permute_param { order: 8 }')
    bottom, top = Blob((1,) * 9, np.float32), Blob(dtype=np.float32)
    layer.set_up([bottom], [top])
    assert not layer.runs_on(device, [bottom], [top])


PRIOR_BOXES = [
    "min_size: 30 max_size: 60 aspect_ratio: 2 flip: true clip: false variance: 0.1 variance: 0.1 "
    "variance: 0.2 variance: 0.2 step: 8",
    "min_size: 10.5 min_size: 20 aspect_ratio: 2 aspect_ratio: 3 flip: false clip: true",
]


@pytest.mark.parametrize("fields", PRIOR_BOXES)
def test_prior_box_on_device_matches_the_host(device, fields):
    results = run_both_ways(device, f'type: "PriorBox" prior_box_param {{ {fields} }}',
                            [rand(2, 4, 3, 5), rand(2, 3, 60, 100)])
    assert_close_both_ways(results, 0)
    assert not results["bottom0.diff"][0].any()


def test_prior_box_on_device_follows_the_shapes(device):
    """Made once per shape: a new feature map size makes new priors, the same one reuses them."""
    layer = make_layer(f'type: "PriorBox" prior_box_param {{ {PRIOR_BOXES[0]} }}')
    feature, image, top = Blob((1, 2, 3, 3), np.float32), Blob((1, 3, 48, 48), np.float32), Blob(dtype=np.float32)
    layer.set_up([feature, image], [top])
    for size in (3, 5, 5, 3):
        feature.reshape((1, 2, size, size))
        layer.reshape([feature, image], [top])
        layer.forward_on(device, [feature, image], [top])
        on_device = top.data.copy()
        layer.forward([feature, image], [top])
        np.testing.assert_array_equal(on_device, top.data)


def detection_inputs(num, classes, share, grid=3):
    """loc, softmax conf and PriorBox priors for a grid x grid map of a 30 x 30 image."""
    layer = make_layer('type: "PriorBox" prior_box_param { min_size: 8 max_size: 16 aspect_ratio: 2 '
                       'variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 }')
    feature, image, top = Blob((1, 1, grid, grid), np.float32), Blob((1, 3, 30, 30), np.float32), Blob()
    layer.set_up([feature, image], [top])
    layer.forward([feature, image], [top])
    priors = top.data.copy()
    count = priors.shape[2] // 4
    loc = rand(num, count * (1 if share else classes) * 4) * 0.5
    logits = rand(num, count, classes) * 2
    conf = (np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)).reshape(num, -1)
    return loc, conf, priors


def detection_text(classes, share=True, background=0, code="CENTER_SIZE", threshold=0.05, keep_top_k=20,
                   eta=1.0, in_target=False):
    return (f'type: "DetectionOutput" detection_output_param {{ num_classes: {classes} '
            f'share_location: {str(share).lower()} background_label_id: {background} '
            f'nms_param {{ nms_threshold: 0.45 top_k: 40 eta: {eta} }} code_type: {code} '
            f'variance_encoded_in_target: {str(in_target).lower()} keep_top_k: {keep_top_k} '
            f'confidence_threshold: {threshold} }}')


def assert_same_detections(ours, host, exact):
    """The same rows: image, label and score bit for bit; the boxes too where
    `exact`, else within 1e-6 (CENTER_SIZE's exp: numpy's float32 exp, on
    the host, is 1 ulp off where the device's rounds to nearest)."""
    assert ours.shape == host.shape
    np.testing.assert_array_equal(ours[..., :3], host[..., :3])
    np.testing.assert_allclose(ours[..., 3:], host[..., 3:], rtol=0, atol=0 if exact else 1e-6)


DETECTIONS = [  # (classes, share, background, code, keep_top_k, eta, variance in target)
    (2, True, 0, "CENTER_SIZE", 20, 1.0, False), (4, True, 0, "CENTER_SIZE", 12, 1.0, True),
    (3, False, -1, "CORNER", -1, 1.0, False), (3, True, 1, "CENTER_SIZE", 30, 0.9, False),
    (3, False, 2, "CENTER_SIZE", 8, 1.0, False), (3, True, 0, "CORNER_SIZE", 10, 1.0, False),
    (2, False, 0, "CORNER_SIZE", -1, 1.0, True), (2, True, 0, "CORNER", 15, 1.0, True)]


@pytest.mark.parametrize("case", DETECTIONS)
def test_detection_output_on_device_matches_the_host(device, case):
    classes, share, background, code, keep, eta, in_target = case
    inputs = detection_inputs(2, classes, share)
    text = detection_text(classes, share, background, code, keep_top_k=keep, eta=eta, in_target=in_target)
    results = run_both_ways(device, text, inputs, propagate_down=[False] * 3)
    assert set(results) == {"top0"}
    ours, host = results["top0"]
    assert_same_detections(ours, host, exact=code != "CENTER_SIZE")
    assert (host[0, 0, :, 1] >= 0).any()                     # something was found


def test_detection_output_on_device_finds_nothing(device):
    """No score above the threshold (a softmax score is at most 1): the fork's row of -1 per image."""
    results = run_both_ways(device, detection_text(2, threshold=1), detection_inputs(3, 2, True),
                            propagate_down=[False] * 3)
    assert_close_both_ways(results, 0)
    assert (results["top0"][0][0, 0, :, 1:] == -1).all()


def test_detection_output_on_device_refuses_a_gradient(device):
    layer = make_layer(detection_text(2))
    bottoms = []
    for array in detection_inputs(1, 2, True):
        bottoms.append(Blob(array.shape, np.float32))
        bottoms[-1].data[...] = array
    top = Blob(dtype=np.float32)
    layer.set_up(bottoms, [top])
    layer.forward_on(device, bottoms, [top])
    with pytest.raises(NotImplementedError, match=r"\(DetectionOutput\).*has no backward"):
        layer.backward_on(device, [top], [True, False, False], bottoms)


# --- Reorg ----------------------------------------------------------------------------
@pytest.mark.parametrize("stride, reverse, shape", [(2, False, (2, 8, 4, 6)), (2, True, (2, 8, 3, 5)),
                                                    (3, False, (1, 9, 6, 3)), (1, False, (2, 3, 2, 2))])
def test_reorg_on_device_matches_the_host(device, stride, reverse, shape):
    text = f'type: "Reorg" reorg_param {{ stride: {stride} reverse: {str(reverse).lower()} }}'
    assert_close_both_ways(run_both_ways(device, text, [rand(*shape)]), 0)


# --- BN -------------------------------------------------------------------------------
def bn_text(fields, values):
    """A BN layer with its blobs given: each (C,) of values as a (1, C, 1, 1) blob."""
    blobs = " ".join("blobs { shape { dim: 1 dim: %d dim: 1 dim: 1 } %s }"
                     % (len(v), " ".join(f"data: {x}" for x in v)) for v in values)
    return f'type: "BN" bn_param {{ {fields} }} {blobs}'


def bn_blobs(count, channels=3):
    """slope/scale, bias/shift, running mean, running variance (positive)."""
    values = [RNG.standard_normal(channels) for _ in range(count)]
    if count == 4:
        values[3] = np.abs(values[3]) + 0.5
    return values


BN_CASES = [
    ("momentum: 0.8 eps: 1e-4 frozen: true", 4, cct.TRAIN),     # PSPNet frozen
    ("momentum: 0.8 eps: 1e-4", 4, cct.TEST),                   # PSPNet at test: the running statistics
    ("momentum: 0.8 eps: 1e-4", 4, cct.TRAIN),                  # PSPNet learning: batch statistics
    ("bn_mode: INFERENCE", 2, cct.TEST),                         # SegNet after compute_bn_statistics.py
    ("bn_mode: LEARN", 2, cct.TRAIN),                            # SegNet learning
]


@pytest.mark.parametrize("fields, blobs, phase", BN_CASES)
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (4, 3)])
def test_bn_on_device_matches_the_host(device, fields, blobs, phase, in_place, shape):
    text = bn_text(fields, bn_blobs(blobs))
    results = run_both_ways(device, text, [rand(*shape) * 2 + 1], phase=phase, in_place=in_place)
    assert_close_but_sums(results, {name for name in results if name.startswith("param")})
    if "INFERENCE" in fields:                  # an affine map: bit for bit
        assert_close_both_ways({"top0": results["top0"], "bottom0.diff": results["bottom0.diff"]}, 0)


@pytest.mark.parametrize("fields, blobs", [("momentum: 0.8 eps: 1e-4", 4), ("bn_mode: LEARN", 2)])
def test_bn_on_device_keeps_statistics_as_the_host(device, fields, blobs):
    """PSPNet's running mean and variance, SegNet's batch statistics tops
    (its E[x^2] - mean^2 cancels: the inputs' mean 3 costs a digit)."""
    text, x = bn_text(fields, bn_blobs(blobs)), rand(2, 3, 4, 5) + 3
    kept = []
    for on_device in (False, True):
        layer = make_layer(text, cct.TRAIN)
        bottom = Blob(x.shape, np.float32)
        bottom.data[...] = x
        tops = [Blob(dtype=np.float32) for _ in range(1 if blobs == 4 else 3)]
        layer.set_up([bottom], tops)
        layer.forward_on(device, [bottom], tops) if on_device else layer.forward([bottom], tops)
        kept.append([blob.data.copy() for blob in layer.blobs[2:]] + [top.data.copy() for top in tops[1:]])
    for ours, reference in zip(kept[1], kept[0]):
        np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-6)


# --- Interp, Upsample -----------------------------------------------------------------
@pytest.mark.parametrize("fields, shape", [
    ("zoom_factor: 3", (2, 3, 4, 5)), ("shrink_factor: 2", (1, 2, 9, 7)), ("height: 8 width: 6", (2, 2, 5, 9)),
    ("zoom_factor: 2 pad_beg: -1 pad_end: -1", (1, 3, 7, 6)), ("height: 1 width: 1", (2, 2, 3, 3)),
    ("height: 4 width: 3 pad_end: -2", (1, 2, 6, 5)),              # the crop's size: a copy
    ("height: 5 width: 5", (2, 3, 5, 5)),                          # the input's size: a copy
])
def test_interp_on_device_matches_the_host(device, fields, shape):
    results = run_both_ways(device, f'type: "Interp" interp_param {{ {fields} }}', [rand(*shape)])
    assert_close_both_ways(results, 0)


def test_interp_on_device_with_a_size_bottom(device):
    results = run_both_ways(device, 'type: "Interp"', [rand(2, 3, 4, 5), rand(2, 1, 7, 9)],
                            propagate_down=[True, False])
    assert_close_both_ways(results, 0)


@pytest.mark.parametrize("scale", [1, 2, 3])
def test_nearest_upsample_on_device_matches_the_host(device, scale):
    results = run_both_ways(device, f'type: "Upsample" upsample_param {{ scale: {scale} }}', [rand(2, 3, 4, 5)])
    assert_close_both_ways(results, 0)


@pytest.mark.parametrize("fields, out", [("scale: 2", (8, 6)), ("upsample_h: 7 upsample_w: 9", (7, 9)),
                                         ("scale: 2 pad_out_h: true", (7, 6))])
def test_unpooling_on_device_matches_the_host(device, fields, out):
    """Masks with repeated cells (a later value wins, every repeat gathers)."""
    values = rand(2, 3, 4, 3)
    mask = RNG.integers(0, out[0] * out[1], values.shape).astype(np.float32)
    results = run_both_ways(device, f'type: "Upsample" upsample_param {{ {fields} }}', [values, mask])
    assert_close_both_ways(results, 0)
    assert not results["bottom1.diff"][0].any()


# --- ROIPooling, PSROIPooling -----------------------------------------------------------
def roi_rows(batch, width, height):
    """ROIs in image pixels: random ones (some malformed, x2 < x1), one clipped
    by every edge, one wholly outside the map (its bins all empty), one a
    single pixel, one along the map's last row (bins past it empty), and
    repeats (a pixel's gradient summed over several ROIs)."""
    rows = []
    for _ in range(6):
        x1, y1 = RNG.uniform(-8, width), RNG.uniform(-8, height)
        rows.append([RNG.integers(batch), x1, y1, x1 + RNG.uniform(-10, width), y1 + RNG.uniform(-10, height)])
    rows += [[0, -20, -15, width + 30, height + 25], [batch - 1, width + 40, height + 40, width + 90, height + 70],
             [0, 3, 2, 3, 2], [batch - 1, 0, height - 1, width - 1, height + 40]]
    rows += rows[:3]
    return np.array(rows, np.float32)


ROI_CASES = [((2, 3), 0.25), ((3, 3), 0.0625), ((4, 2), 0.5), ((7, 7), 1.0)]


@pytest.mark.parametrize("pooled, scale", ROI_CASES)
def test_roi_pooling_on_device_matches_the_host(device, pooled, scale):
    x = rand(2, 3, 9, 11)
    rois = roi_rows(2, 11 / scale, 9 / scale)
    text = (f'type: "ROIPooling" roi_pooling_param {{ pooled_h: {pooled[0]} pooled_w: {pooled[1]} '
            f'spatial_scale: {scale} }}')
    results = run_both_ways(device, text, [x, rois])
    assert_close_both_ways(results, 0)
    assert not results["bottom1.diff"][0].any()
    assert (results["top0"][0] == 0).any()                   # empty bins were pooled


def test_roi_pooling_on_device_ties_and_nan(device):
    """Tied maxima (the first in scan order wins, and gets the gradient), NaN
    cells (never win) and a bin of NaN alone (-FLT_MAX, no gradient)."""
    x = RNG.integers(0, 3, (1, 2, 6, 6)).astype(np.float32)
    x[0, 0, 2:4, 1:3] = np.nan
    x[0, 1, :3, :3] = np.nan
    rois = np.array([[0, 0, 0, 5, 5], [0, 1, 1, 4, 5], [0, 0, 0, 1, 1], [0, 0, 0, 5, 5]], np.float32)
    text = 'type: "ROIPooling" roi_pooling_param { pooled_h: 3 pooled_w: 3 spatial_scale: 1 }'
    results = run_both_ways(device, text, [x, rois], propagate_down=[True, False])
    assert_close_both_ways(results, 0)
    assert (results["top0"][0] == -np.finfo(np.float32).max).any()


@pytest.mark.parametrize("scale, dims, group", [(0.25, 2, 3), (0.0625, 3, 2), (0.5, 1, 7), (1.0, 2, 1)])
def test_psroi_pooling_on_device_matches_the_host(device, scale, dims, group):
    x = rand(2, dims * group * group, 9, 11)
    rois = roi_rows(2, 11 / scale, 9 / scale)
    text = f'type: "PSROIPooling" psroi_pooling_param {{ spatial_scale: {scale} output_dim: {dims} group_size: {group} }}'
    results = run_both_ways(device, text, [x, rois])
    assert_close_both_ways(results, 0)
    assert not results["bottom1.diff"][0].any()
    assert (results["top0"][0] == 0).any()                   # empty bins were pooled


@pytest.mark.parametrize("kind, fields", [
    ("ROIPooling", "roi_pooling_param { pooled_h: 2 pooled_w: 2 }"),
    ("PSROIPooling", "psroi_pooling_param { spatial_scale: 1 output_dim: 1 group_size: 2 }")])
def test_roi_layers_on_device_without_rois(device, kind, fields):
    """No ROI: an empty top, a zero gradient."""
    results = run_both_ways(device, f'type: "{kind}" {fields}', [rand(1, 4, 5, 5), np.zeros((0, 5))])
    assert results["top0"][0].shape == (0, 4 if kind == "ROIPooling" else 1, 2, 2)
    assert not results["bottom0.diff"][0].any()


def test_roi_layers_on_device_refuse_a_bad_image_index(device):
    layer = make_layer('type: "ROIPooling" roi_pooling_param { pooled_h: 2 pooled_w: 2 }')
    features, rois, top = Blob((2, 1, 4, 4), np.float32), Blob((1, 5), np.float32), Blob(dtype=np.float32)
    rois.data[...] = [[2, 0, 0, 3, 3]]
    layer.set_up([features, rois], [top])
    with pytest.raises(cct.ShapeError, match=r"\(ROIPooling\): ROI 0 names image 2; the features"):
        layer.forward_on(device, [features, rois], [top])
