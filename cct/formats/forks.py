"""Binary nets and .caffemodels written by Caffe's forks, whose LayerParameter
field numbers clash with BVLC's (FORKS.md).

protobuf reads a fork's field by its number, so DeepLab's `interp_param`
(143) lands in BVLC's `input_param`, where its values are unknown fields or,
worse, read as BVLC's (SegNet's upsample scale_w, a varint, becomes
embed_param's bias_term, a bool). cct's schema gives those fork fields other
numbers (proto/caffe.proto); after a binary NetParameter is parsed,
resolve_fork_fields re-parses, for each layer of a fork's type, the bytes of
the fork's field, taken from the file, into cct's field, and clears the BVLC
field. SegNet's BN (field 45, its own numbering) lands in cct's
segnet_bn_param and moves into bn_param's SegNet fields. Text prototxts match
fields by name and need none of this.
"""
from cct.formats import wire
from cct.proto import caffe_pb2

# layer type -> (the fork's LayerParameter field number, the field its bytes
# land in when protobuf parses them with cct's schema, cct's field for them)
FORK_FIELDS = {
    "Interp": (143, "input_param", "interp_param"),          # DeepLab v2, PSPNet
    "Upsample": (137, "embed_param", "upsample_param"),      # SegNet
    "Reorg": (147, "swish_param", "reorg_param"),            # the YOLOv2 port
    "BN": (45, "segnet_bn_param", "bn_param"),               # SegNet
}
_LAYER = 100                                                 # NetParameter.layer


def resolve_fork_fields(net_param, data):
    """Move the fork fields of `net_param`'s layers, parsed from the bytes
    `data`, into cct's fields (see the module's docstring); returns the names
    of the layers changed."""
    landed = [index for index, layer in enumerate(net_param.layer)
              if layer.type in FORK_FIELDS and layer.HasField(FORK_FIELDS[layer.type][1])]
    if not landed:
        return []
    payloads = _fork_payloads(data, landed, net_param)
    for index in landed:
        _move(net_param.layer[index], payloads[index])
    return [net_param.layer[index].name for index in landed]


def _fork_payloads(data, indices, net_param):
    """{layer index: the bytes of its fork field} for the layers at `indices`,
    each field's occurrences joined (protobuf merges them so). Where the bytes
    take a form the walk leaves to protobuf, the parsed field serialized again
    (unknown fields included; exact but for values read as a BVLC bool)."""
    wanted = set(indices)
    try:
        payloads, index = {}, 0
        for number, wire_type, _, start, end in wire.fields(data, 0, len(data)):
            if number != _LAYER or wire_type != 2:
                continue
            if index in wanted:
                fork_number = FORK_FIELDS[net_param.layer[index].type][0]
                payloads[index] = b"".join(bytes(data[value_start:value_end]) for field, kind, _, value_start,
                                           value_end in wire.fields(data, start, end)
                                           if field == fork_number and kind == 2)
            index += 1
        return payloads
    except wire.Unexpected:
        return {i: getattr(net_param.layer[i], FORK_FIELDS[net_param.layer[i].type][1]).SerializeToString()
                for i in indices}


def _move(layer, payload):
    _, landed, ours = FORK_FIELDS[layer.type]
    layer.ClearField(landed)
    if landed == "segnet_bn_param":
        segnet = caffe_pb2.SegNetBNParameter.FromString(payload)
        target = layer.bn_param
        for field, value in segnet.ListFields():
            if field.message_type is not None:
                getattr(target, field.name).CopyFrom(value)
            else:
                setattr(target, field.name, value)
        return
    getattr(layer, ours).MergeFromString(payload)
