"""cct.lowering.winograd: the transforms against the direct convolution, the
cached transformed weights, the chooser's timed choice and the Convolution
layer's use of it (forward-only nets, the run settings)."""
import contextlib
import json

import numpy as np
import pytest

import cct
from cct.core.errors import ConfigError
from cct.lowering import ConvGeometry, chooser, reference, winograd
from cct.core.workspace import Arena
from cct.runtime import settings
from cct.testing.gradient_check import make_layer, setup_layer

RNG = np.random.default_rng(17)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CCT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CCT_WINOGRAD", raising=False)
    monkeypatch.delenv("CCT_LOWERING", raising=False)
    chooser.clear_memory_cache()
    yield tmp_path
    chooser.clear_memory_cache()


@pytest.mark.parametrize("m, r", winograd.VARIANTS)
def test_the_transforms_compute_a_correlation(m, r):
    """A^T [(G g G^T) . (B^T d B)] A is the valid r x r correlation of an
    alpha x alpha block, in float64 to rounding."""
    bt, g, at = winograd.transforms(m, r)
    alpha = m + r - 1
    assert bt.shape == (alpha, alpha) and g.shape == (alpha, r) and at.shape == (m, alpha)
    for _ in range(5):
        d, kernel = RNG.standard_normal((alpha, alpha)), RNG.standard_normal((r, r))
        y = at @ ((g @ kernel @ g.T) * (bt @ d @ bt.T)) @ at.T
        expected = [[np.sum(d[i:i + r, j:j + r] * kernel) for j in range(m)] for i in range(m)]
        np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)


GEOMETRIES = [ConvGeometry(3, 5, 9, 9, 3, 3, pad_h=1, pad_w=1),          # 9 = 2 tiles of 4 + 1
              ConvGeometry(4, 6, 8, 11, 3, 3),                           # no padding, uneven sides
              ConvGeometry(2, 3, 5, 7, 3, 3, pad_h=2, pad_w=1),
              ConvGeometry(6, 4, 13, 13, 3, 3, pad_h=1, pad_w=1, group=2),
              ConvGeometry(8, 8, 3, 3, 3, 3, pad_h=0, pad_w=2),          # one output row
              ConvGeometry(1, 2, 1, 1, 3, 3, pad_h=1, pad_w=1),          # 1 x 1 image
              ConvGeometry(4, 6, 13, 13, 5, 5, pad_h=2, pad_w=2),        # 5 x 5: F(2x2, 5x5)
              ConvGeometry(6, 4, 9, 8, 5, 5, pad_h=4, pad_w=0, group=2),
              ConvGeometry(2, 3, 5, 5, 5, 5)]                           # one output
CASES = [(geom, m) for geom in GEOMETRIES for m in winograd.tile_sizes(geom.kernel_h)]


def _case(geom, batch):
    rng = np.random.default_rng([geom.channels, geom.num_output, geom.in_h, geom.in_w, geom.pad_h, batch])
    x = rng.standard_normal(geom.input_shape(batch)).astype(np.float32)
    w = rng.standard_normal(geom.weight_shape).astype(np.float32)
    bias = rng.standard_normal(geom.num_output).astype(np.float32)
    exact = reference.forward(x.astype(np.float64), w.astype(np.float64), geom)
    return x, w, bias, exact + bias.reshape(1, -1, 1, 1)


# Largest error over the output's largest value: 4e-7 (F(2x2, 3x3), alpha 4)
# and 5.5e-6 (F(4x4, 3x3), alpha 6) over 40 random shapes of up to 64 channels;
# the fractions of the alpha-6 transforms (1/6, 1/24) round.
TOLERANCE = {4: 2e-6, 6: 2e-5}


def _close(actual, expected, scale=None, m=4, r=3):
    scale = np.abs(expected).max() if scale is None else scale
    np.testing.assert_allclose(actual, expected, rtol=0, atol=TOLERANCE[m + r - 1] * max(scale, 1e-30))


