"""Neuron layers (layers/neuron.py): gradients, forward against naive scalar
formulas, Caffe's special cases, and in-place use inside a Net."""
import math

import numpy as np
import pytest

import cct
from cct.core.errors import ConfigError
from cct.testing.gradient_check import check_layer_gradient, make_layer, setup_layer
from helpers.layers import run_layer
from helpers.nets import run_net_text

RNG = np.random.default_rng(5)


def uniform(low, high, shape=(2, 3, 4, 5)):
    return RNG.uniform(low, high, shape)


def forward(prototxt, x, phase=cct.TRAIN):
    """The top's data after one forward on x."""
    return run_layer(prototxt, [x], phase=phase)[2][0].data.copy()


def naive(function, x):
    """Apply a scalar function element by element (the independent reference)."""
    flat = [function(float(v)) for v in np.asarray(x).reshape(-1)]
    return np.array(flat).reshape(np.shape(x))


def sigmoid(v):
    return 1 / (1 + math.exp(-v)) if v >= 0 else math.exp(v) / (1 + math.exp(v))


# --- forward against naive formulas -------------------------------------------------
FORWARD_CASES = [
    ('type: "ReLU"', lambda v: max(v, 0.0), (-2, 2)),
    ('type: "ReLU" relu_param { negative_slope: 0.1 }', lambda v: v if v > 0 else 0.1 * v, (-2, 2)),
    ('type: "ELU"', lambda v: v if v > 0 else math.exp(v) - 1, (-3, 2)),
    ('type: "ELU" elu_param { alpha: 0.3 }', lambda v: v if v > 0 else 0.3 * (math.exp(v) - 1), (-3, 2)),
    ('type: "Sigmoid"', sigmoid, (-8, 8)),
    ('type: "TanH"', math.tanh, (-3, 3)),
    ('type: "AbsVal"', abs, (-2, 2)),
    ('type: "BNLL"', lambda v: math.log(1 + math.exp(v)), (-5, 5)),
    ('type: "Power" power_param { power: 2 scale: 0.5 shift: 1.5 }', lambda v: (1.5 + 0.5 * v) ** 2, (-2, 2)),
    ('type: "Power" power_param { power: 0.37 scale: 0.83 shift: 2.5 }', lambda v: (2.5 + 0.83 * v) ** 0.37, (-1, 1)),
    ('type: "Power" power_param { power: 0 scale: 3 shift: 2 }', lambda v: 1.0, (-1, 1)),
    ('type: "Power" power_param { power: 3 scale: 0 shift: 2 }', lambda v: 8.0, (-1, 1)),
    ('type: "Exp"', math.exp, (-2, 2)),
    ('type: "Exp" exp_param { base: 2 scale: 0.5 shift: 0.1 }', lambda v: 2 ** (0.1 + 0.5 * v), (-2, 2)),
    ('type: "Log"', math.log, (0.1, 3)),
    ('type: "Log" log_param { base: 10 scale: 2 shift: 1 }', lambda v: math.log10(1 + 2 * v), (0.1, 3)),
    ('type: "Threshold" threshold_param { threshold: 0.25 }', lambda v: 1.0 if v > 0.25 else 0.0, (-1, 1)),
    ('type: "Clip" clip_param { min: -0.5 max: 0.75 }', lambda v: min(max(v, -0.5), 0.75), (-2, 2)),
    ('type: "Swish"', lambda v: v * sigmoid(v), (-4, 4)),
    ('type: "Swish" swish_param { beta: 2.5 }', lambda v: v * sigmoid(2.5 * v), (-4, 4)),
]


@pytest.mark.parametrize("prototxt,function,bounds", FORWARD_CASES, ids=[c[0] for c in FORWARD_CASES])
def test_forward_matches_naive(prototxt, function, bounds):
    x = uniform(*bounds)
    np.testing.assert_allclose(forward(prototxt, x), naive(function, x), rtol=1e-6, atol=1e-12)  # fields are float32


def test_prelu_forward_matches_naive():
    x = uniform(-2, 2)
    layer = make_layer('type: "PReLU" prelu_param { filler { type: "uniform" min: 0.1 max: 0.9 } }')
    bottoms, tops = setup_layer(layer, [x])
    layer.forward(bottoms, tops)
    slopes = layer.blobs[0].data
    assert slopes.shape == (3,)
    expected = np.empty_like(x)
    for n, c, h, w in np.ndindex(x.shape):
        v = x[n, c, h, w]
        expected[n, c, h, w] = v if v > 0 else slopes[c] * v
    np.testing.assert_allclose(tops[0].data, expected, rtol=1e-12)


