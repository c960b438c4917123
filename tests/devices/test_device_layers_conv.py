"""Convolution, Deconvolution and InnerProduct on a device (lowering type 1,
cct.lowering.device; depthwise geometries by the direct depthwise kernels)
against their host paths, on the numpy CPU device and on OpenCL: forward,
data and parameter gradients (accumulated)."""
import numpy as np
import pytest

from cct.core.rng import set_random_seed
from cct.devices.cpu import CPU
from cct.lowering import device as device_lowering, ConvGeometry
from helpers.devices import OPENCL, assert_close_both_ways, opencl_or_skip, run_both_ways


@pytest.fixture(params=["cpu", OPENCL])
def device(request):
    return CPU if request.param == "cpu" else opencl_or_skip()


CONVOLUTIONS = [
    "num_output: 4 kernel_size: 3",
    "num_output: 6 kernel_size: 3 stride: 2 pad: 1 group: 2",
    "num_output: 3 kernel_h: 2 kernel_w: 3 stride_h: 1 stride_w: 2 pad_h: 0 pad_w: 1 bias_term: false",
    "num_output: 4 kernel_size: 3 dilation: 2 pad: 2",
    "num_output: 2 kernel_size: 3 stride: 2",                  # the last window overruns a 6-wide input
    "num_output: 5 kernel_size: 1",
]
FILLERS = 'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 }'


@pytest.mark.parametrize("kind", ["Convolution", "Deconvolution"])
@pytest.mark.parametrize("fields", CONVOLUTIONS)
def test_convolution_on_device_matches_the_host(device, kind, fields):
    x = np.random.default_rng(1).standard_normal((3, 4, 6, 7))
    text = f'type: "{kind}" convolution_param {{ {fields} {FILLERS} }}'
    assert_close_both_ways(run_both_ways(device, text, [x]), 1e-5)


def test_convolution_on_device_with_two_bottoms_shares_the_weights(device):
    rng = np.random.default_rng(2)
    x, x2 = rng.standard_normal((2, 3, 5, 5)), rng.standard_normal((2, 3, 5, 5))
    text = f'type: "Convolution" convolution_param {{ num_output: 4 kernel_size: 3 {FILLERS} }}'
    assert_close_both_ways(run_both_ways(device, text, [x, x2], num_tops=2), 1e-5)


def test_device_lowering_runs_a_batch_in_chunks_within_the_budget(device):
    """A budget of two images' lowered matrices: chunks of 2, 2, 1, the same numbers."""
    geom = ConvGeometry(3, 4, 6, 6, 3, 3, pad_h=1, pad_w=1)
    per_image = 3 * 9 * 36
    assert device_lowering.chunks(geom, 5, 2 * per_image) == [(0, 2), (2, 2), (4, 1)]
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((5, 3, 6, 6)).astype(np.float32), rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    outputs = []
    for budget in (2 * per_image, device_lowering.DEFAULT_BUDGET):
        buffers = [device.empty(a.size) for a in (x, w)]
        for buffer, array in zip(buffers, (x, w)):
            device.upload(buffer, array.reshape(-1))
        y = device.empty(5 * 4 * 36)
        device_lowering.forward(device, buffers[0], buffers[1], geom, 5, y, budget=budget)
        host = np.empty(5 * 4 * 36, np.float32)
        device.download(y, host)
        outputs.append(host)
    np.testing.assert_array_equal(outputs[0], outputs[1])