@pytest.mark.parametrize("geom, m", CASES, ids=[f"{geom}-F{m}" for geom, m in CASES])
def test_forward_matches_the_direct_convolution(geom, m):
    x, w, bias, expected = _case(geom, 3)
    u = winograd.weights_for(w, geom, m)
    y = winograd.forward(x, u, geom, m, bias=bias)
    assert y.shape == expected.shape and y.dtype == np.float32
    _close(y, expected, m=m, r=geom.kernel_h)
    out = np.full(expected.shape, np.nan, np.float32)
    assert winograd.forward(x, u, geom, m, out=out, ws=Arena()) is out
    _close(out, expected - bias.reshape(1, -1, 1, 1), np.abs(expected).max(), m, geom.kernel_h)


@pytest.mark.parametrize("slope", [0.0, 0.25])
def test_forward_applies_the_relu_as_the_layer_does(slope):
    geom = GEOMETRIES[0]
    x, w, bias, expected = _case(geom, 2)
    y = winograd.forward(x, winograd.weights_for(w, geom, 4), geom, 4, bias=bias, relu=slope)
    relu = np.where(expected > 0, expected, expected * slope)
    _close(y, relu, np.abs(expected).max())
    assert (y[expected < -1e-3] == 0).all() if slope == 0 else (y[expected < -1e-3] < 0).all()


@pytest.mark.parametrize("m, columns, images", [(2, 40, 2), (4, 20, 3)])
def test_blocks_of_images_give_the_whole_batch(m, columns, images, monkeypatch):
    """Several blocks (BLOCK_COLUMNS small) and a last, shorter one: 25 tiles
    an image at m = 2, 9 at m = 4 (channels innermost)."""
    geom = GEOMETRIES[0]
    x, w, bias, _ = _case(geom, 5)
    u = winograd.weights_for(w, geom, m)
    whole = winograd.forward(x, u, geom, m, bias=bias)
    monkeypatch.setattr(winograd, "BLOCK_COLUMNS", columns)
    assert winograd.block_images(geom, m, 5) == images
    np.testing.assert_array_equal(winograd.forward(x, u, geom, m, bias=bias, ws=Arena()), whole)


