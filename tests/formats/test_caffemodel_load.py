"""Loading a .caffemodel at the speed of protobuf and memcpy (issue 39): the
UTF-8 check visits string fields only, never a blob's floats; the blobs'
values go from the file's bytes into the net's arrays once (cct.formats.wire),
with protobuf's answer wherever the walk steps aside (values not packed, V0
layers, damaged files); names that are not UTF-8 are refused as before."""
import numpy as np
import pytest

import cct
from cct.core.errors import ConfigError, WeightsError
from cct.formats import weights, wire
from cct.formats.text import undecoded_string
from cct.proto import caffe_pb2

NET = '''layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 5 } } }
layer { name: "fc" type: "InnerProduct" bottom: "data" top: "fc" inner_product_param { num_output: 3 } }'''
RNG = np.random.default_rng(39)
WEIGHT = RNG.standard_normal((3, 5), dtype=np.float32)
BIAS = RNG.standard_normal(3, dtype=np.float32)


def _model(*blobs, name="fc"):
    model = caffe_pb2.NetParameter(name="m")
    model.layer.add(name="data", type="Input", top=["data"])
    layer = model.layer.add(name=name, type="InnerProduct", bottom=["data"], top=["fc"])
    layer.blobs.extend(blobs)
    return model


def _load(tmp_path, data):
    path = tmp_path / "w.caffemodel"
    path.write_bytes(data if isinstance(data, bytes) else data.SerializeToString())
    return cct.Net(NET, cct.TEST, weights=str(path))


def _assert_loaded(net, weight=WEIGHT, bias=BIAS):
    np.testing.assert_array_equal(net.params["fc"][0].data, weight)
    np.testing.assert_array_equal(net.params["fc"][1].data, bias)


# --- the UTF-8 check never reads a number ------------------------------------------
class _Refused:
    """A numeric repeated field's values: reading them fails the test."""

    def __init__(self, name):
        self.name = name

    def _refuse(self, *_):
        raise AssertionError(f"the UTF-8 check read the numbers of {self.name}")

    __iter__ = __len__ = __getitem__ = __bool__ = _refuse


class _Watched:
    """A message whose numeric repeated fields cannot be read."""

    def __init__(self, message):
        self.message = message

    def ListFields(self):            # noqa: N802 (protobuf's name)
        return [(field, _watched(field, value)) for field, value in self.message.ListFields()]


def _watched(field, value):
    if field.type == field.TYPE_MESSAGE:
        return [_Watched(item) for item in value] if field.is_repeated else _Watched(value)
    if field.is_repeated and field.type not in (field.TYPE_STRING, field.TYPE_BYTES):
        return _Refused(field.name)
    return value


def test_the_utf8_check_reads_no_number_of_any_field():
    model = _model(weights.array_to_blob_proto(WEIGHT, diff=WEIGHT), weights.array_to_blob_proto(BIAS))
    model.input_dim.extend([1, 2, 3, 4])                     # a numeric field outside the blobs
    model.layer[1].blobs.add().double_data.extend([1.0, 2.0])
    assert undecoded_string(_Watched(model)) is None
    bad = caffe_pb2.NetParameter.FromString(model.SerializeToString().replace(b"\n\x02fc", b"\n\x02f\xe9"))
    assert undecoded_string(_Watched(bad)) == ("layer[1].name", b"f\xe9")


def test_loading_cuts_the_values_out_before_protobuf_parses(tmp_path, monkeypatch):
    """The layers that reach the copy hold no value: protobuf parsed only the
    rest, and each value comes from the file's bytes."""
    seen = []

    def copy(layer, source_layer, values, where):
        seen.append(values)
        for blob in source_layer.blobs:
            assert not (blob.data or blob.diff or blob.double_data or blob.double_diff)
        return copy_layer(layer, source_layer, values, where)
    copy_layer = weights._copy_layer
    monkeypatch.setattr(weights, "_copy_layer", copy)
    _assert_loaded(_load(tmp_path, _model(weights.array_to_blob_proto(WEIGHT, diff=-WEIGHT),
                                          weights.array_to_blob_proto(BIAS))))
    assert [value.size for values in seen for value in values] == [15, 3]


