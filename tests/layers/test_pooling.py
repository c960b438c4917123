"""Pooling and SPP (layers/pooling.py): forward against naive window loops
(ceil rounding, clipping, padding counted in AVE), the MAX argmax/mask,
stochastic pooling, gradients, Caffe's parameter checks."""
import math

import numpy as np
import pytest

import cct
from cct.core.errors import ConfigError, ShapeError
import cct.layers.pooling_kernels as pooling_kernels
import cct.layers.pooling_reference as pooling_reference
from cct.layers import pooling as pooling_module
from cct.testing.gradient_check import check_layer_gradient, make_layer, setup_layer
from helpers.layers import run_layer

RNG = np.random.default_rng(7)
FLT_MAX = float(np.finfo(np.float32).max)


def distinct(shape, scale=0.1):
    """Values far apart (no ties, no argmax flips under the checker's step)."""
    return RNG.permutation(int(np.prod(shape))).reshape(shape) * scale - 1.0


def naive_pool(x, method, kernel, stride, pad, ceil=True):
    """Caffe's loops, written out: one output cell at a time."""
    n, c, h, w = x.shape
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, pad

    def size(length, k, s, p):
        rounding = math.ceil if ceil else math.floor
        out = int(rounding((length + 2 * p - k) / s)) + 1
        if p and (out - 1) * s >= length + p:
            out -= 1
        return out

    oh, ow = size(h, kh, sh, ph), size(w, kw, sw, pw)
    y = np.zeros((n, c, oh, ow))
    mask = np.full((n, c, oh, ow), -1)
    for a in range(n):
        for b in range(c):
            for i in range(oh):
                for j in range(ow):
                    hs, ws = i * sh - ph, j * sw - pw
                    if method == "MAX":
                        he, we = min(hs + kh, h), min(ws + kw, w)
                        hs, ws = max(hs, 0), max(ws, 0)
                        best, where = -FLT_MAX, -1
                        for r in range(hs, he):
                            for s in range(ws, we):
                                if x[a, b, r, s] > best:
                                    best, where = x[a, b, r, s], r * w + s
                        y[a, b, i, j], mask[a, b, i, j] = best, where
                    else:
                        he, we = min(hs + kh, h + ph), min(ws + kw, w + pw)
                        count = (he - hs) * (we - ws)
                        hs, ws, he, we = max(hs, 0), max(ws, 0), min(he, h), min(we, w)
                        y[a, b, i, j] = x[a, b, hs:he, ws:we].sum() / count
    return y, mask


# --- forward against the naive loops -------------------------------------------------------
CASES = [   # (prototxt fields, kernel, stride, pad, input shape)
    ("kernel_size: 3 stride: 2", (3, 3), (2, 2), (0, 0), (2, 3, 7, 8)),          # ceil overhang
    ("kernel_size: 3 stride: 2 pad: 1", (3, 3), (2, 2), (1, 1), (2, 2, 6, 7)),   # padding, last window dropped
    ("kernel_size: 2 stride: 2", (2, 2), (2, 2), (0, 0), (1, 2, 5, 5)),
    ("kernel_h: 3 kernel_w: 2 stride_h: 1 stride_w: 3 pad_h: 2 pad_w: 1", (3, 2), (1, 3), (2, 1), (2, 2, 5, 7)),
    ("kernel_size: 4 stride: 3 pad: 2", (4, 4), (3, 3), (2, 2), (1, 3, 8, 6)),
    ("kernel_size: 1 stride: 4", (1, 1), (4, 4), (0, 0), (1, 2, 6, 9)),
]


