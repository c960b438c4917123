"""The layer contract's shared checks (cct.core.layer): an array too large
named by its layer and top, at setup and at forward, before it is allocated;
a layer run in place that would change its bottom's shape (issue 15); the
reshape at forward a layer skips while its blobs are unchanged."""
import math
import time

import numpy as np
import pytest
from google.protobuf import text_format

import cct
from cct.core.errors import MemoryLimitError, ShapeError
from cct.proto import caffe_pb2
from cct.runtime import settings

HUGE_INPUT = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 64 dim: 1000000000 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1" inner_product_param { num_output: 10 } }
"""
HUGE_NUM_OUTPUT = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 64 dim: 10 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1" inner_product_param { num_output: 1000000000 } }
"""
# A top that grows at forward: the Tile's input is made larger after setup.
TILE = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 10 } } }
layer { name: "t" type: "Tile" bottom: "data" top: "t" tile_param { tiles: 10 } }
"""


def test_a_top_too_large_is_refused_at_setup_naming_the_layer_and_top(memory_limit):
    memory_limit(16 << 30)
    start = time.perf_counter()
    with pytest.raises(MemoryLimitError, match=r"layer 'data' \(Input\): top 'data' of shape "
                                               r"\(64, 1000000000\) needs 238 GiB, more than the memory limit of 16 GiB"):
        cct.Net(HUGE_INPUT, cct.TEST)
    assert time.perf_counter() - start < 1.0       # refused before anything large was made


def test_a_parameter_too_large_names_its_field(memory_limit):
    memory_limit(16 << 30)
    with pytest.raises(MemoryLimitError, match=r"layer 'ip1' \(InnerProduct\): parameter blob "
                                               r"\(inner_product_param.weight_filler\) of shape "
                                               r"\(1000000000, 10\) needs 37.25 GiB"):
        cct.Net(HUGE_NUM_OUTPUT, cct.TEST)


def test_the_machines_memory_is_the_default_limit():
    with pytest.raises(MemoryError, match=r"of memory this machine has"):
        cct.Net(HUGE_INPUT.replace("dim: 64", "dim: 1000000000"), cct.TEST)


def test_a_top_that_grows_too_large_at_forward_is_named_too(memory_limit):
    net = cct.Net(TILE, cct.TEST)
    memory_limit(1 << 20)
    net.blobs["data"].reshape(2, 50000)             # 400 KB; the Tile's top would be 3.8 MiB
    with pytest.raises(MemoryLimitError, match=r"layer 't' \(Tile\): top 't' of shape \(2, 500000\) "
                                               r"needs 3.815 MiB, more than the memory limit of 1 MiB"):
        net.forward()


def test_a_layer_in_place_may_not_change_its_bottoms_shape():
    """Found by the fuzzer: a Tile in place reshaped its own input, and its
    forward failed inside numpy."""
    text = TILE.replace('top: "t"', 'top: "data"')
    with pytest.raises(ShapeError, match=r"layer 't' \(Tile\): top 'data' is also a bottom \(in place\), but Tile "
                                         r"changes its shape from \(2, 10\) to \(2, 100\)"):
        cct.Net(text, cct.TEST)


def test_layers_in_place_that_keep_the_shape_still_run():
    net = cct.Net(TILE + 'layer { name: "relu" type: "ReLU" bottom: "t" top: "t" }', cct.TEST)
    net.forward()


# --- reshape at forward: skipped while the blobs are as the last reshape left them -------------------
LAYOUT_NET = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 6 dim: 5 } } }
layer { name: "conv_a" type: "Convolution" bottom: "data" top: "a" convolution_param { num_output: 2 kernel_size: 1 } }
layer { name: "relu_a" type: "ReLU" bottom: "a" top: "a" }
layer { name: "conv_b" type: "Convolution" bottom: "data" top: "b"
        convolution_param { num_output: 3 kernel_size: 3 pad: 1 } }
layer { name: "cat" type: "Concat" bottom: "a" bottom: "b" top: "cat" }
layer { name: "pool" type: "Pooling" bottom: "cat" top: "pool" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv_c" type: "Convolution" bottom: "cat" top: "c" convolution_param { num_output: 2 kernel_size: 1 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip" inner_product_param { num_output: 3 } }
layer { name: "sum" type: "Reduction" bottom: "ip" top: "sum" }
"""


def counting_reshapes(net):
    """{layer name: reshapes so far}, counted from now."""
    counts = {layer.name: 0 for layer in net.layers}
    for layer in net.layers:
        def counted(bottom, top, layer=layer, reshape=layer.reshape):
            counts[layer.name] += 1
            reshape(bottom, top)
        layer.reshape = counted
    return counts


