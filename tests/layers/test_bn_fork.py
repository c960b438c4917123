"""BN (layers/segmentation.py) in both forks' flavours, against references
written here from their C++ (PSPNet's bn_layer.cpp, caffe-segnet's
bn_layer.cpp) in float64: forward in every mode, the running statistics,
backward where it is not the exact gradient, the gradient where it is, how
the flavour is chosen, and the lr_mult PSPNet's setup forces. OpenCV has
no BN (its importer refuses the type)."""
import numpy as np
import pytest

import cct
from cct.core.errors import ConfigError
from cct.testing.gradient_check import check_layer_gradient, make_layer, setup_layer

RNG = np.random.default_rng(38)


def run(text, x, phase=cct.TRAIN, params=None, num_tops=1, dtype=np.float32):
    """The layer's forward on x, its blobs holding `params` first."""
    layer = make_layer(text, phase)
    bottoms, tops = setup_layer(layer, [x], num_tops, dtype=dtype)
    for blob, values in zip(layer.blobs, params or []):
        blob.data[...] = np.reshape(values, blob.shape)
    layer.reshape(bottoms, tops)
    layer.forward(bottoms, tops)
    return layer, bottoms, tops


def per_channel(values):
    return np.reshape(values, (1, -1, 1, 1))


def batch_stats(x):
    """Mean and biased variance per channel over N and space (both forks')."""
    return x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))


PSP = 'type: "BN" bn_param { momentum: 0.8 eps: 1e-4 FROZEN }'
EPS = float(np.float32(1e-4))                  # a float field


def psp_params(channels):
    return [RNG.uniform(0.5, 2, channels), RNG.standard_normal(channels), RNG.standard_normal(channels),
            RNG.uniform(0.5, 2, channels)]


@pytest.mark.parametrize("phase, frozen", [(cct.TRAIN, False), (cct.TEST, False), (cct.TRAIN, True),
                                           (cct.TEST, True)])
def test_pspnet_forward_and_running_statistics(phase, frozen):
    x = RNG.standard_normal((3, 4, 5, 6)) * 2 + 1
    slope, bias, mean0, var0 = params = psp_params(4)
    layer, _, tops = run(PSP.replace("FROZEN", f"frozen: {str(frozen).lower()}"), x, phase, params)
    if phase == cct.TRAIN and not frozen:
        mean, var = batch_stats(x)
        np.testing.assert_allclose(layer.blobs[2].data.ravel(), 0.2 * mean + 0.8 * mean0, rtol=1e-5)
        np.testing.assert_allclose(layer.blobs[3].data.ravel(), 0.2 * var + 0.8 * var0, rtol=1e-5)
    else:
        mean, var = mean0, var0
        np.testing.assert_array_equal(layer.blobs[2].data.ravel(), mean0.astype(np.float32))
    want = per_channel(slope) * (x - per_channel(mean)) / np.sqrt(per_channel(var) + 1e-4) + per_channel(bias)
    np.testing.assert_allclose(tops[0].data, want, rtol=1e-5, atol=1e-5)


def test_pspnet_defaults_and_param_specs():
    layer, _, _ = run('type: "BN" bn_param { frozen: true }', np.ones((1, 2, 2, 2)))
    assert [blob.shape for blob in layer.blobs] == [(1, 2, 1, 1)] * 4
    assert not layer.blobs[0].data.any() and layer.blobs[3].data.ravel().tolist() == [1, 1]   # frozen: variance 1
    assert [(spec.lr_mult, spec.decay_mult) for spec in layer.layer_param.param] == [(0, 0)] * 4
    layer, _, _ = run('type: "BN" param { lr_mult: 1 } param { lr_mult: 2 } param { lr_mult: 1 } '
                      'param { lr_mult: 1 } bn_param { momentum: 0.9 }', np.ones((1, 2, 2, 2)))
    assert [spec.lr_mult for spec in layer.layer_param.param] == [1, 2, 0, 0]


def test_pspnet_gradient_in_train():
    text = PSP.replace("FROZEN", 'slope_filler { type: "gaussian" } bias_filler { type: "gaussian" }')
    check_layer_gradient(make_layer(text), [RNG.standard_normal((2, 3, 3, 2))], step=1e-3, threshold=1e-3)


def test_pspnet_frozen_backward_is_the_forks():
    """Frozen: dx = dy * slope / sqrt(var + eps), and no parameter gradient."""
    x = RNG.standard_normal((2, 3, 2, 2))
    params = psp_params(3)
    layer, bottoms, tops = run(PSP.replace("FROZEN", "frozen: true"), x, params=params, dtype=np.float64)
    dy = RNG.standard_normal(x.shape)
    tops[0].diff[...] = dy
    layer.backward(tops, [True], bottoms)
    np.testing.assert_allclose(bottoms[0].diff, dy * per_channel(params[0]) / np.sqrt(per_channel(params[3]) + EPS),
                               rtol=1e-12)
    assert not any(blob.diff.any() for blob in layer.blobs)


