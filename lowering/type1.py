"""Lowering type 1: expensive lowering, trivial lifting (im2col over the batch).

Shapes per group g (Cg = C/group, Og = O/group, M = N*OH*OW):

    lowered data   D1  (Cg*KH*KW, M)       row (c, i, j), column (n, oh, ow):
                                           D1[(c,i,j), (n,oh,ow)] = xpad[n, c, oh*sh + i*dh, ow*sw + j*dw]
    kernel matrix  K1  (Og, Cg*KH*KW)      w reshaped, no copy
    GEMM           Y   = K1 @ D1  (Og, M)  one call per group over the whole batch
    lifting        Y (O, N, OH, OW) -> y (N, O, OH, OW), a transpose

Backward: dK1 = dY @ D1^T; dD1 = K1^T @ dY (into D1's buffer) then col2im
(KH*KW strided slice sums).

Column order: (n, oh, ow) as above when the output rows are long; for
narrow outputs (OW < BATCH_INNER_WIDTH) the columns run (oh, ow, n) instead,
the batch innermost ("batch-inner"): the padded input is then (C, Hp, Wp, N),
so every lowering copy and col2im add moves rows of OW*N (stride 1) or N
contiguous values instead of OW-long ones. numpy pays a fixed cost per inner
row, which dominated these passes on 8- to 13-pixel-wide images. The price
is that the input, output and gradients are transposed to and from
batch-innermost, four activation-sized copies instead of the
KH*KW-times-larger strided ones they speed up.

For few lowered rows on large images (image_major: LeNet's conv1, 1 -> 20
channels 5x5 on 28x28) the columns run (n, oh, ow) with the images outermost
and the rows inside each image, the lowered matrix (N, C*KH*KW, OH*OW): one
small GEMM per image then reads its image's columns while they are in cache
and writes (N, O, OH*OW), the output's own layout, so neither the output nor
its gradient is transposed. One GEMM over the whole batch streamed the lowered
matrix and the product through memory at a third of the rate.

The timings behind these layouts and kernels: BENCHMARKS.md, "Lowering type 1's
layouts and kernels".

Hp, Wp: the padded frame, geom.padded_h x geom.padded_w (padding plus any
overrun of the last window, see cct.lowering.geometry).

Workspace slots (see cct.lowering.chunking): "padded" (C, N, Hp, Wp),
(C, Hp, Wp, N) or (N, C, Hp, Wp), "lowered" D1, "product" Y (image-major:
the per-image weight gradients, Kg <= OH*OW), "output" dY channels first.
"""
from typing import Callable, List, Optional, Tuple, cast

import numpy as np
import numpy.typing as npt

from cct.core.arrays import FloatArray
from cct.core.workspace import FRESH, Workspace
from cct.devices import pool
from cct.devices.blas import blas_limited, sgemm64
from cct.devices.jit import kernel, parallel_kernel, prange

from .geometry import (ConvGeometry, channels_first_output, finish, gemm_into, lowered_shape, matmul_nt,
                       pad_channels_first, relu_value, relu_values, stacked_matmul, store_relu, unpad_channels_first,
                       weights_as, window_view)


def _channels_first(x: FloatArray, geom: ConvGeometry, ws: Workspace) -> FloatArray:
    """x as (C, N, Hp, Wp): padded in the workspace where it has a border,
    else a view of the input as is."""
    if geom.has_border:
        return pad_channels_first(x, geom, out=ws.empty("padded", (geom.channels, x.shape[0], geom.padded_h,
                                                                   geom.padded_w), x.dtype))
    return x.transpose(1, 0, 2, 3)


def _windows(x: FloatArray, geom: ConvGeometry, ws: Workspace) -> FloatArray:
    """The read-only window view (C, KH, KW, N, OH, OW) of x, padded in the
    workspace where it has a border."""
    return window_view(_channels_first(x, geom, ws), geom)


def lower(x: FloatArray, geom: ConvGeometry, out: Optional[FloatArray] = None, ws: Workspace = FRESH) -> FloatArray:
    """im2col of a whole batch: x (N, C, H, W) -> (C*KH*KW, N*OH*OW)."""
    n = x.shape[0]
    xp = _channels_first(x, geom, ws)
    shape = lowered_shape(geom, n)
    cols = ws.empty("lowered", shape, x.dtype) if out is None else out.reshape(shape)
    if n == 1 and geom.stride_w == geom.dilation_h == geom.dilation_w == 1 and xp.flags.c_contiguous:
        # (no window view: numpy's as_strided costs 5 us a call, and this loop reads xp itself)
        _lower_one_image(xp, geom.kernel_h, geom.kernel_w, geom.stride_h, geom.out_h, geom.out_w,
                         cols.reshape(-1, geom.out_h * geom.out_w))
    else:
        np.copyto(cols, window_view(xp, geom))                   # the one lowering copy
    return cols.reshape(geom.channels * geom.kernel_h * geom.kernel_w, n * geom.out_h * geom.out_w)


