"""cct.lowering.chooser and cct.lowering.chunking: the cost model's picks on
fixed machine constants (no timing here), the cache file, the GEMM fit,
workspace reuse, and chunked execution equal to whole-batch execution."""
import dataclasses
import json
import threading

import numpy as np
import pytest

import cct

from cct.testing.gradient_check import make_layer, setup_layer
from cct.lowering import ConvGeometry, chooser, conv_backward, conv_forward, reference
from cct.lowering.chooser import Machine
from cct.core.workspace import FRESH, Arena, thread_arena
from cct.lowering.chunking import chunk_size, chunks, image_bytes

# Constants measured on the development machine (one BLAS thread), rounded.
FIXED = Machine(bandwidth=21e9, gather_row=3e-9, scatter_row=3e-9, add_row=15e-9, gemm_flops=96e9,
                gemm_out_bandwidth=8e9, gemm_in_bandwidth=16e9)
RNG = np.random.default_rng(5)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CCT_CACHE_DIR", str(tmp_path))
    chooser.clear_memory_cache()
    yield tmp_path
    chooser.clear_memory_cache()


def square(d, o, n=13, k=3, pad=1):
    return ConvGeometry(d, o, n, n, k, k, pad_h=pad, pad_w=pad)


# --- the model -----------------------------------------------------------------------------
@pytest.mark.parametrize("d,o", [(16, 256), (8, 128), (3, 96)])
def test_few_inputs_many_outputs_picks_type1(d, o):
    assert chooser.choose(square(d, o), 64, FIXED) == 1


@pytest.mark.parametrize("d,o", [(256, 16), (512, 32), (1024, 64)])
def test_many_inputs_few_outputs_picks_type3(d, o):
    assert chooser.choose(square(d, o), 64, FIXED) == 3


def test_caffenet_conv1_picks_type1():
    conv1 = ConvGeometry(3, 96, 227, 227, 11, 11, stride_h=4, stride_w=4)
    assert chooser.choose(conv1, 256, FIXED, budget=256 * 2 ** 20) == 1


