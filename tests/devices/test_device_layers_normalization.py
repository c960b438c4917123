"""LRN's and BatchNorm's device paths (forward_on/backward_on) against their
host forward and backward, on the numpy CPU device and on OpenCL; for
BatchNorm also the running statistics each forward leaves in its blobs."""
import numpy as np
import pytest

import cct
from cct.core.blob import Blob
from cct.devices.cpu import CPU
from cct.testing.gradient_check import make_layer
from helpers.devices import OPENCL, assert_close_both_ways, opencl_or_skip, run_both_ways


@pytest.fixture(params=["cpu", OPENCL])
def device(request):
    return CPU if request.param == "cpu" else opencl_or_skip()


# --- LRN -----------------------------------------------------------------------------
@pytest.mark.parametrize("size", [1, 3, 5])
@pytest.mark.parametrize("beta", [0.75, 0.6])
@pytest.mark.parametrize("in_place", [False, True])
def test_lrn_across_channels_on_device_matches_the_host(device, size, beta, in_place):
    x = np.random.default_rng(0).standard_normal((2, 7, 3, 4))
    results = run_both_ways(device, f'type: "LRN" lrn_param {{ local_size: {size} alpha: 0.8 beta: {beta} k: 1.5 }}',
                            [x], in_place=in_place)
    assert_close_both_ways(results, 1e-5)


@pytest.mark.parametrize("size", [3, 5])
@pytest.mark.parametrize("in_place", [False, True])
def test_lrn_within_channel_on_device_matches_the_host(device, size, in_place):
    x = np.random.default_rng(1).standard_normal((2, 3, 6, 5))
    results = run_both_ways(device, f'type: "LRN" lrn_param {{ local_size: {size} alpha: 0.8 beta: 0.75 '
                            'norm_region: WITHIN_CHANNEL }', [x], in_place=in_place)
    assert_close_both_ways(results, 1e-5)


@pytest.mark.parametrize("shape", [(1, 2, 1, 1), (3, 1, 2, 2), (1, 9, 1, 3)])
def test_lrn_on_small_shapes(device, shape):
    x = np.random.default_rng(2).standard_normal(shape)
    for region in ("ACROSS_CHANNELS", "WITHIN_CHANNEL"):
        results = run_both_ways(device, f'type: "LRN" lrn_param {{ local_size: 5 norm_region: {region} }}', [x])
        assert_close_both_ways(results, 1e-5)


# --- BatchNorm -------------------------------------------------------------------------
def run_batch_norm(device, prototxt, x, phase, in_place=False, steps=2, seed=4):
    """BatchNorm twice, host and device, from the same statistics blobs (random,
    factor 2.5): `steps` forward and backward passes, each on new inputs.
    Returns {name: (device value, host value)} for each step's top, bottom
    diff, and the blobs' data and diffs after it."""
    blobs = [np.random.default_rng(seed).standard_normal(x.shape[1] if x.ndim > 1 else 1).astype(np.float32),
             np.abs(np.random.default_rng(seed + 1).standard_normal(x.shape[1] if x.ndim > 1 else 1)),
             np.array([2.5])]
    results = {}
    for run in ("host", "device"):
        rng = np.random.default_rng(seed + 2)
        layer = make_layer(prototxt, phase)
        bottom = [Blob(x.shape, np.float32)]
        top = bottom if in_place else [Blob(dtype=np.float32)]
        bottom[0].data[...] = x
        layer.set_up(bottom, top)
        for blob, values in zip(layer.blobs, blobs):
            blob.data[...] = values
            blob.diff[...] = 0.5
        assert layer.runs_on(device, bottom, top)
        for step in range(steps):
            bottom[0].data[...] = x * (step + 1) + step      # new statistics each step
            (layer.forward if run == "host" else lambda b, t: layer.forward_on(device, b, t))(bottom, top)
            found = {f"top{step}": top[0].data.copy()}
            top[0].diff[...] = rng.standard_normal(x.shape)
            if run == "host":
                layer.backward(top, [True], bottom)
            else:
                layer.backward_on(device, top, [True], bottom)
            found[f"bottom.diff{step}"] = bottom[0].diff.copy()
            for index, blob in enumerate(layer.blobs):
                found[f"blob{index}.data{step}"] = blob.data.copy()
                found[f"blob{index}.diff{step}"] = blob.diff.copy()
            for name, value in found.items():
                results.setdefault(name, []).append(value)
    return {name: (device_value, host_value) for name, (host_value, device_value) in results.items()}


@pytest.mark.parametrize("global_stats", [None, "true", "false"])
@pytest.mark.parametrize("phase", ["TRAIN", "TEST"])
@pytest.mark.parametrize("in_place", [False, True])
def test_batch_norm_on_device_matches_the_host(device, global_stats, phase, in_place):
    fields = "moving_average_fraction: 0.9 eps: 0.001"
    if global_stats is not None:
        fields += f" use_global_stats: {global_stats}"
    x = np.random.default_rng(3).standard_normal((4, 3, 5, 2)).astype(np.float32)
    results = run_batch_norm(device, f'type: "BatchNorm" batch_norm_param {{ {fields} }}', x,
                             getattr(cct, phase), in_place)
    assert_close_both_ways(results, 1e-5)


@pytest.mark.parametrize("shape", [(5, 4), (6,), (1, 3, 1, 1), (2, 1, 3)])
@pytest.mark.parametrize("global_stats", ["true", "false"])
def test_batch_norm_on_other_shapes(device, shape, global_stats):
    # (N, C), (N,): one value per channel per sample; m = 1: no bias correction
    x = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    results = run_batch_norm(device, f'type: "BatchNorm" batch_norm_param {{ use_global_stats: {global_stats} }}',
                             x, cct.TRAIN)
    assert_close_both_ways(results, 1e-5)


def test_batch_norm_with_a_zero_factor(device):
    # global statistics never accumulated: Caffe scales the sums by 0
    x = np.random.default_rng(5).standard_normal((2, 3, 4)).astype(np.float32)
    layer = make_layer('type: "BatchNorm" batch_norm_param { use_global_stats: true }')
    bottom, top = [Blob(x.shape, np.float32)], [Blob(dtype=np.float32)]
    bottom[0].data[...] = x
    layer.set_up(bottom, top)
    for blob in layer.blobs:
        blob.data[...] = 3.0
    layer.blobs[2].data[...] = 0
    layer.forward_on(device, bottom, top)
    np.testing.assert_allclose(top[0].data, x / np.sqrt(np.float32(1e-5)), rtol=1e-6)


@pytest.mark.parametrize("prototxt", ['type: "LRN"', 'type: "LRN" lrn_param { norm_region: WITHIN_CHANNEL }',
                                      'type: "BatchNorm"'])
def test_an_empty_batch(device, prototxt):
    results = run_both_ways(device, prototxt, [np.zeros((0, 3, 4, 4))])
    assert_close_both_ways(results, 0)
