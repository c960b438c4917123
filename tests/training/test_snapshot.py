"""Snapshots: file names and contents in both formats, restore continuing
exactly (N steps + snapshot + restore + M steps == N + M steps, bitwise),
refused states, a `cct train` killed mid-run that resumes from its latest
snapshot, and --sigint_effect/--sighup_effect as Caffe's (stop, snapshot, none;
tools/caffe.cpp and Solver::Step). tests/training/test_kill.py kills it at
random moments."""
import os
import re
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
from google.protobuf import text_format

import cct
from cct.training import solver as solver_module
from cct.core.errors import ConfigError
from cct.proto import caffe_pb2
from helpers.linreg import SOLVER_CASES, make_solver, net_text

FORMATS = {"BINARYPROTO": (".caffemodel", ".solverstate"), "HDF5": (".caffemodel.h5", ".solverstate.h5")}


def solver_text(kind, prefix, snapshot_format="BINARYPROTO", extra=""):
    text, _ = SOLVER_CASES[kind]
    lr = 1.0 if kind == "AdaDelta" else 0.05
    return (f'{text} base_lr: {lr} lr_policy: "multistep" gamma: 0.5 stepvalue: 2 stepvalue: 4 '
            f'weight_decay: 0.01 snapshot_prefix: "{prefix}" snapshot_format: {snapshot_format} {extra}')


def state_of(solver):
    return ([b.data.copy() for b in solver.net.learnable_params], [h.copy() for h in solver.history],
            solver.iter, solver.current_step)


@pytest.mark.parametrize("snapshot_format", sorted(FORMATS))
@pytest.mark.parametrize("kind", sorted(SOLVER_CASES))
def test_restore_continues_exactly(kind, snapshot_format, tmp_path):
    text = solver_text(kind, tmp_path / "run", snapshot_format)
    straight = make_solver(text)
    straight.step(3)
    state_path = straight.snapshot()
    straight.step(4)

    resumed = make_solver(text)
    for blob in resumed.net.learnable_params:     # prove the weights come from the snapshot
        blob.data[...] = 123.0
    resumed.restore(state_path)
    assert resumed.iter == 3 and resumed.current_step == 1
    resumed.step(4)
    ours, theirs = state_of(resumed), state_of(straight)
    for a, b in zip(ours[0] + ours[1], theirs[0] + theirs[1]):
        np.testing.assert_array_equal(a, b)
    assert ours[2:] == theirs[2:] == (7, 2)


def test_binaryproto_snapshot_files(tmp_path):
    solver = make_solver(solver_text("Adam", tmp_path / "lin", extra="snapshot_diff: true"))
    solver.step(3)
    state_path = solver.snapshot()
    assert state_path == f"{tmp_path}/lin_iter_3.solverstate"
    assert sorted(os.listdir(tmp_path)) == ["lin_iter_3.caffemodel", "lin_iter_3.solverstate"]
    state = caffe_pb2.SolverState.FromString(open(state_path, "rb").read())
    assert state.iter == 3 and state.current_step == 1
    assert state.learned_net == f"{tmp_path}/lin_iter_3.caffemodel"
    assert len(state.history) == 4                 # Adam: m for W, b, then v for W, b (Caffe's order)
    np.testing.assert_array_equal(np.array(state.history[2].data).reshape(2, 3), solver.history[2])
    assert list(state.history[0].shape.dim) == [2, 3]
    model = caffe_pb2.NetParameter.FromString(open(state.learned_net, "rb").read())
    fc = [layer for layer in model.layer if layer.name == "fc"][0]
    np.testing.assert_array_equal(np.array(fc.blobs[0].data).reshape(2, 3), solver.net.params["fc"][0].data)
    assert len(fc.blobs[0].diff) == 6              # snapshot_diff writes the gradients too
    net = cct.Net(text_format.Parse(net_text(), caffe_pb2.NetParameter()), cct.TEST,
                  weights=state.learned_net)
    np.testing.assert_array_equal(net.params["fc"][1].data, solver.net.params["fc"][1].data)


