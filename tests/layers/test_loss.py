"""Softmax and the loss layers (layers/loss.py): gradients, forward against
naive loops, normalization modes, ignore_label, and loss weights in a Net."""
import math

import numpy as np
import pytest

import cct
from cct.core.errors import ConfigError, DataError, ShapeError
from cct.testing.gradient_check import check_layer_gradient, make_layer, setup_layer
from cct.formats.weights import array_to_blob_proto

RNG = np.random.default_rng(9)
FLT_MIN = float(np.finfo(np.float32).tiny)


def run(prototxt, arrays, num_tops=1, top_diff=1.0):
    """Forward then backward (bottom 0 only) with top[0].diff = top_diff."""
    layer = make_layer(prototxt)
    bottoms, tops = setup_layer(layer, arrays, num_tops)
    layer.forward(bottoms, tops)
    tops[0].diff[...] = top_diff
    for top in tops[1:]:
        top.diff[...] = 0
    layer.backward(tops, [True] + [False] * (len(bottoms) - 1), bottoms)
    return layer, bottoms, tops


def labels_for(shape, channels, ignore=None, ignore_fraction=0.3):
    labels = RNG.integers(0, channels, shape).astype(float)
    if ignore is not None:
        labels[RNG.random(shape) < ignore_fraction] = ignore
    return labels


# --- Softmax ------------------------------------------------------------------------
def naive_softmax(x, axis):
    x = np.moveaxis(x, axis, -1)
    out = np.empty_like(x)
    for index in np.ndindex(x.shape[:-1]):
        row = x[index]
        exps = [math.exp(v - max(row)) for v in row]
        out[index] = [e / sum(exps) for e in exps]
    return np.moveaxis(out, -1, axis)


@pytest.mark.parametrize("axis", [1, 0, -1, 2])
def test_softmax_forward_and_gradient(axis):
    x = RNG.uniform(-3, 3, (2, 3, 4))
    layer, _, tops = run(f'type: "Softmax" softmax_param {{ axis: {axis} }}', [x])
    np.testing.assert_allclose(tops[0].data, naive_softmax(x, axis), rtol=1e-12)
    check_layer_gradient(make_layer(f'type: "Softmax" softmax_param {{ axis: {axis} }}'), [x])


def test_softmax_is_stable_for_large_inputs():
    x = np.array([[1000.0, 1001.0, 999.0], [-1000.0, -1000.0, -1000.0]])
    _, _, tops = run('type: "Softmax"', [x])
    np.testing.assert_allclose(tops[0].data, naive_softmax(x, 1), rtol=1e-12)


def test_softmax_in_place():
    x = RNG.uniform(-3, 3, (3, 5))
    layer = make_layer('type: "Softmax"')
    blob = cct.Blob(x.shape, dtype=np.float64)
    blob.data[...] = x
    layer.setup([blob], [blob])
    layer.reshape([blob], [blob])
    layer.forward([blob], [blob])
    np.testing.assert_allclose(blob.data, naive_softmax(x, 1), rtol=1e-12)


# --- SoftmaxWithLoss ------------------------------------------------------------------
def naive_softmax_loss(x, labels, ignore, mode):
    """x (N, C, S), labels (N, S): summed -log p over non-ignored, then normalized."""
    p = naive_softmax(x, 1)
    total, valid = 0.0, 0
    for n in range(x.shape[0]):
        for s in range(x.shape[2]):
            label = int(labels[n, s])
            if label == ignore:
                continue
            total -= math.log(max(p[n, label, s], FLT_MIN))
            valid += 1
    norm = {"FULL": x.shape[0] * x.shape[2], "VALID": valid, "BATCH_SIZE": x.shape[0], "NONE": 1}[mode]
    return total / max(1, norm), p, norm


def naive_softmax_loss_gradient(p, labels, ignore, norm, weight):
    grad = p.copy()
    for n in range(p.shape[0]):
        for s in range(p.shape[2]):
            label = int(labels[n, s])
            if label == ignore:
                grad[n, :, s] = 0
            else:
                grad[n, label, s] -= 1
    return grad * weight / max(1, norm)


