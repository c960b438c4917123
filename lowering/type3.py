"""Lowering type 3: cheap lowering, expensive lifting.

Shapes per group g (Cg = C/group, Og = O/group, M3 = N*Hp*Wp, padded input):

    lowered data   D3  (Cg, M3)              the padded input, channels first (no duplication)
    kernel matrix  K3  (Og*KH*KW, Cg)        K3[(o,i,j), c] = w[o, c, i, j]
    GEMM           Z   = K3 @ D3  (Og*KH*KW, M3), one call per group over the whole batch
    lifting        y[n, o, oh, ow] = sum_{i,j} Z[(o,i,j), (n, oh*sh + i*dh, ow*sw + j*dw)]
                   (KH*KW shifted, strided, dilated slices)

Backward: dZ scatters dy into the KH*KW shifted slices; dD3 = K3^T @ dZ (then
crop the padding); dK3 = dZ @ D3^T.
"""
import numpy as np

from .geometry import matmul_nt, output_channels_first, pad_channels_first, store_output, unpad_channels_first, weights_as


def lower(x, geom):
    """x (N, C, H, W) -> D3 (C, N*Hp*Wp)."""
    return pad_channels_first(x, geom).reshape(geom.channels, -1)


def _kernel_matrix(w, geom, dtype):
    """w (O, Cg, KH, KW) -> K3 (g, Og*KH*KW, Cg)."""
    g, og, cg = geom.group, geom.outputs_per_group, geom.channels_per_group
    k = weights_as(w, dtype).reshape(g, og, cg, geom.kernel_h * geom.kernel_w).transpose(0, 1, 3, 2)
    return k.reshape(g, og * geom.kernel_h * geom.kernel_w, cg)


def lift(z, geom, batch):
    """Z (O*KH*KW, N*Hp*Wp) -> y channels-first (O, N, OH, OW)."""
    z = z.reshape(geom.num_output, geom.kernel_h, geom.kernel_w, batch, geom.padded_h, geom.padded_w)
    y = z[:, 0, 0, :, geom.rows(0), geom.cols(0)].copy()
    for i in range(geom.kernel_h):
        for j in range(geom.kernel_w):
            if i or j:
                y += z[:, i, j, :, geom.rows(i), geom.cols(j)]
    return y


def unlift(dy, geom):
    """Adjoint of `lift`: dy (N, O, OH, OW) -> dZ (g, Og*KH*KW, N*Hp*Wp)."""
    n = dy.shape[0]
    dy_cf = output_channels_first(dy)                                  # (O, N, OH, OW)
    dz = np.zeros((geom.num_output, geom.kernel_h, geom.kernel_w, n, geom.padded_h, geom.padded_w), dy.dtype)
    for i in range(geom.kernel_h):
        for j in range(geom.kernel_w):
            dz[:, i, j, :, geom.rows(i), geom.cols(j)] = dy_cf
    return dz.reshape(geom.group, geom.outputs_per_group * geom.kernel_h * geom.kernel_w, -1)


def forward(x, w, geom, out=None):
    """y (N, O, OH, OW) = conv(x (N, C, H, W), w (O, C/g, KH, KW))."""
    n = x.shape[0]
    lowered = lower(x, geom).reshape(geom.group, geom.channels_per_group, -1)
    z = np.matmul(_kernel_matrix(w, geom, x.dtype), lowered)        # (g, Og*KH*KW, M3)
    return store_output(lift(z, geom, n), out)


def backward(x, dy, w, geom, data=True, weights=True):
    """(dx or None, dw or None), sharing the unlifted dZ between the two."""
    n = dy.shape[0]
    dz = unlift(dy, geom)
    dx = dw = None
    if data:
        dxp = np.matmul(_kernel_matrix(w, geom, dy.dtype).transpose(0, 2, 1), dz)   # (g, Cg, M3)
        dx = unpad_channels_first(dxp.reshape(geom.channels, n, geom.padded_h, geom.padded_w), geom)
    if weights:
        lowered = lower(x, geom).reshape(geom.group, geom.channels_per_group, -1)
        dk = matmul_nt(dz, lowered)                                  # (g, Og*KH*KW, Cg)
        dk = dk.reshape(geom.num_output, geom.kernel_h, geom.kernel_w, geom.channels_per_group)
        dw = np.ascontiguousarray(dk.transpose(0, 3, 1, 2))
    return dx, dw


def backward_data(dy, w, geom, out=None):
    """dx (N, C, H, W) from dy (N, O, OH, OW)."""
    dx, _ = backward(None, dy, w, geom, data=True, weights=False)
    if out is None:
        return dx
    out[...] = dx
    return out


def backward_weights(x, dy, geom, out=None):
    """dw (O, C/g, KH, KW) from x and dy (not accumulated)."""
    _, dw = backward(x, dy, None, geom, data=False, weights=True)
    if out is None:
        return dw
    out[...] = dw
    return out
