"""filter_net, insert_splits and legacy_crop_offsets, prototxt text in ->
text out (Caffe's FilterNet and InsertSplits tests, rewritten for the V2
format; the forks' Crop offsets computed by hand from their coordinate maps)."""
import pytest
from google.protobuf import text_format

from cct.core.errors import ConfigError
from cct.core.passes import filter_net, insert_splits, legacy_crop_offsets, state_meets_rule
from cct.proto import caffe_pb2
from helpers.protos import assert_same, parse


def state(text):
    return parse(text, caffe_pb2.NetState())


def kept_layers(net_text, state_text):
    return [layer.name for layer in filter_net(parse(net_text), state(state_text), "net.prototxt").layer]


# --- filter_net -----------------------------------------------------------------------
LENET_PHASES = """
name: "LeNet"
layer { name: "mnist" type: "Data" top: "data" top: "label" include { phase: TRAIN }
        data_param { source: "train_lmdb" batch_size: 64 } }
layer { name: "mnist" type: "Data" top: "data" top: "label" include { phase: TEST }
        data_param { source: "test_lmdb" batch_size: 100 } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 10 } }
layer { name: "accuracy" type: "Accuracy" bottom: "ip" bottom: "label" top: "accuracy" include { phase: TEST } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


@pytest.mark.parametrize("phase,sources,names", [
    ("TRAIN", ["train_lmdb"], ["mnist", "ip", "loss"]),
    ("TEST", ["test_lmdb"], ["mnist", "ip", "accuracy", "loss"]),
])
def test_filter_by_phase(phase, sources, names):
    filtered = filter_net(parse(LENET_PHASES), state(f"phase: {phase}"))
    assert [layer.name for layer in filtered.layer] == names
    assert [layer.data_param.source for layer in filtered.layer if layer.type == "Data"] == sources
    assert filtered.name == "LeNet"


def test_no_rules_keeps_everything_unchanged():
    text = 'name: "n" layer { name: "a" type: "Input" top: "x" } layer { name: "b" type: "ReLU" bottom: "x" top: "y" }'
    assert_same(filter_net(parse(text), state("phase: TRAIN")), text)


def test_filter_output_is_a_copy():
    net = parse('layer { name: "a" type: "Input" top: "x" include { phase: TEST } }')
    filter_net(net, state("phase: TRAIN"))
    assert len(net.layer) == 1


STAGED = """
layer { name: "A" type: "Input" top: "x" }
layer { name: "B" type: "ReLU" bottom: "x" top: "b" include { stage: "mystage" } }
layer { name: "C" type: "ReLU" bottom: "x" top: "c" exclude { stage: "mystage" } }
layer { name: "D" type: "ReLU" bottom: "x" top: "d" include { stage: "mystage" stage: "myotherstage" } }
layer { name: "E" type: "ReLU" bottom: "x" top: "e" include { stage: "mystage" } include { stage: "myotherstage" } }
layer { name: "F" type: "ReLU" bottom: "x" top: "f" include { not_stage: "mystage" } }
layer { name: "G" type: "ReLU" bottom: "x" top: "g" exclude { not_stage: "mystage" } }
"""


@pytest.mark.parametrize("stages,names", [
    ([], ["A", "C", "F"]),
    (["mystage"], ["A", "B", "E", "G"]),
    (["myotherstage"], ["A", "C", "E", "F"]),
    (["mystage", "myotherstage"], ["A", "B", "D", "E", "G"]),
])
def test_filter_by_stage_and_not_stage(stages, names):
    state_text = "phase: TRAIN " + " ".join(f'stage: "{s}"' for s in stages)
    assert kept_layers(STAGED, state_text) == names


LEVELS = """
layer { name: "A" type: "Input" top: "x" }
layer { name: "min2" type: "ReLU" bottom: "x" top: "a" include { min_level: 2 } }
layer { name: "max2" type: "ReLU" bottom: "x" top: "b" include { max_level: 2 } }
layer { name: "between" type: "ReLU" bottom: "x" top: "c" include { min_level: 1 max_level: 3 } }
layer { name: "not_min2" type: "ReLU" bottom: "x" top: "d" exclude { min_level: 2 } }
layer { name: "neg" type: "ReLU" bottom: "x" top: "e" include { max_level: -1 } }
"""


@pytest.mark.parametrize("level,names", [
    (-2, ["A", "max2", "not_min2", "neg"]),
    (0, ["A", "max2", "not_min2"]),
    (1, ["A", "max2", "between", "not_min2"]),
    (2, ["A", "min2", "max2", "between"]),
    (4, ["A", "min2"]),
])
def test_filter_by_level(level, names):
    assert kept_layers(LEVELS, f"phase: TEST level: {level}") == names


def test_one_rule_must_meet_every_condition():
    net = """layer { name: "A" type: "Input" top: "x" include { phase: TEST stage: "s" min_level: 1 } }
             layer { name: "B" type: "Input" top: "y" exclude { phase: TEST stage: "s" } }"""
    assert kept_layers(net, 'phase: TEST stage: "s" level: 1') == ["A"]
    assert kept_layers(net, 'phase: TEST stage: "s" level: 0') == []
    assert kept_layers(net, 'phase: TRAIN stage: "s" level: 1') == ["B"]
    assert kept_layers(net, "phase: TEST level: 1") == ["B"]


def test_any_include_rule_includes_and_any_exclude_rule_excludes():
    net = """layer { name: "A" type: "Input" top: "x" include { phase: TRAIN } include { stage: "s" } }
             layer { name: "B" type: "Input" top: "y" exclude { phase: TRAIN } exclude { stage: "s" } }"""
    assert kept_layers(net, "phase: TRAIN") == ["A"]
    assert kept_layers(net, 'phase: TEST stage: "s"') == ["A"]
    assert kept_layers(net, "phase: TEST") == ["B"]


def test_include_and_exclude_together_is_an_error():
    net = 'layer { name: "bad" type: "ReLU" include { phase: TRAIN } exclude { stage: "x" } }'
    with pytest.raises(ConfigError, match=r"net\.prototxt: layer 'bad' \(ReLU\): include/exclude"):
        kept_layers(net, "phase: TRAIN")


def test_rule_without_phase_matches_both_phases():
    rule = caffe_pb2.NetStateRule(stage=["a"])
    assert state_meets_rule(state('phase: TRAIN stage: "a"'), rule)
    assert state_meets_rule(state('phase: TEST stage: "a" stage: "b"'), rule)
    assert not state_meets_rule(state('phase: TEST stage: "b"'), rule)


# --- insert_splits --------------------------------------------------------------------
def test_no_split_for_single_readers():
    text = """
        layer { name: "data" type: "Input" top: "data" top: "label" }
        layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" }
        layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" }"""
    assert_same(insert_splits(parse(text)), text)


