"""Lowering type 1: expensive lowering, trivial lifting (im2col over the batch).

Shapes per group g (Cg = C/group, Og = O/group, M = N*OH*OW):

    lowered data   D1  (Cg*KH*KW, M)       row (c, i, j), column (n, oh, ow):
                                           D1[(c,i,j), (n,oh,ow)] = xpad[n, c, oh*sh + i*dh, ow*sw + j*dw]
    kernel matrix  K1  (Og, Cg*KH*KW)      w reshaped, no copy
    GEMM           Y   = K1 @ D1  (Og, M)  one call per group over the whole batch
    lifting        Y (O, N, OH, OW) -> y (N, O, OH, OW), a transpose

Backward: dK1 = dY @ D1^T; dD1 = K1^T @ dY (into D1's buffer) then col2im
(KH*KW strided slice sums).

Workspace slots (see cct.lowering.workspace): "padded" (C, N, Hp, Wp),
"lowered" D1, "product" Y, "output" dY channels first.
"""
import numpy as np

from .geometry import (channels_first_output, matmul_nt, pad_channels_first, store_output, unpad_channels_first,
                       weights_as, window_view)
from .workspace import FRESH


def lower(x, geom, out=None, ws=FRESH):
    """im2col of a whole batch: x (N, C, H, W) -> (C*KH*KW, N*OH*OW)."""
    n = x.shape[0]
    xp = pad_channels_first(x, geom, out=ws.empty("padded", (geom.channels, n, geom.padded_h, geom.padded_w),
                                                   x.dtype))
    view = window_view(xp, geom)                                 # (C, KH, KW, N, OH, OW), no copy
    cols = ws.empty("lowered", view.shape, x.dtype) if out is None else out.reshape(view.shape)
    np.copyto(cols, view)                                        # the one lowering copy
    return cols.reshape(geom.channels * geom.kernel_h * geom.kernel_w, n * geom.out_h * geom.out_w)


def col2im(cols, geom, batch, out=None, ws=FRESH):
    """Adjoint of `lower`: (C*KH*KW, N*OH*OW) -> (N, C, H, W), summing overlaps."""
    cols = cols.reshape(geom.channels, geom.kernel_h, geom.kernel_w, batch, geom.out_h, geom.out_w)
    dxp = ws.zeros("padded", (geom.channels, batch, geom.padded_h, geom.padded_w), cols.dtype)
    for i in range(geom.kernel_h):
        for j in range(geom.kernel_w):
            dxp[:, :, geom.rows(i), geom.cols(j)] += cols[:, i, j]
    return unpad_channels_first(dxp, geom, out)


def _kernel_matrix(w, geom, dtype):
    return weights_as(w, dtype).reshape(geom.group, geom.outputs_per_group, -1)   # (g, Og, Cg*KH*KW)


def forward(x, w, geom, out=None, ws=FRESH):
    """y (N, O, OH, OW) = conv(x (N, C, H, W), w (O, C/g, KH, KW))."""
    n = x.shape[0]
    m = n * geom.out_h * geom.out_w
    lowered = lower(x, geom, ws=ws).reshape(geom.group, -1, m)
    y = np.matmul(_kernel_matrix(w, geom, x.dtype), lowered,
                  out=ws.empty("product", (geom.group, geom.outputs_per_group, m), x.dtype))  # == (O, N, OH, OW)
    return store_output(y.reshape(geom.num_output, n, geom.out_h, geom.out_w), out)


def backward(x, dy, w, geom, data=True, weights=True, ws=FRESH, dx_out=None):
    """(dx or None, dw or None), sharing the channels-first dy matrix. dx goes
    into `dx_out` when given; dw is a new array (set, not accumulated)."""
    n = dy.shape[0]
    dy_mat = channels_first_output(dy, ws).reshape(geom.group, geom.outputs_per_group, -1)   # (g, Og, M)
    dw = dx = None
    if weights:                   # first: the data gradient then reuses the lowered buffer
        lowered = lower(x, geom, ws=ws).reshape(geom.group, -1, dy_mat.shape[-1])
        dw = np.ascontiguousarray(matmul_nt(dy_mat, lowered)).reshape(geom.weight_shape)   # (g, Og, Cg*KH*KW)
    if data:
        kernel = _kernel_matrix(w, geom, dy.dtype)
        dcols = np.matmul(kernel.transpose(0, 2, 1), dy_mat,
                          out=ws.empty("lowered", (geom.group, kernel.shape[2], dy_mat.shape[-1]), dy.dtype))
        dx = col2im(dcols, geom, n, out=dx_out, ws=ws)
    return dx, dw


def backward_data(dy, w, geom, out=None, ws=FRESH):
    """dx (N, C, H, W) from dy (N, O, OH, OW)."""
    return backward(None, dy, w, geom, data=True, weights=False, ws=ws, dx_out=out)[0]


def backward_weights(x, dy, geom, out=None, ws=FRESH):
    """dw (O, C/g, KH, KW) from x and dy (not accumulated)."""
    dw = backward(x, dy, None, geom, data=False, weights=True, ws=ws)[1]
    if out is None:
        return dw
    out[...] = dw
    return out
