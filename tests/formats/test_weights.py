"""Weight files: large .caffemodels past protobuf's 64 MB default limit, V1
models with legacy 4-d blob shapes (the model zoo's CaffeNet), the
BlobProto <-> numpy conversions, and recurrent layers' blobs both ways
(saved and loaded by cct; BVLC Caffe's LSTM weights in and out)."""
import re

import numpy as np
import pytest

import cct
from cct.formats import weights
from cct.proto import caffe_pb2
from helpers.reference import CASES

BIG_NET = '''name: "big"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 4200 } } }
layer { name: "fc" type: "InnerProduct" bottom: "data" top: "fc" inner_product_param { num_output: 4096 } }
'''


@pytest.mark.slow
def test_caffemodel_over_64_megabytes_loads(tmp_path):
    net = cct.Net(BIG_NET, cct.TEST)
    fc = net.params["fc"][0]
    fc.data[...] = np.random.default_rng(0).standard_normal(fc.shape, dtype=np.float32)
    path = tmp_path / "big.caffemodel"
    net.save(str(path))
    assert path.stat().st_size > 64 * 2**20
    loaded = cct.Net(BIG_NET, cct.TEST, weights=str(path))
    np.testing.assert_array_equal(loaded.params["fc"][0].data, fc.data)


def test_v1_caffemodel_with_legacy_shapes_loads(tmp_path):
    """V1 models store `layers` with enum types and num/channels/height/width blobs."""
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((3, 5), dtype=np.float32)
    bias = rng.standard_normal(3, dtype=np.float32)
    model = caffe_pb2.NetParameter(name="v1")
    layer = model.layers.add(name="fc", type=caffe_pb2.V1LayerParameter.INNER_PRODUCT)
    for values, legacy in ((weight, (1, 1, 3, 5)), (bias, (1, 1, 1, 3))):
        blob = layer.blobs.add(num=legacy[0], channels=legacy[1], height=legacy[2], width=legacy[3])
        blob.data.extend(values.ravel().tolist())
    path = tmp_path / "v1.caffemodel"
    path.write_bytes(model.SerializeToString())
    net = cct.Net('''layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 5 } } }
                     layer { name: "fc" type: "InnerProduct" bottom: "data" top: "fc"
                             inner_product_param { num_output: 3 } }''', cct.TEST, weights=str(path))
    np.testing.assert_array_equal(net.params["fc"][0].data, weight)
    np.testing.assert_array_equal(net.params["fc"][1].data, bias)


def test_blob_proto_round_trip_keeps_values_and_shape():
    array = np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7
    proto = weights.array_to_blob_proto(array, diff=-array)
    assert tuple(proto.shape.dim) == (2, 3, 4)
    np.testing.assert_array_equal(weights.blob_proto_to_array(proto), array)
    np.testing.assert_array_equal(weights.blob_proto_to_array(proto, diff=True), -array)


def test_double_data_is_read():
    proto = caffe_pb2.BlobProto()
    proto.shape.dim.extend([2])
    proto.double_data.extend([0.5, -1.5])
    np.testing.assert_array_equal(weights.blob_proto_to_array(proto), [0.5, -1.5])


@pytest.mark.parametrize("legacy, blob_shape, matches", [
    ((1, 1, 3, 5), (3, 5), True), ((2, 3, 4, 5), (2, 3, 4, 5), True),
    ((1, 1, 3, 5), (5, 3), False), ((1, 1, 1, 3), (1, 2, 3, 4, 5), False)])
def test_legacy_shape_rule(legacy, blob_shape, matches):
    proto = caffe_pb2.BlobProto(num=legacy[0], channels=legacy[1], height=legacy[2], width=legacy[3])
    assert weights.legacy_shape_matches(blob_shape, proto) is matches