def test_prelu_default_filler_and_shared_shape():
    layer = make_layer('type: "PReLU"')
    setup_layer(layer, [uniform(-1, 1)])
    np.testing.assert_array_equal(layer.blobs[0].data, np.full(3, 0.25))
    shared = make_layer('type: "PReLU" prelu_param { channel_shared: true }')
    setup_layer(shared, [uniform(-1, 1)])
    assert shared.blobs[0].shape == () and float(shared.blobs[0].data) == 0.25


def test_prelu_needs_two_axes():
    with pytest.raises(cct.ShapeError, match="at least 2 axes"):
        setup_layer(make_layer('type: "PReLU"'), [uniform(-1, 1, (5,))])


# --- gradients --------------------------------------------------------------------
GRADIENT_CASES = [
    ('type: "ReLU"', (-1, 1), dict(kink=0.0, kink_range=1e-3)),
    ('type: "ReLU" relu_param { negative_slope: 0.1 }', (-1, 1), dict(kink=0.0, kink_range=1e-3)),
    ('type: "ReLU" relu_param { negative_slope: -0.4 }', (-1, 1), dict(kink=0.0, kink_range=1e-3)),
    ('type: "ELU"', (-2, 2), dict(kink=0.0, kink_range=1e-3)),
    ('type: "ELU" elu_param { alpha: 0.7 }', (-2, 2), dict(kink=0.0, kink_range=1e-3)),
    ('type: "Sigmoid"', (-4, 4), {}),
    ('type: "TanH"', (-2, 2), {}),
    ('type: "AbsVal"', (-1, 1), dict(kink=0.0, kink_range=1e-3)),
    ('type: "BNLL"', (-4, 4), {}),
    ('type: "Power" power_param { power: 2 scale: 0.5 shift: 1.5 }', (-2, 2), {}),
    ('type: "Power" power_param { power: 0.37 scale: 0.83 shift: 2.5 }', (-1, 1), {}),
    ('type: "Power" power_param { power: -1.5 scale: 1.0 shift: 0 }', (0.5, 2), {}),
    ('type: "Power" power_param { power: 3 }', (-1, 1), {}),
    ('type: "Power" power_param { power: 1 scale: -2 shift: 1 }', (-1, 1), {}),
    ('type: "Power" power_param { power: 0 scale: 2 }', (-1, 1), {}),
    ('type: "Exp"', (-1, 1), {}),
    ('type: "Exp" exp_param { base: 2 scale: 0.5 shift: 0.1 }', (-1, 1), {}),
    ('type: "Log"', (0.2, 2), {}),
    ('type: "Log" log_param { base: 2 scale: 0.5 shift: 1 }', (0.2, 2), {}),
    ('type: "Swish"', (-3, 3), {}),
    ('type: "Swish" swish_param { beta: 0.4 }', (-3, 3), {}),
]


@pytest.mark.parametrize("prototxt,bounds,kink", GRADIENT_CASES, ids=[c[0] for c in GRADIENT_CASES])
def test_gradient(prototxt, bounds, kink):
    check_layer_gradient(make_layer(prototxt), [uniform(*bounds, (2, 3, 3, 2))], **kink)


def away_from(x, points, gap=1e-2):
    """Move values within `gap` of any point (a kink) by 2 * gap."""
    x = x.copy()
    for p in points:
        near = np.abs(x - p) < gap
        x[near] += 2 * gap
    return x


def test_clip_gradient():
    x = away_from(uniform(-1.5, 1.5, (2, 3, 3, 2)), [-0.5, 0.75])
    check_layer_gradient(make_layer('type: "Clip" clip_param { min: -0.5 max: 0.75 }'), [x])


@pytest.mark.parametrize("param", ["", "prelu_param { channel_shared: true }",
                                   'prelu_param { filler { type: "uniform" min: -0.5 max: 0.5 } }'])
def test_prelu_gradient(param):
    layer = make_layer(f'type: "PReLU" {param}')
    check_layer_gradient(layer, [uniform(-1, 1, (2, 3, 2, 3))], kink=0.0, kink_range=1e-3)


def test_prelu_gradient_on_2d_bottom():
    check_layer_gradient(make_layer('type: "PReLU"'), [uniform(-1, 1, (4, 5))], kink=0.0, kink_range=1e-3)


def test_prelu_param_diff_accumulates():
    layer = make_layer('type: "PReLU"')
    bottoms, tops = setup_layer(layer, [uniform(-1, 1)])
    layer.forward(bottoms, tops)
    tops[0].diff[...] = uniform(-1, 1)
    layer.backward(tops, [True], bottoms)
    once = layer.blobs[0].diff.copy()
    assert np.abs(once).max() > 0
    layer.backward(tops, [True], bottoms)
    np.testing.assert_allclose(layer.blobs[0].diff, 2 * once)


