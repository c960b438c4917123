"""The shape of a 2-d convolution, shared by the lowerings, the layers and the
tests. Array conventions used throughout cct.lowering:

    x  (N, C, H, W)            input batch
    w  (O, C/group, KH, KW)    kernel
    y  (N, O, OH, OW)          output batch

with OH = trunc((H + 2*pad_h - (dilation_h*(KH-1)+1)) / stride_h) + 1 (OW alike):
Caffe's C++ integer division, which truncates toward zero. So a window may
overrun the padded input when the kernel extent exceeds it by less than the
stride (kernel 3, stride 2 on a 2 x 2 input: one 1 x 1 output), and Caffe's
im2col reads every cell outside the image as zero. The lowerings do the same
by padding the bottom and right further by the overrun (`overrun_h`,
`overrun_w`): `padded_h` and `padded_w` include it, and the data gradient is
cropped back to H x W as for any padding. When the extent exceeds the padded
input by the stride or more, OH is 0 (Caffe runs it: an empty top) or
negative (Caffe's Blob::Reshape refuses it, and so does ConvGeometry).
"""
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Optional, Tuple, cast

import numpy as np
import numpy.typing as npt

from cct.core.arrays import FloatArray
from cct.core.workspace import Workspace
from cct.devices import pool
from cct.devices.blas import blas_limited, sgemm64
from cct.devices.jit import kernel, parallel_kernel, prange

Shape4 = Tuple[int, int, int, int]


def _truncating_div(a: int, b: int) -> int:
    """a / b rounded toward zero, as C++ integer division (b > 0)."""
    return a // b if a >= 0 else -(-a // b)


# Derived sizes are cached_property: a geometry is immutable, and a convolution's
# forward asked out_h and out_w five times each (2 us of its 18 on a tiny blob).
@dataclass(frozen=True)
class ConvGeometry:
    channels: int            # C, input channels
    num_output: int          # O, output channels
    in_h: int
    in_w: int
    kernel_h: int
    kernel_w: int
    stride_h: int = 1
    stride_w: int = 1
    pad_h: int = 0
    pad_w: int = 0
    dilation_h: int = 1
    dilation_w: int = 1
    group: int = 1

    def __post_init__(self) -> None:
        if self.channels % self.group or self.num_output % self.group:
            raise ValueError(f"channels {self.channels} and num_output {self.num_output} "
                             f"must both be multiples of group {self.group}")
        if min(self.kernel_h, self.kernel_w, self.stride_h, self.stride_w,
               self.dilation_h, self.dilation_w, self.group) < 1:
            raise ValueError(f"kernel, stride, dilation and group must be >= 1: {self}")
        # Caffe computes the output size without a check; Blob::Reshape then refuses
        # a negative one (CHECK_GE(shape[i], 0), blob.cpp) and runs a zero one.
        if self.out_h < 0 or self.out_w < 0:
            raise ValueError(f"the output would be {self.out_h} x {self.out_w}; a size may be 0, not negative")

    # Extent of one dilated kernel window.
    @cached_property
    def extent_h(self) -> int:
        return self.dilation_h * (self.kernel_h - 1) + 1

    @cached_property
    def extent_w(self) -> int:
        return self.dilation_w * (self.kernel_w - 1) + 1

    @cached_property
    def out_h(self) -> int:
        return _truncating_div(self.in_h + 2 * self.pad_h - self.extent_h, self.stride_h) + 1

    @cached_property
    def out_w(self) -> int:
        return _truncating_div(self.in_w + 2 * self.pad_w - self.extent_w, self.stride_w) + 1

    # Rows (columns) the last window reads past the padded input: nonzero only when
    # the kernel extent exceeds the padded input (by less than the stride); none
    # when there is no window (an empty output).
    @cached_property
    def overrun_h(self) -> int:
        if not self.out_h:
            return 0
        return max(0, self.stride_h * (self.out_h - 1) + self.extent_h - self.in_h - 2 * self.pad_h)

    @cached_property
    def overrun_w(self) -> int:
        if not self.out_w:
            return 0
        return max(0, self.stride_w * (self.out_w - 1) + self.extent_w - self.in_w - 2 * self.pad_w)

    # The zero-bordered frame the lowerings read: pad on both sides, plus the overrun.
    @cached_property
    def padded_h(self) -> int:
        return self.in_h + 2 * self.pad_h + self.overrun_h

    @cached_property
    def padded_w(self) -> int:
        return self.in_w + 2 * self.pad_w + self.overrun_w

    @cached_property
    def empty(self) -> bool:
        """Nothing to lower: no input channels or pixels, or an empty output. A
        forward then gives the bias alone (every window reads only padding), a
        backward zero gradients (cct.lowering skips these, as an empty batch)."""
        return not (self.channels and self.num_output and self.in_h and self.in_w and self.out_h and self.out_w)

    @cached_property
    def has_border(self) -> bool:
        """Whether the frame the windows read is larger than the input."""
        return self.padded_h != self.in_h or self.padded_w != self.in_w

    @cached_property
    def channels_per_group(self) -> int:
        return self.channels // self.group

    @cached_property
    def outputs_per_group(self) -> int:
        return self.num_output // self.group

    @cached_property
    def weight_shape(self) -> Shape4:
        return (self.num_output, self.channels_per_group, self.kernel_h, self.kernel_w)

    def input_shape(self, batch: int) -> Shape4:
        return (batch, self.channels, self.in_h, self.in_w)

    def output_shape(self, batch: int) -> Shape4:
        return (batch, self.num_output, self.out_h, self.out_w)

    def rows(self, i: int) -> slice:
        """Slice of padded rows read by kernel row i for every output row (none
        for an empty output: its stop would be before its start, which a slice
        would read from the end)."""
        start = i * self.dilation_h
        return slice(start, start + self.stride_h * (self.out_h - 1) + 1 if self.out_h else start, self.stride_h)

    def cols(self, j: int) -> slice:
        """Slice of padded columns read by kernel column j for every output column."""
        start = j * self.dilation_w
        return slice(start, start + self.stride_w * (self.out_w - 1) + 1 if self.out_w else start, self.stride_w)


