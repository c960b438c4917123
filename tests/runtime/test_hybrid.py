"""The hybrid CPU+device split (cct.runtime.hybrid): BVLC Caffe's reference
cases with every splittable layer's batch divided between the host and the
OpenCL device at uneven shares, the solver cases too; the shards staying on
the device between layers on one split; the FLOPS rule, its cache and the
run configuration's shares."""
import json

import numpy as np
import pytest

import cct
from cct.core.blob import SPLIT
from cct.runtime import hybrid, settings
from helpers.devices import OPENCL, opencl_or_skip
from helpers.reference import (CASE_NAMES, CASES, assert_matches_caffe, assert_solver_matches_caffe, load_case,
                               run_solver_case)


@pytest.fixture(params=[OPENCL])
def on_opencl(monkeypatch):
    device = opencl_or_skip()
    settings.set_device_id(device.index)
    settings.set_mode("gpu")
    return device


def split_everything(net, device, share):
    net.executor.hybrid = {index: share for index in range(len(net.layers))
                           if hybrid.splittable(net, index, device)}


def batch_of(name):
    net, inputs, _ = load_case(name)
    return min((v.shape[0] for v in inputs.values() if v.ndim), default=0)


# cases whose batch has at least two samples, so a share can put rows on each side
SPLIT_CASES = [name for name in CASE_NAMES if (CASES / name / "inputs.npz").exists() and batch_of(name) >= 2]


@pytest.mark.parametrize("share", [0.3, 0.85])
@pytest.mark.parametrize("name", SPLIT_CASES)
def test_reference_case_split_between_host_and_device(name, share, on_opencl):
    net, inputs, top_diffs = load_case(name)
    split_everything(net, on_opencl, share)
    for blob_name, values in inputs.items():
        net.blobs[blob_name].data[...] = values
    net.forward()
    for blob_name, values in top_diffs.items():
        net.blobs[blob_name].diff[...] = values
    net.backward()
    assert_matches_caffe(net, name)
    for index in net.executor.hybrid:
        assert net.executor.placed[index].startswith(f"hybrid: {share:.2f}"), net.layers[index].name


@pytest.mark.parametrize("share, where", [(0.0, "host"), (1.0, "device")])
def test_a_share_of_0_or_1_runs_the_layer_whole_on_one_side(share, where, on_opencl):
    net, inputs, top_diffs = load_case("conv_basic")
    split_everything(net, on_opencl, share)
    for blob_name, values in inputs.items():
        net.blobs[blob_name].data[...] = values
    net.forward()
    for blob_name, values in top_diffs.items():
        net.blobs[blob_name].diff[...] = values
    net.backward()
    conv = next(i for i, layer in enumerate(net.layers) if layer.type == "Convolution")
    assert net.executor.placed[conv] == (on_opencl.name if where == "device" else "host")
    assert_matches_caffe(net, "conv_basic")


def test_some_cases_are_really_split():
    """Not a vacuous pass: the convolution and inner product cases have batches to split."""
    assert {"conv_basic", "inner_product", "pool_max_pad"} <= set(SPLIT_CASES)


@pytest.mark.parametrize("share", [0.3, 0.85])
@pytest.mark.parametrize("case", ["lenet_sgd", "caffenet_mini_sgd"])
def test_reference_solver_case_split(case, share, on_opencl, monkeypatch):
    monkeypatch.chdir(CASES / case)
    settings.set_hybrid(True)
    settings.load(settings.parse(json.dumps({"hybrid": {"default": share}})))
    monkeypatch.setattr(hybrid, "measure_shares", lambda *args: pytest.fail("configured shares measure nothing"))
    solver = run_solver_case(case)
    assert_solver_matches_caffe(solver)
    placed = solver.net.executor.placed
    assert any(where.startswith(f"hybrid: {share:.2f}") for where in placed.values())


