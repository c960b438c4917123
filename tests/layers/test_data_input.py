"""Input-holding layers (layers/data_input.py): Input, DummyData's fill rules,
MemoryData's batches and wrap-around, Parameter's gradient."""
import numpy as np
import pytest

import cct
from cct.core.errors import ConfigError, ShapeError
from cct.testing.gradient_check import check_layer_gradient, make_layer, setup_layer

RNG = np.random.default_rng(7)


def build(prototxt, num_tops):
    layer = make_layer(prototxt)
    bottoms, tops = setup_layer(layer, [], num_tops)
    return layer, bottoms, tops


def step(layer, bottoms, tops):
    layer.reshape(bottoms, tops)
    layer.forward(bottoms, tops)
    return [top.data.copy() for top in tops]


# --- Input ---------------------------------------------------------------------------
def test_input_shapes():
    _, _, tops = build('type: "Input" input_param { shape { dim: 2 dim: 3 } shape { dim: 4 } }', 2)
    assert [t.shape for t in tops] == [(2, 3), (4,)]


# --- DummyData -----------------------------------------------------------------------
def test_dummy_data_shapes_and_default_zero():
    _, _, tops = build('type: "DummyData" dummy_data_param { shape { dim: 2 dim: 3 } shape { dim: 5 } }', 2)
    assert [t.shape for t in tops] == [(2, 3), (5,)]
    assert all(np.all(t.data == 0) for t in tops)
    _, _, tops = build('type: "DummyData" dummy_data_param { num: 2 channels: 3 channels: 1 '
                       'height: 4 width: 5 }', 2)
    assert [t.shape for t in tops] == [(2, 3, 4, 5), (2, 1, 4, 5)]


def test_dummy_data_constant_filled_once_others_every_forward():
    layer, bottoms, tops = build(
        'type: "DummyData" dummy_data_param { shape { dim: 3 dim: 4 } '
        'data_filler { type: "constant" value: 2 } data_filler { type: "uniform" } }', 2)
    assert np.all(tops[0].data == 2)
    assert np.all(tops[1].data == 0)           # not filled before the first forward
    tops[0].data[0, 0] = -7                     # a constant top is never refilled (Caffe)
    first = step(layer, bottoms, tops)
    second = step(layer, bottoms, tops)
    assert first[0][0, 0] == -7 and second[0][0, 0] == -7
    assert np.all((first[1] >= 0) & (first[1] <= 1))
    assert not np.array_equal(first[1], second[1])


def test_dummy_data_one_filler_for_all_tops():
    layer, bottoms, tops = build(
        'type: "DummyData" dummy_data_param { shape { dim: 4 } data_filler { type: "gaussian" } }', 3)
    values = step(layer, bottoms, tops)
    assert all(v.shape == (4,) and np.any(v != 0) for v in values)


@pytest.mark.parametrize("params,message", [
    ('shape { dim: 2 } data_filler { } data_filler { }', "data_filler.*none, one, or one per top \\(3\\)"),
    ('shape { dim: 2 } shape { dim: 2 }', "shape.*one per top \\(3\\), got 2"),
    ('shape { dim: 2 } num: 1 channels: 1 height: 1 width: 1', "not both"),
    ('num: 1 num: 1 channels: 1 height: 1 width: 1', "dummy_data_param.num.*got 2"),
    ('shape { dim: 2 } data_filler { type: "nope" }', "unknown filler 'nope'"),
])
def test_dummy_data_errors(params, message):
    with pytest.raises(ConfigError, match=message):
        build(f'type: "DummyData" dummy_data_param {{ {params} }}', 3)


# --- MemoryData ----------------------------------------------------------------------
MEMORY = 'type: "MemoryData" memory_data_param { batch_size: 2 channels: 1 height: 2 width: 3 }'


def test_memory_data_serves_batches_and_wraps_around():
    layer, bottoms, tops = build(MEMORY, 2)
    assert tops[0].shape == (2, 1, 2, 3) and tops[1].shape == (2,)
    data = RNG.standard_normal((6, 1, 2, 3))
    labels = np.arange(6.0)
    layer.set_input_arrays(data, labels)
    for batch in (0, 1, 2, 0, 1):
        got_data, got_labels = step(layer, bottoms, tops)
        np.testing.assert_array_equal(got_data, data[2 * batch:2 * batch + 2])
        # Caffe's MemoryData forward shapes the label top (N, 1, 1, 1).
        np.testing.assert_array_equal(got_labels, labels[2 * batch:2 * batch + 2].reshape(2, 1, 1, 1))


def test_memory_data_reset_uses_first_n_and_restarts():
    layer, bottoms, tops = build(MEMORY, 2)
    data = RNG.standard_normal((6, 1, 2, 3))
    labels = np.arange(6.0).reshape(6, 1, 1, 1)
    layer.reset(data, labels, 4)
    served = [step(layer, bottoms, tops)[1] for _ in range(3)]
    np.testing.assert_array_equal(np.concatenate(served).ravel(), [0, 1, 2, 3, 0, 1])
    layer.reset(data, labels, 6)
    np.testing.assert_array_equal(step(layer, bottoms, tops)[1].ravel(), [0, 1])


def test_memory_data_errors():
    layer, bottoms, tops = build(MEMORY, 2)
    with pytest.raises(ConfigError, match="set_input_arrays"):
        step(layer, bottoms, tops)
    with pytest.raises(ShapeError, match="multiple of memory_data_param.batch_size \\(2\\)"):
        layer.set_input_arrays(np.zeros((3, 1, 2, 3)), np.zeros(3))
    with pytest.raises(ShapeError, match="data must have shape"):
        layer.set_input_arrays(np.zeros((4, 2, 2, 3)), np.zeros(4))
    with pytest.raises(ShapeError, match="one value per item"):
        layer.set_input_arrays(np.zeros((4, 1, 2, 3)), np.zeros(3))
    with pytest.raises(ConfigError, match="memory_data_param.height"):
        build('type: "MemoryData" memory_data_param { batch_size: 2 channels: 1 width: 3 }', 2)


def test_memory_data_in_a_net(tmp_path):
    path = tmp_path / "net.prototxt"
    path.write_text(f'layer {{ name: "data" top: "data" top: "label" {MEMORY} }}')
    net = cct.Net(str(path), cct.TEST)
    data = RNG.standard_normal((4, 1, 2, 3)).astype(np.float32)
    net.layer_dict["data"].set_input_arrays(data, np.array([3, 1, 4, 1]))
    net.forward()
    out = net.forward()
    np.testing.assert_array_equal(out["data"], data[2:])
    np.testing.assert_array_equal(out["label"].ravel(), [4, 1])


# --- Parameter -----------------------------------------------------------------------
def test_parameter_exposes_blob_and_accumulates_diff():
    prototxt = 'type: "Parameter" parameter_param { shape { dim: 2 dim: 3 } }'
    layer, bottoms, tops = build(prototxt, 1)
    assert layer.blobs[0].shape == (2, 3) and np.all(layer.blobs[0].data == 0)
    layer.blobs[0].data[...] = values = RNG.standard_normal((2, 3))
    np.testing.assert_array_equal(step(layer, bottoms, tops)[0], values)
    tops[0].diff[...] = 1
    layer.backward(tops, [], bottoms)
    layer.backward(tops, [], bottoms)
    assert np.all(layer.blobs[0].diff == 2)


def test_parameter_gradient():
    layer = make_layer('type: "Parameter" parameter_param { shape { dim: 3 dim: 2 } }')
    check_layer_gradient(layer, [])