def test_fan_out_gets_a_split_with_caffes_names():
    net = insert_splits(parse("""
        name: "TestNetwork"
        layer { name: "data" type: "Input" top: "data" top: "label" }
        layer { name: "innerprod1" type: "InnerProduct" bottom: "data" top: "innerprod1" }
        layer { name: "innerprod2" type: "InnerProduct" bottom: "data" top: "innerprod2" }
        layer { name: "innerprod3" type: "InnerProduct" bottom: "data" top: "innerprod3" }
        layer { name: "loss1" type: "EuclideanLoss" bottom: "innerprod1" bottom: "innerprod2" }
        layer { name: "loss2" type: "EuclideanLoss" bottom: "innerprod2" bottom: "innerprod3" }"""))
    assert_same(net, """
        name: "TestNetwork"
        layer { name: "data" type: "Input" top: "data" top: "label" }
        layer { name: "data_data_0_split" type: "Split" bottom: "data"
                top: "data_data_0_split_0" top: "data_data_0_split_1" top: "data_data_0_split_2" }
        layer { name: "innerprod1" type: "InnerProduct" bottom: "data_data_0_split_0" top: "innerprod1" }
        layer { name: "innerprod2" type: "InnerProduct" bottom: "data_data_0_split_1" top: "innerprod2" }
        layer { name: "innerprod2_innerprod2_0_split" type: "Split" bottom: "innerprod2"
                top: "innerprod2_innerprod2_0_split_0" top: "innerprod2_innerprod2_0_split_1" }
        layer { name: "innerprod3" type: "InnerProduct" bottom: "data_data_0_split_2" top: "innerprod3" }
        layer { name: "loss1" type: "EuclideanLoss" bottom: "innerprod1" bottom: "innerprod2_innerprod2_0_split_0" }
        layer { name: "loss2" type: "EuclideanLoss" bottom: "innerprod2_innerprod2_0_split_1" bottom: "innerprod3" }""")


def test_split_names_use_the_top_index():
    net = insert_splits(parse("""
        layer { name: "data" type: "Input" top: "data" top: "label" }
        layer { name: "a" type: "ReLU" bottom: "label" top: "a" }
        layer { name: "b" type: "ReLU" bottom: "label" top: "b" }"""))
    assert_same(net, """
        layer { name: "data" type: "Input" top: "data" top: "label" }
        layer { name: "label_data_1_split" type: "Split" bottom: "label"
                top: "label_data_1_split_0" top: "label_data_1_split_1" }
        layer { name: "a" type: "ReLU" bottom: "label_data_1_split_0" top: "a" }
        layer { name: "b" type: "ReLU" bottom: "label_data_1_split_1" top: "b" }""")


