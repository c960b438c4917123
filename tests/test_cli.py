"""The `cct` command line: flag spellings, each command's output, and bad
input ending in one `cct: error: ...` line with exit status 1, never a traceback."""
import importlib.util
import re
import subprocess
import sys
import types

import pytest
from google.protobuf import text_format

import cct
from cct import cli
from cct.proto import caffe_pb2
from siblings import load_sibling


helpers = load_sibling("test_solver")
LOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d{6} \w+\] ")


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def messages(err):
    """Log lines without their glog-style prefix."""
    return [LOG_LINE.sub("", line) for line in err.splitlines() if LOG_LINE.match(line)]


def assert_one_line_error(code, err, *fragments):
    assert code == 1, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("cct: error: ")]
    assert len(errors) == 1 and err.rstrip().splitlines()[-1] == errors[0], err
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


@pytest.fixture
def run_folder(tmp_path, monkeypatch):
    """A folder with net.prototxt (Input + TestLinReg) and solver.prototxt, as the working folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.prototxt").write_text(helpers.net_text())
    (tmp_path / "solver.prototxt").write_text(
        'net: "net.prototxt" base_lr: 0.01 lr_policy: "fixed" momentum: 0.9 max_iter: 4 display: 2 '
        'snapshot: 2 snapshot_prefix: "snap" test_iter: 2 test_interval: 2 random_seed: 1')
    return tmp_path


def test_normalize_flags():
    argv = ["train", "-solver", "s.prototxt", "-weights=a,b", "--level", "-1", "-h", "--stage=x", "--", "-keep"]
    assert cli.normalize_flags(argv) == ["train", "--solver", "s.prototxt", "--weights=a,b", "--level", "-1",
                                         "-h", "--stage=x", "--", "-keep"]


@pytest.mark.parametrize("style", [["--solver=solver.prototxt"], ["--solver", "solver.prototxt"],
                                   ["-solver", "solver.prototxt"], ["-solver=solver.prototxt"]])
def test_train_flag_styles(style, run_folder, capsys):
    code, _, err = run(capsys, "train", *style, "-sigint_effect", "stop", "--gpu=0")
    assert code == 0, err
    lines = messages(err)
    assert "--gpu=0: cct runs on the CPU; the flag is ignored" in lines
    assert "Optimization Done." in lines
    assert sorted(p.name for p in run_folder.glob("snap_iter_*")) == [
        "snap_iter_2.caffemodel", "snap_iter_2.solverstate", "snap_iter_4.caffemodel", "snap_iter_4.solverstate"]


def test_train_resume_and_finetune(run_folder, capsys):
    assert run(capsys, "train", "-solver", "solver.prototxt")[0] == 0
    code, _, err = run(capsys, "train", "-solver", "solver.prototxt", "-snapshot", "snap_iter_2.solverstate")
    assert code == 0, err
    assert "Restoring previous solver status from snap_iter_2.solverstate" in messages(err)
    code, _, err = run(capsys, "train", "-solver", "solver.prototxt", "-weights", "snap_iter_4.caffemodel")
    assert code == 0, err
    assert "Loading weights from snap_iter_4.caffemodel" in messages(err)


def test_train_weights_flag_replaces_the_solvers_weights(run_folder, capsys):
    """caffe.cpp clears the solver's `weights:` when --weights or --snapshot is given."""
    assert run(capsys, "train", "-solver", "solver.prototxt")[0] == 0
    solver = run_folder / "solver.prototxt"
    solver.write_text(solver.read_text() + ' weights: "does_not_exist.caffemodel"')
    code, _, err = run(capsys, "train", "-solver", "solver.prototxt", "-weights", "snap_iter_4.caffemodel")
    assert code == 0, err
    assert "Loading weights from snap_iter_4.caffemodel" in messages(err)
    code, _, err = run(capsys, "train", "-solver", "solver.prototxt", "-snapshot", "snap_iter_2.solverstate")
    assert code == 0, err


