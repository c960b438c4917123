"""Lowering type 2: balanced; lower along the width only, lift along the height.

Shapes per group g (Cg = C/group, Og = O/group, M2 = N*Hp*OW, Hp = H + 2*pad_h
+ overrun_h, see cct.lowering.geometry):

    lowered data   D2  (Cg*KW, M2)          D2[(c,j), (n,hp,ow)] = xpad[n, c, hp, ow*sw + j*dw]
    kernel matrix  K2  (Og*KH, Cg*KW)       K2[(o,i), (c,j)] = w[o, c, i, j]
    GEMM           Z   = K2 @ D2  (Og*KH, M2), one call per group over the whole batch
    lifting        y[n, o, oh, ow] = sum_i Z[(o,i), (n, oh*sh + i*dh, ow)]   (KH shifted slices)

Backward: dZ scatters dy into the KH shifted row slices; dK2 = dZ @ D2^T;
dD2 = K2^T @ dZ (into D2's buffer) then a KW-slice col2im along the width.

Workspace slots (see cct.lowering.chunking): "padded" (C, N, Hp, Wp),
"lowered" D2, "product" Z, "output" y or dy channels first.
"""
from typing import Optional, Tuple, cast

import numpy as np
import numpy.typing as npt

from cct.core.arrays import FloatArray
from cct.core.workspace import FRESH, Workspace

from .geometry import (ConvGeometry, channels_first_output, finish, matmul_nt, pad_channels_first, relu_after,
                       store_output, unpad_channels_first, weights_as, window_view)


def lower(x: FloatArray, geom: ConvGeometry, ws: Workspace = FRESH) -> FloatArray:
    """x (N, C, H, W) -> D2 (C*KW, N*Hp*OW)."""
    n = x.shape[0]
    xp = pad_channels_first(x, geom, out=ws.empty("padded", (geom.channels, n, geom.padded_h, geom.padded_w),
                                                   x.dtype))
    view = window_view(xp, geom, lower_h=False)                  # (C, KW, N, Hp, OW), no copy
    lowered = ws.empty("lowered", view.shape, x.dtype)
    np.copyto(lowered, view)
    return lowered.reshape(geom.channels * geom.kernel_w, n * geom.padded_h * geom.out_w)


def unlower(lowered: FloatArray, geom: ConvGeometry, batch: int, out: Optional[FloatArray] = None,
            ws: Workspace = FRESH) -> FloatArray:
    """Adjoint of `lower`: (C*KW, N*Hp*OW) -> (N, C, H, W), summing the KW slices."""
    lowered = lowered.reshape(geom.channels, geom.kernel_w, batch, geom.padded_h, geom.out_w)
    dxp = ws.zeros("padded", (geom.channels, batch, geom.padded_h, geom.padded_w), lowered.dtype)
    for j in range(geom.kernel_w):
        dxp[:, :, :, geom.cols(j)] += lowered[:, j]
    return unpad_channels_first(dxp, geom, out)


def _kernel_matrix(w: FloatArray, geom: ConvGeometry, dtype: npt.DTypeLike) -> FloatArray:
    """w (O, Cg, KH, KW) -> K2 (g, Og*KH, Cg*KW)."""
    g, og, cg = geom.group, geom.outputs_per_group, geom.channels_per_group
    k = weights_as(w, dtype).reshape(g, og, cg, geom.kernel_h, geom.kernel_w).transpose(0, 1, 3, 2, 4)
    return k.reshape(g, og * geom.kernel_h, cg * geom.kernel_w)


def lift(z: FloatArray, geom: ConvGeometry, batch: int, ws: Workspace = FRESH,
         into: Optional[FloatArray] = None) -> FloatArray:
    """Z (O*KH, N*Hp*OW) -> y channels-first (O, N, OH, OW), in `into` when given."""
    z = z.reshape(geom.num_output, geom.kernel_h, batch, geom.padded_h, geom.out_w)
    y = ws.empty("output", (geom.num_output, batch, geom.out_h, geom.out_w), z.dtype) if into is None else into
    np.copyto(y, z[:, 0, :, geom.rows(0)])
    for i in range(1, geom.kernel_h):
        y += z[:, i, :, geom.rows(i)]
    return y


