"""cct.runtime.memory: diff sharing between blobs whose gradients are never live
together. Training with shared diffs must give bitwise the numbers of training
without (the arenas are poisoned with NaN first, so a diff read before it is
set shows), the arenas must be smaller, and the blobs whose diffs matter
outside backward (inputs, outputs, losses) or alias another blob's must keep
their own. Also the config key, CCT_SHARE_DIFFS and the solver's use of them."""
import json

import numpy as np
import pytest
from google.protobuf import text_format

import cct
from cct.runtime import settings as config
from cct.runtime import memory
from cct.training import solver as solver_module
from cct.core.errors import ConfigError
from cct.proto import caffe_pb2
from cct.core.rng import set_random_seed

GAUSS = 'weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "constant" value: 0.1 }'

LENET = f'''name: "lenet_like"
layer {{ name: "data" type: "Input" top: "data" top: "label"
        input_param {{ shape {{ dim: 6 dim: 1 dim: 12 dim: 12 }} shape {{ dim: 6 }} }} }}
layer {{ name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param {{ num_output: 4 kernel_size: 3 {GAUSS} }} }}
layer {{ name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param {{ pool: MAX kernel_size: 2 stride: 2 }} }}
layer {{ name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
        convolution_param {{ num_output: 6 kernel_size: 3 {GAUSS} }} }}
layer {{ name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }}
layer {{ name: "flat" type: "Flatten" bottom: "conv2" top: "flat" }}
layer {{ name: "ip1" type: "InnerProduct" bottom: "flat" top: "ip1"
        inner_product_param {{ num_output: 10 {GAUSS} }} }}
layer {{ name: "relu3" type: "ReLU" bottom: "ip1" top: "ip1" }}
layer {{ name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param {{ num_output: 5 {GAUSS} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }}
layer {{ name: "accuracy" type: "Accuracy" bottom: "ip2" bottom: "label" top: "accuracy" }}
'''

# CaffeNet's layer kinds, small: grouped conv, ReLU in place, LRN, a fan-out
# (Split) into two convs joined by Concat, Dropout in place, InnerProduct.
CAFFENET = f'''name: "caffenet_like"
layer {{ name: "data" type: "Input" top: "data" top: "label"
        input_param {{ shape {{ dim: 4 dim: 3 dim: 15 dim: 15 }} shape {{ dim: 4 }} }} }}
layer {{ name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param {{ num_output: 8 kernel_size: 3 stride: 2 {GAUSS} }} }}
layer {{ name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }}
layer {{ name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param {{ pool: MAX kernel_size: 3 stride: 2 }} }}
layer {{ name: "norm1" type: "LRN" bottom: "pool1" top: "norm1"
        lrn_param {{ local_size: 3 alpha: 0.1 beta: 0.75 }} }}
layer {{ name: "conv2a" type: "Convolution" bottom: "norm1" top: "conv2a"
        convolution_param {{ num_output: 4 kernel_size: 3 pad: 1 group: 2 {GAUSS} }} }}
layer {{ name: "conv2b" type: "Convolution" bottom: "norm1" top: "conv2b"
        convolution_param {{ num_output: 6 kernel_size: 1 {GAUSS} }} }}
layer {{ name: "concat" type: "Concat" bottom: "conv2a" bottom: "conv2b" top: "concat" }}
layer {{ name: "relu2" type: "ReLU" bottom: "concat" top: "concat" }}
layer {{ name: "pool2" type: "Pooling" bottom: "concat" top: "pool2"
        pooling_param {{ pool: AVE kernel_size: 2 stride: 1 }} }}
layer {{ name: "fc6" type: "InnerProduct" bottom: "pool2" top: "fc6"
        inner_product_param {{ num_output: 12 {GAUSS} }} }}
layer {{ name: "relu6" type: "ReLU" bottom: "fc6" top: "fc6" }}
layer {{ name: "drop6" type: "Dropout" bottom: "fc6" top: "fc6" dropout_param {{ dropout_ratio: 0.5 }} }}
layer {{ name: "fc7" type: "InnerProduct" bottom: "fc6" top: "fc7"
        inner_product_param {{ num_output: 12 {GAUSS} }} }}
layer {{ name: "relu7" type: "ReLU" bottom: "fc7" top: "fc7" }}
layer {{ name: "drop7" type: "Dropout" bottom: "fc7" top: "fc7" dropout_param {{ dropout_ratio: 0.5 }} }}
layer {{ name: "fc8" type: "InnerProduct" bottom: "fc7" top: "fc8"
        inner_product_param {{ num_output: 5 {GAUSS} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "fc8" bottom: "label" top: "loss" }}
layer {{ name: "accuracy" type: "Accuracy" bottom: "fc8" bottom: "label" top: "accuracy" }}
'''
# a loss weight on an inner top: its Split adds the weighted diff set in forward
LOSS_INSIDE = LENET.replace('bottom: "conv1" top: "pool1"', 'bottom: "conv1" top: "pool1" loss_weight: 0.5')
NETS = {"lenet": LENET, "caffenet": CAFFENET, "loss_inside": LOSS_INSIDE}


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in ("CCT_CONFIG", "CCT_SHARE_DIFFS", "CCT_PARTITIONS"):
        monkeypatch.delenv(name, raising=False)
    config.load(None)
    yield
    config.load(None)


