"""The OpenCL device's core primitives (cct/devices/kernels/core.cl, CLBlast's
GEMM, memory ops) against the numpy reference device (cct.devices.cpu), and
the reference device against plain numpy or the lowering's direct
convolution (cct.lowering.reference)."""
import numpy as np
import pytest

from cct.devices.base import DeviceError
from cct.devices.cpu import CPU
from cct.lowering import ConvGeometry, reference
from helpers.devices import OPENCL, on_device, opencl_or_skip, same_op, to_host

RNG = np.random.default_rng(11)


def random(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


@pytest.fixture(params=[OPENCL])
def opencl():
    return opencl_or_skip()


def assert_same(pairs, tolerance=1e-6):
    for ours, expected in pairs:
        np.testing.assert_allclose(ours, expected, rtol=tolerance, atol=tolerance * max(1, np.abs(expected).max()))


@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
def test_gemm_with_offsets_and_transposes(opencl, trans_a, trans_b, beta):
    m, n, k = 5, 7, 3
    a, b, c = random(m * k + 4), random(k * n + 2), random(m * n + 3)

    def run(device, a, b, c):
        device.gemm(trans_a, trans_b, m, n, k, 1.5, a, b, beta, c, a_offset=4, b_offset=2, c_offset=3)
    (ours, expected), = same_op(opencl, run, [a, b, c], [2])
    assert_same([(ours, expected)], 1e-5)
    op_a = a[4:].reshape((k, m) if trans_a else (m, k))
    op_b = b[2:].reshape((n, k) if trans_b else (k, n))
    product = (op_a.T if trans_a else op_a) @ (op_b.T if trans_b else op_b)
    np.testing.assert_allclose(expected[3:].reshape(m, n), 1.5 * product + beta * c[3:].reshape(m, n), rtol=1e-5,
                               atol=1e-5)
    assert np.array_equal(ours[:3], c[:3])                  # nothing before the offset written


def test_gemm_over_nothing_scales_c(opencl):
    c = random(6)
    (ours, expected), = same_op(opencl, lambda d, a, b, c: d.gemm(False, False, 2, 3, 0, 1.0, a, b, 0.5, c),
                                [random(1), random(1), c], [2])
    assert_same([(ours, expected)])
    np.testing.assert_allclose(expected, 0.5 * c)


def test_gemm_reads_blocks_of_columns_of_wider_matrices(opencl):
    """a_ld and b_ld: op(A) and op(B) are columns 3, ..., 3 + k - 1 of wider
    stored matrices (a slice of split-K), transposed or not."""
    m, n, k, width = 4, 6, 5, 11
    a, b = random(m * width), random(n * width)

    def run(device, a, b, c):
        device.gemm(False, True, m, n, k, 1.0, a, b, 0.0, c, a_offset=3, b_offset=3, a_ld=width, b_ld=width)
    (ours, expected), = same_op(opencl, run, [a, b, random(m * n)], [2])
    product = a.reshape(m, width)[:, 3:3 + k] @ b.reshape(n, width)[:, 3:3 + k].T
    np.testing.assert_allclose(expected.reshape(m, n), product, rtol=1e-5, atol=1e-5)
    assert_same([(ours, expected)], 1e-5)


@pytest.mark.parametrize("placement", ["strided", "listed"])
@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_gemm_batched_is_each_gemm(opencl, placement, trans_a, trans_b, beta):
    """Three GEMMs in one call, their offsets evenly strided (CLBlast's
    strided-batched GEMM) or not (its batched GEMM): each product the one
    gemm gives, within rounding; nothing else in C written."""
    m, n, k = 5, 7, 3
    if placement == "strided":
        offsets = [[1 + i * m * k for i in range(3)], [2 + i * k * n for i in range(3)], [3 + i * m * n for i in range(3)]]
    else:
        offsets = [[1, 40, 20], [2, 60, 30], [3, 90, 50]]
    a, b, c = random(100), random(100), random(150)

    def batched(device, a, b, c):
        device.gemm_batched(trans_a, trans_b, m, n, k, 1.5, a, b, beta, c, *offsets)

    def one_by_one(device, a, b, c):
        for a_offset, b_offset, c_offset in zip(*offsets):
            device.gemm(trans_a, trans_b, m, n, k, 1.5, a, b, beta, c, a_offset, b_offset, c_offset)
    (ours, expected), = same_op(opencl, batched, [a, b, c], [2])
    (_, each), = same_op(opencl, one_by_one, [a, b, c], [2])
    np.testing.assert_array_equal(expected, each)
    assert_same([(ours, expected)], 1e-5)
    written = np.zeros(150, bool)
    for c_offset in offsets[2]:
        written[c_offset:c_offset + m * n] = True
    np.testing.assert_array_equal(ours[~written], c[~written])


def test_gemm_keeps_clblasts_temporary_buffer(opencl):
    """A GEMM large enough for CLBlast's indirect kernel (padded copies of
    its operands) gets the device's kept temporary buffer, where the CLBlast
    library has the C call for it: one buffer for every later call, grown
    only when a larger GEMM needs more; the products the reference's."""
    from cct.devices import opencl as module
    if module._gemm_with_temp() is None:
        pytest.skip("this CLBlast has no CLBlastSgemmWithTempBuffer")
    buffers = []
    for m, n, k in [(1000, 1030, 990), (1000, 1030, 990), (100, 90, 80), (1100, 1030, 1000)]:
        a, b = random(m * k), random(k * n)

        def run(device, a, b, c):
            device.gemm(False, True, m, n, k, 1.0, a, b, 0.0, c)
        (ours, expected), = same_op(opencl, run, [a, b, random(m * n)], [2])
        assert_same([(ours, expected)], 1e-4)
        buffers.append(opencl._gemm_temp)
    if buffers[0] is None:
        pytest.skip(f"CLBlast runs these GEMMs direct on {opencl.name} (no temporary buffer)")
    assert buffers[1] is buffers[0] and buffers[2] is buffers[0]
    assert buffers[3].size >= buffers[0].size


def test_memory_ops(opencl):
    values = random(10)
    for device in (opencl, CPU):
        buffer, = on_device(device, [values])
        device.fill(buffer, 2.5, 3, offset=4)
        other = device.empty(10)
        device.fill(other, -1.0, 10)
        device.copy(other, buffer, 5, dst_offset=2, src_offset=3)
        expected_buffer = values.copy()
        expected_buffer[4:7] = 2.5
        expected_other = np.full(10, -1.0, np.float32)
        expected_other[2:7] = expected_buffer[3:8]
        assert np.array_equal(to_host(device, buffer, 10), expected_buffer)
        assert np.array_equal(to_host(device, other, 10), expected_other)
        assert np.array_equal(to_host(device, device.ones(7), 7), np.ones(7, np.float32))


@pytest.mark.parametrize("beta", [0.0, 2.0])
def test_axpby_and_sum_axis(opencl, beta):
    x, y = random(12), random(12)
    assert_same(same_op(opencl, lambda d, x, y: d.axpby(9, 0.5, x, beta, y, x_offset=2, y_offset=3), [x, y], [1]))
    x, out = random(3 * 4 * 5), random(3 * 5)
    pairs = same_op(opencl, lambda d, x, out: d.sum_axis(x, 3, 4, 5, out, beta), [x, out], [1])
    assert_same(pairs, 1e-5)
    np.testing.assert_allclose(pairs[0][1].reshape(3, 5), x.reshape(3, 4, 5).sum(1) + beta * out.reshape(3, 5),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("slope", [0.0, 0.2])
def test_relu_kernels(opencl, slope):
    x, y, dy, dx = random(50), random(50), random(50), random(50)
    assert_same(same_op(opencl, lambda d, x, y: d.relu_forward(x, y, 50, slope), [x, y], [1]))
    assert_same(same_op(opencl, lambda d, x, dy, dx: d.relu_backward(x, dy, dx, 50, slope), [x, dy, dx], [2]))


def test_clip_kernels(opencl):
    x, y, dy, dx = random(50) * 8, random(50), random(50), random(50)
    x[:4] = [0.0, 6.0, -0.0, 6.5]                       # the bounds pass no gradient
    assert_same(same_op(opencl, lambda d, x, y: d.clip_forward(x, y, 50, 0.0, 6.0), [x, y], [1]))
    assert_same(same_op(opencl, lambda d, x, dy, dx: d.clip_backward(x, dy, dx, 50, 0.0, 6.0), [x, dy, dx], [2]))


GEOMETRIES = [
    ConvGeometry(3, 4, 7, 6, 3, 3, 2, 1, 1, 0),
    ConvGeometry(4, 6, 5, 5, 3, 2, 1, 2, 0, 1, 2, 1, 2),       # groups, dilation
    ConvGeometry(2, 2, 2, 2, 3, 3, 2, 2),                      # the window overruns the input
    ConvGeometry(1, 1, 1, 1, 1, 1),
]


@pytest.mark.parametrize("geom", GEOMETRIES, ids=range(len(GEOMETRIES)))
def test_lowering_kernels_against_the_direct_convolution(opencl, geom):
    """im2col, GEMM and the lift give the direct convolution; the transposed
    GEMM and col2im its data gradient; on images 1 and 2 of a batch of 3 (first=1)."""
    rows = geom.channels // geom.group * geom.kernel_h * geom.kernel_w
    outputs, pixels = geom.num_output // geom.group, geom.out_h * geom.out_w
    x, w, dy = random(*geom.input_shape(3)), random(*geom.weight_shape), random(*geom.output_shape(3))
    for device in (CPU, opencl):
        xs, ws, dys = on_device(device, [x, w, dy])
        cols, product, y, dx = (device.empty(rows * 2 * pixels), device.empty(geom.num_output * 2 * pixels),
                                device.empty(dy.size), device.empty(x.size))
        device.fill(y, 0.0, dy.size)
        device.fill(dx, 0.0, x.size)
        gradient = device.empty(geom.num_output * 2 * pixels)
        device.to_channels_first(dys, 2, geom.num_output, pixels, gradient, first=1)
        for g in range(geom.group):
            device.im2col(xs, geom, 2, cols, g, first=1)
            device.gemm(False, False, outputs, 2 * pixels, rows, 1.0, ws, cols, 0.0, product,
                        a_offset=g * outputs * rows, c_offset=g * outputs * 2 * pixels)
            device.gemm(True, False, rows, 2 * pixels, outputs, 1.0, ws, gradient, 0.0, cols,
                        a_offset=g * outputs * rows, b_offset=g * outputs * 2 * pixels)
            device.col2im(cols, geom, 2, dx, g, first=1)
        device.from_channels_first(product, 2, geom.num_output, pixels, y, first=1)
        ours_y = to_host(device, y, dy.size).reshape(dy.shape)
        ours_dx = to_host(device, dx, x.size).reshape(x.shape)
        np.testing.assert_allclose(ours_y[1:], reference.forward(x[1:], w, geom), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(ours_dx[1:], reference.backward_data(dy[1:], w, geom), rtol=1e-5, atol=1e-5)
        assert not ours_y[0].any() and not ours_dx[0].any()       # image 0 untouched


def test_a_kernel_that_does_not_build_raises_with_the_compiler_log(opencl):
    with pytest.raises(DeviceError, match=r"broken\.cl does not build") as raised:
        opencl.build("__kernel void f(__global float* x) { x[0] = missing_name; }", "broken.cl")
    assert "missing_name" in str(raised.value)          # the compiler's log, naming the culprit