@pytest.mark.parametrize("ratio", [0.3, 0.5, 0.8])
def test_dropout_gradient_in_train(ratio):
    layer = make_layer(f'type: "Dropout" dropout_param {{ dropout_ratio: {ratio} }}')
    check_layer_gradient(layer, [uniform(-1, 1, (3, 4, 5))])


def test_dropout_train_mask_and_scale():
    x = uniform(0.5, 1.5, (50, 40))
    cct.set_random_seed(3)
    y = forward('type: "Dropout" dropout_param { dropout_ratio: 0.3 }', x)
    dropped = y == 0
    assert abs(dropped.mean() - 0.3) < 0.03
    np.testing.assert_allclose(y[~dropped], x[~dropped] / 0.7)


def test_dropout_test_phase_is_identity_both_ways():
    x = uniform(-1, 1)
    layer = make_layer('type: "Dropout" dropout_param { dropout_ratio: 0.6 }', cct.TEST)
    bottoms, tops = setup_layer(layer, [x])
    layer.forward(bottoms, tops)
    np.testing.assert_array_equal(tops[0].data, x)
    tops[0].diff[...] = 2 * x
    layer.backward(tops, [True], bottoms)
    np.testing.assert_array_equal(bottoms[0].diff, 2 * x)


def test_dropout_is_repeatable_with_a_seed():
    x = uniform(-1, 1)
    cct.set_random_seed(11)
    first = forward('type: "Dropout"', x)
    cct.set_random_seed(11)
    np.testing.assert_array_equal(forward('type: "Dropout"', x), first)


# --- Caffe's special cases and checks ---------------------------------------------------
def test_threshold_has_no_backward():
    layer = make_layer('type: "Threshold"')
    bottoms, tops = setup_layer(layer, [uniform(-1, 1)])
    layer.forward(bottoms, tops)
    layer.backward(tops, [False], bottoms)          # nothing asked: fine
    with pytest.raises(NotImplementedError, match="Threshold"):
        layer.backward(tops, [True], bottoms)
    assert not layer.allow_force_backward(0)


def test_power_shift_zero_backward_follows_caffe_at_zero():
    # Caffe computes power * y / x when shift is 0, which is nan at x == 0.
    layer = make_layer('type: "Power" power_param { power: 3 }')
    bottoms, tops = setup_layer(layer, [np.array([[0.0, 2.0]])])
    layer.forward(bottoms, tops)
    tops[0].diff[...] = 1
    layer.backward(tops, [True], bottoms)
    assert np.isnan(bottoms[0].diff[0, 0])
    assert bottoms[0].diff[0, 1] == pytest.approx(12.0)


@pytest.mark.parametrize("prototxt,field", [
    ('type: "Exp" exp_param { base: 0 }', "exp_param.base"),
    ('type: "Log" log_param { base: -2 }', "log_param.base"),
    ('type: "Dropout" dropout_param { dropout_ratio: 1 }', "dropout_param.dropout_ratio"),
    ('type: "Clip" clip_param { min: 1 }', "clip_param.max"),
])
def test_bad_params_are_config_errors(prototxt, field):
    with pytest.raises(ConfigError, match=field):
        setup_layer(make_layer(prototxt), [uniform(0.5, 1)])


def test_clip_with_min_above_max_gives_min_as_caffe():
    layer = make_layer('type: "Clip" clip_param { min: 2 max: 1 }')
    bottoms, tops = setup_layer(layer, [np.array([-3.0, 1.5, 4.0])])
    layer.forward(bottoms, tops)
    np.testing.assert_array_equal(tops[0].data, [2, 2, 2])


def test_absval_refuses_in_place():
    layer = make_layer('type: "AbsVal"')
    blob = cct.Blob((2, 3))
    with pytest.raises(ConfigError, match="in-place"):
        layer.setup([blob], [blob])


# --- in place inside a Net ------------------------------------------------------------
def neuron_net(layer_text, in_place):
    top = "x" if in_place else "y"
    return cct.Net(f'''name: "t" force_backward: true
        layer {{ name: "in" type: "Input" top: "x" top: "target"
                 input_param {{ shape {{ dim: 2 dim: 3 dim: 4 }} shape {{ dim: 2 dim: 3 dim: 4 }} }} }}
        layer {{ name: "n" bottom: "x" top: "{top}" {layer_text} }}
        layer {{ name: "loss" type: "EuclideanLoss" bottom: "{top}" bottom: "target" top: "loss"
                 loss_weight: 2 }}''', cct.TRAIN)


