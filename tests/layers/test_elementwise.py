"""Elementwise layers (layers/elementwise.py): gradients over parameter
settings, forward against naive loops, in-place use and the errors for bad params."""
import itertools

import numpy as np
import pytest

from cct.core.errors import ConfigError, ShapeError
from cct.testing.gradient_check import check_layer_gradient, make_layer, setup_layer
from helpers.layers import run_layer

RNG = np.random.default_rng(23)


def rand(*shape):
    return RNG.standard_normal(shape)


def every_index(shape):
    return itertools.product(*(range(d) for d in shape))


# --- Eltwise -------------------------------------------------------------------------
def naive_eltwise(op, arrays, coeffs):
    out = np.zeros(arrays[0].shape)
    for index in every_index(out.shape):
        values = [float(a[index]) for a in arrays]
        if op == "PROD":
            out[index] = np.prod(values)
        elif op == "SUM":
            out[index] = sum(c * v for c, v in zip(coeffs, values))
        else:
            out[index] = max(values)
    return out


@pytest.mark.parametrize("op,coeffs,count,extra", [
    ("SUM", [], 2, ""), ("SUM", [0.5, -2], 2, ""), ("SUM", [1, -1, 3], 3, ""),
    ("PROD", [], 2, ""), ("PROD", [], 3, ""), ("PROD", [], 3, "stable_prod_grad: false"),
    ("MAX", [], 2, ""), ("MAX", [], 3, ""),
])
def test_eltwise_forward_and_gradient(op, coeffs, count, extra):
    arrays = [rand(2, 3, 2, 2) for _ in range(count)]
    coeff_text = " ".join(f"coeff: {c}" for c in coeffs)
    prototxt = f'type: "Eltwise" eltwise_param {{ operation: {op} {coeff_text} {extra} }}'
    _, _, tops = run_layer(prototxt, arrays)
    np.testing.assert_allclose(tops[0].data, naive_eltwise(op, arrays, coeffs or [1] * count), rtol=1e-12)
    check_layer_gradient(make_layer(prototxt), arrays)


def test_eltwise_max_ties_go_like_caffe():
    # bottom 1 wins a tie with bottom 0; later bottoms only win when strictly greater.
    a = np.array([1.0, 2.0, 0.0])
    b = np.array([1.0, 1.0, 0.0])
    c = np.array([0.0, 2.0, 0.0])
    layer, bottoms, tops = run_layer('type: "Eltwise" eltwise_param { operation: MAX }', [a, b, c])
    tops[0].diff[...] = 1
    layer.backward(tops, [True] * 3, bottoms)
    np.testing.assert_array_equal(bottoms[0].diff, [0, 1, 0])
    np.testing.assert_array_equal(bottoms[1].diff, [1, 0, 1])
    np.testing.assert_array_equal(bottoms[2].diff, [0, 0, 0])


def test_eltwise_sum_in_place():
    a, b = rand(3, 4), rand(3, 4)
    layer = make_layer('type: "Eltwise" eltwise_param { coeff: 2 coeff: 3 }')
    bottoms, tops = setup_layer(layer, [a, b])
    layer.reshape(bottoms, [bottoms[0]])
    layer.forward(bottoms, [bottoms[0]])
    np.testing.assert_allclose(bottoms[0].data, 2 * a + 3 * b)
    bottoms[0].diff[...] = diff = rand(3, 4)
    layer.backward([bottoms[0]], [True, True], bottoms)
    np.testing.assert_allclose(bottoms[1].diff, 3 * diff)
    np.testing.assert_allclose(bottoms[0].diff, 2 * diff)


def test_eltwise_max_ignores_coefficients():
    """Caffe's MAX accepts coeff and takes the plain maximum."""
    a, b = rand(2, 3), rand(2, 3)
    _, _, tops = run_layer('type: "Eltwise" eltwise_param { operation: MAX coeff: 1 coeff: -1 }', [a, b])
    np.testing.assert_array_equal(tops[0].data, np.maximum(a, b))


