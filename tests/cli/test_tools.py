"""The companion commands (cct.cli.tools): device_query, the upgrades, and the
tools whose module is imported only when they run (convert_imageset,
compute_image_mean, compare) and draw."""
import sys
import types

import pytest
from google.protobuf import text_format

from cct import cli
from cct.proto import caffe_pb2
from helpers.cli import assert_one_line_error, messages, run_cct


def test_device_query(capsys):
    code, _, err = run_cct(capsys, "device_query")
    assert code == 0
    text = messages(err)
    assert any(m.startswith("Cores: ") for m in text)
    assert any(m.startswith("BLAS: ") for m in text)
    assert any(m.startswith("OpenCL") for m in text)
    assert text[-1].startswith("import caffe: cct, through its alias ") or text[-1].startswith("import caffe: cct ")


@pytest.mark.opencl
def test_device_query_of_an_opencl_device_measures_its_gemm(capsys):
    from helpers.devices import opencl_or_skip
    device = opencl_or_skip()
    code, _, err = run_cct(capsys, "device_query", "--gpu", "0")
    assert code == 0, err
    text = messages(err)
    assert f"Name: {device.name}" in text
    assert any(line.startswith("Compute units: ") for line in text)
    rate = [line for line in text if line.startswith("Measured SGEMM")]
    assert rate and float(rate[0].split(": ")[1].split()[0]) > 0
    code, _, err = run_cct(capsys, "device_query", "--gpu", "9")
    assert_one_line_error(code, err, "--gpu", "OpenCL device 9")


def test_upgrade_commands(tmp_path, capsys):
    (tmp_path / "v1.prototxt").write_text(
        'name: "old" input: "data" input_dim: 1 input_dim: 1 input_dim: 2 input_dim: 2 '
        'layers { name: "relu" type: RELU bottom: "data" top: "data" }')
    code, _, err = run_cct(capsys, "upgrade_net_proto_text", tmp_path / "v1.prototxt", tmp_path / "new.prototxt")
    assert code == 0, err
    upgraded = text_format.Parse((tmp_path / "new.prototxt").read_text(), caffe_pb2.NetParameter())
    assert [(layer.name, layer.type) for layer in upgraded.layer] == [("input", "Input"), ("relu", "ReLU")]
    (tmp_path / "v1.caffemodel").write_bytes(
        text_format.Parse((tmp_path / "v1.prototxt").read_text(), caffe_pb2.NetParameter()).SerializeToString())
    code, _, err = run_cct(capsys, "upgrade_net_proto_binary", tmp_path / "v1.caffemodel", tmp_path / "new.caffemodel")
    assert code == 0, err
    assert caffe_pb2.NetParameter.FromString((tmp_path / "new.caffemodel").read_bytes()) == upgraded
    (tmp_path / "solver.prototxt").write_text('net: "n" solver_type: NESTEROV base_lr: 0.1')
    code, _, err = run_cct(capsys, "upgrade_solver_proto_text", tmp_path / "solver.prototxt", tmp_path / "s2.prototxt")
    assert code == 0, err
    solver = text_format.Parse((tmp_path / "s2.prototxt").read_text(), caffe_pb2.SolverParameter())
    assert solver.type == "Nesterov" and not solver.HasField("solver_type")


def test_pass_through_tools_get_their_argv(monkeypatch, capsys):
    calls = []
    fake_tools = types.SimpleNamespace(convert_imageset=lambda argv: calls.append(("convert", argv)) or 0,
                                       compute_image_mean=lambda argv: calls.append(("mean", argv)) or 0)
    fake_compare = types.SimpleNamespace(main=lambda argv: calls.append(("compare", argv)) or 3)
    monkeypatch.setitem(sys.modules, "cct.cli.datasets", fake_tools)
    monkeypatch.setitem(sys.modules, "cct.cli.compare", fake_compare)
    assert cli.main(["convert_imageset", "-resize_height=8", "root/", "list.txt", "db"]) == 0
    assert cli.main(["compute_image_mean", "db", "mean.binaryproto"]) == 0
    assert cli.main(["compare", "--help"]) == 3
    assert calls == [("convert", ["-resize_height=8", "root/", "list.txt", "db"]),
                     ("mean", ["db", "mean.binaryproto"]), ("compare", ["--help"])]


def test_missing_tool_module_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "cct.cli.compare", None)      # makes the import fail
    code, _, err = run_cct(capsys, "compare")
    assert_one_line_error(code, err, "no cct.cli.compare")


def test_draw_writes_graphviz_source_and_an_image(tmp_path, capsys):
    """`cct draw` (Caffe's draw_net.py) on the digits LSTM, by phase: the TEST
    phase keeps the test data layer only; a .png is an image."""
    from helpers.paths import REPO
    net = REPO / "models" / "digits_lstm" / "train_test.prototxt"
    code, _, err = run_cct(capsys, "draw", net, tmp_path / "net.raw", "--phase", "TEST", "--rankdir", "TB")
    assert code == 0, err
    source = (tmp_path / "net.raw").read_text()
    assert "(LSTM)" in source and "rankdir=TB" in source
    batch = {rule.phase: layer.data_param.batch_size
             for layer in text_format.Parse(net.read_text(), caffe_pb2.NetParameter()).layer
             if layer.type == "Data" for rule in layer.include}
    assert batch[caffe_pb2.TRAIN] != batch[caffe_pb2.TEST]          # the edge labels tell the phases apart
    assert f"Batch {batch[caffe_pb2.TEST]}" in source and f"Batch {batch[caffe_pb2.TRAIN]}" not in source
    code, _, err = run_cct(capsys, "draw", net, tmp_path / "net.png")
    assert code == 0, err
    assert (tmp_path / "net.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_draw_names_a_missing_net(tmp_path, capsys):
    code, _, err = run_cct(capsys, "draw", tmp_path / "none.prototxt", tmp_path / "net.png")
    assert_one_line_error(code, err, "none.prototxt")
