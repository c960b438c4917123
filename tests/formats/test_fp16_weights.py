"""NVIDIA Caffe's raw weights (issue 38): a BlobProto's raw_data of raw_data_type
FLOAT16 (or FLOAT, DOUBLE) loads as float32, exactly, through cct.formats.wire's
fast path and through protobuf's full parse; a type cct does not read and a
raw_data that does not fit its shape are errors naming the file, the layer, the
blob and the field. OpenCV's res10 face detector shrunk to FP16 as OpenCV made
its _fp16 file detects what its FP32 model with those weights rounded to float16 does."""
from pathlib import Path

import numpy as np
import pytest

import cct
from cct.core.errors import WeightsError
from cct.formats import weights, wire
from cct.proto import caffe_pb2
from helpers.res10 import face_blob, res10_files, shared_images

NET = '''layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 4 dim: 4 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" convolution_param { num_output: 2 kernel_size: 3 } }
layer { name: "fc" type: "InnerProduct" bottom: "conv" top: "fc" inner_product_param { num_output: 3 } }'''
RNG = np.random.default_rng(38)
PARAMS = {"conv": [RNG.standard_normal((2, 3, 3, 3)), RNG.standard_normal(2)],
          "fc": [RNG.standard_normal((3, 8)), RNG.standard_normal(3)]}
RAW = {"FLOAT16": np.float16, "FLOAT": np.float32, "DOUBLE": np.float64}


def raw_blob(array, kind="FLOAT16"):
    """A BlobProto as NVIDIA Caffe's Blob::ToProto writes it: shape, raw_data_type, raw_data."""
    return caffe_pb2.BlobProto(shape=caffe_pb2.BlobShape(dim=np.shape(array)), raw_data_type=caffe_pb2.Type.Value(kind),
                               raw_data=np.asarray(array, np.dtype(RAW[kind]).newbyteorder("<")).tobytes())


def model(kind="FLOAT16"):
    net = caffe_pb2.NetParameter(name="m")
    net.layer.add(name="data", type="Input", top=["data"])
    for name, bottom in (("conv", "data"), ("fc", "conv")):
        layer = net.layer.add(name=name, type="InnerProduct" if name == "fc" else "Convolution",
                              bottom=[bottom], top=[name])
        layer.blobs.extend(raw_blob(array, kind) for array in PARAMS[name])
    return net


def unpacked_floats(values):
    """BlobProto.data as one fixed32 field per value: protobuf reads it, the walk leaves it to protobuf."""
    return b"".join(wire.varint((5 << 3) | 5) + np.float32(value).tobytes() for value in values)


def forced_fallback(net):
    """`net`'s bytes with fc's bias as unpacked `data`: the whole file goes through protobuf."""
    bias = caffe_pb2.BlobProto(shape=caffe_pb2.BlobShape(dim=[3])).SerializeToString() + unpacked_floats(PARAMS["fc"][1])
    fc, head = caffe_pb2.LayerParameter(), caffe_pb2.NetParameter()
    fc.CopyFrom(net.layer[2])
    del fc.blobs[1]
    head.CopyFrom(net)
    del head.layer[2]                                   # fc, the last layer, is appended in bytes
    fc_bytes = fc.SerializeToString() + b"".join(wire.field_pieces(7, [bias]))
    data = head.SerializeToString() + b"".join(wire.field_pieces(100, [fc_bytes]))
    with pytest.raises(wire.Unexpected):
        wire.split_blobs(data)
    return data


def load(tmp_path, monkeypatch, data):
    """(cct.Net(..., weights=) on the file of `data`, whether the wire's fast path loaded it)."""
    seen = []

    def copy(layer, source_layer, values, where):
        seen.extend(value is not None for value in values)     # the fallback's are None: parsed by protobuf
        return copy_layer(layer, source_layer, values, where)
    copy_layer = weights._copy_layer
    monkeypatch.setattr(weights, "_copy_layer", copy)
    path = tmp_path / "w.caffemodel"
    path.write_bytes(data)
    net = cct.Net(NET, cct.TEST, weights=str(path))
    assert len(seen) == 4 and len(set(seen)) == 1                  # conv's and fc's two blobs each, one way
    return net, seen[0]


def file_bytes(net, path_kind):
    return net.SerializeToString() if path_kind == "fast" else forced_fallback(net)


def expected(name, index, kind):
    """What a blob holds after loading: its values in the file's type, as float32."""
    return PARAMS[name][index].astype(RAW[kind]).astype(np.float32)