@pytest.mark.parametrize("mode", ["FULL", "VALID", "BATCH_SIZE", "NONE"])
@pytest.mark.parametrize("ignore", [None, 2])
def test_softmax_with_loss_matches_naive(mode, ignore):
    x = RNG.uniform(-2, 2, (3, 4, 5))
    labels = labels_for((3, 5), 4, ignore)
    loss_param = f"normalization: {mode}" + (f" ignore_label: {ignore}" if ignore is not None else "")
    _, bottoms, tops = run(f'type: "SoftmaxWithLoss" loss_param {{ {loss_param} }}', [x, labels],
                           num_tops=2, top_diff=1.5)
    expected, p, norm = naive_softmax_loss(x, labels, ignore, mode)
    assert tops[0].shape == ()
    assert float(tops[0].data) == pytest.approx(expected, rel=1e-12)
    np.testing.assert_allclose(tops[1].data, p, rtol=1e-12)
    np.testing.assert_allclose(bottoms[0].diff, naive_softmax_loss_gradient(p, labels, ignore, norm, 1.5),
                               rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("normalize,mode", [("true", "VALID"), ("false", "BATCH_SIZE")])
def test_softmax_with_loss_deprecated_normalize(normalize, mode):
    x = RNG.uniform(-2, 2, (3, 4, 5))
    labels = labels_for((3, 5), 4, 0)
    _, _, tops = run(f'type: "SoftmaxWithLoss" loss_param {{ ignore_label: 0 normalize: {normalize} }}',
                     [x, labels])
    assert float(tops[0].data) == pytest.approx(naive_softmax_loss(x, labels, 0, mode)[0], rel=1e-12)


def test_softmax_with_loss_normalization_wins_over_normalize():
    x = RNG.uniform(-2, 2, (3, 4))
    labels = labels_for((3,), 4)
    _, _, tops = run('type: "SoftmaxWithLoss" loss_param { normalize: false normalization: NONE }', [x, labels])
    assert float(tops[0].data) == pytest.approx(naive_softmax_loss(x[:, :, None], labels[:, None], None,
                                                                   "NONE")[0], rel=1e-12)


def test_softmax_with_loss_all_ignored_is_zero_not_nan():
    x = RNG.uniform(-2, 2, (2, 3))
    _, bottoms, tops = run('type: "SoftmaxWithLoss" loss_param { ignore_label: 1 }', [x, np.ones(2)])
    assert float(tops[0].data) == 0
    assert not bottoms[0].diff.any()


@pytest.mark.parametrize("prototxt,shape,label_shape,ignore", [
    ('type: "SoftmaxWithLoss"', (4, 5), (4,), None),
    ('type: "SoftmaxWithLoss" loss_param { ignore_label: 1 normalization: VALID }', (2, 3, 2, 3), (2, 1, 2, 3), 1),
    ('type: "SoftmaxWithLoss" loss_param { normalization: FULL }', (2, 3, 4), (2, 4), None),
    ('type: "SoftmaxWithLoss" softmax_param { axis: 2 } loss_param { normalization: BATCH_SIZE }',
     (2, 3, 4), (2, 3), None),
    ('type: "SoftmaxWithLoss" loss_param { ignore_label: 0 normalization: NONE }', (3, 4), (3,), 0),
])
def test_softmax_with_loss_gradient(prototxt, shape, label_shape, ignore):
    channels = shape[2] if "axis: 2" in prototxt else shape[1]
    labels = labels_for(label_shape, channels, ignore)
    check_layer_gradient(make_layer(prototxt), [RNG.uniform(-2, 2, shape), labels], check_bottoms=[0])


def test_softmax_with_loss_refuses_label_gradient_and_bad_labels():
    layer = make_layer('type: "SoftmaxWithLoss"')
    bottoms, tops = setup_layer(layer, [RNG.uniform(-1, 1, (2, 3)), np.array([0.0, 1.0])])
    layer.forward(bottoms, tops)
    with pytest.raises(NotImplementedError, match="labels"):
        layer.backward(tops, [True, True], bottoms)
    assert not layer.allow_force_backward(1)
    bottoms[1].data[...] = [0, 3]
    with pytest.raises(DataError, match="label 3"):
        layer.forward(bottoms, tops)


def test_softmax_with_loss_label_count_must_match():
    with pytest.raises(ShapeError, match="number of labels"):
        setup_layer(make_layer('type: "SoftmaxWithLoss"'), [np.zeros((2, 3, 4)), np.zeros((2, 3))])


def test_loss_layers_need_equal_first_dimensions():
    with pytest.raises(ShapeError, match="first dimension"):
        setup_layer(make_layer('type: "EuclideanLoss"'), [np.zeros((2, 3)), np.zeros((3, 2))])


def test_softmax_with_loss_weight_in_a_net():
    net = cct.Net('''name: "t"
        layer { name: "in" type: "Input" top: "x" top: "label"
                input_param { shape { dim: 4 dim: 3 } shape { dim: 4 } } }
        layer { name: "loss" type: "SoftmaxWithLoss" bottom: "x" bottom: "label" top: "loss" loss_weight: 2.5 }
        ''', cct.TRAIN)
    x = RNG.uniform(-1, 1, (4, 3)).astype(np.float32)
    labels = np.array([0, 2, 1, 2], np.float32)
    net.blobs["x"].data[...] = x
    net.blobs["label"].data[...] = labels
    net.forward()
    expected, p, norm = naive_softmax_loss(x[:, :, None].astype(float), labels[:, None], None, "VALID")
    assert net.blobs["loss"].data.shape == ()
    assert float(net.blobs["loss"].data) == pytest.approx(expected, rel=1e-5)
    assert net.forward_backward() == pytest.approx(2.5 * expected, rel=1e-5)
    # Input blobs get no diff unless force_backward; run the layer's backward directly.
    layer = net.layer_dict["loss"]
    layer.backward(net.top_vecs[1], [True, False], net.bottom_vecs[1])
    grad = naive_softmax_loss_gradient(p, labels[:, None], None, norm, 2.5)[:, :, 0]
    np.testing.assert_allclose(net.blobs["x"].diff, grad, rtol=1e-5)


# --- EuclideanLoss --------------------------------------------------------------------
def test_euclidean_loss_forward_and_gradient():
    a, b = RNG.uniform(-1, 1, (3, 4, 2)), RNG.uniform(-1, 1, (3, 8))
    _, _, tops = run('type: "EuclideanLoss"', [a, b])
    total = sum((a.reshape(3, 8)[n, k] - b[n, k]) ** 2 for n in range(3) for k in range(8))
    assert float(tops[0].data) == pytest.approx(total / 3 / 2, rel=1e-12)
    layer = make_layer('type: "EuclideanLoss"')
    check_layer_gradient(layer, [a, b])
    assert layer.allow_force_backward(1)


# --- SigmoidCrossEntropyLoss -----------------------------------------------------------------
def naive_sce(x, t, ignore, mode):
    total, valid = 0.0, 0
    for v, target in zip(x.reshape(-1), t.reshape(-1)):
        if ignore is not None and int(target) == ignore:
            continue
        p = 1 / (1 + math.exp(-v)) if v >= 0 else math.exp(v) / (1 + math.exp(v))
        # clamp keeps log finite where p rounds to 0 or 1 for the extreme inputs
        total -= target * math.log(max(p, 1e-300)) + (1 - target) * math.log(max(1 - p, 1e-300))
        valid += 1
    norm = {"FULL": x.size, "VALID": valid, "BATCH_SIZE": x.shape[0], "NONE": 1}[mode]
    return total / max(1, norm)


@pytest.mark.parametrize("loss_param,mode,ignore", [
    ("", "BATCH_SIZE", None),
    ("normalization: FULL", "FULL", None),
    ("ignore_label: -1 normalization: VALID", "VALID", -1),
    ("ignore_label: -1 normalize: true", "VALID", -1),
    ("ignore_label: -1 normalization: NONE", "NONE", -1),
])
def test_sigmoid_cross_entropy_matches_naive_and_gradient(loss_param, mode, ignore):
    x = RNG.uniform(-4, 4, (3, 2, 4))
    t = RNG.random((3, 8))
    if ignore is not None:
        t[RNG.random(t.shape) < 0.3] = ignore
    prototxt = f'type: "SigmoidCrossEntropyLoss" loss_param {{ {loss_param} }}'
    _, _, tops = run(prototxt, [x, t])
    assert float(tops[0].data) == pytest.approx(naive_sce(x, t, ignore, mode), rel=1e-10)
    check_layer_gradient(make_layer(prototxt), [x, t], check_bottoms=[0])


def test_sigmoid_cross_entropy_is_stable_for_extreme_inputs():
    x = np.array([[200.0, -200.0, 30.0, -30.0]])
    t = np.array([[1.0, 0.0, 0.0, 1.0]])
    _, bottoms, tops = run('type: "SigmoidCrossEntropyLoss"', [x, t])
    assert float(tops[0].data) == pytest.approx(60.0, rel=1e-10)
    assert np.isfinite(bottoms[0].diff).all()


# --- HingeLoss -------------------------------------------------------------------------
def naive_hinge(x, labels, norm):
    total = 0.0
    for n in range(x.shape[0]):
        for k in range(x.shape[1]):
            sign = -1.0 if k == int(labels[n]) else 1.0
            d = max(0.0, 1 + sign * x[n, k])
            total += d if norm == "L1" else d * d
    return total / x.shape[0]


@pytest.mark.parametrize("norm", ["L1", "L2"])
def test_hinge_loss(norm):
    x = RNG.uniform(-3, 3, (4, 5))
    x[np.abs(np.abs(x) - 1) < 0.05] += 0.1        # keep away from the hinge's kink at |x| = 1
    labels = labels_for((4,), 5)
    prototxt = f'type: "HingeLoss" hinge_loss_param {{ norm: {norm} }}'
    _, _, tops = run(prototxt, [x, labels])
    assert float(tops[0].data) == pytest.approx(naive_hinge(x, labels, norm), rel=1e-12)
    check_layer_gradient(make_layer(prototxt), [x, labels], check_bottoms=[0])


# --- MultinomialLogisticLoss -----------------------------------------------------------------
def test_multinomial_logistic_loss():
    p = RNG.uniform(0.05, 1, (4, 5))
    p[0, 2] = 0.0                                   # clamped at 1e-20 before the log
    labels = np.array([2.0, 0.0, 4.0, 1.0])
    _, _, tops = run('type: "MultinomialLogisticLoss"', [p, labels])
    expected = -sum(math.log(max(p[n, int(labels[n])], 1e-20)) for n in range(4)) / 4
    assert float(tops[0].data) == pytest.approx(expected, rel=1e-12)
    p[0, 2] = 0.3
    check_layer_gradient(make_layer('type: "MultinomialLogisticLoss"'), [p, labels], check_bottoms=[0])


# --- InfogainLoss ---------------------------------------------------------------------
def naive_infogain(x, labels, h, ignore=None):
    """x (N, C, S): softmax over C, then -sum_k H[label, k] log p_k, VALID-normalized."""
    p = naive_softmax(x, 1)
    total, valid = 0.0, 0
    for n in range(x.shape[0]):
        for s in range(x.shape[2]):
            label = int(labels[n, s])
            if label == ignore:
                continue
            total -= sum(h[label, k] * math.log(max(p[n, k, s], 1e-20)) for k in range(x.shape[1]))
            valid += 1
    return total / max(1, valid)


def test_infogain_loss_with_matrix_bottom():
    x = RNG.uniform(-2, 2, (3, 4, 2))
    labels = labels_for((3, 2), 4, ignore=3)
    h = RNG.uniform(0, 1, (4, 4))
    prototxt = 'type: "InfogainLoss" loss_param { ignore_label: 3 }'
    _, _, tops = run(prototxt, [x, labels, h], num_tops=2)
    assert float(tops[0].data) == pytest.approx(naive_infogain(x, labels, h, ignore=3), rel=1e-12)
    np.testing.assert_allclose(tops[1].data, naive_softmax(x, 1), rtol=1e-12)
    check_layer_gradient(make_layer(prototxt), [x, labels, h], check_bottoms=[0])


def test_infogain_loss_from_source_file(tmp_path):
    x = RNG.uniform(-2, 2, (5, 3))
    labels = labels_for((5,), 3)
    h = RNG.uniform(0, 1, (1, 1, 3, 3))
    path = tmp_path / "h.binaryproto"
    path.write_bytes(array_to_blob_proto(h.astype(np.float32)).SerializeToString())
    prototxt = f'type: "InfogainLoss" infogain_loss_param {{ source: "{path}" }}'
    _, _, tops = run(prototxt, [x, labels])
    expected = naive_infogain(x[:, :, None], labels[:, None], h.reshape(3, 3).astype(np.float32))
    assert float(tops[0].data) == pytest.approx(expected, rel=1e-6)
    check_layer_gradient(make_layer(prototxt), [x, labels], check_bottoms=[0])


def test_infogain_identity_equals_softmax_with_loss():
    x = RNG.uniform(-2, 2, (2, 3, 4))
    labels = labels_for((2, 4), 3, ignore=1)
    _, info_bottoms, info = run('type: "InfogainLoss" loss_param { ignore_label: 1 }', [x, labels, np.eye(3)])
    _, soft_bottoms, soft = run('type: "SoftmaxWithLoss" loss_param { ignore_label: 1 }', [x, labels])
    assert float(info[0].data) == pytest.approx(float(soft[0].data), rel=1e-12)
    np.testing.assert_allclose(info_bottoms[0].diff, soft_bottoms[0].diff, rtol=1e-10, atol=1e-14)


def test_infogain_loss_axis_and_checks():
    x = RNG.uniform(-2, 2, (2, 3, 4))
    labels = labels_for((2, 3), 4)
    check_layer_gradient(make_layer('type: "InfogainLoss" infogain_loss_param { axis: 2 }'),
                         [x, labels, RNG.uniform(0, 1, (4, 4))], check_bottoms=[0])
    with pytest.raises(ConfigError, match="source"):
        setup_layer(make_layer('type: "InfogainLoss"'), [x, labels])
    with pytest.raises(ConfigError, match="normalize"):
        setup_layer(make_layer('type: "InfogainLoss" loss_param { normalize: true }'), [x, labels, np.eye(4)])
    with pytest.raises(ShapeError, match="infogain matrix"):
        setup_layer(make_layer('type: "InfogainLoss" infogain_loss_param { axis: 2 }'), [x, labels, np.eye(3)])


# --- ContrastiveLoss -----------------------------------------------------------------------
def naive_contrastive(a, b, y, margin, legacy):
    total = 0.0
    for n in range(a.shape[0]):
        d2 = sum((a[n, k] - b[n, k]) ** 2 for k in range(a.shape[1]))
        if int(y[n]):
            total += d2
        elif legacy:
            total += max(margin - d2, 0.0)
        else:
            total += max(margin - math.sqrt(d2), 0.0) ** 2
    return total / a.shape[0] / 2


@pytest.mark.parametrize("legacy", [False, True])
def test_contrastive_loss(legacy):
    a = RNG.uniform(-0.5, 0.5, (6, 3, 1, 1))
    b = RNG.uniform(-0.5, 0.5, (6, 3, 1, 1))
    y = np.array([1, 0, 0, 1, 0, 0], float).reshape(6, 1, 1, 1)
    prototxt = f'type: "ContrastiveLoss" contrastive_loss_param {{ margin: 1.5 legacy_version: {str(legacy).lower()} }}'
    _, _, tops = run(prototxt, [a, b, y])
    expected = naive_contrastive(a.reshape(6, 3), b.reshape(6, 3), y.reshape(6), 1.5, legacy)
    assert float(tops[0].data) == pytest.approx(expected, rel=1e-6)
    # Caffe divides by (d + 1e-4) in the non-legacy gradient, so allow that much error.
    check_layer_gradient(make_layer(prototxt), [a, b, y], check_bottoms=[0, 1], threshold=2e-3)
