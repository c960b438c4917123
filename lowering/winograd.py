"""Winograd convolution F(m x m, r x r) for forwards that never run backward
(deploy nets: Convolution.runs_backward False), after Lavin and Gray, "Fast
Algorithms for Convolutional Neural Networks" (2016): F(2x2, 3x3),
F(4x4, 3x3) and F(2x2, 5x5).

An r x r kernel at stride 1 (no dilation) makes each m x m block of outputs
("tile") a function of an alpha x alpha block of input, alpha = m + r - 1:

    Y = A^T [ U (.) V ] A,   U = G g G^T (alpha x alpha per kernel),
                             V = B^T d B (alpha x alpha per input tile)

so the (.) products of all tiles and channels are alpha^2 GEMMs,
M[xi] (O, tiles) = U[xi] (O, C) @ V[xi] (C, tiles): r^2 m^2 / alpha^2 times
fewer multiplications than the direct convolution (2.25x for F(2x2, 3x3), 4x
for F(4x4, 3x3), 2.8x for F(2x2, 5x5)), with no lowered matrix r^2 times the
input. What it costs: U is alpha^2 / r^2 times the weights (1.8x, 4x, 1.4x),
read by every GEMM, and the transforms are passes over alpha^2 / m^2 times
the input and output. So it pays on large planes (many tiles per GEMM) and
at larger batches, and loses on small planes, where the GEMMs are few
columns wide and bound by reading U: the chooser times it against the
lowering on the shape itself (cct.lowering.chooser.choose_forward) and keeps
Winograd where it is clearly faster. F(4x4, 3x3) and F(2x2, 5x5) share
alpha = 6 and the points 0, +-1, +-2, so their B^T, the input transform, is one.

Numbers: the same sums in another order, and the transforms' fractions (1/6,
1/24 at alpha = 6) round: the output differs from the direct convolution by a
few 1e-6 of its largest value (alpha = 6; less for F(2x2, 3x3)), inside the
reference cases' 1e-4. float32 only; the weights are transformed in float64.

U is cached (TransformedWeights) with a copy of the weights it came from, and
made again when they differ bit for bit: pycaffe writes weights through
numpy views (net.params[...][0].data[...] = ...), which no flag sees, so
every forward compares, a pass over twice the weights' bytes (one memcmp,
cct.core.bits). The chooser's timing includes it.

Layout: the images' tiles t = (ty, tx) make one side of the GEMMs; a block
of images is transformed at once, its tiles side by side, so that the GEMMs
are large enough (BLOCK_COLUMNS) while V and M stay small (BLOCK_BYTES).
Each variant runs a shape one of two ways (channels_inner). Tiles
innermost: V (alpha^2, C, tiles) and M (alpha^2, O, tiles) = U @ V, the
transforms vectorised over a channel's tiles. Channels innermost: the
image is copied to (H, W, C), V is (alpha^2, tiles, C) and M (alpha^2,
tiles, O) = V @ U with U (alpha^2, C, O), and each tile is transformed as
vectors over the channels, by the same B^T and A^T kernels. The longer
vectors win, so channels innermost runs images of 64 channels or more, or
of fewer tiles than channels: at batch 1 a channel has few tiles (49 on
28x28 at F(4x4, 3x3); BENCHMARKS.md, "Session 10: per-layer costs, kept fused passes, Winograd channels innermost").
The same sums either way: outputs equal bit for bit but where OpenBLAS
orders a GEMM's sums otherwise (48 of 54 cases, 9 shapes with and without
bias and ReLU, bit for bit; 3.7e-6 of the largest value at worst).
"""
import threading
from typing import Any, Dict, List, Optional, Tuple, Union, cast

import numpy as np
import numpy.typing as npt

from cct.core.arrays import Array, Float32Array, FloatArray
from cct.core.bits import same_bits
from cct.core.workspace import FRESH, Workspace
from cct.devices.jit import PLANE_GROUPS, kernel, parallel_kernel, prange

from . import depthwise
from .geometry import ConvGeometry, relu_value, relu_values, stacked_matmul, weights_as

# Transform matrices (B^T, G, A^T) per (output tile m, kernel r), points 0,
# +-1, +-2, as in Lavin and Gray and wincnn. F(2x2, 5x5)'s G and A^T follow
# from the shared B^T: A^T[i, j] G[j, k] = (B^T)^-1[i + k, j].
_BT6 = [[4, 0, -5, 0, 1, 0],
        [0, -4, -4, 1, 1, 0],
        [0, 4, -4, -1, 1, 0],
        [0, -2, -1, 2, 1, 0],
        [0, 2, -1, -2, 1, 0],
        [0, 4, 0, -5, 0, 1]]
_TRANSFORMS = {
    (2, 3): ([[1, 0, -1, 0],
              [0, 1, 1, 0],
              [0, -1, 1, 0],
              [0, 1, 0, -1]],
             [[1, 0, 0],
              [1 / 2, 1 / 2, 1 / 2],
              [1 / 2, -1 / 2, 1 / 2],
              [0, 0, 1]],
             [[1, 1, 1, 0],
              [0, 1, -1, -1]]),
    (4, 3): (_BT6,
             [[1 / 4, 0, 0],
              [-1 / 6, -1 / 6, -1 / 6],
              [-1 / 6, 1 / 6, -1 / 6],
              [1 / 24, 1 / 12, 1 / 6],
              [1 / 24, -1 / 12, 1 / 6],
              [0, 0, 1]],
             [[1, 1, 1, 1, 1, 0],
              [0, 1, -1, 2, -2, 0],
              [0, 1, 1, 4, 4, 0],
              [0, 1, -1, 8, -8, 1]]),
    (2, 5): (_BT6,
             [[1 / 4, 0, 0, 0, 0],
              [-1 / 6, -1 / 6, -1 / 6, -1 / 6, -1 / 6],
              [-1 / 6, 1 / 6, -1 / 6, 1 / 6, -1 / 6],
              [1 / 24, 1 / 12, 1 / 6, 1 / 3, 2 / 3],
              [1 / 24, -1 / 12, 1 / 6, -1 / 3, 2 / 3],
              [0, 0, 0, 0, 1]],
             [[1, 1, 1, 1, 1, 0],
              [0, 1, -1, 2, -2, 1]]),
}
VARIANTS = tuple(sorted(_TRANSFORMS))
TILE_SIZES = tuple(sorted({m for m, _ in VARIANTS}))      # the run settings' tile sizes


