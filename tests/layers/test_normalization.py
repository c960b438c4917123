"""LRN, MVN and BatchNorm: gradients, forward against naive loops, Caffe's
parameter checks and BatchNorm's running statistics."""
import warnings

import numpy as np
import pytest

import cct
from cct.layers.normalization import LRN
from cct.core.blob import Blob
from cct.core.errors import ConfigError, ShapeError
from cct.testing.gradient_check import check_layer_gradient, make_layer, setup_layer
from helpers.layers import run_layer
from helpers.nets import run_net_text


def f32(value):
    """A prototxt float as the layer sees it (float32 fields)."""
    return float(np.float32(value))


def random(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


# --- naive references -------------------------------------------------------------
def naive_lrn_across(x, size, alpha, beta, k):
    n, c, h, w = x.shape
    out = np.empty_like(x)
    half = (size - 1) // 2
    for i in range(n):
        for ch in range(c):
            total = np.zeros((h, w))
            for other in range(max(0, ch - half), min(c, ch + half + 1)):
                total += x[i, other] ** 2
            out[i, ch] = x[i, ch] / (k + alpha / size * total) ** beta
    return out


def naive_lrn_within(x, size, alpha, beta):
    n, c, h, w = x.shape
    half = (size - 1) // 2
    out = np.empty_like(x)
    for i in range(n):
        for ch in range(c):
            for r in range(h):
                for col in range(w):
                    window = x[i, ch, max(0, r - half):r + half + 1, max(0, col - half):col + half + 1]
                    average = (window ** 2).sum() / size ** 2    # zero padding counts
                    out[i, ch, r, col] = x[i, ch, r, col] / (1 + alpha * average) ** beta
    return out


def naive_mvn(x, normalize_variance, across_channels, eps):
    out = np.empty_like(x)
    groups = [(i,) for i in range(x.shape[0])] if across_channels else \
        [(i, c) for i in range(x.shape[0]) for c in range(x.shape[1])]
    for g in groups:
        values = x[g]
        centred = values - values.mean()
        if normalize_variance:
            centred = centred / (np.sqrt((centred ** 2).mean()) + eps)
        out[g] = centred
    return out


def naive_batch_norm(x, mean, variance, eps):
    shape = (1, -1) + (1,) * (x.ndim - 2)
    return (x - mean.reshape(shape)) / np.sqrt(variance.reshape(shape) + eps)


# --- LRN --------------------------------------------------------------------------
LRN_ACROSS = [(3, 1.0, 0.75, 1.0), (5, 0.5, 0.75, 2.0), (1, 2.0, 0.5, 1.0), (7, 1e-2, 1.5, 0.5)]


@pytest.mark.parametrize("size,alpha,beta,k", LRN_ACROSS)
def test_lrn_across_forward_matches_naive(size, alpha, beta, k):
    x = random((2, 6, 3, 4))
    _, _, tops = run_layer(f'type: "LRN" lrn_param {{ local_size: {size} alpha: {alpha} '
                           f'beta: {beta} k: {k} }}', [x])
    np.testing.assert_allclose(tops[0].data, naive_lrn_across(x, size, f32(alpha), f32(beta), f32(k)), rtol=1e-10)


@pytest.mark.parametrize("size,alpha,beta,k", LRN_ACROSS)
def test_lrn_across_gradient(size, alpha, beta, k):
    layer = make_layer(f'type: "LRN" lrn_param {{ local_size: {size} alpha: {alpha} beta: {beta} k: {k} }}')
    check_layer_gradient(layer, [random((2, 6, 3, 3), seed=1)])


@pytest.mark.parametrize("size,alpha,beta", [(3, 0.5, 0.75), (5, 1.0, 0.75), (1, 2.0, 1.5)])
def test_lrn_within_forward_matches_naive(size, alpha, beta):
    x = random((2, 2, 5, 6))
    _, _, tops = run_layer(f'type: "LRN" lrn_param {{ local_size: {size} alpha: {alpha} beta: {beta} '
                           'norm_region: WITHIN_CHANNEL k: 7 }', [x])   # k is not used within a channel
    np.testing.assert_allclose(tops[0].data, naive_lrn_within(x, size, f32(alpha), f32(beta)), rtol=1e-10)


@pytest.mark.parametrize("size,alpha,beta", [(3, 0.5, 0.75), (5, 2.0, 0.75)])
def test_lrn_within_gradient(size, alpha, beta):
    layer = make_layer(f'type: "LRN" lrn_param {{ local_size: {size} alpha: {alpha} beta: {beta} '
                       'norm_region: WITHIN_CHANNEL }')
    check_layer_gradient(layer, [random((2, 2, 4, 5), seed=2)])


@pytest.mark.parametrize("size", [1, 3, 5, 9])
def test_lrn_across_sums_in_caffes_order(size):
    """The scale and backward's window sum in the steps of Caffe's
    CrossChannelForward_cpu / Backward_cpu (padded squares, caffe_axpy from
    k, the head added and the tail subtracted), emulated here one float32
    operation at a time: bit for bit (local sizes past the channel count too)."""
    from cct.layers.normalization import _caffe_scales, _caffe_window
    x = random((2, 7, 3, 2), seed=9).astype(np.float32) * 3
    a, k = np.float32(0.7 / size), np.float32(2)
    n, channels, pre_pad = x.shape[0], x.shape[1], (size - 1) // 2
    padded = np.zeros((n, channels + size - 1) + x.shape[2:], np.float32)
    padded[:, pre_pad:pre_pad + channels] = x * x
    want = np.empty_like(x)
    want[:, 0] = k
    for c in range(size):
        want[:, 0] = a * padded[:, c] + want[:, 0]
    for c in range(1, channels):
        want[:, c] = a * padded[:, c + size - 1] + want[:, c - 1]
        want[:, c] = -a * padded[:, c - 1] + want[:, c]
    got = _caffe_scales(x * x, pre_pad, a, k, np.empty_like(x))
    np.testing.assert_array_equal(got, want)
    ratio = random(x.shape, seed=10).astype(np.float32)
    padded_ratio = np.zeros_like(padded)
    padded_ratio[:, size - (size + 1) // 2:size - (size + 1) // 2 + channels] = ratio
    accum, window = np.zeros_like(x[:, 0]), np.empty_like(x)
    for c in range(size - 1):
        accum = accum + padded_ratio[:, c]
    for c in range(channels):
        accum = accum + padded_ratio[:, c + size - 1]
        window[:, c] = accum
        accum = accum - padded_ratio[:, c]
    np.testing.assert_array_equal(_caffe_window(ratio, pre_pad, np.empty_like(x)), window)


def test_lrn_rejects_even_local_size():
    with pytest.raises(ConfigError, match="lrn_param.local_size.*odd"):
        setup_layer(make_layer('type: "LRN" lrn_param { local_size: 4 }'), [random((1, 4, 2, 2))])


def test_lrn_needs_four_axes():
    with pytest.raises(ShapeError, match="4 axes"):
        setup_layer(make_layer('type: "LRN"'), [random((2, 4, 3))])


# --- MVN --------------------------------------------------------------------------
MVN_SETTINGS = [(True, False), (True, True), (False, False), (False, True)]


@pytest.mark.parametrize("normalize_variance,across_channels", MVN_SETTINGS)
def test_mvn_forward_matches_naive(normalize_variance, across_channels):
    x = random((2, 3, 4, 5)) * 3 + 1
    text = (f'type: "MVN" mvn_param {{ normalize_variance: {str(normalize_variance).lower()} '
            f'across_channels: {str(across_channels).lower()} eps: 0.01 }}')
    _, _, tops = run_layer(text, [x])
    np.testing.assert_allclose(tops[0].data, naive_mvn(x, normalize_variance, across_channels, f32(0.01)),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("normalize_variance,across_channels", MVN_SETTINGS)
def test_mvn_gradient(normalize_variance, across_channels):
    # Caffe's backward treats the std + eps as the std; exact only as eps -> 0
    text = (f'type: "MVN" mvn_param {{ normalize_variance: {str(normalize_variance).lower()} '
            f'across_channels: {str(across_channels).lower()} eps: 1e-12 }}')
    check_layer_gradient(make_layer(text), [random((2, 3, 3, 3), seed=5)])


def test_mvn_eps_is_added_to_the_std():
    x = np.array([[[[1.0, 3.0]]]])          # std 1
    _, _, tops = run_layer('type: "MVN" mvn_param { eps: 1 }', [x])
    np.testing.assert_allclose(tops[0].data.ravel(), [-0.5, 0.5])


def test_mvn_reshapes_top_to_four_axes_as_caffe():
    _, _, tops = run_layer('type: "MVN"', [random((3, 4))])
    assert tops[0].shape == (3, 4, 1, 1)


# --- BatchNorm --------------------------------------------------------------------
def test_batch_norm_train_forward_and_running_stats():
    x = random((4, 3, 2, 5)) * 2 + 0.5
    layer, bottoms, tops = run_layer('type: "BatchNorm" batch_norm_param { moving_average_fraction: 0.9 }', [x])
    mean = x.mean(axis=(0, 2, 3))
    variance = x.var(axis=(0, 2, 3))
    np.testing.assert_allclose(tops[0].data, naive_batch_norm(x, mean, variance, f32(1e-5)), rtol=1e-8)
    m = x.size / 3
    np.testing.assert_allclose(layer.blobs[0].data, mean)
    np.testing.assert_allclose(layer.blobs[1].data, variance * m / (m - 1))
    np.testing.assert_allclose(layer.blobs[2].data, [1.0])
    # A second pass decays the sums by moving_average_fraction.
    x2 = random((4, 3, 2, 5), seed=9)
    bottoms[0].data[...] = x2
    layer.forward(bottoms, tops)
    np.testing.assert_allclose(layer.blobs[0].data, f32(0.9) * mean + x2.mean(axis=(0, 2, 3)))
    np.testing.assert_allclose(layer.blobs[1].data, f32(0.9) * variance * m / (m - 1) + x2.var(axis=(0, 2, 3)) * m / (m - 1))
    np.testing.assert_allclose(layer.blobs[2].data, [f32(0.9) + 1])


def test_batch_norm_global_stats_divide_by_scale_factor():
    x = random((2, 3, 4))
    layer = make_layer('type: "BatchNorm" batch_norm_param { eps: 0.001 }', cct.TEST)
    bottoms, tops = setup_layer(layer, [x])
    layer.blobs[0].data[...] = [2.0, -4.0, 8.0]
    layer.blobs[1].data[...] = [4.0, 8.0, 0.0]
    layer.blobs[2].data[...] = 4.0
    layer.forward(bottoms, tops)
    expected = naive_batch_norm(x, np.array([0.5, -1.0, 2.0]), np.array([1.0, 2.0, 0.0]), f32(0.001))
    np.testing.assert_allclose(tops[0].data, expected, rtol=1e-10)
    assert layer.blobs[2].data[0] == 4.0       # global stats leave the blobs alone


def test_batch_norm_zero_scale_factor_means_zero_statistics():
    x = random((2, 3))
    layer = make_layer('type: "BatchNorm" batch_norm_param { use_global_stats: true eps: 0.25 }')
    bottoms, tops = setup_layer(layer, [x])
    layer.blobs[0].data[...] = 5.0
    layer.forward(bottoms, tops)
    np.testing.assert_allclose(tops[0].data, x / 0.5)


@pytest.mark.parametrize("shape", [(4, 3, 2, 3), (5, 2), (3, 2, 4)])
def test_batch_norm_train_gradient(shape):
    check_layer_gradient(make_layer('type: "BatchNorm"'), [random(shape, seed=6)], check_params=False)


def test_batch_norm_global_gradient():
    layer = make_layer('type: "BatchNorm" batch_norm_param { use_global_stats: true }')
    x = random((3, 2, 2, 2), seed=7)
    setup_layer(layer, [x])
    layer.blobs[0].data[...] = [1.0, -1.0]
    layer.blobs[1].data[...] = [2.0, 3.0]
    layer.blobs[2].data[...] = 2.0            # setup again (in the checker) keeps existing blobs
    # Caffe computes no gradient for the statistics, so only the bottom is checked.
    check_layer_gradient(layer, [x], check_params=False)


def test_batch_norm_use_global_stats_defaults_to_test_phase():
    layer = make_layer('type: "BatchNorm"', cct.TEST)
    setup_layer(layer, [random((2, 3))])
    assert layer.use_global_stats
    layer = make_layer('type: "BatchNorm"', cct.TRAIN)
    setup_layer(layer, [random((2, 3))])
    assert not layer.use_global_stats


def test_batch_norm_adds_fixed_param_specs():
    layer = make_layer('type: "BatchNorm" param { lr_mult: 0 decay_mult: 0 }')
    setup_layer(layer, [random((2, 3))])
    assert [p.lr_mult for p in layer.layer_param.param] == [0, 0, 0]
    assert [b.shape for b in layer.blobs] == [(3,), (3,), (1,)]


def test_batch_norm_rejects_learned_statistics():
    layer = make_layer('type: "BatchNorm" param { lr_mult: 0 } param { lr_mult: 1 }')
    with pytest.raises(ConfigError, match=r"param\[1\]\.lr_mult"):
        setup_layer(layer, [random((2, 3))])


def test_batch_norm_of_a_blob_without_axes_is_a_clean_error():
    """Found by the fuzzer (issue 15): an Input without a shape gives a blob
    of shape (), whose channel axis BatchNorm indexed (IndexError)."""
    net_text = """layer { name: "data" type: "Input" top: "data" }
    layer { name: "l" type: "BatchNorm" bottom: "data" top: "out" }"""
    with pytest.raises(ShapeError, match=r"layer 'l' \(BatchNorm\): bottom 'data' has no axes"):
        cct.Net(net_text, cct.TEST)


def test_batch_norm_of_an_empty_batch_runs():
    """Found by the fuzzer: a batch of 0 failed in numpy's reshape(0, C, -1)."""
    net_text = """force_backward: true
    layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 0 dim: 3 dim: 4 dim: 4 } } }
    layer { name: "l" type: "BatchNorm" bottom: "data" top: "out" }"""
    assert run_net_text(net_text, cct.TEST).blobs["out"].shape == (0, 3, 4, 4)


@pytest.mark.parametrize("shape", ["", "shape { dim: 2 dim: 0 dim: 0 dim: 0 }", "shape { dim: 0 dim: 3 }"])
def test_mvn_of_an_empty_or_axisless_blob_runs(shape):
    """Found by the fuzzer: MVN indexed the channel axis of a blob of shape ()
    (IndexError) and reshaped an empty one with -1 (ValueError); Caffe views
    both as 4-d (its legacy shape) and runs."""
    net_text = f"""force_backward: true
    layer {{ name: "data" type: "Input" top: "data" input_param {{ {shape} }} }}
    layer {{ name: "l" type: "MVN" bottom: "data" top: "out" }}"""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)     # numpy's "mean of empty slice", as Caffe's NaN
        net = run_net_text(net_text, cct.TRAIN)
    assert net.blobs["out"].shape == (net.blobs["data"].shape + (1, 1, 1, 1))[:4]


def test_batch_norm_channel_mismatch_on_reshape():
    layer = make_layer('type: "BatchNorm"')
    bottoms, tops = setup_layer(layer, [random((2, 3))])
    bottoms[0].reshape(2, 4)
    with pytest.raises(ShapeError, match="4 channels"):
        layer.reshape(bottoms, tops)


# --- in place -------------------------------------------------------------------------
@pytest.mark.parametrize("text,phase", [
    ('type: "LRN" lrn_param { local_size: 3 alpha: 0.7 }', cct.TRAIN),
    ('type: "LRN" lrn_param { local_size: 3 alpha: 0.7 norm_region: WITHIN_CHANNEL }', cct.TRAIN),
    ('type: "MVN"', cct.TRAIN),
    ('type: "MVN" mvn_param { across_channels: true normalize_variance: false }', cct.TRAIN),
    ('type: "BatchNorm"', cct.TRAIN),
    ('type: "BatchNorm"', cct.TEST),
])
def test_in_place_matches_out_of_place(text, phase):
    x = random((2, 5, 4, 4), seed=3)
    g = random((2, 5, 4, 4), seed=4)
    layer, bottoms, tops = run_layer(text, [x], phase=phase)
    tops[0].diff[...] = g
    layer.backward(tops, [True], bottoms)

    in_place = make_layer(text, phase)
    blob = Blob(x.shape, np.float64)
    blob.data[...] = x
    in_place.setup([blob], [blob])
    in_place.reshape([blob], [blob])
    in_place.forward([blob], [blob])
    np.testing.assert_allclose(blob.data, tops[0].data)
    blob.diff[...] = g
    in_place.backward([blob], [True], [blob])
    np.testing.assert_allclose(blob.diff, bottoms[0].diff)


# --- batch chunks ---------------------------------------------------------------------
def lrn_forward_backward(text, x, g, in_place=False):
    layer = make_layer(text)
    if in_place:
        blob = Blob(x.shape, x.dtype)
        blob.data[...] = x
        bottoms = tops = [blob]
        layer.setup(bottoms, tops)
        layer.reshape(bottoms, tops)
    else:
        bottoms, tops = setup_layer(layer, [x], dtype=x.dtype)
    layer.forward(bottoms, tops)
    y = tops[0].data.copy()
    tops[0].diff[...] = g
    layer.backward(tops, [True], bottoms)
    return y, bottoms[0].diff.copy()


@pytest.mark.parametrize("text", [
    'type: "LRN" lrn_param { local_size: 5 alpha: 0.7 beta: 0.75 k: 2 }',       # the square-root power
    'type: "LRN" lrn_param { local_size: 3 alpha: 0.7 beta: 0.6 }',
    'type: "LRN" lrn_param { local_size: 3 alpha: 0.7 norm_region: WITHIN_CHANNEL }',
])
@pytest.mark.parametrize("in_place", [False, True])
def test_lrn_batch_chunks_give_the_unchunked_numbers(monkeypatch, text, in_place):
    """CHUNK_ELEMENTS below one image: every image is its own chunk, and the
    scale backward recomputes per chunk equals the forward's."""
    x, g = random((5, 6, 4, 4), seed=5), random((5, 6, 4, 4), seed=6)
    whole = lrn_forward_backward(text, x, g, in_place)
    monkeypatch.setattr("cct.layers.normalization.CHUNK_ELEMENTS", 10)
    chunked = lrn_forward_backward(text, x, g, in_place)
    for ours, theirs in zip(chunked, whole):
        np.testing.assert_array_equal(ours, theirs)


def test_lrn_keeps_no_blob_sized_scale():
    """s is recomputed in backward: forward leaves nothing of the blob's size
    behind when not in place."""
    layer, _, _ = run_layer('type: "LRN" lrn_param { local_size: 3 }', [random((4, 6, 5, 5))])
    kept = [value for value in vars(layer).values() if isinstance(value, np.ndarray) and value.size >= 4 * 6 * 25]
    assert not kept and not hasattr(layer, "scale")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("size", [1, 3, 5, 9])
def test_lrn_compiled_pass_equals_the_numpy_passes(monkeypatch, dtype, in_place, size):
    """ACROSS_CHANNELS with beta 0.75 runs compiled (one pass per image); it
    gives bitwise the numbers of the chunked numpy passes, in place too (local
    sizes past the channel count included)."""
    text = f'type: "LRN" lrn_param {{ local_size: {size} alpha: 0.7 beta: 0.75 k: 2 }}'
    x, g = random((3, 7, 5, 4), seed=7).astype(dtype), random((3, 7, 5, 4), seed=8).astype(dtype)
    calls = []
    real = LRN._compiled
    monkeypatch.setattr(LRN, "_compiled", lambda self, x: calls.append(1) or real(self, x))
    compiled = lrn_forward_backward(text, x, g, in_place)
    assert len(calls) == 2                                  # forward and backward asked
    monkeypatch.setattr(LRN, "_compiled", lambda self, x: False)
    numpy_passes = lrn_forward_backward(text, x, g, in_place)
    for ours, theirs in zip(compiled, numpy_passes):
        assert ours.dtype == dtype
        np.testing.assert_array_equal(ours, theirs)
