"""Checks on proto/caffe.proto and its generated module proto/caffe_pb2.py.

(a) the checked-in caffe_pb2.py is what protoc makes of caffe.proto today;
(b) spot checks that the schema is BVLC Caffe's: field numbers and defaults;
(c) Caffe prototxt in both the V1 (`layers`) and current (`layer`) syntax
    parses, and a message encodes to the bytes Caffe would write.
"""

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pool, text_format
from helpers.requirements import require

REPO = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO / "proto"
PB2_PATH = PROTO_DIR / "caffe_pb2.py"


def _load_caffe_pb2():
    try:
        from cct.proto import caffe_pb2
        return caffe_pb2
    except ImportError:
        pass
    # Not installed yet: load proto/caffe_pb2.py by path.  protobuf refuses
    # to register "caffe.proto" twice in one process, so reuse the module if
    # something already loaded this file under another name.
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path and Path(path).resolve() == PB2_PATH.resolve():
            return module
    spec = importlib.util.spec_from_file_location("_cct_proto_caffe_pb2", PB2_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[spec.name] = module
    return module


caffe_pb2 = _load_caffe_pb2()


def _serialized_file_descriptor(path):
    """The FileDescriptorProto bytes a generated *_pb2.py registers.

    Read from the source with ast rather than by importing, so that a stale
    copy never has to be registered next to the current one in protobuf's
    default descriptor pool.
    """
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "AddSerializedFile"
        ):
            return ast.literal_eval(node.args[0])
    raise AssertionError(f"no AddSerializedFile(...) call in {path}")


def _field(message, name):
    return getattr(caffe_pb2, message).DESCRIPTOR.fields_by_name[name]


# --------------------------------------------------------------------------
# (a) the generated module is current