def test_train_level_and_stage_select_layers(run_folder, capsys):
    (run_folder / "net.prototxt").write_text(helpers.net_text() + """
layer { name: "deep" type: "TestLinReg" bottom: "x" bottom: "t" top: "loss2"
        include { stage: "deep" min_level: 2 } inner_product_param { num_output: 2 } }
""")
    def trained_layers(*flags):
        code, _, err = run(capsys, "train", "-solver", "solver.prototxt", *flags)
        assert code == 0, err
        model = caffe_pb2.NetParameter.FromString((run_folder / "snap_iter_4.caffemodel").read_bytes())
        return [layer.name for layer in model.layer]
    assert "deep" not in trained_layers("-stage", "deep")
    assert "deep" not in trained_layers("-level", "2")
    assert "deep" in trained_layers("-level", "2", "-stage", "other,deep")


def test_train_log_format_and_parse_log(run_folder, capsys):
    code, _, err = run(capsys, "train", "--solver", "solver.prototxt")
    assert code == 0
    lines = err.splitlines()
    assert all(LOG_LINE.match(line) for line in lines), lines
    text = messages(err)
    assert any(re.fullmatch(r"Iteration 2 \(.* iter/s, .* images/s, .*s/2 iters.*\), loss = \S+", m) for m in text)
    assert any(re.fullmatch(r"    Train net output #0: loss = \S+ \(\* 1 = \S+ loss\)", m) for m in text)
    assert any(re.fullmatch(r"    Test net output #0: loss = \S+ \(\* 1 = \S+ loss\)", m) for m in text)
    assert "Iteration 2, lr = 0.01" in text
    (run_folder / "train.log").write_text(err)
    code, _, err = run(capsys, "parse_log", "train.log", str(run_folder))
    assert code == 0, err
    train = (run_folder / "train.log.train").read_text().splitlines()
    test = (run_folder / "train.log.test").read_text().splitlines()
    assert train[0] == "NumIters,Seconds,LearningRate,loss"
    assert [row.split(",")[0] for row in train[1:]] == ["0", "2"]
    assert all(row.split(",")[2] == "0.01" for row in train[1:])
    assert [row.split(",")[0] for row in test[1:]] == ["0", "2", "4"]


def test_parse_log_reads_caffe_logs(tmp_path):
    from cct.cli.train_log import parse_log
    log = tmp_path / "caffe.log"
    log.write_text(
        "I1231 23:59:59.500000  1234 solver.cpp:330] Iteration 0, Testing net (#0)\n"
        "I1231 23:59:59.900000  1234 solver.cpp:397]     Test net output #0: accuracy = 0.1\n"
        "I1231 23:59:59.900000  1234 solver.cpp:397]     Test net output #1: loss = 2.3 (* 1 = 2.3 loss)\n"
        "I1231 23:59:59.950000  1234 solver.cpp:218] Iteration 0 (0 iter/s, 0.4s/100 iters), loss = 2.31\n"
        "I1231 23:59:59.950000  1234 solver.cpp:237]     Train net output #0: loss = 2.31 (* 1 = 2.31 loss)\n"
        "I1231 23:59:59.950000  1234 sgd_solver.cpp:105] Iteration 0, lr = 0.01\n"
        "I0101 00:00:01.500000  1234 solver.cpp:218] Iteration 100 (50 iter/s, 2s/100 iters), loss = 0.5\n"
        "I0101 00:00:01.500000  1234 solver.cpp:237]     Train net output #0: loss = 0.4 (* 1 = 0.4 loss)\n"
        "I0101 00:00:01.500000  1234 sgd_solver.cpp:105] Iteration 100, lr = 0.009\n")
    train, test = parse_log(log)
    assert [(r["NumIters"], r["LearningRate"], r["loss"]) for r in train] == [(0, 0.01, 2.31), (100, 0.009, 0.4)]
    assert train[1]["Seconds"] == pytest.approx(2.0)          # across the new year
    assert test == [{"NumIters": 0, "Seconds": pytest.approx(0.4), "accuracy": 0.1, "loss": 2.3,
                     "LearningRate": 0.01}]