def test_hdf5_snapshot_files_have_caffes_layout(tmp_path):
    solver = make_solver(solver_text("AdaDelta", tmp_path / "lin", "HDF5"))
    solver.step(3)
    state_path = solver.snapshot()
    assert sorted(os.listdir(tmp_path)) == ["lin_iter_3.caffemodel.h5", "lin_iter_3.solverstate.h5"]
    with h5py.File(state_path, "r") as state:
        assert int(state["iter"][0]) == 3 and int(state["current_step"][0]) == 1
        assert state["learned_net"][()].decode() == f"{tmp_path}/lin_iter_3.caffemodel.h5"
        assert sorted(state["history"]) == ["0", "1", "2", "3"]
        np.testing.assert_array_equal(state["history/3"][...], solver.history[3])
    with h5py.File(f"{tmp_path}/lin_iter_3.caffemodel.h5", "r") as model:
        np.testing.assert_array_equal(model["data/fc/0"][...], solver.net.params["fc"][0].data)


def test_periodic_snapshots_and_snapshot_after_train(tmp_path):
    solver = make_solver(f'base_lr: 0.1 lr_policy: "fixed" max_iter: 7 snapshot: 3 '
                         f'snapshot_prefix: "{tmp_path}/p"')
    solver.solve()
    names = sorted(os.listdir(tmp_path))
    assert names == [f"p_iter_{i}.{ext}" for i in (3, 6, 7) for ext in ("caffemodel", "solverstate")]
    # No snapshot_after_train duplicate when max_iter is a multiple of snapshot.
    again = make_solver(f'base_lr: 0.1 lr_policy: "fixed" max_iter: 6 snapshot: 3 '
                        f'snapshot_prefix: "{tmp_path}/q"')
    again.solve()
    assert len([n for n in os.listdir(tmp_path) if n.startswith("q_")]) == 4


def test_solve_resumes_from_a_state_file(tmp_path):
    text = f'base_lr: 0.1 lr_policy: "fixed" momentum: 0.9 max_iter: 5 snapshot_prefix: "{tmp_path}/r"'
    first = make_solver(text)
    first.step(2)
    state_path = first.snapshot()
    first.step(3)
    resumed = make_solver(text)
    resumed.solve(state_path)
    assert resumed.iter == 5
    np.testing.assert_array_equal(resumed.net.params["fc"][0].data, first.net.params["fc"][0].data)