def test_eltwise_errors():
    with pytest.raises(ConfigError, match="eltwise_param.coeff.*one coefficient per bottom \\(2\\), got 3"):
        run_layer('type: "Eltwise" eltwise_param { coeff: 1 coeff: 2 coeff: 3 }', [rand(2), rand(2)])
    with pytest.raises(ConfigError, match="PROD operation takes no coefficients"):
        run_layer('type: "Eltwise" eltwise_param { operation: PROD coeff: 1 coeff: 2 }', [rand(2), rand(2)])
    with pytest.raises(ShapeError, match=r"bottom\[1\] has shape \(3,\)"):
        run_layer('type: "Eltwise"', [rand(2), rand(3)])
    with pytest.raises(ConfigError, match="at least 2 bottom"):
        run_layer('type: "Eltwise"', [rand(2)])


# --- Reduction -----------------------------------------------------------------------
def naive_reduction(op, x, axis, coeff):
    lead = x.shape[:axis]
    out = np.zeros(lead)
    for index in every_index(lead):
        values = [float(v) for v in np.asarray(x[index]).reshape(-1)]
        total = {"SUM": sum(values), "ASUM": sum(abs(v) for v in values),
                 "SUMSQ": sum(v * v for v in values), "MEAN": sum(values) / len(values)}[op]
        out[index] = coeff * total
    return out


@pytest.mark.parametrize("op", ["SUM", "ASUM", "SUMSQ", "MEAN"])
@pytest.mark.parametrize("axis,coeff", [(0, 1.0), (1, 0.5), (2, -2.0), (-1, 1.5)])
def test_reduction_forward_and_gradient(op, axis, coeff):
    x = rand(2, 3, 4)
    prototxt = f'type: "Reduction" reduction_param {{ operation: {op} axis: {axis} coeff: {coeff} }}'
    _, _, tops = run_layer(prototxt, [x])
    canonical = axis % 3
    assert tops[0].shape == x.shape[:canonical]
    np.testing.assert_allclose(tops[0].data, naive_reduction(op, x, canonical, coeff), rtol=1e-12)
    check_layer_gradient(make_layer(prototxt), [x], kink=0.0 if op == "ASUM" else None, kink_range=1e-3)


def test_reduction_axis_error():
    with pytest.raises(ConfigError, match="reduction_param.axis"):
        run_layer('type: "Reduction" reduction_param { axis: 3 }', [rand(2, 3, 4)])


# --- Scale ---------------------------------------------------------------------------
def naive_broadcast(x, operand, axis, op):
    """Apply op(x[index], operand[index[axis:axis+operand.ndim]]) element by element."""
    out = np.zeros(x.shape)
    for index in every_index(x.shape):
        out[index] = op(x[index], operand[index[axis:axis + operand.ndim]])
    return out


SCALE_SETTINGS = [   # (params, expected learned shape, axis used)
    ("", (3,), 1),
    ("axis: 0 num_axes: -1", (2, 3, 4, 2), 0),
    ("num_axes: 0", (), 0),
    ("axis: 2 num_axes: 2", (4, 2), 2),
    ("axis: -2", (4,), 2),
    ("axis: 1 num_axes: -1", (3, 4, 2), 1),
]


@pytest.mark.parametrize("params,shape,axis", SCALE_SETTINGS)
@pytest.mark.parametrize("bias", [False, True])
def test_scale_learned(params, shape, axis, bias):
    x = rand(2, 3, 4, 2)
    bias_text = 'bias_term: true bias_filler { type: "gaussian" }' if bias else ""
    prototxt = f'type: "Scale" scale_param {{ {params} filler {{ type: "uniform" min: -2 max: 2 }} {bias_text} }}'
    layer, _, tops = run_layer(prototxt, [x])
    assert [b.shape for b in layer.blobs] == [shape] * (2 if bias else 1)
    expected = naive_broadcast(x, layer.blobs[0].data, axis, lambda v, s: v * s)
    if bias:
        expected = naive_broadcast(expected, layer.blobs[1].data, axis, lambda v, s: v + s)
    np.testing.assert_allclose(tops[0].data, expected, rtol=1e-12)
    check_layer_gradient(make_layer(prototxt), [x])