def pad_channels_first(x: FloatArray, geom: ConvGeometry, out: Optional[FloatArray] = None) -> FloatArray:
    """x (N, C, H, W) -> padded, channels-first (C, N, Hp, Wp), Hp = geom.padded_h
    (H + 2*pad_h + overrun_h; Wp alike).

    Every lowering starts here: with channels outermost, the per-group matrices
    are plain reshapes and the copies in the lowerings walk memory in order.
    `out` may hold garbage: only its border is zeroed."""
    n = x.shape[0]
    shape = (geom.channels, n, geom.padded_h, geom.padded_w)
    if out is None:
        out = np.empty(shape, x.dtype)
    ph, pw, h, w = geom.pad_h, geom.pad_w, geom.in_h, geom.in_w
    out[:, :, :ph] = 0                        # each border is empty when there is none
    out[:, :, ph + h:] = 0
    out[:, :, ph:ph + h, :pw] = 0
    out[:, :, ph:ph + h, pw + w:] = 0
    out[:, :, ph:ph + h, pw:pw + w] = x.transpose(1, 0, 2, 3)
    return out


def unpad_channels_first(xp: FloatArray, geom: ConvGeometry, out: Optional[FloatArray] = None) -> FloatArray:
    """Inverse of pad_channels_first: (C, N, Hp, Wp) -> (N, C, H, W), crops the padding."""
    inner = xp[:, :, geom.pad_h:geom.pad_h + geom.in_h, geom.pad_w:geom.pad_w + geom.in_w]
    if out is None:
        return np.ascontiguousarray(inner.transpose(1, 0, 2, 3))
    out[...] = inner.transpose(1, 0, 2, 3)
    return out


def output_channels_first(dy: FloatArray) -> FloatArray:
    """dy (N, O, OH, OW) -> contiguous (O, N, OH, OW): the GEMM-side layout of outputs."""
    return np.ascontiguousarray(dy.transpose(1, 0, 2, 3))


def channels_first_output(dy: FloatArray, ws: Workspace) -> FloatArray:
    """output_channels_first into the workspace slot "output"."""
    n, o, oh, ow = dy.shape
    out = ws.empty("output", (o, n, oh, ow), dy.dtype)
    out[...] = dy.transpose(1, 0, 2, 3)
    return out


def store(y: FloatArray, out: Optional[FloatArray], bias: Optional[FloatArray] = None) -> FloatArray:
    """Copy y, any (N, O, OH, OW) view, into `out` (new when None), adding
    bias (O,) on the way: the add costs no extra pass over the output."""
    if out is None:
        out = np.empty(y.shape, y.dtype)
    if bias is None:
        np.copyto(out, y)
    else:
        np.add(y, bias.reshape(1, -1, 1, 1), out=out)
    return out