def test_type1_cost_grows_with_d_over_o_relative_to_type3():
    def type1_over_type3(d):
        geom = square(d, 4096 // d)
        return chooser.estimate(geom, 64, 1, FIXED) / chooser.estimate(geom, 64, 3, FIXED)
    ratios = [type1_over_type3(d) for d in (16, 64, 256)]
    assert ratios[0] < ratios[1] < ratios[2]


def test_estimate_parts_add_up_and_scale_with_batch():
    geom = square(32, 64)
    for kind in chooser.TYPES:
        parts = chooser.estimate_parts(geom, 8, kind, FIXED)
        assert {p for p, _ in parts} == {"forward", "backward"}
        assert all(seconds >= 0 for seconds in parts.values())
        assert chooser.estimate(geom, 8, kind, FIXED) == pytest.approx(sum(parts.values()))
        assert chooser.estimate(geom, 16, kind, FIXED) > chooser.estimate(geom, 8, kind, FIXED)


def test_skinny_gemms_run_below_peak():
    square_rate = 2 * 1024 ** 3 / FIXED.gemm_seconds(1024, 1024, 1024)
    skinny_rate = 2 * 1024 * 65536 * 4 / FIXED.gemm_seconds(1024, 65536, 4)
    assert skinny_rate < 0.2 * square_rate < FIXED.gemm_flops


def test_gemm_fit_recovers_constants():
    probes = [[m, n, k, FIXED.gemm_seconds(m, n, k)] for m, n, k in chooser.GEMM_PROBES]
    flops, out_bw, in_bw = chooser.fit_gemm(probes)
    assert flops == pytest.approx(FIXED.gemm_flops, rel=1e-6)
    assert out_bw == pytest.approx(FIXED.gemm_out_bandwidth, rel=1e-6)
    assert in_bw == pytest.approx(FIXED.gemm_in_bandwidth, rel=1e-6)


# --- calibrating only where it changes a choice -------------------------------------------------
def test_a_choice_every_nominal_machine_agrees_on_calibrates_nothing(monkeypatch):
    monkeypatch.setattr(chooser, "measure_machine", lambda: pytest.fail("calibrated"))
    geom = square(16, 256)
    assert chooser.choose_uncalibrated(geom, 64) is not None
    assert chooser.choose(geom, 64) == chooser.choose_by_model(geom, 64, chooser.NOMINAL_MACHINE)


def test_a_choice_that_depends_on_the_machine_calibrates_once(monkeypatch):
    """Asked to be exact (CLOSE_ENOUGH 1), CaffeNet's conv5 shape at 32
    images picks differently on some nominal machine: the host is measured,
    once, and the model runs on its constants."""
    monkeypatch.setattr(chooser, "CLOSE_ENOUGH", 1.0)
    geom = square(384, 256, n=13)
    assert chooser.choose_uncalibrated(geom, 32) is None
    calls = []
    monkeypatch.setattr(chooser, "measure_machine", lambda: calls.append(1) or FIXED)
    assert chooser.choose(geom, 32) == chooser.choose_by_model(geom, 32, FIXED)
    assert chooser.choose(geom, 32) == chooser.choose_by_model(geom, 32, FIXED) and calls == [1]


def test_a_stored_calibration_is_used_once_it_merges_enough_measurements(cache_dir, monkeypatch):
    stored = dataclasses.replace(FIXED, calibrations=chooser.CALIBRATIONS - 1)
    (cache_dir / "lowering.json").write_text(json.dumps({"version": chooser.CACHE_VERSION, "choices": {},
                                                         "machines": {chooser.machine_key(): stored.to_dict()}}))
    assert chooser.known_machine() is None                  # a few calibrations may read slow: not yet
    monkeypatch.setattr(chooser, "measure_machine", lambda: FIXED)
    assert chooser.load_machine().calibrations == chooser.CALIBRATIONS
    chooser.clear_memory_cache()                              # a new process
    monkeypatch.setattr(chooser, "measure_machine", lambda: pytest.fail("calibrated"))
    assert chooser.known_machine().calibrations == chooser.CALIBRATIONS


# --- the cache file ----------------------------------------------------------------------------
def test_machine_is_measured_once_per_process_and_cached(cache_dir, monkeypatch):
    calls = []
    monkeypatch.setattr(chooser, "measure_machine", lambda: calls.append(1) or FIXED)
    assert chooser.load_machine() == FIXED
    assert chooser.load_machine() == FIXED and calls == [1]
    stored = json.loads((cache_dir / "lowering.json").read_text())
    assert stored["machines"][chooser.machine_key()]["gemm_flops"] == FIXED.gemm_flops


def probed(machine, slowdown=1.0):
    """`machine` with its GEMM probes timed by its own model, `slowdown` times slower."""
    probes = [[m, n, k, slowdown * machine.gemm_seconds(m, n, k)] for m, n, k in chooser.GEMM_PROBES]
    return dataclasses.replace(machine, probes=probes)


def test_cache_keeps_the_fastest_calibration_seen(cache_dir, monkeypatch):
    """A calibration taken under load reads slow; the next quiet process
    replaces it, and a later loaded one cannot make it slow again."""
    quiet = probed(FIXED)
    loaded = dataclasses.replace(probed(FIXED, 3.0), bandwidth=FIXED.bandwidth / 3, gemm_flops=FIXED.gemm_flops / 3,
                                 gather_row=3 * FIXED.gather_row, add_row=3 * FIXED.add_row)
    for measured in (loaded, quiet, loaded):
        chooser.clear_memory_cache()                   # a new process
        monkeypatch.setattr(chooser, "measure_machine", lambda: measured)
        machine = chooser.load_machine()
    assert machine.bandwidth == FIXED.bandwidth and machine.gather_row == FIXED.gather_row
    assert machine.gemm_flops == pytest.approx(FIXED.gemm_flops, rel=1e-6)
    assert machine.gemm_in_bandwidth == pytest.approx(FIXED.gemm_in_bandwidth, rel=1e-6)
    stored = json.loads((cache_dir / "lowering.json").read_text())["machines"][chooser.machine_key()]
    assert stored["gemm_flops"] == pytest.approx(FIXED.gemm_flops, rel=1e-6)
    chooser.clear_memory_cache()
    monkeypatch.setattr(chooser, "measure_machine", lambda: loaded)
    assert chooser.load_machine(refresh=True).bandwidth == loaded.bandwidth      # refresh forgets the file


def timed_copies(copy_seconds, gather_seconds, elements=1300, rows=100):
    """Machine.copies of a calibration: its contiguous copy and its strided
    passes (the scatter and add as fast as the gather, per element)."""
    return {"copy": [10 ** 6, 1, 2, copy_seconds], "gather": [elements, rows, 2, gather_seconds],
            "scatter": [elements, rows, 2, gather_seconds], "add": [elements, rows, 3, 1.5 * gather_seconds]}


def test_the_cache_merges_copy_timings_not_constants(cache_dir, monkeypatch):
    """A run whose contiguous copy timed slow (its bandwidth low) derives a
    row cost of 0 from a fast strided pass; another run times the copy fast
    and the strided pass slow. Merged, the best copy and the best strided
    pass give the row cost no single run saw but both bound: positive, where
    the constants' own best (largest bandwidth, smallest row) gave 0 for good."""
    noisy_copy = timed_copies(copy_seconds=4e-3, gather_seconds=2.0e-6)
    noisy_gather = timed_copies(copy_seconds=1e-3, gather_seconds=3.0e-6)
    runs = [dataclasses.replace(probed(FIXED), copies=copies) for copies in (noisy_copy, noisy_gather)]
    runs = [dataclasses.replace(run, **dict(zip(("bandwidth", "gather_row", "scatter_row", "add_row"),
                                                chooser.copy_constants(run.copies)))) for run in runs]
    assert runs[0].gather_row == 0 and runs[1].gather_row > 0
    for measured in runs:
        chooser.clear_memory_cache()                   # a new process each
        monkeypatch.setattr(chooser, "measure_machine", lambda: measured)
        machine = chooser.load_machine()
    bandwidth = 2 * 10 ** 6 * 4 / 1e-3
    assert machine.bandwidth == pytest.approx(bandwidth)
    assert machine.gather_row == pytest.approx((2.0e-6 - 2 * 1300 * 4 / bandwidth) / 100) and machine.gather_row > 0
    stored = json.loads((cache_dir / "lowering.json").read_text())["machines"][chooser.machine_key()]
    assert stored["copies"]["copy"][3] == 1e-3 and stored["copies"]["gather"][3] == 2.0e-6


def test_measure_machine_derives_its_constants_from_its_timed_copies():
    machine = chooser.measure_machine()
    assert sorted(machine.copies) == sorted(chooser.COPY_PROBES)
    assert (machine.bandwidth, machine.gather_row, machine.scatter_row, machine.add_row) == \
        chooser.copy_constants(machine.copies)
    assert chooser.Machine.from_dict(machine.to_dict()) == machine


def test_measured_choice_is_cached_per_shape(cache_dir, monkeypatch):
    monkeypatch.setattr(chooser, "measure_types", lambda geom, batch, dtype, forward_only: {1: 3.0, 2: 1.0, 3: 2.0})
    geom = square(8, 8)
    assert chooser.choose(geom, 4, FIXED, measure=True) == 2
    chooser.clear_memory_cache()
    monkeypatch.setattr(chooser, "measure_types", lambda *args: pytest.fail("measured twice"))
    assert chooser.choose(geom, 4, FIXED, measure=True) == 2
    choices = json.loads((cache_dir / "lowering.json").read_text())["choices"]
    assert list(choices.values()) == [{"type": 2, "seconds": {"1": 3.0, "2": 1.0, "3": 2.0}}]


def test_forward_only_choices_are_measured_and_cached_apart(cache_dir, monkeypatch):
    """A deploy net's convolution times the forward alone, under its own key."""
    asked = []
    monkeypatch.setattr(chooser, "measure_types", lambda geom, batch, dtype, forward_only: asked.append(
        forward_only) or ({1: 1.0, 2: 3.0, 3: 2.0} if forward_only else {1: 3.0, 2: 1.0, 3: 2.0}))
    geom = square(8, 8)
    assert chooser.choose(geom, 4, FIXED, measure=True, forward_only=True) == 1
    assert chooser.choose(geom, 4, FIXED, measure=True) == 2
    assert chooser.choose(geom, 4, FIXED, measure=True, forward_only=True) == 1
    assert asked == [True, False]
    assert len(json.loads((cache_dir / "lowering.json").read_text())["choices"]) == 2


def test_measure_types_forward_only_runs_no_backward(monkeypatch):
    import cct.lowering as lowering
    monkeypatch.setattr(lowering, "conv_backward", lambda *a, **k: pytest.fail("a backward ran"))
    seconds = chooser.measure_types(square(2, 3, n=5), 2, repeats=1, forward_only=True)
    assert sorted(seconds) == [1, 2, 3]


def test_corrupt_cache_file_is_replaced(cache_dir, monkeypatch):
    (cache_dir / "lowering.json").write_text("{not json")
    monkeypatch.setattr(chooser, "measure_machine", lambda: FIXED)
    assert chooser.load_machine() == FIXED
    assert json.loads((cache_dir / "lowering.json").read_text())["version"] == chooser.CACHE_VERSION


def test_measure_types_times_every_type_on_a_small_shape():
    seconds = chooser.measure_types(square(2, 3, n=5), 2, repeats=1)
    assert sorted(seconds) == [1, 2, 3] and all(s > 0 for s in seconds.values())


# --- workspace and chunks ----------------------------------------------------------------------
def test_arena_reuses_and_grows_its_stores():
    arena = Arena()
    a = arena.empty("lowered", (4, 5), np.float32)
    store = arena.stores["lowered"]
    b = arena.empty("lowered", (2, 10), np.float32)
    assert arena.stores["lowered"] is store and np.shares_memory(a, b)
    arena.zeros("lowered", (3, 3), np.float64)
    assert arena.stores["lowered"] is store                 # 72 bytes fit in 80
    big = arena.empty("lowered", (100,), np.float32)
    assert arena.stores["lowered"] is not store and big.shape == (100,)
    assert FRESH.empty("x", (2,), np.float32) is not FRESH.empty("x", (2,), np.float32)


def test_threads_have_their_own_arenas():
    seen = []
    worker = threading.Thread(target=lambda: seen.append(thread_arena()))
    worker.start()
    worker.join()
    assert seen[0] is not thread_arena() and thread_arena() is thread_arena()


def test_chunk_size_fits_the_budget():
    geom = ConvGeometry(3, 96, 227, 227, 11, 11, stride_h=4, stride_w=4)   # CaffeNet conv1
    per_image = image_bytes(geom, 1, 4)
    assert per_image == (363 * 55 * 55 + 2 * 96 * 55 * 55 + 3 * 227 * 227) * 4
    size = chunk_size(geom, 1, 256, 4, 256 * 2 ** 20)
    assert size * per_image <= 256 * 2 ** 20 < (size + 1) * per_image
    assert chunk_size(geom, 1, 256, 4, 1) == 1 and chunk_size(geom, 1, 4, 4, 2 ** 40) == 4
    assert chunks(5, 2) == [(0, 2), (2, 4), (4, 5)]


@pytest.mark.parametrize("kind", chooser.TYPES)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_chunked_equals_whole(kind, chunk):
    geom = ConvGeometry(4, 6, 7, 6, 3, 2, stride_h=2, pad_h=1, pad_w=1, group=2)
    x = RNG.standard_normal(geom.input_shape(5))
    w = RNG.standard_normal(geom.weight_shape)
    dy = RNG.standard_normal(geom.output_shape(5))
    arena = Arena()
    y = conv_forward(x, w, geom, kind, ws=arena, chunk=chunk)
    dx, dw = conv_backward(x, dy, w, geom, kind, ws=arena, chunk=chunk)
    np.testing.assert_allclose(y, reference.forward(x, w, geom), atol=1e-10)
    np.testing.assert_allclose(dx, reference.backward_data(dy, w, geom), atol=1e-10)
    np.testing.assert_allclose(dw, reference.backward_weights(x, dy, geom), atol=1e-10)


CONV = ('type: "Convolution" convolution_param { num_output: 6 kernel_size: 3 pad: 1 '
        'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 } }')


def run_layer(x, dy):
    cct.set_random_seed(1)                         # the same filled weights every time
    layer = make_layer(CONV)
    bottoms, tops = setup_layer(layer, [x])
    layer.forward(bottoms, tops)
    tops[0].diff[...] = dy
    layer.backward(tops, [True], bottoms)
    return layer, tops[0].data.copy(), bottoms[0].diff.copy(), layer.blobs[0].diff.copy()


@pytest.mark.parametrize("kind", ["1", "2", "3"])
def test_layer_under_a_tiny_budget_equals_unchunked(kind, monkeypatch):
    monkeypatch.setenv("CCT_LOWERING", kind)
    x = RNG.standard_normal((5, 4, 6, 6))
    dy = RNG.standard_normal((5, 6, 6, 6))
    whole = run_layer(x, dy)
    monkeypatch.setenv("CCT_LOWERING_BUDGET_MB", "0.001")          # about 1 KB: one image per chunk
    chunked = run_layer(x, dy)
    assert chunked[0]._chunk(int(kind), x) == 1 and whole[0]._chunk(int(kind), x) == 5
    for ours, theirs in zip(chunked[1:], whole[1:]):
        np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-12)


