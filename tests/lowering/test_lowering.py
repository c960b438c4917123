"""cct.lowering: the three lowerings against the direct reference convolution
(forward, data gradient, weight gradient) over a grid of geometries, and the
reference itself against scalar loops and its own adjoints."""
import itertools

import numpy as np
import pytest

from cct.lowering import (LOWERINGS, ConvGeometry, bind_conv_forward, conv_backward, conv_backward_data, conv_backward_weights,
                          conv_forward, lowering, pointwise, reference, type1, type3)
from cct.lowering.chunking import band_slot_bytes, slot_bytes

RNG = np.random.default_rng(11)
TYPES = sorted(LOWERINGS)


def arrays(geom, batch=2, dtype=np.float64):
    x = RNG.standard_normal(geom.input_shape(batch)).astype(dtype)
    w = RNG.standard_normal(geom.weight_shape).astype(dtype)
    dy = RNG.standard_normal(geom.output_shape(batch)).astype(dtype)
    return x, w, dy


def naive_conv(x, w, geom):
    """Seven nested loops, straight from the definition."""
    n_, c_, h_, w_ = x.shape
    y = np.zeros(geom.output_shape(n_))
    cg, og = geom.channels_per_group, geom.outputs_per_group
    for n in range(n_):
        for o in range(geom.num_output):
            g = o // og
            for oh in range(geom.out_h):
                for ow in range(geom.out_w):
                    total = 0.0
                    for c in range(cg):
                        for i in range(geom.kernel_h):
                            for j in range(geom.kernel_w):
                                h = oh * geom.stride_h - geom.pad_h + i * geom.dilation_h
                                v = ow * geom.stride_w - geom.pad_w + j * geom.dilation_w
                                if 0 <= h < h_ and 0 <= v < w_:
                                    total += x[n, g * cg + c, h, v] * w[o, c, i, j]
                    y[n, o, oh, ow] = total
    return y


# --- the reference --------------------------------------------------------------------
SMALL = [ConvGeometry(2, 4, 5, 6, 3, 2, stride_h=2, pad_w=1, dilation_w=2, group=2),
         ConvGeometry(3, 2, 4, 4, 2, 2, pad_h=1, pad_w=1),
         ConvGeometry(4, 2, 7, 5, 3, 1, stride_h=3, stride_w=2, pad_h=2, dilation_h=2, group=2)]


