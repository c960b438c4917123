"""Neuron layers' device paths (forward_on/backward_on) against their host
forward and backward, on the numpy CPU device and on OpenCL."""
import numpy as np
import pytest

from cct.devices.cpu import CPU
from helpers.devices import OPENCL, assert_close_both_ways, opencl_or_skip, run_both_ways


@pytest.fixture(params=["cpu", OPENCL])
def device(request):
    return CPU if request.param == "cpu" else opencl_or_skip()


@pytest.mark.parametrize("slope", [0.0, 0.1, -0.5])
@pytest.mark.parametrize("in_place", [False, True])
def test_relu_on_device_matches_the_host(device, slope, in_place):
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 5))
    results = run_both_ways(device, f'type: "ReLU" relu_param {{ negative_slope: {slope} }}', [x],
                            in_place=in_place)
    assert_close_both_ways(results, 0)
