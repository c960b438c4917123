"""The solver's update kernels (cct/devices/kernels/update.cl) against the
numpy reference device (cct.devices.cpu), bit for bit: the same float32
operations in the same order (the host solver's, tests/training/
test_device_training.py checks that side); and clip_gradients' sum of squares."""
import numpy as np
import pytest

from helpers.devices import OPENCL, opencl_or_skip, same_op

RNG = np.random.default_rng(5)
# coefficients per rule, as the solvers pass them (cct.training.updates' step_scalars)
COEFFICIENTS = {"SGD": (0.9,), "Nesterov": (0.9, 1.9), "AdaGrad": (1e-8,), "RMSProp": (0.98, 0.02, 1e-8),
                "AdaDelta": (0.95, 0.05, 1e-6), "Adam": (0.9, 0.1, 0.999, 0.001, 1e-8)}


@pytest.fixture(params=[OPENCL])
def opencl():
    return opencl_or_skip()


@pytest.mark.parametrize("regularization", [0, 1, 2])
@pytest.mark.parametrize("rule", sorted(COEFFICIENTS))
def test_a_step_is_its_reference(opencl, rule, regularization):
    count = 1000
    data, diff = RNG.standard_normal(count), RNG.standard_normal(count) * 0.1
    data[:3] = [0.0, -0.0, 1e-30]                        # sign() at zeros, tiny values
    first, second = np.abs(RNG.standard_normal(count)) * 0.01, np.abs(RNG.standard_normal(count)) * 0.01
    pairs = same_op(opencl, lambda device, *buffers: device.solver_step(
        rule, count - 1, *buffers, 0.75, 0.5, regularization, 5e-4, 0.01, COEFFICIENTS[rule]),
        [data, diff, first, second], [0, 1, 2, 3])
    for ours, expected in pairs:
        np.testing.assert_array_equal(ours, expected)
    assert pairs[0][0][-1] == np.float32(data[-1])         # past `count`: untouched


def test_the_sum_of_squares_is_read_as_one_scalar(opencl):
    arrays = [RNG.standard_normal(n).astype(np.float32) for n in (5000, 3, 70_000)]
    buffers = [opencl.empty(a.size) for a in arrays]
    for buffer, array in zip(buffers, arrays):
        opencl.upload(buffer, array)
    moved = dict(opencl.moved.bytes)
    total = opencl.sum_of_squares([(b, a.size - 1) for b, a in zip(buffers, arrays)])
    assert opencl.moved.bytes["down"] - moved["down"] == 4
    expected = sum(float(np.dot(a[:-1].astype(np.float64), a[:-1])) for a in arrays)
    assert abs(total - expected) <= 1e-5 * expected
