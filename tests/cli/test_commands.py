"""The `cct` command line (cct.cli, cct.cli.commands): flag spellings, and bad
input ending in one `cct: error: ...` line with exit status 1, never a traceback."""
import subprocess
import sys

import pytest

from cct import cli
from helpers.cli import assert_one_line_error, run_cct


def test_normalize_flags():
    argv = ["train", "-solver", "s.prototxt", "-weights=a,b", "--level", "-1", "-h", "--stage=x", "--", "-keep"]
    assert cli.normalize_flags(argv) == ["train", "--solver", "s.prototxt", "--weights=a,b", "--level", "-1",
                                         "-h", "--stage=x", "--", "-keep"]


# --- refused input: one line, exit 1 -----------------------------------------------------------
def test_missing_solver_file(tmp_path, capsys):
    code, _, err = run_cct(capsys, "train", "--solver", tmp_path / "nope.prototxt")
    assert_one_line_error(code, err, "nope.prototxt: file not found")


def test_solver_pointing_at_a_missing_net(run_folder, capsys):
    (run_folder / "solver.prototxt").write_text('net: "gone.prototxt" base_lr: 0.1 lr_policy: "fixed"')
    code, _, err = run_cct(capsys, "train", "--solver", "solver.prototxt")
    assert_one_line_error(code, err, "solver.prototxt: net: net file 'gone.prototxt' not found")


def test_corrupt_solverstate(run_folder, capsys):
    (run_folder / "bad.solverstate").write_bytes(b"\x0a\xff\xff\xff\xff\x0f garbage")
    code, _, err = run_cct(capsys, "train", "--solver", "solver.prototxt", "--snapshot", "bad.solverstate")
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
    code, _, err = run_cct(capsys, *argv)
    assert_one_line_error(code, err, fragment)


def test_bad_net_in_time_is_one_line(run_folder, capsys):
    (run_folder / "bad.prototxt").write_text('layer { name: "x" type: "NoSuchLayer" top: "y" }')
    code, _, err = run_cct(capsys, "time", "-model", "bad.prototxt")
    assert_one_line_error(code, err, "unknown layer type 'NoSuchLayer'")


def test_console_script_in_a_process(tmp_path):
    finished = subprocess.run([sys.executable, "-m", "cct.cli", "train", "-solver", str(tmp_path / "no.prototxt")],
                              capture_output=True, text=True, timeout=60)
    assert finished.returncode == 1
    assert finished.stderr.strip().splitlines() == [f"cct: error: {tmp_path / 'no.prototxt'}: file not found"]