# --- names that are not UTF-8: the same errors as before --------------------------------
@pytest.mark.parametrize("good,bad,where", [
    (b"\n\x02fc", b"\n\x02f\xe9", r"layer\[1\]\.name: not UTF-8 text: b'f\\xe9'"),
    (b'"\x04data', b'"\x04d\xffta', r"layer\[0\]\.top\[0\]: not UTF-8 text: b'd\\xffta'"),
    (b"\n\x04w_fc", b"\n\x04w\xe9fc", r"layer\[1\]\.param\[0\]\.name: not UTF-8 text: b'w\\xe9fc'"),
])
def test_a_weight_file_with_a_string_that_is_not_utf8_is_refused_naming_the_file(tmp_path, good, bad, where):
    model = _model(weights.array_to_blob_proto(WEIGHT), weights.array_to_blob_proto(BIAS))
    model.layer[1].param.add(name="w_fc")
    data = model.SerializeToString()
    assert data.count(good) == 1
    with pytest.raises(ConfigError, match=r"w\.caffemodel: " + where):
        _load(tmp_path, data.replace(good, bad))


def test_a_v1_weight_file_with_a_name_that_is_not_utf8_is_refused(tmp_path):
    model = caffe_pb2.NetParameter()
    layer = model.layers.add(name="fc", type=caffe_pb2.V1LayerParameter.INNER_PRODUCT)
    layer.blobs.extend([weights.array_to_blob_proto(WEIGHT), weights.array_to_blob_proto(BIAS)])
    data = model.SerializeToString()
    assert data.count(b'"\x02fc') == 1                             # V1LayerParameter.name = 4
    with pytest.raises(ConfigError, match=r"w\.caffemodel: layers\[0\]\.name: not UTF-8 text: b'f\\xe9'"):
        _load(tmp_path, data.replace(b'"\x02fc', b'"\x02f\xe9'))


# --- the walk against protobuf ---------------------------------------------------------
def _legacy(values, dims):
    blob = caffe_pb2.BlobProto(num=dims[0], channels=dims[1], height=dims[2], width=dims[3])
    blob.data.extend(values.ravel().tolist())
    return blob


def _doubles(values):
    blob = caffe_pb2.BlobProto(shape=caffe_pb2.BlobShape(dim=values.shape))
    blob.double_data.extend(values.ravel().astype(np.float64).tolist())
    return blob


def _v1_model():
    model = caffe_pb2.NetParameter(name="v1")
    layer = model.layers.add(name="fc", type=caffe_pb2.V1LayerParameter.INNER_PRODUCT, blobs_lr=[1, 2])
    layer.blobs.extend([_legacy(WEIGHT, (1, 1, 3, 5)), _legacy(BIAS, (1, 1, 1, 3))])
    return model


def _double_over_float():
    blob = weights.array_to_blob_proto(np.zeros(15, np.float32))
    blob.shape.dim[:] = [3, 5]
    blob.double_data.extend(WEIGHT.ravel().astype(np.float64).tolist())    # read in preference, as Caffe does
    return _model(blob, _doubles(BIAS))


MODELS = {
    "shape.dim, with diffs": _model(weights.array_to_blob_proto(WEIGHT, diff=WEIGHT),
                                    weights.array_to_blob_proto(BIAS, diff=BIAS)),
    "V1, legacy 4-d shapes": _v1_model(),
    "double_data over data": _double_over_float(),
}


@pytest.mark.parametrize("name", MODELS)
def test_the_walk_gives_protobufs_values_and_message(name):
    data = MODELS[name].SerializeToString()
    skeleton, values = wire.split_blobs(data)
    whole = caffe_pb2.NetParameter.FromString(data)
    blobs = [blob for layer in list(whole.layer) + list(whole.layers) for blob in layer.blobs]
    assert len(values) == len(blobs)
    for array, blob in zip(values, blobs):
        np.testing.assert_array_equal(array, np.array(blob.double_data or blob.data))
        for field in ("data", "diff", "double_data", "double_diff"):
            blob.ClearField(field)
    assert caffe_pb2.NetParameter.FromString(skeleton) == whole


@pytest.mark.parametrize("name", MODELS)
def test_each_form_loads_its_values(tmp_path, name):
    _assert_loaded(_load(tmp_path, MODELS[name]))


def _field(number, payload):
    return wire.varint((number << 3) | 2) + wire.varint(len(payload)) + payload