def test_layer_reuses_its_workspace_across_forwards(monkeypatch):
    monkeypatch.setenv("CCT_LOWERING", "1")
    layer = make_layer(CONV)
    bottoms, tops = setup_layer(layer, [RNG.standard_normal((3, 4, 6, 6))])
    arena = thread_arena()
    layer.forward(bottoms, tops)
    store, lowered = arena.store, arena.empty("lowered", (1,), np.float64)
    first = tops[0].data.copy()
    for _ in range(2):
        layer.reshape(bottoms, tops)
        layer.forward(bottoms, tops)
        tops[0].diff[...] = 1
        layer.backward(tops, [True], bottoms)
        assert arena.store is store                                         # the same buffer object
        assert np.shares_memory(arena.empty("lowered", (1,), np.float64), lowered)
    np.testing.assert_array_equal(tops[0].data, first)


def test_arena_plan_lays_slots_out_in_one_store():
    arena = Arena()
    arena.plan({"a": 100, "b": 10})
    a, b = arena.empty("a", (25,), np.float32), arena.empty("b", (10,), np.uint8)
    assert not np.shares_memory(a, b) and np.shares_memory(a, arena.store) and np.shares_memory(b, arena.store)
    store = arena.store
    arena.plan({"b": 60, "a": 60})                  # smaller in all: the same store
    assert arena.store is store and arena.stores == {}
    arena.empty("c", (3,), np.float32)              # unplanned: a store of its own
    assert set(arena.stores) == {"c"}
    arena.plan({"a": 10 ** 4})
    assert arena.store is not store and arena.store.size >= 10 ** 4