def tile_sizes(kernel: int) -> Tuple[int, ...]:
    """The output tile sizes m with an F(m x m, kernel x kernel)."""
    return tuple(m for m, r in VARIANTS if r == kernel)


# Multiply-adds (x2) of the direct forward below which "auto" keeps the lowering
# without timing: there a forward takes some 0.1 ms, Winograd's fixed costs
# (checking the weights, the calls) eat what it saves, and the timing would
# pick between noise.
AUTO_MIN_FLOPS = 10 ** 7
# GEMM columns (tiles in the batch) below which "auto" does not time a tile
# size: 4 to 16 columns are bound by reading U, every such pick lost in the nets,
# and a timing under load could still pick it (BENCHMARKS.md, "Winograd for deploy convolutions (session 9)").
AUTO_MIN_COLUMNS = 32

# Channels innermost where the image has at least this many channels, or as
# many as it has tiles (see "Layout" in the module docstring, and channels_inner).
CHANNELS_INNER_MIN = 64

BLOCK_COLUMNS = 256            # tiles per block of images, at least (whole images)
BLOCK_BYTES = 4 * 2 ** 20      # ... while V and M of the block stay within this


def transforms(m: int, r: int = 3, dtype: npt.DTypeLike = np.float64) -> Tuple[Array, ...]:
    """(B^T, G, A^T) of F(m x m, r x r)."""
    try:
        return tuple(np.array(matrix, dtype) for matrix in _TRANSFORMS[(m, r)])
    except KeyError:
        raise ValueError(f"Winograd F(m x m, r x r) is one of {VARIANTS} as (m, r), got {(m, r)!r}") from None


def applicable(geom: ConvGeometry, dtype: npt.DTypeLike = np.float32) -> bool:
    """Whether a forward of this geometry can run as some F(m x m, r x r): a
    square kernel with a variant (3 x 3, 5 x 5) at stride 1 without dilation,
    padding below the kernel, float32, something to compute; not a depthwise
    geometry, whose direct kernels (cct.lowering.depthwise) it would only slow."""
    return (geom.kernel_h == geom.kernel_w and bool(tile_sizes(geom.kernel_h)) and not depthwise.applies(geom)
            and geom.stride_h == geom.stride_w == 1 and geom.dilation_h == geom.dilation_w == 1
            and np.dtype(dtype) == np.float32 and not geom.empty
            and max(geom.pad_h, geom.pad_w) < geom.kernel_h)


def worth_timing(geom: ConvGeometry, batch: int) -> bool:
    """Whether "auto" times Winograd on this shape at all: AUTO_MIN_FLOPS, and
    some tile size with AUTO_MIN_COLUMNS (timing_tiles)."""
    flops = (2 * batch * geom.out_h * geom.out_w * geom.num_output * geom.channels_per_group
             * geom.kernel_h * geom.kernel_w)
    return flops >= AUTO_MIN_FLOPS and bool(timing_tiles(geom, batch))


def timing_tiles(geom: ConvGeometry, batch: int) -> Tuple[int, ...]:
    """The tile sizes "auto" times on this shape: those whose GEMMs get at
    least AUTO_MIN_COLUMNS columns (tiles) from the batch."""
    return tuple(m for m in tile_sizes(geom.kernel_h) if batch * np.prod(tile_counts(geom, m)) >= AUTO_MIN_COLUMNS)


def channels_inner(geom: ConvGeometry, m: int) -> Union[bool, np.bool_]:
    """Whether F(m x m) runs this shape channels innermost: vectors of C
    values, against tiles innermost, vectors of one image's tiles. The
    longer vectors win: channels innermost with 64 channels or more, or on
    planes of fewer tiles than channels; tiles innermost with 16 or 32
    channels (BENCHMARKS.md, "Session 10: per-layer costs, kept fused passes, Winograd channels innermost")."""
    return geom.channels >= CHANNELS_INNER_MIN or geom.channels >= np.prod(tile_counts(geom, m))


# Kernels transform_weights takes in one block: its float64 steps (under
# 3 MB at alpha 6) stay in a core's cache.
TRANSFORM_KERNELS = 2048


def _u_shape(w: FloatArray, m: int, inner: Union[bool, np.bool_]) -> Tuple[int, ...]:
    """transform_weights' array before its last reshape: (alpha, alpha, O, C/group), or C/group, O."""
    alpha = m + w.shape[-1] - 1
    outputs, channels = w.shape[0], w.shape[1]
    return (alpha, alpha) + ((channels, outputs) if inner else (outputs, channels))


