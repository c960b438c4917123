"""The layer ops of cct.devices (softmax and its loss, Eltwise's maps, block
copies, the broadcast affine map) on OpenCL against the numpy CPU device,
at odd shapes; and the CPU device's ops against plain numpy formulas."""
import numpy as np
import pytest

from cct.devices.base import DeviceError
from cct.devices.cpu import CPU
from helpers.devices import OPENCL, on_device, opencl_or_skip, same_op, to_host


@pytest.fixture(params=[OPENCL])
def device():
    return opencl_or_skip()


def rng(seed=0):
    return np.random.default_rng(seed)


def assert_same(pairs, tolerance=0.0):
    for ours, reference in pairs:
        scale = max(float(np.abs(reference).max(initial=0)), 1e-6)
        error = float(np.abs(ours - reference).max(initial=0)) / scale
        assert error <= tolerance, f"relative error {error:.3g} > {tolerance}"


@pytest.mark.parametrize("blocks, size, src_stride, dst_stride, src_offset, dst_offset", [
    (7, 5, 13, 11, 3, 2),          # strided both sides
    (1, 37, 37, 37, 0, 5),         # one run
    (4, 9, 9, 9, 1, 0),            # contiguous: one copy
    (3, 0, 4, 4, 0, 0),            # nothing
])
def test_copy_blocks(device, blocks, size, src_stride, dst_stride, src_offset, dst_offset):
    src = rng().standard_normal(src_offset + blocks * src_stride + size)
    dst = rng(1).standard_normal(dst_offset + blocks * dst_stride + size)
    pairs = same_op(device, "copy_blocks", [src, dst], [1], blocks, size, src_stride, dst_stride,
                    src_offset, dst_offset)
    assert_same(pairs)
    expected = dst.astype(np.float32)
    for b in range(blocks):
        expected[dst_offset + b * dst_stride:][:size] = src[src_offset + b * src_stride:][:size]
    np.testing.assert_array_equal(pairs[0][1], expected)


def test_copy_blocks_refuses_an_overrun():
    buffer = np.zeros(10, np.float32)
    with pytest.raises(DeviceError, match="overrun"):
        CPU.copy_blocks(buffer, np.zeros(10, np.float32), 3, 4, 4, 4)


@pytest.mark.parametrize("op", ["multiply", "divide"])
@pytest.mark.parametrize("count", [1, 257, 1000])
def test_multiply_and_divide(device, op, count):
    a, b = rng().standard_normal(count), rng(1).standard_normal(count) + 3
    out = np.zeros(count + 3)
    pairs = same_op(device, op, [a, b, out], [2], count)
    assert_same(pairs, 1e-7)
    numpy_op = np.multiply if op == "multiply" else np.divide
    np.testing.assert_array_equal(pairs[0][1][:count], numpy_op(a.astype(np.float32), b.astype(np.float32)))


@pytest.mark.parametrize("outer, dim, inner", [(3, 5, 7), (1, 1, 11), (2, 17, 1)])
@pytest.mark.parametrize("terms", ["scale", "bias", "both", "neither"])
def test_broadcast_affine(device, outer, dim, inner, terms):
    x = rng().standard_normal(outer * dim * inner)
    scale, bias = rng(1).standard_normal(dim), rng(2).standard_normal(dim)
    y = np.zeros(x.size)

    def op(target, x, y, scale, bias):
        target.broadcast_affine(x, outer, dim, inner, y, scale if terms in ("scale", "both") else None,
                                bias if terms in ("bias", "both") else None)

    pairs = same_op(device, op, [x, y, scale, bias], [1])
    assert_same(pairs, 1e-7)
    expected = x.reshape(outer, dim, inner).astype(np.float32)
    if terms in ("scale", "both"):
        expected = expected * scale.astype(np.float32).reshape(1, dim, 1)
    if terms in ("bias", "both"):
        expected = expected + bias.astype(np.float32).reshape(1, dim, 1)
    np.testing.assert_array_equal(pairs[0][1], expected.reshape(-1))


def test_broadcast_affine_in_place(device):
    x, scale = rng().standard_normal(60), rng(1).standard_normal(4)
    pairs = same_op(device, lambda t, x, s: t.broadcast_affine(x, 3, 4, 5, x, s, s), [x, scale], [0])
    assert_same(pairs, 1e-7)


def test_eltwise_max_steps(device):
    count = 301
    inputs = [np.round(rng(k).standard_normal(count), 1) for k in range(3)]     # ties happen
    out, argmax = np.zeros(count), np.full(count, 7.0)

    def op(target, a, b, c, out, argmax):
        target.eltwise_max(a, b, out, argmax, count, 1)
        target.eltwise_max(out, c, out, argmax, count, 2)

    pairs = same_op(device, op, inputs + [out, argmax], [3, 4])
    assert_same(pairs)
    stacked = np.stack(inputs).astype(np.float32)
    np.testing.assert_array_equal(pairs[0][1], stacked.max(axis=0))
    first = np.where(stacked[0] > stacked[1], 0, 1)
    expected = np.where(stacked[2] > np.maximum(stacked[0], stacked[1]), 2, first)
    np.testing.assert_array_equal(pairs[1][1], expected)