def test_a_moved_run_finds_its_weights_beside_the_state(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    solver = make_solver('base_lr: 0.1 lr_policy: "fixed" snapshot_prefix: "snaps/m"')
    os.makedirs("snaps")
    solver.step(1)
    state_path = solver.snapshot()                  # learned_net: "snaps/m_iter_1.caffemodel"
    os.rename("snaps", "moved")
    restored = make_solver('base_lr: 0.1 lr_policy: "fixed"')
    restored.restore(state_path.replace("snaps", "moved"))
    np.testing.assert_array_equal(restored.net.params["fc"][0].data, solver.net.params["fc"][0].data)


def test_refused_states(tmp_path):
    sgd = make_solver(solver_text("SGD", tmp_path / "sgd"))
    sgd.step(1)
    state_path = sgd.snapshot()
    adam = make_solver(solver_text("Adam", tmp_path / "adam"))
    with pytest.raises(ConfigError, match="has 2 history blobs, a Adam solver on this net needs 4"):
        adam.restore(state_path)
    corrupt = tmp_path / "corrupt.solverstate"
    corrupt.write_bytes(b"\xff\xff\xff\xff not a proto")
    with pytest.raises(ConfigError, match="corrupt.solverstate: not a valid binary SolverState"):
        sgd.restore(corrupt)
    with pytest.raises(ConfigError, match="missing.solverstate: solver state file not found"):
        sgd.restore(tmp_path / "missing.solverstate")
    os.remove(tmp_path / "sgd_iter_1.caffemodel")
    with pytest.raises(ConfigError, match="learned_net: weight file .*sgd_iter_1.caffemodel' not found"):
        sgd.restore(state_path)
    broken_h5 = tmp_path / "broken.solverstate.h5"
    broken_h5.write_bytes(b"not hdf5")
    with pytest.raises(ConfigError, match="not a readable HDF5 solver state"):
        sgd.restore(broken_h5)


def test_hdf5_states_are_checked_before_they_are_read(tmp_path):
    """Found by the fuzzer (issue 15): a history dataset declared as 2^31
    floats was read whole (8 GiB) before its size was compared; a group where
    `iter` belongs raised h5py's TypeError."""
    sgd = make_solver(solver_text("SGD", tmp_path / "sgd", "HDF5"))
    sgd.step(1)
    state_path = sgd.snapshot()
    with h5py.File(state_path, "r+") as state:
        del state["history/0"]
        state.create_dataset("history/0", shape=(2, 1 << 30), dtype="float32")   # never written: no disk
    with pytest.raises(ConfigError, match=r"history\[0\] has shape \(2, 1073741824\), the parameter has 6 values"):
        sgd.restore(state_path)
    with h5py.File(state_path, "r+") as state:
        del state["iter"]
        state.create_group("iter")
    with pytest.raises(ConfigError, match="'iter' is a group, expected a dataset"):
        sgd.restore(state_path)


def test_a_learned_net_that_is_not_a_file_is_a_clean_error(tmp_path):
    """Found by the fuzzer: a learned_net of bytes that are not UTF-8 mixed
    bytes and str in a path (TypeError); one naming a folder had the folder
    opened as the weights (IsADirectoryError)."""
    sgd = make_solver(solver_text("SGD", tmp_path / "sgd"))
    sgd.step(1)
    state_path = sgd.snapshot()
    state = caffe_pb2.SolverState.FromString(open(state_path, "rb").read())
    state.ClearField("learned_net")
    for learned_net, shown in ((b"sgd\xe9.caffemodel", r"'sgd\\udce9.caffemodel'"),
                               (str(tmp_path).encode(), re.escape(repr(str(tmp_path))))):
        assert len(learned_net) < 128            # its length is then one varint byte
        raw = state.SerializeToString() + b"\x12" + bytes([len(learned_net)]) + learned_net   # field 2, as bytes
        with open(state_path, "wb") as out:
            out.write(raw)
        with pytest.raises(ConfigError, match=f"learned_net: weight file {shown} not found"):
            sgd.restore(state_path)

def test_snapshot_leaves_no_temporary_files(tmp_path):
    for snapshot_format in FORMATS:
        solver = make_solver(solver_text("SGD", tmp_path / snapshot_format, snapshot_format))
        solver.step(1)
        solver.snapshot()
    assert not [name for name in os.listdir(tmp_path) if "tmp" in name]


# --- `cct train` as a process ------------------------------------------------------------------
TRAIN_NET = """
name: "tiny"
layer { name: "data" type: "DummyData" top: "x" top: "t"
  dummy_data_param { shape { dim: 16 dim: 8 } shape { dim: 16 dim: 4 }
                     data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 0.5 } } }
layer { name: "fc1" type: "InnerProduct" bottom: "x" top: "h"
  inner_product_param { num_output: 16 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu" type: "ReLU" bottom: "h" top: "h" }
layer { name: "fc2" type: "InnerProduct" bottom: "h" top: "y"
  inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "y" bottom: "t" top: "loss" }
"""


def write_run(folder, max_iter, snapshot=5, extra=""):
    (folder / "net.prototxt").write_text(TRAIN_NET)
    solver = folder / f"solver_{max_iter}.prototxt"
    solver.write_text(f'net: "{folder}/net.prototxt" base_lr: 0.01 lr_policy: "fixed" momentum: 0.9 '
                      f'max_iter: {max_iter} snapshot: {snapshot} snapshot_prefix: "{folder}/snap" '
                      f'display: 50 random_seed: 3 {extra}')
    return solver


def start_train(log_path, *flags):
    """`cct train` in its own process, its log going to `log_path` (a pipe could fill up)."""
    with open(log_path, "w") as log_file:
        return subprocess.Popen([sys.executable, "-m", "cct.cli", "train", *map(str, flags)],
                                stdout=subprocess.DEVNULL, stderr=log_file, text=True)


def wait_for(predicate, process, log_path, timeout=60):
    deadline = time.monotonic() + timeout
    while not predicate():
        if process.poll() is not None:
            raise AssertionError(f"cct train ended early ({process.returncode}):\n{log_path.read_text()}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"timed out waiting for cct train:\n{log_path.read_text()}")
        time.sleep(0.05)


def snapshot_iters(folder):
    return sorted(int(m.group(1)) for name in os.listdir(folder)
                  if (m := re.fullmatch(r"snap_iter_(\d+)\.solverstate", name)))


@pytest.mark.slow
def test_killed_training_resumes_from_its_latest_snapshot(tmp_path):
    solver_path = write_run(tmp_path, max_iter=10 ** 7)
    log_path = tmp_path / "train.log"
    process = start_train(log_path, f"--solver={solver_path}")
    wait_for(lambda: len(snapshot_iters(tmp_path)) >= 3, process, log_path)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    latest = snapshot_iters(tmp_path)[-1]
    state_path = tmp_path / f"snap_iter_{latest}.solverstate"

    solver = solver_module.get_solver(str(solver_path))
    solver.restore(state_path)                      # the newest complete snapshot loads
    assert solver.iter == latest

    resume_solver = write_run(tmp_path, max_iter=latest + 3)
    finished = subprocess.run([sys.executable, "-m", "cct.cli", "train", "-solver", str(resume_solver),
                               "-snapshot", str(state_path)], capture_output=True, text=True, timeout=120)
    assert finished.returncode == 0, finished.stderr
    assert "Restoring previous solver status from" in finished.stderr
    assert "Optimization Done." in finished.stderr
    assert latest + 3 in snapshot_iters(tmp_path)
    resumed = solver_module.get_solver(str(resume_solver))
    resumed.restore(tmp_path / f"snap_iter_{latest + 3}.solverstate")
    assert resumed.iter == latest + 3


@pytest.mark.slow
def test_sighup_snapshots_and_sigint_stops(tmp_path):
    solver_path = write_run(tmp_path, max_iter=10 ** 7, snapshot=0)
    log_path = tmp_path / "train.log"
    process = start_train(log_path, "--solver", solver_path)
    # The handlers are in place before solving starts, which the log announces.
    wait_for(lambda: "Learning Rate Policy" in log_path.read_text(), process, log_path)
    process.send_signal(signal.SIGHUP)
    wait_for(lambda: snapshot_iters(tmp_path), process, log_path)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=60) == 0, log_path.read_text()
    log = log_path.read_text()
    assert "SIGHUP received: snapshot" in log and "SIGINT received: stop" in log
    assert "Optimization stopped early." in log
    assert len(snapshot_iters(tmp_path)) == 2       # SIGHUP's, then the stop's (snapshot_after_train)


@pytest.mark.slow
def test_sigint_effect_snapshot_goes_on_and_sighup_effect_stop_stops(tmp_path):
    """As Caffe's Solver::Step: a 'snapshot' request snapshots and training goes
    on; a 'stop' request ends training, with the snapshot_after_train snapshot."""
    solver_path = write_run(tmp_path, max_iter=10 ** 7, snapshot=0)
    log_path = tmp_path / "train.log"
    process = start_train(log_path, "--solver", solver_path, "--sigint_effect=snapshot", "--sighup_effect=stop")
    wait_for(lambda: "Learning Rate Policy" in log_path.read_text(), process, log_path)
    process.send_signal(signal.SIGINT)
    wait_for(lambda: snapshot_iters(tmp_path), process, log_path)
    process.send_signal(signal.SIGHUP)
    assert process.wait(timeout=60) == 0, log_path.read_text()
    log = log_path.read_text()
    assert "SIGINT received: snapshot" in log and "SIGHUP received: stop" in log
    assert "Optimization stopped early." in log
    first, last = snapshot_iters(tmp_path)
    assert last > first                             # it trained on after the SIGINT snapshot


@pytest.mark.slow
@pytest.mark.parametrize("ignored, stopping", [("SIGINT", "SIGHUP"), ("SIGHUP", "SIGINT")])
def test_effect_none_ignores_and_stop_without_snapshot_after_train_writes_nothing(ignored, stopping, tmp_path):
    solver_path = write_run(tmp_path, max_iter=10 ** 7, snapshot=0, extra="snapshot_after_train: false")
    log_path = tmp_path / "train.log"
    effects = {ignored: "none", stopping: "stop"}
    process = start_train(log_path, "--solver", solver_path, f"--sigint_effect={effects['SIGINT']}",
                          f"--sighup_effect={effects['SIGHUP']}")
    wait_for(lambda: "Learning Rate Policy" in log_path.read_text(), process, log_path)
    process.send_signal(getattr(signal, ignored))
    wait_for(lambda: f"{ignored} received: none" in log_path.read_text(), process, log_path)
    # Still training: a display line (every 50 iterations) comes after the ignored signal.
    wait_for(lambda: "] Iteration" in log_path.read_text().split(f"{ignored} received: none")[1],
             process, log_path)
    process.send_signal(getattr(signal, stopping))
    assert process.wait(timeout=60) == 0, log_path.read_text()
    assert f"{stopping} received: stop" in log_path.read_text()
    assert "Optimization stopped early." in log_path.read_text()
    assert snapshot_iters(tmp_path) == []
