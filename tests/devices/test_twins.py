"""Every kernel's numpy twin (cct.devices.jit) against its compiled kernel, bit
for bit: the same arguments, every array the call writes compared as bytes
afterwards, on several shapes (odd sizes, strides, pads, one-cell planes)
and values with NaNs, -0.0, infinities and ties among them. A NaN matches
any NaN: which operand's NaN an operation passes on (its sign, its payload)
is the compiler's choice of operand order, vectorised or not, and is no
number of Caffe's either."""
import numpy as np
import pytest

from cct.devices import jit
from cct.layers import normalization, pooling_kernels
from cct.lowering import geometry, type1, winograd
from cct.runtime import fusion

# The twins are called here directly, on infinities too (inf - inf): the kernel
# wrapper that calls them in a net silences numpy's warnings, as a compiled kernel is silent
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

F32 = np.float32


def values(rng, shape, specials=True):
    """float32 values of `shape`, rounded to a few bits so ties happen, with
    NaN, +-inf, 0.0 and -0.0 scattered among them."""
    x = np.round(rng.standard_normal(shape) * 4) / 4
    x = x.astype(F32)
    if specials and x.size:
        flat = x.reshape(-1)
        spots = rng.integers(0, flat.size, size=(5, max(1, flat.size // 16)))
        for spot, special in zip(spots, (np.nan, np.inf, -np.inf, 0.0, -0.0)):
            flat[spot] = special
    return x


def same_bits(a, b):
    """Bit for bit (-0.0 is not 0.0), every NaN alike."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.kind == "f":
        nan_a, nan_b = np.isnan(a), np.isnan(b)
        if not np.array_equal(nan_a, nan_b):
            return False
        a, b = np.where(nan_a, 0, a), np.where(nan_b, 0, b)
    return a.tobytes() == b.tobytes()


def wrapper(kernel):
    """The jit wrapper of `kernel` (once compiled, its module holds the
    compiled function in the wrapper's place)."""
    function = getattr(kernel, "py_func", kernel)
    return next(w for w in jit.twinned()
                if (w.__module__, w.__name__) == (function.__module__, function.__name__))


def check(kernel, make):
    """Run kernel's twin and its compiled form on two identical argument sets
    (make(rng) twice from one seed) and compare what each wrote and returned."""
    kernel = wrapper(kernel)
    twin_args, kernel_args = make(np.random.default_rng(7)), make(np.random.default_rng(7))
    twin_result = kernel.numpy_twin(*twin_args)
    kernel_result = jit.compiled(kernel)(*kernel_args)
    assert (twin_result is None) == (kernel_result is None)
    if twin_result is not None:
        assert bool(twin_result) == bool(kernel_result)
    for index, (t, k) in enumerate(zip(twin_args, kernel_args)):
        if isinstance(t, np.ndarray):
            assert same_bits(t, k), f"{kernel.__name__}: argument {index} differs"


# --- pooling ------------------------------------------------------------------------------------------------
PLANES = [(1, 1, 1), (2, 1, 5), (2, 5, 1), (3, 2, 2), (2, 3, 3), (4, 7, 9), (2, 8, 8), (3, 13, 14)]


def pooled_input(rng, shape, negative_zeros):
    """Values for a max: with -0.0s (the twin then selects bits), or their
    -0.0s made 0.0 (it takes fmax: equal values then have equal bits)."""
    x = values(rng, shape)
    return x if negative_zeros else x + F32(0)


@pytest.mark.parametrize("shape", PLANES)
@pytest.mark.parametrize("negative_zeros", [True, False])
def test_max_3x3_same(shape, negative_zeros):
    check(pooling_kernels.max_3x3_same, lambda rng: (pooled_input(rng, shape, negative_zeros), values(rng, shape)))


def _pooled(size):
    return (max(size - 3, 0) + 1) // 2 + 1          # Caffe's ceil rounding, no padding


@pytest.mark.parametrize("shape", PLANES + [(2, 4, 6), (2, 112, 111)])
@pytest.mark.parametrize("negative_zeros", [True, False])
def test_max_3x3_stride2(shape, negative_zeros):
    out = (shape[0], _pooled(shape[1]), _pooled(shape[2]))
    check(pooling_kernels.max_3x3_stride2, lambda rng: (pooled_input(rng, shape, negative_zeros),
                                                        values(rng, out)))


@pytest.mark.parametrize("shape", PLANES)
def test_ave_whole(shape):
    def make(rng):
        x = values(rng, shape, specials=False)
        x[0] = -0.0                                  # a plane of -0.0s sums to +0.0 from +0.0
        return x, F32(shape[1] * shape[2]), values(rng, shape[:1])
    check(pooling_kernels.ave_whole, make)


# --- LRN across channels, beta 0.75 -------------------------------------------------------------------------
@pytest.mark.parametrize("shape,size", [((1, 1, 1), 5), ((1, 3, 7), 5), ((2, 7, 5), 3), ((1, 6, 9), 1),
                                        ((2, 5, 4), 7), ((1, 9, 13), 5)])
def test_lrn_forward_075(shape, size):
    def make(rng):
        x = np.abs(values(rng, shape, specials=False))
        return x, size, F32(1e-4 / size) * F32(7), F32(1), F32(1), values(rng, shape[2:]), values(rng, shape)
    check(normalization._lrn_forward_075, make)


# --- a convolution's end: bias and ReLU ------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 3, 5), (1, 7, 13)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("slope", [0.0, -0.0, 0.1])
def test_bias_relu(shape, bias, slope):
    check(geometry._bias_relu, lambda rng: (values(rng, shape), values(rng, shape[1:2]) if bias
                                            else np.empty(0, F32), F32(slope)))


# --- type 1 lowering ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("channels,height,width,kernel_h,kernel_w,stride_h",
                         [(1, 1, 1, 1, 1, 1), (3, 7, 6, 3, 3, 1), (2, 9, 8, 3, 2, 2), (4, 31, 31, 5, 5, 1),
                          (2, 15, 11, 1, 1, 3), (3, 12, 10, 4, 3, 3)])
def test_lower_one_image(channels, height, width, kernel_h, kernel_w, stride_h):
    out_h, out_w = (height - kernel_h) // stride_h + 1, width - kernel_w + 1
    check(type1._lower_one_image, lambda rng: (
        values(rng, (channels, 1, height, width)), kernel_h, kernel_w, stride_h, out_h, out_w,
        values(rng, (channels * kernel_h * kernel_w, out_h * out_w))))


@pytest.mark.parametrize("out_shape,source_shape,row0,col0", [((1, 1, 1, 1), (1, 1, 1, 1), 0, 0),
                                                              ((3, 2, 5, 4), (2, 7, 6, 3), 1, 2),
                                                              ((17, 3, 2, 19), (3, 2, 20, 18), 0, 1)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("relu,slope", [(False, 0.0), (True, 0.0), (True, 0.25)])
def test_to_batch_first(out_shape, source_shape, row0, col0, bias, relu, slope):
    check(type1._to_batch_first, lambda rng: (
        values(rng, source_shape), row0, col0, values(rng, out_shape[1:2]) if bias else np.empty(0, F32),
        relu, F32(slope), values(rng, out_shape)))


# --- Winograd's transforms ------------------------------------------------------------------------------------
# (m, r, the tile-innermost input kernel, its alpha, the output variant)
VARIANTS = [(2, 3, winograd._input_a4, 0), (4, 3, winograd._input_a6, 1), (2, 5, winograd._input_a6, 2)]
CHANNELS_INNER = {(2, 3): winograd._input_channels_a4, (4, 3): winograd._input_channels,
                  (2, 5): winograd._input_channels}
IMAGES = [(1, 1, 1, 0), (3, 5, 7, 1), (2, 8, 8, 0), (5, 9, 6, 2), (4, 14, 13, 1)]   # (C, H, W, pad)


def _tiles(height, width, pad, m, r):
    out_h, out_w = height + 2 * pad - r + 1, width + 2 * pad - r + 1
    return out_h, out_w, -(-out_h // m), -(-out_w // m)


def _image_cases():
    for m, r, tiles_kernel, _ in VARIANTS:
        for channels, height, width, pad in IMAGES:
            out_h, out_w, tiles_h, tiles_w = _tiles(height, width, pad, m, r)
            if out_h > 0 and out_w > 0:
                yield m, r, tiles_kernel, channels, height, width, pad, tiles_h, tiles_w


@pytest.mark.parametrize("m,r,tiles_kernel,channels,height,width,pad,tiles_h,tiles_w", list(_image_cases()))
@pytest.mark.parametrize("first", [0, 3])
def test_winograd_input(m, r, tiles_kernel, channels, height, width, pad, tiles_h, tiles_w, first):
    alpha2, total = (m + r - 1) ** 2, first + tiles_h * tiles_w + 2
    check(tiles_kernel, lambda rng: (values(rng, (channels, height, width)), pad, pad, m, tiles_h, tiles_w,
                                     values(rng, (alpha2, channels, total)), first))
    check(CHANNELS_INNER[m, r], lambda rng: (values(rng, (height, width, channels)), pad, pad, m, tiles_h,
                                             tiles_w, values(rng, (alpha2, total, channels)), first))


@pytest.mark.parametrize("m,r,tiles_kernel,channels,height,width,pad,tiles_h,tiles_w", list(_image_cases()))
@pytest.mark.parametrize("first", [0, 2])
@pytest.mark.parametrize("bias,relu,slope", [(True, True, 0.0), (False, False, 0.0), (True, False, 0.0),
                                             (False, True, 0.5)])
def test_winograd_output(m, r, tiles_kernel, channels, height, width, pad, tiles_h, tiles_w, first, bias, relu,
                         slope):
    variant = next(v for mm, rr, _, v in VARIANTS if (mm, rr) == (m, r))
    out_h, out_w, _, _ = _tiles(height, width, pad, m, r)
    outputs, alpha2, total = channels + 1, (m + r - 1) ** 2, first + tiles_h * tiles_w + 1

    def make(layout):
        return lambda rng: (values(rng, (alpha2,) + layout(outputs, total)), variant, first, tiles_h, tiles_w,
                            values(rng, (outputs,)) if bias else np.zeros(0, F32), bias, F32(slope), relu,
                            values(rng, (outputs, out_h, out_w)))
    check(winograd._output_tiles, make(lambda o, t: (o, t)))
    check(winograd._output_channels, make(lambda o, t: (t, o)))


# --- fused passes -----------------------------------------------------------------------------------------------
PASS_SHAPES = [(1, 1, 1), (2, 3, 5), (1, 4, fusion.PASS_CHUNK + 3)]
NOTHING = np.zeros((0, 0, 0), F32)


def _maps(rng, channels):
    return values(rng, (channels,)), values(rng, (channels,)), values(rng, (channels,))


@pytest.mark.parametrize("shape", PASS_SHAPES)
@pytest.mark.parametrize("affine,relu1,slope1", [(True, True, 0.0), (False, False, 0.0), (True, False, 0.0),
                                                 (False, True, 0.1)])
@pytest.mark.parametrize("store_value,summed,relu2,slope2", [(False, False, False, 0.0), (True, True, True, 0.0),
                                                             (False, True, False, 0.0), (True, True, True, 0.2)])
@pytest.mark.parametrize("in_place", [False, True])
def test_fused_pass(shape, affine, relu1, slope1, store_value, summed, relu2, slope2, in_place):
    def make(rng):
        source = values(rng, shape)
        out = source if in_place else values(rng, shape)
        return (source, *_maps(rng, shape[1]), affine, F32(slope1), relu1,
                values(rng, shape) if store_value else NOTHING, store_value,
                values(rng, shape) if summed else NOTHING, F32(0.5), F32(-1.5), summed, F32(slope2), relu2, out)
    check(fusion._fused_pass, make)


@pytest.mark.parametrize("shape", PASS_SHAPES)
@pytest.mark.parametrize("affine,relu1,slope1,relu2,slope2", [(True, True, 0.0, False, 0.0),
                                                              (False, False, 0.0, True, 0.3),
                                                              (True, True, 0.1, True, 0.0)])
def test_in_place_pass(shape, affine, relu1, slope1, relu2, slope2):
    check(fusion._in_place_pass, lambda rng: (values(rng, shape), *_maps(rng, shape[1]), affine, F32(slope1), relu1,
                                              F32(slope2), relu2))


@pytest.mark.parametrize("shape", PASS_SHAPES)
@pytest.mark.parametrize("affine,relu1,slope1,relu2,slope2", [(True, True, 0.0, False, 0.0),
                                                              (False, False, 0.0, True, 0.3),
                                                              (True, True, 0.1, True, 0.0)])
def test_mapped_pass(shape, affine, relu1, slope1, relu2, slope2):
    check(fusion._mapped_pass, lambda rng: (values(rng, shape), *_maps(rng, shape[1]), affine, F32(slope1), relu1,
                                            F32(slope2), relu2, values(rng, shape)))


@pytest.mark.parametrize("shape", PASS_SHAPES)
@pytest.mark.parametrize("affine,relu1,slope1,relu2,slope2", [(True, False, 0.0, True, 0.0),
                                                              (False, True, 0.2, False, 0.0)])
@pytest.mark.parametrize("coeffs", [(1.0, 1.0), (0.5, -2.0)])
def test_kept_sum_pass(shape, affine, relu1, slope1, relu2, slope2, coeffs):
    check(fusion._kept_sum_pass, lambda rng: (values(rng, shape), *_maps(rng, shape[1]), affine, F32(slope1), relu1,
                                              values(rng, shape), F32(coeffs[0]), F32(coeffs[1]), F32(slope2), relu2,
                                              values(rng, shape)))


@pytest.mark.parametrize("case", ["same", "nan", "negative zero", "longer", "empty"])
def test_same_bits(case):
    def make(rng):
        current = values(rng, (9,))
        snapshot = current.copy()
        if case == "negative zero":
            current[2], snapshot[2] = 0.0, -0.0
        elif case == "longer":
            snapshot = np.append(snapshot, F32(1))
        elif case == "empty":
            current, snapshot = current[:0], snapshot[:0]
        return current.view(np.uint32), snapshot.view(np.uint32)
    check(fusion._same_bits, make)


@pytest.mark.parametrize("word", [np.uint32, np.uint64])
@pytest.mark.parametrize("changed", [None, 0, 2])
def test_first_changed(changed, word):
    """ParamWatch's check, whose twin it calls itself (the kernel takes the
    arrays' addresses), by 4- and 8-byte words."""
    from cct.devices import addressed
    rng = np.random.default_rng(3)
    pieces = [values(rng, (2 * n,)).view(word) for n in (3, 1, 8)]
    snapshots = [piece.copy() for piece in pieces]
    if changed is not None:
        pieces[changed][-1] ^= 1
    offsets = np.cumsum([0] + [p.size for p in snapshots]).astype(np.uint64)
    snapshot = np.concatenate(snapshots)
    expected = -1 if changed is None else changed
    addresses = np.array([piece.ctypes.data for piece in pieces], np.uint64)
    assert fusion._first_changed(pieces, snapshot, offsets) == expected
    assert addressed.first_changed(addresses, snapshot, offsets) == expected


def test_every_twin_is_tested():
    """Each kernel given a twin has its test here (a new twin needs one)."""
    tested = {pooling_kernels.max_3x3_same, pooling_kernels.max_3x3_stride2, pooling_kernels.ave_whole,
              normalization._lrn_forward_075, geometry._bias_relu, type1._lower_one_image, type1._to_batch_first,
              winograd._input_a4, winograd._input_a6, winograd._input_channels, winograd._input_channels_a4,
              winograd._output_tiles, winograd._output_channels, fusion._fused_pass, fusion._in_place_pass,
              fusion._kept_sum_pass, fusion._mapped_pass, fusion._same_bits}
    assert set(jit.twinned()) == {wrapper(kernel) for kernel in tested}