IN_PLACE_CASES = [
    ('type: "ReLU"', (-1, 1)),
    ('type: "ReLU" relu_param { negative_slope: -0.5 }', (-1, 1)),
    ('type: "PReLU"', (-1, 1)),
    ('type: "ELU" elu_param { alpha: -0.5 }', (-1, 1)),
    ('type: "Sigmoid"', (-2, 2)),
    ('type: "TanH"', (-2, 2)),
    ('type: "BNLL"', (-2, 2)),
    ('type: "Power" power_param { power: 2.5 scale: 0.5 shift: 1.5 }', (-1, 1)),
    ('type: "Exp" exp_param { base: 3 }', (-1, 1)),
    ('type: "Log" log_param { shift: 1 }', (0, 1)),
    ('type: "Clip" clip_param { min: -0.3 max: 0.3 }', (-1, 1)),
    ('type: "Swish"', (-2, 2)),
    ('type: "Dropout"', (-1, 1)),
]


@pytest.mark.parametrize("layer_text,bounds", IN_PLACE_CASES, ids=[c[0] for c in IN_PLACE_CASES])
def test_in_place_in_a_net_matches_out_of_place(layer_text, bounds):
    x, target = uniform(*bounds, (2, 3, 4)), uniform(-1, 1, (2, 3, 4))
    results = []
    for in_place in (False, True):
        net = neuron_net(layer_text, in_place)
        net.blobs["x"].data[...] = x
        net.blobs["target"].data[...] = target
        cct.set_random_seed(7)
        loss = net.forward()["loss"].item()
        net.backward()
        out = net.blobs["x" if in_place else "y"].data.copy()
        param_diffs = [b.diff.copy() for b in net.layer_dict["n"].blobs]
        results.append((loss, out, net.blobs["x"].diff.copy(), param_diffs))
    (loss0, out0, dx0, p0), (loss1, out1, dx1, p1) = results
    assert loss1 == pytest.approx(loss0, rel=1e-6)
    np.testing.assert_allclose(out1, out0, rtol=1e-6)
    np.testing.assert_allclose(dx1, dx0, rtol=1e-5, atol=1e-7)
    assert np.abs(dx0).max() > 0
    for a, b in zip(p0, p1):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


# --- chunks and memory ------------------------------------------------------------------
def relu_forward_backward(text, x, dy, in_place):
    layer = make_layer(text)
    if in_place:
        blob = cct.Blob(x.shape, np.float64)
        blob.data[...] = x
        bottoms = tops = [blob]
        layer.setup(bottoms, tops)
        layer.reshape(bottoms, tops)
    else:
        bottoms, tops = setup_layer(layer, [x])
    layer.forward(bottoms, tops)
    y = tops[0].data.copy()
    tops[0].diff[...] = dy
    layer.backward(tops, [True], bottoms)
    return layer, y, bottoms[0].diff.copy()


@pytest.mark.parametrize("in_place", [False, True])
def test_relu_backward_slices_give_the_unsliced_numbers(monkeypatch, in_place):
    """CHUNK_ELEMENTS = 7 on 120 elements: the backward mask runs in 18 slices."""
    x, dy = uniform(-1, 1), uniform(-1, 1)
    _, y, dx = relu_forward_backward('type: "ReLU"', x, dy, in_place)
    monkeypatch.setattr("cct.layers.neuron.CHUNK_ELEMENTS", 7)
    _, y_sliced, dx_sliced = relu_forward_backward('type: "ReLU"', x, dy, in_place)
    np.testing.assert_array_equal(y_sliced, y)
    np.testing.assert_array_equal(dx_sliced, dx)
    np.testing.assert_array_equal(dx, np.where(x > 0, dy, 0))


@pytest.mark.parametrize("slope,saves", [(0, False), (0.1, False), (-0.2, True)])
def test_in_place_relu_keeps_its_input_only_for_a_negative_slope(slope, saves):
    """y > 0 exactly where x > 0 when the slope is >= 0: no copy of x is needed."""
    x, dy = uniform(-1, 1), uniform(-1, 1)
    text = f'type: "ReLU" relu_param {{ negative_slope: {slope} }}'
    layer, _, dx = relu_forward_backward(text, x, dy, in_place=True)
    assert hasattr(layer, "_saved_input") == saves
    np.testing.assert_allclose(dx, np.where(x > 0, dy, dy * np.float32(slope)))


def test_prelu_of_a_blob_without_channels_is_refused_by_its_filler():
    """Found by the fuzzer: an input of 0 channels failed in numpy's
    reshape(N, 0, -1) (ValueError). Its slopes would be empty, and Caffe's
    fillers refuse an empty blob (CHECK(count), filler.hpp): so does cct."""
    net_text = """force_backward: true
    layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 0 dim: 4 dim: 5 } } }
    layer { name: "l" type: "PReLU" bottom: "data" top: "data" }"""
    with pytest.raises(cct.ConfigError, match=r"layer 'l' \(PReLU\): prelu_param.filler: the constant filler "
                                              r"cannot fill a blob of shape \(0,\)"):
        run_net_text(net_text, cct.TRAIN)
