"""Learning-rate policies against their formulas, evaluated by hand here."""
import math

import pytest
from google.protobuf import text_format

from cct.core.errors import ConfigError
from cct.training.lr_policy import learning_rate
from cct.proto import caffe_pb2


def solver(text):
    return text_format.Parse(text, caffe_pb2.SolverParameter())


def rates(param, iterations):
    """Rates for iterations 0..iterations-1, carrying the step counter along as the solver does."""
    out, step = [], 0
    for iteration in range(iterations):
        rate, step = learning_rate(param, iteration, step)
        out.append(rate)
    return out


def f32(value):
    """Proto floats are float32; the formulas below use the stored values."""
    import numpy as np
    return float(np.float32(value))


def test_fixed():
    assert rates(solver('lr_policy: "fixed" base_lr: 0.01'), 5) == [f32(0.01)] * 5


def test_step():
    param = solver('lr_policy: "step" base_lr: 0.1 gamma: 0.5 stepsize: 3')
    expected = [f32(0.1) * 0.5 ** (i // 3) for i in range(10)]
    assert rates(param, 10) == pytest.approx(expected, rel=1e-12)
    assert learning_rate(param, 7, 0)[1] == 2          # step keeps Caffe's current_step


def test_exp():
    param = solver('lr_policy: "exp" base_lr: 0.1 gamma: 0.9')
    assert rates(param, 6) == pytest.approx([f32(0.1) * f32(0.9) ** i for i in range(6)], rel=1e-12)


def test_inv():
    param = solver('lr_policy: "inv" base_lr: 0.01 gamma: 0.0001 power: 0.75')
    for i in (0, 1, 100, 10000):
        expected = f32(0.01) * (1 + f32(0.0001) * i) ** -f32(0.75)
        assert learning_rate(param, i)[0] == pytest.approx(expected, rel=1e-12)


def test_multistep_counter_advances_one_step_per_call():
    param = solver('lr_policy: "multistep" base_lr: 1 gamma: 0.1 stepvalue: 2 stepvalue: 4 stepvalue: 5')
    steps = [0, 0, 1, 1, 2, 3, 3]
    assert rates(param, 7) == pytest.approx([f32(0.1) ** k for k in steps], rel=1e-12)
    # A counter restored from a snapshot is used as is (Caffe's `if`, not `while`):
    # at iteration 10 with the counter at 0 only one step is taken.
    rate, step = learning_rate(param, 10, 0)
    assert step == 1 and rate == pytest.approx(f32(0.1))


def test_poly():
    param = solver('lr_policy: "poly" base_lr: 0.2 power: 2 max_iter: 10')
    assert rates(param, 11) == pytest.approx([f32(0.2) * (1 - i / 10) ** 2 for i in range(11)])
    assert learning_rate(param, 12)[0] == 0.0          # past max_iter: 0, not NaN


def test_sigmoid():
    param = solver('lr_policy: "sigmoid" base_lr: 0.5 gamma: 0.25 stepsize: 4')
    expected = [f32(0.5) / (1 + math.exp(-0.25 * (i - 4))) for i in range(10)]
    assert rates(param, 10) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("text, field", [
    ('lr_policy: "sttep" base_lr: 0.1', "lr_policy"),
    ('base_lr: 0.1', "lr_policy"),
    ('lr_policy: "step" base_lr: 0.1 gamma: 0.1', "stepsize"),
    ('lr_policy: "step" base_lr: 0.1 stepsize: 2 gamma: -1', "gamma"),
    ('lr_policy: "sigmoid" base_lr: 0.1 gamma: 0.1', "stepsize"),
    ('lr_policy: "poly" base_lr: 0.1 power: 1', "max_iter"),
])
def test_bad_policy_names_the_field(text, field):
    with pytest.raises(ConfigError, match=f"solver.prototxt: {field}:"):
        learning_rate(solver(text), 0, 0, source="solver.prototxt")
