"""Binary nets and .caffemodels written with the forks' field numbers
(cct.formats.forks): DeepLab's interp_param at 143 (BVLC's input_param),
SegNet's upsample_param at 137 (embed_param, whose bool bias_term would
swallow scale_w) and its BN at 45, built here byte by byte as the forks
write them, load with their parameters in cct's fields and their weights
by layer name, through the wire's fast path and protobuf's full parse; and
the same nets as text prototxts. Likewise the YOLOv2 port's DetectionOutput
(its own numbers inside SSD's 204) and MobileNet-YOLO's net (reorg_param 149,
upsample_param 150, its detection outputs at 601 and 602)."""
import numpy as np
import pytest
from google.protobuf import text_format

import cct
from cct.formats import forks, prototxt, wire
from cct.proto import caffe_pb2

RNG = np.random.default_rng(38)
SCALE, SHIFT = RNG.standard_normal(2), RNG.standard_normal(2)

# The net: a SegNet-style pool and unpool, SegNet's BN, DeepLab's Interp.
TEXT = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 dim: 6 dim: 6 } } }
layer { name: "pool" type: "Pooling" bottom: "data" top: "pool" top: "mask" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "bn" type: "BN" bottom: "pool" top: "bn" bn_param { bn_mode: INFERENCE } }
layer { name: "up" type: "Upsample" bottom: "bn" bottom: "mask" top: "up" upsample_param { scale_h: 2 scale_w: 3 upsample_h: 6 upsample_w: 6 } }
layer { name: "interp" type: "Interp" bottom: "up" top: "interp" interp_param { height: 9 width: 4 pad_beg: -1 } }
"""


def fork_layer(name, kind, bottoms, tops, number=None, param=b"", blobs=()):
    """A LayerParameter's bytes with `param` (a fork-numbered message's bytes) at field `number`."""
    layer = caffe_pb2.LayerParameter(name=name, type=kind, bottom=bottoms, top=tops)
    layer.blobs.extend(caffe_pb2.BlobProto(shape=caffe_pb2.BlobShape(dim=np.shape(b)), data=np.ravel(b))
                       for b in blobs)
    data = layer.SerializeToString()
    return data + b"".join(wire.field_pieces(number, [param])) if number else data


def fork_net():
    """The net as SegNet's and DeepLab's Caffe write it (their field numbers), with BN's 2 blobs."""
    segnet_bn = caffe_pb2.SegNetBNParameter(bn_mode=caffe_pb2.BNParameter.INFERENCE).SerializeToString()
    upsample = caffe_pb2.UpsampleParameter(scale_h=2, scale_w=3, upsample_h=6, upsample_w=6).SerializeToString()
    interp = caffe_pb2.InterpParameter(height=9, width=4, pad_beg=-1).SerializeToString()
    data_layer = caffe_pb2.LayerParameter(name="data", type="Input", top=["data"])
    data_layer.input_param.shape.add(dim=[1, 2, 6, 6])
    pool = caffe_pb2.LayerParameter(name="pool", type="Pooling", bottom=["data"], top=["pool", "mask"])
    pool.pooling_param.kernel_size = 2
    pool.pooling_param.stride = 2
    layers = [data_layer.SerializeToString(), pool.SerializeToString(),
              fork_layer("bn", "BN", ["pool"], ["bn"], 45, segnet_bn,
                         [SCALE.reshape(1, 2, 1, 1), SHIFT.reshape(1, 2, 1, 1)]),
              fork_layer("up", "Upsample", ["bn", "mask"], ["up"], 137, upsample),
              fork_layer("interp", "Interp", ["up"], ["interp"], 143, interp)]
    return b"".join(piece for layer in layers for piece in wire.field_pieces(100, [layer]))


def check_params(net_param):
    layers = {layer.name: layer for layer in net_param.layer}
    assert layers["interp"].interp_param == caffe_pb2.InterpParameter(height=9, width=4, pad_beg=-1)
    assert not layers["interp"].HasField("input_param")
    assert layers["up"].upsample_param == caffe_pb2.UpsampleParameter(scale_h=2, scale_w=3, upsample_h=6, upsample_w=6)
    assert not layers["up"].HasField("embed_param")
    assert layers["bn"].bn_param.bn_mode == caffe_pb2.BNParameter.INFERENCE
    assert not layers["bn"].HasField("segnet_bn_param")


