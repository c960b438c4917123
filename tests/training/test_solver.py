"""Solvers (cct.training.solver): iter_size, gradient clipping, L1/L2 with
decay_mult and lr_mult, test nets, display lines, requested actions, the
striped update over threads, and BVLC Caffe's solver reference cases. The nets
are helpers.linreg's (test-only layers with closed-form gradients), so these
tests do not depend on the layer zoo; the update rules themselves are in
test_updates.py."""
import logging
import os
import time

import numpy as np
import pytest
from google.protobuf import text_format

import cct
from cct.core.errors import ConfigError
from cct.proto import caffe_pb2
from cct.training import solver as solver_module
from helpers.linreg import (B0, BATCHES, SOLVER_CASES, D, M, N, T, W0, X, assert_params, gradients, make_solver,
                            net_text, reference_run, set_weights, solver_param)
from helpers.reference import CASES, assert_solver_matches_caffe, run_solver_case

RNG = np.random.default_rng(8)


def test_solver_classes_by_name_and_deprecated_enum():
    for kind in SOLVER_CASES:
        cls = getattr(cct, f"{kind}Solver")
        assert solver_module.SOLVER_TYPES[kind] is cls
    param = solver_param('solver_type: ADAM base_lr: 0.1 lr_policy: "fixed"')
    assert isinstance(solver_module.get_solver(param), cct.AdamSolver)
    with pytest.raises(ConfigError, match="type: unknown solver type 'Adamm'; known types: AdaDelta"):
        solver_module.get_solver(solver_param('type: "Adamm" base_lr: 0.1 lr_policy: "fixed"'))


@pytest.mark.parametrize("regularization", ["L1", "L2"])
@pytest.mark.parametrize("mults", [((1, 1), (2, 0)), ((0.5, 2), (0, 1)), ((0, 0), (3, 5))])
def test_regularization_and_multipliers(regularization, mults):
    solver = make_solver(f'type: "SGD" base_lr: 0.05 lr_policy: "fixed" momentum: 0.8 weight_decay: 0.1 '
                         f'regularization_type: "{regularization}"', net=net_text(mults))
    solver.step(4)
    expected = reference_run("SGD", 4, lr=0.05, momentum=0.8, weight_decay=0.1,
                             regularization=regularization, mults=mults)
    assert_params(solver.net, expected)
    for index, (lr_mult, _) in enumerate(mults):
        if lr_mult == 0:                          # a frozen parameter never moves
            np.testing.assert_array_equal(solver.net.params["fc"][index].data, [W0, B0][index])


def test_unknown_regularization_is_refused():
    with pytest.raises(ConfigError, match="regularization_type: unknown regularization type 'L3'"):
        make_solver('base_lr: 0.1 lr_policy: "fixed" regularization_type: "L3"')


def test_clip_gradients_scales_the_global_norm():
    grads = gradients(W0.astype(np.float64), B0.astype(np.float64), X.astype(np.float64), T.astype(np.float64))
    norm = np.sqrt(sum(np.sum(g ** 2) for g in grads))
    clip = norm / 3                               # clipping happens on the first step at least
    solver = make_solver(f'base_lr: 0.1 lr_policy: "fixed" momentum: 0.9 weight_decay: 0.01 '
                         f'clip_gradients: {clip}')
    solver.step(4)
    assert_params(solver.net, reference_run("SGD", 4, lr=0.1, momentum=0.9, weight_decay=0.01, clip=clip))
    unclipped = reference_run("SGD", 4, lr=0.1, momentum=0.9, weight_decay=0.01)
    assert not np.allclose(solver.net.params["fc"][0].data, unclipped[0], rtol=1e-3)


CYCLE_NET = f"""
name: "cycle"
layer {{ name: "feed" type: "TestCycleData" top: "x" top: "t" }}
layer {{ name: "fc" type: "TestLinReg" bottom: "x" bottom: "t" top: "loss"
        inner_product_param {{ num_output: {M} }} }}
"""


