"""Upsample (layers/segmentation.py) in both flavours, against loops written
here from the forks' C++ (caffe-segnet's upsample_layer.cpp, the YOLOv3
ports' upsample_layer.cpp): SegNet's unpooling fed by a Pooling layer's mask
top, the nearest-neighbour upsampling, their gradients, and their errors.
OpenCV has neither (its importer refuses the type)."""
import numpy as np
import pytest

import cct
from cct.core.errors import ConfigError, ShapeError
from cct.testing.gradient_check import check_layer_gradient, make_layer
from helpers.layers import run_layer

RNG = np.random.default_rng(38)


def pooled_with_mask(x, kernel=2, stride=2):
    """A MAX Pooling layer's output and mask top on x."""
    text = f'type: "Pooling" pooling_param {{ pool: MAX kernel_size: {kernel} stride: {stride} }}'
    _, _, tops = run_layer(text, [x], num_tops=2)
    return tops[0].data.copy(), tops[1].data.copy()


def naive_unpool(values, mask, out_h, out_w):
    """The fork's Forward_cpu: zeros, then top[mask[i]] = bottom[i] plane by plane, in order."""
    n, c = values.shape[:2]
    top = np.zeros((n, c, out_h * out_w))
    for i in range(n):
        for j in range(c):
            for v, m in zip(values[i, j].ravel(), mask[i, j].ravel()):
                top[i, j, int(m)] = v
    return top.reshape(n, c, out_h, out_w)


@pytest.mark.parametrize("size, kernel, stride, fields, out", [
    ((8, 6), 2, 2, "scale: 2", (8, 6)),
    ((7, 9), 2, 2, "scale: 2 pad_out_h: true pad_out_w: true", (7, 9)),
    ((7, 9), 3, 2, "upsample_h: 7 upsample_w: 9", (7, 9)),          # overlapping windows: a later value wins
    ((9, 6), 3, 3, "scale_h: 3 scale_w: 3", (9, 6)),
])
def test_unpooling_forward_and_backward(size, kernel, stride, fields, out):
    x = RNG.standard_normal((2, 3) + size)
    values, mask = pooled_with_mask(x, kernel, stride)
    layer, bottoms, tops = run_layer(f'type: "Upsample" upsample_param {{ {fields} }}', [values, mask])
    assert tops[0].shape == (2, 3) + out
    np.testing.assert_array_equal(tops[0].data, naive_unpool(values, mask, *out))
    dy = RNG.standard_normal(tops[0].shape)
    tops[0].diff[...] = dy
    layer.backward(tops, [True, True], bottoms)
    flat = dy.reshape(2, 3, -1)                   # the fork's gather: dx[i] = dy[mask[i]], repeats too
    want = np.take_along_axis(flat, mask.reshape(2, 3, -1).astype(int), axis=2).reshape(values.shape)
    np.testing.assert_array_equal(bottoms[0].diff, want)
    assert not bottoms[1].diff.any()


def test_unpooling_gradient():
    values, mask = pooled_with_mask(RNG.standard_normal((2, 2, 6, 4)))
    check_layer_gradient(make_layer('type: "Upsample" upsample_param { scale: 2 }'), [values, mask],
                         check_bottoms=[0])


def test_segnet_pool_and_unpool_in_a_net():
    net = cct.Net("""input: "x" input_shape { dim: 1 dim: 2 dim: 6 dim: 6 }
        layer { name: "pool" type: "Pooling" bottom: "x" top: "pool" top: "mask" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
        layer { name: "up" type: "Upsample" bottom: "pool" bottom: "mask" top: "up" upsample_param { scale: 2 } }""",
                  cct.TEST)
    x = RNG.standard_normal((1, 2, 6, 6))
    net.blobs["x"].data[...] = x
    up = net.forward()["up"]
    blocks = x.reshape(1, 2, 3, 2, 3, 2)
    is_max = blocks == blocks.max(axis=(3, 5), keepdims=True)
    np.testing.assert_allclose(up, np.where(is_max, blocks, 0).reshape(x.shape), rtol=1e-6)


def naive_nearest_backward(dy, scale):
    """The port's Backward_cpu: each input's s x s block summed, column offset outer."""
    n, c, h, w = dy.shape[0], dy.shape[1], dy.shape[2] // scale, dy.shape[3] // scale
    dx = np.zeros((n, c, h, w), np.float32)
    for y in range(h):
        for x in range(w):
            for i in range(scale):
                for j in range(scale):
                    dx[:, :, y, x] += dy[:, :, y * scale + j, x * scale + i]
    return dx


@pytest.mark.parametrize("scale", [1, 2, 3])
def test_nearest_forward_backward_and_gradient(scale):
    x = RNG.standard_normal((2, 3, 4, 5)).astype(np.float32)
    text = f'type: "Upsample" upsample_param {{ scale: {scale} }}'
    layer, bottoms, tops = run_layer(text, [x])
    assert tops[0].shape == (2, 3, 4 * scale, 5 * scale)
    for h in range(4 * scale):
        for w in range(5 * scale):
            np.testing.assert_array_equal(tops[0].data[:, :, h, w], x[:, :, h // scale, w // scale])
    dy = RNG.standard_normal(tops[0].shape).astype(np.float32)
    layer, bottoms, tops = run_layer(text, [x], dtype=np.float32)
    tops[0].diff[...] = dy
    layer.backward(tops, [True], bottoms)
    np.testing.assert_array_equal(bottoms[0].diff, naive_nearest_backward(dy, scale))
    check_layer_gradient(make_layer(text), [RNG.standard_normal((1, 2, 3, 2))])


@pytest.mark.parametrize("fields, bottoms, error, message", [
    ("upsample_h: 4", 2, ConfigError, r"\(Upsample\): upsample_param.upsample_h: give upsample_h and upsample_w together"),
    ("scale: 1", 2, ConfigError, r"upsample_param.scale: must be > 1, got 1"),
    ("scale: 3 pad_out_h: true", 2, ConfigError, r"upsample_param.pad_out_h: needs its scale to be 2, got 3"),
    ("scale_h: 2", 2, ConfigError, r"upsample_param.scale_h: give upsample_h and upsample_w, or scale"),
    ("scale: 0", 1, ConfigError, r"upsample_param.scale: must be >= 1, got 0"),
    ("upsample_h: 4 upsample_w: 4", 1, ConfigError, r"upsample_param.upsample_h: the one-bottom .* takes only scale"),
])
def test_upsample_errors(fields, bottoms, error, message):
    with pytest.raises(error, match=message):
        run_layer(f'type: "Upsample" upsample_param {{ {fields} }}', [np.zeros((1, 1, 2, 2))] * bottoms)


def test_unpooling_mask_out_of_range():
    values, mask = pooled_with_mask(RNG.standard_normal((1, 1, 8, 8)))
    with pytest.raises(ShapeError, match=r"mask \(bottom\[1\]\) holds index \d+, outside the 4 x 4 top"):
        run_layer('type: "Upsample" upsample_param { upsample_h: 4 upsample_w: 4 }', [values, mask])
    with pytest.raises(ShapeError, match=r"must have bottom\[0\]'s shape"):
        run_layer('type: "Upsample"', [values, mask[:, :, :2]])