def test_layer_uses_the_model_choice_and_caches_it(monkeypatch):
    monkeypatch.delenv("CCT_LOWERING", raising=False)
    monkeypatch.setattr(chooser, "load_machine", lambda: FIXED)
    calls = []
    choose = chooser.choose
    monkeypatch.setattr(chooser, "choose", lambda *a, **k: calls.append(a) or choose(*a, **k))
    layer = make_layer('type: "Convolution" convolution_param { num_output: 2 kernel_size: 3 pad: 1 }')
    bottoms, tops = setup_layer(layer, [np.zeros((16, 64, 13, 13), np.float32)])
    assert layer.lowering_type == 3                         # d/o = 32
    layer.reshape(bottoms, tops)
    assert len(calls) == 1                                  # same shape: no second choice
    layer.lowering_type = 1                                 # a scheduler forces it
    layer.reshape(bottoms, tops)
    assert layer.lowering_type == 1


def test_types_2_and_3_pay_for_copying_their_kernel_matrix():
    """K2 and K3 are the weights transposed, copied at every call (and twice
    more in a backward); a 1 x 1 kernel's are views. Big weights on small
    planes (ResNet's res5 3x3 at batch 1: type 2 took 3.9x type 1's forward)
    make types 2 and 3 dearer."""
    res5 = ConvGeometry(512, 512, 7, 7, 3, 3, pad_h=1, pad_w=1)
    for kind in (2, 3):
        parts = chooser.estimate_parts(res5, 1, kind, FIXED)
        weights = 512 * 512 * 9
        row = 3 if kind == 2 else 1
        assert parts["forward", "kernel"] == pytest.approx(FIXED.gather(weights, row, 4))
        assert parts["backward", "kernel"] == pytest.approx(2 * parts["forward", "kernel"])
    assert ("forward", "kernel") not in chooser.estimate_parts(res5, 1, 1, FIXED)
    pointwise = ConvGeometry(512, 512, 7, 7, 1, 1)
    assert not any(part == "kernel" for _, part in chooser.estimate_parts(pointwise, 1, 3, FIXED))
    assert chooser.choose(res5, 1, FIXED, forward_only=True) == 1