@parallel_kernel
def _lower_one_image(xp, kernel_h, kernel_w, stride_h, out_h, out_w, cols):
    """cols[(c, i, j), (oh, ow)] = xp[c, 0, oh*stride_h + i, ow + j]: one
    image's lowering at stride 1 along the width, no dilation: numpy's
    strided copy pays per inner row, and one image's rows are short. The
    plane view is taken once per channel, not per kernel offset."""
    for c in prange(xp.shape[0]):
        plane = xp[c, 0]
        for i in range(kernel_h):
            for j in range(kernel_w):
                row = cols[(c * kernel_h + i) * kernel_w + j]
                k = 0
                for y in range(out_h):
                    source = plane[y * stride_h + i]
                    for x in range(out_w):
                        row[k + x] = source[j + x]
                    k += out_w


@_lower_one_image.twin
def _lower_one_image_twin(xp, kernel_h, kernel_w, stride_h, out_h, out_w, cols):
    """_lower_one_image as one strided copy per kernel offset (a copy: the same values)."""
    channels, offsets = xp.shape[0], kernel_h * kernel_w
    for i in range(kernel_h):
        for j in range(kernel_w):
            rows = cols[i * kernel_w + j:channels * offsets:offsets].reshape(channels, out_h, out_w)
            rows[...] = xp[:, 0, i:i + stride_h * (out_h - 1) + 1:stride_h, j:j + out_w]


def col2im(cols: FloatArray, geom: ConvGeometry, batch: int, out: Optional[FloatArray] = None,
           ws: Workspace = FRESH) -> FloatArray:
    """Adjoint of `lower`: (C*KH*KW, N*OH*OW) -> (N, C, H, W), summing overlaps."""
    cols = cols.reshape(lowered_shape(geom, batch))
    dxp = ws.zeros("padded", (geom.channels, batch, geom.padded_h, geom.padded_w), cols.dtype)
    for i in range(geom.kernel_h):
        for j in range(geom.kernel_w):
            dxp[:, :, geom.rows(i), geom.cols(j)] += cols[:, i, j]
    return unpad_channels_first(dxp, geom, out)


BATCH_INNER_WIDTH = 32      # outputs narrower than this use the batch-inner column order


def batch_inner(geom: ConvGeometry, batch: int) -> bool:
    """Whether type 1 orders its columns (oh, ow, n) for this geometry and batch:
    for narrow outputs whose lowered matrix is much larger than the output
    (C*KH*KW >= 4*O: the strided output transpose would cost more than the
    lowering saves otherwise, as on LeNet conv1), when that makes the copies'
    rows (OW*N at stride 1, N otherwise) at least twice as long as OW."""
    if geom.out_w >= BATCH_INNER_WIDTH or geom.channels * geom.kernel_h * geom.kernel_w < 4 * geom.num_output:
        return False
    row = batch * geom.out_w if geom.stride_w == 1 else batch
    return row >= 2 * geom.out_w


# Back from the batch-inner layout, numpy's strided copy reads one value per
# cache line; this loop goes by 16 x 16 tiles, a cache line each way. (Into
# the layout, numpy's copy is as fast as a tiled loop, and stays.)
TILE = 16


@kernel
def _to_batch_first(source, row0, col0, bias, relu, slope, out):
    """out[n, c, h, w] = source[c, row0 + h, col0 + w, n] (+ bias[c] when bias
    has C entries; an empty bias adds nothing), then, if relu, a ReLU of
    negative slope `slope` (as geometry.finish's): out (N, C, H, W)."""
    batch, channels, height, width = out.shape
    for c in range(channels):
        for h in range(height):
            for w0 in range(0, width, TILE):
                for n0 in range(0, batch, TILE):
                    for w in range(w0, min(w0 + TILE, width)):
                        for n in range(n0, min(n0 + TILE, batch)):
                            v = source[c, row0 + h, col0 + w, n]
                            if bias.shape[0]:
                                v = v + bias[c]
                            out[n, c, h, w] = relu_value(v, slope) if relu else v


