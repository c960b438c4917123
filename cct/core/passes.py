"""Pure NetParameter -> NetParameter passes that build the net Caffe runs:
filter_net keeps the layers whose include/exclude rules match the NetState,
insert_splits gives every blob read by several layers a Split layer."""
from collections import defaultdict
from typing import DefaultDict, Dict, Tuple

from cct.core.errors import ConfigError
from cct.proto import caffe_pb2

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