@pytest.mark.parametrize("method", ["MAX", "AVE"])
@pytest.mark.parametrize("fields,kernel,stride,pad,shape", CASES)
def test_forward_matches_naive(method, fields, kernel, stride, pad, shape):
    x = RNG.standard_normal(shape)
    _, _, tops = run_layer(f'type: "Pooling" pooling_param {{ pool: {method} {fields} }}', [x])
    expected, _ = naive_pool(x, method, kernel, stride, pad)
    np.testing.assert_allclose(tops[0].data, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("method", ["MAX", "AVE"])
def test_floor_round_mode(method):
    x = RNG.standard_normal((2, 2, 7, 8))
    _, _, tops = run_layer(f'type: "Pooling" pooling_param {{ pool: {method} kernel_size: 3 stride: 2 '
                           f'round_mode: FLOOR }}', [x])
    expected, _ = naive_pool(x, method, (3, 3), (2, 2), (0, 0), ceil=False)
    assert tops[0].shape == (2, 2, 3, 3)
    np.testing.assert_allclose(tops[0].data, expected, rtol=1e-12)


def test_max_mask_and_first_maximum_on_ties():
    x = np.zeros((1, 1, 4, 4))
    x[0, 0, 1, 1] = x[0, 0, 1, 2] = x[0, 0, 2, 1] = 5.0       # three tied maxima
    x[0, 0, 3, 3] = -2.0
    _, _, tops = run_layer('type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 1 }', [x], num_tops=2)
    expected, mask = naive_pool(x, "MAX", (3, 3), (1, 1), (0, 0))
    np.testing.assert_array_equal(tops[0].data, expected)
    np.testing.assert_array_equal(tops[1].data, mask)
    assert tops[1].data[0, 0, 0, 0] == 1 * 4 + 1                  # first in scan order


def test_max_backward_routes_to_argmax_and_sums_overlaps():
    x = RNG.standard_normal((2, 3, 6, 5))
    layer, bottoms, tops = run_layer('type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 1 pad: 1 }',
                                     [x])
    tops[0].diff[...] = RNG.standard_normal(tops[0].shape)
    layer.backward(tops, [True], bottoms)
    _, mask = naive_pool(x, "MAX", (3, 3), (1, 1), (1, 1))
    expected = np.zeros(x.shape)
    for index in np.ndindex(*mask.shape):
        h, w = divmod(mask[index], x.shape[3])
        expected[index[0], index[1], h, w] += tops[0].diff[index]
    np.testing.assert_allclose(bottoms[0].diff, expected, atol=1e-12)


def test_empty_max_window_keeps_caffe_initial_value():
    # kernel 1, stride 4 on 5 columns: ceil rounding adds a window past the image.
    x = RNG.standard_normal((1, 1, 1, 5))
    _, _, tops = run_layer('type: "Pooling" pooling_param { pool: MAX kernel_h: 1 kernel_w: 1 '
                           'stride_h: 1 stride_w: 6 }', [x], num_tops=2)
    expected, mask = naive_pool(x, "MAX", (1, 1), (1, 6), (0, 0))
    np.testing.assert_array_equal(tops[0].data, expected)
    np.testing.assert_array_equal(tops[1].data, mask)


@pytest.mark.parametrize("method", ["MAX", "AVE"])
def test_global_pooling(method):
    x = RNG.standard_normal((2, 3, 5, 4))
    _, _, tops = run_layer(f'type: "Pooling" pooling_param {{ pool: {method} global_pooling: true }}', [x])
    expected = x.max(axis=(2, 3)) if method == "MAX" else x.mean(axis=(2, 3))
    np.testing.assert_allclose(tops[0].data.reshape(2, 3), expected, rtol=1e-12)


# --- stochastic ---------------------------------------------------------------------------
def test_stochastic_test_phase_is_weighted_average():
    x = RNG.uniform(0, 1, (2, 2, 5, 5))
    _, _, tops = run_layer('type: "Pooling" pooling_param { pool: STOCHASTIC kernel_size: 3 stride: 2 }', [x],
                           phase=cct.TEST)
    expected = np.zeros((2, 2, 2, 2))
    for i in range(2):
        for j in range(2):
            window = x[:, :, 2 * i:2 * i + 3, 2 * j:2 * j + 3]
            expected[:, :, i, j] = (window ** 2).sum(axis=(2, 3)) / window.sum(axis=(2, 3))
    np.testing.assert_allclose(tops[0].data, expected, rtol=1e-6)


def test_stochastic_train_samples_by_probability():
    window = np.array([[1.0, 0.0], [3.0, 4.0]])
    x = np.broadcast_to(window, (4000, 1, 2, 2)).copy()
    cct.set_random_seed(3)
    layer, bottoms, tops = run_layer('type: "Pooling" pooling_param { pool: STOCHASTIC kernel_size: 2 }', [x])
    values, counts = np.unique(tops[0].data, return_counts=True)
    assert set(values) <= {1.0, 3.0, 4.0}
    np.testing.assert_allclose(counts / 4000, [0.125, 0.375, 0.5], atol=0.03)
    # The gradient goes to the sampled cell only.
    tops[0].diff[...] = 1.0
    layer.backward(tops, [True], bottoms)
    np.testing.assert_array_equal(bottoms[0].diff.sum(axis=(2, 3)), 1.0)
    np.testing.assert_array_equal((bottoms[0].diff * x).sum(axis=(2, 3)), tops[0].data.reshape(-1, 1))


# --- gradients ----------------------------------------------------------------------------
@pytest.mark.parametrize("fields", [
    "pool: MAX kernel_size: 3 stride: 2",
    "pool: MAX kernel_size: 3 stride: 2 pad: 1",
    "pool: MAX kernel_h: 2 kernel_w: 3 stride_h: 1 stride_w: 2 pad_h: 1 pad_w: 0",
    "pool: AVE kernel_size: 3 stride: 2 pad: 1",
    "pool: AVE kernel_size: 2 stride: 1",
    "pool: AVE global_pooling: true",
    "pool: MAX global_pooling: true",
    "pool: STOCHASTIC kernel_size: 2 stride: 2",
])
def test_gradient(fields):
    x = distinct((2, 2, 5, 6)) + 3.0                       # positive, for STOCHASTIC
    check_layer_gradient(make_layer(f'type: "Pooling" pooling_param {{ {fields} }}'), [x])


def test_gradient_with_mask_top():
    check_layer_gradient(make_layer('type: "Pooling" pooling_param { pool: MAX kernel_size: 2 stride: 2 }'),
                         [distinct((2, 2, 4, 5))], num_tops=2)


# --- SPP -----------------------------------------------------------------------------------
def naive_spp(x, height, method):
    n, c, h, w = x.shape
    levels = []
    for level in range(height):
        bins = 2 ** level
        kh, kw = math.ceil(h / bins), math.ceil(w / bins)
        pad = ((kh * bins - h + 1) // 2, (kw * bins - w + 1) // 2)
        pooled, _ = naive_pool(x, method, (kh, kw), (kh, kw), pad)
        levels.append(pooled.reshape(n, -1))
    return np.concatenate(levels, axis=1)


@pytest.mark.parametrize("method", ["MAX", "AVE"])
def test_spp_forward_and_gradient(method):
    x = distinct((2, 3, 8, 9))
    _, _, tops = run_layer(f'type: "SPP" spp_param {{ pyramid_height: 3 pool: {method} }}', [x])
    assert tops[0].shape == (2, 3 * (1 + 4 + 16))
    np.testing.assert_allclose(tops[0].data, naive_spp(x, 3, method), rtol=1e-12)
    check_layer_gradient(make_layer(f'type: "SPP" spp_param {{ pyramid_height: 2 pool: {method} }}'),
                         [distinct((2, 2, 5, 6))])


def test_spp_height_one_is_a_single_pooling():
    x = RNG.standard_normal((2, 3, 5, 4))
    layer, bottoms, tops = run_layer('type: "SPP" spp_param { pyramid_height: 1 }', [x])
    assert tops[0].shape == (2, 3, 1, 1)
    np.testing.assert_allclose(tops[0].data[..., 0, 0], x.max(axis=(2, 3)))
    # A new image size rebuilds the levels.
    bottoms[0].reshape(2, 3, 6, 7)
    bottoms[0].data[...] = RNG.standard_normal((2, 3, 6, 7))
    layer.reshape(bottoms, tops)
    layer.forward(bottoms, tops)
    np.testing.assert_allclose(tops[0].data[..., 0, 0], bottoms[0].data.max(axis=(2, 3)))


# --- errors --------------------------------------------------------------------------------
@pytest.mark.parametrize("fields,message", [
    ("pool: MAX", "kernel"),
    ("pool: MAX kernel_size: 2 kernel_h: 2 kernel_w: 2", "not both"),
    ("pool: MAX kernel_h: 2", "kernel_h"),
    ("pool: MAX kernel_size: 0", "kernel_size"),
    ("pool: MAX kernel_size: 2 stride: 0", "stride"),
    ("pool: MAX kernel_size: 2 pad: 1 pad_h: 1 pad_w: 1", "pad"),
    ("pool: MAX kernel_size: 2 stride_h: 2", "stride"),
    ("pool: MAX kernel_size: 2 pad: 2", "pad"),
    ("pool: STOCHASTIC kernel_size: 3 pad: 1", "MAX and AVE"),
    ("pool: AVE global_pooling: true kernel_size: 2", "global_pooling"),
    ("pool: AVE global_pooling: true stride: 2", "global_pooling"),
])
def test_config_errors(fields, message):
    with pytest.raises(ConfigError, match=message):
        setup_layer(make_layer(f'type: "Pooling" pooling_param {{ {fields} }}'), [np.zeros((1, 1, 5, 5))])


def test_mask_top_only_for_max_and_4d_bottom():
    with pytest.raises(ConfigError, match="mask"):
        setup_layer(make_layer('type: "Pooling" pooling_param { pool: AVE kernel_size: 2 }'),
                    [np.zeros((1, 1, 4, 4))], num_tops=2)
    with pytest.raises(ShapeError, match="4-d"):
        setup_layer(make_layer('type: "Pooling" pooling_param { pool: AVE kernel_size: 2 }'), [np.zeros((1, 4, 4))])
    with pytest.raises(ConfigError, match="pyramid_height"):
        setup_layer(make_layer('type: "SPP" spp_param { pool: MAX }'), [np.zeros((1, 1, 4, 4))])


def test_padding_on_one_axis_clips_the_last_window_on_both():
    """Caffe's Reshape drops a last window starting in the padding on each axis
    when either pad is non-zero (pooling_layer.cpp)."""
    for fields, expected in ((dict(kernel_h=2, kernel_w=1, stride_h=1, stride_w=3, pad_h=1, pad_w=0), (5, 2)),
                             (dict(kernel_h=1, kernel_w=2, stride_h=2, stride_w=1, pad_h=0, pad_w=1), (2, 6))):
        text = " ".join(f"{k}: {v}" for k, v in fields.items())
        layer = make_layer(f'type: "Pooling" pooling_param {{ pool: MAX {text} }}')
        _, tops = setup_layer(layer, [np.zeros((1, 1, 4, 5))])
        assert tops[0].shape[2:] == expected


def forward_backward(prototxt, x, dy, spread=None):
    layer = make_layer(prototxt, cct.TRAIN)
    bottoms, tops = setup_layer(layer, [x], dtype=x.dtype)
    if spread is not None:
        layer.run_partitions(1, spread.parts, spread)     # run whole on spread.parts threads
    layer.forward(bottoms, tops)
    tops[0].diff[...] = dy
    layer.backward(tops, [True], bottoms)
    return tops[0].data.copy(), bottoms[0].diff.copy()


def naive_backward(dy, mask, x_shape, method, kernel, stride, pad):
    """Caffe's backward loops: MAX routes by the mask, AVE spreads dy / divisor."""
    n, c, h, w = x_shape
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, pad
    dx = np.zeros(x_shape, dy.dtype)
    for a, b, i, j in np.ndindex(*dy.shape):
        if method == "MAX":
            if mask[a, b, i, j] >= 0:
                dx[a, b].flat[mask[a, b, i, j]] += dy[a, b, i, j]
            continue
        hs, ws = i * sh - ph, j * sw - pw
        he, we = min(hs + kh, h + ph), min(ws + kw, w + pw)
        share = dy[a, b, i, j] / dy.dtype.type((he - hs) * (we - ws))
        dx[a, b, max(hs, 0):min(he, h), max(ws, 0):min(we, w)] += share
    return dx


@pytest.mark.parametrize("method", ["MAX", "AVE"])
@pytest.mark.parametrize("fields,kernel,stride,pad,shape", CASES[:4])
def test_float32_forward_and_backward_equal_caffe_loops(method, fields, kernel, stride, pad, shape):
    """In float32, MAX equals Caffe's loops bitwise (the same winners, the same
    sums of routed gradients); AVE up to float32 rounding (its sums run in
    another order)."""
    x = RNG.standard_normal(shape).astype(np.float32)
    prototxt = f'type: "Pooling" pooling_param {{ pool: {method} {fields} }}'
    y, mask = naive_pool(x, method, kernel, stride, pad)
    y = y.astype(np.float32)
    dy = RNG.standard_normal(y.shape).astype(np.float32)
    ours_y, ours_dx = forward_backward(prototxt, x, dy)
    dx = naive_backward(dy, mask, shape, method, kernel, stride, pad)
    if method == "MAX":
        np.testing.assert_array_equal(ours_y, y)
        np.testing.assert_array_equal(ours_dx, dx)
    else:
        np.testing.assert_allclose(ours_y, y, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(ours_dx, dx, rtol=1e-6, atol=1e-7)


def test_max_winner_offsets_fit_the_kernel():
    """The kept winner offsets are bytes for small kernels, wider for big ones."""
    small = run_layer('type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 }',
                      [distinct((1, 1, 7, 7))])[0]
    big = run_layer('type: "Pooling" pooling_param { pool: MAX kernel_size: 12 stride: 1 }',
                    [distinct((1, 1, 13, 13))])[0]
    assert small.winner.dtype == np.int8 and big.winner.dtype == np.int16


def test_max_with_empty_windows_after_chunks():
    """A window with nothing above -FLT_MAX keeps -FLT_MAX and gets no gradient."""
    x = np.full((2, 1, 4, 4), -np.inf)
    x[0] = distinct((1, 4, 4))
    layer, bottoms, tops = run_layer('type: "Pooling" pooling_param { pool: MAX kernel_size: 2 stride: 2 }', [x])
    assert (tops[0].data[1] == -FLT_MAX).all() and (tops[0].data[0] > -FLT_MAX).all()
    tops[0].diff[...] = 1
    layer.backward(tops, [True], bottoms)
    assert not bottoms[0].diff[1].any() and bottoms[0].diff[0].sum() == 4


def test_max_whole_image_window_wider_than_the_image_routes_to_its_maximum():
    """Kernel 3, stride 2 on a 2 x 2 map: one window past the image; its winner
    is a flat index of the 2-wide image, not of the 3-wide kernel."""
    x = np.array([[[[1.0, 2.0], [3.0, 4.0]]]])
    layer, bottoms, tops = run_layer('type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 }', [x])
    assert tops[0].data.ravel().tolist() == [4.0]
    tops[0].diff[...] = 1
    layer.backward(tops, [True], bottoms)
    assert bottoms[0].diff.ravel().tolist() == [0, 0, 0, 1]


def test_max_backward_after_a_reshape_without_forward_is_an_error():
    layer, bottoms, tops = run_layer('type: "Pooling" pooling_param { pool: MAX kernel_size: 2 stride: 2 }',
                                     [distinct((2, 1, 4, 4))])
    bottoms[0].reshape(3, 1, 4, 4)
    layer.reshape(bottoms, tops)
    with pytest.raises(ShapeError, match="backward needs a forward"):
        layer.backward(tops, [True], bottoms)


# --- the compiled kernels against the numpy passes (layers/pooling_reference.py) -----------
KERNEL_CASES = [   # prototxt fields, input shape: every geometry the kernels special-case
    ("kernel_size: 3 stride: 2", (2, 3, 13, 13)),                    # GoogLeNet's pool1-4: ceil overhang
    ("kernel_size: 3 stride: 1 pad: 1", (1, 5, 7, 7)),               # the inception pools
    ("kernel_size: 2 stride: 2", (3, 4, 8, 8)),                      # LeNet: planes used as they are
    ("kernel_size: 3 stride: 2 pad: 1", (2, 2, 6, 7)),
    ("kernel_size: 2 stride: 2 round_mode: FLOOR", (2, 2, 7, 9)),   # rows and columns no window reaches
    ("kernel_h: 3 kernel_w: 2 stride_h: 1 stride_w: 3 pad_h: 2 pad_w: 1", (2, 2, 5, 7)),
    ("kernel_size: 4 stride: 3 pad: 2", (1, 3, 8, 6)),               # stride 3: the general column split
    ("kernel_size: 1 stride: 4", (1, 2, 6, 9)),                      # stride past the kernel
    ("kernel_size: 7 stride: 1", (2, 3, 7, 7)),                      # GoogLeNet's pool5: the whole image
    ("kernel_size: 3 stride: 2", (1, 2, 2, 2)),                      # one window wider than the image
    ("global_pooling: true", (2, 3, 5, 4)),
]


def forward_in(x, prototxt, num_tops=1):
    """The layer's tops after one forward, in x's dtype."""
    layer = make_layer(prototxt, cct.TEST)
    bottoms, tops = setup_layer(layer, [x], num_tops=num_tops, dtype=x.dtype)
    layer.forward(bottoms, tops)
    return tops


def forward_backward_both(prototxt, x, dy, num_tops=1):
    """(the layer's, the numpy passes') tops and bottom diff, and the layer
    (its kernel, stride and pad). The layer's gradient is a one-top layer's,
    routed by its kept winners output after output, in Caffe's order (with a
    mask top the layer routes by the mask with np.bincount, whose float64
    sums round once); the MAX passes route by their own mask in that order."""
    compiled = []
    for tops_now in sorted({num_tops, 1}, reverse=True):
        layer = make_layer(prototxt, cct.TRAIN)
        bottoms, tops = setup_layer(layer, [x], dtype=x.dtype, num_tops=tops_now)
        layer.forward(bottoms, tops)
        tops[0].diff[...] = dy
        layer.backward(tops, [True], bottoms)
        compiled = compiled or [top.data.copy() for top in tops]
    compiled.append(bottoms[0].diff.copy())
    geometry = (layer.kernel, layer.stride, layer.pad)
    if layer.pool == pooling_module.MAX:
        value, _, mask = pooling_reference.max_pool(x, *geometry, layer.out_hw)
        passes = [value, mask.astype(x.dtype)][:num_tops] + [pooling_reference.max_backward(dy, mask, x.shape)]
    else:
        passes = [pooling_reference.ave_pool(x, *geometry, layer.out_hw), pooling_reference.ave_backward(dy, x.shape, *geometry)]
    return (compiled, passes), layer


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("method", ["MAX", "AVE"])
@pytest.mark.parametrize("fields,shape", KERNEL_CASES)
def test_kernels_equal_numpy_passes(monkeypatch, fields, shape, method, dtype):
    """Bit for bit: MAX's values, mask and routed gradients; AVE's window sums
    (both add a window's cells in scan order from 0; the padding's zeros change
    nothing). AVE's spread gradients equal Caffe's loop bit for bit (each cell's
    shares in the order of their outputs), the numpy passes' (window offset
    order) to rounding. A whole-image AVE sums in scan order where numpy's sum
    goes pairwise: checked against Caffe's loop below."""
    x = RNG.standard_normal(shape).astype(dtype)
    x[0, 0, 0, :2] = x[0, 0, 1, 0]                             # ties: the first in scan order wins
    prototxt = f'type: "Pooling" pooling_param {{ pool: {method} {fields} }}'
    top_shape = run_layer(prototxt, [x])[2][0].shape
    dy = RNG.standard_normal(top_shape).astype(dtype)
    (compiled, numpy_passes), layer = forward_backward_both(prototxt, x, dy, num_tops=2 if method == "MAX" else 1)
    whole_image_ave = method == "AVE" and layer.whole_image
    tolerance = dict(rtol=1e-6 if dtype == np.float32 else 1e-14, atol=1e-7 if dtype == np.float32 else 1e-15)
    for ours, theirs in zip(compiled[:-1], numpy_passes[:-1]):
        if whole_image_ave:
            np.testing.assert_allclose(ours, theirs, **tolerance)
        else:
            np.testing.assert_array_equal(ours, theirs)
    if method == "MAX":
        np.testing.assert_array_equal(compiled[-1], numpy_passes[-1])
    else:
        np.testing.assert_allclose(compiled[-1], numpy_passes[-1], **tolerance)
        if not layer.whole_image:
            caffe = naive_backward(dy, None, shape, "AVE", layer.kernel, layer.stride, layer.pad)
            np.testing.assert_array_equal(compiled[-1], caffe)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("fields,shape", KERNEL_CASES)
def test_a_forward_no_backward_follows_gives_the_same_maxima(fields, shape, dtype):
    """A MAX layer its net never runs backward (runs_backward False, no mask
    top) finds the maxima without their winners: bit for bit the same values,
    with ties, NaN, infinities and windows of padding only."""
    x = RNG.standard_normal(shape).astype(dtype)
    x[0, 0, 0, :2] = x[0, 0, 1, 0]
    x.flat[3], x.flat[-1], x.flat[-2] = np.nan, -np.inf, np.inf
    prototxt = f'type: "Pooling" pooling_param {{ pool: MAX {fields} }}'
    tracked = forward_in(x, prototxt)[0].data
    layer = make_layer(prototxt, cct.TEST)
    layer.runs_backward = False
    bottoms, tops = setup_layer(layer, [x], dtype=dtype)
    layer.forward(bottoms, tops)
    np.testing.assert_array_equal(tops[0].data, tracked)
    general = not (layer.whole_image or layer._tiles_2x2(x))
    assert (layer.winner is None) == general


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(2, 3, 7, 7), (1, 4, 28, 28), (2, 3, 1, 5), (1, 2, 4, 1), (1, 1, 1, 1),
                                   (1, 2, 2, 2), (1, 3, 2, 9), (2, 2, 9, 2), (1, 3, 13, 13), (1, 2, 12, 11)])
@pytest.mark.parametrize("fields, kernel_name", [("stride: 1 pad: 1", "max_3x3_same"),
                                                 ("stride: 2", "max_3x3_stride2")])
def test_the_3x3_pooling_kernels_give_the_general_maxima(shape, dtype, fields, kernel_name, monkeypatch):
    """3 x 3 at stride 1 with padding 1 (max_3x3_same) and at stride 2 with
    ceil-mode overhang (max_3x3_stride2), no backward to follow: bit for bit
    the general kernel's values (winners found) on planes down to one row or
    column, with ties of 0.0 and -0.0 (the first in scan order wins), NaN and
    infinities."""
    x = RNG.standard_normal(shape).astype(dtype)
    x.flat[::5] = 0.0
    x.flat[1::5] = -0.0
    x.flat[-1] = np.nan if x.size % 2 else -np.inf      # a window of one cell that never wins included
    if x.size > 8:
        x.flat[3], x.flat[-3] = np.nan, np.inf
    prototxt = f'type: "Pooling" pooling_param {{ pool: MAX kernel_size: 3 {fields} }}'
    general = forward_in(x, prototxt)[0].data
    calls = []
    real = getattr(pooling_kernels, kernel_name)
    monkeypatch.setattr(pooling_kernels, kernel_name, lambda *a: calls.append(1) or real(*a))
    layer = make_layer(prototxt, cct.TEST)
    layer.runs_backward = False
    bottoms, tops = setup_layer(layer, [x], dtype=dtype)
    layer.forward(bottoms, tops)
    # the stride-2 kernel takes planes whose windows all start inside (not whole-image ones)
    applies = layer._same_3x3(x) if kernel_name == "max_3x3_same" else layer._stride2_3x3(x) and not layer.whole_image
    assert bool(calls) == applies and (applies or min(shape[2:]) < 3)
    np.testing.assert_array_equal(tops[0].data, general)
    assert (np.signbit(tops[0].data) == np.signbit(general)).all()


def test_whole_image_average_sums_in_caffe_order():
    x = RNG.standard_normal((2, 3, 7, 7)).astype(np.float32) * 1000
    tops = forward_in(x, 'type: "Pooling" pooling_param { pool: AVE global_pooling: true }')
    for index in np.ndindex(2, 3):
        total = np.float32(0)
        for value in x[index].ravel():                          # Caffe's loop, float32 throughout
            total = np.float32(total + value)
        assert tops[0].data[index][0, 0] == total / np.float32(49)


@pytest.mark.parametrize("block_cells", [1, 200])
@pytest.mark.parametrize("method", ["MAX", "AVE"])
@pytest.mark.parametrize("fields,shape", KERNEL_CASES[:7])
def test_kernel_blocks_give_the_one_block_numbers(monkeypatch, fields, shape, method, block_cells):
    """BLOCK_CELLS below a plane: every plane is its own block; 200: blocks of
    a few planes, the last one short."""
    x = RNG.standard_normal(shape).astype(np.float32)
    prototxt = f'type: "Pooling" pooling_param {{ pool: {method} {fields} }}'
    dy = RNG.standard_normal(run_layer(prototxt, [x])[2][0].shape).astype(np.float32)
    whole = forward_backward(prototxt, x, dy)
    monkeypatch.setattr("cct.layers.pooling_kernels.BLOCK_CELLS", block_cells)
    blocked = forward_backward(prototxt, x, dy)
    for ours, theirs in zip(blocked, whole):
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(3, 4, 8, 8), (1, 2, 2, 6)])
def test_2x2_kernels_equal_the_general_kernels_and_the_numpy_passes(monkeypatch, shape, dtype):
    """2 x 2 windows at stride 2 tiling the planes run max_forward_2x2 and
    max_backward_2x2: bit for bit the general kernels and the numpy passes,
    values, winners and the gradient routed by those winners (no mask top),
    with ties, NaN, infinities and gradients of -0.0."""
    x = RNG.standard_normal(shape).astype(dtype)
    x[0, 0, 0, :2] = x[0, 0, 1, 0]                             # ties: the first in scan order wins
    x[0, 1, :2, :2] = np.nan
    x[0, 1, 0, 2:4] = -np.inf
    x[0, 1, 1, 2] = np.nan
    prototxt = 'type: "Pooling" pooling_param { pool: MAX kernel_size: 2 stride: 2 }'
    dy = RNG.standard_normal(run_layer(prototxt, [x])[2][0].shape).astype(dtype)
    dy[0, 0, 0, 0] = -0.0
    calls = []
    for name in ("max_forward_2x2", "max_backward_2x2"):
        real = getattr(pooling_kernels, name)
        monkeypatch.setattr(pooling_kernels, name, lambda *a, name=name, real=real: calls.append(name) or real(*a))
    (compiled, numpy_passes), layer = forward_backward_both(prototxt, x, dy)
    assert calls == ["max_forward_2x2", "max_backward_2x2"]
    monkeypatch.setattr(pooling_module.Pooling, "_tiles_2x2", lambda self, x: False)
    (general, _), _ = forward_backward_both(prototxt, x, dy)
    for ours, theirs, other in zip(compiled, numpy_passes, general):
        assert np.array_equal(ours, theirs, equal_nan=True) and np.array_equal(ours, other, equal_nan=True)
        assert np.array_equal(np.signbit(ours), np.signbit(theirs)) and np.array_equal(np.signbit(ours),
                                                                                   np.signbit(other))
    np.testing.assert_array_equal(layer.winner[0, 1, 0, :2], [-1, 3])     # all NaN: none; -inf never wins