@_to_batch_first.twin
def _to_batch_first_twin(source, row0, col0, bias, relu, slope, out):
    batch, channels, height, width = out.shape
    values = source[:, row0:row0 + height, col0:col0 + width, :batch].transpose(3, 0, 1, 2)
    values = values + bias.reshape(1, -1, 1, 1) if bias.shape[0] else values.copy()
    out[...] = relu_values(values, slope) if relu else values


def _batch_first(source: FloatArray, row0: int, col0: int, shape: Tuple[int, ...], out: Optional[FloatArray],
                 bias: Optional[FloatArray] = None, relu: Optional[float] = None) -> FloatArray:
    """(N, C, H, W) `shape` from the batch-inner `source`, into `out` (new when
    None; a non-contiguous one is filled through a copy), + bias, then a ReLU
    of negative slope `relu` (None: none)."""
    target = out if out is not None and out.flags.c_contiguous else np.empty(shape, source.dtype)
    bias = np.empty(0, source.dtype) if bias is None else np.ascontiguousarray(weights_as(bias, source.dtype))
    _to_batch_first(source, row0, col0, bias, relu is not None, source.dtype.type(relu or 0), target)
    if out is not None and target is not out:
        out[...] = target
        return out
    return target


def pad_batch_inner(x: FloatArray, geom: ConvGeometry, out: FloatArray) -> FloatArray:
    """x (N, C, H, W) -> padded, batch innermost (C, Hp, Wp, N); `out` may hold
    garbage: only its border is zeroed."""
    ph, pw, h, w = geom.pad_h, geom.pad_w, geom.in_h, geom.in_w
    out[:, :ph] = 0                           # each border is empty when there is none
    out[:, ph + h:] = 0
    out[:, ph:ph + h, :pw] = 0
    out[:, ph:ph + h, pw + w:] = 0
    out[:, ph:ph + h, pw:pw + w] = x.transpose(1, 2, 3, 0)
    return out


def _window_batch_inner(xp: FloatArray, geom: ConvGeometry) -> FloatArray:
    """Read-only view of xp (C, Hp, Wp, N) as the lowered (C, KH, KW, OH, OW, N)."""
    sc, sh, sw, sn = xp.strides
    shape = (geom.channels, geom.kernel_h, geom.kernel_w, geom.out_h, geom.out_w, xp.shape[3])
    strides = (sc, sh * geom.dilation_h, sw * geom.dilation_w, sh * geom.stride_h, sw * geom.stride_w, sn)
    return np.lib.stride_tricks.as_strided(xp, shape, strides, writeable=False)


def _lower_batch_inner(x: FloatArray, geom: ConvGeometry, ws: Workspace) -> FloatArray:
    """x (N, C, H, W) -> (C*KH*KW, OH*OW*N)."""
    n = x.shape[0]
    xp = pad_batch_inner(x, geom, ws.empty("padded", (geom.channels, geom.padded_h, geom.padded_w, n), x.dtype))
    view = _window_batch_inner(xp, geom)
    cols = ws.empty("lowered", view.shape, x.dtype)
    np.copyto(cols, view)
    return cols.reshape(geom.channels * geom.kernel_h * geom.kernel_w, -1)


@kernel
def _add_windows_batch_inner(cols, stride_h, stride_w, dilation_h, dilation_w, dxp):
    """dxp (C, Hp, Wp, N) += each window's column of cols (C, KH, KW, OH, OW, N),
    N values at a time, each cell's sum in Caffe's order (kernel offset, then
    output position); compiled, as numpy's KH*KW strided adds were slower
    (the batch-inner im2col was not, and stays numpy)."""
    channels, kernel_h, kernel_w, out_h, out_w, batch = cols.shape
    for c in range(channels):
        for i in range(kernel_h):
            for j in range(kernel_w):
                for oh in range(out_h):
                    row = oh * stride_h + i * dilation_h
                    for ow in range(out_w):
                        col = ow * stride_w + j * dilation_w
                        for n in range(batch):
                            dxp[c, row, col, n] += cols[c, i, j, oh, ow, n]


# Images below which col2im at stride_w 1 adds whole output rows of OW*N
# values (_add_window_rows_batch_inner) instead of N at a time: the N-long
# loops vectorise from 8 values up (BENCHMARKS.md, "Behind lowering/type1.py").
ROWS_BELOW_BATCH = 8


@kernel
def _add_window_rows_batch_inner(cols, stride_h, dilation_h, column_step, dxp):
    """_add_windows_batch_inner at stride_w 1: for each window offset and
    output row, the row's OW*N values of cols (C, KH, KW, OH, OW*N) are one
    contiguous run of dxp's row (C, Hp, Wp*N), starting column_step (dilation_w
    * N) values further for each kernel column, added in one loop. The same
    adds in the same order per cell, so the same numbers."""
    channels, kernel_h, kernel_w, out_h, span = cols.shape
    for c in range(channels):
        for i in range(kernel_h):
            for j in range(kernel_w):
                offset = j * column_step
                for oh in range(out_h):
                    target = dxp[c, oh * stride_h + i * dilation_h]
                    source = cols[c, i, j, oh]
                    for t in range(span):
                        target[offset + t] += source[t]