def test_iter_size_accumulates_and_averages():
    batches = [(RNG.normal(size=(N, D)).astype(np.float32), RNG.normal(size=(N, M)).astype(np.float32))
               for _ in range(4)]
    BATCHES["feed"] = batches
    common = 'base_lr: 0.1 lr_policy: "fixed" momentum: 0.9 weight_decay: 0.01 clip_gradients: 0.5 '
    solver = make_solver(common + "iter_size: 2", net=CYCLE_NET)
    solver.step(3)
    mults = ((1, 1), (1, 1))
    expected = reference_run("SGD", 3, lr=0.1, momentum=0.9, weight_decay=0.01, clip=0.5, mults=mults,
                             batches=batches, iter_size=2)
    assert_params(solver.net, expected)
    # iter_size 2 over batches (a, b) == iter_size 1 over the batch a+b (the loss is a mean);
    # without clipping, which Caffe applies to the sum before dividing by iter_size.
    common = 'base_lr: 0.1 lr_policy: "fixed" momentum: 0.9 weight_decay: 0.01 '
    BATCHES["feed"] = batches
    solver = make_solver(common + "iter_size: 2", net=CYCLE_NET)
    solver.step(3)
    BATCHES["feed"] = [(np.concatenate([batches[2 * k][0], batches[2 * k + 1][0]]),
                        np.concatenate([batches[2 * k][1], batches[2 * k + 1][1]])) for k in range(2)]
    whole = make_solver(common + "iter_size: 1", net=CYCLE_NET)
    whole.step(3)
    for ours, theirs in zip(solver.net.params["fc"], whole.net.params["fc"]):
        np.testing.assert_allclose(ours.data, theirs.data, rtol=1e-5, atol=1e-6)


def test_callbacks_and_apply_update():
    calls = []
    solver = make_solver('base_lr: 0.1 lr_policy: "fixed"')
    solver.add_callback(lambda: calls.append("start"), lambda: calls.append("ready"))
    solver.step(2)
    assert calls == ["start", "ready"] * 2
    # pycaffe's apply_update: one update from the diffs already in the net.
    solver.net.clear_param_diffs()
    solver.net.forward_backward()
    before = solver.net.params["fc"][1].data.copy()
    gradient = solver.net.params["fc"][1].diff.copy()
    solver.apply_update()
    np.testing.assert_allclose(solver.net.params["fc"][1].data, before - 0.2 * gradient, rtol=1e-5)
    assert solver.iter == 2


def test_share_weights():
    solver = make_solver('base_lr: 0.1 lr_policy: "fixed"')
    other = cct.Net(text_format.Parse(net_text(), caffe_pb2.NetParameter()), cct.TEST)
    solver.share_weights(other)
    solver.step(1)
    np.testing.assert_array_equal(other.params["fc"][0].data, solver.net.params["fc"][0].data)


def test_display_and_test_lines(caplog):
    text = ('base_lr: 0.01 lr_policy: "fixed" display: 2 average_loss: 2 max_iter: 4 '
            'test_iter: 3 test_interval: 2 test_compute_loss: true snapshot_after_train: false')
    solver = make_solver(text)
    for net in solver.test_nets:
        set_weights(net)
    with caplog.at_level(logging.INFO, logger="cct"):
        solver.solve()
    messages = [r.getMessage() for r in caplog.records]
    loss0 = float(np.sum((X @ W0.T + B0 - T) ** 2) / (2 * N))
    assert f"    Train net output #0: loss = {loss0:.6g} (* 1 = {loss0:.6g} loss)" in messages
    assert "Iteration 0, lr = 0.01" in messages
    assert any(m.startswith("Iteration 2 (") and "iter/s" in m and "images/s" in m and "loss = " in m
               for m in messages)
    assert "Iteration 0, Testing net (#0)" in messages
    assert f"Test loss: {loss0:.6g}" in messages
    assert f"    Test net output #0: loss = {loss0:.6g} (* 1 = {loss0:.6g} loss)" in messages
    assert "Iteration 4, Testing net (#0)" in messages          # the final test Solve runs
    assert messages[-1] == "Optimization Done."
    assert solver.iter == 4
    assert len(solver.mean_scores[0]) == 1


def test_debug_info_lines(caplog):
    solver = make_solver('base_lr: 0.01 lr_policy: "fixed" display: 1 debug_info: true')
    with caplog.at_level(logging.INFO, logger="cct"):
        solver.step(1)
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("    [Forward] Layer fc, top blob loss data: ") for m in messages)
    assert any(m.startswith("    [Backward] Layer fc, param blob 1 diff: ") for m in messages)


def test_smoothed_loss_averages_the_last_losses():
    solver = make_solver('base_lr: 0.05 lr_policy: "fixed" average_loss: 3')
    losses = []
    solver.add_callback(lambda: None, lambda: losses.append(float(solver.net.blobs["loss"].data)))
    solver.step(5)
    assert solver.smoothed_loss == pytest.approx(np.mean(losses[-3:]), rel=1e-6)