@pytest.mark.parametrize("scale_shape,params,axis", [
    ((3,), "", 1), ((3, 4), "", 1), ((), "", 0), ((4, 2), "axis: 2", 2),
    ((2, 3), "axis: 0", 0), ((2, 3, 4, 2), "axis: 0", 0),
])
@pytest.mark.parametrize("bias", [False, True])
def test_scale_second_bottom(scale_shape, params, axis, bias):
    x, scale = rand(2, 3, 4, 2), rand(*scale_shape)
    prototxt = f'type: "Scale" scale_param {{ {params} bias_term: {str(bias).lower()} ' \
               'bias_filler { type: "uniform" min: -1 max: 1 } }'
    layer, _, tops = run_layer(prototxt, [x, scale])
    assert [b.shape for b in layer.blobs] == ([scale_shape] if bias else [])
    expected = naive_broadcast(x, scale, axis, lambda v, s: v * s)
    if bias:
        expected = naive_broadcast(expected, layer.blobs[0].data, axis, lambda v, s: v + s)
    np.testing.assert_allclose(tops[0].data, expected, rtol=1e-12)
    check_layer_gradient(make_layer(prototxt), [x, scale])


def test_scale_default_fillers_are_identity():
    layer, _, tops = run_layer('type: "Scale" scale_param { bias_term: true }', [rand(2, 3)])
    assert np.all(layer.blobs[0].data == 1) and np.all(layer.blobs[1].data == 0)


def test_scale_in_place_matches_out_of_place():
    x, diff = rand(2, 3, 4), rand(2, 3, 4)
    prototxt = 'type: "Scale" scale_param { bias_term: true filler { type: "gaussian" } bias_filler { type: "gaussian" } }'
    results = []
    for in_place in (False, True):
        layer = make_layer(prototxt)
        bottoms, tops = setup_layer(layer, [x])
        layer.blobs[0].data[...] = [0.5, -1, 2]
        layer.blobs[1].data[...] = [0.1, 0.2, 0.3]
        if in_place:
            tops = bottoms
            layer.reshape(bottoms, tops)
        layer.forward(bottoms, tops)
        out = tops[0].data.copy()
        tops[0].diff[...] = diff
        layer.backward(tops, [True], bottoms)
        results.append((out, bottoms[0].diff.copy(), layer.blobs[0].diff.copy(), layer.blobs[1].diff.copy()))
    for ours, theirs in zip(*results):
        np.testing.assert_allclose(ours, theirs, rtol=1e-12)


def test_scale_param_diffs_accumulate():
    layer, bottoms, tops = run_layer('type: "Scale"', [rand(2, 3, 4)])
    tops[0].diff[...] = 1
    layer.backward(tops, [False], bottoms)
    once = layer.blobs[0].diff.copy()
    layer.backward(tops, [False], bottoms)
    np.testing.assert_allclose(layer.blobs[0].diff, 2 * once)


def test_scale_errors():
    with pytest.raises(ShapeError, match=r"\(4,\) does not match bottom\[0\] \(2, 3, 4\) from axis 1"):
        run_layer('type: "Scale"', [rand(2, 3, 4), rand(4)])
    with pytest.raises(ConfigError, match="scale_param.num_axes.*>= 0"):
        run_layer('type: "Scale" scale_param { num_axes: -2 }', [rand(2, 3)])
    with pytest.raises(ConfigError, match="scale_param.num_axes.*goes past"):
        run_layer('type: "Scale" scale_param { axis: 1 num_axes: 3 }', [rand(2, 3)])
    with pytest.raises(ConfigError, match="scale_param.axis"):
        run_layer('type: "Scale" scale_param { axis: 2 }', [rand(2, 3)])


# --- Bias ----------------------------------------------------------------------------
@pytest.mark.parametrize("params,shape,axis", SCALE_SETTINGS)
def test_bias_learned(params, shape, axis):
    x = rand(2, 3, 4, 2)
    prototxt = f'type: "Bias" bias_param {{ {params} filler {{ type: "gaussian" }} }}'
    layer, _, tops = run_layer(prototxt, [x])
    assert layer.blobs[0].shape == shape
    np.testing.assert_allclose(tops[0].data, naive_broadcast(x, layer.blobs[0].data, axis, lambda v, b: v + b),
                               rtol=1e-12)
    check_layer_gradient(make_layer(prototxt), [x])


