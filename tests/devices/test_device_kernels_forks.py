"""The forks' layer ops of cct.devices (strided copies, Normalize's division
and gradient, Interp's resize and its adjoint, unpooling) on OpenCL against
the numpy CPU device, bit for bit; and the CPU device's against plain numpy
or loops."""
import numpy as np
import pytest

from cct.devices.cpu import CPU
from cct.layers.segmentation import interp_device_table
from helpers.devices import OPENCL, on_device, opencl_or_skip, to_host


@pytest.fixture(params=["cpu", OPENCL])
def device(request):
    return CPU if request.param == "cpu" else opencl_or_skip()


def rng(seed=0):
    return np.random.default_rng(seed)


def run(device, op, arrays, outputs, *args, **kwargs):
    """The op on `device`: the output buffers' values."""
    buffers = on_device(device, arrays)
    getattr(device, op)(*buffers, *args, **kwargs)
    return [to_host(device, buffers[i], np.asarray(arrays[i]).size) for i in outputs]


@pytest.mark.parametrize("shape, make", [
    ((2, 3, 4, 5), lambda a: a.transpose(0, 2, 3, 1)),             # SSD's Permute
    ((2, 3, 4), lambda a: a.transpose(2, 0, 1)),
    ((2, 8, 2, 3), lambda a: a.reshape(2, 2, 2, 2, 2, 3).transpose(0, 3, 4, 1, 5, 2)),  # Reorg
    ((1, 2, 3, 4, 1, 2, 1, 2), lambda a: a.transpose(7, 6, 5, 4, 3, 2, 1, 0)),      # eight axes
    ((2, 3, 4), lambda a: np.broadcast_to(a[:, :, None, :, None], (2, 3, 2, 4, 3))),  # nearest Upsample
    ((5,), lambda a: a),
])
def test_copy_strided(device, shape, make):
    x = rng().standard_normal(shape).astype(np.float32)
    view = make(x)
    out_shape, strides = view.shape, [s // 4 for s in view.strides]
    (out,) = run(device, "copy_strided", [x, np.zeros(view.size)], [1], out_shape, strides)
    np.testing.assert_array_equal(out, np.ascontiguousarray(view).reshape(-1))


def test_copy_strided_offsets_destination_strides_and_accumulate(device):
    x = rng().standard_normal((4, 6)).astype(np.float32)
    dst = rng(1).standard_normal((5, 7)).astype(np.float32)
    # x[1:3, 2:5] added into dst[2:4, 1:4]
    (out,) = run(device, "copy_strided", [x, dst], [1], (2, 3), (6, 1), (7, 1), src_offset=8, dst_offset=15,
                 accumulate=True)
    expected = dst.copy()
    expected[2:4, 1:4] += x[1:3, 2:5]
    np.testing.assert_array_equal(out.reshape(5, 7), expected)


@pytest.mark.parametrize("outer, axis, inner", [(2, 3, 5), (3, 7, 1), (1, 4, 6)])
def test_divide_across_and_normalize_backward(device, outer, axis, inner):
    x, dy = (rng(seed).standard_normal((outer, axis, inner)).astype(np.float32) for seed in (1, 2))
    norm = (np.abs(rng(3).standard_normal((outer, 1, inner))) + 0.5).astype(np.float32)
    dot = rng(4).standard_normal((outer, 1, inner)).astype(np.float32)
    (y,) = run(device, "divide_across", [x, norm, np.zeros(x.size)], [2], outer, axis, inner)
    np.testing.assert_array_equal(y.reshape(x.shape), x / norm)
    (dx,) = run(device, "l2_normalize_backward", [x, dy, norm, dot, np.zeros(x.size)], [4], outer, axis, inner)
    np.testing.assert_array_equal(dx.reshape(x.shape), (dy - x * dot / (norm * norm)) / norm)


def outputs(th, tw, out_h, out_w):
    """Each output (h, w) in order with its table entries (i, si, h0, h1, j, sj, w0, w1)."""
    for h in range(out_h):
        for w in range(out_w):
            yield (h, w, int(th[h]), int(th[out_h + h]), th[2 * out_h + h], th[3 * out_h + h],
                   int(tw[w]), int(tw[out_w + w]), tw[2 * out_w + w], tw[3 * out_w + w])


def naive_interp(x, th, tw, out_h, out_w):
    y = np.zeros((x.shape[0], out_h, out_w), np.float32)
    for h, w, i, si, h0, h1, j, sj, w0, w1 in outputs(th, tw, out_h, out_w):
        y[:, h, w] = (h0 * (w0 * x[:, i, j] + w1 * x[:, i, j + sj])
                      + h1 * (w0 * x[:, i + si, j] + w1 * x[:, i + si, j + sj]))
    return y


def naive_interp_backward(dy, th, tw, in_h, in_w):
    planes, out_h, out_w = dy.shape
    dx = np.zeros((planes, in_h, in_w), np.float32)
    for h, w, i, si, h0, h1, j, sj, w0, w1 in outputs(th, tw, out_h, out_w):
        g = dy[:, h, w]
        dx[:, i, j] += h0 * w0 * g
        dx[:, i, j + sj] += h0 * w1 * g
        dx[:, i + si, j] += h1 * w0 * g
        dx[:, i + si, j + sj] += h1 * w1 * g
    return dx


@pytest.mark.parametrize("in_hw, crop, out_hw", [
    ((5, 7), (0, 0), (9, 13)),          # zoom
    ((9, 8), (0, 0), (3, 3)),           # shrink
    ((8, 9), (2, 1), (11, 4)),          # cropped at (start, end) = (2, 1)
    ((4, 4), (0, 0), (1, 6)),           # a single output row reads row 0
])
def test_interp_forward_and_backward(device, in_hw, crop, out_hw):
    (in_h, in_w), (start, end), (out_h, out_w) = in_hw, crop, out_hw
    th = interp_device_table(in_h, start, in_h - start - end, out_h)
    tw = interp_device_table(in_w, start, in_w - start - end, out_w)
    x = rng().standard_normal((3, in_h, in_w)).astype(np.float32)
    dy = rng(1).standard_normal((3, out_h, out_w)).astype(np.float32)
    (y,) = run(device, "interp_forward", [x, np.zeros(3 * out_h * out_w), th, tw], [1], 3, in_h, in_w,
               out_h, out_w)
    np.testing.assert_array_equal(y.reshape(dy.shape), naive_interp(x, th, tw, out_h, out_w))
    (dx,) = run(device, "interp_backward", [dy, np.full(x.size, 7.0), th, tw], [1], 3, in_h, in_w, out_h, out_w)
    np.testing.assert_array_equal(dx.reshape(x.shape), naive_interp_backward(dy, th, tw, in_h, in_w))


def test_unpool(device):
    x = rng().standard_normal((3, 6)).astype(np.float32)
    # repeated cells (the later value wins), -0.5 truncated to 0, out-of-range cells skipped
    mask = np.array([[0, 3, 3, 8, 1, 2], [-0.5, 2.9, 9, -1, 4, 4], [8.5, 7, 6, 5, 4, 3]], np.float32)
    y, = run(device, "unpool_forward", [x, mask, np.full(27, 5.0)], [2], 3, 6, 9)
    expected = np.zeros((3, 9), np.float32)
    for p in range(3):
        for i in range(6):
            if -1 < mask[p, i] < 9:
                expected[p, int(mask[p, i])] = x[p, i]
    np.testing.assert_array_equal(y.reshape(3, 9), expected)
    dy = rng(1).standard_normal((3, 9)).astype(np.float32)
    dx, = run(device, "unpool_backward", [dy, mask, np.full(18, 5.0)], [2], 3, 6, 9)
    want = np.array([[dy[p, int(m)] if -1 < m < 9 else 0 for m in mask[p]] for p in range(3)], np.float32)
    np.testing.assert_array_equal(dx.reshape(3, 6), want)

