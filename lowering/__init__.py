"""Convolution by lowering (Caffe con Troll): the batch is lowered to one
matrix, multiplied by the kernel matrix in one GEMM per group, and the product
lifted to the output. Three lowerings trade lowering cost against lifting cost
(see each module's docstring for its matrix shapes):

    1  type1: im2col over the batch, (C*KH*KW) x (N*OH*OW); lifting is a transpose
    2  type2: lowered along the width only, (C*KW) x (N*Hp*OW); lifting sums KH slices
    3  type3: the padded input as is, C x (N*Hp*Wp); lifting sums KH*KW slices

Every function is pure (arrays in, arrays out) and works on any batch, so a
scheduler can call it on a partition of the batch.
"""
from . import type1, type2, type3
from .geometry import ConvGeometry

LOWERINGS = {1: type1, 2: type2, 3: type3}


def lowering(lowering_type):
    try:
        return LOWERINGS[int(lowering_type)]
    except (KeyError, ValueError, TypeError):
        raise ValueError(f"lowering type must be one of {sorted(LOWERINGS)}, got {lowering_type!r}") from None


def conv_forward(x, w, geom, lowering_type=1, out=None):
    """y (N, O, OH, OW) = conv(x (N, C, H, W), w (O, C/group, KH, KW))."""
    return lowering(lowering_type).forward(x, w, geom, out=out)


def conv_backward_data(dy, w, geom, lowering_type=1, out=None):
    """dx (N, C, H, W) from dy (N, O, OH, OW)."""
    return lowering(lowering_type).backward_data(dy, w, geom, out=out)


def conv_backward_weights(x, dy, geom, lowering_type=1, out=None):
    """dw (O, C/group, KH, KW) from x and dy (set, not accumulated)."""
    return lowering(lowering_type).backward_weights(x, dy, geom, out=out)


def conv_backward(x, dy, w, geom, lowering_type=1, data=True, weights=True):
    """(dx or None, dw or None); types 2 and 3 share their unlifted dy between the two."""
    return lowering(lowering_type).backward(x, dy, w, geom, data=data, weights=weights)


__all__ = ["ConvGeometry", "LOWERINGS", "lowering", "conv_forward", "conv_backward_data",
           "conv_backward_weights", "conv_backward"]
