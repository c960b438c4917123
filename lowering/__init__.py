"""Convolution by lowering (Caffe con Troll): the batch is lowered to one
matrix, multiplied by the kernel matrix in one GEMM per group, and the product
lifted to the output. Three lowerings trade lowering cost against lifting cost
(see each module's docstring for its matrix shapes):

    1  type1: im2col over the batch, (C*KH*KW) x (N*OH*OW); lifting is a transpose
    2  type2: lowered along the width only, (C*KW) x (N*Hp*OW); lifting sums KH slices
    3  type3: the padded input as is, C x (N*Hp*Wp); lifting sums KH*KW slices

Every function works on any batch, so a scheduler can call it on a partition
of the batch; an empty one is skipped (nothing lowered, a zero weight
gradient), and so is a geometry with nothing to lower (ConvGeometry.empty: no
input channels or pixels, or an empty output), whose output is the bias alone
(the type modules themselves are never called with either). By default they
allocate their intermediates (pure: arrays in, arrays out); given `ws` (a
cct.core.workspace.Arena) they reuse its buffers instead, and given `chunk`
they process the batch that many images at a time, which bounds the workspace
(see workspace.chunk_size). The chooser (cct.lowering.chooser) picks a type
per layer from a cost model.

A depthwise geometry (group == channels == num_output > 1, MobileNets')
runs its forward and backward directly over the windows instead, whatever
the lowering type (cct.lowering.depthwise).

A forward that never runs backward (a deploy net's) may instead run a 3 x 3 or
5 x 5 convolution at stride 1 by Winograd's minimal filtering
(cct.lowering.winograd), where timing it on the shape says it is faster
(chooser.choose_forward).
"""
from types import ModuleType
from typing import Callable, Dict, Optional, Tuple, Union, cast

import numpy as np
import numpy.typing as npt

from . import depthwise, type1, type2, type3
from .geometry import ConvGeometry, Shape4, finish, weights_as
from .kept import KeptLowering
from cct.core.arrays import FloatArray
from cct.core.workspace import FRESH, Workspace

from .chunking import band_slot_bytes, chunks, slot_bytes

LOWERINGS: Dict[int, ModuleType] = {1: type1, 2: type2, 3: type3}


def lowering(lowering_type: Union[int, str]) -> ModuleType:
    try:
        return LOWERINGS[int(lowering_type)]
    except (KeyError, ValueError, TypeError):
        raise ValueError(f"lowering type must be one of {sorted(LOWERINGS)}, got {lowering_type!r}") from None


def _whole(batch: int, chunk: Optional[int]) -> bool:
    return chunk is None or chunk >= batch


def _plan(ws: Workspace, geom: ConvGeometry, lowering_type: int, batch: int, chunk: Optional[int],
          dtype: npt.DTypeLike) -> None:
    """Lay the call's workspace out in one store (see cct.core.workspace.Arena.plan)."""
    images = batch if _whole(batch, chunk) else cast(int, chunk)
    ws.plan(slot_bytes(geom, int(lowering_type), images, np.dtype(dtype).itemsize))


# Output planes from which a pointwise convolution multiplies image by image at any batch: one GEMM per
# image beat the lowerings' batch-wide GEMM and copies from 14x14 up (BENCHMARKS.md, "Behind lowering/__init__.py").
POINTWISE_PIXELS = 196


def pointwise(geom: ConvGeometry, batch: int) -> bool:
    """Whether a forward multiplies image by image without lowering: a 1x1
    kernel at stride 1 without padding in one group makes every lowered
    matrix the input itself, so y[n] (O, H*W) = w (O, C) @ x[n] (C, H*W)
    reads and writes the blobs' own layouts, with no copy (a batch of one
    image always; larger ones on planes of POINTWISE_PIXELS or more)."""
    return (geom.kernel_h == geom.kernel_w == 1 and geom.stride_h == geom.stride_w == 1
            and geom.pad_h == geom.pad_w == 0 and geom.group == 1 and geom.overrun_h == geom.overrun_w == 0
            and (batch == 1 or geom.in_h * geom.in_w >= POINTWISE_PIXELS))


def _pointwise_forward(x: FloatArray, w: FloatArray, geom: ConvGeometry, out: Optional[FloatArray],
                       bias: Optional[FloatArray], relu: Optional[float]) -> FloatArray:
    n, pixels = x.shape[0], geom.in_h * geom.in_w
    shape = geom.output_shape(n)
    target = out if out is not None and out.flags.c_contiguous else np.empty(shape, x.dtype)
    product = target.reshape(n, geom.num_output, pixels)
    np.matmul(weights_as(w, x.dtype).reshape(geom.num_output, geom.channels), x.reshape(n, geom.channels, pixels),
              out=product)
    finish(product, bias, relu)
    if out is not None and target is not out:
        out[...] = target
        return out
    return target