@kernel
def relu_value(v, slope):
    """One value through cct's ReLU layer: max(v, 0) for slope 0 (-0.0 to 0
    too; `slope` is 0 in v's type), else v where v > 0, v * slope otherwise.
    The kernels that end a convolution with its fused ReLU all call this, so
    they give the layer's numbers."""
    if slope == 0:
        return slope if v <= 0 else v
    return v if v > 0 else v * slope


@parallel_kernel
def _bias_relu(out, bias, slope):
    """out (N, C, S) in place: + bias[c] (an empty bias adds nothing), then
    relu_value; the same operations, so the same numbers, as the two passes."""
    batch, channels, inner = out.shape
    for plane in prange(batch * channels):
        n, c = plane // channels, plane % channels
        for s in range(inner):
            v = out[n, c, s]
            if bias.shape[0]:
                v = v + bias[c]
            out[n, c, s] = relu_value(v, slope)


def relu_values(v: FloatArray, slope: Any) -> FloatArray:
    """relu_value over an array, in place (the kernels' twins, cct.devices.jit):
    the same value for each, NaNs left NaN. A masked copy (np.copyto's
    where=, np.where) goes value by value, many times slower than these
    whole-array passes that give relu_value's bits: max(v, +0.0) is v above
    0, and 0.0 or -0.0 at or below it, which adding +0.0 makes 0.0; with a
    slope in (0, 1) v * slope lies between 0 and v, so the larger of v and
    v * slope is v above 0 and v * slope otherwise (above 1: the smaller)."""
    if slope == 0 and not np.signbit(slope):
        np.maximum(v, slope, out=v)
        v += slope
    elif 0 < slope < 1:
        np.maximum(v, v * slope, out=v)
    elif slope > 1:
        np.minimum(v, v * slope, out=v)
    elif slope == 0:                                  # -0.0: relu_value's 0 is the slope, -0.0
        np.copyto(v, slope, where=v <= 0)
    else:
        np.copyto(v, v * slope, where=~(v > 0))
    return v


@_bias_relu.twin
def _bias_relu_twin(out: FloatArray, bias: FloatArray, slope: Any) -> None:
    if bias.shape[0]:
        out += bias.reshape(1, -1, 1)
    relu_values(out, slope)


def finish(out: FloatArray, bias: Optional[FloatArray] = None, relu: Optional[float] = None) -> FloatArray:
    """The output (N, O, ...) in place: bias (O,) added, then a ReLU of negative
    slope `relu` (None: no ReLU; cct.runtime.fusion hands a convolution the
    in-place ReLU after it), in one pass over it (through a contiguous copy
    where `out` is a strided view)."""
    if bias is None and relu is None:
        return out
    if not out.flags.c_contiguous:
        out[...] = finish(np.ascontiguousarray(out), bias, relu)
        return out
    flat = out.reshape(out.shape[0], out.shape[1], -1)       # a view: contiguous
    if relu is None:
        flat += weights_as(cast(FloatArray, bias), out.dtype).reshape(-1, 1)    # (given: both None returned above)
        return out
    bias = np.empty(0, out.dtype) if bias is None else np.ascontiguousarray(weights_as(bias, out.dtype))
    _bias_relu(flat, bias, out.dtype.type(relu))
    return out


def relu_after(out: FloatArray, relu: Optional[float]) -> FloatArray:
    """A ReLU of negative slope `relu` (None: none) on a stored output, in place
    (a pass of its own)."""
    return finish(out, None, relu)


def store_relu(y: FloatArray, out: Optional[FloatArray], relu: Optional[float]) -> FloatArray:
    """store(y, out) with a ReLU of negative slope `relu` on the way (None: none)."""
    if relu == 0:
        if out is None:
            out = np.empty(y.shape, y.dtype)
        return np.maximum(y, 0, out=out)
    return finish(store(y, out), None, relu)


def store_output(y_cf: FloatArray, out: Optional[FloatArray], bias: Optional[FloatArray] = None) -> FloatArray:
    """(O, N, OH, OW) channels-first result -> (N, O, OH, OW) (+ bias), into `out` if given."""
    return store(y_cf.transpose(1, 0, 2, 3), out, bias)