def test_forward_only_estimate_is_the_forward_parts():
    """Caffenet's conv2 (one group) at batch 1: the forward parts alone, and the
    choice on them may differ from the one on both passes."""
    conv2 = ConvGeometry(48, 128, 27, 27, 5, 5, pad_h=2, pad_w=2)
    for kind in chooser.TYPES:
        parts = chooser.estimate_parts(conv2, 1, kind, FIXED)
        forward = sum(seconds for (step, _), seconds in parts.items() if step == "forward")
        assert chooser.estimate(conv2, 1, kind, FIXED, forward_only=True) == pytest.approx(forward)
        assert chooser.estimate(conv2, 1, kind, FIXED) == pytest.approx(sum(parts.values()))
        assert 0 < forward < sum(parts.values())
    costs = {kind: chooser.estimate(conv2, 1, kind, FIXED, forward_only=True) for kind in chooser.TYPES}
    assert chooser.choose(conv2, 1, FIXED, forward_only=True) == min(costs, key=costs.get)


NET_WITH_A_BRANCH = """
name: "branch"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } shape { dim: 2 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 4 kernel_size: 3 } }
layer { name: "side" type: "Convolution" bottom: "data" top: "side"
        convolution_param { num_output: 2 kernel_size: 3 } }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip" inner_product_param { num_output: 3 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


@pytest.mark.parametrize("force", [False, True])
def test_a_net_tells_its_convolutions_whether_they_run_backward(tmp_path, monkeypatch, force):
    """Layers feeding no loss (the net's layer_need_backward) choose their
    lowering for the forward alone; force_backward makes every layer run it."""
    monkeypatch.delenv("CCT_LOWERING", raising=False)
    asked = {}
    choose = chooser.choose
    monkeypatch.setattr(chooser, "load_machine", lambda: FIXED)
    monkeypatch.setattr(chooser, "choose", lambda geom, batch, **kwargs: asked.__setitem__(
        geom.num_output, kwargs["forward_only"]) or choose(geom, batch, **kwargs))
    path = tmp_path / "net.prototxt"
    path.write_text(("force_backward: true\n" if force else "") + NET_WITH_A_BRANCH)
    net = cct.Net(str(path), cct.TRAIN)
    net.forward()
    assert [layer.runs_backward for layer in net.layers] == net.layer_need_backward
    assert asked == {4: False, 2: not force}             # "side" feeds no loss
    deploy = cct.Net(str(path), cct.TEST)
    assert deploy.layer_dict["side"].runs_backward is force


def test_layer_chooses_for_the_batch_one_partition_lowers(monkeypatch):
    """Told it runs as p batch partitions (the executor does so after every
    reshape), a convolution asks the chooser about the largest partition and
    its share of the budget: what each twin's GEMM really gets."""
    monkeypatch.delenv("CCT_LOWERING", raising=False)
    asked = []
    monkeypatch.setattr(chooser, "choose", lambda geom, batch, **kwargs: asked.append((batch, kwargs["budget"])) or 2)
    layer = make_layer('type: "Convolution" convolution_param { num_output: 2 kernel_size: 3 pad: 1 }')
    bottoms, tops = setup_layer(layer, [np.zeros((7, 4, 5, 5), np.float32)])
    layer.configure({"lowering_budget_mb": 8})
    budget = 8 * 2 ** 20
    for partitions, expected in ((1, (7, budget)), (3, (3, budget // 3)), (9, (1, budget // 7))):
        layer.run_partitions(partitions)
        assert asked[-1] == expected and layer.lowering_type == 2
    calls = len(asked)
    layer.run_partitions(9)
    layer.reshape(bottoms, tops)
    assert len(asked) == calls                              # same shape, same partitions: no new choice