@pytest.mark.parametrize("geom", SMALL)
def test_reference_forward_matches_loops(geom):
    x, w, _ = arrays(geom)
    np.testing.assert_allclose(reference.forward(x, w, geom), naive_conv(x, w, geom), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("geom", SMALL)
def test_reference_gradients_are_adjoints(geom):
    # <conv(x, w), dy> == <x, backward_data(dy, w)> == <w, backward_weights(x, dy)>
    x, w, dy = arrays(geom)
    value = np.vdot(reference.forward(x, w, geom), dy)
    assert np.isclose(np.vdot(x, reference.backward_data(dy, w, geom)), value, rtol=1e-12)
    assert np.isclose(np.vdot(w, reference.backward_weights(x, dy, geom)), value, rtol=1e-12)


# --- every lowering against the reference over the grid --------------------------------
CHANNELS = [(2, 16), (4, 8), (4, 4), (8, 4), (16, 2)]      # d/o from 1/8 to 8
KERNELS = [(1, 1), (3, 3), (2, 3), (3, 1)]


def grid():
    for group, pad, stride, dilation, kernel, (c, o) in itertools.product(
            (1, 2), (0, 1, 2), (1, 2, 3), (1, 2), KERNELS, CHANNELS):
        try:
            yield ConvGeometry(c, o, 7, 6, *kernel, stride, stride, pad, pad, dilation, dilation, group)
        except ValueError:                                    # kernel larger than the padded input
            continue


GRID = list(grid())


def assert_every_type_matches_reference(geom):
    """Forward, data and weight gradients of every lowering type against the reference."""
    x, w, dy = arrays(geom)
    expected = (reference.forward(x, w, geom), reference.backward_data(dy, w, geom),
                reference.backward_weights(x, dy, geom))
    for kind in TYPES:
        got = (conv_forward(x, w, geom, kind), conv_backward_data(dy, w, geom, kind),
               conv_backward_weights(x, dy, geom, kind))
        for name, ours, want in zip(("forward", "backward_data", "backward_weights"), got, expected):
            np.testing.assert_allclose(ours, want, rtol=1e-10, atol=1e-10, err_msg=f"type {kind} {name}")


@pytest.mark.parametrize("geom", GRID, ids=lambda g: f"c{g.channels}o{g.num_output}k{g.kernel_h}x{g.kernel_w}"
                         f"s{g.stride_h}p{g.pad_h}d{g.dilation_h}g{g.group}")
def test_lowerings_match_reference(geom):
    assert_every_type_matches_reference(geom)


@pytest.mark.parametrize("kind", TYPES)
def test_rectangular_mixed_parameters(kind):
    geom = ConvGeometry(6, 4, 9, 8, 3, 2, stride_h=2, stride_w=1, pad_h=1, pad_w=2,
                        dilation_h=1, dilation_w=3, group=2)
    x, w, dy = arrays(geom, batch=3)
    np.testing.assert_allclose(conv_forward(x, w, geom, kind), reference.forward(x, w, geom), atol=1e-10)
    dx, dw = conv_backward(x, dy, w, geom, kind)
    np.testing.assert_allclose(dx, reference.backward_data(dy, w, geom), atol=1e-10)
    np.testing.assert_allclose(dw, reference.backward_weights(x, dy, geom), atol=1e-10)
    only_dx, none_dw = conv_backward(x, dy, w, geom, kind, weights=False)
    assert none_dw is None and np.allclose(only_dx, dx)


@pytest.mark.parametrize("kind", TYPES)
def test_float32_stays_float32(kind):
    geom = ConvGeometry(4, 6, 8, 8, 3, 3, pad_h=1, pad_w=1, group=2)
    x, w, dy = arrays(geom, dtype=np.float32)
    assert conv_forward(x, w, geom, kind).dtype == np.float32
    assert conv_backward_data(dy, w, geom, kind).dtype == np.float32
    assert conv_backward_weights(x, dy, geom, kind).dtype == np.float32
    np.testing.assert_allclose(conv_forward(x, w, geom, kind), reference.forward(x, w, geom), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", TYPES)
def test_batch_partitions_compose(kind):
    # A scheduler may run each function on a slice of the batch: results must agree.
    geom = ConvGeometry(3, 4, 6, 6, 3, 3, pad_h=1, pad_w=1)
    x, w, dy = arrays(geom, batch=5)
    whole = conv_forward(x, w, geom, kind)
    parts = np.concatenate([conv_forward(x[:2], w, geom, kind), conv_forward(x[2:], w, geom, kind)])
    np.testing.assert_allclose(parts, whole, atol=1e-12)
    dw = conv_backward_weights(x[:2], dy[:2], geom, kind) + conv_backward_weights(x[2:], dy[2:], geom, kind)
    np.testing.assert_allclose(dw, conv_backward_weights(x, dy, geom, kind), atol=1e-10)


@pytest.mark.parametrize("kind", TYPES)
def test_an_empty_batch_is_skipped(kind):
    """No partition runs on no sample, but if one did it would compute nothing."""
    geom = ConvGeometry(3, 4, 6, 6, 3, 3, pad_h=1, pad_w=1)
    x, w, dy = arrays(geom, batch=0)
    assert conv_forward(x, w, geom, kind, chunk=1).shape == (0, 4, 6, 6)
    dx, dw = conv_backward(x, dy, w, geom, kind, chunk=1)
    assert dx.shape == x.shape and dw.shape == w.shape and not dw.any()


@pytest.mark.parametrize("kind", TYPES)
def test_out_buffers_are_filled(kind):
    geom = ConvGeometry(2, 3, 5, 5, 3, 3, pad_h=1, pad_w=1)
    x, w, dy = arrays(geom)
    y, dx, dw = np.empty(geom.output_shape(2)), np.empty(x.shape), np.empty(w.shape)
    assert conv_forward(x, w, geom, kind, out=y) is y
    assert conv_backward_data(dy, w, geom, kind, out=dx) is dx
    assert conv_backward_weights(x, dy, geom, kind, out=dw) is dw
    np.testing.assert_allclose(y, reference.forward(x, w, geom), atol=1e-12)
    np.testing.assert_allclose(dx, reference.backward_data(dy, w, geom), atol=1e-12)
    np.testing.assert_allclose(dw, reference.backward_weights(x, dy, geom), atol=1e-12)


WIDE_LOWERED = [g for g in GRID if g.channels * g.kernel_h * g.kernel_w >= 4 * g.num_output][::3]


@pytest.mark.parametrize("geom", WIDE_LOWERED, ids=lambda g: f"c{g.channels}o{g.num_output}k{g.kernel_h}x{g.kernel_w}"
                         f"s{g.stride_h}p{g.pad_h}d{g.dilation_h}g{g.group}")
@pytest.mark.parametrize("width", [0, 10 ** 6])
def test_type1_both_column_orders_match_reference(geom, width, monkeypatch):
    # width 0: columns (n, oh, ow) everywhere; 10**6: batch-inner (oh, ow, n) everywhere.
    monkeypatch.setattr(type1, "BATCH_INNER_WIDTH", width)
    batch = 3 if geom.stride_w == 1 else 2 * geom.out_w
    wide = geom.channels * geom.kernel_h * geom.kernel_w >= 4 * geom.num_output
    assert type1.batch_inner(geom, batch) == (bool(width) and wide)
    x, w, dy = arrays(geom, batch=batch)
    np.testing.assert_allclose(conv_forward(x, w, geom, 1), reference.forward(x, w, geom), atol=1e-10)
    dx, dw = conv_backward(x, dy, w, geom, 1)
    np.testing.assert_allclose(dx, reference.backward_data(dy, w, geom), atol=1e-10)
    np.testing.assert_allclose(dw, reference.backward_weights(x, dy, geom), atol=1e-10)


@pytest.mark.parametrize("geom", [ConvGeometry(6, 2, 9, 8, 3, 3, pad_h=1, pad_w=1),
                                  ConvGeometry(4, 2, 11, 12, 3, 2, stride_h=2, pad_w=1, dilation_w=2, group=2),
                                  ConvGeometry(3, 1, 8, 9, 2, 3, dilation_h=2, pad_h=2)],
                         ids=["plain", "stride_h_dilation_w_group", "dilation_h"])
@pytest.mark.parametrize("batch", [2, 3, 7])
def test_batch_inner_col2im_by_whole_rows_gives_the_same_bits(geom, batch, monkeypatch):
    """Few images at stride_w 1: col2im adds each output row's OW*N values in
    one run (ROWS_BELOW_BATCH): bit for bit the N-at-a-time loop's data
    gradient, and the reference's."""
    monkeypatch.setattr(type1, "BATCH_INNER_WIDTH", 10 ** 6)
    x, w, dy = arrays(geom, batch=batch, dtype=np.float32)
    assert type1.batch_inner(geom, batch)
    gradients = []
    for below in (0, 8):
        monkeypatch.setattr(type1, "ROWS_BELOW_BATCH", below)
        gradients.append(conv_backward_data(dy, w, geom, 1))
    assert gradients[0].tobytes() == gradients[1].tobytes()
    expected = reference.backward_data(dy.astype(np.float64), w.astype(np.float64), geom)
    np.testing.assert_allclose(gradients[1], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("chunk", [None, 2])
def test_forward_adds_the_bias_while_storing(kind, chunk):
    geom = ConvGeometry(4, 6, 7, 6, 3, 2, stride_h=2, pad_w=1, group=2)
    x, w, _ = arrays(geom, batch=3)
    bias = RNG.standard_normal(geom.num_output)
    expected = reference.forward(x, w, geom) + bias.reshape(1, -1, 1, 1)
    np.testing.assert_allclose(conv_forward(x, w, geom, kind, bias=bias, chunk=chunk), expected, atol=1e-10)
    y = np.empty(geom.output_shape(3))
    assert conv_forward(x, w, geom, kind, out=y, bias=bias, chunk=chunk) is y
    np.testing.assert_allclose(y, expected, atol=1e-10)


def test_cache_chunk_only_splits_wide_type1_layers():
    from cct.lowering.chunking import cache_chunk
    conv1 = ConvGeometry(3, 96, 227, 227, 11, 11, 4, 4)          # 4.4 MB lowered per image, 3025 columns
    assert cache_chunk(conv1, 1, 256, 4) == 2                    # >= 4096 GEMM columns
    assert cache_chunk(conv1, 2, 256, 4) == 256
    lenet2 = ConvGeometry(20, 50, 12, 12, 5, 5)                  # batch-inner: whole
    assert type1.batch_inner(lenet2, 64) and cache_chunk(lenet2, 1, 64, 4) == 64
    assert not type1.batch_inner(ConvGeometry(1, 20, 28, 28, 5, 5), 64)     # output larger than lowered


def test_type1_lowered_matrix_layout():
    # Row (c, i, j), column (n, oh, ow): the (C*KH*KW) x (N*OH*OW) patch matrix.
    geom = ConvGeometry(2, 1, 4, 5, 2, 3, stride_w=2, pad_h=1)
    x, _, _ = arrays(geom, batch=2)
    cols = type1.lower(x, geom)
    assert cols.shape == (2 * 2 * 3, 2 * geom.out_h * geom.out_w)
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (0, 0)))
    for c, i, j, n, oh, ow in itertools.product(range(2), range(2), range(3), range(2),
                                                range(geom.out_h), range(geom.out_w)):
        row = (c * 2 + i) * 3 + j
        col = (n * geom.out_h + oh) * geom.out_w + ow
        assert cols[row, col] == xp[n, c, oh + i, ow * 2 + j]


# --- kernels that overrun the padded input (Caffe's truncating output size) ---------------
def overrun_grid():
    """Geometries whose last window reads past the padded input on at least one axis:
    Caffe truncates (in + 2*pad - extent) / stride toward zero, so an extent larger
    than the padded input by less than the stride still gives one output."""
    for (c, o, group), (h, w), (kh, kw), (sh, sw), (ph, pw), (dh, dw) in itertools.product(
            [(2, 4, 1), (4, 2, 2)], [(2, 2), (3, 4), (5, 2)], [(3, 3), (4, 2), (2, 5)],
            [(2, 2), (3, 2), (4, 3)], [(0, 0), (1, 0)], [(1, 1), (2, 1)]):
        try:
            geom = ConvGeometry(c, o, h, w, kh, kw, sh, sw, ph, pw, dh, dw, group)
        except ValueError:
            continue
        if geom.overrun_h or geom.overrun_w:
            yield geom


OVERRUN = list(overrun_grid())
OVERRUN_IDS = [f"c{g.channels}o{g.num_output}i{g.in_h}x{g.in_w}k{g.kernel_h}x{g.kernel_w}"
               f"s{g.stride_h}x{g.stride_w}p{g.pad_h}x{g.pad_w}d{g.dilation_h}x{g.dilation_w}" for g in OVERRUN]


def test_overrun_grid_is_not_empty():
    assert len(OVERRUN) > 20
    assert any(g.overrun_h and g.overrun_w for g in OVERRUN)
    assert any(g.group == 2 for g in OVERRUN) and any(g.pad_h for g in OVERRUN)


@pytest.mark.parametrize("geom", OVERRUN[::4], ids=OVERRUN_IDS[::4])
def test_overrun_reference_matches_loops(geom):
    # The loops read every cell outside the image as zero, as Caffe's im2col does.
    x, w, dy = arrays(geom)
    np.testing.assert_allclose(reference.forward(x, w, geom), naive_conv(x, w, geom), rtol=1e-12, atol=1e-12)
    value = np.vdot(reference.forward(x, w, geom), dy)
    assert np.isclose(np.vdot(x, reference.backward_data(dy, w, geom)), value, rtol=1e-12)
    assert np.isclose(np.vdot(w, reference.backward_weights(x, dy, geom)), value, rtol=1e-12)


@pytest.mark.parametrize("geom", OVERRUN, ids=OVERRUN_IDS)
def test_overrun_lowerings_match_reference(geom):
    assert_every_type_matches_reference(geom)


@pytest.mark.parametrize("width", [0, 10 ** 6])
def test_overrun_type1_both_column_orders(width, monkeypatch):
    monkeypatch.setattr(type1, "BATCH_INNER_WIDTH", width)
    geom = ConvGeometry(4, 1, 3, 2, 4, 3, 2, 2, 0, 0)            # 1 x 1 output, both axes overrun by 1
    assert (geom.out_h, geom.out_w, geom.overrun_h, geom.overrun_w) == (1, 1, 1, 1)
    x, w, dy = arrays(geom, batch=4)
    assert type1.batch_inner(geom, 4) == bool(width)
    np.testing.assert_allclose(conv_forward(x, w, geom, 1), naive_conv(x, w, geom), atol=1e-10)
    dx, dw = conv_backward(x, dy, w, geom, 1)
    np.testing.assert_allclose(dx, reference.backward_data(dy, w, geom), atol=1e-10)
    np.testing.assert_allclose(dw, reference.backward_weights(x, dy, geom), atol=1e-10)


@pytest.mark.parametrize("kind", TYPES)
def test_kernel_3_stride_2_on_2x2_input_by_hand(kind):
    # Caffe: (2 - 3) / 2 + 1 = 0 + 1 = 1 output; the window covers the 4 pixels and 5 zeros.
    geom = ConvGeometry(1, 1, 2, 2, 3, 3, stride_h=2, stride_w=2)
    assert (geom.out_h, geom.out_w) == (1, 1)
    x = np.array([[[[1.0, 2.0], [3.0, 4.0]]]])
    w = np.arange(1.0, 10.0).reshape(1, 1, 3, 3)                # [[1 2 3] [4 5 6] [7 8 9]]
    y = conv_forward(x, w, geom, kind)
    np.testing.assert_array_equal(y, [[[[1 * 1 + 2 * 2 + 3 * 4 + 4 * 5]]]])          # 37
    dy = np.array([[[[2.0]]]])
    np.testing.assert_array_equal(conv_backward_data(dy, w, geom, kind), [[[[2.0, 4.0], [8.0, 10.0]]]])
    np.testing.assert_array_equal(conv_backward_weights(x, dy, geom, kind),
                                  [[[[2.0, 4.0, 0.0], [6.0, 8.0, 0.0], [0.0, 0.0, 0.0]]]])


@pytest.mark.parametrize("kind", TYPES)
def test_overrun_with_chunks_and_out_buffers(kind):
    geom = ConvGeometry(2, 3, 3, 5, 4, 2, stride_h=2, stride_w=3, pad_w=1)
    assert geom.overrun_h == 1
    x, w, dy = arrays(geom, batch=3)
    y, dx = np.full(geom.output_shape(3), np.nan), np.full(x.shape, np.nan)
    conv_forward(x, w, geom, kind, out=y, chunk=2)
    conv_backward(x, dy, w, geom, kind, weights=False, chunk=2, dx_out=dx)
    np.testing.assert_allclose(y, naive_conv(x, w, geom), atol=1e-10)
    np.testing.assert_allclose(dx, reference.backward_data(dy, w, geom), atol=1e-10)
    np.testing.assert_allclose(conv_backward_weights(x, dy, geom, kind, chunk=1),
                               reference.backward_weights(x, dy, geom), atol=1e-10)


def test_output_size_truncates_toward_zero():
    cases = [  # (in, kernel, stride, pad, dilation) -> Caffe's size, (in + 2*pad - extent) / stride + 1 in C++
        ((2, 3, 2, 0, 1), 1), ((3, 4, 2, 0, 1), 1), ((2, 2, 3, 0, 2), 1), ((1, 3, 3, 0, 1), 1),
        ((1, 3, 3, 1, 2), 1), ((7, 3, 2, 0, 1), 3), ((8, 3, 2, 0, 1), 3), ((5, 5, 4, 0, 1), 1)]
    for (size, kernel, stride, pad, dilation), expected in cases:
        geom = ConvGeometry(1, 1, size, 4, kernel, 1, stride, 1, pad, 0, dilation, 1)
        assert geom.out_h == expected, (size, kernel, stride, pad, dilation)
        extent = dilation * (kernel - 1) + 1
        assert geom.overrun_h == max(0, extent - size - 2 * pad)
        assert geom.padded_h == size + 2 * pad + geom.overrun_h
    plain = ConvGeometry(1, 1, 6, 6, 3, 3, 2, 2, 1, 1)
    assert (plain.overrun_h, plain.padded_h, plain.out_h) == (0, 8, 3)      # unused last row: no overrun
    for size, kernel, stride in [(2, 5, 2), (1, 4, 3)]:                     # trunc(-3/2), -3/3: size 0, empty
        geom = ConvGeometry(1, 1, size, size, kernel, kernel, stride, stride)
        assert (geom.out_h, geom.overrun_h, geom.empty) == (0, 0, True)
    for size, kernel, stride in [(3, 5, 1), (1, 5, 1)]:                     # -2 + 1, -4 + 1: negative, refused
        with pytest.raises(ValueError, match="output"):
            ConvGeometry(1, 1, size, size, kernel, kernel, stride, stride)


def test_geometry_output_size_and_errors():
    geom = ConvGeometry(3, 4, 27, 27, 5, 5, stride_h=2, stride_w=2, pad_h=2, pad_w=2, dilation_h=2, dilation_w=2)
    assert (geom.out_h, geom.out_w) == ((27 + 4 - 9) // 2 + 1,) * 2
    with pytest.raises(ValueError, match="group"):
        ConvGeometry(3, 4, 5, 5, 3, 3, group=2)
    with pytest.raises(ValueError, match="output"):
        ConvGeometry(3, 4, 2, 2, 4, 4)
    with pytest.raises(ValueError, match="lowering type"):
        lowering(4)


@pytest.mark.parametrize("bias", [None, np.arange(3.0)])
def test_batch_first_transpose_crops_adds_bias_and_fills_any_out(bias):
    """type1._batch_first, the tiled way back from the batch-inner layout: a
    crop of (C, Hp, Wp, N) as (N, C, H, W), plus a bias per channel, into a new,
    a contiguous or a strided `out` (sizes past one 16 x 16 tile)."""
    source = RNG.standard_normal((3, 7, 21, 19))                  # C, Hp, Wp, N
    expected = source[:, 1:6, 2:20].transpose(3, 0, 1, 2) + (0 if bias is None else bias.reshape(1, 3, 1, 1))
    shape = (19, 3, 5, 18)
    np.testing.assert_array_equal(type1._batch_first(source, 1, 2, shape, None, bias), expected)
    contiguous = np.empty(shape)
    assert type1._batch_first(source, 1, 2, shape, contiguous, bias) is contiguous
    np.testing.assert_array_equal(contiguous, expected)
    strided = np.empty((19, 3, 5, 36))[..., ::2]
    assert type1._batch_first(source, 1, 2, shape, strided, bias) is strided
    np.testing.assert_array_equal(strided, expected)


# --- type 1's lowering of one image (a compiled loop) -----------------------------------
@pytest.mark.parametrize("geom", [ConvGeometry(16, 4, 28, 28, 5, 5, pad_h=2, pad_w=2),
                                  ConvGeometry(3, 4, 9, 7, 3, 2, stride_h=2),                  # no border
                                  ConvGeometry(4, 6, 10, 9, 3, 3, stride_h=3, pad_h=1, group=2),
                                  ConvGeometry(2, 3, 9, 8, 4, 4, stride_h=3, pad_h=2),          # overrun
                                  ConvGeometry(5, 3, 6, 6, 1, 1, pad_w=1)],
                         ids=["5x5", "no_border", "stride_h_group", "overrun", "1x1_padded"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_one_image_lowers_as_the_strided_copy(geom, dtype):
    """One image at stride 1 along the width, no dilation, lowers through a
    compiled loop: the same matrix as numpy's copy of the window view, with
    the signed zeros, NaN and infinities of the input where they fall."""
    x = RNG.standard_normal(geom.input_shape(1)).astype(dtype)
    x.flat[::7] = -0.0
    x.flat[3], x.flat[-2] = np.nan, -np.inf
    expected = np.array(type1.window_view(type1.pad_channels_first(x, geom), geom))
    expected = expected.reshape(geom.channels * geom.kernel_h * geom.kernel_w, -1)
    calls, real = [], type1._lower_one_image
    type1._lower_one_image = lambda *a: calls.append(1) or real(*a)
    try:
        got = type1.lower(x, geom)
    finally:
        type1._lower_one_image = real
    assert calls == [1]
    np.testing.assert_array_equal(got.view(f"u{x.itemsize}"), expected.view(f"u{x.itemsize}"))
    batch = np.concatenate([x, x])                         # two images: numpy's copy, the same columns twice
    both = type1.lower(batch, geom).reshape(got.shape[0], 2, -1)
    np.testing.assert_array_equal(both[:, 0], got)
    np.testing.assert_array_equal(both[:, 1], got)


# --- type 1 on one image, in bands of output rows (forward_in_bands) -----------------------
@pytest.mark.parametrize("geom", [ConvGeometry(3, 4, 23, 17, 7, 7, stride_h=2, stride_w=2, pad_h=3, pad_w=3),
                                  ConvGeometry(4, 6, 11, 13, 3, 2, stride_h=2, pad_w=1, dilation_w=2, group=2),
                                  ConvGeometry(2, 3, 9, 8, 4, 4, stride_h=3, dilation_h=2, pad_h=2)],
                         ids=["conv1", "group_dilation", "overrun"])
@pytest.mark.parametrize("relu", [None, 0.0])
def test_one_image_in_bands_gives_the_whole_forward(geom, relu, monkeypatch):
    """Bands of 2 output rows (the last one shorter where OH is odd) give the
    whole lowering's output, into a C-contiguous `out`, within float32
    rounding (OpenBLAS's kernels for small GEMMs may sum in another order);
    a forward that keeps its lowering for the backward lowers whole."""
    from cct.core.workspace import Arena
    from cct.lowering.kept import KeptLowering
    x, w, _ = arrays(geom, batch=1, dtype=np.float32)
    bias = RNG.standard_normal(geom.num_output).astype(np.float32)
    whole = conv_forward(x, w, geom, 1, out=np.empty(geom.output_shape(1), np.float32), ws=Arena(), bias=bias,
                         relu=relu)
    row_bytes = 4 * geom.channels * geom.kernel_h * geom.kernel_w * geom.out_w
    monkeypatch.setattr(type1, "BAND_BYTES", 2 * row_bytes)
    monkeypatch.setattr(type1, "BAND_MIN_COLUMNS", 1)
    assert type1.band_rows(geom, 1, 4) == 2 and type1.band_rows(geom, 2, 4) == 0
    real, calls = np.matmul, []
    monkeypatch.setattr(np, "matmul", lambda *a, **k: calls.append(a[1].shape[-1]) or real(*a, **k))
    arena = Arena()
    banded = conv_forward(x, w, geom, 1, out=np.empty(geom.output_shape(1), np.float32), ws=arena, bias=bias,
                          relu=relu)
    assert calls == [2 * geom.out_w] * (geom.out_h // 2) + [geom.out_w] * (geom.out_h % 2)
    # the workspace holds a band and the padded frame, not the whole lowering, and nothing beside its plan
    band = band_slot_bytes(geom, 2, 4)
    assert arena.store.nbytes == sum(-(-size // 64) * 64 for size in band.values()) and not arena.stores
    assert arena.store.nbytes < sum(slot_bytes(geom, 1, 1, 4).values())
    np.testing.assert_allclose(banded, whole, rtol=1e-5, atol=1e-5)
    expected = reference.forward(x.astype(np.float64), w.astype(np.float64), geom) + bias.reshape(1, -1, 1, 1)
    np.testing.assert_allclose(banded, np.maximum(expected, 0) if relu == 0.0 else expected, rtol=1e-4, atol=1e-4)
    calls.clear()
    kept = KeptLowering()
    conv_forward(x, w, geom, 1, out=np.empty(geom.output_shape(1), np.float32), ws=Arena(), keep=kept, bias=bias)
    assert len(calls) == 1 and kept.matrix_for(x, 1, geom) is not None


def test_bands_only_where_they_hold_enough_columns():
    conv1 = ConvGeometry(3, 64, 224, 224, 7, 7, stride_h=2, stride_w=2, pad_h=3, pad_w=3)    # GoogLeNet's
    assert type1.band_rows(conv1, 1, 4) * conv1.out_w >= type1.BAND_MIN_COLUMNS
    assert type1.band_rows(ConvGeometry(96, 256, 27, 27, 5, 5, pad_h=2, pad_w=2, group=2), 1, 4) == 0  # CaffeNet conv2
    assert type1.band_rows(ConvGeometry(3, 8, 10, 10, 3, 3), 1, 4) == 0          # fits one band


def test_band_pieces_share_the_rows_evenly():
    geom = ConvGeometry(3, 32, 300, 300, 7, 7, stride_h=2, stride_w=2, pad_h=3, pad_w=3)     # res10's conv1
    assert type1.band_pieces(geom, 11, 1) == [(0, 150)]
    assert type1.band_pieces(geom, 11, 2) == [(0, 75), (75, 150)]
    assert type1.band_pieces(geom, 11, 3) == [(0, 50), (50, 100), (100, 150)]
    assert len(type1.band_pieces(geom, 11, 64)) == 14              # no more pieces than bands
    assert band_slot_bytes(geom, 11, 4, 2)["lowered"] == 2 * band_slot_bytes(geom, 11, 4)["lowered"]


# --- type 1 image by image (image_major) -----------------------------------------------
def force_image_major(monkeypatch):
    """Every geometry whose output is at least as wide as its lowered rows, image by image."""
    monkeypatch.setattr(type1, "IMAGE_MAJOR_ROWS", 10 ** 6)
    monkeypatch.setattr(type1, "IMAGE_MAJOR_PIXELS", 1)
    monkeypatch.setattr(type1, "BATCH_INNER_WIDTH", 0)


IMAGE_MAJOR = [g for g in GRID + OVERRUN if g.out_h * g.out_w >= g.channels_per_group * g.kernel_h * g.kernel_w]


@pytest.mark.parametrize("geom", IMAGE_MAJOR[::2], ids=lambda g: f"c{g.channels}o{g.num_output}i{g.in_h}x{g.in_w}"
                         f"k{g.kernel_h}x{g.kernel_w}s{g.stride_h}p{g.pad_h}d{g.dilation_h}g{g.group}")
def test_type1_image_major_order_matches_reference(geom, monkeypatch):
    force_image_major(monkeypatch)
    assert type1.image_major(geom, 3)
    x, w, dy = arrays(geom, batch=3)
    bias = RNG.standard_normal(geom.num_output)
    expected = reference.forward(x, w, geom) + bias.reshape(1, -1, 1, 1)
    np.testing.assert_allclose(conv_forward(x, w, geom, 1, bias=bias), expected, atol=1e-10)
    y = np.empty(geom.output_shape(3), np.float64)[:, ::-1]            # a strided out: filled through a copy
    np.testing.assert_allclose(conv_forward(x, w, geom, 1, out=y, bias=bias), expected, atol=1e-10)
    dx, dw = conv_backward(x, dy, w, geom, 1)
    np.testing.assert_allclose(dx, reference.backward_data(dy, w, geom), atol=1e-10)
    np.testing.assert_allclose(dw, reference.backward_weights(x, dy, geom), atol=1e-10)


@pytest.mark.parametrize("relu", [None, 0.0])
@pytest.mark.parametrize("geom", [ConvGeometry(1, 4, 20, 19, 3, 3), ConvGeometry(2, 4, 9, 9, 3, 3, pad_h=1, group=2)])
def test_image_major_steps_give_the_whole_batch_numbers(geom, relu, monkeypatch):
    """An image-major forward in steps of 2 images (IMAGE_MAJOR_STEP_BYTES
    just above one image's bytes; 5 images: a short last step) gives bitwise
    the one-step output and keeps bitwise the one-step lowering."""
    from cct.core.workspace import Arena
    from cct.lowering.kept import KeptLowering
    force_image_major(monkeypatch)
    x, w, _ = arrays(geom, batch=5, dtype=np.float32)
    bias = RNG.standard_normal(geom.num_output).astype(np.float32)
    results = []
    image_bytes = 4 * geom.out_h * geom.out_w * (geom.channels * geom.kernel_h * geom.kernel_w + geom.num_output)
    for step_bytes in (1 << 30, 2 * image_bytes + 1):
        monkeypatch.setattr(type1, "IMAGE_MAJOR_STEP_BYTES", step_bytes)
        kept, calls = KeptLowering(), []
        real = np.matmul
        monkeypatch.setattr(np, "matmul", lambda *a, **k: calls.append(a[1].shape[0]) or real(*a, **k))
        y = conv_forward(x, w, geom, 1, ws=Arena(), keep=kept, bias=bias, relu=relu)
        monkeypatch.setattr(np, "matmul", real)
        results.append((y, np.array(kept.matrix_for(x, 1, geom)), calls))
    (whole, whole_kept, whole_calls), (stepped, stepped_kept, stepped_calls) = results
    assert whole_calls == [5] and stepped_calls == [2, 2, 1]
    np.testing.assert_array_equal(stepped, whole)
    np.testing.assert_array_equal(stepped_kept, whole_kept)
    expected = reference.forward(x.astype(np.float64), w.astype(np.float64), geom) + bias.reshape(1, -1, 1, 1)
    np.testing.assert_allclose(stepped, np.maximum(expected, 0) if relu == 0.0 else expected, rtol=1e-4, atol=1e-4)


def test_image_major_picks_few_rows_on_large_images():
    assert type1.image_major(ConvGeometry(1, 20, 28, 28, 5, 5), 64)              # LeNet conv1
    assert not type1.image_major(ConvGeometry(20, 50, 12, 12, 5, 5), 64)         # conv2: 500 rows, batch-inner
    assert not type1.image_major(ConvGeometry(3, 96, 227, 227, 11, 11, 4, 4), 64)   # CaffeNet conv1: 363 rows


# --- the forward's lowering kept for the backward (cct.lowering.kept) --------------------
KEPT_CASES = [(ConvGeometry(1, 4, 20, 19, 3, 3), 1),                  # image by image
              (ConvGeometry(6, 2, 6, 5, 3, 2, pad_h=1, stride_w=2), 1),  # batch-inner
              (ConvGeometry(2, 4, 7, 6, 2, 3, pad_w=1, group=2), 1),     # channels first, (n, oh, ow)
              (ConvGeometry(2, 4, 7, 6, 3, 2, stride_h=2, pad_h=1), 2),
              (ConvGeometry(4, 2, 6, 6, 3, 3, pad_h=1, pad_w=1, group=2), 3)]


@pytest.mark.parametrize("geom, kind", KEPT_CASES, ids=lambda c: str(c) if isinstance(c, int) else
                         f"c{c.channels}o{c.num_output}i{c.in_h}x{c.in_w}g{c.group}")
def test_a_kept_lowering_gives_the_backward_bitwise_its_own(geom, kind):
    from cct.core.workspace import Arena
    from cct.lowering.kept import KeptLowering
    x, w, dy = arrays(geom, batch=4, dtype=np.float32)
    kept, arena = KeptLowering(), Arena()
    y = conv_forward(x, w, geom, kind, ws=arena, keep=kept)
    np.testing.assert_array_equal(y, conv_forward(x, w, geom, kind))
    conv_backward(x, dy, w, geom, kind, ws=arena)                  # the arena is reused: the kept store is not
    lowered = kept.matrix_for(x, kind, geom)
    assert lowered is not None
    expected = conv_backward(x, dy, w, geom, kind)
    got = conv_backward(x, dy, w, geom, kind, ws=arena, lowered=lowered)
    for ours, want in zip(got, expected):
        np.testing.assert_array_equal(ours, want)
    # spent: the data gradient's product written over the matrix the weight gradient read
    got = conv_backward(x, dy, w, geom, kind, ws=kept.workspace(arena, kind), lowered=lowered)
    assert kept.matrix_for(x, kind, geom) is None
    for ours, want in zip(got, expected):
        np.testing.assert_array_equal(ours, want)


def test_a_kept_lowering_is_refused_once_its_bottom_changed():
    from cct.lowering.kept import KeptLowering
    geom = ConvGeometry(1, 4, 20, 19, 3, 3)
    x, w, _ = arrays(geom, batch=4, dtype=np.float32)
    kept = KeptLowering()
    conv_forward(x, w, geom, 1, keep=kept)
    assert kept.matrix_for(x.copy(), 1, geom) is not None          # the same values in another array
    assert kept.matrix_for(x[:3], 1, geom) is None                 # another batch
    assert kept.matrix_for(x, 2, geom) is None                     # another lowering type
    changed = x.copy()
    changed[3, 0, 19, 18] = np.nextafter(changed[3, 0, 19, 18], np.float32(np.inf))   # one ulp, last pixel
    assert kept.matrix_for(changed, 1, geom) is None
    signed = x.copy()
    signed[0, 0, 0, 0] = 0.0
    conv_forward(signed, w, geom, 1, keep=kept)
    signed[0, 0, 0, 0] = -0.0                                      # equal as a number, not as bits
    assert kept.matrix_for(signed, 1, geom) is None
    conv_forward(x, w, geom, 1, keep=kept, chunk=2)                # a chunked forward keeps nothing
    assert kept.matrix_for(x, 1, geom) is None


# --- paths without copies: one image, and pointwise (1x1) convolutions --------------------
@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("geom", [ConvGeometry(3, 5, 6, 7, 3, 3, pad_h=1, pad_w=1),
                                  ConvGeometry(4, 6, 7, 6, 3, 2, stride_h=2, pad_w=1, group=2),
                                  ConvGeometry(2, 3, 9, 9, 5, 5, stride_h=2, stride_w=2, pad_h=2, pad_w=2)])
def test_one_image_writes_the_output_directly_to_the_same_numbers(kind, geom):
    """At batch 1 types 1 and 2 multiply (and lift) into the output blob
    itself; with and without a bias, into a given buffer or a new one."""
    x, w, _ = arrays(geom, batch=1, dtype=np.float32)
    bias = RNG.standard_normal(geom.num_output).astype(np.float32)
    expected = reference.forward(x.astype(np.float64), w.astype(np.float64), geom)
    for b in (None, bias):
        want = expected + (0 if b is None else b.reshape(1, -1, 1, 1))
        out = np.full(geom.output_shape(1), np.nan, np.float32)
        assert conv_forward(x, w, geom, kind, out=out, bias=b) is out
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(conv_forward(x, w, geom, kind, bias=b), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch, side, taken", [(1, 3, True), (3, 14, True), (3, 7, False), (1, 14, True)])
def test_pointwise_convolutions_multiply_image_by_image(batch, side, taken):
    """A 1x1 kernel at stride 1 without padding in one group multiplies the
    blobs as they are (batch 1, or planes of 14x14 and more); the numbers are
    every lowering's, into a contiguous output or a strided view."""
    geom = ConvGeometry(6, 4, side, side, 1, 1)
    assert pointwise(geom, batch) is taken
    assert not pointwise(ConvGeometry(6, 4, 14, 14, 1, 1, pad_h=1, pad_w=1), 1)
    assert not pointwise(ConvGeometry(6, 4, 14, 14, 1, 1, stride_h=2, stride_w=2), 1)
    assert not pointwise(ConvGeometry(6, 4, 14, 14, 1, 1, group=2), 1)
    x, w, _ = arrays(geom, batch=batch, dtype=np.float32)
    bias = RNG.standard_normal(geom.num_output).astype(np.float32)
    want = reference.forward(x.astype(np.float64), w.astype(np.float64), geom) + bias.reshape(1, -1, 1, 1)
    for kind in TYPES:
        np.testing.assert_allclose(conv_forward(x, w, geom, kind, bias=bias), want, rtol=1e-5, atol=1e-5)
        wide = np.zeros((batch, geom.num_output + 2, side, side), np.float32)
        conv_forward(x, w, geom, kind, out=wide[:, 1:-1], bias=bias)
        np.testing.assert_allclose(wide[:, 1:-1], want, rtol=1e-5, atol=1e-5)
        assert not wide[:, 0].any() and not wide[:, -1].any()


RELU_GEOMETRIES = [ConvGeometry(3, 5, 6, 40, 3, 3, pad_h=1, pad_w=1),                # type 1 column order
                   ConvGeometry(20, 6, 12, 12, 5, 5),                                 # batch-inner at batch 4
                   ConvGeometry(1, 6, 28, 28, 5, 5),                                  # image-major
                   ConvGeometry(6, 4, 14, 14, 1, 1),                                  # pointwise
                   ConvGeometry(4, 6, 7, 6, 3, 2, stride_h=2, pad_w=1, group=2)]


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("geom", RELU_GEOMETRIES, ids=["plain", "batch_inner", "image_major", "pointwise", "group"])
@pytest.mark.parametrize("batch, chunk", [(1, None), (4, None), (4, 3)])
def test_an_output_relu_gives_the_numbers_of_the_relu_after(kind, geom, batch, chunk):
    """conv_forward(relu=slope) gives bitwise what cct's ReLU layer computes on
    conv_forward's output (np.maximum, or the negative slope's product)."""
    x, w, _ = arrays(geom, batch=batch, dtype=np.float32)
    bias = RNG.standard_normal(geom.num_output).astype(np.float32)
    for slope in (0.0, 0.25):
        for b in (None, bias):
            plain = conv_forward(x, w, geom, kind, bias=b, chunk=chunk)
            want = np.maximum(plain, 0) if slope == 0 else np.where(plain > 0, plain, plain * np.float32(slope))
            got = conv_forward(x, w, geom, kind, bias=b, chunk=chunk, relu=slope)
            assert got.tobytes() == want.tobytes()
            strided = np.zeros((batch, geom.num_output + 1) + geom.output_shape(batch)[2:], np.float32)
            conv_forward(x, w, geom, kind, out=strided[:, 1:], bias=b, chunk=chunk, relu=slope)
            assert strided[:, 1:].tobytes() == want.tobytes() and not strided[:, 0].any()


def test_finish_writes_through_a_view_it_cannot_flatten():
    """geometry.finish on an output whose (N, O, rest) reshape would be a copy
    (a transposed view) still writes the view."""
    from cct.lowering.geometry import finish
    base = RNG.standard_normal((4, 5, 3, 2)).astype(np.float32)
    bias = RNG.standard_normal(5).astype(np.float32)
    for relu in (None, 0.0, 0.5):
        out = base.copy().transpose(0, 1, 3, 2)                    # (4, 5, 2, 3): its planes do not flatten
        want = out + bias.reshape(1, -1, 1, 1)
        if relu is not None:
            want = np.maximum(want, 0) if relu == 0 else np.where(want > 0, want, want * np.float32(relu))
        assert finish(out, bias, relu) is out
        assert out.tobytes() == np.ascontiguousarray(want).tobytes()


@pytest.mark.parametrize("geom", [ConvGeometry(256, 8, 1, 1, 3, 3, pad_h=1, pad_w=1),      # res10's last heads
                                  ConvGeometry(128, 256, 3, 3, 3, 3),
                                  ConvGeometry(8, 12, 9, 7, 3, 2, stride_h=2, pad_h=1, pad_w=2, group=2),
                                  ConvGeometry(6, 4, 5, 6, 2, 2)])                           # no border
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("relu", [None, 0.0, 0.1])
def test_bound_one_image_forward_gives_the_per_call_bits(geom, dtype, relu):
    """A plan's bound one-image lowering (type1.bind_one_image) against
    conv_forward's per-call path, bias and output ReLU included, called twice
    (the kept padded frame's border must stay zero)."""
    x, w, _ = arrays(geom, batch=1, dtype=dtype)
    bias = np.random.default_rng(3).standard_normal(geom.num_output).astype(dtype)
    expected = conv_forward(x, w, geom, 1, out=np.empty(geom.output_shape(1), dtype), bias=bias, relu=relu)
    out = np.full(geom.output_shape(1), np.nan, dtype)
    bound = bind_conv_forward(x, w, geom, 1, out, None)
    assert bound is not None
    for _ in range(2):
        bound(bias, relu)
        assert np.array_equal(out, expected)
    assert bind_conv_forward(np.concatenate([x, x]), w, geom, 1, np.empty(geom.output_shape(2), dtype), None) is None
    assert bind_conv_forward(x, w, geom, 3, out, None) is None


@pytest.mark.parametrize("geom", [ConvGeometry(4, 4, 2, 2, 1, 1), ConvGeometry(16, 8, 5, 3, 1, 1),
                                  ConvGeometry(8, 32, 7, 7, 1, 1)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bound_pointwise_backward_gives_type3s_bits(geom, dtype):
    """A plan's bound pointwise backward (type3.bind_pointwise_backward)
    against type 3's per-call backward of one image, both gradients and each alone."""
    x, w, dy = arrays(geom, batch=1, dtype=dtype)
    dx_expected, dw_expected = type3.backward(x, dy, w, geom, dx_out=np.empty_like(x))
    dx = np.full_like(x, np.nan)
    bound = type3.bind_pointwise_backward(x, dy, w, geom, dx)
    assert np.array_equal(bound(True, True), dw_expected) and np.array_equal(dx, dx_expected)
    dx[...] = np.nan
    assert bound(False, True) is not None and np.isnan(dx).all()
    assert bound(True, False) is None and np.array_equal(dx, dx_expected)
    weights_only = type3.bind_pointwise_backward(x, dy, w, geom, None)      # no data gradient asked for
    assert np.array_equal(weights_only(False, True), dw_expected)
    wider = ConvGeometry(geom.channels, geom.num_output, geom.in_h, geom.in_w, 1, 1, pad_h=1)
    assert type3.bind_pointwise_backward(x, dy, w, wider, dx) is None
