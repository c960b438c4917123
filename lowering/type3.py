"""Lowering type 3: cheap lowering, expensive lifting.

Shapes per group g (Cg = C/group, Og = O/group, M3 = N*Hp*Wp, the padded
input frame geom.padded_h x geom.padded_w, see cct.lowering.geometry):

    lowered data   D3  (Cg, M3)              the padded input, channels first (no duplication)
    kernel matrix  K3  (Og*KH*KW, Cg)        K3[(o,i,j), c] = w[o, c, i, j]
    GEMM           Z   = K3 @ D3  (Og*KH*KW, M3), one call per group over the whole batch
    lifting        y[n, o, oh, ow] = sum_{i,j} Z[(o,i,j), (n, oh*sh + i*dh, ow*sw + j*dw)]
                   (KH*KW shifted, strided, dilated slices)

Backward: dZ scatters dy into the KH*KW shifted slices; dK3 = dZ @ D3^T;
dD3 = K3^T @ dZ (into D3's buffer, then crop the padding).

Workspace slots (see cct.lowering.chunking): "padded" D3, "product" Z,
"output" y or dy channels first.
"""
from typing import Callable, Optional, Tuple, cast

import numpy as np
import numpy.typing as npt

from cct.core.arrays import FloatArray
from cct.core.workspace import FRESH, Workspace

from .geometry import (ConvGeometry, channels_first_output, matmul_nt, pad_channels_first, relu_after, store_output,
                       unpad_channels_first, weights_as)


def lower(x: FloatArray, geom: ConvGeometry, ws: Workspace = FRESH) -> FloatArray:
    """x (N, C, H, W) -> D3 (C, N*Hp*Wp)."""
    shape = (geom.channels, x.shape[0], geom.padded_h, geom.padded_w)
    return pad_channels_first(x, geom, out=ws.empty("padded", shape, x.dtype)).reshape(geom.channels, -1)


def _kernel_matrix(w: FloatArray, geom: ConvGeometry, dtype: npt.DTypeLike) -> FloatArray:
    """w (O, Cg, KH, KW) -> K3 (g, Og*KH*KW, Cg)."""
    g, og, cg = geom.group, geom.outputs_per_group, geom.channels_per_group
    k = weights_as(w, dtype).reshape(g, og, cg, geom.kernel_h * geom.kernel_w).transpose(0, 1, 3, 2)
    return k.reshape(g, og * geom.kernel_h * geom.kernel_w, cg)


def lift(z: FloatArray, geom: ConvGeometry, batch: int, ws: Workspace = FRESH) -> FloatArray:
    """Z (O*KH*KW, N*Hp*Wp) -> y channels-first (O, N, OH, OW)."""
    z = z.reshape(geom.num_output, geom.kernel_h, geom.kernel_w, batch, geom.padded_h, geom.padded_w)
    y = ws.empty("output", (geom.num_output, batch, geom.out_h, geom.out_w), z.dtype)
    np.copyto(y, z[:, 0, 0, :, geom.rows(0), geom.cols(0)])
    for i in range(geom.kernel_h):
        for j in range(geom.kernel_w):
            if i or j:
                y += z[:, i, j, :, geom.rows(i), geom.cols(j)]
    return y


def unlift(dy: FloatArray, geom: ConvGeometry, ws: Workspace = FRESH) -> FloatArray:
    """Adjoint of `lift`: dy (N, O, OH, OW) -> dZ (g, Og*KH*KW, N*Hp*Wp)."""
    n = dy.shape[0]
    dy_cf = channels_first_output(dy, ws)                              # (O, N, OH, OW)
    dz = ws.zeros("product", (geom.num_output, geom.kernel_h, geom.kernel_w, n, geom.padded_h, geom.padded_w),
                  dy.dtype)
    for i in range(geom.kernel_h):
        for j in range(geom.kernel_w):
            dz[:, i, j, :, geom.rows(i), geom.cols(j)] = dy_cf
    return dz.reshape(geom.group, geom.outputs_per_group * geom.kernel_h * geom.kernel_w, -1)