def test_keep_where_index(device):
    count = 300
    dy, argmax, dx = rng().standard_normal(count), rng(1).integers(0, 3, count), np.zeros(count)
    pairs = same_op(device, lambda t, dy, argmax, dx: t.keep_where_index(dy, argmax, 2, dx, count),
                    [dy, argmax, dx], [2])
    assert_same(pairs)
    np.testing.assert_array_equal(pairs[0][1], np.where(argmax == 2, dy.astype(np.float32), 0))


SOFTMAX_SHAPES = [(2, 10, 1), (3, 7, 13), (1, 1, 5), (5, 300, 3)]


@pytest.mark.parametrize("outer, channels, inner", SOFTMAX_SHAPES)
def test_softmax_forward(device, outer, channels, inner):
    x = rng().standard_normal(outer * channels * inner) * 5
    pairs = same_op(device, lambda t, x, y: t.softmax_forward(x, y, outer, channels, inner), [x, np.zeros(x.size)],
                    [1])
    assert_same(pairs, 1e-6)
    view = x.reshape(outer, channels, inner)
    exp = np.exp(view - view.max(axis=1, keepdims=True))
    assert_same([(pairs[0][1], (exp / exp.sum(axis=1, keepdims=True)).reshape(-1))], 1e-5)


def test_softmax_forward_in_place(device):
    x = rng().standard_normal(3 * 4 * 5)
    pairs = same_op(device, lambda t, x: t.softmax_forward(x, x, 3, 4, 5), [x], [0])
    assert_same(pairs, 1e-6)


def test_softmax_of_no_values_does_nothing(device):
    x = np.arange(4.0)
    pairs = same_op(device, lambda t, x: t.softmax_forward(x, x, 2, 0, 2), [x], [0])
    assert_same(pairs)
    np.testing.assert_array_equal(pairs[0][0], x)


@pytest.mark.parametrize("outer, channels, inner", SOFTMAX_SHAPES)
@pytest.mark.parametrize("in_place", [False, True])
def test_softmax_backward(device, outer, channels, inner, in_place):
    count = outer * channels * inner
    y, dy = rng().random(count), rng(1).standard_normal(count)

    def op(target, y, dy, dx):
        target.softmax_backward(y, dy, dy if in_place else dx, outer, channels, inner)

    pairs = same_op(device, op, [y, dy, np.zeros(count)], [1 if in_place else 2])
    assert_same(pairs, 1e-6)
    y3, dy3 = y.reshape(outer, channels, inner), dy.reshape(outer, channels, inner)
    expected = (dy3 - (dy3 * y3).sum(axis=1, keepdims=True)) * y3
    assert_same([(pairs[0][1], expected.reshape(-1))], 1e-5)         # float32 against float64


def loss_inputs(outer, channels, inner, ignore_label=None, bad=None):
    """Probabilities (some tiny), labels as floats with fractions (truncated),
    some set to ignore_label, one to `bad`."""
    generator = rng()
    prob = generator.random(outer * channels * inner).astype(np.float32)
    prob[::7] = 1e-40                                          # floored at FLT_MIN
    labels = generator.integers(0, channels, outer * inner) + 0.25
    if ignore_label is not None:
        labels[::3] = ignore_label
    if bad is not None:
        labels[-1] = bad
    return prob, labels


@pytest.mark.parametrize("outer, channels, inner", [(4, 10, 1), (2, 5, 9), (3, 1, 7)])
@pytest.mark.parametrize("ignore_label", [None, 0, 255, -1])
def test_softmax_loss_forward(device, outer, channels, inner, ignore_label):
    prob, labels = loss_inputs(outer, channels, inner, ignore_label)
    out = np.zeros(2 * outer * inner)

    def op(target, prob, labels, out):
        target.softmax_loss_forward(prob, labels, out, outer, channels, inner, ignore_label)

    pairs = same_op(device, op, [prob, labels, out], [2])
    assert_same(pairs, 1e-6)
    reference = pairs[0][1]
    positions = outer * inner
    whole = np.trunc(labels).astype(np.int64)
    ignored = whole == ignore_label if ignore_label is not None else np.zeros(positions, bool)
    np.testing.assert_array_equal(reference[positions:], np.where(ignored, 0, 1))
    picked = prob.reshape(outer, channels, inner)[np.arange(outer)[:, None], np.where(ignored, 0, whole).reshape(
        outer, inner), np.arange(inner)[None, :]].reshape(-1)
    expected = np.where(ignored, 0, np.log(np.maximum(picked, np.finfo(np.float32).tiny)))
    np.testing.assert_allclose(reference[:positions], expected, rtol=1e-6)


