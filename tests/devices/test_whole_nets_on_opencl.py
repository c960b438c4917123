"""Whole zoo nets on the OpenCL device against the host: LeNet's and
CIFAR-10 quick's deploy nets, forward and backward from the same random
weights and top gradient, every layer on the device. (CaffeNet, GoogLeNet,
VGG-16 and ResNet-50 take minutes on pocl: bench/check_device_nets.py runs
all seven, and BENCHMARKS.md has its figures.) And a small MobileNet-SSD's
forward, its depthwise convolutions and DetectionOutput on the device too."""
import numpy as np
import pytest

import cct
from cct.formats.prototxt import read_net
from cct.runtime import settings
from helpers.devices import opencl_or_skip
from helpers.paths import MODELS

DEPLOY_NETS = {"lenet": MODELS / "lenet" / "lenet.prototxt",
               "cifar10_quick": MODELS / "cifar10_quick" / "cifar10_quick.prototxt"}


def one_pass(param, weights, top_diff_seed=5):
    """A net built from `param` with `weights`, forward, then backward from a
    random top gradient: {name: array} of every blob's data and diff and
    every parameter gradient."""
    net = cct.Net(param, cct.TEST)
    for name, values in weights.items():
        for blob, array in zip(net.params[name], values):
            blob.data[...] = array
    net.blobs["data"].data[...] = np.random.default_rng(2).standard_normal(net.blobs["data"].shape)
    net.forward()
    top = net.blobs[net.outputs[0]]
    top.diff[...] = np.random.default_rng(top_diff_seed).standard_normal(top.shape)
    net.backward()
    arrays = {f"{name} data": blob.data.copy() for name, blob in net.blobs.items()}
    arrays.update({f"{name} diff": blob.diff.copy() for name, blob in net.blobs.items()})
    arrays.update({f"{name}[{i}] gradient": p.diff.copy() for name, params in net.params.items()
                   for i, p in enumerate(params)})
    return net, arrays