def test_generated_module_is_current(tmp_path):
    require("grpc_tools")
    # Same command as tools/gen_proto.sh, writing into a temporary folder.
    result = subprocess.run(
        [
            sys.executable, "-m", "grpc_tools.protoc",
            "-I", str(PROTO_DIR),
            f"--python_out={tmp_path}",
            str(PROTO_DIR / "caffe.proto"),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    fresh = _serialized_file_descriptor(tmp_path / "caffe_pb2.py")

    stale = "proto/caffe_pb2.py is stale: run tools/gen_proto.sh"
    # The bytes protoc embedded in the checked-in file (version headers and
    # other generated boilerplate play no part).
    assert _serialized_file_descriptor(PB2_PATH) == fresh, stale
    # And the descriptor the imported module actually registered.  The runtime
    # re-serializes descriptors (float defaults at float precision, say), so
    # build the fresh one in a private pool and compare like with like; the
    # default pool must not get a second "caffe.proto".
    fresh_file = descriptor_pool.DescriptorPool().AddSerializedFile(fresh)
    assert caffe_pb2.DESCRIPTOR.serialized_pb == fresh_file.serialized_pb, stale


def test_module_describes_package_caffe():
    assert caffe_pb2.DESCRIPTOR.package == "caffe"
    assert caffe_pb2.DESCRIPTOR.name == "caffe.proto"
    # Self-contained: imports no other .proto file.
    assert list(caffe_pb2.DESCRIPTOR.dependencies) == []


# --------------------------------------------------------------------------
# (b) field numbers and defaults are Caffe's


@pytest.mark.parametrize(
    "message, field, number",
    [
        ("BlobProto", "shape", 7),
        ("BlobProto", "data", 5),
        ("BlobProto", "double_data", 8),
        ("BlobProto", "double_diff", 9),
        ("BlobProto", "num", 1),
        ("NetParameter", "layer", 100),
        ("NetParameter", "layers", 2),
        ("NetParameter", "input_shape", 8),
        ("SolverParameter", "base_lr", 5),
        ("SolverParameter", "net", 24),
        ("SolverParameter", "type", 40),
        ("SolverParameter", "layer_wise_reduce", 41),
        ("SolverParameter", "weights", 42),
        ("V1LayerParameter", "blobs_lr", 7),
        ("V1LayerParameter", "weight_decay", 8),
        ("V1LayerParameter", "convolution_param", 10),
        ("V1LayerParameter", "param", 1001),
        ("V1LayerParameter", "blob_share_mode", 1002),
        ("V1LayerParameter", "layer", 1),
        ("V0LayerParameter", "hdf5_output_param", 1001),
        ("PoolingParameter", "round_mode", 13),
        ("ConvolutionParameter", "dilation", 18),
        ("ParamSpec", "lr_mult", 3),
    ],
)
def test_field_numbers(message, field, number):
    assert _field(message, field).number == number


# Every layer-specific parameter of LayerParameter, as numbered upstream.
LAYER_PARAMS = {
    "transform_param": 100, "loss_param": 101, "accuracy_param": 102,
    "argmax_param": 103, "batch_norm_param": 139, "bias_param": 141,
    "clip_param": 148, "concat_param": 104, "contrastive_loss_param": 105,
    "convolution_param": 106, "crop_param": 144, "data_param": 107,
    "dropout_param": 108, "dummy_data_param": 109, "eltwise_param": 110,
    "elu_param": 140, "embed_param": 137, "exp_param": 111,
    "flatten_param": 135, "hdf5_data_param": 112, "hdf5_output_param": 113,
    "hinge_loss_param": 114, "image_data_param": 115,
    "infogain_loss_param": 116, "inner_product_param": 117,
    "input_param": 143, "log_param": 134, "lrn_param": 118,
    "memory_data_param": 119, "mvn_param": 120, "parameter_param": 145,
    "pooling_param": 121, "power_param": 122, "prelu_param": 131,
    "python_param": 130, "recurrent_param": 146, "reduction_param": 136,
    "relu_param": 123, "reshape_param": 133, "scale_param": 142,
    "sigmoid_param": 124, "softmax_param": 125, "spp_param": 132,
    "slice_param": 126, "swish_param": 147, "tanh_param": 127,
    "threshold_param": 128, "tile_param": 138, "window_data_param": 129,
}


# The forks' parameters cct reads, at their forks' numbers (SSD's: weiliu89/caffe, branch ssd).
FORK_PARAMS = {"permute_param": 202, "prior_box_param": 203, "detection_output_param": 204, "norm_param": 206,
               "bn_param": 152, "segnet_bn_param": 45, "shuffle_channel_param": 164, "roi_pooling_param": 8266711,
               "smooth_l1_loss_param": 8266712, "psroi_pooling_param": 10001, "relu6_param": 211,
               "yolo_detection_output_param": 601, "yolov3_detection_output_param": 602,
               # MobileNet-YOLO's numbers for reorg_param and upsample_param (cct.formats.forks moves them)
               "mobilenet_yolo_reorg_param": 149, "mobilenet_yolo_upsample_param": 150}
# A fork number that is BVLC's too (FORKS.md) is numbered 10000 higher in cct's schema.
CLASHING_FORK_PARAMS = {"interp_param": 143, "upsample_param": 137, "reorg_param": 147}


def test_layer_parameter_fields_are_upstreams():
    fields = caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name
    params = {n: f.number for n, f in fields.items() if n.endswith("_param")}
    assert params == {**LAYER_PARAMS, **FORK_PARAMS,
                      **{name: 10000 + number for name, number in CLASHING_FORK_PARAMS.items()}}
    assert set(CLASHING_FORK_PARAMS.values()) <= set(LAYER_PARAMS.values())   # why they moved
    common = {n: f.number for n, f in fields.items() if not n.endswith("_param")}
    assert common == {
        "name": 1, "type": 2, "bottom": 3, "top": 4, "phase": 10,
        "loss_weight": 5, "param": 6, "blobs": 7, "propagate_down": 11,
        "include": 8, "exclude": 9,
    }


@pytest.mark.parametrize(
    "message, field, default",
    [
        ("ConvolutionParameter", "bias_term", True),
        ("ConvolutionParameter", "group", 1),
        ("LRNParameter", "local_size", 5),
        ("LRNParameter", "alpha", 1.0),
        ("LRNParameter", "beta", 0.75),
        ("LRNParameter", "k", 1.0),
        ("SolverParameter", "type", "SGD"),
        ("SolverParameter", "regularization_type", "L2"),
        ("SolverParameter", "random_seed", -1),
        ("SolverParameter", "clip_gradients", -1.0),
        ("FillerParameter", "type", "constant"),
        ("FillerParameter", "sparse", -1),
        ("BatchNormParameter", "eps", pytest.approx(1e-5)),
        ("BatchNormParameter", "moving_average_fraction", pytest.approx(0.999)),
        ("DataParameter", "prefetch", 4),
        ("WindowDataParameter", "crop_mode", "warp"),
        ("SwishParameter", "beta", 1.0),
    ],
)
def test_defaults(message, field, default):
    assert getattr(getattr(caffe_pb2, message)(), field) == default


def test_solver_defaults():
    solver = caffe_pb2.SolverParameter()
    assert solver.snapshot_format == caffe_pb2.SolverParameter.BINARYPROTO
    assert solver.solver_mode == caffe_pb2.SolverParameter.GPU
    assert solver.solver_type == caffe_pb2.SolverParameter.SGD
    # float fields: compare at float32 precision.
    assert solver.momentum2 == pytest.approx(0.999)
    assert solver.delta == pytest.approx(1e-8)
    assert solver.rms_decay == pytest.approx(0.99)


def test_enums():
    assert caffe_pb2.TRAIN == 0 and caffe_pb2.TEST == 1
    assert caffe_pb2.NetState().phase == caffe_pb2.TEST
    pooling = caffe_pb2.PoolingParameter
    assert pooling.CEIL == 0 and pooling.FLOOR == 1
    assert pooling().round_mode == pooling.CEIL
    assert (pooling.MAX, pooling.AVE, pooling.STOCHASTIC) == (0, 1, 2)
    v1 = caffe_pb2.V1LayerParameter
    assert v1.CONVOLUTION == 4
    assert v1.DECONVOLUTION == 39
    assert v1.SOFTMAX_LOSS == 21
    assert v1.LayerType.Name(0) == "NONE"
    assert caffe_pb2.HingeLossParameter().norm == caffe_pb2.HingeLossParameter.L1
    assert caffe_pb2.LossParameter().normalization == caffe_pb2.LossParameter.VALID


def test_clip_bounds_are_required():
    clip = caffe_pb2.ClipParameter(min=-1.0)
    assert not clip.IsInitialized()
    clip.max = 6.0
    assert clip.IsInitialized()


def test_labels_and_packing():
    assert _field("BlobShape", "dim").is_packed
    assert _field("BlobProto", "data").is_packed
    assert not _field("Datum", "float_data").is_packed
    assert _field("NetParameter", "layer").is_repeated
    assert _field("SolverParameter", "weights").is_repeated
    assert not _field("SolverParameter", "type").is_repeated
    assert _field("ClipParameter", "min").is_required
    assert not _field("SwishParameter", "beta").is_required


# --------------------------------------------------------------------------
# (c) Caffe's text format and wire format


V1_NET = """
name: "v1net"
input: "data"
input_dim: 1 input_dim: 3 input_dim: 8 input_dim: 8
layers {
  name: "conv1"
  type: CONVOLUTION
  bottom: "data"
  top: "conv1"
  blobs_lr: 1
  blobs_lr: 2
  weight_decay: 1
  weight_decay: 0
  convolution_param {
    num_output: 4
    kernel_size: 3
    weight_filler { type: "gaussian" std: 0.01 }
  }
}
layers { name: "relu1" type: RELU bottom: "conv1" top: "conv1" }
"""

NEW_NET = """
name: "net"
layer {
  name: "data"
  type: "Input"
  top: "data"
  input_param { shape { dim: 1 dim: 3 dim: 8 dim: 8 } }
}
layer {
  name: "conv1"
  type: "Convolution"
  bottom: "data"
  top: "conv1"
  param { lr_mult: 1 decay_mult: 1 }
  param { lr_mult: 2 decay_mult: 0 }
  convolution_param { num_output: 4 kernel_size: 3 pad: 1 stride: 1 }
}
layer {
  name: "pool1"
  type: "Pooling"
  bottom: "conv1"
  top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 round_mode: FLOOR }
}
layer {
  name: "clip1" type: "Clip" bottom: "pool1" top: "pool1"
  clip_param { min: 0 max: 6 }
}
layer {
  name: "loss"
  type: "SoftmaxWithLoss"
  bottom: "pool1"
  bottom: "label"
  top: "loss"
  include { phase: TRAIN }
  loss_param { normalization: VALID ignore_label: -1 }
}
"""


def test_parse_v1_prototxt():
    net = text_format.Parse(V1_NET, caffe_pb2.NetParameter())
    assert len(net.layers) == 2 and len(net.layer) == 0
    assert list(net.input_dim) == [1, 3, 8, 8]
    conv = net.layers[0]
    assert conv.type == caffe_pb2.V1LayerParameter.CONVOLUTION
    assert list(conv.blobs_lr) == [1.0, 2.0]
    assert list(conv.weight_decay) == [1.0, 0.0]
    assert conv.convolution_param.num_output == 4
    assert list(conv.convolution_param.kernel_size) == [3]
    assert conv.convolution_param.weight_filler.std == pytest.approx(0.01)
    assert net.layers[1].type == caffe_pb2.V1LayerParameter.RELU


def test_parse_minimal_v1_layer():
    net = text_format.Parse(
        "layers { type: CONVOLUTION blobs_lr: 1 }", caffe_pb2.NetParameter()
    )
    assert net.layers[0].type == caffe_pb2.V1LayerParameter.CONVOLUTION
    assert list(net.layers[0].blobs_lr) == [1.0]


def test_parse_new_prototxt():
    net = text_format.Parse(NEW_NET, caffe_pb2.NetParameter())
    assert [layer.type for layer in net.layer] == [
        "Input", "Convolution", "Pooling", "Clip", "SoftmaxWithLoss",
    ]
    assert list(net.layer[0].input_param.shape[0].dim) == [1, 3, 8, 8]
    conv = net.layer[1]
    assert [p.lr_mult for p in conv.param] == [1.0, 2.0]
    assert conv.convolution_param.bias_term  # default
    pool = net.layer[2].pooling_param
    assert pool.round_mode == caffe_pb2.PoolingParameter.FLOOR
    assert net.layer[3].clip_param.max == 6.0
    loss = net.layer[4]
    assert loss.include[0].phase == caffe_pb2.TRAIN
    assert loss.loss_param.ignore_label == -1
    # Round trip through text and binary.
    again = text_format.Parse(text_format.MessageToString(net), caffe_pb2.NetParameter())
    assert again == net
    assert caffe_pb2.NetParameter.FromString(net.SerializeToString()) == net


def test_parse_solver_prototxt():
    solver = text_format.Parse(
        'net: "train.prototxt" base_lr: 0.01 lr_policy: "step" stepsize: 100 '
        'momentum: 0.9 max_iter: 1000 snapshot_format: HDF5 solver_mode: CPU '
        'type: "Adam" weights: "a.caffemodel"',
        caffe_pb2.SolverParameter(),
    )
    assert solver.base_lr == pytest.approx(0.01)
    assert solver.snapshot_format == caffe_pb2.SolverParameter.HDF5
    assert solver.solver_mode == caffe_pb2.SolverParameter.CPU
    assert list(solver.weights) == ["a.caffemodel"]


def test_wire_bytes():
    # LayerParameter.convolution_param (106, length-delimited) holding
    # num_output (1, varint) = 1: tag 106 << 3 | 2 = 850 = varint d2 06.
    layer = caffe_pb2.LayerParameter()
    layer.convolution_param.num_output = 1
    assert layer.SerializeToString() == b"\xd2\x06\x02\x08\x01"
    # NetParameter.layer (100) is tag 802 = varint a2 06.
    net = caffe_pb2.NetParameter()
    net.layer.add().name = "a"
    assert net.SerializeToString() == b"\xa2\x06\x03\x0a\x01a"
    # BlobShape.dim is packed: tag 0a, length, varints.
    shape = caffe_pb2.BlobShape(dim=[2, 3])
    assert shape.SerializeToString() == b"\x0a\x02\x02\x03"
    # V1 blobs_lr (7, float, not packed): tag 3d then 4 little-endian bytes.
    v1 = caffe_pb2.V1LayerParameter(blobs_lr=[1.0])
    assert v1.SerializeToString() == b"\x3d\x00\x00\x80\x3f"
