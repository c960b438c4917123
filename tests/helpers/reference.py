"""BVLC Caffe 1.0's reference cases (tests/reference/cases, see its README.md):
a case's net with Caffe's weights, inputs and top diffs loaded, run forward and
backward, and the blobs or parameters further than TOLERANCE from Caffe's
(max abs error over the reference's max abs value, floored at 1e-6)."""
from pathlib import Path

import numpy as np

import cct

CASES = Path(__file__).resolve().parents[1] / "reference" / "cases"
CASE_NAMES = sorted(p.name for p in CASES.iterdir() if (p / "net.prototxt").exists())
TOLERANCE = 1e-4


def relative_error(ours, reference):
    reference = np.asarray(reference, np.float64)
    ours = np.asarray(ours, np.float64).reshape(reference.shape)
    scale = max(float(np.abs(reference).max(initial=0.0)), 1e-6)
    return float(np.abs(ours - reference).max(initial=0.0)) / scale


def load_case(name):
    folder = CASES / name
    phase = cct.TRAIN if (folder / "phase.txt").read_text().strip() == "TRAIN" else cct.TEST
    net = cct.Net(str(folder / "net.prototxt"), phase, weights=str(folder / "weights.caffemodel"))
    inputs = dict(np.load(folder / "inputs.npz"))
    top_diffs = dict(np.load(folder / "top_diffs.npz")) if (folder / "top_diffs.npz").exists() else {}
    return net, inputs, top_diffs


def value_of(net, key, field):
    if key.startswith("param/"):
        _, layer, index = key.split("/")
        return getattr(net.params[layer][int(index)], field)
    return getattr(net.blobs[key], field)


def mismatches(net, expected, field):
    """{blob or param key: relative error} where `field` ("data" or "diff") is off."""
    return {key: err for key in expected.files
            if (err := relative_error(value_of(net, key, field), expected[key])) > TOLERANCE}


def run_case(name):
    """The case's net after one forward and one backward from Caffe's inputs and top diffs."""
    net, inputs, top_diffs = load_case(name)
    for blob_name, values in inputs.items():
        net.blobs[blob_name].data[...] = values
    net.forward()
    for blob_name, values in top_diffs.items():
        net.blobs[blob_name].diff[...] = values
    net.backward()
    return net


def assert_matches_caffe(net, name):
    """The net's blob data and diffs against the case's forward.npz and backward.npz."""
    folder = CASES / name
    assert mismatches(net, np.load(folder / "forward.npz"), "data") == {}
    assert mismatches(net, np.load(folder / "backward.npz"), "diff") == {}


def run_solver_case(case):
    """A solver case (steps.npz) from its folder, which must be the current
    directory (its solver names net.prototxt relatively): Caffe's weights
    loaded, each step fed its batch. Returns the solver; assert_solver_matches_caffe checks it."""
    from cct.training import solver as solver_module
    steps = np.load("steps.npz")
    solver = solver_module.get_solver("solver.prototxt")
    solver.net.copy_from("weights.caffemodel")
    batch = {key[len("batch/"):]: steps[key] for key in steps.files if key.startswith("batch/")}
    solver.case_losses = []
    for _ in range(len(steps["losses"])):
        for name, values in batch.items():
            solver.net.blobs[name].data[...] = values
        solver.step(1)
        solver.case_losses.append(float(solver.net.blobs["loss"].data))
    return solver


def assert_solver_matches_caffe(solver, tolerance=1e-3):
    """The losses after each step and the final weights within `tolerance` of Caffe's."""
    steps = np.load("steps.npz")
    assert relative_error(solver.case_losses, steps["losses"]) < tolerance
    for key in steps.files:
        if key.startswith("final/"):
            _, layer, index = key.split("/")
            assert relative_error(solver.net.params[layer][int(index)].data, steps[key]) < tolerance, key
