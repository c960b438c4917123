"""Routing and reshaping layers (layers/shape.py): gradients, forward against
naive index loops, Caffe's shape rules and the errors for bad params."""
import itertools

import numpy as np
import pytest

import cct
from cct.core.errors import ConfigError, ShapeError
from cct.testing.gradient_check import check_layer_gradient, make_layer, setup_layer
from helpers.layers import run_layer

RNG = np.random.default_rng(11)


def rand(*shape):
    return RNG.standard_normal(shape)


def every_index(shape):
    return itertools.product(*(range(d) for d in shape))


# --- Split ---------------------------------------------------------------------------
def test_split_copies_and_sums_diffs():
    x = rand(2, 3)
    check_layer_gradient(make_layer('type: "Split"'), [x], num_tops=3)
    _, _, tops = run_layer('type: "Split"', [x], num_tops=2)
    for top in tops:
        np.testing.assert_array_equal(top.data, x)


# --- Concat --------------------------------------------------------------------------
def naive_concat(arrays, axis):
    """Copy element by element, shifting the concat-axis index by the sizes before."""
    shape = list(arrays[0].shape)
    shape[axis] = sum(a.shape[axis] for a in arrays)
    out = np.zeros(shape)
    offset = 0
    for a in arrays:
        for index in every_index(a.shape):
            moved = list(index)
            moved[axis] += offset
            out[tuple(moved)] = a[index]
        offset += a.shape[axis]
    return out


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_concat_forward_and_gradient(axis):
    sizes = [2, 3, 1]
    base = [2, 3, 4, 2]
    canonical = axis % 4
    arrays = []
    for size in sizes:
        shape = list(base)
        shape[canonical] = size
        arrays.append(rand(*shape))
    prototxt = f'type: "Concat" concat_param {{ axis: {axis} }}'
    _, _, tops = run_layer(prototxt, arrays)
    np.testing.assert_array_equal(tops[0].data, naive_concat(arrays, canonical))
    check_layer_gradient(make_layer(prototxt), arrays)


def test_concat_legacy_concat_dim_and_single_bottom():
    a, b = rand(2, 2, 3), rand(2, 2, 1)
    _, _, tops = run_layer('type: "Concat" concat_param { concat_dim: 2 }', [a, b])
    np.testing.assert_array_equal(tops[0].data, naive_concat([a, b], 2))
    _, _, tops = run_layer('type: "Concat"', [a])
    np.testing.assert_array_equal(tops[0].data, a)
    check_layer_gradient(make_layer('type: "Concat"'), [a])


def test_concat_errors():
    with pytest.raises(ShapeError, match=r"bottom\[1\].*\(2, 3, 5\)"):
        run_layer('type: "Concat" concat_param { axis: 1 }', [rand(2, 2, 4), rand(2, 3, 5)])
    with pytest.raises(ShapeError, match=r"bottom\[1\]"):
        run_layer('type: "Concat"', [rand(2, 2, 4), rand(2, 3)])
    with pytest.raises(ConfigError, match="concat_dim.*not both"):
        run_layer('type: "Concat" concat_param { axis: 1 concat_dim: 1 }', [rand(2, 2), rand(2, 2)])
    with pytest.raises(ConfigError, match="concat_param.axis"):
        run_layer('type: "Concat" concat_param { axis: 3 }', [rand(2, 2), rand(2, 2)])


# --- Slice ---------------------------------------------------------------------------
def naive_slice(x, axis, points):
    bounds = list(zip([0] + points, points + [x.shape[axis]]))
    pieces = []
    for start, end in bounds:
        shape = list(x.shape)
        shape[axis] = end - start
        piece = np.zeros(shape)
        for index in every_index(shape):
            source = list(index)
            source[axis] += start
            piece[index] = x[tuple(source)]
        pieces.append(piece)
    return pieces


