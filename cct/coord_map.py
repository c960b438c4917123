"""pycaffe's coord_map: how the spatial coordinates of two NetSpec tops relate,
so that a fully convolutional net (FCN) can crop an upsampled score map back
onto its input with the right Crop offsets.

    from cct.coord_map import coord_map_from_to, crop
    axis, scale, shift = coord_map_from_to(n.upscore, n.data)
    n.score = crop(n.upscore, n.data)      # L.Crop(n.upscore, n.data, crop_param={axis, offset})

A map (axis, a, b) says: coordinate x of the input lands at a * x + b in the
output, on every axis from `axis` on (a and b are arrays, one value per
spatial axis, or one value for all). The layers that have a map:
- Convolution, Pooling, Im2col (kernel k, stride s, pad p, dilation d; the
  effective kernel K = (k - 1) * d + 1): a = 1 / s, b = (p - (K - 1) / 2) / s;
- Deconvolution: a = s, b = (K - 1) / 2 - p (the convolution's inverse);
- the pointwise layers of PASS_THROUGH_LAYERS: the identity, on any axis;
- Crop (axis c, offsets o): a = 1, b = -o on axis c - 1 (its first bottom only:
  the second gives the output size, not coordinates).
Any other layer (InnerProduct, a global pooling, ...) ends the walk: tops
connected only through them have no map (RuntimeError).
"""
import numpy as np

from cct.core.errors import ConfigError
from cct.net_spec import assign_proto, layers as L
from cct.proto import caffe_pb2

PASS_THROUGH_LAYERS = ("AbsVal", "BatchNorm", "Bias", "BNLL", "Dropout", "Eltwise", "ELU", "Log", "LRN", "Exp",
                       "MVN", "Power", "ReLU", "PReLU", "Scale", "Sigmoid", "Split", "TanH", "Threshold")
IDENTITY = (None, 1, 0)


class UndefinedMapException(Exception):
    """A layer type without a coordinate map (the walk stops at it)."""


class AxisMismatchException(ConfigError):
    """Two maps on different axes cannot be composed."""


def _array(values, default):
    """A repeated proto field (or one scalar) as a float array; `default` when empty."""
    values = list(values) if hasattr(values, "__len__") else [values]
    return np.array(values or [default], dtype=np.float64, ndmin=1)


def _param_message(fn, field):
    """Layer `fn`'s `field` message (convolution_param, pooling_param, crop_param),
    with the proto's defaults, from its NetSpec keywords given nested
    (convolution_param=dict(...)) or flat (kernel_size=3), as pycaffe's coord_map
    reads them: flat works for Deconvolution and Im2col too, which share
    convolution_param without a message named after them."""
    holder = caffe_pb2.LayerParameter()
    message = getattr(holder, field)
    if field in fn.params:
        assign_proto(holder, field, fn.params[field])
        return message
    for key, value in fn.params.items():
        if key in message.DESCRIPTOR.fields_by_name:
            assign_proto(message, key, value)
    return message


def _legacy_fields(message, names):
    return [name for name in names if message.HasField(name)]


def kernel_geometry(fn):
    """(axis, stride, effective kernel, pad) of a Convolution, Deconvolution,
    Im2col or Pooling layer, from its parameters with Caffe's defaults."""
    if fn.type_name == "Pooling":
        param, axis = _param_message(fn, "pooling_param"), 1
        if param.global_pooling:
            raise UndefinedMapException("global pooling keeps no coordinates")
        kernel, dilation = _array(param.kernel_size, 0), _array(1, 1)
    else:
        param = _param_message(fn, "convolution_param")
        axis, kernel, dilation = param.axis, _array(param.kernel_size, 0), _array(param.dilation, 1)
    legacy = _legacy_fields(param, ("kernel_h", "kernel_w", "stride_h", "stride_w", "pad_h", "pad_w"))
    if legacy:
        raise ConfigError(f"coord_map: layer {fn.type_name}: {', '.join(legacy)}: the legacy _h/_w fields "
                          "are not supported; give kernel_size/stride/pad as lists")
    return axis, _array(param.stride, 1), (kernel - 1) * dilation + 1, _array(param.pad, 0)