@pytest.mark.opencl
@pytest.mark.parametrize("name", sorted(DEPLOY_NETS))
def test_a_deploy_net_on_the_device_matches_the_host(name, monkeypatch):
    device = opencl_or_skip()
    param = read_net(str(DEPLOY_NETS[name]))
    param.force_backward = True
    param.layer[0].input_param.shape[0].dim[0] = 3
    rng = np.random.default_rng(1)
    probe = cct.Net(param, cct.TEST)
    weights = {layer: [rng.standard_normal(p.shape).astype(np.float32) * (0.5 if p.data.ndim > 1 else 0.1)
                       / np.sqrt(max(p.count // p.shape[0], 1)) for p in params]
               for layer, params in probe.params.items()}
    settings.set_mode("cpu")
    _, on_host = one_pass(param, weights)
    settings.set_device_id(device.index)
    settings.set_mode("gpu")
    net, on_device = one_pass(param, weights)
    assert all(where == device.name for index, where in net.executor.placed.items()
               if net.layers[index].type != "Input"), net.executor.placed
    for key, expected in on_host.items():
        scale = max(float(np.linalg.norm(expected)), 1e-6)
        assert np.linalg.norm(on_device[key] - expected) / scale < 1e-5, key


# A small MobileNet-SSD: a strided convolution, a depthwise 3 x 3 and a 1 x 1
# (MobileNet's block), location and confidence heads on two maps, priors,
# softmax, DetectionOutput
MOBILE_SSD = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 32 dim: 32 } } }
layer { name: "conv0" type: "Convolution" bottom: "data" top: "conv0"
  convolution_param { num_output: 8 kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "relu0" type: "ReLU" bottom: "conv0" top: "conv0" }
layer { name: "conv1_dw" type: "Convolution" bottom: "conv0" top: "conv1_dw"
  convolution_param { num_output: 8 group: 8 kernel_size: 3 pad: 1 } }
layer { name: "relu1_dw" type: "ReLU" bottom: "conv1_dw" top: "conv1_dw" }
layer { name: "conv1" type: "Convolution" bottom: "conv1_dw" top: "conv1" convolution_param { num_output: 16 kernel_size: 1 } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "conv2_dw" type: "ConvolutionDepthwise" bottom: "conv1" top: "conv2_dw"
  convolution_param { kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "conv2" type: "Convolution" bottom: "conv2_dw" top: "conv2" convolution_param { num_output: 16 kernel_size: 1 } }
HEAD(conv1, 8)
HEAD(conv2, 16)
layer { name: "loc" type: "Concat" bottom: "conv1_loc_flat" bottom: "conv2_loc_flat" top: "loc" }
layer { name: "conf" type: "Concat" bottom: "conv1_conf_flat" bottom: "conv2_conf_flat" top: "conf" }
layer { name: "priors" type: "Concat" bottom: "conv1_prior" bottom: "conv2_prior" top: "priors" concat_param { axis: 2 } }
layer { name: "conf_reshape" type: "Reshape" bottom: "conf" top: "conf_reshape"
  reshape_param { shape { dim: 0 dim: -1 dim: 3 } } }
layer { name: "conf_softmax" type: "Softmax" bottom: "conf_reshape" top: "conf_softmax" softmax_param { axis: 2 } }
layer { name: "conf_flat" type: "Flatten" bottom: "conf_softmax" top: "conf_flat" }
layer { name: "det" type: "DetectionOutput" bottom: "loc" bottom: "conf_flat" bottom: "priors" top: "det"
  detection_output_param { num_classes: 3 share_location: true background_label_id: 0
    nms_param { nms_threshold: 0.45 top_k: 100 } code_type: CENTER_SIZE keep_top_k: 50 confidence_threshold: 0.3 } }
"""
HEAD = """
layer { name: "BLOB_loc" type: "Convolution" bottom: "BLOB" top: "BLOB_loc" convolution_param { num_output: 12 kernel_size: 3 pad: 1 } }
layer { name: "BLOB_loc_perm" type: "Permute" bottom: "BLOB_loc" top: "BLOB_loc_perm" permute_param { order: 0 order: 2 order: 3 order: 1 } }
layer { name: "BLOB_loc_flat" type: "Flatten" bottom: "BLOB_loc_perm" top: "BLOB_loc_flat" }
layer { name: "BLOB_conf" type: "Convolution" bottom: "BLOB" top: "BLOB_conf" convolution_param { num_output: 9 kernel_size: 3 pad: 1 } }
layer { name: "BLOB_conf_perm" type: "Permute" bottom: "BLOB_conf" top: "BLOB_conf_perm" permute_param { order: 0 order: 2 order: 3 order: 1 } }
layer { name: "BLOB_conf_flat" type: "Flatten" bottom: "BLOB_conf_perm" top: "BLOB_conf_flat" }
layer { name: "BLOB_prior" type: "PriorBox" bottom: "BLOB" bottom: "data" top: "BLOB_prior"
  prior_box_param { min_size: SIZE aspect_ratio: 2 flip: true variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 } }
"""


def mobile_ssd():
    text = MOBILE_SSD
    for blob, size in (("conv1", 8), ("conv2", 16)):
        text = text.replace(f"HEAD({blob}, {size})", HEAD.replace("BLOB", blob).replace("SIZE", str(size)))
    return text


@pytest.mark.opencl
def test_a_small_mobilenet_ssd_on_the_device_finds_what_the_host_finds():
    """Every layer on the device, the depthwise convolutions and DetectionOutput
    included; the same detections (the heads' sums round in another order on
    the device: scores and boxes within 1e-5)."""
    device = opencl_or_skip()
    param = read_net(mobile_ssd())
    rng = np.random.default_rng(3)
    probe = cct.Net(param, cct.TEST)
    weights = {layer: [rng.standard_normal(p.shape).astype(np.float32) * 0.3 for p in params]
               for layer, params in probe.params.items()}
    image = np.random.default_rng(4).standard_normal((2, 3, 32, 32)).astype(np.float32)
    found = []
    for mode in ("cpu", "gpu"):
        if mode == "gpu":
            settings.set_device_id(device.index)
        settings.set_mode(mode)
        net = cct.Net(param, cct.TEST)
        for name, values in weights.items():
            for blob, array in zip(net.params[name], values):
                blob.data[...] = array
        net.blobs["data"].data[...] = image
        found.append(net.forward()["det"].copy())
    assert all(where == device.name for index, where in net.executor.placed.items()
               if net.layers[index].type != "Input"), net.executor.placed
    host, ours = found
    assert host.shape == ours.shape and (host[0, 0, :, 1] > 0).sum() > 5
    np.testing.assert_array_equal(ours[..., :2], host[..., :2])
    np.testing.assert_allclose(ours[..., 2:], host[..., 2:], rtol=0, atol=1e-5)
