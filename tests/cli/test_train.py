"""`cct train` and `cct test` (cct.cli.train) on helpers.linreg's net: flag
styles, resuming and fine-tuning, level and stages, and the lines `cct test` logs."""
import pytest

import cct
from cct.proto import caffe_pb2
from helpers.cli import messages, run_cct
from helpers.linreg import net_text


@pytest.mark.parametrize("style", [["--solver=solver.prototxt"], ["--solver", "solver.prototxt"],
                                   ["-solver", "solver.prototxt"], ["-solver=solver.prototxt"]])
def test_train_flag_styles(style, run_folder, capsys):
    code, _, err = run_cct(capsys, "train", *style, "-sigint_effect", "stop", "--gpu=0")
    assert code == 0, err
    lines = messages(err)
    assert "--gpu=0: cct runs on the CPU; the flag is ignored" in lines
    assert "Optimization Done." in lines
    assert sorted(p.name for p in run_folder.glob("snap_iter_*")) == [
        "snap_iter_2.caffemodel", "snap_iter_2.solverstate", "snap_iter_4.caffemodel", "snap_iter_4.solverstate"]


def test_train_resume_and_finetune(run_folder, capsys):
    assert run_cct(capsys, "train", "-solver", "solver.prototxt")[0] == 0
    code, _, err = run_cct(capsys, "train", "-solver", "solver.prototxt", "-snapshot", "snap_iter_2.solverstate")
    assert code == 0, err
    assert "Restoring previous solver status from snap_iter_2.solverstate" in messages(err)
    code, _, err = run_cct(capsys, "train", "-solver", "solver.prototxt", "-weights", "snap_iter_4.caffemodel")
    assert code == 0, err
    assert "Loading weights from snap_iter_4.caffemodel" in messages(err)


def test_train_weights_flag_replaces_the_solvers_weights(run_folder, capsys):
    """caffe.cpp clears the solver's `weights:` when --weights or --snapshot is given."""
    assert run_cct(capsys, "train", "-solver", "solver.prototxt")[0] == 0
    solver = run_folder / "solver.prototxt"
    solver.write_text(solver.read_text() + ' weights: "does_not_exist.caffemodel"')
    code, _, err = run_cct(capsys, "train", "-solver", "solver.prototxt", "-weights", "snap_iter_4.caffemodel")
    assert code == 0, err
    assert "Loading weights from snap_iter_4.caffemodel" in messages(err)
    code, _, err = run_cct(capsys, "train", "-solver", "solver.prototxt", "-snapshot", "snap_iter_2.solverstate")
    assert code == 0, err


def test_train_level_and_stage_select_layers(run_folder, capsys):
    (run_folder / "net.prototxt").write_text(net_text() + """
layer { name: "deep" type: "TestLinReg" bottom: "x" bottom: "t" top: "loss2"
        include { stage: "deep" min_level: 2 } inner_product_param { num_output: 2 } }
""")
    def trained_layers(*flags):
        code, _, err = run_cct(capsys, "train", "-solver", "solver.prototxt", *flags)
        assert code == 0, err
        model = caffe_pb2.NetParameter.FromString((run_folder / "snap_iter_4.caffemodel").read_bytes())
        return [layer.name for layer in model.layer]
    assert "deep" not in trained_layers("-stage", "deep")
    assert "deep" not in trained_layers("-level", "2")
    assert "deep" in trained_layers("-level", "2", "-stage", "other,deep")


def test_test_command(run_folder, capsys):
    assert run_cct(capsys, "train", "--solver", "solver.prototxt")[0] == 0
    code, _, err = run_cct(capsys, "test", "-model", "net.prototxt", "-weights", "snap_iter_4.caffemodel",
                       "-iterations", "2")
    assert code == 0, err
    text = messages(err)
    net = cct.Net("net.prototxt", cct.TEST, weights="snap_iter_4.caffemodel")
    net.forward()
    loss = float(net.blobs["loss"].data)
    assert f"Batch 0, loss = {loss:.6g}" in text and f"Batch 1, loss = {loss:.6g}" in text
    assert f"Loss: {loss:.6g}" in text
    assert f"loss = {loss:.6g} (* 1 = {loss:.6g} loss)" in text
