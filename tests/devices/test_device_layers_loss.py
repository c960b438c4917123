"""Softmax's and SoftmaxWithLoss's device paths (forward_on/backward_on)
against their host forward and backward, on the numpy CPU device and on
OpenCL: every axis, in place, ignore_label, each normalization, the
probability top."""
import numpy as np
import pytest

from cct.core.blob import Blob
from cct.core.errors import DataError
from cct.devices.cpu import CPU
from cct.testing.gradient_check import make_layer
from helpers.devices import OPENCL, assert_close_both_ways, opencl_or_skip, run_both_ways

RNG = np.random.default_rng(5)


@pytest.fixture(params=["cpu", OPENCL])
def device(request):
    return CPU if request.param == "cpu" else opencl_or_skip()


@pytest.mark.parametrize("axis", [1, 0, 2, -1])
@pytest.mark.parametrize("in_place", [False, True])
def test_softmax_on_device_matches_the_host(device, axis, in_place):
    x = RNG.uniform(-4, 4, (2, 5, 3, 7))
    results = run_both_ways(device, f'type: "Softmax" softmax_param {{ axis: {axis} }}', [x], in_place=in_place)
    assert_close_both_ways(results, 1e-5)


def test_softmax_of_large_values_on_device(device):
    x = np.array([[1000.0, 1001.0, 999.0], [-1000.0, -1000.0, -1000.0]])
    results = run_both_ways(device, 'type: "Softmax"', [x])
    assert_close_both_ways(results, 1e-6)


def labels_for(shape, channels, ignore=None):
    labels = RNG.integers(0, channels, shape).astype(float)
    if ignore is not None:
        labels[RNG.random(shape) < 0.3] = ignore
    return labels


def loss_both_ways(device, loss_param, x, labels, axis=1, num_tops=1):
    prototxt = f'type: "SoftmaxWithLoss" softmax_param {{ axis: {axis} }} loss_param {{ {loss_param} }}'
    return run_both_ways(device, prototxt, [x, labels], num_tops=num_tops, propagate_down=[True, False])


@pytest.mark.parametrize("mode", ["FULL", "VALID", "BATCH_SIZE", "NONE"])
@pytest.mark.parametrize("ignore", [None, 2, 255])
def test_softmax_with_loss_on_device_matches_the_host(device, mode, ignore):
    x = RNG.uniform(-3, 3, (4, 6, 3, 5))
    labels = labels_for((4, 1, 3, 5), 6, ignore)
    loss_param = f"normalization: {mode}" + (f" ignore_label: {ignore}" if ignore is not None else "")
    results = loss_both_ways(device, loss_param, x, labels)
    assert_close_both_ways(results, 1e-5)


@pytest.mark.parametrize("normalize", ["true", "false"])
def test_softmax_with_loss_legacy_normalize_on_device(device, normalize):
    x = RNG.uniform(-3, 3, (5, 4, 3))
    results = loss_both_ways(device, f"ignore_label: 0 normalize: {normalize}", x, labels_for((5, 3), 4))
    assert_close_both_ways(results, 1e-5)


@pytest.mark.parametrize("axis, label_shape", [(2, (3, 4, 2)), (-1, (3, 4, 5))])
def test_softmax_with_loss_on_another_axis(device, axis, label_shape):
    x = RNG.uniform(-3, 3, (3, 4, 5, 2))
    labels = labels_for(label_shape, x.shape[axis], ignore=1)
    results = loss_both_ways(device, "ignore_label: 1 normalization: VALID", x, labels, axis=axis)
    assert_close_both_ways(results, 1e-5)


def test_softmax_with_loss_probability_top(device):
    x = RNG.uniform(-3, 3, (6, 10))
    results = loss_both_ways(device, "ignore_label: 3", x, labels_for((6,), 10, 3), num_tops=2)
    assert_close_both_ways(results, 1e-5)


def test_softmax_with_loss_every_label_ignored(device):
    x = RNG.uniform(-3, 3, (3, 4))
    results = loss_both_ways(device, "ignore_label: 2 normalization: VALID", x, np.full(3, 2.0))
    assert_close_both_ways(results, 1e-5)
    assert results["top0"][0] == 0


def test_softmax_with_loss_truncates_fractional_labels(device):
    x = RNG.uniform(-3, 3, (4, 5))
    results = loss_both_ways(device, "", x, np.array([0.5, 1.9, 4.2, 3.0]))
    assert_close_both_ways(results, 1e-5)


@pytest.mark.parametrize("bad", [5.0, -1.0])
def test_softmax_with_loss_refuses_a_bad_label_on_device(device, bad):
    layer = make_layer('type: "SoftmaxWithLoss"')
    bottoms = [Blob((3, 5), np.float32), Blob((3,), np.float32)]
    bottoms[0].data[...] = RNG.standard_normal((3, 5))
    bottoms[1].data[...] = [1, bad, 2]
    tops = [Blob(dtype=np.float32)]
    layer.set_up(bottoms, tops)
    layer.forward_on(device, bottoms, tops)                 # the loss summed on the device, NaN
    with pytest.raises(DataError, match=f"label {int(bad)} is outside"):
        layer.weighted_loss_on(device, tops)                # where the executor reads it
