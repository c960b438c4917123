"""The OpenCL device's pooling, LRN and BatchNorm ops (kernels/pooling.cl,
kernels/normalization.cl) against the numpy reference device
(cct.devices.cpu), on odd shapes: padding, stride above the kernel,
ceil-mode overhang, global pooling, 1 x 1 images; and the reference's
pooling against Caffe's loops written out in Python."""
import numpy as np
import pytest

from cct.devices.cpu import CPU
from cct.layers.pooling import pooled_size
from helpers.devices import OPENCL, on_device, opencl_or_skip, same_op, to_host

RNG = np.random.default_rng(23)
FLT_MAX = float(np.finfo(np.float32).max)


def random(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


@pytest.fixture(params=[OPENCL])
def opencl():
    return opencl_or_skip()


def assert_same(pairs, tolerance=1e-6):
    for ours, expected in pairs:
        np.testing.assert_allclose(ours, expected, rtol=tolerance,
                                   atol=tolerance * max(1, np.nanmax(np.abs(expected), initial=0)))


# (N, C, H, W), kernel, stride, pad, ceil rounding
GEOMETRIES = [
    ((2, 3, 7, 6), (3, 3), (2, 2), (1, 1), True),          # padded, ceil overhang clipped
    ((1, 2, 9, 8), (3, 2), (2, 3), (0, 0), True),          # overhang past the image, no padding
    ((2, 2, 5, 7), (2, 2), (3, 3), (1, 0), False),         # stride above the kernel, floor
    ((1, 3, 6, 6), (6, 6), (1, 1), (0, 0), True),          # global pooling
    ((3, 2, 1, 1), (1, 1), (1, 1), (0, 0), True),          # 1 x 1 images
    ((1, 1, 1, 1), (2, 2), (1, 1), (1, 1), True),          # a padded 1 x 1 image
    ((2, 1, 4, 9), (1, 4), (1, 2), (0, 3), True),          # non-square, pad on one axis
    ((1, 2, 5, 5), (1, 1), (3, 3), (0, 0), True),          # last windows wholly past the image: divisor -1
    ((1, 2, 4, 5), (1, 1), (2, 2), (0, 0), True),          # a window at H + pad: Caffe's 0 / 0
]


def geometry(shape, kernel, stride, pad, ceil):
    padded = any(pad)
    pooled = tuple(pooled_size(size, k, s, p, ceil, padded)
                   for size, k, s, p in zip(shape[2:], kernel, stride, pad))
    return shape, pooled, kernel, stride, pad


def outputs(shape, pooled):
    return shape[0] * shape[1] * pooled[0] * pooled[1]


@pytest.mark.parametrize("case", GEOMETRIES, ids=lambda case: "x".join(map(str, case[0])))
def test_max_pool(opencl, case):
    geom = geometry(*case)
    shape, pooled = geom[:2]
    x = np.round(random(*shape) * 2) / 2                  # many ties: the first maximum must win
    count = outputs(shape, pooled)
    forward = same_op(opencl, "max_pool_forward", [x, np.zeros(count), np.zeros(count)], [1, 2], *geom)
    assert_same(forward, 0)
    mask = forward[1][1]
    dy = random(count)
    backward = same_op(opencl, "max_pool_backward", [dy, mask, np.zeros(x.size)], [2], *geom)
    assert_same(backward)


@pytest.mark.parametrize("case", GEOMETRIES, ids=lambda case: "x".join(map(str, case[0])))
def test_ave_pool(opencl, case):
    geom = geometry(*case)
    shape, pooled = geom[:2]
    count = outputs(shape, pooled)
    assert_same(same_op(opencl, "ave_pool_forward", [random(*shape), np.zeros(count)], [1], *geom))
    assert_same(same_op(opencl, "ave_pool_backward", [random(count), np.zeros(int(np.prod(shape)))], [1], *geom))


def test_max_pool_backward_routes_by_a_mask_with_empty_windows(opencl):
    # a mask top's -1 (a window with nothing above -FLT_MAX) routes nowhere
    geom = geometry((1, 1, 3, 3), (2, 2), (1, 1), (0, 0), True)
    mask = np.array([0, -1, 4, 4], np.float32)
    dy = np.array([1, 2, 3, 4], np.float32)
    (ours, expected), = same_op(opencl, "max_pool_backward", [dy, mask, np.zeros(9)], [2], *geom)
    np.testing.assert_array_equal(expected, [1, 0, 0, 0, 7, 0, 0, 0, 0])
    np.testing.assert_array_equal(ours, expected)


def test_max_pool_never_picks_nan_or_minus_inf(opencl):
    x = np.array([np.nan, -np.inf, -np.inf, 2.0], np.float32)
    geom = ((1, 1, 2, 2), (2, 1), (1, 2), (1, 1), (0, 0))
    for device in (opencl, CPU):
        buffers = on_device(device, [x, np.zeros(2), np.zeros(2)])
        device.max_pool_forward(*buffers, *geom)
        assert list(to_host(device, buffers[1], 2)) == [-FLT_MAX, 2.0]
        assert list(to_host(device, buffers[2], 2)) == [-1.0, 3.0]


def caffe_pool(x, pooled, kernel, stride, pad, method):
    """Caffe's pooling forward as its CPU loops (the reference's reference)."""
    n, c, h, w = x.shape
    y = np.zeros((n, c) + pooled, np.float32)
    mask = np.full(y.shape, -1, np.int64)
    for ph in range(pooled[0]):
        for pw in range(pooled[1]):
            hstart, wstart = ph * stride[0] - pad[0], pw * stride[1] - pad[1]
            hend, wend = min(hstart + kernel[0], h + pad[0]), min(wstart + kernel[1], w + pad[1])
            size = (hend - hstart) * (wend - wstart)
            hstart, wstart, hend, wend = max(hstart, 0), max(wstart, 0), min(hend, h), min(wend, w)
            window = x[:, :, hstart:hend, wstart:wend].reshape(n, c, -1)
            if method == "max":
                best = np.full((n, c), -FLT_MAX, np.float32)
                for k in range(window.shape[2]):
                    better = window[:, :, k] > best
                    best = np.where(better, window[:, :, k], best)
                    cell = (hstart + k // (wend - wstart)) * w + wstart + k % (wend - wstart)
                    mask[:, :, ph, pw] = np.where(better, cell, mask[:, :, ph, pw])
                y[:, :, ph, pw] = best
            else:
                with np.errstate(invalid="ignore"):
                    y[:, :, ph, pw] = window.sum(axis=2, dtype=np.float32) / np.float32(size)
    return y, mask


@pytest.mark.parametrize("case", GEOMETRIES, ids=lambda case: "x".join(map(str, case[0])))
def test_the_reference_pools_as_caffes_loops(case):
    geom = geometry(*case)
    shape, pooled = geom[:2]
    x = np.round(random(*shape) * 2) / 2
    count = outputs(shape, pooled)
    value, mask, average = CPU.empty(count), CPU.empty(count), CPU.empty(count)
    CPU.max_pool_forward(x.reshape(-1), value, mask, *geom)
    CPU.ave_pool_forward(x.reshape(-1), average, *geom)
    expected_max, expected_mask = caffe_pool(x, pooled, *geom[2:], "max")
    expected_average, _ = caffe_pool(x, pooled, *geom[2:], "ave")
    np.testing.assert_array_equal(value, expected_max.reshape(-1))
    np.testing.assert_array_equal(mask, expected_mask.reshape(-1))
    np.testing.assert_allclose(average, expected_average.reshape(-1), rtol=1e-6, atol=1e-6)


# --- LRN -----------------------------------------------------------------------------
LRN_SHAPES = [(2, 7, 3, 4), (1, 2, 1, 1), (1, 1, 5, 3), (3, 4, 2, 6)]


@pytest.mark.parametrize("shape", LRN_SHAPES, ids=lambda shape: "x".join(map(str, shape)))
@pytest.mark.parametrize("size", [1, 3, 5])
@pytest.mark.parametrize("across", [True, False])
def test_lrn_ops(opencl, shape, size, across):
    count = int(np.prod(shape))
    x, dy = random(count), random(count)
    alpha_over_size, k, beta = 0.7 / size, 1.5, 0.75 if across else 0.6
    (scale, expected_scale), = same_op(opencl, "lrn_scale", [x, np.zeros(count)], [1], shape, size,
                                       alpha_over_size, k, across)
    assert_same([(scale, expected_scale)])
    # the window sum against a direct one: zeros beyond the edges
    half = (size - 1) // 2
    squares = np.pad(x.reshape(shape).astype(np.float64) ** 2,
                     [(0, 0), (half, half), (0, 0), (0, 0)] if across else [(0, 0), (0, 0), (half, half), (half, half)])
    window = sum(squares[:, d:d + shape[1]] for d in range(size)) if across else \
        sum(squares[:, :, i:i + shape[2], j:j + shape[3]] for i in range(size) for j in range(size))
    np.testing.assert_allclose(expected_scale, (k + alpha_over_size * window).reshape(-1), rtol=1e-5)
    assert_same(same_op(opencl, "lrn_forward", [x, expected_scale, np.zeros(count)], [2], count, beta))
    y = x * expected_scale ** -beta
    assert_same(same_op(opencl, "lrn_backward", [x, y, expected_scale, dy, np.zeros(count)], [4], shape, size,
                        beta, 2 * beta * 0.7 / size, across), 2e-6)


# --- BatchNorm ---------------------------------------------------------------------------
BN_SHAPES = [(4, 3, 5), (1, 2, 1), (3, 1, 7), (2, 5, 0)]


@pytest.mark.parametrize("dims", BN_SHAPES, ids=lambda dims: "x".join(map(str, dims)))
@pytest.mark.parametrize("with_times", [False, True])
def test_channel_sum(opencl, dims, with_times):
    batch, channels, spatial = dims
    count = batch * channels * spatial
    x, other = random(count), random(count)

    def run(device, x, other, out):
        device.channel_sum(x, batch, channels, spatial, out, alpha=0.25, times=other if with_times else None)
    (ours, expected), = same_op(opencl, run, [x, other, random(channels)], [2])
    assert_same([(ours, expected)])
    values = x * other if with_times else x
    np.testing.assert_allclose(expected, 0.25 * values.reshape(batch, channels, spatial).sum(axis=(0, 2)),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("use_mean, use_std", [(True, True), (True, False), (False, True)])
def test_channel_normalize(opencl, use_mean, use_std):
    batch, channels, spatial = 3, 4, 5
    count = batch * channels * spatial

    def run(device, x, y, mean, std):
        device.channel_normalize(x, y, batch, channels, spatial, mean if use_mean else None,
                                 std if use_std else None)
    x, mean, std = random(count), random(channels), np.abs(random(channels)) + 0.5
    (ours, expected), = same_op(opencl, run, [x, np.zeros(count), mean, std], [1])
    assert_same([(ours, expected)])
    values = x.reshape(batch, channels, spatial)
    values = values - mean[:, None] if use_mean else values
    values = values / std[:, None] if use_std else values
    np.testing.assert_allclose(expected, values.reshape(-1), rtol=1e-6)


@pytest.mark.parametrize("factor", [None, 0.0, 2.5])
def test_batch_norm_stats(opencl, factor):
    channels = 5
    mean, variance = random(channels), np.abs(random(channels))

    def run(device, mean, variance, std, scale):
        device.batch_norm_stats(mean, variance, std, channels, 1e-3, None if factor is None else scale)
    pairs = same_op(opencl, run, [mean, variance, np.zeros(channels), np.array([factor or 0.0])], [0, 1, 2])
    assert_same(pairs)
    inverse = 1.0 if factor is None else 0.0 if factor == 0 else 1 / factor
    np.testing.assert_allclose(pairs[0][1], mean * inverse, rtol=1e-6)
    np.testing.assert_allclose(pairs[2][1], np.sqrt(variance * inverse + 1e-3), rtol=1e-6)


def test_batch_norm_backward(opencl):
    batch, channels, spatial = 3, 4, 5
    count = batch * channels * spatial

    def run(device, dy, y, std, mean_dy, mean_dy_y, dx):
        device.batch_norm_backward(dy, y, std, mean_dy, mean_dy_y, dx, batch, channels, spatial)
    dy, y, std = random(count), random(count), np.abs(random(channels)) + 0.5
    mean_dy, mean_dy_y = random(channels), random(channels)
    (ours, expected), = same_op(opencl, run, [dy, y, std, mean_dy, mean_dy_y, np.zeros(count)], [5])
    assert_same([(ours, expected)])
    per = (1, channels, 1)
    values = (dy.reshape(batch, channels, spatial) - mean_dy.reshape(per)
              - y.reshape(batch, channels, spatial) * mean_dy_y.reshape(per)) / std.reshape(per)
    np.testing.assert_allclose(expected, values.reshape(-1), rtol=1e-5, atol=1e-6)