def test_mismatched_blob_count_names_the_layer(tmp_path):
    model = caffe_pb2.NetParameter()
    layer = model.layer.add(name="fc", type="InnerProduct")
    layer.blobs.add().CopyFrom(weights.array_to_blob_proto(np.zeros((3, 5), np.float32)))
    path = tmp_path / "one_blob.caffemodel"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(cct.WeightsError, match=r"one_blob.caffemodel: layer 'fc' \(InnerProduct\).*1 blobs"):
        cct.Net('''layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 5 } } }
                   layer { name: "fc" type: "InnerProduct" bottom: "data" top: "fc"
                           inner_product_param { num_output: 3 } }''', cct.TEST, weights=str(path))


def test_missing_weight_file_is_named(tmp_path):
    with pytest.raises(cct.WeightsError, match="nowhere.caffemodel: weight file not found"):
        cct.Net(BIG_NET, cct.TEST, weights=str(tmp_path / "nowhere.caffemodel"))


# --- recurrent layers: Caffe's blob layout both ways ----------------------------------------------
LSTM_CASE = CASES / "lstm_basic"
LSTM_NET = '''layer { name: "input" type: "Input" top: "x" top: "cont" top: "x_static"
        input_param { shape { dim: 4 dim: 2 dim: 3 } shape { dim: 4 dim: 2 } shape { dim: 2 dim: 5 } } }
layer { name: "lstm" type: "LSTM" bottom: "x" bottom: "cont" bottom: "x_static" top: "h"
        recurrent_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" } } }
layer { name: "rnn" type: "RNN" bottom: "h" bottom: "cont" top: "o"
        recurrent_param { num_output: 2 weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" } } }
'''


def forward_sequence(net):
    rng = np.random.default_rng(8)
    for name in ("x", "x_static"):
        net.blobs[name].data[...] = rng.standard_normal(net.blobs[name].shape)
    net.blobs["cont"].data[...] = [[0, 0], [1, 1], [1, 0], [1, 1]]
    return net.forward()["o"].copy()


@pytest.mark.parametrize("suffix", [".caffemodel", ".h5"])
def test_recurrent_net_saved_and_loaded_gives_the_same_outputs(tmp_path, suffix):
    net = cct.Net(LSTM_NET, cct.TEST)
    expected = forward_sequence(net)
    path = str(tmp_path / f"sequence{suffix}")
    net.save(path) if suffix == ".caffemodel" else net.save_hdf5(path)
    loaded = cct.Net(LSTM_NET, cct.TEST, weights=path)
    for name in ("lstm", "rnn"):
        for own, saved in zip(loaded.params[name], net.params[name]):
            np.testing.assert_array_equal(own.data, saved.data)
    np.testing.assert_array_equal(forward_sequence(loaded), expected)


def test_caffes_lstm_weights_load_and_save_in_caffes_layout(tmp_path):
    """lstm_basic's weights.caffemodel (written by BVLC Caffe) loads into the
    parameters Caffe had, and cct writes it back blob for blob as Caffe did."""
    net = cct.Net(str(LSTM_CASE / "net.prototxt"), cct.TRAIN, weights=str(LSTM_CASE / "weights.caffemodel"))
    caffe_values = np.load(LSTM_CASE / "forward.npz")
    assert len(net.params["l"]) == 3
    for k, blob in enumerate(net.params["l"]):
        np.testing.assert_array_equal(blob.data, caffe_values[f"param/l/{k}"])
    path = tmp_path / "resaved.caffemodel"
    net.save(str(path))

    def blobs_by_layer(model_path):
        model = weights.read_caffemodel(str(model_path))
        return {layer.name: [(tuple(b.shape.dim), tuple(b.data)) for b in layer.blobs]
                for layer in model.layer if layer.blobs}
    assert blobs_by_layer(path) == blobs_by_layer(LSTM_CASE / "weights.caffemodel")


# --- damaged or hostile HDF5 weights (issue 15) -----------------------------------------
HDF5_NET = '''layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 } } }
layer { name: "fc" type: "InnerProduct" bottom: "data" top: "fc" inner_product_param { num_output: 2 } }'''


