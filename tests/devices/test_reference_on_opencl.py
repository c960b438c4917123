"""BVLC Caffe's reference cases on the OpenCL device (pocl's CPU device in
CI): forward and backward within the cases' 1e-4, the solver cases within
1e-3, with every layer that has a device path run on the device (the others
on the host, their blobs synced, as Caffe falls back to Forward_cpu)."""
import pytest

from cct.runtime import settings
from helpers.devices import OPENCL, opencl_or_skip
from helpers.reference import (CASE_NAMES, CASES, assert_matches_caffe, assert_solver_matches_caffe, run_case,
                               run_solver_case)


@pytest.fixture(params=[OPENCL])
def on_opencl(monkeypatch):
    device = opencl_or_skip()
    settings.set_device_id(device.index)
    settings.set_mode("gpu")
    return device


def assert_device_paths_ran_on(net, device):
    """Every layer whose device path covers its blobs ran on the device."""
    executor = net.executor
    for index, layer in enumerate(net.layers):
        bottoms, tops = net.bottom_vecs[index], net.top_vecs[index]
        expected = device.name if layer.runs_on(device, bottoms, tops) else "host"
        assert executor.placed[index] == expected, f"layer {layer.name} ({layer.type})"


@pytest.mark.parametrize("name", CASE_NAMES)
def test_reference_case_on_opencl(name, on_opencl):
    net = run_case(name)
    assert_matches_caffe(net, name)
    assert_device_paths_ran_on(net, on_opencl)


def test_device_paths_cover_the_reference_nets_hot_layers(on_opencl):
    """Not a vacuous pass: the convolution, pooling and inner product cases run on the device."""
    ran = set()
    for name in ("conv_basic", "lenet_sgd"):
        if (CASES / name / "net.prototxt").exists():
            net = run_case(name)
            ran |= {layer.type for index, layer in enumerate(net.layers)
                    if net.executor.placed.get(index) == on_opencl.name}
    assert {"Convolution", "InnerProduct"} <= ran


@pytest.mark.parametrize("case", ["lenet_sgd", "caffenet_mini_sgd"])
def test_reference_solver_case_on_opencl(case, on_opencl, monkeypatch):
    monkeypatch.chdir(CASES / case)
    solver = run_solver_case(case)
    assert_solver_matches_caffe(solver)
    assert "Convolution" in {layer.type for index, layer in enumerate(solver.net.layers)
                             if solver.net.executor.placed.get(index) == on_opencl.name}