def unlift(dy: FloatArray, geom: ConvGeometry, ws: Workspace = FRESH) -> FloatArray:
    """Adjoint of `lift`: dy (N, O, OH, OW) -> dZ (g, Og*KH, N*Hp*OW)."""
    n = dy.shape[0]
    dy_cf = channels_first_output(dy, ws)                              # (O, N, OH, OW)
    dz = ws.zeros("product", (geom.num_output, geom.kernel_h, n, geom.padded_h, geom.out_w), dy.dtype)
    for i in range(geom.kernel_h):
        dz[:, i, :, geom.rows(i)] = dy_cf
    return dz.reshape(geom.group, geom.outputs_per_group * geom.kernel_h, -1)


def forward(x: FloatArray, w: FloatArray, geom: ConvGeometry, out: Optional[FloatArray] = None, ws: Workspace = FRESH,
            bias: Optional[FloatArray] = None, relu: Optional[float] = None) -> FloatArray:
    """y (N, O, OH, OW) = conv(x (N, C, H, W), w (O, C/g, KH, KW)) (+ bias (O,)),
    then a ReLU of negative slope `relu` when given (a pass of its own)."""
    n = x.shape[0]
    lowered = lower(x, geom, ws).reshape(geom.group, geom.channels_per_group * geom.kernel_w, -1)
    kernel = _kernel_matrix(w, geom, x.dtype)
    z = np.matmul(kernel, lowered, out=ws.empty("product", (geom.group, kernel.shape[1], lowered.shape[2]),
                                                x.dtype))             # (g, Og*KH, M2)
    if n == 1 and out is not None and out.flags.c_contiguous:
        # one image: channels first is the output's own layout, so the lifting sums into the blob
        lift(z, geom, n, ws, into=out.reshape(geom.num_output, 1, geom.out_h, geom.out_w))
        return finish(out, bias, relu)
    return relu_after(store_output(lift(z, geom, n, ws), out, bias), relu)


def backward(x: Optional[FloatArray], dy: FloatArray, w: Optional[FloatArray], geom: ConvGeometry, data: bool = True,
             weights: bool = True, ws: Workspace = FRESH, dx_out: Optional[FloatArray] = None,
             lowered: Optional[FloatArray] = None) -> Tuple[Optional[FloatArray], Optional[FloatArray]]:
    """(dx or None, dw or None), sharing the unlifted dZ between the two. dx goes
    into `dx_out` when given; dw is a new array (set, not accumulated).
    x is given where `weights` is, w where `data` is.
    `lowered`: x's lowering as the forward left it (cct.lowering.kept)."""
    n = dy.shape[0]
    dz = unlift(dy, geom, ws)
    dx = dw = None
    if weights:                   # first: the data gradient then reuses the lowered buffer
        lowered = (lower(cast(FloatArray, x), geom, ws) if lowered is None else lowered).reshape(
            geom.group, geom.channels_per_group * geom.kernel_w, -1)
        dk = matmul_nt(dz, lowered)                                  # (g, Og*KH, Cg*KW)
        dk = dk.reshape(geom.group, geom.outputs_per_group, geom.kernel_h,
                        geom.channels_per_group, geom.kernel_w)
        dw = np.ascontiguousarray(dk.transpose(0, 1, 3, 2, 4)).reshape(geom.weight_shape)
    if data:
        kernel = _kernel_matrix(cast(FloatArray, w), geom, dy.dtype)
        dlowered = np.matmul(kernel.transpose(0, 2, 1), dz,
                             out=ws.empty("lowered", (geom.group, kernel.shape[2], dz.shape[2]), dy.dtype))
        dx = unlower(dlowered, geom, n, out=dx_out, ws=ws)
    return dx, dw
