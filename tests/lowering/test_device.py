"""cct.lowering.device on the numpy device and on OpenCL: split-K weight
gradients against the unsplit GEMM and a float64 product, run to run bitwise;
the chunks of images sized from lowering_budget_mb or the device's memory."""
import numpy as np
import pytest

from cct.core.rng import set_random_seed
from cct.devices.cpu import CPU, CPUDevice
from cct.lowering import device as device_lowering, ConvGeometry
from helpers.devices import OPENCL, assert_close_both_ways, on_device, opencl_or_skip, run_both_ways, to_host

FILLERS = 'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 }'


@pytest.fixture(params=["cpu", OPENCL])
def device(request):
    return CPUDevice() if request.param == "cpu" else opencl_or_skip()   # a CPU of its own: tests set its sizes


def weight_gradients(device, geom, columns, slices, seed=0):
    """dw (G, Og, R) from a fixed start plus dY_g @ D_g^T split in `slices`,
    with the float64 product it should equal."""
    rows, outputs, _ = device_lowering._sizes(geom)
    rng = np.random.default_rng(seed)
    gradient = rng.standard_normal((geom.group, outputs, columns)).astype(np.float32)
    lowered = rng.standard_normal((geom.group, rows, columns)).astype(np.float32)
    start = rng.standard_normal((geom.group, outputs, rows)).astype(np.float32)
    gradient_buffer, lowered_buffer, dw = on_device(device, [gradient, lowered, start])
    device_lowering.weight_gradient(device, gradient_buffer, lowered_buffer, geom, columns, dw, slices)
    exact = start + np.einsum("gok,grk->gor", gradient.astype(np.float64), lowered.astype(np.float64))
    return to_host(device, dw, start.size), exact.reshape(-1)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("slices", [2, 5, 7])