def test_pspnet_test_phase_backward_uses_the_batch_formula():
    """In TEST, not frozen, the fork's backward is its batch-statistics
    formula with the running std: dx = (dxhat - mean(dxhat) - x_norm *
    mean(x_norm * dxhat)) / std, x_norm normalized with the running stats."""
    x = RNG.standard_normal((2, 3, 2, 2))
    slope, _, mean, var = params = psp_params(3)
    layer, bottoms, tops = run(PSP.replace("FROZEN", ""), x, cct.TEST, params, dtype=np.float64)
    dy = RNG.standard_normal(x.shape)
    tops[0].diff[...] = dy
    layer.backward(tops, [True], bottoms)
    inv_std = 1 / np.sqrt(per_channel(var) + EPS)
    x_norm = (x - per_channel(mean)) * inv_std
    dxhat = dy * per_channel(slope)
    want = (dxhat - dxhat.mean(axis=(0, 2, 3), keepdims=True)
            - x_norm * (x_norm * dxhat).mean(axis=(0, 2, 3), keepdims=True)) * inv_std
    np.testing.assert_allclose(bottoms[0].diff, want, rtol=1e-10, atol=1e-12)


SEGNET_LEARN = 'type: "BN" bn_param { scale_filler { type: "gaussian" } shift_filler { type: "gaussian" } }'
SEGNET_INFERENCE = 'type: "BN" bn_param { bn_mode: INFERENCE }'


@pytest.mark.parametrize("phase", [cct.TRAIN, cct.TEST])
def test_segnet_learn_uses_batch_statistics_and_gives_them_as_tops(phase):
    x = RNG.standard_normal((3, 4, 5, 6)) * 2 + 1
    scale, shift = RNG.uniform(0.5, 2, 4), RNG.standard_normal(4)
    layer, _, tops = run(SEGNET_LEARN, x, phase, [scale, shift], num_tops=3)
    mean, var = batch_stats(x)
    want = per_channel(scale) * (x - per_channel(mean)) / np.sqrt(per_channel(var) + 1e-9) + per_channel(shift)
    np.testing.assert_allclose(tops[0].data, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(tops[1].data, per_channel(mean), rtol=1e-5)
    np.testing.assert_allclose(tops[2].data, per_channel(var), rtol=1e-4)
    assert len(layer.blobs) == 2


def test_segnet_inference_is_an_affine_map():
    x = RNG.standard_normal((2, 3, 4, 4))
    scale, shift = RNG.standard_normal(3), RNG.standard_normal(3)
    _, _, tops = run(SEGNET_INFERENCE, x, cct.TEST, [scale, shift], dtype=np.float64)
    np.testing.assert_array_equal(tops[0].data, x * per_channel(scale) + per_channel(shift))


@pytest.mark.parametrize("text", [SEGNET_LEARN, SEGNET_INFERENCE.replace("INFERENCE", 'INFERENCE scale_filler '
                                                                          '{ type: "gaussian" }')])
def test_segnet_gradient(text):
    check_layer_gradient(make_layer(text), [RNG.standard_normal((2, 3, 3, 2))], step=1e-3, threshold=1e-3)


def test_segnet_inference_in_place_keeps_its_input_for_the_scale_gradient():
    layer = make_layer(SEGNET_INFERENCE.replace("INFERENCE", 'INFERENCE scale_filler { type: "constant" value: 2 }'))
    x = RNG.standard_normal((1, 2, 2, 2))
    bottoms, _ = setup_layer(layer, [x], 1)
    blob = bottoms[0]
    layer.reshape([blob], [blob])
    layer.forward([blob], [blob])
    blob.diff[...] = 1
    layer.backward([blob], [True], [blob])
    np.testing.assert_allclose(layer.blobs[0].diff.ravel(), x.sum(axis=(0, 2, 3)))


@pytest.mark.parametrize("text, segnet", [
    ('type: "BN"', False), ('type: "BN" bn_param { frozen: true }', False),
    ('type: "BN" bn_param { bn_mode: LEARN }', True), ('type: "BN" param { lr_mult: 1 } param { lr_mult: 1 }', True),
])
def test_flavour_from_fields_or_param_count(text, segnet):
    layer, _, _ = run(text, np.ones((1, 2, 2, 2)))
    assert layer.segnet is segnet and len(layer.blobs) == (2 if segnet else 4)


def test_bn_errors():
    with pytest.raises(ConfigError, match=r"\(BN\): bn_param.bn_mode: SegNet's field beside PSPNet's bn_param.frozen"):
        run('type: "BN" bn_param { bn_mode: LEARN frozen: true }', np.ones((1, 2, 2, 2)))
    with pytest.raises(ConfigError, match=r"\(BN\): top: PSPNet's BN takes exactly 1 top, got 2"):
        run('type: "BN"', np.ones((1, 2, 2, 2)), num_tops=2)


def test_pspnet_bn_in_a_net_learns_only_slope_and_bias(tmp_path):
    net = cct.Net('input: "x" input_shape { dim: 2 dim: 3 dim: 4 dim: 4 } '
                  'layer { name: "bn" type: "BN" bottom: "x" top: "x" bn_param { momentum: 0.9 } }', cct.TRAIN)
    assert net.params_lr == [1, 1, 0, 0]
    net.blobs["x"].data[...] = RNG.standard_normal((2, 3, 4, 4))
    net.forward()
    np.testing.assert_allclose(net.blobs["x"].data.mean(axis=(0, 2, 3)), 0, atol=1e-6)   # slope 0 bias 0: all 0
