"""cct.coord_map (pycaffe's caffe.coord_map): each layer type's map worked out by
hand from its geometry, composition through a net, the Crop layer that crop()
defines checked by running it (a centred delta kernel makes a convolution a
shift, so the cropped output must equal the input), and the refusals."""
import numpy as np
import pytest

import cct
from cct.coord_map import (PASS_THROUGH_LAYERS, AxisMismatchException, compose, coord_map, coord_map_from_to,
                           crop, inverse)
from cct.core.errors import ConfigError
from cct.net_spec import NetSpec, layers as L, params as P


def data(shape=(1, 1, 20, 20)):
    return L.Input(shape=dict(dim=list(shape)))


def assert_map(found, axis, a, b):
    assert found[0] == axis
    np.testing.assert_allclose(np.broadcast_to(found[1], np.shape(b)), a)
    np.testing.assert_allclose(found[2], b)


def test_convolution_map_from_its_geometry():
    # effective kernel (5 - 1) * 2 + 1 = 9: a = 1 / 2, b = (1 - (9 - 1) / 2) / 2
    conv = L.Convolution(data(), num_output=1, kernel_size=5, stride=2, pad=1, dilation=2)
    assert_map(coord_map(conv.fn), 1, 0.5, [-1.5])
    nested = L.Convolution(data(), convolution_param=dict(num_output=1, kernel_size=5, stride=2, pad=1, dilation=2))
    assert_map(coord_map(nested.fn), 1, 0.5, [-1.5])


def test_deconvolution_undoes_the_same_convolution():
    deconv = L.Deconvolution(data(), num_output=1, kernel_size=5, stride=2, pad=1, dilation=2)
    assert_map(coord_map(deconv.fn), 1, 2, [3.0])             # a = 2, b = (9 - 1) / 2 - 1
    conv = L.Convolution(data(), num_output=1, kernel_size=5, stride=2, pad=1, dilation=2)
    assert_map(compose(coord_map(conv.fn), coord_map(deconv.fn)), 1, 1, [0.0])


def test_pooling_im2col_and_anisotropic_kernels():
    pool = L.Pooling(data(), pool=P.Pooling.MAX, kernel_size=3, stride=2, pad=1)
    assert_map(coord_map(pool.fn), 1, 0.5, [0.0])             # (1 - 1) / 2
    im2col = L.Im2col(data(), convolution_param=dict(kernel_size=[3, 5], stride=[1, 2], pad=[0, 10]))
    assert_map(coord_map(im2col.fn), 1, [1, 0.5], [-1.0, 4.0])
    volume = L.Convolution(data((1, 1, 9, 9, 9)), num_output=1, kernel_size=[3, 3, 3], pad=[0, 1, 2])
    assert_map(coord_map(volume.fn), 1, [1, 1, 1], [-1.0, 0.0, 1.0])


def test_pass_through_and_crop_maps():
    assert len(PASS_THROUGH_LAYERS) == 19 and "ReLU" in PASS_THROUGH_LAYERS and "Eltwise" in PASS_THROUGH_LAYERS
    assert coord_map(L.ReLU(data()).fn) == (None, 1, 0)
    cropped = L.Crop(data(), data(), crop_param=dict(axis=2, offset=[3, 4]))
    assert_map(coord_map(cropped.fn), 1, 1, [-3.0, -4.0])      # axis 2 - 1: the last axis left alone
    assert_map(coord_map(L.Crop(data(), data()).fn), 1, 1, [0.0])


def test_compose_and_inverse():
    assert compose((None, 1, 0), (2, 3, 1)) == (2, 3, 1)
    assert compose((1, 2, 1), (None, 1, 0)) == (1, 2, 1)
    assert compose((1, 2, 1), (1, 3, 4)) == (1, 6, 9)          # x -> 3x + 4 -> 2(3x + 4) + 1
    assert inverse((1, 2, 1)) == (1, 0.5, -0.5)
    with pytest.raises(AxisMismatchException, match="axis 1 and axis 2"):
        compose((1, 1, 0), (2, 1, 0))


def fcn(pad=100):
    """FCN's pattern: a padded convolution, a 2x pooling, a 2x deconvolution."""
    n = NetSpec()
    n.data = data()
    n.conv = L.Convolution(n.data, num_output=1, kernel_size=3, pad=pad)
    n.pool = L.Pooling(n.conv, pool=P.Pooling.MAX, kernel_size=2, stride=2)
    n.up = L.Deconvolution(n.pool, convolution_param=dict(num_output=1, kernel_size=4, stride=2))
    return n


def test_map_through_a_net_and_back():
    n = fcn()
    # data -> conv: b = 100 - 1; -> pool: a 1/2, b -1/4; -> up: a 2, b 3/2: up = data + 100
    assert_map(coord_map_from_to(n.up, n.data), 1, 1, [-100.0])
    assert_map(coord_map_from_to(n.data, n.up), 1, 1, [100.0])
    n.relu = L.ReLU(n.up)
    assert_map(coord_map_from_to(n.relu, n.data), 1, 1, [-100.0])
    n.score = crop(n.relu, n.data)
    layer = n.to_proto().layer[-1]
    assert (layer.type, layer.crop_param.axis, list(layer.crop_param.offset)) == ("Crop", 2, [100])


@pytest.mark.parametrize("kernel, pad", [(3, 5), (5, 7), (3, 1)])
def test_crop_aligns_a_shifted_map_exactly(tmp_path, kernel, pad):
    n = NetSpec()
    n.data = data((1, 1, 6, 7))
    n.conv = L.Convolution(n.data, num_output=1, kernel_size=kernel, pad=pad, bias_term=False)
    n.relu = L.ReLU(n.conv)
    n.aligned = crop(n.relu, n.data)
    (tmp_path / "net.prototxt").write_text(str(n.to_proto()))
    net = cct.Net(str(tmp_path / "net.prototxt"), cct.TEST)
    delta = np.zeros((kernel, kernel), np.float32)
    delta[kernel // 2, kernel // 2] = 1                     # the convolution only shifts
    net.params["conv"][0].data[0, 0] = delta
    image = np.random.default_rng(0).uniform(0.1, 1, (1, 1, 6, 7)).astype(np.float32)
    np.testing.assert_array_equal(net.forward(data=image)["aligned"], image)


def test_unmappable_tops_and_impossible_crops():
    n = fcn()
    n.ip = L.InnerProduct(n.up, num_output=2)
    with pytest.raises(RuntimeError, match="not connected by spatial layers"):
        coord_map_from_to(n.ip, n.data)
    n.whole = L.Pooling(n.data, pool=P.Pooling.AVE, global_pooling=True)
    with pytest.raises(RuntimeError, match="not connected"):
        coord_map_from_to(n.whole, n.data)
    with pytest.raises(AssertionError, match="scale mismatch"):
        crop(n.pool, n.data)
    with pytest.raises(AssertionError, match="negative offset"):
        crop(n.data, n.up)
    half = L.Convolution(n.data, num_output=1, kernel_size=2, pad=1)      # b = 1 - 1/2
    with pytest.raises(AssertionError, match="fractional offset"):
        crop(half, n.data)


def test_legacy_h_w_fields_are_refused_by_name():
    conv = L.Convolution(data(), num_output=1, kernel_h=3, kernel_w=3)
    with pytest.raises(ConfigError, match="Convolution: kernel_h, kernel_w: the legacy _h/_w fields"):
        coord_map(conv.fn)
