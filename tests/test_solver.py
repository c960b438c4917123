"""Solvers: every update rule against a textbook float64 version written here,
iter_size, gradient clipping, L1/L2 with decay_mult and lr_mult, test nets,
display lines, requested actions, and BVLC Caffe's solver reference cases.

The nets are built from test-only layers registered below (their gradients
are known in closed form), so these tests do not depend on the layer zoo:
    TestLinReg     bottoms x (N, D), t (N, M); params W (M, D), b (M,)
                   loss = sum((x W^T + b - t)^2) / (2 N)
    TestCycleData  tops x, t: the next batch of BATCHES[layer name] per forward
Other test files load this one with siblings.load_sibling("test_solver").
"""
import logging
import os
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

import cct
from cct.training import solver as solver_module
from cct.core.errors import ConfigError
from cct.core.fillers import fill
from cct.core.layer import LAYER_TYPES, Layer, register
from cct.proto import caffe_pb2

class LinRegLayer(Layer):
    exact_bottoms = 2
    exact_tops = 1
    is_loss = True

    def setup(self, bottom, top):
        param = self.layer_param.inner_product_param
        outputs, inputs = param.num_output, bottom[0].shape[1]
        self.blobs = [cct.Blob((outputs, inputs)), cct.Blob((outputs,))]
        fill(self.blobs[0], param.weight_filler, self.where())
        fill(self.blobs[1], param.bias_filler, self.where())

    def reshape(self, bottom, top):
        top[0].reshape(())

    def forward(self, bottom, top):
        x, t = bottom[0].data, bottom[1].data
        self.residual = x @ self.blobs[0].data.T + self.blobs[1].data - t
        top[0].data[...] = np.sum(self.residual ** 2) / (2 * x.shape[0])

    def backward(self, top, propagate_down, bottom):
        scaled = self.residual * (top[0].diff / bottom[0].shape[0])
        if self.param_propagate_down[0]:
            self.blobs[0].diff[...] += scaled.T @ bottom[0].data
        if self.param_propagate_down[1]:
            self.blobs[1].diff[...] += scaled.sum(axis=0)
        if propagate_down[0]:
            bottom[0].diff[...] = scaled @ self.blobs[0].data


class CycleDataLayer(Layer):
    exact_bottoms = 0
    exact_tops = 2
    BATCHES = {}          # layer name -> [(x, t), ...]


    def setup(self, bottom, top):
        self.position = 0
        self.reshape(bottom, top)

    def reshape(self, bottom, top):
        batches = self.BATCHES[self.name]
        x, t = batches[self.position % len(batches)]
        top[0].reshape(x.shape)
        top[1].reshape(t.shape)

    def forward(self, bottom, top):
        batches = self.BATCHES[self.name]
        x, t = batches[self.position % len(batches)]
        top[0].data[...] = x
        top[1].data[...] = t
        self.position += 1


for _name, _cls in (("TestLinReg", LinRegLayer), ("TestCycleData", CycleDataLayer)):
    if _name not in LAYER_TYPES:      # other test files load this module again under another name
        register(_name)(_cls)
BATCHES = LAYER_TYPES["TestCycleData"].BATCHES     # the registered class's, whichever copy that is


N, D, M = 4, 3, 2
RNG = np.random.default_rng(7)
X = RNG.normal(size=(N, D)).astype(np.float32)
T = RNG.normal(size=(N, M)).astype(np.float32)
W0 = RNG.normal(size=(M, D)).astype(np.float32)
B0 = RNG.normal(size=(M,)).astype(np.float32)

NET = f"""
name: "linreg"
layer {{ name: "data" type: "Input" top: "x" top: "t"
        input_param {{ shape {{ dim: {N} dim: {D} }} shape {{ dim: {N} dim: {M} }} }} }}
layer {{ name: "fc" type: "TestLinReg" bottom: "x" bottom: "t" top: "loss"
        param {{ lr_mult: LR0 decay_mult: DECAY0 }} param {{ lr_mult: LR1 decay_mult: DECAY1 }}
        inner_product_param {{ num_output: {M} weight_filler {{ type: "gaussian" std: 0.1 }} }} }}
"""