@pytest.mark.parametrize("fields,kernel,stride,pad", [
    ("kernel_size: 2 stride: 2", (2, 2), (2, 2), (0, 0)),
    ("kernel_size: 3 stride: 2", (3, 3), (2, 2), (0, 0)),
    ("kernel_size: 3 stride: 1 pad: 1", (3, 3), (1, 1), (1, 1)),
    ("global_pooling: true", (5, 6), (1, 1), (0, 0)),
])
def test_max_kernel_skips_nan_and_infinity_as_caffe_does(fields, kernel, stride, pad):
    """Caffe's `if (x > max)` from -FLT_MAX: NaN, -inf and -FLT_MAX never win;
    a window of nothing else keeps -FLT_MAX and mask -1."""
    x = RNG.standard_normal((1, 2, 5, 6)).astype(np.float32)
    x[0, 0, :2, :3] = np.nan
    x[0, 0, 3:, 2:] = -np.inf
    x[0, 1] = -np.inf
    x[0, 1, 2, 3] = np.nan
    tops = forward_in(x, f'type: "Pooling" pooling_param {{ pool: MAX {fields} }}', num_tops=2)
    expected, mask = naive_pool(x, "MAX", kernel, stride, pad)
    np.testing.assert_array_equal(tops[0].data, expected.astype(np.float32))
    np.testing.assert_array_equal(tops[1].data, mask)