def layout_net(rng, fused):
    settings.set_fusion(fused)
    try:
        net = cct.Net(LAYOUT_NET, cct.TEST)
    finally:
        settings.set_fusion(None)
    for layer in net.layers:
        for blob in layer.blobs:
            blob.data[...] = rng.normal(0, 0.5, blob.shape)
    return net


def outputs_of(net, x):
    net.blobs["data"].reshape(x.shape)
    net.blobs["data"].data[...] = x
    net.forward()
    return {name: net.blobs[name].data.copy() for name in ("a", "b", "cat", "pool", "c", "ip", "sum")}


@pytest.mark.parametrize("fused", [True, False])
def test_a_forward_reshapes_only_the_layers_whose_blobs_changed(fused):
    """Caffe reshapes every layer at every forward; the layers that declare
    reshape_reads_layout (convolutions, poolings, Splits, Concats, inner
    products, ...) skip it while their blobs keep the shapes and stores the
    last one left, and the numbers are those of a net that reshaped."""
    rng = np.random.default_rng(3)
    net = layout_net(rng, fused)
    reference = layout_net(np.random.default_rng(3), fused)
    net.forward()
    counts = counting_reshapes(net)
    skipping = {layer.name for layer in net.layers if layer.reshape_reads_layout}
    assert {"conv_a", "relu_a", "conv_b", "cat", "pool", "conv_c", "ip"} <= skipping and "sum" not in skipping
    x = rng.normal(size=(1, 3, 6, 5)).astype(np.float32)
    first = outputs_of(net, x)
    assert all(counts[name] == 0 for name in skipping)
    assert counts["sum"] == 1                              # the others reshape at every forward, as Caffe's
    for name, values in outputs_of(reference, x).items():
        np.testing.assert_array_equal(first[name], values, err_msg=name)
    # another batch: every layer reshapes, and again after the batch returns
    for batch in (2, 1):
        x = rng.normal(size=(batch, 3, 6, 5)).astype(np.float32)
        before = dict(counts)
        got, expected = outputs_of(net, x), outputs_of(reference, x)
        assert all(counts[name] == before[name] + 1 for name in skipping)
        for name in expected:
            np.testing.assert_array_equal(got[name], expected[name], err_msg=f"{name} at batch {batch}")


def test_a_blob_given_another_store_of_the_same_shape_is_reshaped_for():
    """A top reshaped larger and back by the user has a new store at the
    same shape: its layers reshape (a Concat's placed bottom moves to its
    piece of the top again), and reshape_again asks for one too."""
    rng = np.random.default_rng(4)
    net, reference = layout_net(rng, True), layout_net(np.random.default_rng(4), True)
    x = rng.normal(size=(1, 3, 6, 5)).astype(np.float32)
    outputs_of(net, x)
    counts = counting_reshapes(net)
    shape = net.blobs["b"].shape
    net.blobs["b"].reshape((4,) + shape[1:])               # grows: a store of its own
    net.blobs["b"].reshape(shape)
    got = outputs_of(net, x)
    assert counts["conv_b"] == 1 and counts["cat"] == 1 and counts["conv_a"] == 0
    for name, values in outputs_of(reference, x).items():
        np.testing.assert_array_equal(got[name], values, err_msg=name)
    assert np.shares_memory(net.blobs["b"].data, net.blobs["cat"].data)   # placed again
    net.layer_dict["pool"].reshape_again()
    outputs_of(net, x)
    assert counts["pool"] == 1


@pytest.mark.parametrize("filler, expected", [('type: "constant"', 0.0), ('type: "constant" value: 0', 0.0),
                                              ('type: "constant" value: -0.0', -0.0),
                                              ('type: "constant" value: 2.5', 2.5)])
def test_a_parameter_filled_with_constants_holds_the_fillers_bits(filler, expected):
    """A zero constant (Caffe's default filler) is left to the new blob's +0.0
    (no pass over its pages, fillers.fills_zeros); -0.0 and other constants are written."""
    from cct.core import fillers
    param = text_format.Parse(filler, caffe_pb2.FillerParameter())
    assert fillers.fills_zeros(param) == (expected == 0 and math.copysign(1, expected) > 0)
    net = cct.Net('layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 1 dim: 3 } } }\n'
                  'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { '
                  f'num_output: 4 weight_filler {{ {filler} }} }} }}', cct.TEST)
    weights = net.params["ip"][0].data
    np.testing.assert_array_equal(weights.view(np.uint32), np.full(weights.shape, expected, np.float32).view(np.uint32))