def test_protobuf_alone_reads_the_forks_fields_into_bvlcs():
    net = caffe_pb2.NetParameter.FromString(fork_net())
    assert net.layer[3].embed_param.bias_term                   # SegNet's scale_w 3, read as a bool
    assert net.layer[4].HasField("input_param") and not net.layer[4].HasField("interp_param")


def test_a_binary_net_reads_into_ccts_fields(tmp_path):
    path = tmp_path / "net.binaryproto"
    path.write_bytes(fork_net())
    check_params(prototxt.read_net(str(path)))


def expected_forward(x):
    text_net = cct.Net(TEXT, cct.TEST)
    text_net.params["bn"][0].data[...] = SCALE.reshape(1, 2, 1, 1)
    text_net.params["bn"][1].data[...] = SHIFT.reshape(1, 2, 1, 1)
    text_net.blobs["data"].data[...] = x
    return text_net.forward()["interp"].copy()


@pytest.mark.parametrize("path_kind", ["fast", "protobuf"])
def test_a_fork_caffemodel_loads_params_and_weights(tmp_path, monkeypatch, path_kind):
    model = tmp_path / "segnet.caffemodel"
    model.write_bytes(fork_net())
    if path_kind == "protobuf":
        def refuse(data):
            raise wire.Unexpected("forced")
        monkeypatch.setattr("cct.formats.weights.split_blobs", refuse)
    net = cct.Net(TEXT, cct.TEST, weights=str(model))
    np.testing.assert_array_equal(net.params["bn"][0].data.ravel(), SCALE.astype(np.float32))
    np.testing.assert_array_equal(net.params["bn"][1].data.ravel(), SHIFT.astype(np.float32))
    # the binary itself as the net: its fields and its weights
    own = cct.Net(str(model), cct.TEST, weights=str(model))
    x = RNG.standard_normal((1, 2, 6, 6))
    own.blobs["data"].data[...] = x
    np.testing.assert_allclose(own.forward()["interp"], expected_forward(x), rtol=1e-6)
    assert own.blobs["up"].shape == (1, 2, 6, 6) and own.blobs["interp"].shape == (1, 2, 9, 4)


def test_the_table_names_each_clash():
    assert forks.FORK_FIELDS["Interp"] == ((143, "input_param", "interp_param"),)
    for entries in forks.FORK_FIELDS.values():
        for number, landed, ours in entries:
            field = caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name[landed]
            assert field.number == number and ours in caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name


def test_text_prototxts_match_by_name():
    net = cct.Net(TEXT, cct.TEST)
    assert net.layer_dict["bn"].segnet and net.layer_dict["bn"].mode == caffe_pb2.BNParameter.INFERENCE
    assert net.blobs["interp"].shape == (1, 2, 9, 4)
    psp = cct.Net('input: "x" input_shape { dim: 1 dim: 2 dim: 3 dim: 3 } '
                  'layer { name: "bn" type: "BN" bottom: "x" top: "x" bn_param { frozen: true momentum: 0.95 } }'
                  'layer { name: "z" type: "Interp" bottom: "x" top: "z" interp_param { zoom_factor: 2 } }', cct.TEST)
    assert not psp.layer_dict["bn"].segnet and psp.blobs["z"].shape == (1, 2, 5, 5)


def yolo_detection_bytes(biases):
    """The YOLOv2 port's DetectionOutputParameter as it writes it: side = 1,
    num_classes = 2, num_box = 3, coords = 4, confidence_threshold = 5,
    nms_threshold = 6, biases = 7 (unpacked floats), label_map_file = 8."""
    def key(number, kind):
        return wire.varint((number << 3) | kind)
    out = key(1, 0) + wire.varint(7) + key(2, 0) + wire.varint(3) + key(3, 0) + wire.varint(2)
    out += key(4, 0) + wire.varint(4)
    out += key(5, 5) + np.float32(0.25).tobytes() + key(6, 5) + np.float32(0.4).tobytes()
    out += b"".join(key(7, 5) + np.float32(b).tobytes() for b in biases)
    out += key(8, 2) + wire.varint(len(b"labels.txt")) + b"labels.txt"
    return out