def test_test_state_and_test_nets_from_net_param():
    net = net_text().replace('name: "fc"', 'name: "fc" include { phase: TRAIN }', 1) + """
layer { name: "fc" type: "TestLinReg" bottom: "x" bottom: "t" top: "loss"
        include { phase: TEST stage: "val" } inner_product_param { num_output: 2 } }
"""
    param = solver_param('base_lr: 0.1 lr_policy: "fixed" test_iter: 1 test_interval: 5 '
                         'test_state { stage: "val" }', net)
    solver = solver_module.get_solver(param)
    assert len(solver.test_nets) == 1 and solver.test_nets[0].phase == cct.TEST
    assert "fc" in solver.test_nets[0].layer_dict
    bad = solver_param('base_lr: 0.1 lr_policy: "fixed" test_iter: 1 test_interval: 0')
    with pytest.raises(ConfigError, match="test_interval: must be > 0"):
        solver_module.get_solver(bad)


def test_train_state_merges_with_phase_train():
    net = net_text() + """
layer { name: "extra" type: "Split" bottom: "x" top: "x_copy" include { stage: "deep" } }
"""
    plain = solver_module.get_solver(solver_param('base_lr: 0.1 lr_policy: "fixed"', net))
    assert "extra" not in plain.net.layer_dict and plain.net.phase == cct.TRAIN
    staged = solver_module.get_solver(solver_param('base_lr: 0.1 lr_policy: "fixed" '
                                                   'train_state { stage: "deep" }', net))
    assert "extra" in staged.net.layer_dict


def test_request_stop_snapshots_when_snapshot_after_train(tmp_path):
    solver = make_solver(f'base_lr: 0.1 lr_policy: "fixed" max_iter: 100 snapshot_prefix: "{tmp_path}/s"')
    solver.add_callback(lambda: None,
                        lambda: solver.request_action("stop") if solver.iter == 2 else None)
    solver.solve()
    assert solver.iter == 3
    assert sorted(os.listdir(tmp_path)) == ["s_iter_3.caffemodel", "s_iter_3.solverstate"]
    with pytest.raises(ConfigError, match="unknown action 'halt'"):
        solver.request_action("halt")


def test_request_snapshot_goes_on(tmp_path):
    solver = make_solver(f'base_lr: 0.1 lr_policy: "fixed" max_iter: 4 snapshot_prefix: "{tmp_path}/s" '
                         'snapshot_after_train: false')
    solver.add_callback(lambda: None,
                        lambda: solver.request_action("snapshot") if solver.iter == 1 else None)
    solver.solve()
    assert solver.iter == 4
    assert sorted(os.listdir(tmp_path)) == ["s_iter_2.caffemodel", "s_iter_2.solverstate"]


def test_net_paths_are_relative_to_the_working_folder(tmp_path, monkeypatch):
    (tmp_path / "net.prototxt").write_text(net_text())
    (tmp_path / "solver.prototxt").write_text('net: "net.prototxt" base_lr: 0.1 lr_policy: "fixed"')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with pytest.raises(ConfigError) as error:
        solver_module.get_solver(str(tmp_path / "solver.prototxt"))
    message = str(error.value)
    assert message.startswith(f"{tmp_path / 'solver.prototxt'}: net: net file 'net.prototxt' not found")
    assert "beside the solver file" in message
    monkeypatch.chdir(tmp_path)
    solver = solver_module.get_solver("solver.prototxt")
    assert solver.net.name == "linreg"
    # A solver file without snapshot_prefix snapshots beside itself, named after it (Caffe master).
    assert solver.param.snapshot_prefix == "solver"


@pytest.mark.parametrize("text, message", [
    ('base_lr: 0.1 lr_policy: "fixed" average_loss: 0', "average_loss: must be >= 1"),
    ('base_lr: 0.1 lr_policy: "fixed" iter_size: 0', "iter_size: must be >= 1"),
    ('base_lr: 0.1 lr_policy: "fixed" type: "AdaGrad" momentum: 0.9', "momentum: cannot be used with AdaGrad"),
    ('base_lr: 0.1 lr_policy: "fixed" type: "RMSProp" rms_decay: 1', r"rms_decay: must be in \[0, 1\)"),
    ('base_lr: 0.1 lr_policy: "fixed" snapshot: 5 snapshot_prefix: "/nonexistent/folder/s"',
     "snapshot_prefix: cannot write to '/nonexistent/folder/s'"),
    ('base_lr: 0.1 lr_policy: "fixed" snapshot: 5', "snapshot_prefix: snapshot is 5 but no snapshot_prefix"),
    ('base_lr: 0.1 lr_policy: "warp"', "lr_policy: unknown learning rate policy 'warp'"),
])
def test_bad_solver_fields(text, message):
    with pytest.raises(ConfigError, match=message):
        make_solver(text)