def transform_weights(w: FloatArray, m: int, inner: Union[bool, np.bool_] = False,
                      out: Optional[Float32Array] = None) -> Float32Array:
    """U float32 from w (O, C/group, r, r), in the layout forward() takes:
    (alpha^2, O, C/group) tiles innermost, (alpha^2, C/group, O) channels
    innermost (`inner`); into `out` where it has _u_shape's shape."""
    r = w.shape[-1]
    _, g, _ = transforms(m, r)
    alpha = g.shape[0]
    shape = _u_shape(w, m, inner)
    u = out if out is not None and out.shape == shape else np.empty(shape, np.float32)
    if inner:
        # the kernels taken in U's order, so each block is stored whole rows at a
        # time (storing the blocks transposed took 1.2-1.9x as long on 128-256 channels)
        w = w.transpose(1, 0, 2, 3)
    rows, columns = w.shape[0], w.shape[1]
    # G k G^T for every kernel k (n = row*columns + column) in float64, G k first, as two
    # GEMMs over a block of kernels at once, each as wide as the block (a
    # stack of alpha x r products costs numpy a BLAS call per kernel); blocks
    # of rows whose float64 steps stay in the cache
    step = max(1, TRANSFORM_KERNELS // max(1, columns))
    for first in range(0, rows, step):
        last = min(rows, first + step)
        kernels = np.asarray(w[first:last], np.float64).reshape(-1, r, r)     # k[n, i, j]
        left = g @ kernels.transpose(1, 0, 2).reshape(r, -1)                    # (alpha, n*r): (G k)[a, n, j]
        block = (g @ left.reshape(-1, r).T).reshape(alpha, alpha, last - first, columns)   # U[b, a, row, column]
        u[:, :, first:last] = block.transpose(1, 0, 2, 3)
    return u.reshape(alpha * alpha, *u.shape[2:])


def weights_for(w: FloatArray, geom: ConvGeometry, m: int) -> Float32Array:
    """transform_weights in the layout forward() takes for this shape."""
    return transform_weights(w, m, channels_inner(geom, m))


def held_bytes(w: FloatArray, m: int) -> int:
    """Bytes a layer holds for Winograd F(m x m, r x r): U and the weights' copy."""
    r = w.shape[-1]
    return ((m + r - 1) ** 2 * w.size // (r * r) + w.size) * 4


class TransformedWeights:
    """U for the weights a layer holds, made again whenever they change (bit
    for bit: pycaffe writes them through numpy views, which nothing sees).
    Shared by a layer's batch partitions, which may ask at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._source: Optional[Array] = None     # a copy of the weights U was made from
        self._made: Dict[Tuple[int, Union[bool, np.bool_]], Float32Array] = {}   # (m, channels innermost) -> U
        self._ahead: Dict[Any, Array] = {}        # reserve()'s arrays: "source" and the key's U

    def reserve(self, w: FloatArray, geom: ConvGeometry, m: int) -> List[Array]:
        """The arrays get() will fill for this shape (the weights' copy and U),
        allocated now and unfilled, so that their pages can be faulted in
        before the first forward (cct.runtime.executor)."""
        key = (m, channels_inner(geom, m))
        with self._lock:
            if self._source is None:
                self._ahead.setdefault("source", np.empty_like(w))
            if key not in self._made:
                self._ahead.setdefault(key, np.empty(_u_shape(w, m, key[1]), np.float32))
            return list(self._ahead.values())

    def get(self, w: FloatArray, geom: ConvGeometry, m: int) -> Float32Array:
        """U of w for F(m x m) on this shape (its layout: channels_inner)."""
        key = (m, channels_inner(geom, m))
        with self._lock:
            ahead, self._ahead = self._ahead, {}      # for this call or none
            if not self._same(w):
                source = ahead.get("source")
                if source is None or source.shape != w.shape or source.dtype != w.dtype:
                    source = np.empty_like(w)
                np.copyto(source, w)
                self._source = source
                self._made = {}
            u = self._made.get(key)
            if u is None:
                u = self._made[key] = transform_weights(w, m, key[1], ahead.get(key))
            return u

    def _same(self, w: FloatArray) -> bool:
        return self._source is not None and same_bits(w, self._source)   # NaN payloads and -0.0 too

    @property
    def nbytes(self) -> int:
        held = sum(u.nbytes for u in self._made.values())
        return held + (0 if self._source is None else self._source.nbytes)


# --- the transforms (one image's channels, its tiles side by side in the block) --------------------
# Each kernel gathers a channel's alpha x alpha input blocks (or takes a
# channel's alpha^2 GEMM results) tile-innermost, so that both halves of a
# transform run as unit-stride loops over all the channel's tiles at once;
# only the gather and the final scatter move one value per tile. The
# formulas are B^T and A^T written out (multiplying by their 0s and 1s
# through general loops took two to three times as long).
# float32 constants: a Python int in a float32 expression widens it to float64
_2, _4, _5, _8 = np.float32(2), np.float32(4), np.float32(5), np.float32(8)


@kernel
def _gather_tiles(image, c, plane, pad_h, pad_w, m, tiles_h, tiles_w, blocks):
    """blocks[i, l, ty*tiles_w + tx] = padded image[c][ty*m + i, tx*m + l]
    (alpha x alpha blocks at stride m); `plane` (tiles_h*m + alpha - m,
    tiles_w*m + alpha - m) is the zero-framed scratch the image is copied into."""
    height, width = image.shape[1], image.shape[2]
    alpha = blocks.shape[0]
    rows_in = min(height, plane.shape[0] - pad_h)
    cols_in = min(width, plane.shape[1] - pad_w)
    for y in range(rows_in):
        source = image[c, y]
        target = plane[pad_h + y, pad_w:pad_w + cols_in]
        for q in range(cols_in):
            target[q] = source[q]
    for i in range(alpha):
        for col in range(alpha):
            target = blocks[i, col]
            for ty in range(tiles_h):
                source = plane[ty * m + i]
                row = target[ty * tiles_w:(ty + 1) * tiles_w]
                for tx in range(tiles_w):
                    row[tx] = source[tx * m + col]


@kernel
def _bt6(d0, d1, d2, d3, d4, d5, r0, r1, r2, r3, r4, r5, count):
    """r = B^T d at alpha = 6, element by element over `count` tiles."""
    for t in range(count):
        a0, a1, a2, a3, a4, a5 = d0[t], d1[t], d2[t], d3[t], d4[t], d5[t]
        r0[t] = _4 * a0 - _5 * a2 + a4
        r1[t] = -_4 * (a1 + a2) + a3 + a4
        r2[t] = _4 * (a1 - a2) - a3 + a4
        r3[t] = (a3 - a1) * _2 - a2 + a4
        r4[t] = (a1 - a3) * _2 - a2 + a4
        r5[t] = _4 * a1 - _5 * a3 + a5


@kernel
def _bt4(d0, d1, d2, d3, r0, r1, r2, r3, count):
    """r = B^T d at alpha = 4 (F(2 x 2, 3 x 3))."""
    for t in range(count):
        a0, a1, a2, a3 = d0[t], d1[t], d2[t], d3[t]
        r0[t] = a0 - a2
        r1[t] = a1 + a2
        r2[t] = a2 - a1
        r3[t] = a1 - a3


@kernel
def _at4(m0, m1, m2, m3, m4, m5, r0, r1, r2, r3, count):
    """r = A^T m for F(4 x 4, 3 x 3)."""
    for t in range(count):
        a0, a1, a2, a3, a4, a5 = m0[t], m1[t], m2[t], m3[t], m4[t], m5[t]
        r0[t] = a0 + a1 + a2 + a3 + a4
        r1[t] = a1 - a2 + (a3 - a4) * _2
        r2[t] = a1 + a2 + _4 * (a3 + a4)
        r3[t] = a1 - a2 + _8 * (a3 - a4) + a5


@kernel
def _at2(m0, m1, m2, m3, r0, r1, count):
    """r = A^T m for F(2 x 2, 3 x 3)."""
    for t in range(count):
        a1, a2 = m1[t], m2[t]
        r0[t] = m0[t] + a1 + a2
        r1[t] = a1 - a2 - m3[t]


@kernel
def _at25(m0, m1, m2, m3, m4, m5, r0, r1, count):
    """r = A^T m for F(2 x 2, 5 x 5)."""
    for t in range(count):
        a1, a2, a3, a4 = m1[t], m2[t], m3[t], m4[t]
        r0[t] = m0[t] + a1 + a2 + a3 + a4
        r1[t] = a1 - a2 + (a3 - a4) * _2 + m5[t]


@parallel_kernel
def _input_a6(image, pad_h, pad_w, m, tiles_h, tiles_w, v, first):
    """V[6j + k, c, first + t] = (B^T d B)[j, k] of every channel c and tile t
    of `image` (C, H, W), tiles innermost, at alpha = 6: d the 6 x 6 block at
    (ty*m - pad_h, tx*m - pad_w) (m = 4: F(4x4, 3x3); 2: F(2x2, 5x5)). The
    channels in PLANE_GROUPS groups, each with its scratch (on the pool's
    threads where a pass lends them)."""
    count = tiles_h * tiles_w
    last = first + count
    channels = image.shape[0]
    groups = min(PLANE_GROUPS, channels)
    for group in prange(groups):
        plane = np.zeros((tiles_h * m + 6 - m, tiles_w * m + 6 - m), np.float32)
        blocks = np.empty((6, 6, count), np.float32)
        rows = np.empty((6, 6, count), np.float32)
        for c in range(channels * group // groups, channels * (group + 1) // groups):
            _gather_tiles(image, c, plane, pad_h, pad_w, m, tiles_h, tiles_w, blocks)
            for col in range(6):                  # rows[:, col] = B^T blocks[:, col]
                _bt6(blocks[0, col], blocks[1, col], blocks[2, col], blocks[3, col], blocks[4, col], blocks[5, col],
                     rows[0, col], rows[1, col], rows[2, col], rows[3, col], rows[4, col], rows[5, col], count)
            for j in range(6):                    # V[6j:6j + 6] = B^T rows[j]
                _bt6(rows[j, 0], rows[j, 1], rows[j, 2], rows[j, 3], rows[j, 4], rows[j, 5],
                     v[6 * j, c, first:last], v[6 * j + 1, c, first:last], v[6 * j + 2, c, first:last],
                     v[6 * j + 3, c, first:last], v[6 * j + 4, c, first:last], v[6 * j + 5, c, first:last], count)


@parallel_kernel
def _input_a4(image, pad_h, pad_w, m, tiles_h, tiles_w, v, first):
    """As _input_a6, F(2 x 2, 3 x 3) (alpha 4, m 2): V[4j + k, c, first + t]."""
    count = tiles_h * tiles_w
    last = first + count
    channels = image.shape[0]
    groups = min(PLANE_GROUPS, channels)
    for group in prange(groups):
        plane = np.zeros((tiles_h * 2 + 2, tiles_w * 2 + 2), np.float32)
        blocks = np.empty((4, 4, count), np.float32)
        rows = np.empty((4, 4, count), np.float32)
        for c in range(channels * group // groups, channels * (group + 1) // groups):
            _gather_tiles(image, c, plane, pad_h, pad_w, 2, tiles_h, tiles_w, blocks)
            for col in range(4):
                _bt4(blocks[0, col], blocks[1, col], blocks[2, col], blocks[3, col],
                     rows[0, col], rows[1, col], rows[2, col], rows[3, col], count)
            for j in range(4):
                _bt4(rows[j, 0], rows[j, 1], rows[j, 2], rows[j, 3], v[4 * j, c, first:last],
                     v[4 * j + 1, c, first:last], v[4 * j + 2, c, first:last], v[4 * j + 3, c, first:last], count)


@kernel
def _finish_tiles(done, bias, has_bias, slope, has_relu, o, tiles_h, tiles_w, out):
    """out[o] from done (m, m, tiles): the bias added, the ReLU (relu_value,
    cct's ReLU layer), and each tile's m x m values put in place; tiles that
    overhang the output write only their part inside it."""
    m = done.shape[0]
    count = tiles_h * tiles_w
    out_h, out_w = out.shape[1], out.shape[2]
    shift = bias[o] if has_bias else np.float32(0)
    for i in range(m):
        for j in range(m):
            values = done[i, j]
            if has_bias:
                for t in range(count):
                    values[t] += shift
            if has_relu:
                for t in range(count):
                    values[t] = relu_value(values[t], slope)
    for ty in range(tiles_h):
        for i in range(m):
            y = ty * m + i
            if y >= out_h:
                break
            row = out[o, y]
            for j in range(m):
                source = done[i, j, ty * tiles_w:(ty + 1) * tiles_w]
                inside = min(tiles_w, (out_w - j + m - 1) // m)
                for tx in range(inside):
                    row[tx * m + j] = source[tx]


@parallel_kernel
def _output_tiles(product, variant, first, tiles_h, tiles_w, bias, has_bias, slope, has_relu, out):
    """out (O, OH, OW) of one image from M = product[:, :, first:] (alpha^2,
    O, tiles): Y = A^T M A per tile, then _finish_tiles. variant 0:
    F(2 x 2, 3 x 3) (alpha 4), 1: F(4 x 4, 3 x 3), 2: F(2 x 2, 5 x 5) (alpha 6).
    The outputs in PLANE_GROUPS groups, each with its scratch."""
    m = 4 if variant == 1 else 2
    alpha = 4 if variant == 0 else 6
    count = tiles_h * tiles_w
    last = first + count
    outputs = out.shape[0]
    groups = min(PLANE_GROUPS, outputs)
    for group in prange(groups):
        half = np.empty((m, alpha, count), np.float32)
        done = np.empty((m, m, count), np.float32)
        for o in range(outputs * group // groups, outputs * (group + 1) // groups):
            for col in range(alpha):              # half[:, col] = A^T M[col::alpha]
                m0, m1 = product[col, o, first:last], product[alpha + col, o, first:last]
                m2, m3 = product[2 * alpha + col, o, first:last], product[3 * alpha + col, o, first:last]
                if variant == 0:
                    _at2(m0, m1, m2, m3, half[0, col], half[1, col], count)
                    continue
                m4, m5 = product[4 * alpha + col, o, first:last], product[5 * alpha + col, o, first:last]
                if variant == 1:
                    _at4(m0, m1, m2, m3, m4, m5, half[0, col], half[1, col], half[2, col], half[3, col], count)
                else:
                    _at25(m0, m1, m2, m3, m4, m5, half[0, col], half[1, col], count)
            for i in range(m):                    # done[i] = A^T half[i]
                h = half[i]
                if variant == 0:
                    _at2(h[0], h[1], h[2], h[3], done[i, 0], done[i, 1], count)
                elif variant == 1:
                    _at4(h[0], h[1], h[2], h[3], h[4], h[5], done[i, 0], done[i, 1], done[i, 2], done[i, 3], count)
                else:
                    _at25(h[0], h[1], h[2], h[3], h[4], h[5], done[i, 0], done[i, 1], count)
            _finish_tiles(done, bias, has_bias, slope, has_relu, o, tiles_h, tiles_w, out)


# --- channels innermost: each tile's values are vectors over the channels -------------------------------
# The same B^T and A^T kernels as above, run over a tile's C (or O) values
# instead of a channel's tiles. One input kernel per alpha, as for the tiles:
# a kernel for both, handing the B^T kernels 2-d slices of V, ran the
# tile-innermost small-channel shapes 1.2-1.45x slower (likely the 2-d
# slices' non-contiguous layout, which keeps the B^T loops from vectorising).
@kernel
def _gather_block(image, y0, x0, block):
    """block[i, j] = image[y0 + i, x0 + j] (C-long vectors of the (H, W, C)
    image), zeros outside it."""
    height, width, channels = image.shape
    for i in range(block.shape[0]):
        y = y0 + i
        for j in range(block.shape[1]):
            x = x0 + j
            target = block[i, j]
            if 0 <= y < height and 0 <= x < width:
                source = image[y, x]
                for c in range(channels):
                    target[c] = source[c]
            else:
                for c in range(channels):
                    target[c] = 0


@parallel_kernel
def _input_channels(image, pad_h, pad_w, m, tiles_h, tiles_w, v, first):
    """V[6j + k, first + t, c] = (B^T d B)[j, k] of every tile t and channel c
    of `image` (H, W, C), channels innermost, at alpha = 6: d the 6 x 6 block
    at (ty*m - pad_h, tx*m - pad_w) (m = 4: F(4x4, 3x3); 2: F(2x2, 5x5))."""
    channels = image.shape[2]
    for ty in prange(tiles_h):
        block = np.empty((6, 6, channels), np.float32)
        rows = np.empty((6, 6, channels), np.float32)
        for tx in range(tiles_w):
            t = first + ty * tiles_w + tx
            _gather_block(image, ty * m - pad_h, tx * m - pad_w, block)
            for col in range(6):                  # rows[:, col] = B^T block[:, col]
                _bt6(block[0, col], block[1, col], block[2, col], block[3, col], block[4, col], block[5, col],
                     rows[0, col], rows[1, col], rows[2, col], rows[3, col], rows[4, col], rows[5, col], channels)
            for j in range(6):                    # V[6j:6j + 6] = B^T rows[j]
                _bt6(rows[j, 0], rows[j, 1], rows[j, 2], rows[j, 3], rows[j, 4], rows[j, 5],
                     v[6 * j, t], v[6 * j + 1, t], v[6 * j + 2, t], v[6 * j + 3, t], v[6 * j + 4, t],
                     v[6 * j + 5, t], channels)


@parallel_kernel
def _input_channels_a4(image, pad_h, pad_w, m, tiles_h, tiles_w, v, first):
    """As _input_channels, at alpha = 4 (F(2x2, 3x3), m = 2): V[4j + k,
    first + t, c] from the 4 x 4 block at (ty*2 - pad_h, tx*2 - pad_w)."""
    channels = image.shape[2]
    for ty in prange(tiles_h):
        block = np.empty((4, 4, channels), np.float32)
        rows = np.empty((4, 4, channels), np.float32)
        for tx in range(tiles_w):
            t = first + ty * tiles_w + tx
            _gather_block(image, ty * 2 - pad_h, tx * 2 - pad_w, block)
            for col in range(4):
                _bt4(block[0, col], block[1, col], block[2, col], block[3, col],
                     rows[0, col], rows[1, col], rows[2, col], rows[3, col], channels)
            for j in range(4):
                _bt4(rows[j, 0], rows[j, 1], rows[j, 2], rows[j, 3],
                     v[4 * j, t], v[4 * j + 1, t], v[4 * j + 2, t], v[4 * j + 3, t], channels)


@kernel
def _put_tile(done, ty, tx, bias, has_bias, slope, has_relu, out):
    """A tile's m x m output vectors done (m, m, O) into out (O, OH, OW) at
    (ty*m, tx*m), with the bias and the ReLU as _finish_tiles; the part of
    an overhanging tile inside the output only."""
    m, outputs = done.shape[0], done.shape[2]
    out_h, out_w = out.shape[1], out.shape[2]
    for i in range(m):
        y = ty * m + i
        if y >= out_h:
            break
        for j in range(m):
            x = tx * m + j
            if x >= out_w:
                break
            values = done[i, j]
            for o in range(outputs):
                value = values[o]
                if has_bias:
                    value += bias[o]
                out[o, y, x] = relu_value(value, slope) if has_relu else value


@parallel_kernel
def _output_channels(product, variant, first, tiles_h, tiles_w, bias, has_bias, slope, has_relu, out):
    """out (O, OH, OW) of one image from M = product[:, first:] (alpha^2,
    tiles, O), channels innermost: Y = A^T M A per tile as O-long vectors,
    then _put_tile. variant as _output_tiles's."""
    m = 4 if variant == 1 else 2
    alpha = 4 if variant == 0 else 6
    outputs = out.shape[0]
    for ty in prange(tiles_h):
        half = np.empty((m, alpha, outputs), np.float32)
        done = np.empty((m, m, outputs), np.float32)
        for tx in range(tiles_w):
            t = first + ty * tiles_w + tx
            for col in range(alpha):              # half[:, col] = A^T M[col::alpha]
                m0, m1 = product[col, t], product[alpha + col, t]
                m2, m3 = product[2 * alpha + col, t], product[3 * alpha + col, t]
                if variant == 0:
                    _at2(m0, m1, m2, m3, half[0, col], half[1, col], outputs)
                    continue
                m4, m5 = product[4 * alpha + col, t], product[5 * alpha + col, t]
                if variant == 1:
                    _at4(m0, m1, m2, m3, m4, m5, half[0, col], half[1, col], half[2, col], half[3, col], outputs)
                else:
                    _at25(m0, m1, m2, m3, m4, m5, half[0, col], half[1, col], outputs)
            for i in range(m):                    # done[i] = A^T half[i]
                h = half[i]
                if variant == 0:
                    _at2(h[0], h[1], h[2], h[3], done[i, 0], done[i, 1], outputs)
                elif variant == 1:
                    _at4(h[0], h[1], h[2], h[3], h[4], h[5], done[i, 0], done[i, 1], done[i, 2], done[i, 3],
                         outputs)
                else:
                    _at25(h[0], h[1], h[2], h[3], h[4], h[5], done[i, 0], done[i, 1], outputs)
            _put_tile(done, ty, tx, bias, has_bias, slope, has_relu, out)


# --- the transforms' twins (cct.devices.jit): the same formulas on whole arrays ------------------------
# Each value goes through the kernels' expressions step by step, in their
# order and grouping (float32 constants; a product's operands swapped is the
# same product), so the same float32 operations: the same bits. Every tile
# and channel at once, each step into an array made once (a temporary per
# operation cost more than the arithmetic); the block axes first: d
# (alpha, alpha, ...) -> V (alpha, alpha, ...); M (alpha, alpha, ...) -> Y
# (m, m, ...).
def _bt_into(d, r, scratch):
    """r[k] = (B^T d)[k] (_bt6, _bt4) of the alpha arrays d, each over any
    shape, `scratch` one of that shape."""
    if len(d) == 4:
        a0, a1, a2, a3 = d
        np.subtract(a0, a2, out=r[0])
        np.add(a1, a2, out=r[1])
        np.subtract(a2, a1, out=r[2])
        np.subtract(a1, a3, out=r[3])
        return
    a0, a1, a2, a3, a4, a5 = d
    for target, (four, five, plus) in ((r[0], (a0, a2, a4)), (r[5], (a1, a3, a5))):    # 4 x - 5 y + z
        np.multiply(_4, four, out=target)
        np.multiply(_5, five, out=scratch)
        target -= scratch
        target += plus
    np.add(a1, a2, out=r[1])                  # -4 (a1 + a2) + a3 + a4
    r[1] *= -_4
    r[1] += a3
    r[1] += a4
    np.subtract(a1, a2, out=r[2])             # 4 (a1 - a2) - a3 + a4
    r[2] *= _4
    r[2] -= a3
    r[2] += a4
    for target, (x, y) in ((r[3], (a3, a1)), (r[4], (a1, a3))):   # (x - y) 2 - a2 + a4
        np.subtract(x, y, out=target)
        target *= _2
        target -= a2
        target += a4


def _at_into(m, r, variant, scratch):
    """r[k] = (A^T m)[k] (_at2, _at4, _at25 by variant) of the alpha arrays m."""
    if variant == 0:
        m0, a1, a2, m3 = m
        np.add(m0, a1, out=r[0])
        r[0] += a2
        np.subtract(a1, a2, out=r[1])
        r[1] -= m3
        return
    a0, a1, a2, a3, a4, a5 = m
    np.add(a0, a1, out=r[0])                  # a0 + a1 + a2 + a3 + a4
    for term in (a2, a3, a4):
        r[0] += term
    np.subtract(a1, a2, out=r[1])             # a1 - a2 + (a3 - a4) 2 [+ a5]
    np.subtract(a3, a4, out=scratch)
    scratch *= _2
    r[1] += scratch
    if variant == 2:
        r[1] += a5
        return
    np.add(a1, a2, out=r[2])                  # a1 + a2 + 4 (a3 + a4)
    np.add(a3, a4, out=scratch)
    np.multiply(_4, scratch, out=scratch)
    r[2] += scratch
    np.subtract(a1, a2, out=r[3])             # a1 - a2 + 8 (a3 - a4) + a5
    np.subtract(a3, a4, out=scratch)
    np.multiply(_8, scratch, out=scratch)
    r[3] += scratch
    r[3] += a5


def _input_values(blocks, done):
    """done (alpha, alpha, ...)[j, k] = (B^T d B)[j, k] of the blocks (alpha,
    alpha, ...) (any strides): B^T down each column first, then along each
    row, as the kernels."""
    alpha = blocks.shape[0]
    rows = np.empty(blocks.shape, np.float32)                          # rows[r, col]
    scratch = np.empty(blocks.shape[1:], np.float32)
    _bt_into([blocks[i] for i in range(alpha)], rows, scratch)
    _bt_into([rows[:, col] for col in range(alpha)], [done[:, k] for k in range(alpha)], scratch)


def _output_values(product, variant):
    """(m, m, ...) Y = A^T M A from product (alpha^2, ...): A^T down each column
    of M first (half), then along each row of half, as the kernels."""
    alpha, m = (4, 2) if variant == 0 else (6, 4 if variant == 1 else 2)
    blocks = product.reshape((alpha, alpha) + product.shape[1:])      # [i, col]
    half = np.empty((m,) + blocks.shape[1:], np.float32)             # [r, col]
    scratch = np.empty(blocks.shape[1:], np.float32)
    _at_into([blocks[i] for i in range(alpha)], half, variant, scratch)
    done = np.empty((m, m) + blocks.shape[2:], np.float32)
    _at_into([half[:, col] for col in range(alpha)], [done[:, j] for j in range(m)], variant, scratch[:m])
    return done


def _padded_blocks(image, pad_h, pad_w, m, tiles_h, tiles_w, alpha):
    """(alpha, alpha, tiles_h, tiles_w, C) view of the image (H, W, C) copied
    into a zero frame: each tile's alpha x alpha block at (ty*m - pad_h,
    tx*m - pad_w)."""
    height, width, channels = image.shape
    plane = np.zeros(((tiles_h - 1) * m + alpha, (tiles_w - 1) * m + alpha, channels), np.float32)
    rows, cols = min(height, plane.shape[0] - pad_h), min(width, plane.shape[1] - pad_w)
    plane[pad_h:pad_h + rows, pad_w:pad_w + cols] = image[:rows, :cols]
    s0, s1, s2 = plane.strides
    return np.lib.stride_tricks.as_strided(plane, (alpha, alpha, tiles_h, tiles_w, channels),
                                           (s0, s1, m * s0, m * s1, s2), writeable=False)


def _input_tiles_twin(image, pad_h, pad_w, m, tiles_h, tiles_w, v, first):
    """_input_a6 and _input_a4: V[:, :, first:] (alpha^2, C, tiles)."""
    alpha = int(round(v.shape[0] ** 0.5))
    blocks = _padded_blocks(image.transpose(1, 2, 0), pad_h, pad_w, m, tiles_h, tiles_w, alpha)
    done = np.empty((alpha, alpha, image.shape[0], tiles_h, tiles_w), np.float32)
    _input_values(blocks.transpose(0, 1, 4, 2, 3), done)
    v[:, :, first:first + tiles_h * tiles_w] = done.reshape(alpha * alpha, image.shape[0], -1)


def _input_channels_twin(image, pad_h, pad_w, m, tiles_h, tiles_w, v, first):
    """_input_channels and _input_channels_a4: V[:, first:] (alpha^2, tiles, C)."""
    alpha = int(round(v.shape[0] ** 0.5))
    blocks = _padded_blocks(image, pad_h, pad_w, m, tiles_h, tiles_w, alpha)
    done = np.empty(blocks.shape, np.float32)
    _input_values(blocks, done)
    v[:, first:first + tiles_h * tiles_w] = done.reshape(alpha * alpha, tiles_h * tiles_w, -1)


_input_a6.twin(_input_tiles_twin)
_input_a4.twin(_input_tiles_twin)
_input_channels.twin(_input_channels_twin)
_input_channels_a4.twin(_input_channels_twin)


def _finished(done, tiles_h, tiles_w, bias, has_bias, slope, has_relu, out, outputs_axis):
    """out (O, OH, OW) from done (m, m, ...) of one image, O at outputs_axis
    (2 or 3) and the tiles at the other: the bias added, then the ReLU (as
    _finish_tiles and _put_tile), the tiles put in place."""
    m = done.shape[0]
    if has_bias:
        done += bias.reshape((-1, 1) if outputs_axis == 2 else (1, -1))
    if has_relu:
        relu_values(done, slope)
    if outputs_axis == 3:
        done = done.transpose(0, 1, 3, 2)                     # (m, m, O, tiles)
    out_h, out_w = out.shape[1], out.shape[2]
    whole = done.reshape(m, m, -1, tiles_h, tiles_w).transpose(2, 3, 0, 4, 1)
    out[...] = whole.reshape(-1, tiles_h * m, tiles_w * m)[:, :out_h, :out_w]


@_output_tiles.twin
def _output_tiles_twin(product, variant, first, tiles_h, tiles_w, bias, has_bias, slope, has_relu, out):
    done = _output_values(product[:, :, first:first + tiles_h * tiles_w], variant)     # (m, m, O, tiles)
    _finished(done, tiles_h, tiles_w, bias, has_bias, slope, has_relu, out, 2)


@_output_channels.twin
def _output_channels_twin(product, variant, first, tiles_h, tiles_w, bias, has_bias, slope, has_relu, out):
    done = _output_values(product[:, first:first + tiles_h * tiles_w], variant)        # (m, m, tiles, O)
    _finished(done, tiles_h, tiles_w, bias, has_bias, slope, has_relu, out, 3)


# (m, r) -> the tiles-innermost input transform (by alpha) and _output_tiles's variant
_INPUT = {(2, 3): _input_a4, (4, 3): _input_a6, (2, 5): _input_a6}
_OUTPUT = {(2, 3): 0, (4, 3): 1, (2, 5): 2}


# --- a forward --------------------------------------------------------------------------------------
def tile_counts(geom: ConvGeometry, m: int) -> Tuple[int, int]:
    return -(-geom.out_h // m), -(-geom.out_w // m)


def _alpha(geom: ConvGeometry, m: int) -> int:
    return m + geom.kernel_h - 1


def block_images(geom: ConvGeometry, m: int, batch: int) -> int:
    """Images transformed together: enough for BLOCK_COLUMNS tiles, as few as
    keep V and M of the block within BLOCK_BYTES (at least one)."""
    tiles_h, tiles_w = tile_counts(geom, m)
    per_image = tiles_h * tiles_w
    alpha = _alpha(geom, m)
    bytes_per_image = alpha * alpha * (geom.channels + geom.num_output) * per_image * 4
    wanted = -(-BLOCK_COLUMNS // per_image)
    fits = max(1, BLOCK_BYTES // bytes_per_image)
    return int(max(1, min(batch, wanted, fits)))


def slot_bytes(geom: ConvGeometry, m: int, batch: int) -> Dict[str, int]:
    """{slot: bytes} one forward asks its workspace for."""
    tiles_h, tiles_w = tile_counts(geom, m)
    columns = block_images(geom, m, batch) * tiles_h * tiles_w
    alpha2 = _alpha(geom, m) ** 2
    slots = {"winograd_input": alpha2 * geom.channels * columns * 4,
             "winograd_product": alpha2 * geom.num_output * columns * 4}
    if channels_inner(geom, m):
        slots["winograd_image"] = geom.in_h * geom.in_w * geom.channels * 4
    return slots


def forward(x: Float32Array, u: Float32Array, geom: ConvGeometry, m: int, out: Optional[FloatArray] = None,
            ws: Workspace = FRESH, bias: Optional[FloatArray] = None, relu: Optional[float] = None) -> FloatArray:
    """y (N, O, OH, OW) = conv(x, w) + bias, then a ReLU of negative slope
    `relu` when given, by F(m x m, r x r) (r the kernel's size) from U in
    this shape's layout (weights_for(w, geom, m), TransformedWeights.get)."""
    n = x.shape[0]
    y = np.empty(geom.output_shape(n), x.dtype) if out is None else out
    x = np.ascontiguousarray(x)
    has_bias = bias is not None
    bias_values = (np.ascontiguousarray(weights_as(cast(FloatArray, bias), np.float32)) if has_bias
                   else np.zeros(0, np.float32))
    slope = np.float32(relu or 0)
    step = block_images(geom, m, n)
    ws.plan(slot_bytes(geom, m, step))
    run = _forward_channels if channels_inner(geom, m) else _forward_tiles
    run(x, u, geom, m, y, ws, step, bias_values, has_bias, slope, relu is not None)
    return y


def _forward_tiles(x: Float32Array, u: Float32Array, geom: ConvGeometry, m: int, y: FloatArray, ws: Workspace,
                   step: int, bias: Float32Array, has_bias: bool, slope: np.float32, has_relu: bool) -> None:
    """forward() tiles innermost: V (alpha^2, C, tiles), M (alpha^2, O,
    tiles) = U @ V per group, U (alpha^2, O, C/group)."""
    n, alpha2 = x.shape[0], _alpha(geom, m) ** 2
    variant = (m, geom.kernel_h)
    transform_input, output_variant = _INPUT[variant], _OUTPUT[variant]
    tiles_h, tiles_w = tile_counts(geom, m)
    per_image = tiles_h * tiles_w
    cg, og = geom.channels_per_group, geom.outputs_per_group
    for start in range(0, n, step):
        images = min(step, n - start)
        columns = images * per_image
        v = ws.empty("winograd_input", (alpha2, geom.channels, columns), np.float32)
        product = ws.empty("winograd_product", (alpha2, geom.num_output, columns), np.float32)
        for k in range(images):
            transform_input(x[start + k], geom.pad_h, geom.pad_w, m, tiles_h, tiles_w, v, k * per_image)
        for g in range(geom.group):
            stacked_matmul(u[:, g * og:(g + 1) * og], v[:, g * cg:(g + 1) * cg], product[:, g * og:(g + 1) * og])
        for k in range(images):
            _output_tiles(product, output_variant, k * per_image, tiles_h, tiles_w, bias, has_bias, slope, has_relu,
                          y[start + k])


def _forward_channels(x: Float32Array, u: Float32Array, geom: ConvGeometry, m: int, y: FloatArray, ws: Workspace,
                      step: int, bias: Float32Array, has_bias: bool, slope: np.float32, has_relu: bool) -> None:
    """forward() channels innermost: each image copied to (H, W, C), V
    (alpha^2, tiles, C), M (alpha^2, tiles, O) = V @ U per group, U
    (alpha^2, C/group, O)."""
    variant = (m, geom.kernel_h)
    transform_input, output_variant = _CHANNELS_INNER_INPUT[variant], _OUTPUT[variant]
    n, alpha2 = x.shape[0], _alpha(geom, m) ** 2
    tiles_h, tiles_w = tile_counts(geom, m)
    per_image = tiles_h * tiles_w
    cg, og = geom.channels_per_group, geom.outputs_per_group
    image = ws.empty("winograd_image", (geom.in_h, geom.in_w, geom.channels), np.float32)
    for start in range(0, n, step):
        images = min(step, n - start)
        columns = images * per_image
        v = ws.empty("winograd_input", (alpha2, columns, geom.channels), np.float32)
        product = ws.empty("winograd_product", (alpha2, columns, geom.num_output), np.float32)
        for k in range(images):
            np.copyto(image, x[start + k].transpose(1, 2, 0))
            transform_input(image, geom.pad_h, geom.pad_w, m, tiles_h, tiles_w, v, k * per_image)
        for g in range(geom.group):
            stacked_matmul(v[:, :, g * cg:(g + 1) * cg], u[:, :, g * og:(g + 1) * og],
                           product[:, :, g * og:(g + 1) * og])
        for k in range(images):
            _output_channels(product, output_variant, k * per_image, tiles_h, tiles_w, bias, has_bias, slope,
                             has_relu, y[start + k])


# (m, r) -> the channel-innermost input transform of F(m x m, r x r) (the output's variant: _OUTPUT)
_CHANNELS_INNER_INPUT = {(2, 3): _input_channels_a4, (4, 3): _input_channels, (2, 5): _input_channels}
