"""Plain direct convolution, for tests only: the obviously-correct version the
lowerings are checked against (llm.c's "reference kernel beside the fast one").

One loop over groups and kernel offsets (i, j); each step multiplies the
input pixels that offset touches, xpad[n, c, oh*sh + i*dh, ow*sw + j*dw], by
w[o, c, i, j] for every n, o, oh, ow at once.
"""
from typing import Iterator, Tuple

import numpy as np

from cct.core.arrays import FloatArray

from .geometry import ConvGeometry


def _padded(x: FloatArray, geom: ConvGeometry) -> FloatArray:
    # Bottom/right also by the last window's overrun: Caffe reads those cells as zero.
    return np.pad(x, ((0, 0), (0, 0), (geom.pad_h, geom.pad_h + geom.overrun_h),
                      (geom.pad_w, geom.pad_w + geom.overrun_w)))


def _offsets(geom: ConvGeometry) -> Iterator[Tuple[slice, slice, int, int]]:
    for g in range(geom.group):
        cs = slice(g * geom.channels_per_group, (g + 1) * geom.channels_per_group)
        os = slice(g * geom.outputs_per_group, (g + 1) * geom.outputs_per_group)
        for i in range(geom.kernel_h):
            for j in range(geom.kernel_w):
                yield cs, os, i, j


def forward(x: FloatArray, w: FloatArray, geom: ConvGeometry) -> FloatArray:
    """y (N, O, OH, OW) from x (N, C, H, W) and w (O, C/g, KH, KW)."""
    xp = _padded(x, geom)
    y = np.zeros(geom.output_shape(x.shape[0]), np.result_type(x, w))
    for cs, os, i, j in _offsets(geom):
        patch = xp[:, cs, geom.rows(i), geom.cols(j)]                 # (N, Cg, OH, OW)
        y[:, os] += np.einsum("nchw,oc->nohw", patch, w[os, :, i, j])
    return y


def backward_data(dy: FloatArray, w: FloatArray, geom: ConvGeometry) -> FloatArray:
    """dx (N, C, H, W): every output's gradient sent back to the pixels it read."""
    dxp = np.zeros((dy.shape[0], geom.channels, geom.padded_h, geom.padded_w), np.result_type(dy, w))
    for cs, os, i, j in _offsets(geom):
        dxp[:, cs, geom.rows(i), geom.cols(j)] += np.einsum("nohw,oc->nchw", dy[:, os], w[os, :, i, j])
    return dxp[:, :, geom.pad_h:geom.pad_h + geom.in_h, geom.pad_w:geom.pad_w + geom.in_w]


def backward_weights(x: FloatArray, dy: FloatArray, geom: ConvGeometry) -> FloatArray:
    """dw (O, C/g, KH, KW): for each offset, the correlation of dy with the pixels it read."""
    xp = _padded(x, geom)
    dw = np.zeros(geom.weight_shape, np.result_type(x, dy))
    for cs, os, i, j in _offsets(geom):
        patch = xp[:, cs, geom.rows(i), geom.cols(j)]
        dw[os, :, i, j] = np.einsum("nohw,nchw->oc", dy[:, os], patch)
    return dw