def test_two_train_nets_are_refused():
    param = solver_param('base_lr: 0.1 lr_policy: "fixed" train_net: "a.prototxt"')
    with pytest.raises(ConfigError, match="exactly one of net, net_param, train_net, train_net_param; "
                                          "got net_param, train_net"):
        solver_module.get_solver(param)


def test_random_seed_makes_fillers_repeatable():
    text = 'base_lr: 0.1 lr_policy: "fixed" random_seed: 5'
    first = solver_module.get_solver(solver_param(text)).net.params["fc"][0].data.copy()
    second = solver_module.get_solver(solver_param(text)).net.params["fc"][0].data.copy()
    np.testing.assert_array_equal(first, second)


@pytest.mark.parametrize("kind", sorted(SOLVER_CASES))
def test_update_striped_over_threads_gives_the_same_numbers(kind, monkeypatch):
    """Solver._striped: T threads each update every T-th piece; with pieces of
    one element, the weights span every stripe, and the result is bitwise
    that of one thread (iter_size 2 and L1 decay run striped too)."""
    monkeypatch.setattr(solver_module, "UPDATE_PIECE", 1)
    monkeypatch.setattr(solver_module, "STRIPED_UPDATE_ELEMENTS", 0)
    text, _ = SOLVER_CASES[kind]
    runs = []
    for threads in (1, 3):
        solver = make_solver(f'{text} base_lr: 0.05 lr_policy: "fixed" weight_decay: 0.01 '
                             f'regularization_type: "L1" iter_size: 2')
        solver.net.executor.threads = threads
        solver.step(3)
        runs.append([blob.data.copy() for blob in solver.net.learnable_params])
    assert runs[0][0].size > 3
    for single, striped in zip(*runs):
        np.testing.assert_array_equal(single, striped)


@pytest.mark.parametrize("threshold, stripes", [(0, {0, 1, 2}), (10 ** 9, {0})])
def test_the_update_is_striped_only_over_enough_parameters(monkeypatch, threshold, stripes):
    """Below STRIPED_UPDATE_ELEMENTS (all learnable elements together) the
    update runs on the calling thread alone."""
    monkeypatch.setattr(solver_module, "STRIPED_UPDATE_ELEMENTS", threshold)
    solver = make_solver('type: "SGD" momentum: 0.9 base_lr: 0.05 lr_policy: "fixed"')
    solver.net.executor.threads = 3
    seen, update = set(), solver._update_params
    monkeypatch.setattr(solver, "_update_params", lambda rate: seen.add(solver._stripe.value[0]) or update(rate))
    solver.step(1)
    assert seen == stripes


def test_a_failing_stripe_is_waited_for_and_raised(monkeypatch):
    """_striped returns only after every stripe has ended, and raises the failure."""
    solver = make_solver('type: "SGD" momentum: 0.9 base_lr: 0.05 lr_policy: "fixed"')
    solver.net.executor.threads = 3
    finished = []

    def update(rate):
        stripe = solver._stripe.value[0]
        if stripe == 0:
            raise RuntimeError("stripe 0 failed")
        time.sleep(0.05)
        finished.append(stripe)
    with pytest.raises(RuntimeError, match="stripe 0 failed"):
        solver._striped(update, 0.1)
    assert sorted(finished) == [1, 2]


# --- BVLC Caffe's solver reference cases ---------------------------------------------------
@pytest.mark.parametrize("case", ["lenet_sgd", "caffenet_mini_sgd"])
def test_reference_solver_case(case, monkeypatch):
    monkeypatch.chdir(CASES / case)                 # the solver names net.prototxt relatively
    assert_solver_matches_caffe(run_solver_case(case))


def test_add_callback_takes_a_callback_object_or_refuses_it():
    """pycaffe's add_callback(nccl) form: an object with on_start and
    on_gradients_ready (Caffe's Solver::Callback); anything else is a TypeError."""
    solver = make_solver('base_lr: 0.1 lr_policy: "fixed"')
    calls = []

    class Counter:
        def on_start(self):
            calls.append("start")

        def on_gradients_ready(self):
            calls.append("ready")
    solver.add_callback(Counter())
    solver.step(1)
    assert calls == ["start", "ready"]
    with pytest.raises(TypeError, match="add_callback: int is not a solver callback"):
        solver.add_callback(3)
