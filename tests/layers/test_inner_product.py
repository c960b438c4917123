"""InnerProduct (layers/inner_product.py): forward against explicit sums,
gradients (axis, transpose, no bias), accumulation, shape checks."""
import numpy as np
import pytest

import cct
from cct.core.errors import ConfigError, ShapeError
from cct.testing.gradient_check import check_layer_gradient, make_layer, setup_layer

RNG = np.random.default_rng(13)
FILLERS = 'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 }'


def ip_text(fields):
    return f'type: "InnerProduct" inner_product_param {{ {fields} {FILLERS} }}'


def naive_inner_product(x, w, b, axis, transpose):
    """Each output as an explicit sum over the folded input vector."""
    rows = int(np.prod(x.shape[:axis]))
    flat = x.reshape(rows, -1)
    weights = w.T if transpose else w                      # (N, K)
    y = np.zeros((rows, weights.shape[0]))
    for m in range(rows):
        for n in range(weights.shape[0]):
            y[m, n] = sum(flat[m, k] * weights[n, k] for k in range(flat.shape[1])) + (b[n] if b is not None else 0)
    return y.reshape(x.shape[:axis] + (weights.shape[0],))


@pytest.mark.parametrize("fields,shape", [
    ("num_output: 4", (3, 2, 2, 2)),
    ("num_output: 3 axis: 2", (2, 3, 4)),
    ("num_output: 5 transpose: true", (2, 6)),
    ("num_output: 2 bias_term: false axis: -1", (2, 2, 3)),
])
def test_forward_matches_naive(fields, shape):
    x = RNG.standard_normal(shape)
    layer = make_layer(ip_text(fields))
    bottoms, tops = setup_layer(layer, [x])
    layer.forward(bottoms, tops)
    p = layer.layer_param.inner_product_param
    axis = p.axis % len(shape)
    bias = layer.blobs[1].data if p.bias_term else None
    np.testing.assert_allclose(tops[0].data, naive_inner_product(x, layer.blobs[0].data, bias, axis, p.transpose),
                               rtol=1e-12, atol=1e-12)
    assert layer.blobs[0].shape == ((int(np.prod(shape[axis:])), p.num_output) if p.transpose
                                    else (p.num_output, int(np.prod(shape[axis:]))))


@pytest.mark.parametrize("fields,shape", [
    ("num_output: 4", (3, 2, 2, 2)),
    ("num_output: 3 axis: 2", (2, 3, 4)),
    ("num_output: 5 transpose: true", (2, 6)),
    ("num_output: 2 bias_term: false", (4, 3)),
])
def test_gradient(fields, shape):
    check_layer_gradient(make_layer(ip_text(fields)), [RNG.standard_normal(shape)])


def test_param_diffs_accumulate():
    layer = make_layer(ip_text("num_output: 3"))
    bottoms, tops = setup_layer(layer, [RNG.standard_normal((2, 4))])
    layer.forward(bottoms, tops)
    tops[0].diff[...] = RNG.standard_normal(tops[0].shape)
    layer.backward(tops, [True], bottoms)
    once = [b.diff.copy() for b in layer.blobs]
    layer.backward(tops, [True], bottoms)
    for blob, first in zip(layer.blobs, once):
        np.testing.assert_allclose(blob.diff, 2 * first)


def test_errors():
    with pytest.raises(ConfigError, match="num_output"):
        setup_layer(make_layer(ip_text("num_output: 0")), [np.zeros((2, 3))])
    with pytest.raises(ConfigError, match="axis"):
        setup_layer(make_layer(ip_text("num_output: 2 axis: 3")), [np.zeros((2, 3))])
    layer = make_layer(ip_text("num_output: 2"))
    bottoms, tops = setup_layer(layer, [np.zeros((2, 3))])
    bottoms[0].reshape(2, 4)
    with pytest.raises(ShapeError, match="inputs"):
        layer.reshape(bottoms, tops)
    bottoms[0].reshape(5, 3)                               # a new batch size is fine
    layer.reshape(bottoms, tops)
    assert tops[0].shape == (5, 2)


@pytest.mark.parametrize("fields", ["num_output: 150", "num_output: 150 transpose: true"])
def test_weight_gradient_blocks_give_the_unblocked_numbers(monkeypatch, fields):
    """WEIGHT_GRADIENT_BLOCK small enough for 64-row blocks: the 150 weight rows
    (or, transposed, 24 rows of 150) are accumulated block by block."""
    x, dy = RNG.standard_normal((5, 4, 3, 2)), RNG.standard_normal((5, 150))

    def weight_gradient():
        cct.set_random_seed(2)                      # the same weights both times
        layer = make_layer(ip_text(fields))
        bottoms, tops = setup_layer(layer, [x])
        layer.forward(bottoms, tops)
        tops[0].diff[...] = dy
        layer.blobs[0].diff[...] = 1.0              # accumulates onto what is there
        layer.backward(tops, [True], bottoms)
        return layer.blobs[0].diff.copy(), bottoms[0].diff.copy()

    whole = weight_gradient()
    monkeypatch.setattr("cct.layers.inner_product.WEIGHT_GRADIENT_BLOCK", 24)
    blocked = weight_gradient()
    expected = 1.0 + (x.reshape(5, 24).T @ dy if "transpose" in fields else dy.T @ x.reshape(5, 24))
    np.testing.assert_allclose(blocked[0], expected, rtol=1e-12)
    np.testing.assert_allclose(blocked[0], whole[0], rtol=1e-12)
    np.testing.assert_array_equal(blocked[1], whole[1])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_a_transposed_product_gives_the_same_numbers(monkeypatch, dtype, rows):
    """Above TRANSPOSED_PRODUCT_WEIGHTS a forward of several rows computes
    y^T = W x^T and copies it out; one row keeps the one product x W^T. The
    two agree to float rounding, bias included, and each with the explicit
    sums: not bit for bit, which no BLAS promises (OpenBLAS's SkylakeX
    kernels happen to give it, its Haswell kernels sum the two orientations
    in other orders)."""
    import cct.layers.inner_product as module
    x = RNG.standard_normal((rows, 40, 3)).astype(dtype)

    def forward(threshold):
        monkeypatch.setattr(module, "TRANSPOSED_PRODUCT_WEIGHTS", threshold)
        cct.set_random_seed(4)
        layer = make_layer(ip_text("num_output: 70"))
        bottoms, tops = setup_layer(layer, [x])
        layer.blobs[0].data[...] = layer.blobs[0].data.astype(dtype)
        layer.forward(bottoms, tops)
        return layer, tops[0].data.copy()

    calls = []
    real = module.InnerProduct._transposed_product
    monkeypatch.setattr(module.InnerProduct, "_transposed_product",
                        lambda self, m: calls.append(real(self, m)) or calls[-1])
    layer, transposed = forward(70 * 120)                  # N*K reaches the threshold
    assert calls[-1] is (rows > 1)
    _, plain = forward(70 * 120 + 1)
    assert calls[-1] is False
    w, b = layer.blobs[0].data, layer.blobs[1].data
    tolerance = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(transposed, plain, rtol=tolerance, atol=tolerance)
    np.testing.assert_allclose(transposed, x.reshape(rows, -1) @ w.T + b, rtol=tolerance, atol=tolerance)
