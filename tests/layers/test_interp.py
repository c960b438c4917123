"""Interp (layers/segmentation.py): forward and backward against plain loops
written from the fork's C++ (PSPNet's and DeepLab v2's util/interp.cpp,
float32 as its Caffe<float>), the gradient, the parameters' errors, and
forward against OpenCV 4's DNN module on one-layer and small nets where
OpenCV sizes the output as the fork does (it ignores pad_beg/pad_end and a
shrink_factor beside zoom_factor, and takes no second bottom)."""
import numpy as np
import pytest

from cct.core.errors import ConfigError, ShapeError
from cct.testing.gradient_check import check_layer_gradient, make_layer
from helpers.layers import run_layer
from helpers.opencv4 import assert_close, compare_with_opencv

RNG = np.random.default_rng(38)
F32 = np.float32


def fork_terms(size1, size2, h2):
    """The fork's (h1, h1p, h0lambda, h1lambda) of output row h2, float32."""
    ratio = F32(size1 - 1) / F32(size2 - 1) if size2 > 1 else F32(0)
    position = F32(ratio * F32(h2))
    h1 = int(position)
    lam1 = F32(position - F32(h1))
    return h1, 1 if h1 < size1 - 1 else 0, F32(F32(1) - lam1), lam1


def naive_interp(x, out_h, out_w, pad_beg=0, pad_end=0):
    """caffe_cpu_interp2 on the cropped input, element by element."""
    n, c, h, w = x.shape
    h1, w1 = h + pad_beg + pad_end, w + pad_beg + pad_end
    crop = x[:, :, -pad_beg:-pad_beg + h1, -pad_beg:-pad_beg + w1].astype(F32)
    if (h1, w1) == (out_h, out_w):
        return crop.copy()
    y = np.empty((n, c, out_h, out_w), F32)
    for i in range(out_h):
        r, rp, a0, a1 = fork_terms(h1, out_h, i)
        for j in range(out_w):
            s, sp, b0, b1 = fork_terms(w1, out_w, j)
            p = crop[:, :, r, s], crop[:, :, r, s + sp], crop[:, :, r + rp, s], crop[:, :, r + rp, s + sp]
            y[:, :, i, j] = a0 * (b0 * p[0] + b1 * p[1]) + a1 * (b0 * p[2] + b1 * p[3])
    return y


def naive_interp_backward(dy, shape, pad_beg=0, pad_end=0):
    """caffe_cpu_interp2_backward: each output's four terms added in order."""
    n, c, h, w = shape
    h1, w1 = h + pad_beg + pad_end, w + pad_beg + pad_end
    dx = np.zeros(shape, F32)
    crop = dx[:, :, -pad_beg:-pad_beg + h1, -pad_beg:-pad_beg + w1]
    out_h, out_w = dy.shape[2:]
    if (h1, w1) == (out_h, out_w):
        crop += dy
        return dx
    for i in range(out_h):
        r, rp, a0, a1 = fork_terms(h1, out_h, i)
        for j in range(out_w):
            s, sp, b0, b1 = fork_terms(w1, out_w, j)
            g = dy[:, :, i, j].astype(F32)
            crop[:, :, r, s] += a0 * b0 * g
            crop[:, :, r, s + sp] += a0 * b1 * g
            crop[:, :, r + rp, s] += a1 * b0 * g
            crop[:, :, r + rp, s + sp] += a1 * b1 * g
    return dx


# (fields, the output size for an 8 x 6 input)
CASES = [("zoom_factor: 2", (15, 11)), ("zoom_factor: 8", (57, 41)), ("height: 13 width: 17", (13, 17)),
         ("shrink_factor: 2", (4, 3)), ("shrink_factor: 2 zoom_factor: 3", (10, 7)),
         ("zoom_factor: 2 pad_beg: -1 pad_end: -1", (11, 7)), ("height: 8 width: 6", (8, 6)),
         ("height: 1 width: 1", (1, 1)), ("height: 5 width: 3 shrink_factor: 3", (3, 2)),
         ("height: 4 width: 3 pad_end: -2", (4, 3))]


def pads(fields):
    words = fields.split()
    value = {words[i].rstrip(":"): int(words[i + 1]) for i in range(0, len(words), 2)}
    return value.get("pad_beg", 0), value.get("pad_end", 0)


