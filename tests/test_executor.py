"""Batch partitioning gives the same numbers as running each layer whole."""
import numpy as np
import pytest

import cct
from cct.executor import BlobSlice, BlasThreads

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


def test_blob_slice_is_a_fixed_view():
    blob = cct.Blob((4, 2))
    view = BlobSlice(blob, 1, 3)
    view.data[...] = 5
    assert blob.data[1:3].tolist() == [[5, 5], [5, 5]] and blob.data[0].tolist() == [0, 0]
    view.reshape(2, 2)
    with pytest.raises(cct.ShapeError):
        view.reshape(4, 2)


def test_blas_thread_count_is_restored():
    blas = BlasThreads()
    blas.set(1)
    blas.set(blas.default)
    assert blas.current == blas.default