def net_text(mults=((1, 1), (2, 0))):
    text = NET
    for index, (lr, decay) in enumerate(mults):
        text = text.replace(f"LR{index}", str(lr)).replace(f"DECAY{index}", str(decay))
    return text


def solver_param(text, net=None):
    param = text_format.Parse(text, caffe_pb2.SolverParameter())
    if not param.HasField("net") and not param.HasField("train_net_param"):
        param.net_param.CopyFrom(text_format.Parse(net or net_text(), caffe_pb2.NetParameter()))
    return param


def make_solver(text, net=None, x=X, t=T):
    solver = solver_module.get_solver(solver_param(text, net))
    set_weights(solver.net, x, t)
    return solver


def set_weights(net, x=X, t=T):
    net.params["fc"][0].data[...] = W0
    net.params["fc"][1].data[...] = B0
    if "x" in net.inputs:
        net.blobs["x"].data[...] = x
        net.blobs["t"].data[...] = t


# --- the textbook version ------------------------------------------------------------
def gradients(w, b, x, t):
    residual = x @ w.T + b - t
    return [residual.T @ x / len(x), residual.sum(axis=0) / len(x)]


def reference_run(kind, steps, lr=0.01, momentum=0.0, momentum2=0.999, delta=1e-8, rms_decay=0.99,
                  weight_decay=0.0, regularization="L2", mults=((1, 1), (2, 0)), clip=-1.0,
                  batches=None, iter_size=1, rate_at=None):
    """Float64 parameters after `steps` updates, from the formulas of each method."""
    f = lambda v: float(np.float32(v))             # proto fields are float32
    lr, momentum, momentum2, delta, rms_decay, weight_decay, clip = map(
        f, (lr, momentum, momentum2, delta, rms_decay, weight_decay, clip))
    params = [W0.astype(np.float64), B0.astype(np.float64)]
    first = [np.zeros_like(p) for p in params]
    second = [np.zeros_like(p) for p in params]
    batches = batches or [(X, T)]
    position = 0
    for iteration in range(steps):
        grads = [np.zeros_like(p) for p in params]
        for _ in range(iter_size):
            x, t = (a.astype(np.float64) for a in batches[position % len(batches)])
            position += 1
            grads = [g + h for g, h in zip(grads, gradients(*params, x, t))]
        if clip >= 0:
            norm = np.sqrt(sum(np.sum(g ** 2) for g in grads))
            if norm > clip:
                grads = [g * clip / norm for g in grads]
        rate = rate_at(iteration) if rate_at else lr
        for i, (p, g) in enumerate(zip(params, grads)):
            g = g / iter_size
            decay = weight_decay * mults[i][1]
            g = g + decay * (p if regularization == "L2" else np.sign(p))
            local = rate * mults[i][0]
            if kind == "SGD":
                first[i] = momentum * first[i] + local * g
                step = first[i]
            elif kind == "Nesterov":
                previous = first[i]
                first[i] = momentum * first[i] + local * g
                step = (1 + momentum) * first[i] - momentum * previous
            elif kind == "AdaGrad":
                first[i] = first[i] + g ** 2
                step = local * g / (np.sqrt(first[i]) + delta)
            elif kind == "RMSProp":
                first[i] = rms_decay * first[i] + (1 - rms_decay) * g ** 2
                step = local * g / (np.sqrt(first[i]) + delta)
            elif kind == "AdaDelta":
                first[i] = momentum * first[i] + (1 - momentum) * g ** 2
                unscaled = g * np.sqrt((second[i] + delta) / (first[i] + delta))
                second[i] = momentum * second[i] + (1 - momentum) * unscaled ** 2
                step = local * unscaled
            elif kind == "Adam":
                first[i] = momentum * first[i] + (1 - momentum) * g
                second[i] = momentum2 * second[i] + (1 - momentum2) * g ** 2
                k = iteration + 1
                correction = np.sqrt(1 - momentum2 ** k) / (1 - momentum ** k)
                step = local * correction * first[i] / (np.sqrt(second[i]) + delta)
            params[i] = p - step
    return params


def assert_params(net, expected, rtol=2e-5, atol=1e-6):
    for blob, want in zip(net.params["fc"], expected):
        np.testing.assert_allclose(blob.data, want, rtol=rtol, atol=atol)


