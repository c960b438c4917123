"""Pure NetParameter -> NetParameter passes that build the net Caffe runs:
filter_net keeps the layers whose include/exclude rules match the NetState,
insert_splits gives every blob read by several layers a Split layer,
legacy_crop_offsets gives the forks' parameterless Crop its offsets."""
import logging
from collections import defaultdict
from fractions import Fraction
from typing import DefaultDict, Dict, Tuple

from cct.core.errors import ConfigError
from cct.proto import caffe_pb2

log = logging.getLogger("cct.core.passes")

Place = Tuple[int, int]                # (layer index, top or bottom index)


def state_meets_rule(state: caffe_pb2.NetState, rule: caffe_pb2.NetStateRule) -> bool:
    """Caffe's Net::StateMeetsRule: phase, level range, required and forbidden stages."""
    if rule.HasField("phase") and rule.phase != state.phase:
        return False
    if rule.HasField("min_level") and state.level < rule.min_level:
        return False
    if rule.HasField("max_level") and state.level > rule.max_level:
        return False
    stages = set(state.stage)
    if any(stage not in stages for stage in rule.stage):
        return False
    return not any(stage in stages for stage in rule.not_stage)


def filter_net(net: caffe_pb2.NetParameter, state: caffe_pb2.NetState,
               source: str = "<net>") -> caffe_pb2.NetParameter:
    """Keep the layers that the NetState admits (Caffe's Net::FilterNet)."""
    filtered = caffe_pb2.NetParameter()
    filtered.CopyFrom(net)
    filtered.ClearField("layer")
    for layer in net.layer:
        if len(layer.include) and len(layer.exclude):
            raise ConfigError(f"{source}: layer '{layer.name}' ({layer.type}): include/exclude: "
                              "specify either include rules or exclude rules, not both")
        included = len(layer.include) == 0
        if any(state_meets_rule(state, rule) for rule in layer.exclude):
            included = False
        if any(state_meets_rule(state, rule) for rule in layer.include):
            included = True
        if included:
            filtered.layer.add().CopyFrom(layer)
    return filtered


def split_layer_name(layer_name: str, blob_name: str, top_index: int) -> str:
    return f"{blob_name}_{layer_name}_{top_index}_split"


def split_blob_name(layer_name: str, blob_name: str, top_index: int, split_index: int) -> str:
    return f"{split_layer_name(layer_name, blob_name, top_index)}_{split_index}"


def insert_splits(net: caffe_pb2.NetParameter, source: str = "<net>") -> caffe_pb2.NetParameter:
    """Give each top read more than once a Split layer (Caffe's InsertSplits).

    A top with a non-zero explicit loss_weight counts as one more reader, so its
    loss and its other readers each get their own copy of the gradient.
    """
    producer_of: Dict[str, Place] = {}                   # blob name -> (layer index, top index) last written
    source_of_bottom: Dict[Place, Place] = {}            # (layer, bottom index) -> producing (layer, top)
    readers: DefaultDict[Place, int] = defaultdict(int)  # (layer, top) -> number of readers
    loss_weight_of: Dict[Place, float] = {}              # (layer, top) -> explicit loss weight
    for i, layer in enumerate(net.layer):
        for j, blob in enumerate(layer.bottom):
            if blob not in producer_of:
                raise ConfigError(f"{source}: layer '{layer.name}' ({layer.type}): bottom[{j}]: "
                                  f"unknown blob '{blob}' (no earlier layer produces it)")
            source_of_bottom[i, j] = producer_of[blob]
            readers[producer_of[blob]] += 1
        for j, blob in enumerate(layer.top):
            producer_of[blob] = (i, j)
        for j in range(min(len(layer.loss_weight), len(layer.top))):
            top_id = producer_of[layer.top[j]]
            loss_weight_of[top_id] = layer.loss_weight[j]
            if layer.loss_weight[j]:
                readers[top_id] += 1

    split = caffe_pb2.NetParameter()
    split.CopyFrom(net)
    split.ClearField("layer")
    next_split_index: DefaultDict[Place, int] = defaultdict(int)
    for i, original in enumerate(net.layer):
        layer = split.layer.add()
        layer.CopyFrom(original)
        for j in range(len(layer.bottom)):
            top_id = source_of_bottom[i, j]
            if readers[top_id] > 1:
                producer_name = net.layer[top_id[0]].name
                layer.bottom[j] = split_blob_name(producer_name, layer.bottom[j], top_id[1],
                                                  next_split_index[top_id])
                next_split_index[top_id] += 1
        for j, blob in enumerate(original.top):
            count = readers[i, j]
            if count <= 1:
                continue
            loss_weight = loss_weight_of.get((i, j), 0.0)
            split.layer.add().CopyFrom(_split_layer(original.name, blob, j, count, loss_weight))
            if loss_weight:
                layer.ClearField("loss_weight")
                next_split_index[i, j] += 1   # split top 0 carries the loss
    return split


def _split_layer(layer_name: str, blob_name: str, top_index: int, count: int,
                 loss_weight: float) -> caffe_pb2.LayerParameter:
    layer = caffe_pb2.LayerParameter(name=split_layer_name(layer_name, blob_name, top_index),
                                     type="Split", bottom=[blob_name])
    for k in range(count):
        layer.top.append(split_blob_name(layer_name, blob_name, top_index, k))
        if loss_weight:
            layer.loss_weight.append(loss_weight if k == 0 else 0.0)
    return layer


