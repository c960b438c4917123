"""The executor (cct.runtime.executor): batch partitioning gives the same
numbers as running each layer whole; which layers its default plan, a plan
entry, the tuner and CCT_PARTITIONS split; clones and their budgets."""
import numpy as np
import pytest

import cct

NET = '''name: "partitioned"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 7 dim: 3 dim: 12 dim: 12 } shape { dim: 7 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.1 }
                            bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" relu_param { negative_slope: -0.2 } }
layer { name: "prelu" type: "PReLU" bottom: "conv1" top: "prelu" }
layer { name: "pool1" type: "Pooling" bottom: "prelu" top: "pool1" pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "norm1" type: "LRN" bottom: "pool1" top: "norm1" lrn_param { local_size: 3 } }
layer { name: "ip1" type: "InnerProduct" bottom: "norm1" top: "ip1"
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }
'''


def run(partitions):
    cct.set_random_seed(3)
    net = cct.Net(NET, cct.TRAIN)
    rng = np.random.default_rng(0)
    net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].shape)
    net.blobs["label"].data[...] = rng.integers(0, 5, 7)
    for index in range(len(net.layers)):
        if partitions > 1 and net.executor.partitionable(index):
            net.executor.set_partitions(index, partitions)
    net.forward()
    net.backward()
    net.forward()        # twice: clone state and param diff accumulation across passes
    net.backward()
    return net