def bind_pointwise_backward(x: FloatArray, dy: FloatArray, w: FloatArray, geom: ConvGeometry,
                            dx: Optional[FloatArray]) -> Optional[Callable[[bool, bool], Optional[FloatArray]]]:
    """backward(x, dy, w, geom, data, weights, dx_out=dx)'s numbers for a
    pointwise geometry (cct.lowering.pointwise) and one image, as one call of
    (data, weights) returning dw or None: the padded input and the unlifted
    dZ are then x and dy themselves, so the same two products read and write
    the blobs with no copy; None for other shapes, strided arrays or another
    dtype. dx None: no data gradient is asked for. For an execution plan,
    whose arrays stay while its layout does."""
    arrays = (x, dy, w) if dx is None else (x, dy, w, dx)
    if (x.shape[0] != 1 or geom.kernel_h != 1 or geom.kernel_w != 1 or geom.stride_h != 1 or geom.stride_w != 1
            or geom.has_border or geom.group != 1 or w.dtype != x.dtype or dy.dtype != x.dtype
            or not all(a.flags.c_contiguous for a in arrays)):
        return None
    pixels = geom.in_h * geom.in_w
    lowered = x.reshape(1, geom.channels, pixels)
    dz = dy.reshape(1, geom.num_output, pixels)
    kernel_t = _kernel_matrix(w, geom, x.dtype).transpose(0, 2, 1)
    dxp = None if dx is None else dx.reshape(1, geom.channels, pixels)

    def backward(data: bool, weights: bool) -> Optional[FloatArray]:
        dw = None
        if weights:
            dk = matmul_nt(dz, lowered).reshape(geom.num_output, 1, 1, geom.channels)
            dw = np.ascontiguousarray(dk.transpose(0, 3, 1, 2))
        if data:
            assert dxp is not None, "a data gradient of a backward bound without dx"
            np.matmul(kernel_t, dz, out=dxp)
        return dw
    return backward


def forward(x: FloatArray, w: FloatArray, geom: ConvGeometry, out: Optional[FloatArray] = None, ws: Workspace = FRESH,
            bias: Optional[FloatArray] = None, relu: Optional[float] = None) -> FloatArray:
    """y (N, O, OH, OW) = conv(x (N, C, H, W), w (O, C/g, KH, KW)) (+ bias (O,)),
    then a ReLU of negative slope `relu` when given (a pass of its own)."""
    n = x.shape[0]
    lowered = lower(x, geom, ws).reshape(geom.group, geom.channels_per_group, -1)
    kernel = _kernel_matrix(w, geom, x.dtype)
    z = np.matmul(kernel, lowered, out=ws.empty("product", (geom.group, kernel.shape[1], lowered.shape[2]),
                                                x.dtype))             # (g, Og*KH*KW, M3)
    return relu_after(store_output(lift(z, geom, n, ws), out, bias), relu)


def backward(x: Optional[FloatArray], dy: FloatArray, w: Optional[FloatArray], geom: ConvGeometry, data: bool = True,
             weights: bool = True, ws: Workspace = FRESH, dx_out: Optional[FloatArray] = None,
             lowered: Optional[FloatArray] = None) -> Tuple[Optional[FloatArray], Optional[FloatArray]]:
    """(dx or None, dw or None), sharing the unlifted dZ between the two. dx goes
    into `dx_out` when given; dw is a new array (set, not accumulated).
    x is given where `weights` is, w where `data` is.
    `lowered`: x's padded input as the forward left it (cct.lowering.kept)."""
    n = dy.shape[0]
    dz = unlift(dy, geom, ws)
    dx = dw = None
    if weights:                   # first: the data gradient then reuses the padded buffer
        lowered = (lower(cast(FloatArray, x), geom, ws) if lowered is None else lowered).reshape(
            geom.group, geom.channels_per_group, -1)
        dk = matmul_nt(dz, lowered)                                  # (g, Og*KH*KW, Cg)
        dk = dk.reshape(geom.num_output, geom.kernel_h, geom.kernel_w, geom.channels_per_group)
        dw = np.ascontiguousarray(dk.transpose(0, 3, 1, 2))
    if data:
        kernel = _kernel_matrix(cast(FloatArray, w), geom, dy.dtype)
        dxp = np.matmul(kernel.transpose(0, 2, 1), dz,
                        out=ws.empty("padded", (geom.group, geom.channels_per_group, dz.shape[2]), dy.dtype))
        dx = unpad_channels_first(dxp.reshape(geom.channels, n, geom.padded_h, geom.padded_w), geom, dx_out)
    return dx, dw
