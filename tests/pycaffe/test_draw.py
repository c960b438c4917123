"""cct.draw: graphs of nets as pycaffe's draw.py makes them, rendered to PNG."""
import shutil

import pytest
from google.protobuf import text_format

import cct
from cct import draw
from cct.core.errors import CctError
from cct.proto import caffe_pb2
from helpers.requirements import require



@pytest.fixture(autouse=True)
def pydot():
    require("pydot")

NET = """name: "drawn"
layer { name: "data" type: "Data" top: "data" top: "label" include { phase: TRAIN }
        data_param { source: "x" batch_size: 64 } }
layer { name: "input" type: "Input" top: "data" top: "label" include { phase: TEST } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        param { lr_mult: 1 } param { lr_mult: 2 }
        convolution_param { num_output: 20 kernel_size: 5 stride: 2 pad: 1 } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1" pooling_param { pool: AVE kernel_size: 3 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool1" top: "ip" inner_product_param { num_output: 10 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" exclude { phase: TEST } }
"""


def net_param():
    return text_format.Parse(NET, caffe_pb2.NetParameter())


def nodes_by_label(graph):
    return {node.get_name().strip('"'): node for node in graph.get_nodes()}


def attr(item, key):
    return str(item.get(key)).strip('"')


def test_labels_styles_and_edges():
    graph = draw.get_pydot_graph(net_param(), "LR", display_lrm=True)
    nodes = nodes_by_label(graph)
    conv = r"conv1\n(Convolution)\nkernel size: 5\nstride: 2\npad: 1\nlr mult: 1.0, 2.0"
    assert conv in nodes and attr(nodes[conv], "fillcolor") == "#FF5050"
    assert attr(nodes[r"pool1\n(Pooling AVE)\nkernel size: 3\nstride: 1\npad: 0"], "fillcolor") == "#FF9900"
    assert attr(nodes[r"relu1\n(ReLU)"], "fillcolor") == "#90EE90"          # in place
    assert attr(nodes["conv1"], "shape") == "octagon"
    labels = {(e.get_source().strip('"'), e.get_destination().strip('"')): attr(e, "label") for e in graph.get_edges()}
    assert labels[(conv, "conv1")] == "20"
    assert labels[(r"data\n(Data)", "data")] == "Batch 64"
    vertical = nodes_by_label(draw.get_pydot_graph(net_param(), "TB"))
    assert "conv1 (Convolution) kernel size: 5 stride: 2 pad: 1" in vertical


def test_phase_filter():
    train = nodes_by_label(draw.get_pydot_graph(net_param(), "LR", phase=cct.TRAIN))
    test = nodes_by_label(draw.get_pydot_graph(net_param(), "LR", phase=cct.TEST))
    everything = nodes_by_label(draw.get_pydot_graph(net_param(), "LR"))
    assert r"data\n(Data)" in train and r"data\n(Data)" not in test
    assert r"loss\n(SoftmaxWithLoss)" in train and r"loss\n(SoftmaxWithLoss)" not in test
    assert r"input\n(Input)" in test and r"input\n(Input)" in everything
    bad = net_param()
    bad.layer[2].exclude.add(phase=cct.TEST)
    bad.layer[2].include.add(phase=cct.TRAIN)
    with pytest.raises(CctError, match="both include and exclude"):
        draw.get_pydot_graph(bad, "LR", phase=cct.TRAIN)


def test_draw_net_to_png_file(tmp_path):
    require("graphviz")
    path = tmp_path / "net.png"
    draw.draw_net_to_file(net_param(), str(path), "BT", phase=cct.TRAIN)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    prototxt = tmp_path / "net.prototxt"
    prototxt.write_text(NET)
    assert draw.draw_net(str(prototxt), "LR", ext="svg").lstrip().startswith(b"<?xml")
    raw = tmp_path / "net.raw"
    draw.draw_net_to_file(net_param(), str(raw))
    assert raw.read_text().startswith("digraph drawn {")


def test_missing_graphviz_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(draw.shutil, "which", lambda name: None)
    with pytest.raises(CctError, match="install graphviz"):
        draw.draw_net(net_param(), "LR")


def test_recurrent_layers_are_drawn():
    """An LSTM with its exposed states: a node per layer, an edge per bottom and top."""
    net = text_format.Parse('''name: "sequence"
        layer { name: "input" type: "Input" top: "x" top: "cont" top: "h0" top: "c0" }
        layer { name: "lstm" type: "LSTM" bottom: "x" bottom: "cont" bottom: "h0" bottom: "c0"
                top: "h" top: "h_T" top: "c_T" recurrent_param { num_output: 8 expose_hidden: true } }
        layer { name: "unit" type: "LSTMUnit" bottom: "c0" bottom: "x" bottom: "cont" top: "c1" top: "h1" }
        layer { name: "rnn" type: "RNN" bottom: "h" bottom: "cont" top: "o" recurrent_param { num_output: 2 } }''',
                            caffe_pb2.NetParameter())
    graph = draw.get_pydot_graph(net, "LR")
    nodes = nodes_by_label(graph)
    for label in (r"lstm\n(LSTM)", r"unit\n(LSTMUnit)", r"rnn\n(RNN)"):
        assert label in nodes
    edges = {(e.get_source().strip('"'), e.get_destination().strip('"')) for e in graph.get_edges()}
    assert {("x", r"lstm\n(LSTM)"), ("c0", r"lstm\n(LSTM)"), (r"lstm\n(LSTM)", "h_T"),
            (r"lstm\n(LSTM)", "c_T"), ("h", r"rnn\n(RNN)"), (r"unit\n(LSTMUnit)", "h1")} <= edges
    if shutil.which("dot") is not None:
        assert draw.draw_net(net, "LR", ext="svg").lstrip().startswith(b"<?xml")
