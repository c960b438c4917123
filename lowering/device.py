"""Convolution by lowering type 1 on a device (cct.devices.base), written once
for every device: the batch lowered in chunks of images, every group at once,
one batched GEMM over the groups per chunk, the product lifted to the output.
The matrices are type 1's (see cct.lowering.type1), per group g and chunk of
n images (R = Cg*KH*KW, P = OH*OW):

    lowered   D  (G, R, n*P)    device.im2col of every channel: group g's rows
                                are the block g (channels g*Cg, ... come in order)
    kernel    K  (G, Og, R)     the weight buffer
    product   Y  (G, Og, n*P)   = K_g @ D_g for every g in one gemm_batched
                                (evenly strided: CLBlast's strided-batched GEMM),
                                lifted to (n, O, OH, OW)

Backward: the top gradient lowered channels-first (dY, O x n*OP), then
dK_g += dY_g @ D_g^T and dD_g = K_g^T @ dY_g (each one gemm_batched over the
groups), folded back by one col2im.

The weight gradient's output (Og x R: conv1's 96 x 363) is small and its K
(n*P, the chunk's output positions) large, and a GEMM spreads only its
output over the device: it would fill a few of a GPU's compute units. So K
is cut into S slices (`split_k`): the S x G partial products by one batched
GEMM into a scratch buffer, then one sum over the slices, in slice order
(deterministic: the same bits every run), added to dK. S is 1 where the
output alone covers the device's compute units (always on the numpy device,
which has one).

A depthwise geometry (group == channels == num_output > 1, MobileNets'
3 x 3 layers: cct.lowering.depthwise.applies) lowers nothing: the device's
direct kernels (depthwise_forward, depthwise_backward_data and _weights)
run it, as the host runs cct.lowering.depthwise, instead of C GEMMs of one
output row each.

Buffers are device buffers; the layer (cct.layers.conv) passes its blobs'.
The lowered matrix of a chunk stays within `budget` elements: the layer's
lowering_budget_mb where it has one, else a share of the device's memory
(`device_budget`), as the host's lowering budget bounds its workspace.
"""
from dataclasses import replace
from functools import lru_cache
from typing import List, Optional, Tuple

from cct.devices.base import Buffer, Device

from .depthwise import applies as depthwise_applies
from .geometry import ConvGeometry

DEFAULT_BUDGET = 16 << 20         # float32 elements of one chunk's lowered matrix (64 MB), without device memory
# Without a lowering_budget_mb, a chunk's lowered matrix may take 1/16 of the
# device's memory (and no more than its largest buffer): the net's blobs, the
# product and the other scratch buffers share the rest. CaffeNet's conv1 at
# batch 256 lowers 363 x 774,400 floats (1.1 GB): one chunk from 18 GB up.
MEMORY_SHARE = 16

# split_k's rule. CLBlast's GEMM gives a work-group a tile of the output
# (64 x 64 or so on GPUs), so an Og x R output has about ceil(Og/64) *
# ceil(R/64) tiles: conv1's 96 x 363 12, conv2's 128 x 1200 38, for an H100's
# 132 compute units. Where the tiles are fewer than the compute units, slices
# are added until every compute unit has TILE_WAVES tiles to run (so none
# waits long on the last), each slice keeping at least MIN_SLICE columns of K
# (so the partial products and their sum stay small beside the GEMM).
TILE = 64
TILE_WAVES = 2
MIN_SLICE = 4096


