"""Fuzzing what training reads (cct.training.solver, cct.training.snapshot):
solver prototxts, and .solverstate / .solverstate.h5 files restored into a
solver. Each ends as a CctError or runs."""
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cct.proto import caffe_pb2
from cct.training.solver import get_solver
from helpers.fuzz import attempt, byte_ops, fuzz_settings, hdf5_ops, message_ops, mutate_bytes, mutate_hdf5, \
    mutate_text, mutated_message_bytes, text_ops

pytestmark = pytest.mark.fuzz

NET = """name: "tiny"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 4 dim: 2 dim: 5 dim: 5 } shape { dim: 4 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 3 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""
SOLVERS = [
    'base_lr: 0.01 momentum: 0.9 weight_decay: 0.0005 lr_policy: "step" gamma: 0.1 stepsize: 2 '
    'max_iter: 10 display: 1 snapshot: 2 snapshot_prefix: "snap" random_seed: 1',
    'type: "Adam" base_lr: 0.001 momentum: 0.9 momentum2: 0.999 delta: 1e-8 lr_policy: "fixed" '
    'max_iter: 10 regularization_type: "L1" weight_decay: 0.001 snapshot_format: HDF5',
    'type: "Nesterov" base_lr: 0.01 momentum: 0.95 lr_policy: "multistep" stepvalue: 1 stepvalue: 3 '
    'gamma: 0.5 max_iter: 10 clip_gradients: 1 iter_size: 2 test_iter: 1 test_interval: 2 '
    'test_initialization: false average_loss: 2',
    'type: "AdaGrad" base_lr: 0.01 delta: 1e-8 lr_policy: "inv" gamma: 0.0001 power: 0.75 max_iter: 10',
    'type: "RMSProp" base_lr: 0.01 rms_decay: 0.98 lr_policy: "poly" power: 2 max_iter: 10',
    'type: "AdaDelta" base_lr: 1 momentum: 0.95 delta: 1e-6 lr_policy: "sigmoid" gamma: -0.1 '
    'stepsize: 5 max_iter: 10',
    'solver_type: NESTEROV base_lr: 0.01 lr_policy: "exp" gamma: 0.9 max_iter: 10 '
    'train_state { stage: "a" } momentum: 0.9',
]
# An input that would run long through no fault of cct (a test pass of 10^9
# batches): built and counted as run, not stepped.
MOST_ITERATIONS = 50


def _write_solver(folder, text):
    (folder / "net.prototxt").write_text(NET)
    path = folder / "solver.prototxt"
    path.write_bytes(f'net: "{folder / "net.prototxt"}"\nsnapshot_prefix: "{folder / "snap"}"\n'.encode() + text)
    return path


def _step(path, steps=3):
    solver = get_solver(str(path))
    param = solver.param
    if max([param.iter_size, *param.test_iter]) * (1 + steps) > MOST_ITERATIONS:
        return
    solver.step(steps)


@fuzz_settings()
@given(seed=st.integers(0, len(SOLVERS) - 1), edits=text_ops(), raw=byte_ops())
def test_solver_prototxt(seed, edits, raw):
    data = mutate_bytes(mutate_text(SOLVERS[seed].replace(" ", "\n").replace("\n{\n", " { "), edits).encode(), raw)
    with tempfile.TemporaryDirectory() as folder:
        path = _write_solver(Path(folder), data)
        attempt("solver", lambda: _step(path), lambda: data.decode(errors="replace"))


@pytest.fixture(scope="module")
def snapshots():
    """A binary and an HDF5 snapshot of the tiny net under SGD: (folder, solver text,
    binary state, HDF5 state path)."""
    folder = Path(tempfile.mkdtemp(prefix="cct-fuzz-state-"))
    text = b'base_lr: 0.01\nmomentum: 0.9\nlr_policy: "fixed"\nmax_iter: 10\n'
    solver = get_solver(str(_write_solver(folder, text)))
    solver.step(1)
    binary = Path(solver.snapshot())
    solver.param.snapshot_format = caffe_pb2.SolverParameter.HDF5
    hdf5 = Path(solver.snapshot())
    return folder, text, caffe_pb2.SolverState.FromString(binary.read_bytes()), hdf5


def _restore(folder, text, state_path):
    solver = get_solver(str(_write_solver(folder, text)))
    solver.restore(str(state_path))
    solver.step(1)


@fuzz_settings()
@given(edits=message_ops(), raw=byte_ops())
def test_solverstate(snapshots, edits, raw):
    folder, text, state, _ = snapshots
    data = mutated_message_bytes(state, edits, raw)
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "snap_iter_1.solverstate"
        path.write_bytes(data)
        attempt("solverstate", lambda: _restore(folder, text, path), lambda: repr(data[:600]))


@fuzz_settings()
@given(edits=hdf5_ops(), raw=byte_ops())
def test_solverstate_hdf5(snapshots, edits, raw):
    folder, text, _, hdf5 = snapshots
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "snap_iter_1.solverstate.h5"
        path.write_bytes(hdf5.read_bytes())
        mutate_hdf5(path, edits)
        path.write_bytes(mutate_bytes(path.read_bytes(), raw))
        attempt("solverstate h5", lambda: _restore(folder, text, path), lambda: f"{edits} {raw}")
