"""`cct compare`: every Caffe reference case passes; a perturbed weight file
fails with the perturbed layer first and exit status 1; single-file dumps;
a reference computed by another interpreter's `import caffe`."""
import sys

import numpy as np
import pytest

import cct
from cct.cli.compare import compare, main
from helpers.reference import CASE_NAMES, CASES

LENET = CASES / "lenet_sgd"


def case_args(name):
    folder = CASES / name
    return str(folder / "net.prototxt"), str(folder / "weights.caffemodel"), str(folder)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_every_reference_case_passes(name):
    rows = compare(*case_args(name))
    failing = [(r.kind, r.name, r.relative_error, r.note) for r in rows if not r.passed]
    assert failing == []
    assert {r.kind for r in rows} == {"data", "diff"}


@pytest.fixture(scope="module")
def perturbed_weights(tmp_path_factory):
    net = cct.Net(str(LENET / "net.prototxt"), cct.TRAIN, weights=str(LENET / "weights.caffemodel"))
    net.params["conv2"][0].data[1, 2, 3, 4] += 0.5
    path = tmp_path_factory.mktemp("bad") / "bad.caffemodel"
    net.save(str(path))
    return str(path)


def test_perturbed_weights_fail_first_in_net_order(perturbed_weights, capsys):
    rows = compare(str(LENET / "net.prototxt"), perturbed_weights, str(LENET))
    failing = [r for r in rows if not r.passed]
    assert rows[:len(failing)] == failing                      # failing rows first
    assert (failing[0].kind, failing[0].name, failing[0].first_index) == ("data", "param/conv2/0", (1, 2, 3, 4))
    assert [r.name for r in failing if r.kind == "data"] == ["param/conv2/0", "conv2", "pool2", "ip1", "ip2", "loss"]
    passing = {r.name for r in rows if r.passed and r.kind == "data"}
    assert {"data", "conv1", "pool1", "param/conv1/0"} <= passing

    status = main([str(LENET / "net.prototxt"), perturbed_weights, str(LENET)])
    assert status == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:3] == ["FAIL", "data", "param/conv2/0"]
    assert "20 FAIL" in lines[-1]


def test_main_passes_with_exit_status_0(capsys):
    assert main(list(case_args("conv_basic")) + ["--tolerance", "1e-4"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and "8 of 8 arrays within relative error 0.0001" in out


@pytest.mark.parametrize("fmt", ["npz", "h5"])
def test_single_file_reference(tmp_path, fmt):
    forward, backward = np.load(LENET / "forward.npz"), np.load(LENET / "backward.npz")
    arrays = {key: forward[key] for key in forward.files}
    arrays.update({"diff/" + key: backward[key] for key in backward.files})
    arrays["ip1"] = arrays["ip1"] + 1.0                    # one blob off
    if fmt == "npz":
        path = tmp_path / "dump.npz"
        np.savez(path, **arrays)
    else:
        import h5py
        path = tmp_path / "dump.h5"
        with h5py.File(path, "w") as out:
            for key, value in arrays.items():
                out.create_dataset(key, data=value)
    rows = compare(str(LENET / "net.prototxt"), str(LENET / "weights.caffemodel"), str(path), phase=cct.TRAIN)
    assert [(r.kind, r.name) for r in rows if not r.passed] == [("data", "ip1")]
    assert len(rows) == len(forward.files) + len(backward.files)


@pytest.mark.slow
def test_reference_from_another_interpreter(tmp_path, capsys):
    # A stand-in for BVLC Caffe: a `caffe` package that is cct, imported by a subprocess.
    shim = tmp_path / "shim" / "caffe"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("from cct import *\nfrom cct import Net, TRAIN, TEST, set_mode_cpu\n")
    keep = tmp_path / "made"
    status = main([str(LENET / "net.prototxt"), str(LENET / "weights.caffemodel"),
                   "--caffe-python", sys.executable, "--caffe-pythonpath", str(shim.parent),
                   "--phase", "TRAIN", "--keep", str(keep)])
    out = capsys.readouterr().out
    assert status == 0, out
    assert {"forward.npz", "backward.npz", "inputs.npz", "phase.txt"} <= {p.name for p in keep.iterdir()}
    assert np.load(keep / "inputs.npz")["label"].tolist() == [0.0] * 8


def test_usage_errors_exit_2(tmp_path, capsys):
    prototxt, weights, _ = case_args("absval")
    assert main([prototxt, weights]) == 2
    assert "exactly one" in capsys.readouterr().err
    assert main([prototxt, weights, str(tmp_path / "missing.npz")]) == 2
    assert "reference not found" in capsys.readouterr().err
    failing_python = tmp_path / "python"
    failing_python.write_text("#!/bin/sh\necho 'ImportError: No module named caffe' >&2\nexit 1\n")
    failing_python.chmod(0o755)
    assert main([prototxt, weights, "--caffe-python", str(failing_python)]) == 2
    assert "No module named caffe" in capsys.readouterr().err