@pytest.mark.parametrize("bias_shape,params,axis", [
    ((3,), "", 1), ((3, 4), "", 1), ((), "", 0), ((4, 2), "axis: 2", 2), ((2,), "axis: 0", 0),
])
def test_bias_second_bottom(bias_shape, params, axis):
    x, bias = rand(2, 3, 4, 2), rand(*bias_shape)
    prototxt = f'type: "Bias" bias_param {{ {params} }}'
    layer, _, tops = run_layer(prototxt, [x, bias])
    assert layer.blobs == []
    np.testing.assert_allclose(tops[0].data, naive_broadcast(x, bias, axis, lambda v, b: v + b), rtol=1e-12)
    check_layer_gradient(make_layer(prototxt), [x, bias])


def test_bias_default_filler_zero_and_in_place():
    layer = make_layer('type: "Bias"')
    bottoms, _ = setup_layer(layer, [rand(2, 3)])
    assert np.all(layer.blobs[0].data == 0)
    layer.blobs[0].data[...] = [1, 2, 3]
    x = bottoms[0].data.copy()
    layer.reshape(bottoms, bottoms)
    layer.forward(bottoms, bottoms)
    np.testing.assert_allclose(bottoms[0].data, x + [1, 2, 3])
    bottoms[0].diff[...] = diff = rand(2, 3)
    layer.backward(bottoms, [True], bottoms)
    np.testing.assert_allclose(bottoms[0].diff, diff)
    np.testing.assert_allclose(layer.blobs[0].diff, diff.sum(axis=0))


def test_bias_errors():
    with pytest.raises(ShapeError, match="does not match bottom"):
        run_layer('type: "Bias"', [rand(2, 3), rand(2)])
    with pytest.raises(ConfigError, match="bias_param.num_axes"):
        run_layer('type: "Bias" bias_param { num_axes: 2 }', [rand(2, 3)])


# --- Embed ---------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("index_shape", [(5,), (2, 3)])
def test_embed_forward_and_gradient(bias, index_shape):
    indices = RNG.integers(0, 4, index_shape).astype(float)
    indices.reshape(-1)[:2] = 3            # a repeated index: its weight diff accumulates
    prototxt = (f'type: "Embed" embed_param {{ num_output: 3 input_dim: 4 bias_term: {str(bias).lower()} '
                'weight_filler { type: "gaussian" } bias_filler { type: "gaussian" } }')
    layer, _, tops = run_layer(prototxt, [indices])
    assert tops[0].shape == index_shape + (3,)
    weight = layer.blobs[0].data
    for index in every_index(index_shape):
        row = weight[int(indices[index])] + (layer.blobs[1].data if bias else 0)
        np.testing.assert_allclose(tops[0].data[index], row, rtol=1e-12)
    check_layer_gradient(make_layer(prototxt), [indices], check_bottoms=[])


def test_embed_errors():
    prototxt = 'type: "Embed" embed_param { num_output: 2 input_dim: 3 }'
    with pytest.raises(ShapeError, match=r"integers in \[0, 3\).*3\.0"):
        run_layer(prototxt, [np.array([0.0, 3.0])])
    with pytest.raises(ShapeError, match=r"integers in \[0, 3\)"):
        run_layer(prototxt, [np.array([-1.0])])
    with pytest.raises(ShapeError, match=r"1\.5"):
        run_layer(prototxt, [np.array([1.5])])
    with pytest.raises(ConfigError, match="embed_param.num_output"):
        run_layer('type: "Embed" embed_param { input_dim: 3 }', [np.array([0.0])])
    with pytest.raises(ConfigError, match="embed_param.input_dim"):
        run_layer('type: "Embed" embed_param { num_output: 3 }', [np.array([0.0])])
    layer, bottoms, tops = run_layer(prototxt, [np.array([1.0])])
    with pytest.raises(ConfigError, match="cannot backpropagate"):
        layer.backward(tops, [True], bottoms)