# --- the schema: NVIDIA Caffe's names and numbers ------------------------------------
def test_blob_proto_has_nvidia_caffes_raw_fields():
    fields = caffe_pb2.BlobProto.DESCRIPTOR.fields_by_name
    assert {name: fields[name].number for name in ("raw_data_type", "raw_diff_type", "raw_data", "raw_diff")} == {
        "raw_data_type": 10, "raw_diff_type": 11, "raw_data": 12, "raw_diff": 13}
    assert fields["raw_data_type"].enum_type.full_name == "caffe.Type"
    assert dict(caffe_pb2.Type.items()) == {"DOUBLE": 0, "FLOAT": 1, "FLOAT16": 2, "INT": 3, "UINT": 4, "BOOL": 5}
    assert [fields[name].number for name in ("shape", "data", "diff", "double_data", "double_diff")] == [7, 5, 6, 8, 9]


# --- loading -----------------------------------------------------------------------
@pytest.mark.parametrize("path_kind", ["fast", "fallback"])
@pytest.mark.parametrize("kind", ["FLOAT16", "FLOAT", "DOUBLE"])
def test_raw_weights_load_exactly(tmp_path, monkeypatch, path_kind, kind):
    net, fast = load(tmp_path, monkeypatch, file_bytes(model(kind), path_kind))
    assert fast == (path_kind == "fast")
    for name, index in (("conv", 0), ("conv", 1), ("fc", 0)):
        blob = net.params[name][index].data
        assert blob.dtype == np.float32
        np.testing.assert_array_equal(blob, expected(name, index, kind))
    bias = PARAMS["fc"][1].astype(RAW[kind] if path_kind == "fast" else np.float32)   # the fallback's is data
    np.testing.assert_array_equal(net.params["fc"][1].data, bias.astype(np.float32))


def test_the_walk_cuts_raw_values_out_as_views():
    """raw_data (and raw_diff) leave the message; raw_data_type stays; the values
    are float16 views of the file's bytes, equal to protobuf's."""
    net = model()
    net.layer[1].blobs[0].raw_diff_type = caffe_pb2.FLOAT16
    net.layer[1].blobs[0].raw_diff = np.ones(54, "<f2").tobytes()
    data = net.SerializeToString()
    skeleton, values = wire.split_blobs(data)
    blobs = [blob for layer in net.layer for blob in layer.blobs]
    assert [array.dtype for array in values] == [np.float16] * 4
    for array, blob in zip(values, blobs):
        assert array.base is not None                     # a view, not a copy
        np.testing.assert_array_equal(array, np.frombuffer(blob.raw_data, "<f2"))
        blob.ClearField("raw_data")
        blob.ClearField("raw_diff")
    assert caffe_pb2.NetParameter.FromString(skeleton) == net


def test_data_is_read_before_raw_data_as_nvidia_caffe_reads_it(tmp_path, monkeypatch):
    net = model()
    net.layer[2].blobs[0].data.extend(np.zeros(24, np.float32))
    loaded, fast = load(tmp_path, monkeypatch, net.SerializeToString())
    assert not fast                                          # NVIDIA Caffe writes one or the other
    np.testing.assert_array_equal(loaded.params["fc"][0].data, np.zeros((3, 8)))
    np.testing.assert_array_equal(loaded.params["conv"][0].data, expected("conv", 0, "FLOAT16"))


def test_blob_proto_to_array_reads_raw_data_and_raw_diff():
    blob = raw_blob(PARAMS["conv"][0])
    blob.raw_diff_type = caffe_pb2.DOUBLE
    blob.raw_diff = PARAMS["conv"][0].astype("<f8").tobytes()
    array = weights.blob_proto_to_array(blob)
    assert array.dtype == np.float32 and array.flags.writeable
    np.testing.assert_array_equal(array, expected("conv", 0, "FLOAT16"))
    np.testing.assert_array_equal(weights.blob_proto_to_array(blob, diff=True), expected("conv", 0, "DOUBLE"))


def test_copy_layers_from_proto_reads_raw_data_from_the_message(tmp_path):
    path = tmp_path / "w.caffemodel"
    path.write_bytes(model().SerializeToString())
    net = cct.Net(NET, cct.TEST)
    assert weights.copy_layers_from_proto(net, weights.read_caffemodel(str(path)), str(path)) == []
    for name in PARAMS:
        for index, blob in enumerate(net.params[name]):
            np.testing.assert_array_equal(blob.data, expected(name, index, "FLOAT16"))


# --- errors name the file, the layer, the blob and the field -----------------------------
def _bad_type(blob):
    blob.raw_data_type = caffe_pb2.INT


def _no_type(blob):
    blob.ClearField("raw_data_type")


def _two_values_more(blob):
    blob.raw_data += np.zeros(2, "<f2").tobytes()


def _a_byte_more(blob):
    blob.raw_data += b"\0"