def _col2im_batch_inner(cols: FloatArray, geom: ConvGeometry, batch: int, out: Optional[FloatArray],
                        ws: Workspace) -> FloatArray:
    """Adjoint of _lower_batch_inner: (C*KH*KW, OH*OW*N) -> (N, C, H, W)."""
    cols = cols.reshape(geom.channels, geom.kernel_h, geom.kernel_w, geom.out_h, geom.out_w, batch)
    dxp = ws.zeros("padded", (geom.channels, geom.padded_h, geom.padded_w, batch), cols.dtype)
    if geom.stride_w == 1 and batch < ROWS_BELOW_BATCH:
        _add_window_rows_batch_inner(np.ascontiguousarray(cols).reshape(cols.shape[:4] + (-1,)), geom.stride_h,
                                     geom.dilation_h, geom.dilation_w * batch, dxp.reshape(dxp.shape[:2] + (-1,)))
    else:
        _add_windows_batch_inner(np.ascontiguousarray(cols), geom.stride_h, geom.stride_w, geom.dilation_h,
                                 geom.dilation_w, dxp)
    return _batch_first(dxp, geom.pad_h, geom.pad_w, geom.input_shape(batch), out)


IMAGE_MAJOR_ROWS = 64      # lowered rows per group up to which a GEMM per image pays ...
IMAGE_MAJOR_PIXELS = 256   # ... on output planes of at least this many pixels


def image_major(geom: ConvGeometry, batch: int) -> bool:
    """Whether type 1 lowers image by image, (N, C*KH*KW, OH*OW): few lowered
    rows per group (the one batch-wide GEMM is then bound by memory, not by
    arithmetic) on an output plane wide enough for a GEMM per image (and at
    least as wide as those rows, which bounds the per-image weight gradients
    by the product slot), unless the batch-inner order is in use."""
    rows = geom.channels_per_group * geom.kernel_h * geom.kernel_w
    pixels = geom.out_h * geom.out_w
    return rows <= IMAGE_MAJOR_ROWS and pixels >= max(IMAGE_MAJOR_PIXELS, rows) and not batch_inner(geom, batch)


def _image_major_windows(x: FloatArray, geom: ConvGeometry, ws: Workspace) -> Tuple[FloatArray, FloatArray]:
    """(the read-only window view (N, C, KH, KW, OH, OW) of x, the workspace's
    lowered store of that shape)."""
    n = x.shape[0]
    xp = x.transpose(1, 0, 2, 3)                                  # (C, N, H, W), a view
    if geom.has_border:   # the padded frame stored image-major (N, C, Hp, Wp), filled through its (C, N) view
        frame = ws.empty("padded", (n, geom.channels, geom.padded_h, geom.padded_w), x.dtype)
        xp = pad_channels_first(x, geom, out=frame.transpose(1, 0, 2, 3))
    view = window_view(xp, geom).transpose(3, 0, 1, 2, 4, 5)
    return view, ws.empty("lowered", view.shape, x.dtype)


def _lower_image_major(x: FloatArray, geom: ConvGeometry, ws: Workspace) -> FloatArray:
    """x (N, C, H, W) -> (N, C*KH*KW, OH*OW)."""
    view, cols = _image_major_windows(x, geom, ws)
    np.copyto(cols, view)
    return cols.reshape(x.shape[0], -1, geom.out_h * geom.out_w)


def _col2im_image_major(cols: FloatArray, geom: ConvGeometry, batch: int, out: Optional[FloatArray],
                        ws: Workspace) -> FloatArray:
    """Adjoint of _lower_image_major: (N, C*KH*KW, OH*OW) -> (N, C, H, W)."""
    cols = cols.reshape(batch, geom.channels, geom.kernel_h, geom.kernel_w, geom.out_h, geom.out_w)
    dxp = ws.zeros("padded", (batch, geom.channels, geom.padded_h, geom.padded_w), cols.dtype)
    for i in range(geom.kernel_h):
        for j in range(geom.kernel_w):
            dxp[:, :, geom.rows(i), geom.cols(j)] += cols[:, :, i, j]
    inner = dxp[:, :, geom.pad_h:geom.pad_h + geom.in_h, geom.pad_w:geom.pad_w + geom.in_w]
    if out is None:
        return np.array(inner)
    out[...] = inner
    return out