def coord_map(fn):
    """The (axis, a, b) map from the bottoms of layer `fn` (a net_spec Function) to its tops."""
    if fn.type_name in ("Convolution", "Pooling", "Im2col"):
        axis, stride, kernel, pad = kernel_geometry(fn)
        return axis, 1 / stride, (pad - (kernel - 1) / 2) / stride
    if fn.type_name == "Deconvolution":
        axis, stride, kernel, pad = kernel_geometry(fn)
        return axis, stride, (kernel - 1) / 2 - pad
    if fn.type_name in PASS_THROUGH_LAYERS:
        return IDENTITY
    if fn.type_name == "Crop":
        param = _param_message(fn, "crop_param")
        return param.axis - 1, 1, -_array(param.offset, 0)    # axis - 1: the last axis left alone
    raise UndefinedMapException(f"{fn.type_name} has no coordinate map")


def compose(base_map, next_map):
    """The map that applies base_map, then next_map: scales multiply, and the
    second shift is scaled by the first scale. An identity (axis None) takes the other's axis."""
    axis1, a1, b1 = base_map
    axis2, a2, b2 = next_map
    if axis1 is not None and axis2 is not None and axis1 != axis2:
        raise AxisMismatchException(f"coord_map: cannot compose maps on axis {axis1} and axis {axis2}")
    return (axis2 if axis1 is None else axis1), a1 * a2, a1 * b2 + b1


def inverse(coord_map):
    """The map back: x = (y - b) / a."""
    axis, a, b = coord_map
    return axis, 1 / a, -b / a


def _mapped_bottoms(top):
    """The bottoms a top's coordinates come from: all of them, but Crop's first only."""
    inputs = top.fn.inputs
    return inputs[:1] if top.fn.type_name == "Crop" else inputs


def _ancestor_maps(top, stop=None):
    """{ancestor top: map from that ancestor to `top`}, `top` itself included,
    walking bottoms through every layer that has a map. With `stop`: returns
    (ancestor, map) at the first ancestor found in `stop`, else None."""
    maps = {top: IDENTITY}
    frontier = [top]
    while frontier:
        current = frontier.pop()
        if stop is not None and current in stop:
            return current, maps[current]
        try:
            layer_map = coord_map(current.fn) if _mapped_bottoms(current) else None
        except UndefinedMapException:
            continue
        for bottom in _mapped_bottoms(current):
            maps[bottom] = compose(maps[current], layer_map)
            frontier.append(bottom)
    return maps if stop is None else None


def coord_map_from_to(top_from, top_to):
    """The map (axis, a, b) from top_from's coordinates to top_to's: walk back
    from both to a common ancestor and compose to_map with from_map's inverse.
    RuntimeError when no ancestor is reached through layers that have a map."""
    from_maps = _ancestor_maps(top_from)
    found = _ancestor_maps(top_to, stop=from_maps)
    if found is None:
        raise RuntimeError(f"coord_map: no map from {top_from.fn.type_name} top to {top_to.fn.type_name} top: "
                           "they are not connected by spatial layers (Convolution, Pooling, Deconvolution, "
                           "Crop, pointwise layers)")
    ancestor, to_map = found
    return compose(to_map, inverse(from_maps[ancestor]))


def crop(top_from, top_to):
    """L.Crop(top_from, top_to) with the axis and offsets that align top_from onto
    top_to. AssertionError (pycaffe's) when their scales differ, or when the
    offset is negative (top_from would be smaller) or not a whole number."""
    axis, a, b = coord_map_from_to(top_from, top_to)
    if not np.all(a == 1):
        raise AssertionError(f"crop: scale mismatch between the tops (a = {a}): they are not the same resolution")
    if not np.all(b <= 0):
        raise AssertionError(f"crop: cannot crop a negative offset (b = {b}): the cropped top would be smaller")
    if not np.all(np.round(b) == b):
        raise AssertionError(f"crop: cannot crop a fractional offset (b = {b})")
    axis = 1 if axis is None else axis          # an identity map: crop from Caffe's default axis 2
    offset = [int(value) for value in -np.round(np.atleast_1d(b))]
    return L.Crop(top_from, top_to, crop_param=dict(axis=axis + 1, offset=offset))
