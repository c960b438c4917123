"""Whole zoo nets on the OpenCL device against the host: LeNet's and
CIFAR-10 quick's deploy nets, forward and backward from the same random
weights and top gradient, every layer on the device. (CaffeNet, GoogLeNet,
VGG-16 and ResNet-50 take minutes on pocl: bench/check_device_nets.py runs
all seven, and BENCHMARKS.md has its figures.)"""
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