SOLVER_CASES = {
    "SGD": ('type: "SGD" momentum: 0.9', dict(momentum=0.9)),
    "Nesterov": ('type: "Nesterov" momentum: 0.9', dict(momentum=0.9)),
    "AdaGrad": ('type: "AdaGrad" delta: 1e-6', dict(delta=1e-6)),
    "RMSProp": ('type: "RMSProp" rms_decay: 0.95 delta: 1e-6', dict(rms_decay=0.95, delta=1e-6)),
    "AdaDelta": ('type: "AdaDelta" momentum: 0.95 delta: 1e-6', dict(momentum=0.95, delta=1e-6)),
    "Adam": ('type: "Adam" momentum: 0.9 momentum2: 0.999 delta: 1e-8', dict(momentum=0.9)),
}


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


def test_solver_classes_by_name_and_deprecated_enum():
    for kind in SOLVER_CASES:
        cls = getattr(cct, f"{kind}Solver")
        assert solver_module.SOLVER_TYPES[kind] is cls
    param = solver_param('solver_type: ADAM base_lr: 0.1 lr_policy: "fixed"')
    assert isinstance(solver_module.get_solver(param), cct.AdamSolver)
    with pytest.raises(ConfigError, match="type: unknown solver type 'Adamm'; known types: AdaDelta"):
        solver_module.get_solver(solver_param('type: "Adamm" base_lr: 0.1 lr_policy: "fixed"'))


def test_class_constructors_take_a_parameter():
    solver = cct.NesterovSolver(solver_param('base_lr: 0.1 lr_policy: "fixed" momentum: 0.5'))
    set_weights(solver.net)
    solver.step(3)
    assert_params(solver.net, reference_run("Nesterov", 3, lr=0.1, momentum=0.5))


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


# --- BVLC Caffe's solver reference cases ---------------------------------------------------
CASES = Path(__file__).parent / "reference" / "cases"


@pytest.mark.parametrize("case", ["lenet_sgd", "caffenet_mini_sgd"])
def test_reference_solver_case(case, monkeypatch):
    folder = CASES / case
    net = text_format.Parse((folder / "net.prototxt").read_text(), caffe_pb2.NetParameter())
    missing = sorted({layer.type for layer in net.layer} - set(cct.layer_type_list()))
    if missing:
        pytest.skip(f"layer types not registered yet: {missing}")
    monkeypatch.chdir(folder)                       # the solver names net.prototxt relatively
    steps = np.load("steps.npz")
    solver = cct.training.solver.get_solver("solver.prototxt")
    solver.net.copy_from("weights.caffemodel")
    batch = {key[len("batch/"):]: steps[key] for key in steps.files if key.startswith("batch/")}
    losses = []
    for _ in range(len(steps["losses"])):
        for name, values in batch.items():
            solver.net.blobs[name].data[...] = values
        solver.step(1)
        losses.append(float(solver.net.blobs["loss"].data))
    reference = steps["losses"]
    assert np.max(np.abs(np.array(losses) - reference)) / max(np.abs(reference).max(), 1e-6) < 1e-3
    for key in steps.files:
        if key.startswith("final/"):
            _, layer, index = key.split("/")
            ours = solver.net.params[layer][int(index)].data
            scale = max(float(np.abs(steps[key]).max()), 1e-6)
            assert float(np.abs(ours - steps[key]).max()) / scale < 1e-3, key


@pytest.mark.parametrize("kind", sorted(SOLVER_CASES))
def test_update_striped_over_threads_gives_the_same_numbers(kind, monkeypatch):
    """Solver._striped: T threads each update every T-th piece; with pieces of
    one element, the weights span every stripe, and the result is bitwise
    that of one thread (iter_size 2 and L1 decay run striped too)."""
    monkeypatch.setattr(solver_module, "UPDATE_PIECE", 1)
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


def test_a_failing_stripe_is_waited_for_and_raised(monkeypatch):
    """_striped returns only after every stripe has ended, and raises the failure."""
    solver = make_solver('type: "SGD" momentum: 0.9 base_lr: 0.05 lr_policy: "fixed"')
    solver.net.executor.threads = 3
    import time
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
