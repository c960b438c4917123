"""Every case produced by BVLC Caffe 1.0 (see cases/README.md): forward and
backward of every blob and parameter within 1e-4 relative (max abs error over
the reference's max abs value, floored at 1e-6), as the cases' README defines.
Loading and comparing the cases is helpers.reference's (the convolution tests
run the conv cases under every lowering with it)."""
import pytest

from helpers.reference import CASE_NAMES, assert_matches_caffe, run_case


@pytest.mark.parametrize("name", CASE_NAMES)
def test_forward_backward_match_caffe(name, partitions, schedule):
    """At 1 and 2 partitions (the conftest fixture): at 2, every layer that
    allows it runs as 2 batch partitions in parallel; in the sequential and
    the streams schedule."""
    net = run_case(name)
    assert net.executor.schedule == schedule
    assert_matches_caffe(net, name)
