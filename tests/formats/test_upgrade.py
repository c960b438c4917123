"""Net and solver upgrades, prototxt text in -> text out: V0 -> V1 -> V2,
V1 -> V2, V1 data transforms, `input:` fields, old BatchNorm specs, solver_type."""
import pytest

from cct.core.errors import ConfigError
from cct.proto import caffe_pb2
from cct.formats.upgrade import upgrade_net, upgrade_solver
from cct.formats.upgrade_v0 import upgrade_v0_net
from helpers.protos import assert_same, parse


def upgraded(text):
    return upgrade_net(parse(text), source="old.prototxt")


# --- V0 -----------------------------------------------------------------------------
V0_NET = """
name: "v0net"
input: "data" input_dim: 2 input_dim: 3 input_dim: 9 input_dim: 9
layers { layer { name: "pad1" type: "padding" pad: 2 } bottom: "data" top: "pad1" }
layers { layer { name: "conv1" type: "conv" num_output: 4 kernelsize: 5 stride: 2 group: 1
                 biasterm: false weight_filler { type: "gaussian" std: 0.01 }
                 blobs_lr: 1 weight_decay: 1 }
         bottom: "pad1" top: "conv1" }
layers { layer { name: "relu1" type: "relu" } bottom: "conv1" top: "conv1" }
layers { layer { name: "pool1" type: "pool" pool: MAX kernelsize: 3 stride: 2 } bottom: "conv1" top: "pool1" }
layers { layer { name: "norm1" type: "lrn" local_size: 3 alpha: 0.0001 beta: 0.75 k: 2 }
         bottom: "pool1" top: "norm1" }
layers { layer { name: "drop1" type: "dropout" dropout_ratio: 0.25 } bottom: "norm1" top: "norm1" }
layers { layer { name: "fc" type: "innerproduct" num_output: 10 bias_filler { type: "constant" value: 1 } }
         bottom: "norm1" top: "fc" }
layers { layer { name: "loss" type: "softmax_loss" } bottom: "fc" bottom: "data" top: "loss" }
"""

V0_AS_V1 = """
name: "v0net"
input: "data" input_dim: 2 input_dim: 3 input_dim: 9 input_dim: 9
layers { bottom: "data" top: "conv1" name: "conv1" type: CONVOLUTION blobs_lr: 1 weight_decay: 1
         convolution_param { num_output: 4 bias_term: false pad: 2 kernel_size: 5 group: 1 stride: 2
                             weight_filler { type: "gaussian" std: 0.01 } } }
layers { bottom: "conv1" top: "conv1" name: "relu1" type: RELU }
layers { bottom: "conv1" top: "pool1" name: "pool1" type: POOLING
         pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layers { bottom: "pool1" top: "norm1" name: "norm1" type: LRN
         lrn_param { local_size: 3 alpha: 0.0001 beta: 0.75 k: 2 } }
layers { bottom: "norm1" top: "norm1" name: "drop1" type: DROPOUT dropout_param { dropout_ratio: 0.25 } }
layers { bottom: "norm1" top: "fc" name: "fc" type: INNER_PRODUCT
         inner_product_param { num_output: 10 bias_filler { type: "constant" value: 1 } } }
layers { bottom: "fc" bottom: "data" top: "loss" name: "loss" type: SOFTMAX_LOSS }
"""

V0_AS_V2 = """
name: "v0net"
layer { name: "input" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 9 dim: 9 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1" param { lr_mult: 1 decay_mult: 1 }
        convolution_param { num_output: 4 bias_term: false pad: 2 kernel_size: 5 group: 1 stride: 2
                            weight_filler { type: "gaussian" std: 0.01 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "norm1" type: "LRN" bottom: "pool1" top: "norm1"
        lrn_param { local_size: 3 alpha: 0.0001 beta: 0.75 k: 2 } }
layer { name: "drop1" type: "Dropout" bottom: "norm1" top: "norm1" dropout_param { dropout_ratio: 0.25 } }
layer { name: "fc" type: "InnerProduct" bottom: "norm1" top: "fc"
        inner_product_param { num_output: 10 bias_filler { type: "constant" value: 1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "data" top: "loss" }
"""