def _fc_layer(*blobs):
    """The bytes of NetParameter.layer 'fc' holding `blobs` (BlobProto bytes)."""
    head = caffe_pb2.LayerParameter(name="fc", type="InnerProduct", bottom=["data"], top=["fc"])
    return _field(100, head.SerializeToString() + b"".join(_field(7, blob) for blob in blobs))


def _packed(values):
    return _field(5, np.asarray(values, "<f4").tobytes())


def test_values_given_in_two_pieces_are_joined_as_protobuf_joins_them(tmp_path):
    """A packed field given twice holds both pieces, in order (protobuf's merge)."""
    shape = caffe_pb2.BlobProto(shape=caffe_pb2.BlobShape(dim=[3, 5])).SerializeToString()
    weight = _packed(WEIGHT.ravel()[:6]) + shape + _packed(WEIGHT.ravel()[6:])
    data = _fc_layer(weight, weights.array_to_blob_proto(BIAS).SerializeToString())
    assert list(caffe_pb2.NetParameter.FromString(data).layer[0].blobs[0].data) == WEIGHT.ravel().tolist()
    _assert_loaded(_load(tmp_path, data))


def test_values_not_packed_are_left_to_protobuf(tmp_path):
    """One field per value: valid protobuf, but not what Caffe writes."""
    bias = caffe_pb2.BlobProto(shape=caffe_pb2.BlobShape(dim=[3])).SerializeToString() + b"".join(
        wire.varint((5 << 3) | 5) + np.float32(value).tobytes() for value in BIAS)
    data = _fc_layer(weights.array_to_blob_proto(WEIGHT).SerializeToString(), bias)
    with pytest.raises(wire.Unexpected):
        wire.split_blobs(data)
    _assert_loaded(_load(tmp_path, data))


def test_a_v0_weight_file_is_left_to_protobuf_and_its_upgrade(tmp_path):
    model = caffe_pb2.NetParameter(name="v0")
    v0 = model.layers.add().layer
    v0.name, v0.type, v0.num_output = "fc", "innerproduct", 3
    v0.blobs.extend([_legacy(WEIGHT, (1, 1, 3, 5)), _legacy(BIAS, (1, 1, 1, 3))])
    with pytest.raises(wire.Unexpected):
        wire.split_blobs(model.SerializeToString())
    _assert_loaded(_load(tmp_path, model))


@pytest.mark.parametrize("cut", [1, 7, 40, -3])
def test_a_damaged_file_is_protobufs_error_naming_the_file(tmp_path, cut):
    data = _model(weights.array_to_blob_proto(WEIGHT), weights.array_to_blob_proto(BIAS)).SerializeToString()
    with pytest.raises(ConfigError, match=r"w\.caffemodel: not a valid binary NetParameter"):
        _load(tmp_path, data[:cut])


def test_a_blob_whose_values_do_not_fill_its_shape_names_the_layer(tmp_path):
    short = weights.array_to_blob_proto(BIAS)
    short.shape.dim[:] = [3, 5]
    with pytest.raises(WeightsError, match=r"w\.caffemodel: layer 'fc' \(InnerProduct\): blobs\[0\]: "
                                           r"BlobProto holds 3 values but its shape \(3, 5\) needs 15"):
        _load(tmp_path, _model(short, weights.array_to_blob_proto(BIAS)))


def test_an_empty_weight_file_loads_nothing(tmp_path):
    net = _load(tmp_path, b"")
    assert not net.params["fc"][1].data.any()


def test_a_caffemodel_over_2_gigabytes_loads(tmp_path):
    """Past 2 GiB, where protobuf's own limits sit: a layer of 2.1 GiB of values
    the net lacks (skipped, as Caffe skips it), then the net's own layer. The
    file is sparse, and its skipped values are never read: no disk, no memory."""
    huge_values = 2**31 + 2**26
    huge = caffe_pb2.LayerParameter(name="huge", type="InnerProduct").SerializeToString()
    blob_head = wire.varint((5 << 3) | 2) + wire.varint(huge_values)
    blob_length = len(blob_head) + huge_values
    blob_field = wire.varint((7 << 3) | 2) + wire.varint(blob_length)
    layer_length = len(huge) + len(blob_field) + blob_length
    tail = _model(weights.array_to_blob_proto(WEIGHT), weights.array_to_blob_proto(BIAS)).SerializeToString()
    path = tmp_path / "w.caffemodel"
    with open(path, "wb") as out:
        out.write(wire.varint((100 << 3) | 2) + wire.varint(layer_length) + huge + blob_field + blob_head)
        out.seek(huge_values, 1)              # a hole: 2.1 GiB of zero bytes that take no disk
        out.write(tail)
    assert path.stat().st_size > 2**31
    _assert_loaded(cct.Net(NET, cct.TEST, weights=str(path)))