def lowered_shape(geom: ConvGeometry, batch: int) -> Tuple[int, int, int, int, int, int]:
    """The channels-first lowered tensor's shape (C, KH, KW, N, OH, OW): the
    window view's, im2col's and col2im's."""
    return (geom.channels, geom.kernel_h, geom.kernel_w, batch, geom.out_h, geom.out_w)


def window_view(xp: FloatArray, geom: ConvGeometry, lower_h: bool = True, lower_w: bool = True) -> FloatArray:
    """Read-only strided view of padded channels-first xp (C, N, Hp, Wp) as the
    lowered tensor, no copy: (C, KH, KW, N, OH, OW) when lowering both axes,
    (C, KW, N, Hp, OW) when lowering the width only."""
    sc, sn, sh, sw = xp.strides
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]
    if lower_h and lower_w:
        shape = lowered_shape(geom, xp.shape[1])
        strides = (sc, sh * geom.dilation_h, sw * geom.dilation_w, sn, sh * geom.stride_h, sw * geom.stride_w)
    else:
        shape = (geom.channels, geom.kernel_w, xp.shape[1], xp.shape[2], geom.out_w)
        strides = (sc, sw * geom.dilation_w, sn, sh, sw * geom.stride_w)
    return np.lib.stride_tricks.as_strided(xp, shape, strides, writeable=False)


def matmul_nt(a: FloatArray, b: FloatArray) -> FloatArray:
    """a @ b^T for stacks (g, m, K) and (g, n, K) with a long K. OpenBLAS is
    several times faster with the taller operand on the left, so when b is
    taller, compute (b @ a^T)^T instead."""
    if a.shape[-2] >= b.shape[-2]:
        return np.matmul(a, b.swapaxes(-1, -2))
    return np.matmul(b, a.swapaxes(-1, -2)).swapaxes(-1, -2)


ROW_MAJOR, NO_TRANSPOSE = 101, 111      # CBLAS's enums, for cblas_sgemm called from a kernel (gemm_into)


def stacked_matmul(a: FloatArray, b: FloatArray, out: FloatArray) -> FloatArray:
    """out[s] = a[s] @ b[s] for a stack (S, M, K) @ (S, K, N) -> (S, M, N).
    Where a pass lends the one pool (cct.devices.pool) several threads, the
    stack's products run side by side on them, each a one-thread GEMM
    (_stack_on_pool): numpy's matmul runs them one after the other, each on
    every thread, and small products gain little from that (BENCHMARKS.md,
    "The first convolution's bands on every thread"). Values: numpy's to
    float32 rounding. Elsewhere, or for other dtypes or strides, numpy's."""
    threads = pool.kernel_threads()
    sgemm = sgemm64() if threads > 1 and a.shape[0] > 1 and _gemm_ready(a, b, out) else None
    if sgemm is None:
        return np.matmul(a, b, out=out)
    with blas_limited(1):         # each product on its own thread; the pool's count stays the pass's
        _stack_on_pool.parallel(a, b, out, sgemm)
    return out


def _gemm_ready(*arrays: FloatArray) -> bool:
    """float32 stacks whose rows are unit-stride (cblas_sgemm's leading dimensions)."""
    return all(array.dtype == np.float32 and array.ndim == 3 and array.strides[2] == 4
               and array.strides[1] % 4 == 0 and array.strides[1] >= 4 * array.shape[2] for array in arrays)


@kernel
def gemm_into(sgemm, a, b, out):
    """out (M, N) = a (M, K) @ b (K, N), float32 matrices with unit-stride
    rows, by `sgemm` (cblas_sgemm, ILP64: cct.devices.blas.sgemm64) at the
    BLAS count in force: for compiled kernels that run GEMMs on the pool's
    threads, one thread each."""
    sgemm(ROW_MAJOR, NO_TRANSPOSE, NO_TRANSPOSE, a.shape[0], b.shape[1], a.shape[1], np.float32(1.0),
          a.ctypes.data, a.strides[0] // 4, b.ctypes.data, b.strides[0] // 4, np.float32(0.0),
          out.ctypes.data, out.strides[0] // 4)


@parallel_kernel
def _stack_on_pool(a, b, out, sgemm):
    """out[s] = a[s] @ b[s], item s on one of the pool's threads (gemm_into)."""
    for s in prange(a.shape[0]):
        gemm_into(sgemm, a[s], b[s], out[s])


def weights_as(w: FloatArray, dtype: npt.DTypeLike) -> FloatArray:
    return w if w.dtype == dtype else w.astype(dtype)
