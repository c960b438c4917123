"""Eltwise's, Scale's, Bias's and Dropout's device paths against their host
forward and backward, on the numpy CPU device and on OpenCL: each
operation, two and three bottoms, in place, a given or a learned operand
at several axes, the parameters' gradients."""
import numpy as np
import pytest

import cct
from cct.devices.cpu import CPU
from helpers.devices import OPENCL, assert_close_both_ways, opencl_or_skip, run_both_ways

RNG = np.random.default_rng(7)
SHAPE = (2, 3, 4, 5)


@pytest.fixture(params=["cpu", OPENCL])
def device(request):
    return CPU if request.param == "cpu" else opencl_or_skip()


def bottoms(count, shape=SHAPE, ties=False):
    arrays = [RNG.standard_normal(shape) for _ in range(count)]
    if ties:                                    # equal values: MAX's tie rule decides the gradient
        arrays = [np.round(a) for a in arrays]
    return arrays


# --- Eltwise -------------------------------------------------------------------------
@pytest.mark.parametrize("param", [
    "operation: SUM",
    "operation: SUM coeff: 1 coeff: -0.5 coeff: 2",
    "operation: PROD",
    "operation: PROD stable_prod_grad: false",
    "operation: MAX",
])
@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize("in_place", [None, 0, 1])
def test_eltwise_on_device_matches_the_host(device, param, count, in_place):
    if "coeff" in param and count == 2:
        param = "operation: SUM coeff: 0.5 coeff: -2"
    arrays = bottoms(count, ties="MAX" in param)
    if "stable_prod_grad: false" in param:
        arrays = [a + np.sign(a) * 0.5 for a in arrays]        # away from 0: top / bottom is well defined
    results = run_both_ways(device, f'type: "Eltwise" eltwise_param {{ {param} }}', arrays,
                            in_place=in_place is not None, in_place_bottom=in_place or 0)
    assert_close_both_ways(results, 1e-5)


def test_eltwise_without_some_gradients(device):
    results = run_both_ways(device, 'type: "Eltwise" eltwise_param { operation: MAX }', bottoms(3),
                            propagate_down=[False, True, False])
    assert_close_both_ways(results, 0)


# --- Scale and Bias ------------------------------------------------------------------
def scale_cases(layer_type):
    section = "scale_param" if layer_type == "Scale" else "bias_param"
    bias = " bias_term: true" if layer_type == "Scale" else ""
    filler = ("filler { type: 'gaussian' std: 1 }" if layer_type == "Scale"
              else "filler { type: 'gaussian' std: 1 }")
    return [
        # (prototxt, operand shape: a second bottom, or None: learned)
        (f'type: "{layer_type}" {section} {{ {filler}{bias} }}', None),                     # ResNet's form
        (f'type: "{layer_type}" {section} {{ {filler} }}', None),
        (f'type: "{layer_type}" {section} {{ axis: 2 num_axes: 2 {filler}{bias} }}', None),
        (f'type: "{layer_type}" {section} {{ axis: 0 num_axes: -1 {filler} }}', None),
        (f'type: "{layer_type}" {section} {{ num_axes: 0 {filler}{bias} }}', None),         # one value
        (f'type: "{layer_type}" {section} {{ axis: -1 {filler} }}', None),
        (f'type: "{layer_type}" {section} {{ {bias} }}', (3,)),
        (f'type: "{layer_type}" {section} {{ axis: 1 }}', (3, 4)),
        (f'type: "{layer_type}" {section} {{ axis: 0 {bias} }}', SHAPE[:1]),
        (f'type: "{layer_type}" {section} {{ axis: 2 }}', (4, 5)),
        (f'type: "{layer_type}" {section} {{ }}', ()),                                       # a 0-d operand
    ]


@pytest.mark.parametrize("layer_type", ["Scale", "Bias"])
@pytest.mark.parametrize("case", range(11))
@pytest.mark.parametrize("in_place", [False, True])
def test_scale_and_bias_on_device_match_the_host(device, layer_type, case, in_place):
    prototxt, operand = scale_cases(layer_type)[case]
    rng = np.random.default_rng([case, in_place, layer_type == "Scale"])    # the same data in any test order
    arrays = [rng.standard_normal(SHAPE)]
    if operand is not None:
        arrays.append(rng.standard_normal(operand))
    results = run_both_ways(device, prototxt, arrays, in_place=in_place)
    summed = {}
    if "num_axes: 0" in prototxt:
        # one value: its gradient sums all N*C*H*W products x * dy, which mostly
        # cancel, in another order on the device; a float32 sum of n such terms
        # in any order is within n * eps (terms of about 1) of another order's
        summed = {"param0.diff": results["param0.diff"]}
        ours, reference = summed["param0.diff"]
        assert abs(float(ours) - float(reference)) <= np.prod(SHAPE) * np.finfo(np.float32).eps
    assert_close_both_ways({name: pair for name, pair in results.items() if name not in summed}, 1e-5)
    assert any(name.startswith("param") for name in results) == (operand is None or "bias_term" in prototxt)