def solver_param(net_text, **fields):
    param = caffe_pb2.SolverParameter(base_lr=0.05, momentum=0.9, weight_decay=5e-4, lr_policy="fixed",
                                      max_iter=100, display=0, random_seed=3, **fields)
    param.net_param.CopyFrom(text_format.Parse(net_text, caffe_pb2.NetParameter()))
    return param


def make_solver(net_text, share, monkeypatch, **fields):
    monkeypatch.setenv("CCT_SHARE_DIFFS", "1" if share else "0")
    solver = cct.SGDSolver(solver_param(net_text, **fields))
    monkeypatch.delenv("CCT_SHARE_DIFFS")
    rng = np.random.default_rng(11)
    data = solver.net.blobs["data"]
    data.data[...] = rng.standard_normal(data.shape)
    solver.net.blobs["label"].data[...] = rng.integers(0, 5, size=solver.net.blobs["label"].shape)
    return solver


def poison(net, summary):
    """NaN in every arena: a diff read before backward sets it poisons the result."""
    for names in summary.arenas:
        for name in names:
            net.blobs[name].diff[...] = np.nan


def step_both(plain, shared, seed):
    for solver in (plain, shared):
        set_random_seed(seed)                 # the same Dropout masks in both
        solver.step(1)


def assert_same_params(plain, shared):
    for index, (a, b) in enumerate(zip(plain.net.learnable_params, shared.net.learnable_params)):
        assert np.isfinite(b.data).all() and np.isfinite(b.diff).all(), f"param {index}"
        np.testing.assert_array_equal(a.diff, b.diff, err_msg=f"param {index} diff")
        np.testing.assert_array_equal(a.data, b.data, err_msg=f"param {index} data")


def arena_names(net):
    summary = memory.summary(net)
    return set() if summary is None else {name for names in summary.arenas for name in names}


# --- training gives the same numbers -------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(NETS))
def test_training_with_shared_diffs_is_bitwise_equal(kind, partitions, monkeypatch):
    plain = make_solver(NETS[kind], False, monkeypatch)
    shared = make_solver(NETS[kind], True, monkeypatch)
    assert memory.summary(plain.net) is None
    summary = memory.summary(shared.net)
    assert summary is not None and len(summary.arenas) >= 2
    if partitions > 1:
        assert any(shared.net.executor.partitions(i) == partitions for i in range(len(shared.net.layers)))
    poison(shared.net, summary)
    for seed in (1, 2, 3):
        step_both(plain, shared, seed)
        assert_same_params(plain, shared)
    # forward/backward alone: the parameter gradients, before any update
    for solver in (plain, shared):
        solver.net.clear_param_diffs()
        set_random_seed(9)
        solver.net.forward_backward()
    assert_same_params(plain, shared)
    np.testing.assert_array_equal(plain.net.blobs["loss"].data, shared.net.blobs["loss"].data)