def test_in_place_chain_splits_the_last_writer():
    # relu1 writes innerprod1 in place and is its only reader; the two later readers
    # read relu1's version, so the split is named after relu1.
    net = insert_splits(parse("""
        layer { name: "data" type: "Input" top: "data" top: "label" }
        layer { name: "innerprod1" type: "InnerProduct" bottom: "data" top: "innerprod1" }
        layer { name: "relu1" type: "ReLU" bottom: "innerprod1" top: "innerprod1" }
        layer { name: "innerprod2" type: "InnerProduct" bottom: "innerprod1" top: "innerprod2" }
        layer { name: "loss" type: "EuclideanLoss" bottom: "innerprod1" bottom: "label" }"""))
    assert_same(net, """
        layer { name: "data" type: "Input" top: "data" top: "label" }
        layer { name: "innerprod1" type: "InnerProduct" bottom: "data" top: "innerprod1" }
        layer { name: "relu1" type: "ReLU" bottom: "innerprod1" top: "innerprod1" }
        layer { name: "innerprod1_relu1_0_split" type: "Split" bottom: "innerprod1"
                top: "innerprod1_relu1_0_split_0" top: "innerprod1_relu1_0_split_1" }
        layer { name: "innerprod2" type: "InnerProduct" bottom: "innerprod1_relu1_0_split_0" top: "innerprod2" }
        layer { name: "loss" type: "EuclideanLoss" bottom: "innerprod1_relu1_0_split_1" bottom: "label" }""")


def test_in_place_layer_reading_a_shared_blob_stops_being_in_place():
    # Input's data is read by ip and by relu (in place): relu gets a split copy as
    # bottom but still writes 'data', which ip0 then reads (Caffe does the same).
    net = insert_splits(parse("""
        layer { name: "data" type: "Input" top: "data" }
        layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" }
        layer { name: "relu" type: "ReLU" bottom: "data" top: "data" }
        layer { name: "ip0" type: "InnerProduct" bottom: "data" top: "ip0" }"""))
    assert_same(net, """
        layer { name: "data" type: "Input" top: "data" }
        layer { name: "data_data_0_split" type: "Split" bottom: "data"
                top: "data_data_0_split_0" top: "data_data_0_split_1" }
        layer { name: "ip" type: "InnerProduct" bottom: "data_data_0_split_0" top: "ip" }
        layer { name: "relu" type: "ReLU" bottom: "data_data_0_split_1" top: "data" }
        layer { name: "ip0" type: "InnerProduct" bottom: "data" top: "ip0" }""")


def test_in_place_writer_with_several_readers():
    net = insert_splits(parse("""
        layer { name: "data" type: "Input" top: "data" }
        layer { name: "relu" type: "ReLU" bottom: "data" top: "data" }
        layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" }
        layer { name: "ip0" type: "InnerProduct" bottom: "data" top: "ip0" }"""))
    assert_same(net, """
        layer { name: "data" type: "Input" top: "data" }
        layer { name: "relu" type: "ReLU" bottom: "data" top: "data" }
        layer { name: "data_relu_0_split" type: "Split" bottom: "data"
                top: "data_relu_0_split_0" top: "data_relu_0_split_1" }
        layer { name: "ip" type: "InnerProduct" bottom: "data_relu_0_split_0" top: "ip" }
        layer { name: "ip0" type: "InnerProduct" bottom: "data_relu_0_split_1" top: "ip0" }""")


def test_loss_weighted_top_read_by_another_layer():
    net = insert_splits(parse("""
        layer { name: "data" type: "Input" top: "data" }
        layer { name: "innerprod1" type: "InnerProduct" bottom: "data" top: "innerprod1" loss_weight: 2.5 }
        layer { name: "innerprod2" type: "InnerProduct" bottom: "innerprod1" top: "innerprod2" }
        layer { name: "innerprod3" type: "InnerProduct" bottom: "innerprod1" top: "innerprod3" }"""))
    assert_same(net, """
        layer { name: "data" type: "Input" top: "data" }
        layer { name: "innerprod1" type: "InnerProduct" bottom: "data" top: "innerprod1" }
        layer { name: "innerprod1_innerprod1_0_split" type: "Split" bottom: "innerprod1"
                top: "innerprod1_innerprod1_0_split_0" top: "innerprod1_innerprod1_0_split_1"
                top: "innerprod1_innerprod1_0_split_2"
                loss_weight: 2.5 loss_weight: 0 loss_weight: 0 }
        layer { name: "innerprod2" type: "InnerProduct" bottom: "innerprod1_innerprod1_0_split_1" top: "innerprod2" }
        layer { name: "innerprod3" type: "InnerProduct" bottom: "innerprod1_innerprod1_0_split_2" top: "innerprod3" }""")


