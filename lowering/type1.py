"""Lowering type 1: expensive lowering, trivial lifting (im2col over the batch).

Shapes per group g (Cg = C/group, Og = O/group, M = N*OH*OW):

    lowered data   D1  (Cg*KH*KW, M)       row (c, i, j), column (n, oh, ow):
                                           D1[(c,i,j), (n,oh,ow)] = xpad[n, c, oh*sh + i*dh, ow*sw + j*dw]
    kernel matrix  K1  (Og, Cg*KH*KW)      w reshaped, no copy
    GEMM           Y   = K1 @ D1  (Og, M)  one call per group over the whole batch
    lifting        Y (O, N, OH, OW) -> y (N, O, OH, OW), a transpose

Backward: dD1 = K1^T @ dY then col2im (KH*KW strided slice sums);
dK1 = dY @ D1^T.
"""
import numpy as np

from .geometry import (matmul_nt, output_channels_first, pad_channels_first, store_output,
                       unpad_channels_first, weights_as, window_view)


def lower(x, geom, out=None):
    """im2col of a whole batch: x (N, C, H, W) -> (C*KH*KW, N*OH*OW)."""
    n = x.shape[0]
    view = window_view(pad_channels_first(x, geom), geom)       # (C, KH, KW, N, OH, OW), no copy
    cols = np.empty(view.shape, x.dtype) if out is None else out.reshape(view.shape)
    np.copyto(cols, view)                                        # the one lowering copy
    return cols.reshape(geom.channels * geom.kernel_h * geom.kernel_w, n * geom.out_h * geom.out_w)


def col2im(cols, geom, batch, out=None):
    """Adjoint of `lower`: (C*KH*KW, N*OH*OW) -> (N, C, H, W), summing overlaps."""
    cols = cols.reshape(geom.channels, geom.kernel_h, geom.kernel_w, batch, geom.out_h, geom.out_w)
    dxp = np.zeros((geom.channels, batch, geom.padded_h, geom.padded_w), cols.dtype)
    for i in range(geom.kernel_h):
        for j in range(geom.kernel_w):
            dxp[:, :, geom.rows(i), geom.cols(j)] += cols[:, i, j]
    return unpad_channels_first(dxp, geom, out)


def _kernel_matrix(w, geom, dtype):
    return weights_as(w, dtype).reshape(geom.group, geom.outputs_per_group, -1)   # (g, Og, Cg*KH*KW)


def forward(x, w, geom, out=None):
    """y (N, O, OH, OW) = conv(x (N, C, H, W), w (O, C/g, KH, KW))."""
    n = x.shape[0]
    lowered = lower(x, geom).reshape(geom.group, -1, n * geom.out_h * geom.out_w)
    y = np.matmul(_kernel_matrix(w, geom, x.dtype), lowered)   # (g, Og, M) == (O, N, OH, OW)
    return store_output(y.reshape(geom.num_output, n, geom.out_h, geom.out_w), out)


def _dy_matrix(dy, geom):
    """dy (N, O, OH, OW) -> (g, Og, N*OH*OW)."""
    return output_channels_first(dy).reshape(geom.group, geom.outputs_per_group, -1)


def _data_gradient(dy_mat, w, geom, batch, out=None):
    dcols = np.matmul(_kernel_matrix(w, geom, dy_mat.dtype).transpose(0, 2, 1), dy_mat)  # (g, Cg*KH*KW, M)
    return col2im(dcols, geom, batch, out)


def _weight_gradient(x, dy_mat, geom, out=None):
    lowered = lower(x, geom).reshape(geom.group, -1, dy_mat.shape[-1])
    dw = matmul_nt(dy_mat, lowered).reshape(geom.weight_shape)   # (g, Og, Cg*KH*KW)
    if out is None:
        return np.ascontiguousarray(dw)
    out[...] = dw
    return out


def backward_data(dy, w, geom, out=None):
    """dx (N, C, H, W) from dy (N, O, OH, OW)."""
    return _data_gradient(_dy_matrix(dy, geom), w, geom, dy.shape[0], out)


def backward_weights(x, dy, geom, out=None):
    """dw (O, C/g, KH, KW) from x and dy (not accumulated)."""
    return _weight_gradient(x, _dy_matrix(dy, geom), geom, out)


def backward(x, dy, w, geom, data=True, weights=True):
    """(dx or None, dw or None), sharing the channels-first dy matrix."""
    dy_mat = _dy_matrix(dy, geom)
    return (_data_gradient(dy_mat, w, geom, dy.shape[0]) if data else None,
            _weight_gradient(x, dy_mat, geom) if weights else None)
