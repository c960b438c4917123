"""The layer contract's shared checks (cct.core.layer): an array too large
named by its layer and top, at setup and at forward, before it is allocated;
a layer run in place that would change its bottom's shape (issue 15)."""
import time

import pytest

import cct
from cct.core.errors import MemoryLimitError, ShapeError

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
