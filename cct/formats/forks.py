"""Binary nets and .caffemodels written by Caffe's forks, whose LayerParameter
field numbers clash with BVLC's (FORKS.md).

protobuf reads a fork's field by its number, so DeepLab's `interp_param`
(143) lands in BVLC's `input_param`, where its values are unknown fields or,
worse, read as BVLC's (SegNet's upsample scale_w, a varint, becomes
embed_param's bias_term, a bool). cct's schema gives those fork fields other
numbers (proto/caffe.proto); after a binary NetParameter is parsed,
resolve_fork_fields re-parses, for each layer of a fork's type, the bytes of
the fork's field, taken from the file, into cct's field, and clears the BVLC
field. MobileNet-YOLO numbers reorg_param 149 and upsample_param 150, free
in BVLC's schema: they land in cct's mobilenet_yolo_* fields and move the
same way, an Upsample scale it leaves unset taking its default
(FORK_DEFAULTS). SegNet's BN (field 45, its own numbering) lands in cct's
segnet_bn_param and moves into bn_param's SegNet fields. The YOLOv2 port's
DetectionOutput keeps SSD's field 204 with its own numbers inside: told by
their wire types, they are renumbered into cct's (YOLO_NUMBERS). Text
prototxts match fields by name and need none of this.
"""
from cct.formats import wire
from cct.proto import caffe_pb2

# layer type -> for each fork that numbers its field otherwise: (the fork's
# LayerParameter field number, the field its bytes land in when protobuf
# parses them with cct's schema, cct's field for them)
FORK_FIELDS = {
    "Interp": ((143, "input_param", "interp_param"),),                      # DeepLab v2, PSPNet
    "Upsample": ((137, "embed_param", "upsample_param"),                    # SegNet
                 (150, "mobilenet_yolo_upsample_param", "upsample_param")),  # MobileNet-YOLO
    "Reorg": ((147, "swish_param", "reorg_param"),                          # the YOLOv2 port
              (149, "mobilenet_yolo_reorg_param", "reorg_param")),          # MobileNet-YOLO
    "BN": ((45, "segnet_bn_param", "bn_param"),),                           # SegNet
}
# A fork's defaults where its message's differ from cct's, by its field number:
# MobileNet-YOLO's UpsampleParameter.scale defaults to 1 (SegNet's and cct's to 2).
FORK_DEFAULTS = {150: {"scale": 1}}
_LAYER = 100                                                 # NetParameter.layer
# The YOLOv2 port's DetectionOutputParameter has SSD's name and LayerParameter
# number (204) and numbers of its own inside; cct's message holds both, the
# port's fields at other numbers: the port's number -> cct's.
YOLO_DETECTION = 204
YOLO_NUMBERS = {1: 101, 2: 1, 3: 102, 4: 103, 5: 9, 6: 104, 7: 105, 8: 106}
# The wire types SSD's fields 4-8 have (nms_param, save_output_param, code_type,
# keep_top_k, variance_encoded_in_target): another there is the port's field.
_SSD_WIRE = {4: 2, 5: 2, 6: 0, 7: 0, 8: 0}


def resolve_fork_fields(net_param, data):
    """Move the fork fields of `net_param`'s layers, parsed from the bytes
    `data`, into cct's fields (see the module's docstring); returns the names
    of the layers changed."""
    landed = {index: fork for index, layer in enumerate(net_param.layer)
              for fork in FORK_FIELDS.get(layer.type, ()) if layer.HasField(fork[1])}
    detections = {index: (YOLO_DETECTION, "detection_output_param", "detection_output_param")
                  for index, layer in enumerate(net_param.layer)
                  if layer.type == "DetectionOutput" and layer.HasField("detection_output_param")}
    if not landed and not detections:
        return []
    payloads = _fork_payloads(data, {**landed, **detections}, net_param)
    for index, fork in landed.items():
        _move(net_param.layer[index], fork, payloads[index])
    moved = list(landed)
    for index in detections:
        if _yolo_numbered(payloads[index]):
            net_param.layer[index].ClearField("detection_output_param")
            net_param.layer[index].detection_output_param.MergeFromString(_renumbered(payloads[index]))
            moved.append(index)
    return [net_param.layer[index].name for index in sorted(moved)]


def _fork_payloads(data, fields, net_param):
    """{layer index: the bytes of its fork field} for the layers of `fields`
    ({index: (fork number, field it lands in, cct's field)}), each field's
    occurrences joined (protobuf merges them so). Where the bytes take a form
    the walk leaves to protobuf, the parsed field serialized again (unknown
    fields included; exact but for values read as a BVLC bool)."""
    try:
        payloads, index = {}, 0
        for number, wire_type, _, start, end in wire.fields(data, 0, len(data)):
            if number != _LAYER or wire_type != 2:
                continue
            if index in fields:
                fork_number = fields[index][0]
                payloads[index] = b"".join(bytes(data[value_start:value_end]) for field, kind, _, value_start,
                                           value_end in wire.fields(data, start, end)
                                           if field == fork_number and kind == 2)
            index += 1
        return payloads
    except wire.Unexpected:
        return {i: getattr(net_param.layer[i], landed).SerializeToString() for i, (_, landed, _) in fields.items()}


def _yolo_numbered(payload):
    """Whether a DetectionOutputParameter's bytes are the YOLOv2 port's: one of
    fields 4-8 has a wire type SSD's field of that number cannot have (the
    port's coords, confidence_threshold, nms_threshold, biases, label_map_file;
    its forward needs biases, so every net of it has one)."""
    try:
        return any(_SSD_WIRE.get(number, wire_type) != wire_type
                   for number, wire_type, _, _, _ in wire.fields(payload, 0, len(payload)))
    except wire.Unexpected:
        return False


def _renumbered(payload):
    """The port's DetectionOutputParameter bytes with cct's field numbers (YOLO_NUMBERS)."""
    out = []
    for number, wire_type, start, _, end in wire.fields(payload, 0, len(payload)):
        key = wire.varint((number << 3) | wire_type)
        new = YOLO_NUMBERS.get(number, number)
        out.append(wire.varint((new << 3) | wire_type) + bytes(payload[start + len(key):end]))
    return b"".join(out)


def _move(layer, fork, payload):
    number, landed, ours = fork
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
    target = getattr(layer, ours)
    target.MergeFromString(payload)
    for name, value in FORK_DEFAULTS.get(number, {}).items():
        if not target.HasField(name):
            setattr(target, name, value)
