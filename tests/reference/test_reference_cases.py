"""Every case produced by BVLC Caffe 1.0 (see cases/README.md): forward and
backward of every blob and parameter within 1e-4 relative (max abs error over
the reference's max abs value, floored at 1e-6), as the cases' README defines.
Loading and comparing the cases is helpers.reference's (the convolution tests
run the conv cases under every lowering with it). TEST-phase cases run with
inference fusion (cct.runtime.fusion) on and off; TRAIN-phase nets never fuse."""
import pytest

from cct.runtime.settings import FUSION_ENV
from helpers.reference import CASES, CASE_NAMES, assert_matches_caffe, run_case


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
