"""Every case produced by BVLC Caffe 1.0 (see cases/README.md): forward and
backward of every blob and parameter within 1e-4 relative (max abs error over
the reference's max abs value, floored at 1e-6), as the cases' README defines."""
from pathlib import Path

import numpy as np
import pytest

import cct

CASES = Path(__file__).parent / "cases"
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
    return {key: err for key in expected.files
            if (err := relative_error(value_of(net, key, field), expected[key])) > TOLERANCE}


def run_case(name):
    net, inputs, top_diffs = load_case(name)
    for blob_name, values in inputs.items():
        net.blobs[blob_name].data[...] = values
    net.forward()
    for blob_name, values in top_diffs.items():
        net.blobs[blob_name].diff[...] = values
    net.backward()
    return net


@pytest.mark.parametrize("partitions", [1, 2])
@pytest.mark.parametrize("name", CASE_NAMES)
def test_forward_backward_match_caffe(name, partitions, monkeypatch):
    """partitions 2: every layer that allows it runs as 2 batch partitions in parallel."""
    monkeypatch.setenv("CCT_PARTITIONS", str(partitions))
    net = run_case(name)
    folder = CASES / name
    forward = np.load(folder / "forward.npz")
    backward = np.load(folder / "backward.npz")
    assert mismatches(net, forward, "data") == {}
    assert mismatches(net, backward, "diff") == {}