# Lowered and output bytes per step of an image-major forward: the step's
# images are lowered, multiplied and finished while their rows are in the L2
# cache (BENCHMARKS.md, "Session 10: per-layer costs, kept fused passes, Winograd channels innermost").
IMAGE_MAJOR_STEP_BYTES = 3 << 19


def _forward_image_major(x: FloatArray, w: FloatArray, geom: ConvGeometry, out: Optional[FloatArray], ws: Workspace,
                         bias: Optional[FloatArray], relu: Optional[float]) -> FloatArray:
    """y (N, O, OH, OW), one GEMM per image and group written in place (+ bias),
    in steps of a few images (IMAGE_MAJOR_STEP_BYTES): each image's numbers
    are those of one whole-batch pass. The lowering is kept whole for the
    backward's weight gradient (cct.lowering.kept)."""
    n, pixels = x.shape[0], geom.out_h * geom.out_w
    view, cols = _image_major_windows(x, geom, ws)
    lowered = cols.reshape(n, geom.group, -1, pixels)
    out = np.empty(geom.output_shape(n), x.dtype) if out is None else out
    direct = out.flags.c_contiguous and out.dtype == x.dtype
    target = out if direct else ws.empty("product", geom.output_shape(n), x.dtype)
    y = target.reshape(n, geom.group, geom.outputs_per_group, pixels)
    kernel = _kernel_matrix(w, geom, x.dtype)
    image_bytes = (lowered[0].size + y[0].size) * x.dtype.itemsize
    step = max(1, IMAGE_MAJOR_STEP_BYTES // image_bytes)
    for start in range(0, n, step):
        stop = min(n, start + step)
        np.copyto(cols[start:stop], view[start:stop])
        np.matmul(kernel, lowered[start:stop], out=y[start:stop])
        finish(target[start:stop], bias, relu)      # along the output's contiguous rows, still in cache
    if not direct:
        out[...] = target
    return out


def _backward_image_major(x: Optional[FloatArray], dy: FloatArray, w: Optional[FloatArray], geom: ConvGeometry,
                          data: bool, weights: bool, ws: Workspace, dx_out: Optional[FloatArray],
                          lowered: Optional[FloatArray]) -> Tuple[Optional[FloatArray], Optional[FloatArray]]:
    """(dx or None, dw or None) from dy (N, O, OH, OW) as it is: no transpose."""
    n, pixels = dy.shape[0], geom.out_h * geom.out_w
    dy_images = np.ascontiguousarray(dy).reshape(n, geom.group, geom.outputs_per_group, pixels)
    dw = dx = None
    if weights:
        lowered = (_lower_image_major(cast(FloatArray, x), geom, ws) if lowered is None else lowered).reshape(
            n, geom.group, -1, pixels)
        per_image = np.matmul(dy_images, lowered.swapaxes(-1, -2),
                              out=ws.empty("product", dy_images.shape[:3] + lowered.shape[2:3], dy.dtype))
        dw = per_image.sum(axis=0).reshape(geom.weight_shape)     # image after image, as Caffe sums them
    if data:
        kernel = _kernel_matrix(cast(FloatArray, w), geom, dy.dtype)
        dcols = np.matmul(kernel.transpose(0, 2, 1), dy_images,
                          out=ws.empty("lowered", (n, geom.group, kernel.shape[2], pixels), dy.dtype))
        dx = _col2im_image_major(dcols, geom, n, dx_out, ws)
    return dx, dw


# Lowered bytes per band of a one-image forward (forward_in_bands): within a
# core's L2 cache while the band's GEMM reads it; and the fewest GEMM columns a
# band may have: narrower GEMMs lost more than the cache won (BENCHMARKS.md,
# "Behind lowering/type1.py").
BAND_BYTES = 1 << 20
BAND_MIN_COLUMNS = 512


def band_rows(geom: ConvGeometry, batch: int, itemsize: int) -> int:
    """Output rows per band of a forward of one image in the columns order
    (n, oh, ow) (forward_in_bands), or 0: the forward lowers the image whole,
    where its lowered matrix fits one band or a band would be narrower than
    BAND_MIN_COLUMNS (many lowered rows: the GEMM, not the copy, dominates)."""
    if batch != 1 or batch_inner(geom, batch) or image_major(geom, batch):
        return 0
    row_bytes = geom.channels * geom.kernel_h * geom.kernel_w * geom.out_w * itemsize
    rows = max(1, BAND_BYTES // max(row_bytes, 1))
    return rows if rows < geom.out_h and rows * geom.out_w >= BAND_MIN_COLUMNS else 0


def band_pieces(geom: ConvGeometry, rows: int, threads: int) -> List[Tuple[int, int]]:
    """The output rows [top, stop) of each thread's piece of a forward in
    bands of `rows` on `threads` threads: the rows shared evenly, as many
    pieces as there are bands at most (one piece: the whole image)."""
    count = max(1, min(threads, -(-geom.out_h // rows)))
    edges = [geom.out_h * k // count for k in range(count + 1)]
    return list(zip(edges[:-1], edges[1:]))


def band_values(geom: ConvGeometry, rows: int) -> int:
    """Values of one band's lowered matrix."""
    return geom.channels * geom.kernel_h * geom.kernel_w * rows * geom.out_w


def forward_in_bands(x: FloatArray, w: FloatArray, geom: ConvGeometry, rows: int, out: FloatArray,
                     ws: Workspace = FRESH, bias: Optional[FloatArray] = None,
                     relu: Optional[float] = None, threads: int = 1) -> FloatArray:
    """One image's y (1, O, OH, OW) into `out` (C-contiguous), its lowered
    matrix made `rows` output rows at a time, each band multiplied into its
    columns of the output while it is in the L2 cache: faster than the whole
    matrix (7.4 MB for GoogLeNet's conv1) written to memory and read back
    (BENCHMARKS.md, "Session 11: Concat as views, conv1 in bands, LRN in
    Caffe's order, 2 x 2 pooling backward, col2im by rows"). The same
    products, summed in the same order where OpenBLAS runs the band's GEMM
    with the whole one's kernel (the zoo nets' outputs are bitwise the same;
    small GEMMs may differ in rounding). Keeps no lowering (a forward a
    backward follows lowers whole).

    A layer given several `threads`, on the one pool (cct.devices.pool),
    shares the rows among them (band_pieces): each thread lowers its own
    bands and multiplies them by one-thread GEMMs (_bands_on_pool), side by
    side, in one compiled call: such short products gain less from a GEMM
    on every thread, and the lowering's copies then run on every thread too
    (BENCHMARKS.md, "The first convolution's bands on every thread"): the
    one-piece path's values to float32 rounding (float32, one group)."""
    pieces = band_pieces(geom, rows, min(threads, pool.kernel_threads()))
    sgemm = sgemm64() if len(pieces) > 1 and geom.group == 1 and x.dtype == np.float32 else None
    if sgemm is None:
        pieces = [(0, geom.out_h)]
    stores = ws.empty("lowered", (len(pieces), band_values(geom, rows)), x.dtype)
    product = out.reshape(geom.group, geom.outputs_per_group, geom.out_h * geom.out_w)
    kernel = _kernel_matrix(w, geom, x.dtype)
    if sgemm is None:
        _bands(_windows(x, geom, ws), kernel, product, rows, 0, geom.out_h, stores[0])
    else:
        edges = np.array([top for top, _ in pieces] + [geom.out_h], np.int64)
        image = _channels_first(x, geom, ws)[:, 0]
        sizes = (geom.kernel_h, geom.kernel_w, geom.stride_h, geom.stride_w, geom.dilation_h, geom.dilation_w)
        with blas_limited(1):         # each GEMM on its own thread; the pool's count stays the pass's
            _bands_on_pool.parallel(image, kernel[0], product[0], *sizes, rows, edges, stores, sgemm)
    return finish(out, bias, relu)


def _bands(view: FloatArray, kernel: FloatArray, product: FloatArray, rows: int, top: int, stop: int,
           store: FloatArray) -> None:
    """Output rows [top, stop) of forward_in_bands, `rows` at a time, each
    band lowered from the window view (C, KH, KW, 1, OH, OW) into `store`
    (flat, a band's values) and multiplied into its columns of `product`
    (G, O/G, OH*OW)."""
    lowered, width = view.shape[0] * view.shape[1] * view.shape[2], view.shape[5]
    for start in range(top, stop, rows):
        end = min(stop, start + rows)
        band = store[:lowered * (end - start) * width].reshape(lowered, (end - start) * width)
        np.copyto(band.reshape(view.shape[:4] + (end - start, width)), view[..., start:end, :])
        np.matmul(kernel, band.reshape(product.shape[0], -1, band.shape[1]),
                  out=product[..., start * width:end * width])


@parallel_kernel
def _bands_on_pool(image, kernel, product, kernel_h, kernel_w, stride_h, stride_w, dilation_h, dilation_w,
                   rows, edges, stores, sgemm):
    """forward_in_bands on the pool: piece p (output rows edges[p] to
    edges[p + 1]) on thread p, each band of `rows` rows lowered from `image`
    (C, Hp, Wp, padded) into stores[p] as (C*KH*KW, rows*OW) and multiplied
    by `kernel` (O, C*KH*KW) into its columns of `product` (O, OH*OW)
    (gemm_into, at the BLAS count the caller set: one thread)."""
    out_w = product.shape[1] // edges[-1]
    for piece in prange(edges.shape[0] - 1):
        store = stores[piece]
        for start in range(edges[piece], edges[piece + 1], rows):
            end = min(edges[piece + 1], start + rows)
            columns = (end - start) * out_w
            for c in range(image.shape[0]):
                for i in range(kernel_h):
                    for y in range(start, end):
                        source = image[c, y * stride_h + i * dilation_h]
                        at = ((c * kernel_h + i) * kernel_w * columns) + (y - start) * out_w
                        for j in range(kernel_w):
                            # slices indexed by the loop's own counter: no negative-index checks
                            into = store[at + j * columns:at + j * columns + out_w]
                            taken = source[j * dilation_w:]
                            if stride_w == 2:     # a constant stride: the gather vectorises
                                for x in range(out_w):
                                    into[x] = taken[2 * x]
                            elif stride_w == 4:
                                for x in range(out_w):
                                    into[x] = taken[4 * x]
                            elif stride_w == 1:
                                for x in range(out_w):
                                    into[x] = taken[x]
                            else:
                                for x in range(out_w):
                                    into[x] = taken[x * stride_w]
            gemm_into(sgemm, kernel, store[:kernel.shape[1] * columns].reshape(kernel.shape[1], columns),
                      product[:, start * out_w:end * out_w])


# A bound one-image forward keeps buffers of its own up to this size: below
# it the call's Python (workspace, padding, checks) cost more than the GEMM.
BOUND_LOWERED_BYTES = 256 * 1024


def bind_one_image(x: FloatArray, w: FloatArray, geom: ConvGeometry,
                   out: FloatArray) -> Optional[Callable[[Optional[FloatArray], Optional[float]], None]]:
    """forward(x, w, geom, out)'s numbers for one image as one call of (bias,
    relu), its padded input and lowered matrix kept here and its views made
    now; None where forward would take another path (several images, bands,
    the image-major or batch-inner orders, strides along the width or
    dilation, strided arrays, another dtype) or the lowered matrix is over
    BOUND_LOWERED_BYTES. For an execution plan, whose arrays stay while its
    layout does."""
    m = geom.out_h * geom.out_w
    rows = geom.channels * geom.kernel_h * geom.kernel_w
    if (x.shape[0] != 1 or image_major(geom, 1) or batch_inner(geom, 1) or band_rows(geom, 1, x.dtype.itemsize)
            or geom.stride_w != 1 or geom.dilation_h != 1 or geom.dilation_w != 1 or w.dtype != x.dtype
            or rows * m * x.dtype.itemsize > BOUND_LOWERED_BYTES
            or not (x.flags.c_contiguous and w.flags.c_contiguous and out.flags.c_contiguous)):
        return None
    padded = np.zeros((geom.channels, 1, geom.padded_h, geom.padded_w), x.dtype) if geom.has_border else None
    xp = x.transpose(1, 0, 2, 3) if padded is None else padded
    inside = None if padded is None else padded[:, 0, geom.pad_h:geom.pad_h + geom.in_h,
                                                geom.pad_w:geom.pad_w + geom.in_w]
    image = x[0]
    cols = np.empty((rows, m), x.dtype)
    weights, lowered = _kernel_matrix(w, geom, x.dtype), cols.reshape(geom.group, -1, m)
    product = out.reshape(geom.group, -1, m)
    sizes = (geom.kernel_h, geom.kernel_w, geom.stride_h, geom.out_h, geom.out_w)

    def forward(bias: Optional[FloatArray], relu: Optional[float]) -> None:
        if inside is not None:
            inside[...] = image                     # the border stays the zeros it was made with
        _lower_one_image(xp, *sizes, cols)
        stacked_matmul(weights, lowered, product)
        finish(out, bias, relu)
    return forward


def _lowered(x: FloatArray, geom: ConvGeometry, ws: Workspace, inner: bool) -> FloatArray:
    return _lower_batch_inner(x, geom, ws) if inner else lower(x, geom, ws=ws)


def _output_matrix(dy: FloatArray, geom: ConvGeometry, ws: Workspace, inner: bool) -> FloatArray:
    """dy (N, O, OH, OW) -> (g, Og, M) in the column order in use."""
    if inner:
        dy_cols = ws.empty("output", (geom.num_output, geom.out_h, geom.out_w, dy.shape[0]), dy.dtype)
        dy_cols[...] = dy.transpose(1, 2, 3, 0)
    else:
        dy_cols = channels_first_output(dy, ws)
    return dy_cols.reshape(geom.group, geom.outputs_per_group, -1)


def _kernel_matrix(w: FloatArray, geom: ConvGeometry, dtype: npt.DTypeLike) -> FloatArray:
    return weights_as(w, dtype).reshape(geom.group, geom.outputs_per_group, -1)   # (g, Og, Cg*KH*KW)


def forward(x: FloatArray, w: FloatArray, geom: ConvGeometry, out: Optional[FloatArray] = None, ws: Workspace = FRESH,
            bias: Optional[FloatArray] = None, relu: Optional[float] = None) -> FloatArray:
    """y (N, O, OH, OW) = conv(x (N, C, H, W), w (O, C/g, KH, KW)) (+ bias (O,)),
    then a ReLU of negative slope `relu` when given."""
    n = x.shape[0]
    if image_major(geom, n):
        return _forward_image_major(x, w, geom, out, ws, bias, relu)
    m = n * geom.out_h * geom.out_w
    inner = batch_inner(geom, n)
    lowered = _lowered(x, geom, ws, inner).reshape(geom.group, -1, m)
    if n == 1 and not inner and out is not None and out.flags.c_contiguous:
        # one image: the product (O, 1, OH, OW) is the output's own layout, so the
        # GEMM writes the blob (GoogLeNet's 3x3s at batch 1: the copy was 15-28% of each);
        # a grouped one's groups run side by side on the pool (stacked_matmul)
        stacked_matmul(_kernel_matrix(w, geom, x.dtype), lowered, out.reshape(geom.group, -1, m))
        return finish(out, bias, relu)
    y = np.matmul(_kernel_matrix(w, geom, x.dtype), lowered,
                  out=ws.empty("product", (geom.group, geom.outputs_per_group, m), x.dtype))
    if inner:                                                     # (O, OH, OW, N)
        return _batch_first(y.reshape(geom.num_output, geom.out_h, geom.out_w, n), 0, 0,
                            geom.output_shape(n), out, bias, relu)
    if bias is not None:
        # the same adds as store's, but along the product's contiguous rows: numpy's add
        # broadcasting a bias into the transposed view took 5x the copy (LeNet conv1: 0.46 ms)
        y.reshape(geom.num_output, m)[...] += bias.reshape(-1, 1)
    y = y.reshape(geom.num_output, n, geom.out_h, geom.out_w).transpose(1, 0, 2, 3)   # (O, N, OH, OW)
    return store_relu(y, out, relu)


def backward(x: Optional[FloatArray], dy: FloatArray, w: Optional[FloatArray], geom: ConvGeometry, data: bool = True,
             weights: bool = True, ws: Workspace = FRESH, dx_out: Optional[FloatArray] = None,
             lowered: Optional[FloatArray] = None) -> Tuple[Optional[FloatArray], Optional[FloatArray]]:
    """(dx or None, dw or None), sharing the dy matrix. dx goes into `dx_out`
    when given; dw is a new array (set, not accumulated). `lowered`: x's
    lowering as the forward left it (cct.lowering.kept), not lowered again.
    x is given where `weights` is, w where `data` is."""
    n = dy.shape[0]
    if image_major(geom, n):
        return _backward_image_major(x, dy, w, geom, data, weights, ws, dx_out, lowered)
    inner = batch_inner(geom, n)
    dy_mat = _output_matrix(dy, geom, ws, inner)                  # (g, Og, M)
    dw = dx = None
    if weights:                   # first: the data gradient then reuses the lowered buffer
        lowered = (_lowered(cast(FloatArray, x), geom, ws, inner) if lowered is None else lowered).reshape(
            geom.group, -1, dy_mat.shape[-1])
        dw = np.ascontiguousarray(matmul_nt(dy_mat, lowered)).reshape(geom.weight_shape)   # (g, Og, Cg*KH*KW)
    if data:
        kernel = _kernel_matrix(cast(FloatArray, w), geom, dy.dtype)
        dcols = np.matmul(kernel.transpose(0, 2, 1), dy_mat,
                          out=ws.empty("lowered", (geom.group, kernel.shape[2], dy_mat.shape[-1]), dy.dtype))
        dx = (_col2im_batch_inner(dcols, geom, n, dx_out, ws) if inner
              else col2im(dcols, geom, n, out=dx_out, ws=ws))
    return dx, dw
