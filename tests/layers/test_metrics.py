"""Accuracy and ArgMax (layers/metrics.py) against naive loops, Caffe's tie
rules, ignore_label, and their refusal to backpropagate."""
from functools import partial

import numpy as np
import pytest

import cct
from cct.core.errors import ConfigError, DataError
from helpers.layers import run_layer

RNG = np.random.default_rng(13)


forward = partial(run_layer, phase=cct.TEST)        # as in a TEST net, where metrics run


# --- Accuracy ---------------------------------------------------------------------------
def naive_accuracy(scores, labels, top_k, ignore=None):
    """scores (N, C, S), labels (N, S). Caffe master's rule: correct when fewer than
    top_k other classes score at least as high as the true class."""
    channels = scores.shape[1]
    correct = count = 0
    per_class_seen, per_class_right = [0] * channels, [0] * channels
    for n in range(scores.shape[0]):
        for s in range(scores.shape[2]):
            label = int(labels[n, s])
            if label == ignore:
                continue
            true = scores[n, label, s]
            rivals = sum(1 for k in range(channels) if k != label and scores[n, k, s] >= true)
            per_class_seen[label] += 1
            if rivals < top_k:
                correct += 1
                per_class_right[label] += 1
            count += 1
    per_class = [r / s if s else 0.0 for r, s in zip(per_class_right, per_class_seen)]
    return (correct / count if count else 0.0), np.array(per_class)


@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("ignore", [None, 3])
def test_accuracy_matches_naive(top_k, ignore):
    # Rounded scores make ties common, exercising the tie rule.
    scores = np.round(RNG.uniform(0, 1, (6, 5, 3)), 1)
    labels = RNG.integers(0, 5, (6, 3)).astype(float)
    param = f"top_k: {top_k}" + (f" ignore_label: {ignore}" if ignore is not None else "")
    _, _, tops = forward(f'type: "Accuracy" accuracy_param {{ {param} }}', [scores, labels], num_tops=2)
    expected, per_class = naive_accuracy(scores, labels, top_k, ignore)
    assert tops[0].shape == () and tops[1].shape == (5,)
    assert float(tops[0].data) == pytest.approx(expected)
    np.testing.assert_allclose(tops[1].data, per_class)


def test_accuracy_ties_count_against_the_true_class():
    scores = np.array([[0.5, 0.5, 0.1], [0.2, 0.7, 0.7], [0.9, 0.1, 0.1]])
    labels = np.array([0.0, 2.0, 0.0])
    _, _, top1 = forward('type: "Accuracy"', [scores, labels])
    assert float(top1[0].data) == pytest.approx(1 / 3)          # only the untied row
    _, _, top2 = forward('type: "Accuracy" accuracy_param { top_k: 2 }', [scores, labels])
    assert float(top2[0].data) == pytest.approx(1.0)


def test_accuracy_axis():
    scores = RNG.uniform(0, 1, (2, 3, 4))
    labels = RNG.integers(0, 4, (2, 3)).astype(float)
    _, _, tops = forward('type: "Accuracy" accuracy_param { axis: -1 }', [scores, labels])
    expected, _ = naive_accuracy(scores.reshape(6, 4, 1), labels.reshape(6, 1), 1)
    assert float(tops[0].data) == pytest.approx(expected)


def test_accuracy_all_ignored_is_zero():
    _, _, tops = forward('type: "Accuracy" accuracy_param { ignore_label: 1 }',
                         [RNG.uniform(0, 1, (3, 4)), np.ones(3)], num_tops=2)
    assert float(tops[0].data) == 0 and not tops[1].data.any()


def test_accuracy_checks():
    with pytest.raises(ConfigError, match="top_k"):
        forward('type: "Accuracy" accuracy_param { top_k: 5 }', [np.zeros((2, 4)), np.zeros(2)])
    with pytest.raises(cct.ShapeError, match="number of labels"):
        forward('type: "Accuracy"', [np.zeros((2, 4, 3)), np.zeros(2)])
    with pytest.raises(DataError, match="label 7"):
        forward('type: "Accuracy"', [np.zeros((2, 4)), np.array([1.0, 7.0])])