# --- the forks' parameterless Crop (HED, CRF-RNN) -------------------------------------------------
# Their crop_layer.cpp walks the net's coordinate maps (DiagonalAffineMap: per
# spatial axis, input coordinate x lands at a * x + b) from each bottom back
# to a blob both reach; these layer types have one there, the others none.
_IDENTITY_MAPS = {"AbsVal", "BatchNorm", "Bias", "BNLL", "Clip", "Concat", "Dropout", "Eltwise", "ELU", "Exp",
                  "Log", "LRN", "MVN", "Power", "PReLU", "ReLU", "Scale", "Sigmoid", "Slice", "Softmax", "Split",
                  "Swish", "TanH", "Threshold"}
_IDENTITY = ((Fraction(1), Fraction(0)),) * 2


def _pair(param, name, default):
    """(h, w) of a convolution's or pooling's field: name_h/name_w, or given
    once or per axis (a pooling's fields are single values)."""
    if name != "dilation" and param.HasField(f"{name}_h"):
        return getattr(param, f"{name}_h"), getattr(param, f"{name}_w")
    value = getattr(param, "kernel_size" if name == "kernel" else name)
    if isinstance(value, int):
        return value, value
    values = list(value) or [default]
    return values[0], values[-1]


def _crop_offsets(param):
    """(h, w) offsets of a Crop with crop_param on a 4-d blob (axis 2 by default)."""
    axis = param.axis % 4
    offsets = list(param.offset)
    return tuple(0 if spatial < axis or not offsets else offsets[0] if len(offsets) == 1
                 else offsets[spatial - axis] for spatial in (2, 3))


def _layer_map(layer):
    """The layer's ((a, b) for h, (a, b) for w), or None where it has none:
    a convolution or pooling maps x to (x - ((K - 1) / 2 - p)) / s, a
    deconvolution x to s * x + (K - 1) / 2 - p, a crop x to x - offset."""
    if layer.type in _IDENTITY_MAPS:
        return _IDENTITY
    if layer.type == "Crop":
        return tuple((Fraction(1), Fraction(-offset)) for offset in _crop_offsets(layer.crop_param))
    if layer.type not in ("Convolution", "Deconvolution", "Pooling"):
        return None
    pooling = layer.type == "Pooling"
    param = layer.pooling_param if pooling else layer.convolution_param
    if pooling and param.global_pooling:
        return None
    dilation = (1, 1) if pooling else _pair(param, "dilation", 1)
    axes = zip(_pair(param, "kernel", 1), _pair(param, "stride", 1), _pair(param, "pad", 0), dilation)
    maps = []
    for kernel, stride, pad, step in axes:
        center = Fraction((kernel - 1) * step, 2) - pad
        maps.append((Fraction(stride), center) if layer.type == "Deconvolution"
                    else (Fraction(1, stride), -center / stride))
    return tuple(maps)


def _compose(left, right):
    """left after right, per axis (DiagonalAffineMap::compose)."""
    return tuple((a1 * a2, a1 * b2 + b1) for (a1, b1), (a2, b2) in zip(left, right))


def _inverse(coord_map):
    return tuple((1 / a, -b / a) for a, b in coord_map)


def _legacy_crop_offset(net, layer, producer):
    """(h, w): where the forks' crop_layer.cpp crops bottom[0] to bottom[1]:
    walk back through each layer's first bottom from bottom[0] to its source,
    then from bottom[1] to the first blob of that path, compose the maps on
    the way, and map bottom[0] onto bottom[1]. None where a layer on the way
    has no map, the walks do not meet, or the map is not a whole shift
    toward the inside (the fork stops there)."""
    first, second = layer.bottom[0], layer.bottom[1]
    path, blob = {first}, first
    while blob in producer and net.layer[producer[blob]].bottom:
        blob = net.layer[producer[blob]].bottom[0]
        path.add(blob)
    meet = second
    while meet not in path:
        if meet not in producer or not net.layer[producer[meet]].bottom:
            return None
        meet = net.layer[producer[meet]].bottom[0]
    maps = []
    for blob in (first, second):
        composed = _IDENTITY
        while blob != meet:
            layer_map = _layer_map(net.layer[producer[blob]])
            if layer_map is None:
                return None
            composed = _compose(composed, layer_map)
            blob = net.layer[producer[blob]].bottom[0]
        maps.append(composed)
    crop = _compose(maps[1], _inverse(maps[0]))
    if any(a != 1 or b > 0 or b.denominator != 1 for a, b in crop):
        return None
    return tuple(int(-b) for _, b in crop)


def legacy_crop_offsets(net, source="<net>"):
    """Give each Crop layer without crop_param whose bottoms' coordinate maps
    put bottom[1] at a non-zero offset in bottom[0] the crop_param { axis: 2
    offset: h offset: w } that the forks' parameterless Crop computes from the
    net (HED, CRF-RNN: _legacy_crop_offset); logged, as it replaces BVLC's
    reading (offset 0). Layers are read in order, so a crop behind another
    sees its offsets, as in the fork. Returns a copy."""
    fixed = caffe_pb2.NetParameter()
    fixed.CopyFrom(net)
    producer = {}                          # blob -> the first layer that writes it (in place: not the later ones)
    for index, layer in enumerate(fixed.layer):
        if layer.type == "Crop" and not layer.HasField("crop_param") and len(layer.bottom) == 2:
            offset = _legacy_crop_offset(fixed, layer, producer)
            if offset is not None and any(offset):
                layer.crop_param.axis = 2
                layer.crop_param.offset.extend(offset)
                log.info("%s: layer '%s' (Crop): no crop_param; crops at the legacy offset (h %d, w %d) that "
                         "the forks' Crop (HED, CRF-RNN) computes from the net's geometry, not BVLC's 0",
                         source, layer.name, *offset)
        for top in layer.top:
            producer.setdefault(top, index)
    return fixed