def test_v0_to_v1_folds_padding_and_moves_fields():
    assert_same(upgrade_v0_net(parse(V0_NET), "old.prototxt"), V0_AS_V1)


def test_v0_to_v2():
    assert_same(upgraded(V0_NET), V0_AS_V2)


def test_v0_padding_into_pool_replaces_its_pad():
    net = upgrade_v0_net(parse("""
        input: "x"
        layers { layer { name: "p" type: "padding" pad: 1 } bottom: "x" top: "px" }
        layers { layer { name: "pool" type: "pool" pad: 7 kernelsize: 2 pool: AVE } bottom: "px" top: "y" }
    """))
    assert_same(net, """
        input: "x"
        layers { bottom: "x" top: "y" name: "pool" type: POOLING
                 pooling_param { pool: AVE kernel_size: 2 pad: 1 } }
    """)


@pytest.mark.parametrize("v0_fields,v0_type,expected", [
    ('source: "db" batchsize: 8 rand_skip: 3 cropsize: 5 mirror: true meanfile: "m.binaryproto" scale: 0.5',
     "data", 'type: DATA data_param { source: "db" batch_size: 8 rand_skip: 3 } '
             'transform_param { scale: 0.5 mirror: true crop_size: 5 mean_file: "m.binaryproto" }'),
    ('source: "list.txt" batchsize: 2 shuffle_images: true new_height: 4 new_width: 6 rand_skip: 1',
     "images", 'type: IMAGE_DATA image_data_param { source: "list.txt" batch_size: 2 rand_skip: 1 '
               'shuffle: true new_height: 4 new_width: 6 }'),
    ('source: "w.txt" batchsize: 3 det_fg_threshold: 0.4 det_bg_threshold: 0.3 det_fg_fraction: 0.2 '
     'det_context_pad: 16 det_crop_mode: "square"',
     "window_data", 'type: WINDOW_DATA window_data_param { source: "w.txt" batch_size: 3 fg_threshold: 0.4 '
                    'bg_threshold: 0.3 fg_fraction: 0.2 context_pad: 16 crop_mode: "square" }'),
    ('source: "h.txt" batchsize: 4', "hdf5_data", 'type: HDF5_DATA hdf5_data_param { source: "h.txt" batch_size: 4 }'),
    ('hdf5_output_param { file_name: "out.h5" }', "hdf5_output",
     'type: HDF5_OUTPUT hdf5_output_param { file_name: "out.h5" }'),
    ('source: "H.binaryproto"', "infogain_loss", 'type: INFOGAIN_LOSS infogain_loss_param { source: "H.binaryproto" }'),
    ("concat_dim: 0", "concat", "type: CONCAT concat_param { concat_dim: 0 }"),
    ("pool: STOCHASTIC kernelsize: 3", "pool", "type: POOLING pooling_param { pool: STOCHASTIC kernel_size: 3 }"),
    ("blobs { data: 1 data: 2 } blobs_lr: 0", "innerproduct", "type: INNER_PRODUCT blobs { data: 1 data: 2 } blobs_lr: 0"),
    ("", "tanh", "type: TANH"),
    ("", "euclidean_loss", "type: EUCLIDEAN_LOSS"),
])
def test_v0_fields_go_to_their_param(v0_fields, v0_type, expected):
    net = upgrade_v0_net(parse(f'layers {{ layer {{ name: "l" type: "{v0_type}" {v0_fields} }} top: "t" }}'))
    assert_same(net, f'layers {{ top: "t" name: "l" {expected} }}')


