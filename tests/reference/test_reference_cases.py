"""Every case produced by BVLC Caffe 1.0 (see cases/README.md): forward and
backward of every blob and parameter within 1e-4 relative (max abs error over
the reference's max abs value, floored at 1e-6), as the cases' README defines.
Loading and comparing the cases is helpers.reference's (the convolution tests
run the conv cases under every lowering with it). TEST-phase cases run with
inference fusion (cct.runtime.fusion) on and off; TRAIN-phase nets never fuse."""
import numpy as np
import pytest

import cct
from cct.runtime.settings import FUSION_ENV
from helpers.reference import CASES, CASE_NAMES, TOLERANCE, assert_matches_caffe, relative_error, run_case


def _phase(name):
    return (CASES / name / "phase.txt").read_text().strip()


RUNS = [(name, fusion) for name in CASE_NAMES
        for fusion in (("on", "off") if _phase(name) == "TEST" else ("off",))]


@pytest.mark.parametrize("name, fusion", RUNS, ids=[f"{name}-fusion_{fusion}" for name, fusion in RUNS])
def test_forward_backward_match_caffe(name, fusion, partitions, schedule, monkeypatch):
    """At 1 and 2 partitions (the conftest fixture): at 2, every layer that
    allows it runs as 2 batch partitions in parallel; in the sequential and
    the streams schedule; TEST-phase cases with fusion on and off."""
    monkeypatch.setenv(FUSION_ENV, "1" if fusion == "on" else "0")
    net = run_case(name)
    assert net.executor.schedule == schedule
    assert (net.executor.fusion is not None) == (fusion == "on")
    assert_matches_caffe(net, name)


# The cases whose convolutions at stride 1 Winograd can run, and how many with
# each tile size: F(2x2, 3x3) and F(2x2, 5x5) at 2, F(4x4, 3x3) at 4
# (caffenet_mini_test: conv3-5 are 3 x 3, conv2 5 x 5).
WINOGRAD_CASES = {"conv_basic": (1, 1), "conv_few_in_many_out": (1, 1), "conv_many_in_few_out": (1, 1),
                  "caffenet_mini_test": (4, 3)}


@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("name", sorted(WINOGRAD_CASES))
def test_winograd_forwards_match_caffe(name, m, tmp_path, monkeypatch):
    """A convolution whose net never runs its backward computes its forward by
    Winograd (cct.lowering.winograd) when asked: the case's net made forward
    only (force_backward and loss layers taken out), its blobs against Caffe's
    forward.npz, with every 3 x 3 (and at m = 2 every 5 x 5) convolution at
    stride 1 on Winograd."""
    from cct.formats.prototxt import read_net
    param = read_net(str(CASES / name / "net.prototxt"))
    param.force_backward = False
    for layer in [layer for layer in param.layer if layer.type.endswith("Loss")]:
        param.layer.remove(layer)
    (tmp_path / "net.prototxt").write_text(str(param))
    monkeypatch.setenv("CCT_WINOGRAD", str(m))
    net = cct.Net(str(tmp_path / "net.prototxt"), cct.TEST, weights=str(CASES / name / "weights.caffemodel"))
    assert sum(getattr(layer, "winograd_tile", 0) == m for layer in net.layers) == WINOGRAD_CASES[name][m // 4]
    for blob_name, values in np.load(CASES / name / "inputs.npz").items():
        net.blobs[blob_name].data[...] = values
    net.forward()
    expected = np.load(CASES / name / "forward.npz")
    errors = {key: relative_error(net.blobs[key].data, expected[key]) for key in expected.files if key in net.blobs}
    assert len(errors) >= 2 and max(errors.values()) <= TOLERANCE, errors
