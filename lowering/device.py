"""Convolution by lowering type 1 on a device (cct.devices.base), written once
for every device: the batch lowered in chunks of images, one GEMM per group
and chunk, the product lifted to the output. The matrices are type 1's
(see cct.lowering.type1), per group g and chunk of n images:

    lowered   D  (Cg*KH*KW, n*OH*OW)   device.im2col
    kernel    K  (Og, Cg*KH*KW)        the weight buffer at offset g*Og*Cg*KH*KW
    product   Y  (O, n*OH*OW)          = K @ D per group, lifted to (n, O, OH, OW)

Backward: the top gradient lowered channels-first (dY, O x n*OH*OW), then
dK += dY_g @ D_g^T and dD_g = K_g^T @ dY_g, folded back by col2im.

A depthwise geometry (group == channels == num_output > 1, MobileNets'
3 x 3 layers: cct.lowering.depthwise.applies) lowers nothing: the device's
direct kernels (depthwise_forward, depthwise_backward_data and _weights)
run it, as the host runs cct.lowering.depthwise, instead of C GEMMs of one
output row each.

Buffers are device buffers; the layer (cct.layers.conv) passes its blobs'.
The lowered matrix of a chunk stays within `budget` elements (64 MB of
float32 by default), as the host's lowering budget bounds its workspace.
"""

from typing import List, Optional, Tuple

from cct.devices.base import Buffer, Device

from .depthwise import applies as depthwise_applies
from .geometry import ConvGeometry

DEFAULT_BUDGET = 16 << 20         # float32 elements of one chunk's lowered matrix (64 MB)


def chunks(geom: ConvGeometry, batch: int, budget: int = DEFAULT_BUDGET) -> List[Tuple[int, int]]:
    """(first image, image count) pairs covering the batch, each chunk's
    lowered matrix within `budget` elements (at least one image a chunk)."""
    per_image = geom.channels // geom.group * geom.kernel_h * geom.kernel_w * geom.out_h * geom.out_w
    step = max(1, budget // max(per_image, 1))
    return [(first, min(step, batch - first)) for first in range(0, batch, step)]


def _sizes(geom: ConvGeometry) -> Tuple[int, int, int]:
    """(Cg*KH*KW, Og, OH*OW): a group's lowered rows, outputs, and the output pixels."""
    rows = geom.channels // geom.group * geom.kernel_h * geom.kernel_w
    return rows, geom.num_output // geom.group, geom.out_h * geom.out_w


def forward(device: Device, x: Buffer, w: Buffer, geom: ConvGeometry, batch: int, y: Buffer,
            bias: Optional[Buffer] = None, budget: int = DEFAULT_BUDGET) -> None:
    """y (N, O, OH, OW) = conv(x (N, C, H, W), w), plus bias (O,) when given."""
    rows, outputs, pixels = _sizes(geom)
    if not (batch and pixels):
        return
    if depthwise_applies(geom):
        device.depthwise_forward(x, w, geom, batch, y, bias)
        return
    for first, count in chunks(geom, batch, budget):
        lowered = device.scratch("lowered", rows * count * pixels)
        product = device.scratch("product", geom.num_output * count * pixels)
        for g in range(geom.group):
            device.im2col(x, geom, count, lowered, g, first)
            device.gemm(False, False, outputs, count * pixels, rows, 1.0, w, lowered, 0.0, product,
                        a_offset=g * outputs * rows, c_offset=g * outputs * count * pixels)
        device.from_channels_first(product, count, geom.num_output, pixels, y, bias, first)


def backward(device: Device, x: Buffer, dy: Buffer, w: Buffer, geom: ConvGeometry, batch: int,
             dx: Optional[Buffer] = None, dw: Optional[Buffer] = None, budget: int = DEFAULT_BUDGET) -> None:
    """dx (N, C, H, W) = the data gradient (SET) when dx is given; dw (O, C/g,
    KH, KW) += the weight gradient when dw is given; both from dy (N, O, OH, OW)."""
    rows, outputs, pixels = _sizes(geom)
    if not (batch and pixels) or (dx is None and dw is None):
        if dx is not None:
            device.fill(dx, 0.0, batch * geom.channels * geom.in_h * geom.in_w)
        return
    if depthwise_applies(geom):
        if dw is not None:
            device.depthwise_backward_weights(x, dy, geom, batch, dw)
        if dx is not None:
            device.depthwise_backward_data(dy, w, geom, batch, dx)
        return
    for first, count in chunks(geom, batch, budget):
        lowered = device.scratch("lowered", rows * count * pixels)
        gradient = device.scratch("product", geom.num_output * count * pixels)   # dY (O, n*P)
        device.to_channels_first(dy, count, geom.num_output, pixels, gradient, first)
        for g in range(geom.group):
            gradient_offset = g * outputs * count * pixels
            if dw is not None:
                device.im2col(x, geom, count, lowered, g, first)
                device.gemm(False, True, outputs, rows, count * pixels, 1.0, gradient, lowered, 1.0, dw,
                            a_offset=gradient_offset, c_offset=g * outputs * rows)
            if dx is not None:
                device.gemm(True, False, rows, count * pixels, outputs, 1.0, w, gradient, 0.0, lowered,
                            a_offset=g * outputs * rows, b_offset=gradient_offset)
                device.col2im(lowered, geom, count, dx, g, first)


def bias_gradient(device: Device, dy: Buffer, batch: int, channels: int, pixels: int, db: Buffer) -> None:
    """db (C,) += dy (N, C, P) summed over the images and pixels."""
    if not batch:
        return
    per_pixel = device.scratch("bias_sums", channels * pixels)
    device.sum_axis(dy, 1, batch, channels * pixels, per_pixel)          # (C*P,) over the images
    device.sum_axis(per_pixel, channels, pixels, 1, db, beta=1.0)        # (C,) over the pixels


def add_bias(device: Device, y: Buffer, batch: int, channels: int, pixels: int, bias: Buffer) -> None:
    """y (N, C, P) += bias (C,) broadcast: two GEMMs with a vector of ones, one
    spreading the bias over the pixels (C, P), one over the images."""
    plane = device.scratch("bias_plane", channels * pixels)
    ones = device.ones(max(batch, pixels))
    device.gemm(False, False, channels, pixels, 1, 1.0, bias, ones, 0.0, plane)
    device.gemm(False, False, batch, channels * pixels, 1, 1.0, ones, plane, 1.0, y)