@pytest.mark.parametrize("partitions", [2, 3, 7])
def test_partitioned_equals_whole(partitions):
    whole, parted = run(1), run(partitions)
    assert any(p > 1 for p in parted.executor.plan.values())
    for name in whole.blobs:
        np.testing.assert_allclose(parted.blobs[name].data, whole.blobs[name].data, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(parted.blobs[name].diff, whole.blobs[name].diff, rtol=1e-5, atol=1e-6)
    for name, blobs in whole.params.items():
        for ours, theirs in zip(parted.params[name], blobs):
            np.testing.assert_allclose(ours.diff, theirs.diff, rtol=1e-4, atol=1e-6)


def test_loss_and_label_layers_are_not_partitioned():
    net = run(1)
    names = [layer.name for i, layer in enumerate(net.layers) if net.executor.partitionable(i)]
    assert names == ["conv1", "relu1", "prelu", "pool1", "norm1", "ip1"]


def test_partition_k_always_runs_on_the_same_thread():
    """Per-thread work stores then exist once per partition index, not once per pool thread."""
    import threading
    net = run(1)
    index = [layer.name for layer in net.layers].index("pool1")
    net.executor.set_partitions(index, 3)
    seen = []
    runner = net.executor._runner(index)
    for clone in runner.clones:
        original = clone.forward

        def forward(bottom, top, original=original, clone=clone):
            seen.append((runner.clones.index(clone), threading.get_ident()))
            original(bottom, top)
        clone.forward = forward
    for _ in range(3):
        net.forward()
    threads = {}
    for partition, thread in seen:
        threads.setdefault(partition, set()).add(thread)
    assert all(len(ids) == 1 for ids in threads.values()) and len(threads) == 3
    assert threads[0] == {threading.get_ident()}          # partition 0 on the calling thread


def test_clones_share_the_layer_budget_and_the_first_clone_its_diffs():
    net = run(1)
    index = [layer.name for layer in net.layers].index("conv1")
    net.executor.set_partitions(index, 2)
    net.forward()
    net.backward()
    layer, clones = net.layers[index], net.executor._runner(index).clones
    assert [clone.lowering_budget for clone in clones] == [layer.lowering_budget // 2] * 2
    assert all(np.shares_memory(clones[0].blobs[i].diff, blob.diff) for i, blob in enumerate(layer.blobs))
    assert not any(np.shares_memory(clones[1].blobs[i].diff, blob.diff) for i, blob in enumerate(layer.blobs))
    assert not clones[1].blobs[0].diff.any()               # summed into the layer's, then cleared


def test_partitions_leave_unneeded_diffs_unmade():
    """In training (forward_backward, as the solver runs it) nothing asks for the
    input's diff: partitioned or not, it is never allocated."""
    for partitions in (1, 2):
        net = cct.Net(NET, cct.TRAIN)
        for index in range(len(net.layers)):
            if partitions > 1 and net.executor.partitionable(index):
                net.executor.set_partitions(index, partitions)
        net.forward_backward()
        assert net.blobs["data"]._diff_store is None and net.blobs["label"]._diff_store is None
        assert net.blobs["conv1"]._diff_store is not None


def test_tune_skips_partitions_that_copy_big_parameters(monkeypatch):
    import cct.runtime.executor
    net = run(1)
    monkeypatch.setattr(cct.runtime.executor, "TUNE_PARAM_COPY_BYTES", 1000)
    tried = []
    original = net.executor._time_layer

    def timed(index, repeats):
        tried.append((net.layers[index].name, net.executor.partitions(index)))
        return original(index, repeats)
    monkeypatch.setattr(net.executor, "_time_layer", timed)
    plan = net.executor.tune(candidates=[1, 2], repeats=1)
    # conv1 (8x3x3x3 + 8 floats: 896 bytes) may be split; ip1 (5 x 288 floats) may not
    assert ("conv1", 2) in tried and ("ip1", 2) not in tried and plan["ip1"] == 1


def test_default_plan_splits_large_layers_per_thread_but_not_inner_product(monkeypatch):
    net = run(1)
    executor = net.executor
    monkeypatch.setattr(executor, "threads", 2)
    monkeypatch.setattr("cct.runtime.executor.DEFAULT_SPLIT_ELEMENTS", net.blobs["pool1"].count)
    names = {layer.name: executor.partitions(i) for i, layer in enumerate(net.layers)}
    # conv1/relu1/prelu (7x8x12x12) and pool1 reach the size; norm1 shares pool1's size;
    # ip1 is an InnerProduct; data and loss cannot be partitioned
    assert names == {"data": 1, "conv1": 2, "relu1": 2, "prelu": 2, "pool1": 2, "norm1": 2, "ip1": 1, "loss": 1}
    executor.set_partitions(1, 1)                        # a plan entry wins over the default
    assert executor.partitions(1) == 1
    monkeypatch.setattr(executor, "threads", 4)          # 7 images: fewer than 2 per partition
    assert executor.partitions(3) == 1
    monkeypatch.setattr(executor, "threads", 3)
    assert executor.partitions(2) == 3                   # relu1: no parameters
    conv1_bytes = sum(blob.count * blob.dtype.itemsize for blob in net.layers[1].blobs)
    monkeypatch.setattr("cct.runtime.executor.TUNE_PARAM_COPY_BYTES", conv1_bytes)
    assert executor.partitions(2) == 3 and executor.default_partitions(1) == 2   # one copy of conv1's


def test_default_plan_splits_a_forward_only_net_at_any_size(monkeypatch):
    """Layers their net never runs backward (a deploy net: no loss) split below
    DEFAULT_SPLIT_ELEMENTS too, so OpenBLAS never runs threads of its own
    between partitioned layers; a training net's small layers stay whole. The
    split deploy net gives the whole one's numbers."""
    monkeypatch.setattr("cct.runtime.executor.DEFAULT_SPLIT_ELEMENTS", 1 << 30)
    deploy = NET.replace('top: "label"', "").replace("shape { dim: 7 } ", "").split('layer { name: "loss"')[0]
    nets = {}
    for threads in ("2", "1"):
        monkeypatch.setenv("CCT_THREADS", threads)
        cct.set_random_seed(3)
        nets[threads] = net = cct.Net(deploy, cct.TEST)
        net.blobs["data"].data[...] = np.random.default_rng(0).standard_normal(net.blobs["data"].shape)
        net.forward()
    split, whole = nets["2"], nets["1"]
    assert not any(layer.runs_backward for layer in split.layers)
    assert {layer.name: split.executor.partitions(i) for i, layer in enumerate(split.layers)} == {
        "data": 1, "conv1": 2, "relu1": 2, "prelu": 2, "pool1": 2, "norm1": 2, "ip1": 1}
    assert all(whole.executor.partitions(i) == 1 for i in range(len(whole.layers)))
    for name in whole.blobs:
        np.testing.assert_allclose(split.blobs[name].data, whole.blobs[name].data, rtol=1e-5, atol=1e-6)
    monkeypatch.setenv("CCT_THREADS", "2")
    training = run(1)
    assert all(training.executor.partitions(i) == 1 for i in range(len(training.layers)))


def test_default_plan_gives_the_whole_layer_numbers(monkeypatch):
    monkeypatch.setattr("cct.runtime.executor.DEFAULT_SPLIT_ELEMENTS", 1)
    monkeypatch.setenv("CCT_THREADS", "2")
    whole = run(1)                                       # conv1..norm1 now run as 2 partitions
    assert whole.executor.partitions(1) == 2
    monkeypatch.setenv("CCT_THREADS", "1")
    single = run(1)
    assert single.executor.partitions(1) == 1
    for name in whole.blobs:
        np.testing.assert_allclose(whole.blobs[name].diff, single.blobs[name].diff, rtol=1e-5, atol=1e-6)


def test_clones_follow_a_budget_set_after_they_were_made():
    net = run(2)
    conv = net.layers[1]
    runner = net.executor._runner(1)
    conv.lowering_budget = 4 << 20
    net.forward()
    assert all(clone.lowering_budget == 2 << 20 for clone in runner.clones)


def test_cct_partitions_1_runs_every_layer_whole(monkeypatch):
    monkeypatch.setenv("CCT_PARTITIONS", "1")
    monkeypatch.setenv("CCT_THREADS", "2")
    monkeypatch.setattr("cct.runtime.executor.DEFAULT_SPLIT_ELEMENTS", 1)
    net = run(1)
    assert all(net.executor.partitions(i) == 1 for i in range(len(net.layers)))


# --- a plan entry at every batch size -------------------------------------------------------------
def reshaped(net, batch):
    net.blobs["data"].reshape(batch, 3, 12, 12)
    net.blobs["label"].reshape(batch)
    net.reshape()
    return net


def test_a_plan_entry_runs_at_most_one_partition_per_sample():
    """What was asked stays in the plan; what runs follows the batch of the last reshape."""
    net = run(1)
    executor, conv1, ip1 = net.executor, net.layer_names.index("conv1"), net.layer_names.index("ip1")
    executor.set_partitions(conv1, 5)
    assert executor.partitions(conv1) == 5
    reshaped(net, 3)
    assert executor.partitions(conv1) == 3 and executor.plan[conv1] == 5
    reshaped(net, 1)
    assert executor.partitions(conv1) == 1 and not executor.partitionable(conv1)
    executor.set_partitions(ip1, 4)                      # asked at batch 1: no error, runs whole
    net.forward()
    net.backward()
    reshaped(net, 7)
    assert executor.partitions(conv1) == 5 and executor.partitions(ip1) == 4


def test_set_partitions_refuses_what_no_batch_allows():
    executor = run(1).executor
    with pytest.raises(ValueError, match=r"layer 'loss' \(SoftmaxWithLoss\).*cannot be batch-partitioned"):
        executor.set_partitions(len(executor.net.layers) - 1, 2)
    with pytest.raises(ValueError, match=r"layer 'conv1' \(Convolution\).*partitions must be >= 1, got 0"):
        executor.set_partitions(1, 0)


def test_tune_times_only_counts_the_batch_can_run():
    net = reshaped(run(1), 3)
    tried = []
    original = net.executor._time_layer

    def timed(index, repeats):
        tried.append(net.executor.partitions(index))
        return original(index, repeats)
    net.executor._time_layer = timed
    plan = net.executor.tune(candidates=[1, 2, 4], repeats=1)
    assert 2 in tried and 4 not in tried and max(plan.values()) <= 3