def detection_net(param_bytes):
    data_layer = caffe_pb2.LayerParameter(name="data", type="Input", top=["data"])
    data_layer.input_param.shape.add(dim=[1, 2 * (4 + 1 + 3), 7, 7])
    layers = [data_layer.SerializeToString(),
              fork_layer("det", "DetectionOutput", ["data"], ["det"], 204, param_bytes)]
    return b"".join(piece for layer in layers for piece in wire.field_pieces(100, [layer]))


def test_the_yolo_ports_binary_detection_output_reads_into_its_fields(tmp_path):
    """Inside SSD's field 204 the port numbers its own fields 1-8: told by
    their wire types and renumbered, they land in cct's YOLO fields, and the
    net builds the port's layer; an SSD DetectionOutput is left as it is."""
    biases = [1.5, 2.0, 3.25, 4.0]
    path = tmp_path / "yolo.binaryproto"
    path.write_bytes(detection_net(yolo_detection_bytes(biases)))
    p = prototxt.read_net(str(path)).layer[1].detection_output_param
    assert (p.side, p.num_classes, p.num_box, p.coords) == (7, 3, 2, 4)
    assert p.confidence_threshold == np.float32(0.25) and p.nms_threshold == np.float32(0.4)
    assert list(p.biases) == biases and p.label_map_file == "labels.txt"
    assert not p.HasField("share_location") and not p.HasField("background_label_id")
    net = cct.Net(str(path), cct.TEST)
    assert type(net.layers[1]).__name__ == "YoloDetectionOutput"
    ssd = caffe_pb2.DetectionOutputParameter(num_classes=21, share_location=True, background_label_id=0,
                                             keep_top_k=200, confidence_threshold=0.01, code_type=2)
    ssd.nms_param.nms_threshold = 0.45
    path.write_bytes(detection_net(ssd.SerializeToString()))
    assert prototxt.read_net(str(path)).layer[1].detection_output_param == ssd


def key(number, kind):
    return wire.varint((number << 3) | kind)


def mobilenet_yolo_net():
    """A net as MobileNet-YOLO (eric612/MobileNet-YOLO@69b4441cb3ec, its caffe.proto)
    writes it, byte by byte: upsample_param 150 { scale = 1 }, reorg_param 149
    { stride = 1 }, yolov3_detection_output_param 602 { num_classes = 1,
    num_box = 2, confidence_threshold = 3, nms_threshold = 4, biases = 5,
    anchors_scale = 6, mask_group_num = 7, mask = 8 } (repeated fields
    unpacked, as proto2 writes them), yolo_detection_output_param 601 { side =
    1, num_classes = 2, num_box = 3, coords = 4, confidence_threshold = 5,
    nms_threshold = 6, biases = 7 }."""
    v3 = key(1, 0) + wire.varint(2) + key(2, 0) + wire.varint(2)
    v3 += key(3, 5) + np.float32(0.3).tobytes() + key(4, 5) + np.float32(0.4).tobytes()
    v3 += b"".join(key(5, 5) + np.float32(b).tobytes() for b in (10, 14, 23, 27, 37, 58, 81, 82))
    v3 += key(6, 0) + wire.varint(8) + key(6, 0) + wire.varint(4) + key(7, 0) + wire.varint(2)
    v3 += b"".join(key(8, 0) + wire.varint(m) for m in (2, 3, 0, 1))
    v2 = key(1, 0) + wire.varint(9) + key(2, 0) + wire.varint(2) + key(3, 0) + wire.varint(2)
    v2 += key(4, 0) + wire.varint(4) + key(5, 5) + np.float32(0.2).tobytes() + key(6, 5) + np.float32(0.5).tobytes()
    v2 += b"".join(key(7, 5) + np.float32(b).tobytes() for b in (1.5, 2.0, 3.25, 4.0))
    data_layer = caffe_pb2.LayerParameter(name="data", type="Input", top=["data"])
    data_layer.input_param.shape.add(dim=[1, 14, 2, 2])
    feat_layer = caffe_pb2.LayerParameter(name="feat", type="Input", top=["feat"])
    feat_layer.input_param.shape.add(dim=[1, 4, 4, 4])
    layers = [data_layer.SerializeToString(),
              fork_layer("up", "Upsample", ["data"], ["up"], 150, key(1, 0) + wire.varint(2)),
              feat_layer.SerializeToString(),
              fork_layer("reorg", "Reorg", ["feat"], ["reorg"], 149, key(1, 0) + wire.varint(2)),
              fork_layer("det", "Yolov3DetectionOutput", ["data", "up"], ["det"], 602, v3),
              fork_layer("det2", "YoloDetectionOutput", ["up"], ["det2"], 601, v2)]
    return b"".join(piece for layer in layers for piece in wire.field_pieces(100, [layer]))


