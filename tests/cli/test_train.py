"""`cct train` and `cct test` (cct.cli.train) on helpers.linreg's net: flag
styles, resuming and fine-tuning, level and stages, and the lines `cct test` logs."""
import sys

import numpy as np
import pytest

import cct
from cct.proto import caffe_pb2
from helpers.cli import messages, run_cct
from helpers.layers import PYCAFFE_DOUBLE_LAYER
from helpers.linreg import net_text


@pytest.mark.parametrize("style", [["--solver=solver.prototxt"], ["--solver", "solver.prototxt"],
                                   ["-solver", "solver.prototxt"], ["-solver=solver.prototxt"]])
def test_train_flag_styles(style, run_folder, capsys):
    code, _, err = run_cct(capsys, "train", *style, "-sigint_effect", "stop")
    assert code == 0, err
    lines = messages(err)
    assert "Optimization Done." in lines
    assert sorted(p.name for p in run_folder.glob("snap_iter_*")) == [
        "snap_iter_2.caffemodel", "snap_iter_2.solverstate", "snap_iter_4.caffemodel", "snap_iter_4.solverstate"]


@pytest.mark.opencl
def test_train_on_an_opencl_device(run_folder, capsys, monkeypatch):
    """--gpu 0: the layers with a device path train on the device (set_mode_gpu), and
    the weights match a host run's; an id that does not exist is a one-line error."""
    from cct.runtime import settings
    from helpers.devices import opencl_or_skip
    device = opencl_or_skip()
    code, _, err = run_cct(capsys, "train", "-solver", "solver.prototxt", "--gpu", "0")
    assert code == 0, err
    assert f"Using OpenCL device 0: {device.name}" in messages(err)
    on_device = cct.Net(str(run_folder / "net.prototxt"), cct.TEST, weights=str(run_folder / "snap_iter_4.caffemodel"))
    settings.set_mode("cpu")
    assert run_cct(capsys, "train", "-solver", "solver.prototxt")[0] == 0
    on_host = cct.Net(str(run_folder / "net.prototxt"), cct.TEST, weights=str(run_folder / "snap_iter_4.caffemodel"))
    for name, params in on_host.params.items():
        for ours, expected in zip(on_device.params[name], params):
            np.testing.assert_allclose(ours.data, expected.data, rtol=1e-4, atol=1e-6)
    code, _, err = run_cct(capsys, "train", "-solver", "solver.prototxt", "--gpu", "7")
    assert code != 0 and "OpenCL device 7: there are" in err


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


def test_train_first_log_line_says_what_import_caffe_gives(run_folder, capsys, monkeypatch):
    code, _, err = run_cct(capsys, "train", "--solver=solver.prototxt")
    assert code == 0, err
    assert messages(err)[0].startswith("import caffe: cct")
    monkeypatch.delitem(sys.modules, "caffe", raising=False)      # not imported yet, and turned off
    monkeypatch.setenv("CCT_CAFFE_ALIAS", "0")
    code, _, err = run_cct(capsys, "train", "--solver=solver.prototxt")
    assert messages(err)[0] == "import caffe: no module named 'caffe' (cct's alias is turned off: CCT_CAFFE_ALIAS=0)"


PYCAFFE_LAYER_NET = '''
layer { name: "data" type: "DummyData" top: "x" top: "t"
        dummy_data_param { shape { dim: 4 dim: 3 } shape { dim: 4 dim: 2 }
                           data_filler { type: "gaussian" } data_filler { type: "constant" value: 1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y"
        inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "double" type: "Python" bottom: "y" top: "y2"
        python_param { module: "cct_pycaffe_layer" layer: "Double" } }
layer { name: "loss" type: "EuclideanLoss" bottom: "y2" bottom: "t" top: "loss" }
'''


def test_train_a_net_with_a_pycaffe_python_layer_unchanged(run_folder, capsys, monkeypatch):
    (run_folder / "cct_pycaffe_layer.py").write_text(PYCAFFE_DOUBLE_LAYER)
    (run_folder / "net.prototxt").write_text(PYCAFFE_LAYER_NET)
    (run_folder / "solver.prototxt").write_text('net: "net.prototxt" base_lr: 0.05 lr_policy: "fixed" max_iter: 30 '
                                                'display: 10 snapshot_after_train: false random_seed: 1')
    monkeypatch.syspath_prepend(str(run_folder))
    monkeypatch.delitem(sys.modules, "cct_pycaffe_layer", raising=False)
    code, _, err = run_cct(capsys, "train", "--solver=solver.prototxt")
    assert code == 0, err
    losses = [float(m.rsplit("= ", 1)[1]) for m in messages(err) if m.startswith("Iteration") and "loss = " in m]
    assert losses[-1] < 0.5 * losses[0]
    module = sys.modules.pop("cct_pycaffe_layer")
    assert module.caffe is cct and issubclass(module.Double, cct.Layer)
    # The trust boundary, in the log: the code a Python layer brings in is named at load.
    assert (f"net.prototxt: layer 'double' (Python): runs Python code: imported module 'cct_pycaffe_layer' "
            f"({module.__file__}) for class 'Double'") in messages(err)


@pytest.mark.parametrize("command, flag", [("train", "--solver"), ("test", "--model"), ("time", "--model")])
def test_help_says_a_python_layer_runs_code(command, flag, capsys):
    with pytest.raises(SystemExit):
        run_cct(capsys, command, "--help")
    shown = " ".join(capsys.readouterr().out.split())
    assert f"{flag} {flag[2:].upper()} the " in shown
    assert "a Python layer in" in shown and "runs the code of the module it names, as in Caffe" in shown


def test_train_with_the_test_net_on_the_training_lmdb(tmp_path, monkeypatch, capsys):
    """One LMDB read by the train and the test net of one run (issue 16): the
    two data layers share its environment."""
    import numpy as np
    from helpers.data import raw_datum, write_lmdb
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    write_lmdb(tmp_path / "train_lmdb", [raw_datum(rng.integers(0, 256, (1, 6, 6), dtype=np.uint8), index % 3)
                                         for index in range(10)])
    data = ('layer {{ name: "data" type: "Data" top: "data" top: "label" include {{ phase: {phase} }} '
            'data_param {{ source: "train_lmdb" batch_size: {batch} backend: LMDB }} '
            'transform_param {{ scale: 0.0039 }} }}\n')
    (tmp_path / "net.prototxt").write_text(
        data.format(phase="TRAIN", batch=4) + data.format(phase="TEST", batch=5)
        + 'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" '
          'inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }\n'
          'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }\n')
    (tmp_path / "solver.prototxt").write_text(
        'net: "net.prototxt" base_lr: 0.01 lr_policy: "fixed" max_iter: 4 display: 2 test_iter: 2 '
        'test_interval: 2 snapshot_after_train: false')
    code, _, err = run_cct(capsys, "train", "--solver", "solver.prototxt")
    assert code == 0, err
    assert sum("Test net output #0: loss" in message for message in messages(err)) == 3