def test_loss_weighted_top_with_one_reader_also_splits():
    net = insert_splits(parse("""
        layer { name: "data" type: "Input" top: "data" }
        layer { name: "a" type: "Power" bottom: "data" top: "a" loss_weight: 1 }
        layer { name: "b" type: "ReLU" bottom: "a" top: "b" }"""))
    assert_same(net, """
        layer { name: "data" type: "Input" top: "data" }
        layer { name: "a" type: "Power" bottom: "data" top: "a" }
        layer { name: "a_a_0_split" type: "Split" bottom: "a" top: "a_a_0_split_0" top: "a_a_0_split_1"
                loss_weight: 1 loss_weight: 0 }
        layer { name: "b" type: "ReLU" bottom: "a_a_0_split_1" top: "b" }""")


def test_zero_loss_weight_is_not_a_reader():
    text = """
        layer { name: "data" type: "Input" top: "data" }
        layer { name: "a" type: "Power" bottom: "data" top: "a" loss_weight: 0 }
        layer { name: "b" type: "ReLU" bottom: "a" top: "b" }"""
    assert_same(insert_splits(parse(text)), text)


def test_loss_weighted_top_without_readers_is_unchanged():
    text = """
        layer { name: "data" type: "Input" top: "data" top: "label" }
        layer { name: "loss" type: "EuclideanLoss" bottom: "data" bottom: "label" top: "loss" loss_weight: 3 }"""
    assert_same(insert_splits(parse(text)), text)


def test_unknown_bottom_is_an_error():
    with pytest.raises(ConfigError, match=r"net\.prototxt: layer 'r' \(ReLU\): bottom\[1\]: unknown blob 'nope'"):
        insert_splits(parse("""
            layer { name: "data" type: "Input" top: "data" }
            layer { name: "r" type: "ReLU" bottom: "data" bottom: "nope" top: "r" }"""),
                      "net.prototxt")


def test_insert_splits_leaves_its_input_alone():
    net = parse("""layer { name: "d" type: "Input" top: "x" }
                   layer { name: "a" type: "ReLU" bottom: "x" top: "a" }
                   layer { name: "b" type: "ReLU" bottom: "x" top: "b" }""")
    before = text_format.MessageToString(net)
    insert_splits(net)
    assert text_format.MessageToString(net) == before


# --- legacy_crop_offsets ----------------------------------------------------------------
CROP_NET = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 1 dim: 20 dim: 20 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 2 kernel_size: 3 pad: PAD } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "up" type: "Deconvolution" bottom: "pool" top: "up"
        convolution_param { num_output: 2 kernel_size: 4 stride: 2 pad: UNPAD } }
layer { name: "crop" type: "Crop" bottom: "up" bottom: "data" top: "crop" CROP }
"""


def crop_net(pad, unpad=0, crop=""):
    return parse(CROP_NET.replace("UNPAD", str(unpad)).replace("PAD", str(pad)).replace("CROP", crop))


@pytest.mark.parametrize("pad, unpad", [(5, 0), (3, 1)])
def test_legacy_crop_offset_from_the_coordinate_maps(pad, unpad):
    # data x -> conv x + pad - 1 -> pool (x + pad - 1.5) / 2 -> deconv x + pad - 1.5 + 1.5 - unpad
    offset = pad - unpad
    want = crop_net(pad, unpad, f"crop_param {{ axis: 2 offset: {offset} offset: {offset} }}")
    assert_same(legacy_crop_offsets(crop_net(pad, unpad)), str(want))


@pytest.mark.parametrize("crop", ["crop_param { offset: 0 }", "crop_param { axis: 3 }"])
def test_legacy_crop_keeps_a_given_crop_param(crop):
    assert_same(legacy_crop_offsets(crop_net(5, 0, crop)), str(crop_net(5, 0, crop)))


def test_legacy_crop_leaves_zero_unmapped_and_misaligned_offsets():
    assert_same(legacy_crop_offsets(crop_net(1, 1)), str(crop_net(1, 1)))     # offset 0: BVLC's reading
    unmapped = crop_net(5)
    unmapped.layer[3].type = "InnerProduct"                                   # no coordinate map
    assert_same(legacy_crop_offsets(unmapped), str(unmapped))
    smaller = crop_net(0, 1)                                                  # offset -1: the fork refuses it
    assert_same(legacy_crop_offsets(smaller), str(smaller))
