"""Split's, Concat's, Slice's, Flatten's, Reshape's and Crop's device paths against
their host forward and backward, on the numpy CPU device and on OpenCL;
and the shared-storage layers' tops sharing the bottom's device buffers."""
import numpy as np
import pytest

from cct.core.blob import Blob
from cct.devices.cpu import CPU
from cct.testing.gradient_check import make_layer
from helpers.devices import OPENCL, assert_close_both_ways, opencl_or_skip, run_both_ways

RNG = np.random.default_rng(11)


@pytest.fixture(params=["cpu", OPENCL])
def device(request):
    return CPU if request.param == "cpu" else opencl_or_skip()


@pytest.mark.parametrize("num_tops", [1, 2, 3])
@pytest.mark.parametrize("aliases", [False, True])
def test_split_on_device_matches_the_host(device, num_tops, aliases):
    configure = (lambda layer: setattr(layer, "aliases", True)) if aliases else None
    results = run_both_ways(device, 'type: "Split"', [RNG.standard_normal((3, 5, 7))], num_tops=num_tops,
                            configure=configure)
    assert_close_both_ways(results, 1e-6)


@pytest.mark.parametrize("axis, shapes", [
    (1, [(2, 3, 4), (2, 5, 4), (2, 1, 4)]),
    (0, [(1, 3, 5), (4, 3, 5)]),
    (2, [(2, 3, 1), (2, 3, 6)]),
    (-1, [(3, 2, 7, 2), (3, 2, 7, 5)]),
    (1, [(3, 4, 5)]),                      # one bottom: a copy
    (1, [(2, 0, 3), (2, 4, 3)]),           # an empty piece
])
def test_concat_on_device_matches_the_host(device, axis, shapes):
    results = run_both_ways(device, f'type: "Concat" concat_param {{ axis: {axis} }}',
                            [RNG.standard_normal(shape) for shape in shapes])
    assert_close_both_ways(results, 0)


def test_concat_without_some_gradients(device):
    results = run_both_ways(device, 'type: "Concat"', [RNG.standard_normal((2, k, 3)) for k in (2, 3, 4)],
                            propagate_down=[False, True, False])
    assert_close_both_ways(results, 0)
    assert set(results) == {"top0", "bottom1.diff"}


@pytest.mark.parametrize("param, shape, num_tops", [
    ("axis: 1 slice_point: 1 slice_point: 4", (2, 6, 3), 3),
    ("axis: 0", (4, 3, 5), 2),
    ("axis: -1 slice_point: 2", (3, 2, 7), 2),
    ("axis: 2", (2, 3, 6, 2), 3),
    ("axis: 1", (2, 5), 1),
])
def test_slice_on_device_matches_the_host(device, param, shape, num_tops):
    results = run_both_ways(device, f'type: "Slice" slice_param {{ {param} }}', [RNG.standard_normal(shape)],
                            num_tops=num_tops)
    assert_close_both_ways(results, 0)


VIEWS = [
    'type: "Flatten"',
    'type: "Flatten" flatten_param { axis: 2 }',
    'type: "Reshape" reshape_param { shape { dim: 0 dim: -1 dim: 2 } }',
    'type: "Reshape" reshape_param { axis: 1 num_axes: 2 shape { dim: 12 } }',
]


@pytest.mark.parametrize("prototxt", VIEWS)
def test_views_on_device_match_the_host(device, prototxt):
    results = run_both_ways(device, prototxt, [RNG.standard_normal((2, 3, 4, 2))])
    assert_close_both_ways(results, 0)


@pytest.mark.parametrize("prototxt", VIEWS)
def test_views_share_the_bottoms_device_buffers(device, prototxt):
    layer = make_layer(prototxt)
    bottom, top = Blob((2, 3, 4, 2), np.float32), Blob(dtype=np.float32)
    bottom.data[...] = RNG.standard_normal(bottom.shape)
    layer.set_up([bottom], [top])
    assert layer.runs_on(device, [bottom], [top])
    layer.forward_on(device, [bottom], [top])
    assert top.device_data(device) is bottom.device_data(device)
    assert top.mutable_device_diff(device) is bottom.device_diff(device)
    # what a device layer writes through the top, the bottom reads (and the host sees)
    device.fill(top.mutable_device_data(device), 2.5, top.count)
    np.testing.assert_array_equal(bottom.data, 2.5)


def test_split_aliases_share_the_bottoms_device_buffer(device):
    layer = make_layer('type: "Split"')
    layer.aliases = True
    bottom, tops = Blob((3, 4), np.float32), [Blob(dtype=np.float32) for _ in range(2)]
    layer.set_up([bottom], tops)
    layer.forward_on(device, [bottom], tops)
    assert all(top.device_data(device) is bottom.device_data(device) for top in tops)


@pytest.mark.parametrize("param, shapes", [
    ("", [(2, 3, 9, 8), (2, 3, 5, 4)]),                                    # offset 0 from axis 2
    ("axis: 2 offset: 3", [(2, 3, 9, 8), (1, 1, 5, 4)]),
    ("axis: 1 offset: 1 offset: 2 offset: 0", [(2, 4, 9, 8), (2, 2, 5, 8)]),
    ("axis: -1 offset: 2", [(3, 5), (3, 2)]),
])
@pytest.mark.parametrize("down", [[True, False], [True, True], [False, True]])
def test_crop_on_device_matches_the_host(device, param, shapes, down):
    """The window copied out forward and back into zeros backward (the
    forks' parameterless Crop runs as this one with the offsets it computes)."""
    results = run_both_ways(device, f'type: "Crop" crop_param {{ {param} }}',
                            [RNG.standard_normal(shape) for shape in shapes], propagate_down=down)
    assert_close_both_ways(results, 0)