@pytest.mark.parametrize("v0_layer,message", [
    ('name: "r" type: "relu" num_output: 3', r"layer 'r' \(V0 type 'relu'\): num_output: not a parameter"),
    ('name: "c" type: "conv" dropout_ratio: 0.5', r"'c'.*dropout_ratio: not a parameter of V0 layer type 'conv'"),
    ('name: "p" type: "pool" group: 2', r"'p'.*group"),
    ('name: "d" type: "data" new_height: 4', r"'d'.*new_height"),
    ('name: "i" type: "innerproduct" new_num: 4', r"'i'.*new_num"),     # Caffe drops it silently
    ('name: "x" type: "fancy"', r"'x'.*unknown V0 layer type 'fancy'"),
])
def test_v0_rejects_fields_the_type_does_not_take(v0_layer, message):
    with pytest.raises(ConfigError, match=message):
        upgraded(f'input: "data" layers {{ layer {{ {v0_layer} }} bottom: "data" top: "out" }}')


def test_v0_error_names_the_file():
    with pytest.raises(ConfigError, match=r"^old\.prototxt: layer 'r'"):
        upgraded('layers { layer { name: "r" type: "relu" kernelsize: 3 } }')


def test_v0_padding_may_only_feed_conv_or_pool():
    with pytest.raises(ConfigError, match=r"'r'.*padding layer 'p'"):
        upgraded("""input: "x"
            layers { layer { name: "p" type: "padding" pad: 1 } bottom: "x" top: "px" }
            layers { layer { name: "r" type: "relu" } bottom: "px" top: "y" }""")


def test_v0_unknown_bottom():
    with pytest.raises(ConfigError, match=r"'c'.*bottom\[0\]: unknown blob 'nope'"):
        upgraded('layers { layer { name: "c" type: "conv" } bottom: "nope" top: "y" }')


def test_v0_entry_with_v1_fields_is_an_error():
    with pytest.raises(ConfigError, match=r"'c'.*name"):
        upgraded('layers { name: "c1" layer { name: "c" type: "conv" } }')


# --- V1 -> V2 -------------------------------------------------------------------------
def test_v1_conv_param_specs():
    net = upgraded("""
        name: "v1"
        layers { name: "c" type: CONVOLUTION bottom: "data" top: "c"
                 blobs_lr: 1 blobs_lr: 2 weight_decay: 1 weight_decay: 0
                 convolution_param { num_output: 8 kernel_size: 3 } }""")
    assert_same(net, """
        name: "v1"
        layer { name: "c" type: "Convolution" bottom: "data" top: "c"
                param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
                convolution_param { num_output: 8 kernel_size: 3 } }""")


def test_v1_names_share_modes_rules_and_loss_weight():
    net = upgraded("""
        layers { name: "ip" type: INNER_PRODUCT bottom: "x" top: "y" param: "w" param: ""
                 blob_share_mode: PERMISSIVE loss_weight: 0.5
                 include { phase: TEST } inner_product_param { num_output: 2 } }
        layers { name: "l" type: EUCLIDEAN_LOSS bottom: "y" bottom: "z" exclude { stage: "deploy" } }""")
    assert_same(net, """
        layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" loss_weight: 0.5
                param { name: "w" share_mode: PERMISSIVE } param { name: "" }
                include { phase: TEST } inner_product_param { num_output: 2 } }
        layer { name: "l" type: "EuclideanLoss" bottom: "y" bottom: "z" exclude { stage: "deploy" } }""")


@pytest.mark.parametrize("v1_type,param", [("DATA", "data_param"), ("IMAGE_DATA", "image_data_param"),
                                          ("WINDOW_DATA", "window_data_param")])
def test_v1_data_transform_fields_move_to_transform_param(v1_type, param):
    net = upgraded(f"""
        layers {{ name: "d" type: {v1_type} top: "data" top: "label"
                 {param} {{ source: "src" batch_size: 4 scale: 0.25 mean_file: "mean.binaryproto"
                            crop_size: 7 mirror: true }} }}""")
    v2_type = {"DATA": "Data", "IMAGE_DATA": "ImageData", "WINDOW_DATA": "WindowData"}[v1_type]
    assert_same(net, f"""
        layer {{ name: "d" type: "{v2_type}" top: "data" top: "label"
                transform_param {{ scale: 0.25 mirror: true crop_size: 7 mean_file: "mean.binaryproto" }}
                {param} {{ source: "src" batch_size: 4 }} }}""")