def device_budget(device: Device) -> int:
    """A chunk's lowered matrix in float32 elements where the layer sets no
    lowering_budget_mb: MEMORY_SHARE of the device's memory, within its
    largest buffer; DEFAULT_BUDGET on a device without memory of its own."""
    if device.memory_bytes is None:
        return DEFAULT_BUDGET
    share = device.memory_bytes // MEMORY_SHARE
    return max(1, min(share, device.max_alloc_bytes or share) // 4)


def split_k(device: Device, rows: int, columns: int, k: int) -> int:
    """Slices of K for a (rows, columns) weight gradient summed over k: none
    where the output's tiles cover the compute units, else enough for
    TILE_WAVES tiles per compute unit, none under MIN_SLICE wide."""
    tiles = -(-rows // TILE) * -(-columns // TILE)
    if tiles >= device.compute_units:
        return 1
    wanted = -(-TILE_WAVES * device.compute_units // tiles)
    return max(1, min(wanted, k // MIN_SLICE))


def chunks(geom: ConvGeometry, batch: int, budget: int = DEFAULT_BUDGET) -> List[Tuple[int, int]]:
    """(first image, image count) pairs covering the batch, each chunk's
    lowered matrix (every group's) within `budget` elements (at least one
    image a chunk)."""
    per_image = geom.channels * geom.kernel_h * geom.kernel_w * geom.out_h * geom.out_w
    step = max(1, budget // max(per_image, 1))
    return [(first, min(step, batch - first)) for first in range(0, batch, step)]


@lru_cache(maxsize=256)
def _ungrouped(geom: ConvGeometry) -> ConvGeometry:
    """The geometry with every channel in one group: im2col and col2im of it
    lower and fold back all the groups at once, group g's rows the g-th block."""
    return replace(geom, group=1)


def _sizes(geom: ConvGeometry) -> Tuple[int, int, int]:
    """(Cg*KH*KW, Og, OH*OW): a group's lowered rows, outputs, and the output pixels."""
    rows = geom.channels // geom.group * geom.kernel_h * geom.kernel_w
    return rows, geom.num_output // geom.group, geom.out_h * geom.out_w


def _groups(geom: ConvGeometry, a_size: int, b_size: int, c_size: int) -> Tuple[List[int], List[int], List[int]]:
    """The offsets of the groups' A, B and C matrices, each group's of the given sizes."""
    a, b, c = ([g * size for g in range(geom.group)] for size in (a_size, b_size, c_size))
    return a, b, c


def forward(device: Device, x: Buffer, w: Buffer, geom: ConvGeometry, batch: int, y: Buffer,
            bias: Optional[Buffer] = None, budget: Optional[int] = None) -> None:
    """y (N, O, OH, OW) = conv(x (N, C, H, W), w), plus bias (O,) when given.
    budget: a chunk's lowered matrix in elements (None: device_budget)."""
    rows, outputs, pixels = _sizes(geom)
    if not (batch and pixels):
        return
    if depthwise_applies(geom):
        device.depthwise_forward(x, w, geom, batch, y, bias)
        return
    for first, count in chunks(geom, batch, device_budget(device) if budget is None else budget):
        columns = count * pixels
        lowered = device.scratch("lowered", geom.group * rows * columns)
        product = device.scratch("product", geom.num_output * columns)
        device.im2col(x, _ungrouped(geom), count, lowered, 0, first)
        device.gemm_batched(False, False, outputs, columns, rows, 1.0, w, lowered, 0.0, product,
                            *_groups(geom, outputs * rows, rows * columns, outputs * columns))
        device.from_channels_first(product, count, geom.num_output, pixels, y, bias, first)


def backward(device: Device, x: Buffer, dy: Buffer, w: Buffer, geom: ConvGeometry, batch: int,
             dx: Optional[Buffer] = None, dw: Optional[Buffer] = None, budget: Optional[int] = None) -> None:
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
    for first, count in chunks(geom, batch, device_budget(device) if budget is None else budget):
        columns = count * pixels
        lowered = device.scratch("lowered", geom.group * rows * columns)
        gradient = device.scratch("product", geom.num_output * columns)        # dY (G, Og, n*P)
        device.to_channels_first(dy, count, geom.num_output, pixels, gradient, first)
        if dw is not None:
            device.im2col(x, _ungrouped(geom), count, lowered, 0, first)
            weight_gradient(device, gradient, lowered, geom, columns, dw)
        if dx is not None:
            device.gemm_batched(True, False, rows, columns, outputs, 1.0, w, gradient, 0.0, lowered,
                                *_groups(geom, outputs * rows, outputs * columns, rows * columns))
            device.col2im(lowered, _ungrouped(geom), count, dx, 0, first)


def weight_gradient(device: Device, gradient: Buffer, lowered: Buffer, geom: ConvGeometry, columns: int,
                    dw: Buffer, slices: Optional[int] = None) -> None:
    """dw (G, Og, R) += dY_g (Og, columns) @ D_g (R, columns)^T for every group
    g, K (columns) cut in `slices` (None: split_k's): S x G partial products
    (S, G, Og, R) by one batched GEMM (a second adds the columns S does not
    divide evenly to the last slice), then one sum over the slices in order."""
    rows, outputs, _ = _sizes(geom)
    if slices is None:
        slices = split_k(device, outputs, rows, columns)
    slices = max(1, min(slices, columns))
    a_groups, b_groups, c_groups = _groups(geom, outputs * columns, rows * columns, outputs * rows)
    if slices == 1:
        device.gemm_batched(False, True, outputs, rows, columns, 1.0, gradient, lowered, 1.0, dw,
                            a_groups, b_groups, c_groups)
        return
    width, size = columns // slices, geom.num_output * rows
    partial = device.scratch("split_k", slices * size)
    placed = [(s, g) for s in range(slices) for g in range(geom.group)]
    device.gemm_batched(False, True, outputs, rows, width, 1.0, gradient, lowered, 0.0, partial,
                        [a_groups[g] + s * width for s, g in placed], [b_groups[g] + s * width for s, g in placed],
                        [s * size + c_groups[g] for s, g in placed], a_ld=columns, b_ld=columns)
    rest = columns - slices * width
    if rest:
        last = slices * width
        device.gemm_batched(False, True, outputs, rows, rest, 1.0, gradient, lowered, 1.0, partial,
                            [a + last for a in a_groups], [b + last for b in b_groups],
                            [(slices - 1) * size + c for c in c_groups], a_ld=columns, b_ld=columns)
    device.sum_axis(partial, 1, slices, size, dw, beta=1.0)


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