MOBILENET_YOLO_TEXT = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 14 dim: 2 dim: 2 } } }
layer { name: "up" type: "Upsample" bottom: "data" top: "up" upsample_param { scale: 2 } }
layer { name: "feat" type: "Input" top: "feat" input_param { shape { dim: 1 dim: 4 dim: 4 dim: 4 } } }
layer { name: "reorg" type: "Reorg" bottom: "feat" top: "reorg" reorg_param { stride: 2 } }
layer { name: "det" type: "Yolov3DetectionOutput" bottom: "data" bottom: "up" top: "det"
        yolov3_detection_output_param { num_classes: 2 num_box: 2 confidence_threshold: 0.3 nms_threshold: 0.4
        biases: 10 biases: 14 biases: 23 biases: 27 biases: 37 biases: 58 biases: 81 biases: 82
        anchors_scale: 8 anchors_scale: 4 mask_group_num: 2 mask: 2 mask: 3 mask: 0 mask: 1 } }
layer { name: "det2" type: "YoloDetectionOutput" bottom: "up" top: "det2"
        yolo_detection_output_param { side: 9 num_classes: 2 num_box: 2 coords: 4 confidence_threshold: 0.2
        nms_threshold: 0.5 biases: 1.5 biases: 2.0 biases: 3.25 biases: 4.0 } }
"""


def test_mobilenet_yolos_binary_fields_read_into_ccts(tmp_path):
    """Its Upsample and Reorg fields (149 and 150: free in BVLC's schema, so
    protobuf puts them in cct's placeholders for them) move into
    upsample_param and reorg_param; its detection outputs' fields are read
    at their own numbers; the binary net runs as the same net in text."""
    landed = caffe_pb2.NetParameter.FromString(mobilenet_yolo_net())
    assert landed.layer[1].mobilenet_yolo_upsample_param.scale == 2 and not landed.layer[1].HasField("upsample_param")
    assert landed.layer[3].mobilenet_yolo_reorg_param.stride == 2 and not landed.layer[3].HasField("reorg_param")
    path = tmp_path / "mobilenet_yolo.binaryproto"
    path.write_bytes(mobilenet_yolo_net())
    read = prototxt.read_net(str(path))
    assert read == text_format.Parse(MOBILENET_YOLO_TEXT, caffe_pb2.NetParameter())
    text = cct.Net(MOBILENET_YOLO_TEXT, cct.TEST)
    binary = cct.Net(str(path), cct.TEST)
    x, feat = RNG.normal(0, 1.5, (1, 14, 2, 2)), RNG.normal(size=(1, 4, 4, 4))
    for net in (binary, text):
        net.blobs["data"].data[...] = x
        net.blobs["feat"].data[...] = feat
        net.forward()
    for name in ("reorg", "det", "det2"):
        np.testing.assert_array_equal(binary.blobs[name].data, text.blobs[name].data)
    assert binary.blobs["reorg"].shape == (1, 16, 2, 2) and binary.blobs["det"].shape[2] > 1


def test_mobilenet_yolos_upsample_keeps_its_default_scale(tmp_path):
    """MobileNet-YOLO's UpsampleParameter.scale defaults to 1 (cct's, for SegNet, to 2):
    its binary Upsample with no scale written stays 1, as the fork runs it."""
    data_layer = caffe_pb2.LayerParameter(name="data", type="Input", top=["data"])
    data_layer.input_param.shape.add(dim=[1, 2, 3, 3])
    layers = [data_layer.SerializeToString(), fork_layer("up", "Upsample", ["data"], ["up"], 150, b"")]
    path = tmp_path / "up.binaryproto"
    path.write_bytes(b"".join(piece for layer in layers for piece in wire.field_pieces(100, [layer])))
    assert prototxt.read_net(str(path)).layer[1].upsample_param.scale == 1
    assert cct.Net(str(path), cct.TEST).blobs["up"].shape == (1, 2, 3, 3)