def test_mixing_layer_and_layers_is_an_error():
    with pytest.raises(ConfigError, match=r"old\.prototxt: uses both `layer` and the legacy `layers`"):
        upgraded('layer { name: "a" type: "ReLU" } layers { name: "b" type: RELU }')


def test_current_net_is_unchanged():
    text = 'name: "n" layer { name: "a" type: "Input" top: "x" input_param { shape { dim: 1 } } }'
    assert_same(upgraded(text), text)


# --- inputs -----------------------------------------------------------------------------
def test_input_dim_becomes_first_input_layer():
    net = upgraded("""
        name: "deploy"
        input: "data" input_dim: 1 input_dim: 3 input_dim: 4 input_dim: 5
        input: "im_info" input_dim: 1 input_dim: 3 input_dim: 1 input_dim: 1
        layer { name: "r" type: "ReLU" bottom: "data" top: "r" }""")
    assert_same(net, """
        name: "deploy"
        layer { name: "input" type: "Input" top: "data" top: "im_info"
                input_param { shape { dim: 1 dim: 3 dim: 4 dim: 5 } shape { dim: 1 dim: 3 dim: 1 dim: 1 } } }
        layer { name: "r" type: "ReLU" bottom: "data" top: "r" }""")


def test_input_shape_becomes_input_layer_after_v1_upgrade():
    net = upgraded("""
        input: "data" input_shape { dim: 10 dim: 2 }
        layers { name: "s" type: SOFTMAX bottom: "data" top: "prob" }""")
    assert_same(net, """
        layer { name: "input" type: "Input" top: "data" input_param { shape { dim: 10 dim: 2 } } }
        layer { name: "s" type: "Softmax" bottom: "data" top: "prob" }""")


@pytest.mark.parametrize("text,message", [
    ('input: "a" input: "b" input_shape { dim: 1 }', "2 inputs but 1 input_shape"),
    ('input: "a" input_dim: 1 input_dim: 2', "need 4 input_dim values, got 2"),
])
def test_input_count_mismatch(text, message):
    with pytest.raises(ConfigError, match=message):
        upgraded(text)


# --- BatchNorm, solver ---------------------------------------------------------------
def test_old_batch_norm_param_specs_are_zeroed():
    net = upgraded("""
        layer { name: "bn" type: "BatchNorm" bottom: "x" top: "x"
                param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 1 } param { lr_mult: 1 decay_mult: 0 } }
        layer { name: "bn2" type: "BatchNorm" bottom: "x" top: "x" param { lr_mult: 0 } }""")
    assert_same(net, """
        layer { name: "bn" type: "BatchNorm" bottom: "x" top: "x"
                param { lr_mult: 0 decay_mult: 0 } param { lr_mult: 0 decay_mult: 0 }
                param { lr_mult: 0 decay_mult: 0 } }
        layer { name: "bn2" type: "BatchNorm" bottom: "x" top: "x" param { lr_mult: 0 } }""")


@pytest.mark.parametrize("enum_name,type_name", [("SGD", "SGD"), ("NESTEROV", "Nesterov"),
                                                ("ADAGRAD", "AdaGrad"), ("RMSPROP", "RMSProp"),
                                                ("ADADELTA", "AdaDelta"), ("ADAM", "Adam")])
def test_solver_type_enum_becomes_type_string(enum_name, type_name):
    solver = upgrade_solver(parse(f'base_lr: 0.1 solver_type: {enum_name}', caffe_pb2.SolverParameter()))
    assert_same(solver, f'base_lr: 0.1 type: "{type_name}"')


def test_solver_without_solver_type_is_unchanged():
    solver = parse('type: "Adam" base_lr: 0.01', caffe_pb2.SolverParameter())
    assert_same(upgrade_solver(solver), 'type: "Adam" base_lr: 0.01')


def test_solver_type_conflicting_with_type():
    solver = parse('type: "Adam" solver_type: NESTEROV', caffe_pb2.SolverParameter())
    with pytest.raises(ConfigError, match="solver_type"):
        upgrade_solver(solver, "solver.prototxt")