BAD = {
    "INT": (_bad_type, r"BlobProto\.raw_data_type is INT: cct reads FLOAT16, FLOAT and DOUBLE"),
    "no type": (_no_type, r"BlobProto\.raw_data has no raw_data_type cct knows"),
    "values past the shape": (_two_values_more, r"BlobProto\.raw_data \(FLOAT16\) holds 26 values but its "
                                                r"shape \(3, 8\) needs 24"),
    "half a value": (_a_byte_more, r"BlobProto\.raw_data holds 49 bytes, not a whole number of FLOAT16 values"),
}


@pytest.mark.parametrize("path_kind", ["fast", "fallback"])
@pytest.mark.parametrize("bad", BAD)
def test_a_bad_raw_blob_is_an_error_naming_the_file_layer_blob_and_field(tmp_path, monkeypatch, path_kind, bad):
    spoil, message = BAD[bad]
    net = model()
    spoil(net.layer[2].blobs[0])
    with pytest.raises(WeightsError, match=r"w\.caffemodel: layer 'fc' \(InnerProduct\): blobs\[0\]: " + message):
        load(tmp_path, monkeypatch, file_bytes(net, path_kind))


def test_a_type_number_nvidia_caffe_lacks_is_an_error(tmp_path):
    data = model().SerializeToString().replace(b"\x50\x02", b"\x50\x09", 1)   # conv's raw_data_type: FLOAT16 -> 9
    path = tmp_path / "w.caffemodel"
    path.write_bytes(data)
    with pytest.raises(WeightsError, match=r"layer 'conv' \(Convolution\): blobs\[0\]: BlobProto\.raw_data has no "
                                           r"raw_data_type cct knows"):
        cct.Net(NET, cct.TEST, weights=str(path))


# --- OpenCV's res10 face detector in FP16 ----------------------------------------------
# The layers whose blobs OpenCV's shrinkCaffeModel, which made the real _fp16
# file, stores as FLOAT16: the others' may not fit (data_bn's variance is 3.9e6).
SHRUNK_TYPES = ("Convolution", "InnerProduct")


def to_fp16(source, path):
    """The .caffemodel `source` shrunk as OpenCV shrinks it: each blob of a
    SHRUNK_TYPES layer keeps its shape fields, its data becomes FLOAT16 raw_data."""
    model32 = weights.read_caffemodel(source)
    for layer in model32.layer:
        for blob in layer.blobs if layer.type in SHRUNK_TYPES else []:
            halves = np.asarray(blob.data, "<f2")
            blob.ClearField("data")
            blob.raw_data_type, blob.raw_data = caffe_pb2.FLOAT16, halves.tobytes()
    Path(path).write_bytes(model32.SerializeToString())
    return [layer.name for layer in model32.layer if layer.type in SHRUNK_TYPES and layer.blobs]


def detections(top):
    """The detection rows of a (1, 1, D, 7) top, less the fork's -1 row for none found."""
    rows = top.reshape(-1, 7)
    return rows[rows[:, 1] != -1]


@pytest.mark.slow
def test_res10_in_fp16_detects_what_fp32_rounded_to_float16_detects(tmp_path):
    files = res10_files(tmp_path)
    images = shared_images()
    rounded = cct.Net(files["prototxt"], cct.TEST, weights=files["caffemodel"])
    fp16_path = str(tmp_path / "res10_300x300_ssd_iter_140000_fp16.caffemodel")
    shrunk = to_fp16(files["caffemodel"], fp16_path)
    halves = [a for a in wire.split_blobs(Path(fp16_path).read_bytes())[1] if a.dtype == np.float16]
    assert len(halves) == sum(len(rounded.params[name]) for name in shrunk) > 0     # all through the fast path
    fp16 = cct.Net(files["prototxt"], cct.TEST, weights=fp16_path)
    for name, blobs in rounded.params.items():
        for blob, loaded in zip(blobs, fp16.params[name]):
            if name in shrunk:
                blob.data[...] = blob.data.astype(np.float16)
            np.testing.assert_array_equal(loaded.data, blob.data)
    for path in images + ["zeros"]:
        data = np.zeros((1, 3, 300, 300), np.float32) if path == "zeros" else face_blob(path)
        ours, theirs = (detections(net.forward(data=data)["detection_out"].copy()) for net in (fp16, rounded))
        assert ours.shape == theirs.shape
        np.testing.assert_array_equal(ours[:, :2], theirs[:, :2])
        np.testing.assert_allclose(ours[:, 2], theirs[:, 2], rtol=0, atol=1e-5)
        worst = float(np.abs(ours[:, 3:] - theirs[:, 3:]).max(initial=0))
        assert worst <= 1e-4
        print(f"{Path(path).name}: {len(ours)} detections, boxes within {worst:.2g} of FP32 rounded to float16")