@pytest.mark.parametrize("layer_type", ["Scale", "Bias"])
def test_scale_and_bias_given_operand_without_its_gradient(device, layer_type):
    section = "scale_param" if layer_type == "Scale" else "bias_param"
    results = run_both_ways(device, f'type: "{layer_type}" {section} {{ axis: 1 }}',
                            [RNG.standard_normal(SHAPE), RNG.standard_normal((3, 4))], propagate_down=[True, False])
    assert_close_both_ways(results, 1e-5)


def test_scale_of_a_2d_blob(device):
    results = run_both_ways(device, 'type: "Scale" scale_param { bias_term: true filler { type: "gaussian" } }',
                            [RNG.standard_normal((7, 9))])
    assert_close_both_ways(results, 1e-5)


# --- Dropout -------------------------------------------------------------------------
@pytest.mark.parametrize("ratio", [0.5, 0.2, 0.0])
@pytest.mark.parametrize("in_place", [False, True])
def test_dropout_on_device_draws_the_host_mask_without_device_masks(device, ratio, in_place):
    results = run_both_ways(device, f'type: "Dropout" dropout_param {{ dropout_ratio: {ratio} }}',
                            [RNG.standard_normal((4, 3, 5, 7))], in_place=in_place, random_seed=11,
                            configure=lambda layer: layer.configure({"device_masks": False}))
    assert_close_both_ways(results, 0)
    kept = results["top0"][0] != 0
    assert 0 < kept.mean() <= 1 and (ratio > 0) == (kept.mean() < 1)


@pytest.mark.parametrize("ratio", [0.5, 0.2, 0.0])
@pytest.mark.parametrize("in_place", [False, True])
def test_dropout_draws_its_mask_on_the_device(device, ratio, in_place):
    """The device's own draw (as Caffe's GPU path): not the host's numbers, so
    checked for what a mask is: each element kept (times 1 / (1 - ratio)) or
    dropped, in about 1 - ratio of them, the backward through the same mask,
    and another mask at the next forward."""
    x = RNG.standard_normal((4, 3, 50, 7)) + 10.0          # no zeros of its own
    results = run_both_ways(device, f'type: "Dropout" dropout_param {{ dropout_ratio: {ratio} }}',
                            [x], in_place=in_place, random_seed=11)
    y, dx = results["top0"][0], results["bottom0.diff"][0]
    kept = y != 0
    np.testing.assert_allclose(y[kept], (x.astype(np.float32) / np.float32(1 - ratio))[kept], rtol=1e-6)
    assert abs(kept.mean() - (1 - ratio)) < 0.03 and (ratio > 0) == (kept.mean() < 1)
    assert ((dx != 0) == kept).all()


def test_the_device_dropout_mask_is_its_reference(device):
    """Device.dropout_mask against the numpy device's, bit for bit, and a new seed a new mask."""
    from helpers.devices import same_op
    for seed in (0, 12345, 2 ** 31 - 1):
        (ours, reference), = same_op(device, "dropout_mask", [np.zeros(10_000)], [0], 10_000, seed, 0.7, 2.5)
        np.testing.assert_array_equal(ours, reference)
        assert set(np.unique(ours)) == {0.0, 2.5} and abs((ours != 0).mean() - 0.7) < 0.02
    (other, _), = same_op(device, "dropout_mask", [np.zeros(10_000)], [0], 10_000, 1, 0.7, 2.5)
    assert (other != ours).any()


@pytest.mark.parametrize("in_place", [False, True])
def test_dropout_at_test_is_the_identity_on_device(device, in_place):
    x = RNG.standard_normal((3, 4))
    results = run_both_ways(device, 'type: "Dropout"', [x], in_place=in_place, phase=cct.TEST)
    assert_close_both_ways(results, 0)
    np.testing.assert_array_equal(results["top0"][0], x.astype(np.float32))
