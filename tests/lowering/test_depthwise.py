"""The direct depthwise kernels (cct.lowering.depthwise) against the grouped
lowerings they stand in for, forward and both gradients, to float32
rounding; and conv_forward / conv_backward choosing them."""
import numpy as np
import pytest

from cct.lowering import ConvGeometry, conv_backward, conv_forward, depthwise, type1, type2, type3
from cct.lowering.kept import KeptLowering

GEOMETRIES = [  # channels, in_h, in_w, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w
    (6, 9, 11, 3, 3, 1, 1, 1, 1, 1, 1),
    (4, 8, 7, 3, 3, 2, 2, 1, 1, 1, 1),
    (3, 10, 9, 3, 2, 2, 1, 0, 2, 2, 3),
    (5, 3, 3, 5, 5, 2, 2, 2, 2, 1, 1),
    (2, 2, 2, 3, 3, 2, 2, 0, 0, 1, 1),        # the window overruns the input
    (2, 7, 6, 4, 4, 3, 3, 3, 0, 1, 1),
    (3, 5, 5, 1, 1, 2, 3, 1, 2, 1, 1),
    (7, 1, 1, 3, 3, 1, 1, 1, 1, 1, 1),
]


def geometry(values):
    channels, *rest = values
    return ConvGeometry(channels, channels, *rest, group=channels)


def relative(ours, reference):
    return float(np.abs(ours - reference).max()) / max(float(np.abs(reference).max()), 1e-30)


@pytest.mark.parametrize("values", GEOMETRIES)
@pytest.mark.parametrize("impl", [type1, type2, type3])
def test_depthwise_kernels_match_the_grouped_lowerings(values, impl):
    geom = geometry(values)
    rng = np.random.default_rng(3)
    x = rng.standard_normal(geom.input_shape(3)).astype(np.float32)
    w = rng.standard_normal(geom.weight_shape).astype(np.float32)
    dy = rng.standard_normal(geom.output_shape(3)).astype(np.float32)
    dx, dw = depthwise.backward(x, dy, w, geom)
    want_dx, want_dw = impl.backward(x, dy, w, geom)
    assert relative(depthwise.forward(x, w, geom), impl.forward(x, w, geom)) < 1e-6
    assert relative(dx, want_dx) < 1e-6
    assert relative(dw, want_dw) < 1e-6


def test_conv_forward_and_backward_run_the_kernels_for_depthwise_geometries():
    geom = geometry(GEOMETRIES[1])
    rng = np.random.default_rng(4)
    x = rng.standard_normal(geom.input_shape(2)).astype(np.float32)
    w = rng.standard_normal(geom.weight_shape).astype(np.float32)
    dy = rng.standard_normal(geom.output_shape(2)).astype(np.float32)
    bias = rng.standard_normal(geom.num_output).astype(np.float32)
    keep = KeptLowering()
    y = conv_forward(x, w, geom, 2, bias=bias, relu=0.1, keep=keep)
    direct = depthwise.forward(x, w, geom) + bias.reshape(1, -1, 1, 1)
    np.testing.assert_array_equal(y, np.where(direct > 0, direct, direct * np.float32(0.1)))
    assert keep.matrix_for(x, 2, geom) is None                       # nothing lowered, nothing kept
    for got, want in zip(conv_backward(x, dy, w, geom, 3, chunk=1), depthwise.backward(x, dy, w, geom)):
        np.testing.assert_array_equal(got, want)
    assert not depthwise.applies(ConvGeometry(4, 8, 5, 5, 3, 3, group=4))
    assert not depthwise.applies(ConvGeometry(1, 1, 5, 5, 3, 3))


def test_depthwise_kernels_in_float64():
    geom = geometry(GEOMETRIES[2])
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal(geom.input_shape(2)), rng.standard_normal(geom.weight_shape)
    dy = rng.standard_normal(geom.output_shape(2))
    np.testing.assert_allclose(depthwise.forward(x, w, geom), type1.forward(x, w, geom), rtol=1e-12, atol=1e-12)
    for got, want in zip(depthwise.backward(x, dy, w, geom), type1.backward(x, dy, w, geom)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