@pytest.mark.parametrize("prototxt,arrays", [
    ('type: "Accuracy"', [np.zeros((2, 3)), np.zeros(2)]),
    ('type: "ArgMax"', [np.zeros((2, 3))]),
])
def test_no_backward(prototxt, arrays):
    layer, bottoms, tops = forward(prototxt, arrays)
    layer.backward(tops, [False] * len(bottoms), bottoms)
    with pytest.raises(NotImplementedError, match="no backward"):
        layer.backward(tops, [True] + [False] * (len(bottoms) - 1), bottoms)
    assert not any(layer.allow_force_backward(i) for i in range(len(bottoms)))


def test_accuracy_in_a_net_with_force_backward():
    net = cct.Net('''name: "t" force_backward: true
        layer { name: "in" type: "Input" top: "x" top: "label"
                input_param { shape { dim: 4 dim: 3 } shape { dim: 4 } } }
        layer { name: "loss" type: "SoftmaxWithLoss" bottom: "x" bottom: "label" top: "loss" }
        layer { name: "acc" type: "Accuracy" bottom: "x" bottom: "label" top: "acc" }''', cct.TRAIN)
    net.blobs["x"].data[...] = [[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 0, 0]]
    net.blobs["label"].data[...] = [0, 1, 1, 0]
    net.forward()
    assert float(net.blobs["acc"].data) == pytest.approx(0.75)
    net.backward()                          # Accuracy is not asked for a gradient
    assert np.abs(net.blobs["x"].diff).max() > 0


# --- ArgMax -----------------------------------------------------------------------------
def naive_top_k(row, k):
    """(indices, values) of the k largest, ties to the higher index (Caffe's pair sort)."""
    order = sorted(range(len(row)), key=lambda j: (row[j], j), reverse=True)[:k]
    return order, [row[j] for j in order]


@pytest.mark.parametrize("top_k", [1, 3])
@pytest.mark.parametrize("out_max_val", [False, True])
def test_argmax_flattened(top_k, out_max_val):
    x = np.round(RNG.uniform(0, 1, (3, 2, 2, 2)), 1)      # ties are common
    _, _, tops = forward(f'type: "ArgMax" argmax_param {{ top_k: {top_k} out_max_val: {str(out_max_val).lower()} }}',
                         [x])
    assert tops[0].shape == (3, 2 if out_max_val else 1, top_k, 1)
    for n in range(3):
        indices, values = naive_top_k(list(x[n].reshape(-1)), top_k)
        np.testing.assert_array_equal(tops[0].data[n, 0, :, 0], indices)
        if out_max_val:
            np.testing.assert_array_equal(tops[0].data[n, 1, :, 0], values)


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
@pytest.mark.parametrize("out_max_val", [False, True])
def test_argmax_along_axis(axis, out_max_val):
    x = np.round(RNG.uniform(0, 1, (3, 4, 5)), 1)
    top_k = 2
    _, _, tops = forward(f'type: "ArgMax" argmax_param {{ axis: {axis} top_k: {top_k} '
                         f'out_max_val: {str(out_max_val).lower()} }}', [x])
    moved = np.moveaxis(x, axis, -1)
    expected = np.empty(moved.shape[:-1] + (top_k,))
    for index in np.ndindex(moved.shape[:-1]):
        indices, values = naive_top_k(list(moved[index]), top_k)
        expected[index] = values if out_max_val else indices
    np.testing.assert_array_equal(tops[0].data, np.moveaxis(expected, -1, axis))


def test_argmax_2d_bottom_gets_three_axes():
    _, _, tops = forward('type: "ArgMax"', [np.array([[0.1, 0.9, 0.3], [0.5, 0.2, 0.5]])])
    assert tops[0].shape == (2, 1, 1)
    np.testing.assert_array_equal(tops[0].data.reshape(-1), [1, 2])


def test_argmax_checks():
    with pytest.raises(ConfigError, match="top_k"):
        forward('type: "ArgMax" argmax_param { top_k: 7 }', [np.zeros((2, 3, 2))])
    with pytest.raises(ConfigError, match="top_k"):
        forward('type: "ArgMax" argmax_param { axis: 1 top_k: 4 }', [np.zeros((2, 3, 2))])
    with pytest.raises(ConfigError, match="top_k"):
        forward('type: "ArgMax" argmax_param { top_k: 0 }', [np.zeros((2, 3))])