@pytest.mark.parametrize("kind", ["Convolution", "Deconvolution"])
def test_a_layers_device_lowering_keeps_to_its_lowering_budget(device, kind, monkeypatch):
    """lowering_budget_mb reaches the device: a budget below one image's
    lowered matrix lowers image by image (5 chunks), the default all at once:
    within rounding of each other (smaller GEMMs) and of the host."""
    lowered = []
    im2col = device.im2col
    monkeypatch.setattr(device, "im2col", lambda *args: lowered.append(args[2]) or im2col(*args))
    x = np.random.default_rng(5).standard_normal((5, 3, 6, 6))
    text = f'type: "{kind}" convolution_param {{ num_output: 4 kernel_size: 3 pad: 1 {FILLERS} }}'
    counts, results = [], []
    for budget in (64, 1e-4):                                    # MB: the default, then about 100 bytes
        lowered.clear()
        set_random_seed(0)                                       # the same filled weights both times
        results.append(run_both_ways(device, text, [x], settings={"lowering_budget_mb": budget}))
        counts.append(sorted(set(lowered)))
    assert counts == [[5], [1]]
    for name in results[0]:       # smaller GEMMs, and a weight gradient summed chunk by chunk: rounding apart
        np.testing.assert_allclose(results[1][name][0], results[0][name][0], rtol=1e-5, atol=1e-5)
    assert_close_both_ways(results[1], 1e-5)


@pytest.mark.parametrize("fields", ["num_output: 5", "num_output: 3 bias_term: false",
                                    "num_output: 4 transpose: true", "num_output: 2 axis: 2"])
def test_inner_product_on_device_matches_the_host(device, fields):
    x = np.random.default_rng(4).standard_normal((3, 4, 2, 5))
    text = f'type: "InnerProduct" inner_product_param {{ {fields} {FILLERS} }}'
    assert_close_both_ways(run_both_ways(device, text, [x]), 1e-5)


# --- depthwise: group == channels == num_output, the direct kernels ------------------
DEPTHWISE = [
    "kernel_size: 3 pad: 1",
    "kernel_size: 3 stride: 2 pad: 1",
    "kernel_h: 2 kernel_w: 3 stride_h: 1 stride_w: 2 pad_h: 0 pad_w: 1 bias_term: false",
    "kernel_size: 3 dilation: 2 pad: 2",
    "kernel_size: 3 stride: 2",                                # the last window overruns a 7-wide input
    "kernel_size: 5 stride: 3 pad: 2",
    "kernel_size: 1",
]


def depthwise_text(kind, fields, channels=4):
    group = "" if kind == "ConvolutionDepthwise" else f"num_output: {channels} group: {channels}"
    return f'type: "{kind}" convolution_param {{ {group} {fields} {FILLERS} }}'


@pytest.mark.parametrize("kind", ["Convolution", "Deconvolution", "ConvolutionDepthwise", "DepthwiseConvolution"])
@pytest.mark.parametrize("fields", DEPTHWISE)
def test_depthwise_on_device_matches_the_host(device, kind, fields):
    """Outputs and data gradients bit for bit (the host's order: window cells
    in row-major order, for planes whose outputs the host sums in one pass);
    the weight gradient, summed in another order, within 1e-5."""
    x = np.random.default_rng(5).standard_normal((3, 4, 6, 7))
    results = run_both_ways(device, depthwise_text(kind, fields), [x])
    assert_close_both_ways({name: results[name] for name in ("top0", "bottom0.diff")}, 0)
    assert_close_both_ways(results, 1e-5)


def test_depthwise_on_device_large_planes(device):
    """Planes past the host's pass of 1,024 outputs (its data gradient then
    adds a pixel's terms pass by pass): within float32 rounding."""
    x = np.random.default_rng(6).standard_normal((2, 3, 40, 36))
    results = run_both_ways(device, depthwise_text("Convolution", "kernel_size: 3 pad: 1", 3), [x])
    assert_close_both_ways({"top0": results["top0"]}, 0)
    assert_close_both_ways(results, 1e-5)


def test_depthwise_on_device_runs_no_gemm(device, monkeypatch):
    """A depthwise geometry lowers nothing: no GEMM, no im2col, forward or backward."""
    def refused(*args, **kwargs):
        raise AssertionError("a depthwise convolution was lowered")
    for op in ("gemm", "im2col", "col2im"):
        monkeypatch.setattr(device, op, refused)
    x = np.random.default_rng(7).standard_normal((2, 4, 5, 5))
    assert_close_both_ways(run_both_ways(device, depthwise_text("Convolution", "kernel_size: 3 pad: 1"), [x]), 1e-5)