def bind_pointwise(x: FloatArray, w: FloatArray, out: FloatArray,
                   geom: ConvGeometry) -> Optional[Callable[[Optional[FloatArray], Optional[float]], None]]:
    """The pointwise forward of these arrays (_pointwise_forward's numbers)
    as one call of (bias, relu), its views made now; None where the arrays
    need the per-call path's copies (weights of another dtype, a strided
    array). For an execution plan, whose arrays stay while its layout does."""
    if w.dtype != x.dtype or not (x.flags.c_contiguous and out.flags.c_contiguous and w.flags.c_contiguous):
        return None
    n, pixels = x.shape[0], geom.in_h * geom.in_w
    weights = w.reshape(geom.num_output, geom.channels)
    inputs, product = x.reshape(n, geom.channels, pixels), out.reshape(n, geom.num_output, pixels)

    def forward(bias: Optional[FloatArray], relu: Optional[float]) -> None:
        np.matmul(weights, inputs, out=product)
        finish(product, bias, relu)
    return forward


def bind_conv_forward(x: FloatArray, w: FloatArray, geom: ConvGeometry, lowering_type: int, out: FloatArray,
                      chunk: Optional[int]) -> Optional[Callable[[Optional[FloatArray], Optional[float]], None]]:
    """conv_forward's numbers for these arrays, with nothing kept for a
    backward, as one call of (bias, relu) bound now, where conv_forward would
    take a path that has a bound form: the pointwise product, or type 1's
    one-image lowering of a small image (type1.bind_one_image); else None."""
    impl = lowering(lowering_type)
    path = _forward_path(geom, x, impl, out, chunk, keeps=False)
    if path == "pointwise":
        return bind_pointwise(x, w, out, geom)
    if path == "whole" and impl is type1:
        return type1.bind_one_image(x, w, geom, out)
    return None


def _forward_path(geom: ConvGeometry, x: FloatArray, impl: ModuleType, out: Optional[FloatArray],
                  chunk: Optional[int], keeps: bool) -> str:
    """Which way conv_forward computes these arrays: "empty" (the bias
    alone), "pointwise", "depthwise", "bands" (type 1, one image), "whole"
    (the lowering type's forward of the batch) or "chunks". One place, so
    that bind_conv_forward binds only the path conv_forward takes."""
    n = x.shape[0]
    if n == 0 or geom.empty:          # an empty batch (or partition), input or output: nothing to lower
        return "empty"
    if pointwise(geom, n):            # nothing to lower, so nothing kept: a backward multiplies x itself
        return "pointwise"
    if depthwise.applies(geom):       # one channel per group: the windows directly, nothing lowered or kept
        return "depthwise"
    if (impl is type1 and not keeps and out is not None and out.flags.c_contiguous
            and type1.band_rows(geom, n, x.dtype.itemsize)):
        return "bands"
    return "whole" if _whole(n, chunk) else "chunks"


def _zeros(shape: Shape4, dtype: npt.DTypeLike, out: Optional[FloatArray]) -> FloatArray:
    if out is None:
        return np.zeros(shape, dtype)
    out[...] = 0
    return out


def _bias_only(geom: ConvGeometry, n: int, dtype: npt.DTypeLike, out: Optional[FloatArray], bias: Optional[FloatArray],
               relu: Optional[float]) -> FloatArray:
    """The output of a convolution that multiplies nothing (geom.empty or no
    images): each window reads only zeros (padding), so the bias alone, or 0."""
    out = _zeros(geom.output_shape(n), dtype, out)
    if out.size:
        finish(out, bias, relu)
    return out