def test_a_shard_stays_on_the_device_between_layers_on_one_split(on_opencl):
    """conv then ReLU in place then conv, all at 0.5: the ReLU's and the second
    convolution's device rows are read from the shard the first convolution
    wrote; no copy down in between, until the host reads the whole blob."""
    net = cct.Net(NET_TEXT, cct.TRAIN)
    split_everything(net, on_opencl, 0.5)
    net.blobs["data"].data[...] = np.random.default_rng(0).standard_normal(net.blobs["data"].shape)
    downloads = []
    original = type(on_opencl).download
    try:
        type(on_opencl).download = lambda self, *args, **kwargs: (downloads.append(args[1].size),
                                                                  original(self, *args, **kwargs))
        for index in range(len(net.layers)):
            net.executor.forward(index)
        assert downloads == []
        assert net.blobs["conv1"]._data_mirror.head == SPLIT
        values = net.blobs["conv2"].data                     # the whole blob on the host: its rows come down
        assert downloads == [net.blobs["conv2"].count // 2]
    finally:
        type(on_opencl).download = original
    reference = cct.Net(NET_TEXT, cct.TRAIN)
    reference.copy_from_net = None
    for name, params in net.params.items():
        for ours, theirs in zip(params, reference.params[name]):
            theirs.data[...] = ours.data
    cct.set_mode_cpu()
    try:
        reference.blobs["data"].data[...] = net.blobs["data"].data
        reference.forward()
    finally:
        settings.set_mode("gpu")
    np.testing.assert_allclose(values, reference.blobs["conv2"].data, rtol=1e-5, atol=1e-5)


NET_TEXT = """name: "split" force_backward: true
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 4 dim: 2 dim: 6 dim: 6 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 3 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
        convolution_param { num_output: 2 kernel_size: 3 weight_filler { type: "gaussian" std: 0.3 } } }
"""


def test_flops_share_is_each_sides_rate_over_the_sum():
    assert hybrid.flops_share(3.0, 1.0) == pytest.approx(0.75)        # the device 3x as fast: 3/4 of the batch
    assert hybrid.flops_share(1.0, 1.0) == pytest.approx(0.5)
    assert hybrid.flops_share(1.0, 0.0) == 1.0 and hybrid.flops_share(0.0, 1.0) == 0.0


def test_the_rows_timed_are_around_the_flops_rules_share_and_the_whole_batch():
    assert hybrid.candidate_rows(32, 1.0, 3.0) == [7, 8, 9, 32]             # 8 = 32 * 1/4
    assert hybrid.candidate_rows(32, 1.0, 20.0) == [1, 2, 32]               # 1.52: 0 is no candidate
    assert hybrid.candidate_rows(4, 1.0, 0.0) == [3, 4]


def test_best_rows_takes_the_fastest_split_as_timed():
    assert hybrid.best_rows(1.0, {1: 0.97, 2: 1.2}) == 1
    # a split slower than the host alone: none (on this host 1 row of conv2's 16 on pocl took 1.18x)
    assert hybrid.best_rows(1.0, {1: 1.18}) == 0
    # the device alone faster than any split with the host (the lent H100's conv1)
    assert hybrid.best_rows(1.6, {245: 0.17, 256: 0.144}) == 256


def test_a_split_is_timed_as_it_runs(on_opencl, monkeypatch):
    """split_seconds runs the HybridLayer itself, both sides at once."""
    net = cct.Net(NET_TEXT, cct.TRAIN)
    net.blobs["data"].data[...] = 1.0
    net.forward()
    ran = []
    original = hybrid.HybridLayer.forward
    monkeypatch.setattr(hybrid.HybridLayer, "forward",
                        lambda self, *args: (ran.append(self.cut(4)), original(self, *args))[1])
    assert hybrid.split_seconds(net, 1, on_opencl, rows=3) > 0
    assert ran and set(ran) == {1}                          # 3 of 4 rows on the device: the host's cut at 1


def test_the_plan_measures_once_caches_and_takes_configured_shares(on_opencl, tmp_path, monkeypatch):
    monkeypatch.setenv("CCT_CACHE_DIR", str(tmp_path))
    net = cct.Net(NET_TEXT, cct.TRAIN)
    net.blobs["data"].data[...] = 1.0
    net.forward()
    shares = hybrid.plan(net, on_opencl)
    names = {net.layers[index].name: share for index, share in shares.items()}
    assert set(names) == {"conv1", "relu1", "conv2"}
    assert all(0.0 <= share <= 1.0 for share in names.values())
    assert names["relu1"] == names["conv1"]                # no GEMM work: the split of its bottom's maker
    cached = list((tmp_path / "hybrid").glob("*.json"))
    assert len(cached) == 1
    monkeypatch.setattr(hybrid, "measure_shares", lambda *args: pytest.fail("measured again"))
    assert hybrid.plan(net, on_opencl) == shares
    configured = hybrid.plan(net, on_opencl, {"default": 0.25, "conv2": 0.9})
    assert {net.layers[i].name: s for i, s in configured.items()} == {"conv1": 0.25, "relu1": 0.25, "conv2": 0.9}
    with pytest.raises(cct.ConfigError, match="hybrid: no layer named 'nope'"):
        hybrid.plan(net, on_opencl, {"nope": 0.5})


def test_a_chain_is_measured_once_not_once_per_layer(on_opencl, monkeypatch):
    """conv1, relu1, conv2 form one chain: each layer with work is timed whole
    once (it was timed again for every layer of its chain: minutes on CaffeNet)."""
    net = cct.Net(NET_TEXT, cct.TRAIN)
    net.blobs["data"].data[...] = 1.0
    net.forward()
    timed = []
    original = hybrid.layer_times
    monkeypatch.setattr(hybrid, "layer_times", lambda net, index, *args: (timed.append(net.layers[index].name),
                                                                          original(net, index, *args))[1])
    shares = hybrid.measure_shares(net, on_opencl)
    assert sorted(timed) == ["conv1", "conv2"]
    assert len(set(shares.values())) == 1                  # one cut for the chain


def test_the_run_configuration_checks_its_hybrid_entry():
    assert settings.parse('{"hybrid": {"conv1": 0.85}}').hybrid == {"conv1": 0.85}
    for bad in ('{"hybrid": 2}', '{"hybrid": {"conv1": 1.5}}', '{"hybrid": {"conv1": true}}'):
        with pytest.raises(cct.ConfigError, match="hybrid"):
            settings.parse(bad)