@pytest.mark.parametrize("fields, size", CASES)
def test_interp_forward_and_backward_are_the_forks(fields, size):
    x = RNG.standard_normal((2, 3, 8, 6)).astype(F32)
    layer, bottoms, tops = run_layer(f'type: "Interp" interp_param {{ {fields} }}', [x], dtype=F32)
    assert tops[0].shape == (2, 3) + size
    np.testing.assert_array_equal(tops[0].data, naive_interp(x, *size, *pads(fields)))
    dy = RNG.standard_normal(tops[0].shape).astype(F32)
    tops[0].diff[...] = dy
    bottoms[0].diff[...] = 7
    layer.backward(tops, [True], bottoms)
    np.testing.assert_array_equal(bottoms[0].diff, naive_interp_backward(dy, x.shape, *pads(fields)))


def test_interp_second_bottom_gives_the_size():
    x, reference = RNG.standard_normal((2, 3, 5, 4)).astype(F32), np.zeros((2, 1, 9, 11), F32)
    _, _, tops = run_layer('type: "Interp"', [x, reference], dtype=F32)
    np.testing.assert_array_equal(tops[0].data, naive_interp(x, 9, 11))


@pytest.mark.parametrize("fields", ["zoom_factor: 3", "height: 7 width: 4 pad_beg: -1", "shrink_factor: 2",
                                    "height: 6 width: 5"])
def test_interp_gradient(fields):
    check_layer_gradient(make_layer(f'type: "Interp" interp_param {{ {fields} }}'),
                         [RNG.standard_normal((2, 2, 6, 5))])


@pytest.mark.parametrize("fields, bottoms, error, message", [
    ("pad_beg: 1 zoom_factor: 2", 1, ConfigError, r"\(Interp\): interp_param.pad_beg: must be <= 0"),
    ("height: 4 width: 4", 2, ConfigError, r"interp_param.height: the output size comes from the second bottom"),
    ("height: 4", 1, ConfigError, r"interp_param: give the output size"),
    ("zoom_factor: 0", 1, ConfigError, r"interp_param.zoom_factor: must be >= 1, got 0"),
    ("zoom_factor: 2 pad_beg: -3 pad_end: -3", 1, ShapeError, r"leaves nothing of the 5 x 5 input"),
])
def test_interp_errors(fields, bottoms, error, message):
    arrays = [np.zeros((1, 2, 5, 5))] * bottoms
    with pytest.raises(error, match=message):
        run_layer(f'type: "Interp" interp_param {{ {fields} }}', arrays, dtype=F32)


# --- against OpenCV 4 ---------------------------------------------------------------
@pytest.mark.parametrize("fields", ["zoom_factor: 2", "zoom_factor: 8", "height: 13 width: 17", "height: 8 width: 6",
                                    "height: 1 width: 1", "height: 5 width: 3"])
def test_interp_against_opencv(tmp_path, fields):
    text = f'layer {{ name: "y" type: "Interp" bottom: "x" top: "y" interp_param {{ {fields} }} }}\n'
    ours, theirs = compare_with_opencv(tmp_path, text, {"x": RNG.standard_normal((2, 3, 8, 6)).astype(F32)}, ["y"])
    print(f"{fields}: max relative difference {assert_close(ours['y'], theirs['y']):.2g}")


# PSPNet's head in small: pyramid pooling, each level back to the map's size, concatenated, zoomed
SMALL_PSP = """
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "pool2" type: "Pooling" bottom: "conv" top: "pool2" pooling_param { pool: AVE kernel_size: 6 stride: 6 } }
layer { name: "pool2_interp" type: "Interp" bottom: "pool2" top: "pool2_interp" interp_param { height: 12 width: 12 } }
layer { name: "pool3" type: "Pooling" bottom: "conv" top: "pool3" pooling_param { pool: AVE kernel_size: 4 stride: 4 } }
layer { name: "pool3_interp" type: "Interp" bottom: "pool3" top: "pool3_interp" interp_param { height: 12 width: 12 } }
layer { name: "cat" type: "Concat" bottom: "conv" bottom: "pool2_interp" bottom: "pool3_interp" top: "cat" }
layer { name: "zoom" type: "Interp" bottom: "cat" top: "zoom" interp_param { zoom_factor: 4 } }
"""


def test_small_pspnet_head_against_opencv(tmp_path):
    ours, theirs = compare_with_opencv(tmp_path, SMALL_PSP, {"data": RNG.standard_normal((2, 3, 12, 12)).astype(F32)},
                                       ["pool2_interp", "zoom"])
    for name in ("pool2_interp", "zoom"):
        print(f"{name}: max relative difference {assert_close(ours[name], theirs[name]):.2g}")