@pytest.mark.parametrize("m, r", winograd.VARIANTS)
def test_both_layouts_give_the_same_convolution(m, r, monkeypatch):
    """Tiles innermost and channels innermost (the threshold moved to force
    each), batch 3 in blocks of 2 images, grouped, bias and ReLU: the same
    numbers up to the GEMM's order of sums; each U is G g G^T in its layout."""
    geom = ConvGeometry(8, 6, 11, 9, r, r, pad_h=r // 2, pad_w=r // 2, group=2)
    x, w, bias, expected = _case(geom, 3)
    monkeypatch.setattr(winograd, "BLOCK_COLUMNS", 2 * np.prod(winograd.tile_counts(geom, m)))
    results = {}
    for inner in (False, True):
        monkeypatch.setattr(winograd, "CHANNELS_INNER_MIN", 1 if inner else 10 ** 9)
        assert winograd.channels_inner(geom, m) == inner
        u = winograd.weights_for(w, geom, m)
        alpha = m + r - 1
        assert u.shape == ((alpha * alpha, 4, 6) if inner else (alpha * alpha, 6, 4)) and u.flags.c_contiguous
        _, g, _ = winograd.transforms(m, r)
        kernel = u[:, 1, 2] if inner else u[:, 2, 1]
        np.testing.assert_allclose(kernel.reshape(alpha, alpha), g @ w[2, 1].astype(np.float64) @ g.T,
                                   rtol=1e-6, atol=1e-6)
        results[inner] = winograd.forward(x, u, geom, m, bias=bias, relu=0.0, ws=Arena())
        _close(results[inner], np.maximum(expected, 0), np.abs(expected).max(), m, r)
    _close(results[True], results[False], np.abs(expected).max(), m, r)


def test_the_layout_follows_the_channels_and_the_tiles():
    """Channels innermost from CHANNELS_INNER_MIN channels, or with as many
    channels as tiles; tiles innermost for few channels on large planes."""
    assert winograd.channels_inner(ConvGeometry(64, 64, 56, 56, 3, 3, pad_h=1, pad_w=1), 4)
    assert winograd.channels_inner(ConvGeometry(32, 32, 16, 16, 3, 3, pad_h=1, pad_w=1), 4)      # 16 tiles
    assert not winograd.channels_inner(ConvGeometry(32, 32, 32, 32, 3, 3, pad_h=1, pad_w=1), 4)  # 64 tiles
    assert not winograd.channels_inner(ConvGeometry(16, 96, 28, 28, 5, 5, pad_h=2, pad_w=2), 2)


def test_applicable_shapes():
    assert winograd.applicable(ConvGeometry(2, 2, 8, 8, 3, 3, pad_h=1, pad_w=1))
    assert winograd.applicable(ConvGeometry(2, 2, 8, 8, 5, 5, pad_h=4, pad_w=4))
    assert winograd.tile_sizes(3) == (2, 4) and winograd.tile_sizes(5) == (2,) and winograd.tile_sizes(7) == ()
    for geom in (ConvGeometry(2, 2, 8, 8, 3, 3, stride_h=2, stride_w=2),
                 ConvGeometry(2, 2, 8, 8, 7, 7), ConvGeometry(2, 2, 8, 8, 3, 1),
                 ConvGeometry(2, 2, 8, 8, 5, 5, pad_h=5, pad_w=5),
                 ConvGeometry(2, 2, 8, 8, 3, 3, dilation_h=2, dilation_w=2),
                 ConvGeometry(2, 2, 8, 8, 3, 3, pad_h=3, pad_w=3), ConvGeometry(0, 2, 8, 8, 3, 3)):
        assert not winograd.applicable(geom), geom
    assert not winograd.applicable(ConvGeometry(2, 2, 8, 8, 3, 3), np.float64)
    with pytest.raises(ValueError, match=r"F\(m x m, r x r\) is one of"):
        winograd.transforms(4, 5)


def test_transformed_weights_follow_writes_through_views():
    w = RNG.standard_normal((4, 3, 3, 3)).astype(np.float32)
    cache = winograd.TransformedWeights()
    geom = ConvGeometry(3, 4, 8, 8, 3, 3, pad_h=1, pad_w=1)
    first = cache.get(w, geom, 4)
    assert cache.get(w, geom, 4) is first                     # unchanged: not made again
    np.testing.assert_array_equal(first, winograd.weights_for(w, geom, 4))
    w[1, 2, 0, 0] += 1                                        # a write no flag sees
    second = cache.get(w, geom, 4)
    assert second is not first
    np.testing.assert_array_equal(second, winograd.weights_for(w, geom, 4))
    w[0, 0, 0, 0] = -0.0 if w[0, 0, 0, 0] == 0 else 0.0       # bit for bit, -0.0 too
    assert cache.get(w, geom, 4) is not second
    assert cache.nbytes == first.nbytes + w.nbytes


@pytest.mark.parametrize("channels, outputs", [(3, 4), (64, 8)])
def test_transformed_weights_fill_the_arrays_reserved_ahead(channels, outputs):
    """reserve() allocates the weights' copy and U for the shape (the
    executor faults their pages in before the first forward); get() fills
    those very arrays, with the same bits, and a reservation for a tile
    the forward does not run is dropped."""
    w = RNG.standard_normal((outputs, channels, 3, 3)).astype(np.float32)
    geom = ConvGeometry(channels, outputs, 16, 16, 3, 3, pad_h=1, pad_w=1)
    cache = winograd.TransformedWeights()
    source, u_ahead = cache.reserve(w, geom, 4)
    assert source.shape == w.shape and u_ahead.nbytes + source.nbytes == winograd.held_bytes(w, 4)
    u = cache.get(w, geom, 4)
    assert np.shares_memory(u, u_ahead)
    np.testing.assert_array_equal(u, winograd.weights_for(w, geom, 4))
    assert cache.reserve(w, geom, 4) == []                     # made: nothing more to reserve
    cache.reserve(w, geom, 2)
    assert cache.get(w, geom, 4) is u and cache.nbytes == u.nbytes + w.nbytes   # the F(2) array let go
    np.testing.assert_array_equal(cache.get(w, geom, 2), winograd.weights_for(w, geom, 2))


# --- the chooser ------------------------------------------------------------------------------------
def test_timed_choice_is_cached_per_shape(cache_dir, monkeypatch):
    geom = ConvGeometry(8, 8, 28, 28, 3, 3, pad_h=1, pad_w=1)
    monkeypatch.setattr(chooser, "measure_forward", lambda geom, batch, kind, dtype, threads, spread: {0: 2.0, 2: 1.0, 4: 1.5})
    assert chooser.choose_forward(geom, 1, 1, measure=True) == 2
    chooser.clear_memory_cache()
    monkeypatch.setattr(chooser, "measure_forward", lambda *args: pytest.fail("timed twice"))
    assert chooser.choose_forward(geom, 1, 1) == 2              # the timed choice stands, not the model's
    choices = json.loads((cache_dir / "lowering.json").read_text())["choices"]
    assert list(choices.values()) == [{"winograd": 2, "seconds": {"0": 2.0, "2": 1.0, "4": 1.5}}]


def test_winograd_is_kept_only_where_clearly_faster(cache_dir, monkeypatch):
    geom = ConvGeometry(8, 8, 28, 28, 3, 3, pad_h=1, pad_w=1)
    near = 1.0 * chooser.CLEARLY_FASTER + 0.01
    monkeypatch.setattr(chooser, "measure_forward", lambda geom, batch, kind, dtype, threads, spread: {0: 1.0, 2: near, 4: 2.0})
    assert chooser.choose_forward(geom, 1, 1, measure=True) == 0
    monkeypatch.setattr(chooser, "measure_forward", lambda geom, batch, kind, dtype, threads, spread: {0: 1.0, 2: 0.9, 4: 0.8})
    assert chooser.choose_forward(geom, 2, 1, measure=True) == 4


def test_auto_decides_by_the_model_without_timing(cache_dir, monkeypatch):
    """Nothing timed and nothing cached: a wide 3 x 3 on a large plane goes
    to F(4x4, 3x3), a few channels on a small plane lower, as the model says."""
    monkeypatch.setattr(chooser, "measure_forward", lambda *args, **kwargs: pytest.fail("timed"))
    monkeypatch.setattr(chooser, "measure_machine", lambda: pytest.fail("calibrated"))
    wide = ConvGeometry(128, 128, 28, 28, 3, 3, pad_h=1, pad_w=1)
    narrow = ConvGeometry(16, 32, 28, 28, 5, 5, pad_h=2, pad_w=2)
    assert chooser.choose_forward(wide, 1, 1) == 4
    assert chooser.choose_forward(narrow, 1, 1) == 0
    machine = chooser.NOMINAL_MACHINE
    lowered = chooser.estimate(wide, 1, 1, machine, budget=64 * 2 ** 20, forward_only=True)
    assert chooser.winograd_estimate(wide, 1, 4, machine) <= chooser.MODEL_CLEARLY_FASTER * lowered
    assert not (cache_dir / "lowering.json").exists() or not json.loads(
        (cache_dir / "lowering.json").read_text())["choices"]


def test_winograd_estimate_shares_the_transforms_among_the_spread():
    """Where the layer runs whole on several threads, the transforms (the
    pool's parallel kernels) are shared among them; the GEMMs and the check
    of the weights are not."""
    no_gemm = chooser.Machine(bandwidth=1e10, gather_row=1e-9, scatter_row=0, add_row=0, gemm_flops=1e30,
                              gemm_out_bandwidth=1e30, gemm_in_bandwidth=1e30)
    geom = ConvGeometry(64, 64, 28, 28, 3, 3, pad_h=1, pad_w=1)
    check = 2 * 64 * 64 * 9 * 4 / no_gemm.bandwidth
    alone, shared = (chooser.winograd_estimate(geom, 1, 4, no_gemm, spread=spread) - check for spread in (1, 2))
    assert shared == pytest.approx(alone / 2)
    free_copies = chooser.Machine(bandwidth=1e30, gather_row=0, scatter_row=0, add_row=0, gemm_flops=1e9,
                                  gemm_out_bandwidth=1e30, gemm_in_bandwidth=1e30)
    assert chooser.winograd_estimate(geom, 1, 4, free_copies, spread=2) == chooser.winograd_estimate(
        geom, 1, 4, free_copies)
    # ResNet-50's res4 3x3 at batch 1: lowered with the transforms on one thread, F(2x2)
    # with them on two (in the net 0.65-0.75x the lowering's time: BENCHMARKS.md,
    # "Winograd's transforms on the pool, in the model")
    res4 = ConvGeometry(256, 256, 14, 14, 3, 3, pad_h=1, pad_w=1)
    assert [chooser.choose_forward_by_model(res4, 1, 1, chooser.NOMINAL_MACHINE, spread=spread)
            for spread in (1, 2)] == [0, 2]


def test_winograd_estimate_counts_the_gemms_the_forward_runs():
    """With free copies and memory, the model is the alpha^2 GEMMs' arithmetic:
    F(4x4, 3x3) on 8 x 8 outputs has 4 tiles of 6 x 6."""
    free = chooser.Machine(bandwidth=1e30, gather_row=0, scatter_row=0, add_row=0, gemm_flops=1e9,
                           gemm_out_bandwidth=1e30, gemm_in_bandwidth=1e30)
    geom = ConvGeometry(16, 32, 8, 8, 3, 3, pad_h=1, pad_w=1)
    assert chooser.winograd_estimate(geom, 2, 4, free) == pytest.approx(36 * 2 * (2 * 4) * 32 * 16 / 1e9)


def test_the_chooser_times_at_the_runtimes_blas_count():
    from cct.runtime import threads
    assert chooser.blas_limited is threads.blas_limited
    library = threads.blas()
    before = library.current
    with threads.blas_limited(1):
        assert library.current == 1
    assert library.current == before


def test_measure_forward_runs_at_the_threads_asked(monkeypatch):
    counts = []
    monkeypatch.setattr(chooser, "blas_limited", lambda count: counts.append(count) or contextlib.nullcontext())
    chooser.measure_forward(ConvGeometry(3, 4, 10, 10, 3, 3, pad_h=1, pad_w=1), 2, 1, repeats=1, threads=1)
    assert counts == [1]


def test_auto_times_only_tile_sizes_with_enough_columns(cache_dir, monkeypatch):
    """On 7x7 planes at batch 1, F(4x4, 3x3) has 4 tiles and F(2x2, 3x3) 16:
    neither is timed (AUTO_MIN_COLUMNS), and a layer lowers; 8 images give
    F(2x2, 3x3) 128 columns and F(4x4, 3x3) 32."""
    seven = ConvGeometry(64, 64, 7, 7, 3, 3, pad_h=1, pad_w=1)
    assert winograd.timing_tiles(seven, 1) == () and not winograd.worth_timing(seven, 1)
    assert winograd.timing_tiles(seven, 8) == (2, 4) and winograd.worth_timing(seven, 8)
    assert winograd.timing_tiles(ConvGeometry(16, 16, 14, 14, 3, 3, pad_h=1, pad_w=1), 1) == (2,)
    seconds = chooser.measure_forward(ConvGeometry(8, 8, 14, 14, 3, 3, pad_h=1, pad_w=1), 1, 1, repeats=1)
    assert sorted(seconds) == [0, 2]
    # a timing cached before the rule keeps to it
    key_geom = ConvGeometry(8, 8, 14, 14, 3, 3, pad_h=1, pad_w=1)
    monkeypatch.setattr(chooser, "measure_forward", lambda geom, batch, kind, dtype, threads, spread: {0: 1.0, 2: 0.99, 4: 0.5})
    assert chooser.choose_forward(key_geom, 1, 1, measure=True) == 4       # measured now: the stub's seconds
    chooser.clear_memory_cache()
    monkeypatch.setattr(chooser, "measure_forward", lambda *args: pytest.fail("timed twice"))
    assert chooser.choose_forward(key_geom, 1, 1) == 0       # read back: F(4x4, 3x3)'s 16 columns left out


def test_measure_forward_times_small_forwards_more_often(monkeypatch):
    rounds = []
    monkeypatch.setattr(chooser, "_interleaved_best", lambda candidates, run, repeats: rounds.append(repeats) or {})
    small = ConvGeometry(3, 4, 10, 10, 3, 3, pad_h=1, pad_w=1)
    # the time budget decides, not this host's speed (a loaded CI machine took 4 runs within 20 ms)
    monkeypatch.setattr(chooser, "FORWARD_TIMING_SECONDS", 1e9)
    chooser.measure_forward(small, 1, 1)
    monkeypatch.setattr(chooser, "FORWARD_TIMING_SECONDS", 1e-9)
    chooser.measure_forward(small, 1, 1)
    assert rounds == [chooser.FORWARD_REPEATS[1], chooser.FORWARD_REPEATS[0]]


def test_measure_forward_times_the_lowering_and_each_tile_size():
    seconds = chooser.measure_forward(ConvGeometry(3, 4, 20, 20, 3, 3, pad_h=1, pad_w=1), 2, 1, repeats=1)
    assert sorted(seconds) == [0, 2, 4] and all(s > 0 for s in seconds.values())
    five = chooser.measure_forward(ConvGeometry(3, 4, 20, 20, 5, 5, pad_h=2, pad_w=2), 1, 1, repeats=1)
    assert sorted(five) == [0, 2]


# --- the layer --------------------------------------------------------------------------------------
DEPLOY = """
name: "deploy"
input: "data" input_shape { dim: 2 dim: 4 dim: 12 dim: 12 }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 6 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.3 }
                            bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
"""


def _deploy(tmp_path, contents, winograd_setting=None, text=DEPLOY):
    path = tmp_path / "deploy.prototxt"
    path.write_text(text)
    if winograd_setting is not None:
        (tmp_path / "run.json").write_text(json.dumps({"default": {"winograd": winograd_setting}}))
        settings.load(str(tmp_path / "run.json"))
    try:
        cct.set_random_seed(3)
        net = cct.Net(str(path), cct.TEST)
    finally:
        settings.load(None)
    net.blobs["data"].data[...] = contents
    return net


@pytest.mark.parametrize("m", winograd.TILE_SIZES)
def test_a_deploy_net_runs_winograd_where_asked_and_agrees(tmp_path, m):
    contents = RNG.standard_normal((2, 4, 12, 12)).astype(np.float32)
    fast, plain = _deploy(tmp_path, contents, m), _deploy(tmp_path, contents, False)
    assert fast.layer_dict["conv"].winograd_tile == m and plain.layer_dict["conv"].winograd_tile == 0
    _close(fast.forward()["pool"], plain.forward()["pool"], m=m)
    _close(fast.blobs["conv"].data, plain.blobs["conv"].data, m=m)    # the ReLU ran in Winograd's output pass
    # Weights written through a numpy view take effect at the next forward.
    for net in (fast, plain):
        net.params["conv"][0].data[2] *= -3
        net.params["conv"][1].data[...] = -0.5
    _close(fast.forward()["pool"], plain.forward()["pool"], m=m)


def test_a_forced_tile_size_applies_where_the_kernel_has_it(tmp_path):
    """F(2x2, 5x5) exists, F(4x4, 5x5) does not: a 5 x 5 convolution asked for
    4 lowers, asked for 2 runs Winograd, and agrees with the lowering."""
    text = DEPLOY.replace("kernel_size: 3 pad: 1", "kernel_size: 5 pad: 2")
    contents = RNG.standard_normal((2, 4, 12, 12)).astype(np.float32)
    assert _deploy(tmp_path, contents, 4, text).layer_dict["conv"].winograd_tile == 0
    five, plain = _deploy(tmp_path, contents, 2, text), _deploy(tmp_path, contents, False, text)
    assert five.layer_dict["conv"].winograd_tile == 2 and five.layer_dict["conv"].kernel == (5, 5)
    _close(five.forward()["pool"], plain.forward()["pool"], m=2, r=5)


def test_auto_times_only_forward_only_shapes_worth_it(tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(chooser, "choose_forward", lambda geom, batch, kind, dtype, threads, measure, spread: asked.append(
        (batch, threads, spread)) or 4)
    monkeypatch.setattr(winograd, "AUTO_MIN_FLOPS", 1)
    contents = RNG.standard_normal((2, 4, 12, 12)).astype(np.float32)
    net = _deploy(tmp_path, contents)
    assert net.layer_dict["conv"].winograd_tile == 4
    # timed for one partition's batch at its BLAS threads (the executor's split), and
    # the threads its parallel kernels share where it runs whole on several
    partitions = net.executor.partitions(net.layers.index(net.layer_dict["conv"]))
    spread = net.executor.spread(partitions)
    assert asked[-1] == (-(-2 // partitions), net.executor.blas_count(partitions), spread.count if spread else 1)
    monkeypatch.setattr(winograd, "AUTO_MIN_FLOPS", 10 ** 9)
    asked.clear()
    assert _deploy(tmp_path, contents).layer_dict["conv"].winograd_tile == 0 and not asked


def test_the_measure_setting_times_winograd_on_the_layers_threads(tmp_path, cache_dir, monkeypatch):
    """With the run configuration's "measure", "auto" Winograd is timed
    (chooser.choose_forward with measure=True) at the layer's BLAS threads
    and spread; a timing at a spread of several threads runs on the pool
    lent to it and is cached apart from one thread's."""
    asked = []

    def timed(geom, batch, kind, dtype, threads, spread):
        asked.append((threads, spread))
        return {0: 2.0, 2: 1.0, 4: 1.5}
    monkeypatch.setattr(chooser, "measure_forward", timed)
    monkeypatch.setattr(winograd, "AUTO_MIN_FLOPS", 1)
    (tmp_path / "run.json").write_text(json.dumps({"default": {"measure": True}}))
    settings.load(str(tmp_path / "run.json"))
    try:
        net = _deploy(tmp_path, RNG.standard_normal((2, 4, 12, 12)).astype(np.float32))
    finally:
        settings.load(None)
    layer = net.layer_dict["conv"]
    assert layer.winograd_tile == 2 and asked           # the stub's fastest, not the model's
    partitions = net.executor.partitions(net.layers.index(layer))
    spread = net.executor.spread(partitions)
    assert asked[-1] == (net.executor.blas_count(partitions), spread.count if spread else 1)
    geom = ConvGeometry(8, 8, 28, 28, 3, 3, pad_h=1, pad_w=1)
    asked.clear()
    assert chooser.choose_forward(geom, 1, 1, threads=2, measure=True, spread=2) == 2
    assert chooser.choose_forward(geom, 1, 1, threads=2, measure=True, spread=1) == 2
    assert asked == [(2, 2), (2, 1)]                     # two timings: the pool's and one thread's
    keys = json.loads((cache_dir / "lowering.json").read_text())["choices"]
    assert sum("spread=2" in key for key in keys) == 1


def test_measure_forward_lends_the_pool_for_a_spread(monkeypatch):
    lent = []
    monkeypatch.setattr(chooser.pool, "acquire", lambda threads: lent.append(threads) or False)
    geom = ConvGeometry(8, 8, 14, 14, 3, 3, pad_h=1, pad_w=1)
    chooser.measure_forward(geom, 1, 1, repeats=1, spread=2)
    chooser.measure_forward(geom, 1, 1, repeats=1)
    assert lent == [2]


def test_a_forced_lowering_or_a_backward_keeps_auto_off(tmp_path, monkeypatch):
    monkeypatch.setattr(chooser, "choose_forward", lambda *args: pytest.fail("timed"))
    monkeypatch.setattr(winograd, "AUTO_MIN_FLOPS", 1)
    monkeypatch.setenv("CCT_LOWERING", "2")
    contents = RNG.standard_normal((2, 4, 12, 12)).astype(np.float32)
    assert _deploy(tmp_path, contents).layer_dict["conv"].winograd_tile == 0
    assert _deploy(tmp_path, contents, 4).layer_dict["conv"].winograd_tile == 4   # asked for by name
    layer = make_layer('type: "Convolution" convolution_param { num_output: 2 kernel_size: 3 pad: 1 }')
    setup_layer(layer, [np.zeros((1, 2, 8, 8), np.float32)])
    layer.configure({"winograd": 4})                         # runs_backward, as a layer alone
    assert layer.winograd_tile == 0


def test_the_memory_plan_counts_the_transformed_weights(tmp_path):
    net = _deploy(tmp_path, 0, 4)
    layer = net.layer_dict["conv"]
    index = net.layers.index(layer)
    needs = layer.planned_bytes(net.bottom_vecs[index], net.top_vecs[index], 1)
    weights = layer.blobs[0].data
    assert needs["held"] == winograd.held_bytes(weights, 4) == (4 * weights.size + weights.size) * 4
    assert needs["lowering"] == sum(winograd.slot_bytes(layer.geom, 4, 2).values())


def test_a_winograd_layer_reserves_its_transformed_weights_ahead(tmp_path):
    """Layer.ahead: the arrays the first forward fills, the ones it uses."""
    net = _deploy(tmp_path, 0, 4)
    layer = net.layer_dict["conv"]
    ahead = layer.ahead()
    assert sum(array.nbytes for array in ahead) == winograd.held_bytes(layer.blobs[0].data, 4)
    net.forward()
    transformed = layer._transformed.get(layer.blobs[0].data, layer.geom, 4)
    assert any(np.shares_memory(transformed, array) for array in ahead)


def test_loading_weights_transforms_them_for_the_forward(tmp_path):
    """Net.copy_from makes U as part of the load (Layer.params_loaded), from
    the loaded weights; the forward uses it and agrees with the saved net."""
    contents = RNG.standard_normal((2, 4, 12, 12)).astype(np.float32)
    saved = _deploy(tmp_path, contents, 4)
    saved.params["conv"][0].data[...] = RNG.standard_normal(saved.params["conv"][0].shape)
    saved.save(str(tmp_path / "w.caffemodel"))
    loaded = _deploy(tmp_path, contents, 4)
    layer = loaded.layer_dict["conv"]
    loaded.copy_from(str(tmp_path / "w.caffemodel"))
    made = list(layer._transformed._made.values())
    assert len(made) == 1
    np.testing.assert_array_equal(made[0], winograd.weights_for(saved.params["conv"][0].data, layer.geom, 4))
    np.testing.assert_array_equal(loaded.forward()["pool"], saved.forward()["pool"])
    assert list(layer._transformed._made.values())[0] is made[0]       # not made again


@pytest.mark.parametrize("value", ["fast", 3, True])
def test_bad_settings_name_the_key(tmp_path, value):
    (tmp_path / "run.json").write_text(json.dumps({"layers": {"conv": {"winograd": value}}}))
    with pytest.raises(ConfigError, match=r"run.json: layers.conv.winograd: must be \"auto\", false, 2 or 4"):
        settings.load(str(tmp_path / "run.json"))


def test_bad_environment_value_names_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("CCT_WINOGRAD", "8")
    with pytest.raises(ConfigError, match="environment variable CCT_WINOGRAD: must be 0, 2, 4 or auto, got '8'"):
        _deploy(tmp_path, 0)
    monkeypatch.setenv("CCT_WINOGRAD", "0")
    monkeypatch.setattr(winograd, "AUTO_MIN_FLOPS", 1)
    monkeypatch.setattr(chooser, "choose_forward", lambda *args: pytest.fail("timed"))
    assert _deploy(tmp_path, 0).layer_dict["conv"].winograd_tile == 0


@pytest.mark.parametrize("shape,m", [((3, 1, 3, 3), 2), ((5, 7, 3, 3), 4), ((300, 20, 3, 3), 4), ((9, 4, 5, 5), 2)])
@pytest.mark.parametrize("inner", [False, True])
def test_transformed_weights_are_each_kernels_g_k_g_t_rounded_once(shape, m, inner):
    """transform_weights's blocked GEMMs give each kernel's G k G^T in float64
    rounded to float32, as a product per kernel does (300 x 20 kernels: more
    than one block)."""
    w = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    _, g, _ = winograd.transforms(m, shape[-1])
    alpha = g.shape[0]
    each = (g @ w.astype(np.float64).reshape(-1, shape[-1], shape[-1]) @ g.T).astype(np.float32)
    each = each.reshape(shape[0], shape[1], alpha * alpha).transpose((2, 1, 0) if inner else (2, 0, 1))
    np.testing.assert_array_equal(winograd.transform_weights(w, m, inner), each)
