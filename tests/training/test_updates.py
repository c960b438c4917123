"""The six update rules (cct.training.updates): each against the float64
textbook version in helpers.linreg, under a learning-rate schedule, through its
class's constructor, and SGD's fused one-pass update against the numpy passes."""
import numpy as np
import pytest

import cct
from cct.training import solver as solver_module
from helpers.linreg import SOLVER_CASES, assert_params, make_solver, net_text, reference_run, set_weights, solver_param


@pytest.mark.parametrize("kind", sorted(SOLVER_CASES))
def test_update_rule_matches_formula(kind):
    text, options = SOLVER_CASES[kind]
    lr = 1.0 if kind == "AdaDelta" else 0.05
    solver = make_solver(f'{text} base_lr: {lr} lr_policy: "fixed" weight_decay: 0.01')
    assert type(solver).__name__ == f"{kind}Solver"
    solver.step(5)
    assert solver.iter == 5
    assert_params(solver.net, reference_run(kind, 5, lr=lr, weight_decay=0.01, **options))


@pytest.mark.parametrize("kind", sorted(SOLVER_CASES))
def test_lr_schedule_reaches_every_rule(kind):
    text, options = SOLVER_CASES[kind]
    solver = make_solver(f'{text} base_lr: 0.2 lr_policy: "step" gamma: 0.5 stepsize: 2')
    solver.step(5)
    rate_at = lambda i: float(np.float32(0.2)) * 0.5 ** (i // 2)
    assert_params(solver.net, reference_run(kind, 5, rate_at=rate_at, **options))


def test_class_constructors_take_a_parameter():
    solver = cct.NesterovSolver(solver_param('base_lr: 0.1 lr_policy: "fixed" momentum: 0.5'))
    set_weights(solver.net)
    solver.step(3)
    assert_params(solver.net, reference_run("Nesterov", 3, lr=0.1, momentum=0.5))


@pytest.mark.parametrize("decay", [0.0, 0.01])
@pytest.mark.parametrize("threads", [1, 3])
def test_fused_sgd_update_equals_the_numpy_passes(decay, threads, monkeypatch):
    """SGDSolver's one-pass compiled update gives bitwise the numbers of the
    regularize / compute_update_value / Blob::Update passes, in float32 too."""
    monkeypatch.setattr(solver_module, "UPDATE_PIECE", 2)
    runs = []
    for fused in (False, True):
        solver = make_solver(f'type: "SGD" momentum: 0.9 base_lr: 0.05 lr_policy: "step" gamma: 0.5 '
                             f'stepsize: 2 weight_decay: {decay}', net=net_text(((1, 1), (2, 0))))
        solver.fused = fused
        solver.net.executor.threads = threads
        assert solver._can_fuse() is fused
        solver.step(4)
        runs.append([blob.data.copy() for blob in solver.net.learnable_params] + [h.copy() for h in solver.history])
    for numpy_pass, compiled in zip(*runs):
        assert numpy_pass.dtype == np.float32
        np.testing.assert_array_equal(compiled, numpy_pass)


def test_fused_sgd_steps_aside_where_it_does_not_apply():
    for text in ('regularization_type: "L1" weight_decay: 0.01', "iter_size: 2"):
        solver = make_solver(f'type: "SGD" momentum: 0.9 base_lr: 0.05 lr_policy: "fixed" {text}')
        assert not solver._can_fuse()
    assert make_solver('type: "SGD" base_lr: 0.05 lr_policy: "fixed"')._can_fuse()


def test_fused_sgd_applies_with_l1_and_no_decay():
    assert make_solver('type: "SGD" base_lr: 0.05 lr_policy: "fixed" regularization_type: "L1"')._can_fuse()
