"""A net at batch 0 (issue 15), under every lowering type and batch partition
plan: Caffe's Blob::Reshape takes a 0 in any axis (blob.cpp), its layers loop
over the batch, so the net runs and gives empty tops; the losses are Caffe's
(0 through a normalizer of at least 1, NaN where Caffe divides by N = 0; see
tests/layers/test_degenerate_shapes.py, layer by layer). A partition plan
runs at most one partition per sample (cct.runtime.executor.fit): none is
empty at batch 0, and the empty ones of a batch smaller than the plan are
skipped (cct.runtime.partition)."""
import warnings

import numpy as np
import pytest

import cct

FILL = 'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "constant" value: 0.25 }'


@pytest.fixture(params=(1, 2, 3), ids=lambda t: f"type{t}")
def lowering_type(request, monkeypatch):
    monkeypatch.setenv("CCT_LOWERING", str(request.param))
    return request.param


EMPTY_NET = """force_backward: true
layer { name: "data" type: "Input" top: "data" top: "label" top: "target"
        input_param { shape { dim: %(n)d dim: 2 dim: 6 dim: 6 } shape { dim: %(n)d } shape { dim: %(n)d dim: 5 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 %(fill)s } }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "deconv" type: "Deconvolution" bottom: "pool" top: "deconv"
        convolution_param { num_output: 2 kernel_size: 2 stride: 2 %(fill)s } }
layer { name: "ip" type: "InnerProduct" bottom: "deconv" top: "ip"
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
layer { name: "l2" type: "EuclideanLoss" bottom: "ip" bottom: "target" top: "l2" loss_weight: 0 }
layer { name: "accuracy" type: "Accuracy" bottom: "ip" bottom: "label" top: "accuracy" }
"""


@pytest.mark.parametrize("partitions", [1, 2, 4], indirect=True)
def test_a_net_at_batch_zero_runs_under_every_lowering_and_partitioning(partitions, lowering_type):
    """Inputs of batch 0 (Blob::Reshape takes them; DummyData's fillers would
    refuse an empty top, as Caffe's CHECK(count) does): every blob has batch 0,
    SoftmaxWithLoss is 0 (its normalizer is at least 1), EuclideanLoss NaN
    (Caffe's dot / N with N = 0), Accuracy 0; the parameters' gradients are 0.
    The same net at batch 3 still runs, with finite losses."""
    net = cct.Net(EMPTY_NET % {"n": 0, "fill": FILL}, cct.TRAIN)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net.forward()
        net.backward()
    assert net.blobs["conv"].shape == (0, 4, 6, 6) and net.blobs["ip"].shape == (0, 5)
    assert net.blobs["data"].diff.shape == (0, 2, 6, 6)
    assert float(net.blobs["loss"].data) == 0.0 and float(net.blobs["accuracy"].data) == 0.0
    assert np.isnan(float(net.blobs["l2"].data))
    for name in ("conv", "deconv", "ip"):
        for param in net.params[name]:
            assert not param.diff.any()
    net.blobs["data"].reshape(3, 2, 6, 6)
    net.blobs["label"].reshape(3)
    net.blobs["target"].reshape(3, 5)
    net.reshape()
    net.forward()
    net.backward()
    assert np.isfinite(float(net.blobs["loss"].data))
    net.blobs["data"].reshape(0, 2, 6, 6)           # and back to 0, after partitioned runs at 3
    net.blobs["label"].reshape(0)
    net.blobs["target"].reshape(0, 5)
    net.reshape()
    net.forward()
    net.backward()
    assert net.blobs["ip"].shape == (0, 5) and float(net.blobs["loss"].data) == 0.0


def test_empty_partitions_are_skipped_when_the_batch_is_smaller_than_the_plan(monkeypatch):
    """A batch of 1 under 4 partitions: one runs, three are empty and skipped."""
    monkeypatch.setenv("CCT_PARTITIONS", "4")
    net = cct.Net(EMPTY_NET % {"n": 1, "fill": FILL}, cct.TRAIN)
    net.forward()
    net.backward()
    assert net.blobs["ip"].shape == (1, 5) and np.isfinite(float(net.blobs["loss"].data))


@pytest.mark.parametrize("partitions", [4], indirect=True)
def test_a_plan_at_batch_zero_runs_whole_and_tuning_finds_nothing_to_split(partitions):
    net = cct.Net(EMPTY_NET % {"n": 0, "fill": FILL}, cct.TRAIN)
    conv = net.layer_names.index("conv")
    net.executor.set_partitions(conv, 4)
    net.forward()
    net.backward()
    assert net.executor.partitions(conv) == 1 and not net.executor.partitionable(conv)
    assert net.executor.tune() == {}