@pytest.mark.parametrize("bad", [5.0, -1.0, np.nan, 1e12])
def test_softmax_loss_forward_marks_a_bad_label(device, bad):
    outer, channels, inner = 2, 5, 3
    prob, labels = loss_inputs(outer, channels, inner, bad=bad)

    def op(target, prob, labels, out):
        target.softmax_loss_forward(prob, labels, out, outer, channels, inner)

    pairs = same_op(device, op, [prob, labels, np.zeros(2 * outer * inner)], [2])
    for result in pairs[0]:
        assert result[-1] == -1 and list(result[outer * inner:-1]) == [1] * (outer * inner - 1)
        np.testing.assert_array_equal(result[outer * inner - 1], np.trunc(np.float32(bad)))


@pytest.mark.parametrize("positions", [1, 7, 256, 300, 5000])
@pytest.mark.parametrize("normalizer", [None, 1.0, 4.0, 0.0])
def test_softmax_loss_reduce(device, positions, normalizer):
    """The loss summed on the device: the host's float64 sum and normalizer to
    float32 rounding, ignored positions left out (the VALID count), the same
    numbers at every run (one work group, a fixed order)."""
    generator = rng(positions)
    values = np.concatenate([generator.uniform(-9, 0, positions), generator.integers(0, 2, positions)])
    values = values.astype(np.float32)
    values[:positions][values[positions:] == 0] = 0                 # an ignored position holds 0

    def op(target, values, loss, stats):
        target.softmax_loss_reduce(values, positions, loss, stats, normalizer)

    pairs = same_op(device, op, [values, np.zeros(2), np.full(4, 9.0)], [1, 2])
    again = same_op(device, op, [values, np.zeros(2), np.full(4, 9.0)], [1, 2])
    np.testing.assert_array_equal(pairs[0][0], again[0][0])
    flags = values[positions:]
    count = int((flags > 0).sum())
    scale = max(1.0, count if normalizer is None else normalizer)
    expected = np.float32((0.0 - values[:positions][flags > 0].sum(dtype=np.float64)) / scale)
    for loss, stats in zip(*pairs):
        np.testing.assert_allclose(loss[0], expected, rtol=2e-7)
        assert loss[1] == 0 and list(stats) == [scale, -1, 0, 9.0]    # nothing past the outputs written


@pytest.mark.parametrize("bad", [5.0, -3.0, 1e12])
def test_softmax_loss_reduce_flags_the_first_bad_label(device, bad):
    outer, channels, inner = 3, 5, 110
    prob, labels = loss_inputs(outer, channels, inner)
    labels[[40, 301]] = bad, 7.0

    def op(target, prob, labels, values, loss, stats):
        target.softmax_loss_forward(prob, labels, values, outer, channels, inner)
        target.softmax_loss_reduce(values, outer * inner, loss, stats)

    pairs = same_op(device, op, [prob, labels, np.zeros(2 * outer * inner), np.zeros(1), np.zeros(3)], [3, 4])
    for loss, stats in zip(*pairs):
        assert np.isnan(loss[0])
        np.testing.assert_array_equal(stats[1:], [40, np.trunc(np.float32(bad))])


@pytest.mark.parametrize("outer, channels, inner", [(4, 10, 1), (2, 5, 9), (3, 1, 7)])
@pytest.mark.parametrize("ignore_label", [None, 2, 255])
def test_softmax_loss_backward(device, outer, channels, inner, ignore_label):
    prob, labels = loss_inputs(outer, channels, inner, ignore_label)

    def op(target, prob, labels, dx, weight, stats):
        target.softmax_loss_backward(prob, labels, dx, outer, channels, inner, weight, stats, ignore_label)

    weight, normalizer = 0.37, 7.0          # the loss top's diff; the normalizer softmax_loss_reduce leaves
    pairs = same_op(device, op, [prob, labels, np.zeros(prob.size), [weight, 5.0], [normalizer, -1, 0]], [2])
    assert_same(pairs)
    whole = np.trunc(labels).reshape(outer, 1, inner)
    hot = np.arange(channels).reshape(1, channels, 1) == whole
    expected = (prob.reshape(outer, channels, inner) - hot) * np.float32(weight / normalizer)   # the host's rounding
    if ignore_label is not None:
        expected = np.where(whole == ignore_label, 0, expected)
    np.testing.assert_allclose(pairs[0][1], expected.reshape(-1), rtol=1e-6)


def test_ops_leave_what_follows_the_count(device):
    """Outputs are written over `count` elements only (blob buffers may be larger)."""
    for target in (device, CPU):
        a, b, out = on_device(target, [np.ones(10), np.ones(10), np.full(10, 5.0)])
        target.multiply(a, b, out, 6)
        np.testing.assert_array_equal(to_host(target, out, 10), [1] * 6 + [5] * 4)