def conv_forward(x: FloatArray, w: FloatArray, geom: ConvGeometry, lowering_type: int = 1,
                 out: Optional[FloatArray] = None, ws: Workspace = FRESH, chunk: Optional[int] = None,
                 bias: Optional[FloatArray] = None, keep: Optional[KeptLowering] = None,
                 relu: Optional[float] = None, threads: int = 1) -> FloatArray:
    """y (N, O, OH, OW) = conv(x (N, C, H, W), w (O, C/group, KH, KW)), plus
    bias (O,) when given (added while the result is stored, no extra pass),
    then a ReLU of negative slope `relu` when given (the same numbers as
    cct's ReLU layer after it: cct.runtime.fusion's output ReLU; in the
    store's pass where the output has one).
    `keep` (a cct.lowering.kept.KeptLowering) keeps the lowered matrix and x
    for conv_backward's `lowered`: a whole batch only, a chunked call keeps nothing.
    `threads` (those a layer run whole is given) share a one-image forward
    in bands among them (type1.forward_in_bands); other paths ignore it."""
    impl, n = lowering(lowering_type), x.shape[0]
    if keep is not None:
        keep.forget()
    path = _forward_path(geom, x, impl, out, chunk, keeps=keep is not None)
    if path == "empty":
        return _bias_only(geom, n, x.dtype, out, bias, relu)
    if path == "pointwise":
        return _pointwise_forward(x, w, geom, out, bias, relu)
    if path == "depthwise":
        return depthwise.forward(x, w, geom, out, bias, relu)
    if path == "bands":
        rows = type1.band_rows(geom, n, x.dtype.itemsize)
        pieces = len(type1.band_pieces(geom, rows, threads))
        ws.plan(band_slot_bytes(geom, rows, x.dtype.itemsize, pieces))      # a band a thread, not the whole lowering
        return type1.forward_in_bands(x, w, geom, rows, cast(FloatArray, out), ws=ws, bias=bias, relu=relu,
                                      threads=threads)
    _plan(ws, geom, lowering_type, n, chunk, x.dtype)
    if path == "whole":
        y = impl.forward(x, w, geom, out=out, ws=ws if keep is None else keep.workspace(ws, lowering_type), bias=bias,
                         relu=relu)
        if keep is not None:
            keep.record(x, lowering_type, geom)
        return y
    out = np.empty(geom.output_shape(n), x.dtype) if out is None else out
    for start, stop in chunks(n, cast(int, chunk)):          # (not whole: a chunk is given)
        impl.forward(x[start:stop], w, geom, out=out[start:stop], ws=ws, bias=bias, relu=relu)
    return out


def conv_backward(x: Optional[FloatArray], dy: FloatArray, w: Optional[FloatArray], geom: ConvGeometry,
                  lowering_type: int = 1, data: bool = True, weights: bool = True, ws: Workspace = FRESH,
                  chunk: Optional[int] = None, dx_out: Optional[FloatArray] = None,
                  lowered: Optional[FloatArray] = None) -> Tuple[Optional[FloatArray], Optional[FloatArray]]:
    """(dx or None, dw or None); types 2 and 3 share their unlifted dy between the
    two. dx goes into `dx_out` when given; dw is summed over the chunks.
    `lowered`: x's lowered matrix the forward kept (KeptLowering.matrix_for),
    read instead of lowering x again (a whole batch only); the weight
    gradient reads it before the data gradient asks `ws` for its slot."""
    impl, n = lowering(lowering_type), dy.shape[0]
    if n == 0 or geom.empty:          # nothing lowered: the gradients are zero (or empty)
        dx = _zeros(geom.input_shape(n), dy.dtype, dx_out) if data else None
        return dx, (np.zeros(geom.weight_shape, dy.dtype) if weights else None)
    if depthwise.applies(geom):
        return depthwise.backward(x, dy, w, geom, data=data, weights=weights, dx_out=dx_out)
    _plan(ws, geom, lowering_type, n, chunk, dy.dtype)
    if _whole(n, chunk):
        return impl.backward(x, dy, w, geom, data=data, weights=weights, ws=ws, dx_out=dx_out, lowered=lowered)
    if data and dx_out is None:
        dx_out = np.empty(geom.input_shape(n), dy.dtype)
    dw = None
    for start, stop in chunks(n, cast(int, chunk)):          # (not whole: a chunk is given)
        _, part = impl.backward(None if x is None else x[start:stop], dy[start:stop], w, geom, data=data,
                                weights=weights, ws=ws, dx_out=cast(FloatArray, dx_out)[start:stop] if data else None)
        if weights and dw is None:
            dw = part
        elif weights:
            dw += part
    return (dx_out if data else None), dw


def conv_backward_data(dy: FloatArray, w: FloatArray, geom: ConvGeometry, lowering_type: int = 1,
                       out: Optional[FloatArray] = None, ws: Workspace = FRESH,
                       chunk: Optional[int] = None) -> Optional[FloatArray]:
    """dx (N, C, H, W) from dy (N, O, OH, OW)."""
    return conv_backward(None, dy, w, geom, lowering_type, weights=False, ws=ws, chunk=chunk, dx_out=out)[0]


def conv_backward_weights(x: FloatArray, dy: FloatArray, geom: ConvGeometry, lowering_type: int = 1,
                          out: Optional[FloatArray] = None, ws: Workspace = FRESH,
                          chunk: Optional[int] = None) -> Optional[FloatArray]:
    """dw (O, C/group, KH, KW) from x and dy (set, not accumulated)."""
    dw = conv_backward(x, dy, None, geom, lowering_type, data=False, ws=ws, chunk=chunk)[1]
    if out is None:
        return dw
    out[...] = dw
    return out


__all__ = ["ConvGeometry", "LOWERINGS", "lowering", "conv_forward", "bind_pointwise", "bind_conv_forward", "conv_backward_data",
           "conv_backward_weights", "conv_backward"]