def test_arenas_are_smaller_and_members_never_live_together():
    net = cct.Net(text_format.Parse(CAFFENET, caffe_pb2.NetParameter()), cct.TRAIN)
    summary = memory.share_diffs(net)
    assert summary.arena_bytes < summary.unshared_bytes and summary.saved_bytes > 0
    assert summary.unshared_bytes == sum(net.blobs[n].count * 4 for names in summary.arenas for n in names)
    for names in summary.arenas:
        spans = [summary.intervals[name] for name in names]
        for i, (a, b) in enumerate(spans):
            for c, d in spans[i + 1:]:
                assert b < c or d < a, (names, spans)
        for name in names[1:]:
            assert np.shares_memory(net.blobs[name].diff, net.blobs[names[0]].diff)
    # a layer's top and bottom never share an arena
    arena_of = {name: k for k, names in enumerate(summary.arenas) for name in names}
    for bottoms, tops in zip(net.bottom_names.values(), net.top_names.values()):
        for top in tops:
            for bottom in bottoms:
                if top != bottom and top in arena_of and bottom in arena_of:
                    assert arena_of[top] != arena_of[bottom], (top, bottom)


def test_colour_is_greedy_first_fit_with_closed_intervals():
    intervals = {"a": (0, 2), "b": (2, 3), "c": (3, 5), "d": (4, 6), "e": (6, 7)}
    sizes = dict.fromkeys(intervals, 10)
    dtypes = dict.fromkeys(intervals, np.dtype(np.float32))
    assert memory.colour(intervals, sizes, dtypes) == [["a", "c", "e"], ["b", "d"]]
    dtypes["c"] = np.dtype(np.float64)            # an arena holds one dtype
    assert memory.colour(intervals, sizes, dtypes) == [["a", "d"], ["b", "e"], ["c"]]


def test_losses_outputs_inputs_and_aliased_blobs_keep_their_own_diffs():
    net = cct.Net(text_format.Parse(LENET, caffe_pb2.NetParameter()), cct.TRAIN)
    summary = memory.share_diffs(net)
    shared = arena_names(net)
    excluded = summary.excluded
    assert {"data", "label"} <= set(excluded) and excluded["data"] == "net input"
    assert excluded["loss"] == "loss weight (diff set in forward)" and excluded["accuracy"] == "net output"
    # Flatten's top is its bottom's diff memory: both left out
    assert "aliased" in excluded["flat"] and "aliased" in excluded["conv2"]
    # the Split top read by Accuracy (no backward): Split still sums its diff
    accuracy_input = net.bottom_names["accuracy"][0]
    assert "sets no gradient" in excluded[accuracy_input]
    assert not shared & set(excluded)
    assert shared == set(net.blobs) - set(excluded)
    arenas = [net.blobs[names[0]].diff for names in summary.arenas]
    for name in excluded:
        blob = net.blobs[name]
        if blob._diff_store is not None:
            assert not any(np.shares_memory(blob._diff_store, arena) for arena in arenas), name


def test_loss_weight_blobs_are_not_shared():
    net = cct.Net(text_format.Parse(LOSS_INSIDE, caffe_pb2.NetParameter()), cct.TRAIN)
    summary = memory.share_diffs(net)
    weighted = [name for name, weight in net.blob_loss_weights.items() if weight]
    assert sorted(weighted) == ["loss", "pool1_pool1_0_split_0"]
    for name in weighted:
        assert summary.excluded[name] == "loss weight (diff set in forward)"
    assert "pool1" in arena_names(net)         # the blob the weighted split top comes from


def test_share_again_after_growing_the_batch(monkeypatch):
    plain = make_solver(LENET, False, monkeypatch)
    shared = make_solver(LENET, True, monkeypatch)
    for solver in (plain, shared):
        solver.net.blobs["data"].reshape(9, 1, 12, 12)
        solver.net.blobs["label"].reshape(9)
        solver.net.reshape()
        rng = np.random.default_rng(5)
        solver.net.blobs["data"].data[...] = rng.standard_normal((9, 1, 12, 12))
        solver.net.blobs["label"].data[...] = rng.integers(0, 5, size=9)
    grown = memory.summary(shared.net).arenas[0]
    # the grown blobs have diffs of their own now: correct, unshared
    assert not np.shares_memory(shared.net.blobs[grown[0]].diff, shared.net.blobs[grown[1]].diff)
    step_both(plain, shared, 1)
    assert_same_params(plain, shared)
    summary = memory.share_diffs(shared.net)
    assert np.shares_memory(shared.net.blobs[summary.arenas[0][0]].diff,
                            shared.net.blobs[summary.arenas[0][1]].diff)
    poison(shared.net, summary)
    step_both(plain, shared, 2)
    assert_same_params(plain, shared)