def test_split_k_weight_gradient_is_the_unsplit_one(device, group, slices):
    """K cut in 2, 5 and 7 slices (7 leaves a remainder on the last), every
    group in the one batched GEMM: the float64 product within float32
    rounding, as the unsplit GEMM is; the same bits on a second run."""
    geom = ConvGeometry(2 * group, 4 * group, 9, 9, 3, 3, group=group)
    columns = 1000
    unsplit, exact = weight_gradients(device, geom, columns, 1)
    split, _ = weight_gradients(device, geom, columns, slices)
    again, _ = weight_gradients(device, geom, columns, slices)
    scale = np.sqrt(columns)                      # a sum of `columns` unit-variance products
    np.testing.assert_allclose(unsplit, exact, rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(split, exact, rtol=0, atol=1e-5 * scale)
    np.testing.assert_array_equal(split, again)


def test_split_k_fills_the_compute_units():
    """split_k: where the output's tiles are fewer than the compute units,
    slices until each has TILE_WAVES tiles, none narrower than MIN_SLICE."""
    gpu = CPUDevice()
    gpu.compute_units = 132
    assert device_lowering.split_k(gpu, 96, 363, 256 * 3025) == 22      # conv1: 12 tiles
    assert device_lowering.split_k(gpu, 128, 1200, 256 * 729) == 7       # conv2 per group: 38 tiles
    assert device_lowering.split_k(gpu, 96, 363, 3 * 4096 + 1) == 3      # K too narrow for 22
    assert device_lowering.split_k(gpu, 4096, 4096, 10 ** 6) == 1        # 4096 tiles fill it already
    assert device_lowering.split_k(gpu, 640, 1280, 10 ** 6) == 1         # 200 tiles: each unit has one
    assert device_lowering.split_k(CPU, 96, 363, 256 * 3025) == 1        # one compute unit


def layer_results(device, kind, group, settings=None, batch=3):
    """run_both_ways of a 3 x 3 Convolution or Deconvolution over a batch whose
    weight gradient sums 64 x 64 positions per image (K >= 2 * MIN_SLICE)."""
    size = 66 if kind == "Convolution" else 64
    x = np.random.default_rng(7).standard_normal((batch, 2 * group, size, size))
    text = (f'type: "{kind}" convolution_param {{ num_output: {2 * group} kernel_size: 3 group: {group} '
            f'{FILLERS} }}')
    set_random_seed(0)                            # the same filled weights every run
    return run_both_ways(device, text, [x], settings=settings)


@pytest.mark.parametrize("kind", ["Convolution", "Deconvolution"])
@pytest.mark.parametrize("group", [1, 2])
def test_a_layers_split_k_weight_gradient_matches_the_host_bitwise_run_to_run(device, kind, group,
                                                                           monkeypatch):
    """On a device of many compute units a layer's weight gradient is split
    (3 slices of K): within float32 rounding of the
    host's and of the unsplit device one; the same bits on a second run."""
    chosen = []
    split_k = device_lowering.split_k
    monkeypatch.setattr(device_lowering, "split_k", lambda *args: chosen.append(split_k(*args)) or chosen[-1])
    monkeypatch.setattr(device, "compute_units", 1)
    unsplit = layer_results(device, kind, group)
    monkeypatch.setattr(device, "compute_units", 10_000)
    split, again = layer_results(device, kind, group), layer_results(device, kind, group)
    assert chosen == [1, 3, 3]
    weights = "param0.diff"
    assert_close_both_ways({weights: split[weights]}, 1e-5)
    assert_close_both_ways({weights: (split[weights][0], unsplit[weights][0])}, 1e-5)
    np.testing.assert_array_equal(split[weights][0], again[weights][0])
    for name in split:                            # the rest does not depend on the split
        if name != weights:
            np.testing.assert_array_equal(split[name][0], unsplit[name][0])


def test_device_budget_is_a_share_of_the_devices_memory_within_its_largest_buffer():
    device = CPUDevice()
    assert device_lowering.device_budget(device) == device_lowering.DEFAULT_BUDGET     # the host's memory
    device.memory_bytes, device.max_alloc_bytes = 2 ** 30, 2 ** 28
    assert device_lowering.device_budget(device) == 2 ** 30 // device_lowering.MEMORY_SHARE // 4
    device.memory_bytes = 2 ** 36
    assert device_lowering.device_budget(device) == 2 ** 28 // 4


@pytest.mark.parametrize("kind", ["Convolution", "Deconvolution"])
def test_a_layers_chunks_follow_the_devices_memory_unless_lowering_budget_mb_is_set(device, kind, monkeypatch):
    """No lowering_budget_mb: the chunks come from the device's memory (sized
    here for two images' lowered matrices: 2, 2, 1); lowering_budget_mb set
    (64 MB, the default's value) keeps to it: all 5 at once. The same numbers."""
    lowered = []
    im2col = device.im2col
    monkeypatch.setattr(device, "im2col", lambda *args: lowered.append(args[2]) or im2col(*args))
    per_image = 4 * 9 * 16 * 16 * 4                              # bytes: C*KH*KW rows, 16 x 16 columns
    monkeypatch.setattr(device, "memory_bytes", 2 * per_image * device_lowering.MEMORY_SHARE)
    monkeypatch.setattr(device, "max_alloc_bytes", 2 ** 30)
    x = np.random.default_rng(5).standard_normal((5, 4, 16, 16))
    text = f'type: "{kind}" convolution_param {{ num_output: 4 kernel_size: 3 pad: 1 group: 2 {FILLERS} }}'
    counts, results = [], []
    for settings in (None, {"lowering_budget_mb": 64}):
        lowered.clear()
        set_random_seed(0)
        results.append(run_both_ways(device, text, [x], settings=settings))
        counts.append(sorted(set(lowered)))
    assert counts == [[1, 2], [5]]
    assert_close_both_ways(results[0], 1e-5)
    assert_close_both_ways({name: (ours, results[1][name][0]) for name, (ours, _) in results[0].items()}, 1e-5)
