"""Pooling's device path (forward_on/backward_on) against its host forward
and backward, on the numpy CPU device and on OpenCL: MAX (with and without
the mask top) and AVE over kernels, strides, pads, Caffe's ceil-mode
overhang, floor rounding and global pooling."""
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


# pooling_param fields, input shape
SETTINGS = [
    ("kernel_size: 2 stride: 2", (2, 3, 6, 8)),
    ("kernel_size: 3 stride: 2", (2, 3, 7, 6)),                          # ceil overhang, no padding
    ("kernel_size: 3 stride: 2 pad: 1", (2, 2, 9, 7)),                   # padded, last window clipped
    ("kernel_size: 3 stride: 1 pad: 2", (1, 2, 5, 4)),
    ("kernel_size: 2 stride: 3", (2, 2, 8, 7)),                          # stride above the kernel
    ("kernel_h: 3 kernel_w: 2 stride_h: 1 stride_w: 2 pad_h: 1 pad_w: 0", (2, 3, 5, 7)),
    ("kernel_size: 3 stride: 2 pad: 1 round_mode: FLOOR", (2, 2, 8, 8)),
    ("global_pooling: true", (2, 3, 5, 4)),
    ("global_pooling: true", (3, 2, 1, 1)),                              # 1 x 1 images
    ("kernel_size: 2 stride: 1 pad: 1", (2, 2, 1, 1)),
]


def inputs(shape, ties=False):
    x = np.random.default_rng(0).standard_normal(shape)
    return np.round(x * 2) / 2 if ties else x       # ties: the first maximum must win on both


@pytest.mark.parametrize("fields, shape", SETTINGS)
@pytest.mark.parametrize("ties", [False, True])
def test_max_pooling_on_device_matches_the_host(device, fields, shape, ties):
    results = run_both_ways(device, f'type: "Pooling" pooling_param {{ pool: MAX {fields} }}',
                            [inputs(shape, ties)])
    assert_close_both_ways(results, 1e-6)


@pytest.mark.parametrize("fields, shape", SETTINGS[:6])
def test_max_pooling_with_the_mask_top(device, fields, shape):
    # the mask top is written by the device, and backward routes by it (Caffe's)
    results = run_both_ways(device, f'type: "Pooling" pooling_param {{ pool: MAX {fields} }}',
                            [inputs(shape, ties=True)], num_tops=2)
    assert_close_both_ways(results, 1e-6)


@pytest.mark.parametrize("fields, shape", SETTINGS)
def test_average_pooling_on_device_matches_the_host(device, fields, shape):
    results = run_both_ways(device, f'type: "Pooling" pooling_param {{ pool: AVE {fields} }}', [inputs(shape)])
    assert_close_both_ways(results, 1e-5)


@pytest.mark.parametrize("pool", ["MAX", "AVE"])
def test_windows_past_the_image_as_caffe(device, pool):
    # ceil mode with no padding: a last window at or past the image's edge (AVE's
    # divisor 0 or negative: NaN or -0, MAX's -FLT_MAX and no gradient), as the host
    for shape in [(1, 2, 4, 5), (1, 2, 5, 5)]:
        results = run_both_ways(device, f'type: "Pooling" pooling_param {{ pool: {pool} kernel_size: 1 stride: '
                                f'{2 if shape[2] == 4 else 3} }}', [inputs(shape)])
        for name, (ours, expected) in results.items():
            np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=1e-6, err_msg=name)


def test_stochastic_and_float64_pooling_stay_on_the_host(device):
    for prototxt, dtype in [('type: "Pooling" pooling_param { pool: STOCHASTIC kernel_size: 2 }', np.float32),
                            ('type: "Pooling" pooling_param { pool: MAX kernel_size: 2 }', np.float64)]:
        layer = make_layer(prototxt, cct.TEST)
        bottom, top = [Blob((1, 1, 4, 4), dtype)], [Blob(dtype=dtype)]
        layer.set_up(bottom, top)
        assert not layer.runs_on(device, bottom, top)


def test_repeated_passes_and_a_reshape(device):
    """The kept mask follows the shape: forward and backward at one shape, then another."""
    prototxt = 'type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 }'
    layers = {"device": make_layer(prototxt), "host": make_layer(prototxt)}
    rng = np.random.default_rng(5)
    for shape in [(2, 3, 9, 9), (1, 3, 5, 6), (2, 3, 9, 9)]:
        x = rng.standard_normal(shape)
        outputs = {}
        for run, layer in layers.items():
            bottom, top = [Blob(shape, np.float32)], [Blob(dtype=np.float32)]
            bottom[0].data[...] = x
            layer.set_up(bottom, top)
            if run == "device":
                layer.forward_on(device, bottom, top)
            else:
                layer.forward(bottom, top)
            top[0].diff[...] = 1.0
            if run == "device":
                layer.backward_on(device, top, [True], bottom)
            else:
                layer.backward(top, [True], bottom)
            outputs[run] = (top[0].data.copy(), bottom[0].diff.copy())
        for ours, expected in zip(outputs["device"], outputs["host"]):
            np.testing.assert_array_equal(ours, expected)


@pytest.mark.parametrize("pool", ["MAX", "AVE"])
def test_an_empty_batch(device, pool):
    results = run_both_ways(device, f'type: "Pooling" pooling_param {{ pool: {pool} kernel_size: 2 }}',
                            [np.zeros((0, 2, 4, 4))])
    assert_close_both_ways(results, 0)