# --- switching it on -------------------------------------------------------------------------
def test_off_by_default_and_never_for_test_nets(monkeypatch):
    solver = cct.SGDSolver(solver_param(LENET))
    assert memory.summary(solver.net) is None
    param = solver_param(LENET, test_interval=10)
    param.test_iter.append(1)
    monkeypatch.setenv("CCT_SHARE_DIFFS", "1")
    solver = cct.SGDSolver(param)
    assert memory.summary(solver.net) is not None
    assert solver.test_nets and memory.summary(solver.test_nets[0]) is None


def test_cct_train_shares_by_default_unless_told_not_to(tmp_path, monkeypatch):
    """`cct train` shows no activation diff, so it shares them; the variable
    and the configuration still decide when they say."""
    assert memory.summary(solver_module.get_solver(solver_param(LENET), share_diffs=True).net) is not None
    monkeypatch.setenv("CCT_SHARE_DIFFS", "0")
    assert memory.summary(solver_module.get_solver(solver_param(LENET), share_diffs=True).net) is None
    monkeypatch.delenv("CCT_SHARE_DIFFS")
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"share_diffs": False}))
    config.load(path)
    assert memory.summary(solver_module.get_solver(solver_param(LENET), share_diffs=True).net) is None


def test_cli_train_asks_for_shared_diffs(tmp_path, monkeypatch):
    asked = {}

    class Stop(Exception):
        pass

    def fake_get_solver(param, source=None, share_diffs=False):
        asked["share_diffs"] = share_diffs
        raise Stop
    monkeypatch.setattr(solver_module, "get_solver", fake_get_solver)
    path = tmp_path / "solver.prototxt"
    path.write_text('net: "none.prototxt" base_lr: 0.1 lr_policy: "fixed" max_iter: 1')
    from cct import cli
    with pytest.raises(Stop):
        cli.main(["train", f"--solver={path}"])
    assert asked == {"share_diffs": True}


@pytest.mark.parametrize("value, enabled", [("1", True), ("true", True), ("0", False), ("off", False)])
def test_env_var_switches_it(value, enabled, monkeypatch):
    monkeypatch.setenv("CCT_SHARE_DIFFS", value)
    assert config.share_diffs_enabled() is enabled
    solver = solver_module.get_solver(solver_param(LENET))
    assert (memory.summary(solver.net) is not None) is enabled


def test_env_var_bad_value_is_an_error(monkeypatch):
    monkeypatch.setenv("CCT_SHARE_DIFFS", "maybe")
    with pytest.raises(ConfigError, match="CCT_SHARE_DIFFS: must be 1 or 0, got 'maybe'"):
        cct.SGDSolver(solver_param(LENET))


def test_config_key_switches_it(tmp_path, monkeypatch):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"share_diffs": True}))
    monkeypatch.setenv("CCT_CONFIG", str(path))
    assert config.share_diffs_enabled()
    assert memory.summary(cct.SGDSolver(solver_param(LENET)).net) is not None
    monkeypatch.setenv("CCT_SHARE_DIFFS", "0")          # the file, named for this run, decides
    assert memory.summary(cct.SGDSolver(solver_param(LENET)).net) is not None
    monkeypatch.delenv("CCT_SHARE_DIFFS")
    path.write_text(json.dumps({"share_diffs": False, "default": {"partitions": 1}}))
    config.load(path)
    assert not config.share_diffs_enabled()
    assert memory.summary(cct.SGDSolver(solver_param(LENET)).net) is None


@pytest.mark.parametrize("value", ["yes", 1, None, [True]])
def test_config_bad_value_names_file_and_key(tmp_path, value):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"share_diffs": value}))
    with pytest.raises(ConfigError, match=rf"{path}: share_diffs: must be true or false, got "):
        config.read(path)