@pytest.mark.parametrize("text", ["pool: MAX kernel_size: 3 stride: 2", "pool: AVE kernel_size: 3 stride: 1 pad: 1",
                                  "pool: MAX global_pooling: true"])
def test_a_spread_layer_gives_the_one_call_numbers(monkeypatch, text):
    """Kernels of a layer run whole on several threads split into ranges of
    planes (Layer.run_partitions' spread) give the one call's numbers; a
    batch partition's twin never splits."""
    from cct.layers import pooling
    x = distinct((2, 3, 9, 9))
    prototxt = f'type: "Pooling" pooling_param {{ {text} }}'
    dy = RNG.standard_normal(run_layer(prototxt, [x])[2][0].shape)
    whole = forward_backward(prototxt, x, dy)
    calls = []

    class Spread:
        parts = 4

        def __call__(self, function, pieces):
            calls.append(len(pieces))
            for arguments in pieces:
                function(*arguments)
    monkeypatch.setattr(pooling, "PARALLEL_ELEMENTS", 0)
    split = forward_backward(prototxt, x, dy, spread=Spread())
    assert calls and set(calls) == {4}
    calls.clear()
    twin = make_layer(prototxt, cct.TRAIN).clone(2)
    twin.run_partitions(1, 4, Spread())
    bottoms, tops = setup_layer(twin, [x])
    twin.forward(bottoms, tops)
    assert not calls
    for ours, theirs in zip(split, whole):
        np.testing.assert_array_equal(ours, theirs)