def test_plot_training_log(run_folder, capsys):
    code, _, err = run(capsys, "train", "--solver", "solver.prototxt")
    (run_folder / "train.log").write_text(err)
    code, _, err = run(capsys, "plot_training_log", "train.log", "plot.png")
    if importlib.util.find_spec("matplotlib") is None:
        assert_one_line_error(code, err, "plot_training_log needs matplotlib")
    else:
        assert code == 0, err
        assert (run_folder / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_time_output_format(run_folder, capsys):
    code, _, err = run(capsys, "time", "-model", "net.prototxt", "-iterations", "3")
    assert code == 0, err
    text = messages(err)
    for name in ("data", "fc"):
        assert any(re.fullmatch(rf" *{name}\tforward: [0-9.e+-]+ ms\.", m) for m in text), text
        assert any(re.fullmatch(rf" *{name}\tbackward: [0-9.e+-]+ ms\.", m) for m in text), text
    assert [m for m in text if m.startswith("      data\t")]              # names right-aligned in 10
    for label in ("Average Forward pass", "Average Backward pass", "Average Forward-Backward", "Total Time"):
        assert any(re.fullmatch(rf"{label}: [0-9.e+-]+ ms\.", m) for m in text), label
    assert sum(m.startswith("Iteration: ") and "forward-backward time" in m for m in text) == 3
    assert text.index("*** Benchmark begins ***") < text.index("*** Benchmark ends ***")


def test_time_and_test_phase_flag(run_folder, capsys):
    (run_folder / "net.prototxt").write_text(helpers.net_text() + """
layer { name: "only_test" type: "TestLinReg" bottom: "x" bottom: "t" top: "loss2"
        include { phase: TEST } inner_product_param { num_output: 2 } }
""")
    def timed_layers(*flags):
        code, _, err = run(capsys, "time", "-model", "net.prototxt", "-iterations", "1", *flags)
        assert code == 0, err
        return [m.split("\t")[0].strip() for m in messages(err) if "\tforward:" in m]
    assert timed_layers() == ["data", "fc"]                     # caffe time builds in TRAIN
    tested = timed_layers("-phase", "TEST")                      # Split layers join in, shared x and t
    assert tested[0] == "data" and tested[-2:] == ["fc", "only_test"]


def test_time_prints_caffes_per_layer_lines(run_folder, capsys):
    code, _, err = run(capsys, "time", "--model=net.prototxt", "--iterations=1")
    assert code == 0
    assert any(re.fullmatch(r" +fc\tforward: \S+ ms\.", m) for m in messages(err))
    assert any(re.fullmatch(r" +fc\tbackward: \S+ ms\.", m) for m in messages(err))


def test_test_command(run_folder, capsys):
    assert run(capsys, "train", "--solver", "solver.prototxt")[0] == 0
    code, _, err = run(capsys, "test", "-model", "net.prototxt", "-weights", "snap_iter_4.caffemodel",
                       "-iterations", "2")
    assert code == 0, err
    text = messages(err)
    net = cct.Net("net.prototxt", cct.TEST, weights="snap_iter_4.caffemodel")
    net.forward()
    loss = float(net.blobs["loss"].data)
    assert f"Batch 0, loss = {loss:.6g}" in text and f"Batch 1, loss = {loss:.6g}" in text
    assert f"Loss: {loss:.6g}" in text
    assert f"loss = {loss:.6g} (* 1 = {loss:.6g} loss)" in text


def test_device_query(capsys):
    code, _, err = run(capsys, "device_query")
    assert code == 0
    text = messages(err)
    assert any(m.startswith("Cores: ") for m in text)
    assert any(m.startswith("BLAS: ") for m in text)
    assert any(m.startswith("OpenCL") for m in text)


def test_upgrade_commands(tmp_path, capsys):
    (tmp_path / "v1.prototxt").write_text(
        'name: "old" input: "data" input_dim: 1 input_dim: 1 input_dim: 2 input_dim: 2 '
        'layers { name: "relu" type: RELU bottom: "data" top: "data" }')
    code, _, err = run(capsys, "upgrade_net_proto_text", tmp_path / "v1.prototxt", tmp_path / "new.prototxt")
    assert code == 0, err
    upgraded = text_format.Parse((tmp_path / "new.prototxt").read_text(), caffe_pb2.NetParameter())
    assert [(layer.name, layer.type) for layer in upgraded.layer] == [("input", "Input"), ("relu", "ReLU")]
    (tmp_path / "v1.caffemodel").write_bytes(
        text_format.Parse((tmp_path / "v1.prototxt").read_text(), caffe_pb2.NetParameter()).SerializeToString())
    code, _, err = run(capsys, "upgrade_net_proto_binary", tmp_path / "v1.caffemodel", tmp_path / "new.caffemodel")
    assert code == 0, err
    assert caffe_pb2.NetParameter.FromString((tmp_path / "new.caffemodel").read_bytes()) == upgraded
    (tmp_path / "solver.prototxt").write_text('net: "n" solver_type: NESTEROV base_lr: 0.1')
    code, _, err = run(capsys, "upgrade_solver_proto_text", tmp_path / "solver.prototxt", tmp_path / "s2.prototxt")
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


# --- refused input: one line, exit 1 -----------------------------------------------------------
def test_missing_solver_file(tmp_path, capsys):
    code, _, err = run(capsys, "train", "--solver", tmp_path / "nope.prototxt")
    assert_one_line_error(code, err, "nope.prototxt: file not found")


def test_solver_pointing_at_a_missing_net(run_folder, capsys):
    (run_folder / "solver.prototxt").write_text('net: "gone.prototxt" base_lr: 0.1 lr_policy: "fixed"')
    code, _, err = run(capsys, "train", "--solver", "solver.prototxt")
    assert_one_line_error(code, err, "solver.prototxt: net: net file 'gone.prototxt' not found")


def test_corrupt_solverstate(run_folder, capsys):
    (run_folder / "bad.solverstate").write_bytes(b"\x0a\xff\xff\xff\xff\x0f garbage")
    code, _, err = run(capsys, "train", "--solver", "solver.prototxt", "--snapshot", "bad.solverstate")
    assert_one_line_error(code, err, "bad.solverstate: not a valid binary SolverState")


@pytest.mark.parametrize("argv, fragment", [
    (["train"], "--solver: need a solver definition to train"),
    (["train", "-solver", "solver.prototxt", "-snapshot", "a", "-weights", "b"], "not both"),
    (["train", "-solver", "solver.prototxt", "-weights", "missing.caffemodel"],
     "missing.caffemodel: weight file not found"),
    (["test", "-model", "net.prototxt"], "--weights: need model weights to score"),
    (["time"], "--model: need a model definition to time"),
    (["time", "-model", "net.prototxt", "-iterations", "0"], "--iterations: must be > 0, got 0"),
    (["time", "-model", "missing.prototxt"], "missing.prototxt: file not found"),
    (["parse_log", "missing.log", "."], "missing.log: log file not found"),
    (["upgrade_net_proto_text", "missing.prototxt", "out.prototxt"], "missing.prototxt: file not found"),
])
def test_refused_preconditions(argv, fragment, run_folder, capsys):
    code, _, err = run(capsys, *argv)
    assert_one_line_error(code, err, fragment)


def test_bad_net_in_time_is_one_line(run_folder, capsys):
    (run_folder / "bad.prototxt").write_text('layer { name: "x" type: "NoSuchLayer" top: "y" }')
    code, _, err = run(capsys, "time", "-model", "bad.prototxt")
    assert_one_line_error(code, err, "unknown layer type 'NoSuchLayer'")


def test_missing_tool_module_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "cct.cli.compare", None)      # makes the import fail
    code, _, err = run(capsys, "compare")
    assert_one_line_error(code, err, "no cct.cli.compare")


def test_console_script_in_a_process(tmp_path):
    finished = subprocess.run([sys.executable, "-m", "cct.cli", "train", "-solver", str(tmp_path / "no.prototxt")],
                              capture_output=True, text=True, timeout=60)
    assert finished.returncode == 1
    assert finished.stderr.strip().splitlines() == [f"cct: error: {tmp_path / 'no.prototxt'}: file not found"]