@pytest.mark.parametrize("axis,points,num_tops", [
    (0, [1, 3], 3), (1, [2], 2), (2, [1, 2, 4], 4), (1, [], 3), (-1, [], 2),
])
def test_slice_forward_and_gradient(axis, points, num_tops):
    x = rand(4, 6, 5, 2)
    canonical = axis % 4
    point_text = " ".join(f"slice_point: {p}" for p in points)
    prototxt = f'type: "Slice" slice_param {{ axis: {axis} {point_text} }}'
    expected_points = points or [x.shape[canonical] // num_tops * k for k in range(1, num_tops)]
    _, _, tops = run_layer(prototxt, [x], num_tops)
    for top, piece in zip(tops, naive_slice(x, canonical, expected_points)):
        np.testing.assert_array_equal(top.data, piece)
    check_layer_gradient(make_layer(prototxt), [x], num_tops=num_tops)


def test_slice_legacy_slice_dim():
    x = rand(2, 4, 3)
    _, _, tops = run_layer('type: "Slice" slice_param { slice_dim: 2 slice_point: 1 }', [x], 2)
    np.testing.assert_array_equal(tops[1].data, x[:, :, 1:])


def test_slice_errors():
    x = rand(2, 6, 3)
    with pytest.raises(ConfigError, match="slice_point.*2 for 3 tops.*got 1"):
        run_layer('type: "Slice" slice_param { slice_point: 2 }', [x], 3)
    with pytest.raises(ConfigError, match="4 tops do not evenly divide"):
        run_layer('type: "Slice"', [x], 4)
    with pytest.raises(ConfigError, match="increase strictly"):
        run_layer('type: "Slice" slice_param { slice_point: 3 slice_point: 2 }', [x], 3)
    with pytest.raises(ConfigError, match="increase strictly"):
        run_layer('type: "Slice" slice_param { slice_point: 6 }', [x], 2)
    with pytest.raises(ConfigError, match="slice_dim.*not both"):
        run_layer('type: "Slice" slice_param { axis: 1 slice_dim: 1 }', [x], 2)


# --- Flatten -------------------------------------------------------------------------
@pytest.mark.parametrize("params,expected", [
    ("", (2, 60)), ("axis: 2", (2, 3, 20)), ("axis: 0 end_axis: 1", (6, 4, 5)),
    ("axis: 1 end_axis: -2", (2, 12, 5)), ("axis: -1", (2, 3, 4, 5)),
])
def test_flatten_shapes_values_and_gradient(params, expected):
    x = rand(2, 3, 4, 5)
    prototxt = f'type: "Flatten" flatten_param {{ {params} }}'
    _, _, tops = run_layer(prototxt, [x])
    assert tops[0].shape == expected
    # Row-major order is kept: the i-th element in C order is the same.
    np.testing.assert_array_equal(tops[0].data.reshape(-1), [x[i] for i in every_index(x.shape)])
    check_layer_gradient(make_layer(prototxt), [x])


def test_flatten_not_in_place():
    layer = make_layer('type: "Flatten"')
    blob = cct.Blob((2, 3))
    with pytest.raises(ConfigError, match="in place"):
        layer.setup([blob], [blob])


# --- Reshape -------------------------------------------------------------------------
@pytest.mark.parametrize("params,expected", [
    ("shape { dim: 0 dim: -1 dim: 8 }", (2, 15, 8)),
    ("shape { dim: 6 dim: 5 dim: 8 }", (6, 5, 8)),
    ("shape { dim: -1 }", (240,)),
    ("shape { dim: 0 dim: 0 dim: 0 dim: 0 }", (2, 3, 5, 8)),
    ("shape { dim: 0 dim: 3 dim: -1 dim: 0 dim: 1 }", (2, 3, 5, 8, 1)),
    ("axis: 1 num_axes: 2 shape { dim: -1 }", (2, 15, 8)),
    ("axis: -1 shape { dim: 1 dim: 1 }", (2, 3, 5, 8, 1, 1)),
    ("axis: 0 num_axes: 0 shape { dim: 1 }", (1, 2, 3, 5, 8)),
    ("axis: 2 num_axes: 1 shape { dim: 0 dim: 1 }", (2, 3, 5, 1, 8)),
    ("axis: 1 shape { dim: 0 dim: -1 }", (2, 3, 40)),
])
def test_reshape_rules_values_and_gradient(params, expected):
    x = rand(2, 3, 5, 8)
    prototxt = f'type: "Reshape" reshape_param {{ {params} }}'
    _, _, tops = run_layer(prototxt, [x])
    assert tops[0].shape == expected
    np.testing.assert_array_equal(tops[0].data.reshape(-1), [x[i] for i in every_index(x.shape)])
    check_layer_gradient(make_layer(prototxt), [x])


def test_reshape_follows_the_bottom_when_it_changes():
    layer = make_layer('type: "Reshape" reshape_param { shape { dim: 0 dim: -1 } }')
    bottoms, tops = setup_layer(layer, [rand(2, 3, 4)])
    bottoms[0].reshape(5, 2, 2)
    bottoms[0].data[...] = 7
    layer.reshape(bottoms, tops)
    layer.forward(bottoms, tops)
    assert tops[0].shape == (5, 4)
    assert np.all(tops[0].data == 7)


@pytest.mark.parametrize("params,error,message", [
    ("shape { dim: -1 dim: -1 }", ConfigError, "2 dims of -1"),
    ("shape { dim: 7 dim: -1 }", ShapeError, "not divisible"),
    ("shape { dim: 5 dim: 7 }", ShapeError, "elements"),
    ("shape { dim: 0 dim: 0 dim: 0 dim: 0 }", ConfigError, "no axis 3 to copy"),
    ("shape { dim: -2 }", ConfigError, "must be > 0, 0"),
    ("axis: 4 shape { dim: 1 }", ConfigError, "reshape_param.axis"),
    ("axis: 1 num_axes: 3 shape { dim: 1 }", ConfigError, "reshape_param.num_axes"),
    ("num_axes: -2 shape { dim: 1 }", ConfigError, "reshape_param.num_axes"),
])
def test_reshape_errors(params, error, message):
    with pytest.raises(error, match=message):
        run_layer(f'type: "Reshape" reshape_param {{ {params} }}', [rand(2, 3, 4)])


# --- Crop ----------------------------------------------------------------------------
def naive_crop(x, shape, offsets):
    out = np.zeros(shape)
    for index in every_index(shape):
        out[index] = x[tuple(i + o for i, o in zip(index, offsets))]
    return out


@pytest.mark.parametrize("params,ref_shape,offsets", [
    ("axis: 2 offset: 1 offset: 2", (2, 3, 4, 3), (0, 0, 1, 2)),
    ("axis: 2 offset: 1", (2, 3, 5, 4), (0, 0, 1, 1)),
    ("", (2, 3, 6, 6), (0, 0, 0, 0)),
    ("axis: 1 offset: 1", (2, 2, 4, 5), (0, 1, 1, 1)),
    ("axis: -3 offset: 0 offset: 2 offset: 1", (2, 3, 4, 5), (0, 0, 2, 1)),
    ("axis: 0 offset: 1 offset: 0 offset: 3 offset: 0", (1, 3, 3, 6), (1, 0, 3, 0)),
])
def test_crop_forward_and_gradient(params, ref_shape, offsets):
    x, ref = rand(2, 3, 6, 6), rand(*ref_shape)
    prototxt = f'type: "Crop" crop_param {{ {params} }}'
    _, _, tops = run_layer(prototxt, [x, ref])
    np.testing.assert_array_equal(tops[0].data, naive_crop(x, ref_shape, offsets))
    check_layer_gradient(make_layer(prototxt), [x, ref])


def test_crop_errors():
    with pytest.raises(ShapeError, match="out of bounds.*offset 3"):
        run_layer('type: "Crop" crop_param { offset: 3 }', [rand(1, 1, 6, 6), rand(1, 1, 4, 4)])
    with pytest.raises(ConfigError, match="crop_param.offset.*one per cropped axis \\(2"):
        run_layer('type: "Crop" crop_param { offset: 1 offset: 1 offset: 1 }', [rand(1, 1, 6, 6), rand(1, 1, 4, 4)])


# --- Tile ----------------------------------------------------------------------------
@pytest.mark.parametrize("axis,tiles", [(0, 2), (1, 3), (2, 2), (-1, 4)])
def test_tile_forward_and_gradient(axis, tiles):
    x = rand(2, 3, 2, 2)
    canonical = axis % 4
    prototxt = f'type: "Tile" tile_param {{ axis: {axis} tiles: {tiles} }}'
    _, _, tops = run_layer(prototxt, [x])
    # Each tile is a full copy of the bottom's trailing block from `axis` on.
    for index in every_index(tops[0].shape):
        source = list(index)
        source[canonical] %= x.shape[canonical]
        assert tops[0].data[index] == x[tuple(source)]
    check_layer_gradient(make_layer(prototxt), [x])


def test_tile_errors():
    with pytest.raises(ConfigError, match="tile_param.tiles.*missing"):
        run_layer('type: "Tile"', [rand(2, 2)])
    with pytest.raises(ConfigError, match="tile_param.tiles.*> 0"):
        run_layer('type: "Tile" tile_param { tiles: 0 }', [rand(2, 2)])


# --- Silence -------------------------------------------------------------------------
def test_silence_zeroes_bottom_diffs():
    layer, bottoms, tops = run_layer('type: "Silence"', [rand(2, 3), rand(4)], num_tops=0)
    for blob in bottoms:
        blob.diff[...] = 5
    layer.backward(tops, [True, False], bottoms)
    assert np.all(bottoms[0].diff == 0) and np.all(bottoms[1].diff == 5)


# --- BatchReindex --------------------------------------------------------------------
def test_batch_reindex_forward_and_gradient():
    x = rand(4, 3, 2)
    index = np.array([2, 0, 2, 3, 3, 3])
    _, _, tops = run_layer('type: "BatchReindex"', [x, index])
    for i, source in enumerate(index):
        np.testing.assert_array_equal(tops[0].data[i], x[source])
    check_layer_gradient(make_layer('type: "BatchReindex"'), [x, index], check_bottoms=[0])
    layer, bottoms, tops = run_layer('type: "BatchReindex"', [x, index])
    tops[0].diff[...] = 1
    layer.backward(tops, [True, False], bottoms)
    np.testing.assert_array_equal(bottoms[0].diff[:, 0, 0], [1, 0, 2, 3])   # counts of each index


def test_batch_reindex_errors():
    with pytest.raises(ShapeError, match=r"\[0, 4\)"):
        run_layer('type: "BatchReindex"', [rand(4, 2), np.array([0, 4])])
    with pytest.raises(ShapeError, match=r"\[0, 4\)"):
        run_layer('type: "BatchReindex"', [rand(4, 2), np.array([-1, 0])])
    layer, bottoms, tops = run_layer('type: "BatchReindex"', [rand(4, 2), np.array([1, 0])])
    with pytest.raises(ConfigError, match="cannot backpropagate to its index"):
        layer.backward(tops, [True, True], bottoms)


# --- Filter --------------------------------------------------------------------------
def test_filter_forward_and_gradient():
    a, b = rand(5, 3), rand(5, 2, 2)
    selector = np.array([0, 1, 0, 1, 1.0]).reshape(5, 1)
    layer, bottoms, tops = run_layer('type: "Filter"', [a, b, selector], num_tops=2)
    kept = [i for i in range(5) if selector[i, 0] != 0]
    np.testing.assert_array_equal(tops[0].data, np.array([a[i] for i in kept]))
    np.testing.assert_array_equal(tops[1].data, np.array([b[i] for i in kept]))
    check_layer_gradient(make_layer('type: "Filter"'), [a, b, selector], num_tops=2, check_bottoms=[0, 1])
    tops[0].diff[...] = 1
    bottoms[0].diff[...] = 9
    layer.backward(tops, [True, False, False], bottoms)
    np.testing.assert_array_equal(bottoms[0].diff[:, 0], [0, 1, 0, 1, 1])


def test_filter_first_reshape_is_full_batch_then_follows_selector():
    layer = make_layer('type: "Filter"')
    bottoms = [cct.Blob((4, 2)), cct.Blob((4,))]
    tops = [cct.Blob()]
    layer.setup(bottoms, tops)
    layer.reshape(bottoms, tops)
    assert tops[0].shape == (4, 2)
    layer.reshape(bottoms, tops)          # selector all zero: nothing kept
    assert tops[0].shape == (0, 2)


def test_filter_errors():
    with pytest.raises(ConfigError, match="one top per filtered bottom"):
        run_layer('type: "Filter"', [rand(3, 2), rand(3)], num_tops=2)
    with pytest.raises(ShapeError, match="selector.*shape"):
        run_layer('type: "Filter"', [rand(3, 2), rand(3, 2)])
    with pytest.raises(ShapeError, match="first dimension 3"):
        run_layer('type: "Filter"', [rand(4, 2), rand(3)])
    layer, bottoms, tops = run_layer('type: "Filter"', [rand(3, 2), np.ones(3)])
    with pytest.raises(ConfigError, match="cannot backpropagate to its index"):
        layer.backward(tops, [True, True], bottoms)


# --- in a Net ------------------------------------------------------------------------
def test_shared_view_layers_in_a_net(tmp_path):
    path = tmp_path / "net.prototxt"
    path.write_text("""
        force_backward: true
        layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 dim: 4 } } }
        layer { name: "f" type: "Flatten" bottom: "x" top: "f" }
        layer { name: "r" type: "Reshape" bottom: "f" top: "r" reshape_param { shape { dim: -1 dim: 4 } } }
        layer { name: "s" type: "Slice" bottom: "r" top: "a" top: "b" slice_param { axis: 0 } }
        layer { name: "c" type: "Concat" bottom: "b" bottom: "a" top: "c" concat_param { axis: 0 } }
    """)
    net = cct.Net(str(path), cct.TEST)
    x = rand(2, 3, 4)
    out = net.forward(x=x)["c"]
    rows = x.reshape(6, 4)
    np.testing.assert_allclose(out, np.concatenate([rows[3:], rows[:3]]), rtol=1e-6)
    diff = rand(6, 4)
    grad = net.backward(c=diff)["x"]
    np.testing.assert_allclose(grad.reshape(6, 4), np.concatenate([diff[3:], diff[:3]]), rtol=1e-6)