# --- the copies beside the build (weights.CopyBeside) ----------------------------------
def test_the_values_are_copied_on_a_thread_as_the_layers_are_built(tmp_path, monkeypatch):
    threads = []

    def copy(layer, source_layer, values, where):
        threads.append(__import__("threading").current_thread().name)
        return copy_layer(layer, source_layer, values, where)
    copy_layer = weights._copy_layer
    monkeypatch.setattr(weights, "_copy_layer", copy)
    _assert_loaded(_load(tmp_path, _model(weights.array_to_blob_proto(WEIGHT), weights.array_to_blob_proto(BIAS))))
    assert threads == ["cct-weights", "cct-weights"]   # the file's Input layer (no values), then fc


def test_a_bad_net_is_reported_before_a_missing_weight_file(tmp_path):
    """Caffe builds, then loads: the prototxt's error comes first."""
    bad = NET.replace("num_output: 3", "num_output: 0")
    with pytest.raises(ConfigError, match="num_output"):
        cct.Net(bad, cct.TEST, weights=str(tmp_path / "missing.caffemodel"))
    with pytest.raises(WeightsError, match="missing.caffemodel: weight file not found"):
        cct.Net(NET, cct.TEST, weights=str(tmp_path / "missing.caffemodel"))
    damaged = tmp_path / "damaged.caffemodel"
    damaged.write_bytes(_model(weights.array_to_blob_proto(WEIGHT)).SerializeToString()[:-7])
    with pytest.raises(ConfigError, match="num_output"):
        cct.Net(bad, cct.TEST, weights=str(damaged))
    with pytest.raises(ConfigError, match="damaged.caffemodel: not a valid binary NetParameter"):
        cct.Net(NET, cct.TEST, weights=str(damaged))


def test_a_bad_net_ends_the_copies_begun(tmp_path):
    """A layer after fc fails to build while fc's values are being copied:
    the build's error, and no copying thread left behind."""
    import threading
    bad = NET + '''
layer { name: "after" type: "InnerProduct" bottom: "fc" top: "after" inner_product_param { num_output: 0 } }'''
    path = tmp_path / "w.caffemodel"
    path.write_bytes(_model(weights.array_to_blob_proto(WEIGHT), weights.array_to_blob_proto(BIAS)).SerializeToString())
    with pytest.raises(ConfigError, match="after"):
        cct.Net(bad, cct.TEST, weights=str(path))
    assert not [thread for thread in threading.enumerate() if thread.name == "cct-weights"]


def test_a_shape_mismatch_names_the_file_the_layer_and_the_blob(tmp_path):
    wrong = RNG.standard_normal((4, 5), dtype=np.float32)
    with pytest.raises(WeightsError, match=r"w.caffemodel: layer 'fc' \(InnerProduct\): blobs\[0\]: shape mismatch"):
        _load(tmp_path, _model(weights.array_to_blob_proto(wrong), weights.array_to_blob_proto(BIAS)))


def test_two_layers_of_one_name_load_into_the_first_as_in_caffe(tmp_path):
    """Caffe's CopyTrainedLayersFrom (a NetParameter) searches layer_names_
    from the start: the first layer of the name gets the values."""
    net_text = NET + '''
layer { name: "fc" type: "InnerProduct" bottom: "fc" top: "fc2" inner_product_param { num_output: 3 } }'''
    path = tmp_path / "w.caffemodel"
    path.write_bytes(_model(weights.array_to_blob_proto(WEIGHT), weights.array_to_blob_proto(BIAS)).SerializeToString())
    built = cct.Net(net_text, cct.TEST, weights=str(path))
    after = cct.Net(net_text, cct.TEST)
    after.copy_from(str(path))                          # the same after the build
    for net in (built, after):
        np.testing.assert_array_equal(net.layers[1].blobs[0].data, WEIGHT)
        np.testing.assert_array_equal(net.layers[1].blobs[1].data, BIAS)
        assert not net.layers[2].blobs[0].data.any()   # the second "fc" keeps its filler's zeros