def test_hdf5_weights_are_checked_before_they_are_read(tmp_path):
    """Found by the fuzzer: a dataset declared as 2^31 floats (no bytes on
    disk) was read whole, 8 GiB, before its size was compared; a group or
    strings where numbers belong, or a damaged file, raised h5py's errors."""
    import h5py
    net = cct.Net(HDF5_NET, cct.TEST)
    path = tmp_path / "fc.caffemodel.h5"
    net.save_hdf5(str(path))
    with h5py.File(path, "r+") as handle:
        del handle["data/fc/0"]
        handle.create_dataset("data/fc/0", shape=(2, 1 << 30), dtype="float32")    # never written
    with pytest.raises(cct.WeightsError, match=r"layer 'fc' \(InnerProduct\): blobs\[0\]: shape mismatch, "
                                               r"the file has \(2, 1073741824\), the net wants \(2, 3\)"):
        net.copy_from(str(path))
    for replace, message in ((lambda h: h.create_group("data/fc/0"), "'0' is a group, expected a dataset"),
                             (lambda h: h.create_dataset("data/fc/0", data=np.array([b"ab"] * 6)),
                              "dataset '0' holds |S2, expected numbers")):
        with h5py.File(path, "r+") as handle:
            del handle["data/fc/0"]
            replace(handle)
        with pytest.raises(cct.WeightsError, match=re.escape(message)):
            net.copy_from(str(path))
    path.write_bytes(path.read_bytes()[:800])
    with pytest.raises(cct.WeightsError, match="fc.caffemodel.h5: not a readable HDF5 weight file"):
        net.copy_from(str(path))


def test_a_folder_given_as_weights_is_a_clean_error(tmp_path):
    with pytest.raises(cct.WeightsError, match="weight file is a folder, expected a file"):
        cct.Net(HDF5_NET, cct.TEST).copy_from(str(tmp_path))


@pytest.mark.parametrize("write_diff", [False, True])
def test_caffemodel_written_in_pieces_is_the_serialized_message(tmp_path, write_diff):
    """save_caffemodel writes each weight array straight from its blob; the file
    is byte for byte the NetParameter's own serialization, with layer fields on
    both sides of `blobs` (phase 10, include 8, inner_product_param 117) and a
    layer whose prototxt carried blobs of its own."""
    param = caffe_pb2.NetParameter()
    param.CopyFrom(weights.net_to_proto(cct.Net(HDF5_NET, cct.TEST)))
    param.layer[-1].include.add(phase=caffe_pb2.TEST)
    net = cct.Net(param, cct.TEST)
    for layer in net.layers:
        for blob in layer.blobs:
            blob.data[...] = np.random.default_rng(1).standard_normal(blob.shape)
            blob.diff[...] = -blob.data
    path = tmp_path / "net.caffemodel"
    weights.save_caffemodel(net, str(path), write_diff)
    assert path.read_bytes() == weights.net_to_proto(net, write_diff).SerializeToString()
    assert any(layer.blobs for layer in net.layers) and net.layers[-1].layer_param.blobs


def test_solver_state_written_in_pieces_is_the_serialized_message(tmp_path):
    from cct.training import snapshot
    from cct.training.solver import get_solver
    net_path = tmp_path / "net.prototxt"
    net_path.write_text(HDF5_NET.replace('"Input"', '"DummyData"').replace(
        "input_param { shape { dim: 1 dim: 3 } }", "dummy_data_param { shape { dim: 1 dim: 3 } }"))
    solver_path = tmp_path / "solver.prototxt"
    solver_path.write_text(f'net: "{net_path}" base_lr: 0.1 lr_policy: "fixed" momentum: 0.9 '
                           f'snapshot_prefix: "{tmp_path}/snap" display: 0')
    solver = get_solver(str(solver_path))
    for history in solver.history:
        history[...] = np.random.default_rng(2).standard_normal(history.shape)
    solver.iter, solver.current_step = 3, 1
    state_path = snapshot.write(solver)
    expected = caffe_pb2.SolverState(iter=3, learned_net=f"{tmp_path}/snap_iter_3.caffemodel", current_step=1)
    for history in solver.history:
        expected.history.add().CopyFrom(weights.array_to_blob_proto(history))
    assert open(state_path, "rb").read() == expected.SerializeToString()
