"""The layer registry (cct.core.layer), as Caffe's test_layer_factory: every
registered type is created from a minimal LayerParameter with create_layer,
set up on small bottoms (Caffe's SetUp) and run forward once, and the tops it
gives have the shapes written below. TYPES must name every registered type:
a type registered without an entry here fails test_every_registered_type_has_an_entry.

Data layers read tiny sources written into tmp_path by helpers.data (with
lmdb, Pillow and h5py themselves): an LMDB of raw Datums, an image list, an
HDF5 list, a window file. Every type runs forward; none is only created.
An unknown type's error (listing the known ones) is tested where a user meets
it, in tests/core/test_net.py::test_unknown_layer_type_lists_the_known_ones."""
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import pytest
from google.protobuf import text_format

from cct.core.blob import Blob
from cct.core.layer import LAYER_TYPES, TRAIN, create_layer, layer_type_list
from cct.proto import caffe_pb2
from helpers.data import (images, png_bytes, raw_datum, write_hdf5_list, write_image_list, write_lmdb,
                          write_window_file)
from helpers.layers import Echo
from helpers.registry import TEST_ONLY_TYPES


@dataclass(frozen=True)
class Case:
    """param: the LayerParameter's fields besides name and type (with sources,
    a format string whose {placeholders} sources(tmp_path) fills); bottoms: a
    shape (filled with values in [0.1, 0.9)) or an array (indices, labels) per
    bottom; tops: the top shapes after one forward; prepare(layer) runs between
    set-up and forward."""
    param: str = ""
    bottoms: tuple = ()
    tops: tuple = ((2, 3),)
    sources: Optional[Callable] = None
    prepare: Optional[Callable] = None


def labels(*values):
    return np.array(values, np.float64)


# --- the sources data layers read -------------------------------------------------------------
def lmdb_source(tmp_path):
    pixels = images(3, 1, 2, 3)
    return {"source": write_lmdb(tmp_path / "lmdb", [raw_datum(p, i) for i, p in enumerate(pixels)])}


def image_list_source(tmp_path):
    root, listing = write_image_list(tmp_path, images(3, 3, 4, 5), [0, 1, 2])
    return {"root": root, "source": listing}


def hdf5_list_source(tmp_path):
    rows = {"data": np.arange(6, dtype=np.float32).reshape(3, 2), "label": np.arange(3, dtype=np.float32)}
    return {"source": write_hdf5_list(tmp_path, [rows])}


def hdf5_output_file(tmp_path):
    return {"file": str(tmp_path / "out.h5")}


def window_source(tmp_path):
    (tmp_path / "scene.png").write_bytes(png_bytes(images(1, 3, 12, 12)[0]))
    windows = [(1, 0.9, 2, 2, 9, 9), (0, 0.1, 0, 0, 4, 4)]       # one foreground, one background
    return {"source": write_window_file(tmp_path / "windows.txt", "scene.png", (3, 12, 12), windows),
            "root": f"{tmp_path}/"}


def feed_memory_data(layer):
    layer.set_input_arrays(np.zeros((4, 1, 2, 2), np.float32), np.arange(4, dtype=np.float32))


NEURON = Case(bottoms=((2, 3),))
LOSS = ((),)                                      # a loss top is a scalar

TYPES = {
    # neurons: one bottom, one top of its shape
    "AbsVal": NEURON, "BNLL": NEURON, "Dropout": NEURON, "ELU": NEURON, "Exp": NEURON, "Log": NEURON,
    "Power": NEURON, "ReLU": NEURON, "Sigmoid": NEURON, "Swish": NEURON, "TanH": NEURON, "Threshold": NEURON,
    "Clip": Case("clip_param { min: 0.2 max: 0.8 }", ((2, 3),)),
    "PReLU": Case(bottoms=((2, 3, 2),), tops=((2, 3, 2),)),
    # conv.py, inner_product.py, pooling.py, normalization.py
    "Convolution": Case("convolution_param { num_output: 2 kernel_size: 3 }", ((1, 2, 4, 4),), ((1, 2, 2, 2),)),
    "Deconvolution": Case("convolution_param { num_output: 2 kernel_size: 2 stride: 2 }", ((1, 2, 2, 2),),
                          ((1, 2, 4, 4),)),
    "Im2col": Case("convolution_param { kernel_size: 2 }", ((1, 1, 3, 3),), ((1, 4, 2, 2),)),
    "InnerProduct": Case("inner_product_param { num_output: 2 }", ((2, 3),), ((2, 2),)),
    "Pooling": Case("pooling_param { pool: MAX kernel_size: 2 stride: 2 }", ((1, 1, 4, 4),), ((1, 1, 2, 2),)),
    "SPP": Case("spp_param { pyramid_height: 2 }", ((1, 1, 4, 4),), ((1, 5),)),
    "LRN": Case(bottoms=((1, 3, 2, 2),), tops=((1, 3, 2, 2),)),
    "MVN": Case(bottoms=((2, 3, 2, 2),), tops=((2, 3, 2, 2),)),
    "BatchNorm": Case(bottoms=((2, 3),)),
    # elementwise.py
    "Eltwise": Case(bottoms=((2, 3), (2, 3))),
    "Scale": Case(bottoms=((2, 3),)),
    "Bias": Case(bottoms=((2, 3),)),
    "Reduction": Case(bottoms=((2, 3),), tops=((),)),
    "Embed": Case("embed_param { num_output: 3 input_dim: 4 }", (labels(0, 3),), ((2, 3),)),
    # shape.py
    "Split": Case(bottoms=((2, 3),), tops=((2, 3), (2, 3))),
    "Concat": Case(bottoms=((2, 3), (2, 1)), tops=((2, 4),)),
    "Slice": Case(bottoms=((2, 4),), tops=((2, 2), (2, 2))),
    "Flatten": Case(bottoms=((2, 3, 2),), tops=((2, 6),)),
    "Reshape": Case("reshape_param { shape { dim: 3 dim: 2 } }", ((2, 3),), ((3, 2),)),
    "Crop": Case(bottoms=((1, 1, 4, 4), (1, 1, 2, 2)), tops=((1, 1, 2, 2),)),
    "Tile": Case("tile_param { tiles: 2 }", ((2, 3),), ((2, 6),)),
    "Silence": Case(bottoms=((2, 3),), tops=()),
    "BatchReindex": Case(bottoms=((3, 2), labels(2, 0)), tops=((2, 2),)),
    "Filter": Case(bottoms=((3, 2), labels(1, 0, 1)), tops=((2, 2),)),
    # loss.py and metrics.py: scores (2, 3), labels in 0..2
    "Softmax": Case(bottoms=((2, 3),)),
    "SoftmaxWithLoss": Case(bottoms=((2, 3), labels(0, 2)), tops=LOSS),
    "EuclideanLoss": Case(bottoms=((2, 3), (2, 3)), tops=LOSS),
    "SigmoidCrossEntropyLoss": Case(bottoms=((2, 3), (2, 3)), tops=LOSS),
    "HingeLoss": Case(bottoms=((2, 3), labels(0, 2)), tops=LOSS),
    "MultinomialLogisticLoss": Case(bottoms=((2, 3), labels(0, 2)), tops=LOSS),
    "InfogainLoss": Case(bottoms=((2, 3), labels(0, 2), np.eye(3)), tops=LOSS),
    "ContrastiveLoss": Case(bottoms=((2, 3), (2, 3), labels(1, 0)), tops=LOSS),
    "Accuracy": Case(bottoms=((2, 3), labels(0, 2)), tops=((),)),
    "ArgMax": Case(bottoms=((2, 3),), tops=((2, 1, 1),)),
    # recurrent.py: x (T, N, ...), cont (T, N); LSTMUnit: c_prev, gates, cont of one step
    "RNN": Case("recurrent_param { num_output: 2 }", ((3, 2, 4), (3, 2)), ((3, 2, 2),)),
    "LSTM": Case("recurrent_param { num_output: 2 }", ((3, 2, 4), (3, 2)), ((3, 2, 2),)),
    "LSTMUnit": Case(bottoms=((1, 2, 3), (1, 2, 12), (1, 2)), tops=((1, 2, 3), (1, 2, 3))),
    # data_input.py: no bottoms
    "Input": Case("input_param { shape { dim: 2 dim: 3 } }"),
    "DummyData": Case("dummy_data_param { shape { dim: 2 dim: 3 } }"),
    "Parameter": Case("parameter_param { shape { dim: 2 dim: 3 } }"),
    # MemoryData's labels are (N,) after set-up and (N, 1, 1, 1) from the first forward on, as Caffe's
    "MemoryData": Case("memory_data_param { batch_size: 2 channels: 1 height: 2 width: 2 }",
                       tops=((2, 1, 2, 2), (2, 1, 1, 1)), prepare=feed_memory_data),
    # data.py: sources on disk
    "Data": Case('data_param {{ source: "{source}" batch_size: 2 backend: LMDB }}',
                 tops=((2, 1, 2, 3), (2,)), sources=lmdb_source),
    "ImageData": Case('image_data_param {{ source: "{source}" root_folder: "{root}" batch_size: 2 }}',
                      tops=((2, 3, 4, 5), (2,)), sources=image_list_source),
    "HDF5Data": Case('top: "data" top: "label" hdf5_data_param {{ source: "{source}" batch_size: 2 }}',
                     tops=((2, 2), (2,)), sources=hdf5_list_source),
    "HDF5Output": Case('hdf5_output_param {{ file_name: "{file}" }}', ((2, 3), labels(0, 1)), tops=(),
                       sources=hdf5_output_file),
    "WindowData": Case('transform_param {{ crop_size: 4 }} window_data_param {{ source: "{source}" '
                       'root_folder: "{root}" batch_size: 2 }}', tops=((2, 3, 4, 4), (2,)), sources=window_source),
    # python_layer.py: a class from an importable module
    "Python": Case('python_param { module: "helpers.layers" layer: "Echo" }', ((2, 3),)),
    # ssd.py (SSD's fork): 2 priors on a 1 x 1 map of an 8 x 8 image; DetectionOutput's 2 priors of 2
    # classes, every score below its threshold: one row of -1 for the image
    "Normalize": Case(bottoms=((1, 3, 2, 2),), tops=((1, 3, 2, 2),)),
    "Permute": Case("permute_param { order: 0 order: 2 order: 3 order: 1 }", ((1, 3, 2, 2),), ((1, 2, 2, 3),)),
    "PriorBox": Case("prior_box_param { min_size: 4 max_size: 6 }", ((1, 1, 1, 1), (1, 3, 8, 8)), ((1, 2, 8),)),
    "DetectionOutput": Case("detection_output_param { num_classes: 2 confidence_threshold: 0.95 "
                            "nms_param { nms_threshold: 0.45 } }", ((1, 8), (1, 4), (1, 2, 8)), ((1, 1, 1, 7),)),
    # segmentation.py (DeepLab v2, PSPNet, SegNet, the YOLOv3 ports); Upsample's nearest-neighbour flavour
    "Interp": Case("interp_param { zoom_factor: 2 }", ((1, 2, 3, 4),), ((1, 2, 5, 7),)),
    "BN": Case("bn_param { frozen: true }", ((2, 3, 2, 2),), ((2, 3, 2, 2),)),
    "Upsample": Case("upsample_param { scale: 2 }", ((1, 2, 3, 4),), ((1, 2, 6, 8),)),
    # roi.py (Fast/Faster R-CNN, R-FCN): one ROI [image 0, 0, 0, 0.5, 0.5] of a 2 x 2 map
    "ROIPooling": Case("roi_pooling_param { pooled_h: 2 pooled_w: 2 }", ((1, 3, 2, 2), np.array([[0, 0, 0, .5, .5]])),
                       ((1, 3, 2, 2),)),
    "PSROIPooling": Case("psroi_pooling_param { spatial_scale: 1 output_dim: 1 group_size: 2 }",
                         ((1, 4, 2, 2), np.array([[0, 0, 0, .5, .5]])), ((1, 1, 2, 2),)),
    # the other forks' small layers (test_fork_layers.py)
    "Axpy": Case(bottoms=((1, 3, 1, 1), (1, 3, 2, 2), (1, 3, 2, 2)), tops=((1, 3, 2, 2),)),
    "ShuffleChannel": Case("shuffle_channel_param { group: 3 }", ((1, 6, 2, 2),), ((1, 6, 2, 2),)),
    "Reorg": Case("reorg_param { stride: 2 }", ((1, 4, 2, 2),), ((1, 16, 1, 1),)),
    "ReLU6": NEURON,
    # yolo.py (MobileNet-YOLO): every score below its threshold, one row of -1 for the image
    "YoloDetectionOutput": Case("yolo_detection_output_param { num_classes: 1 num_box: 1 biases: 1 biases: 1 "
                                "confidence_threshold: 1 }", ((1, 6, 2, 2),), ((1, 1, 1, 7),)),
    "Yolov3DetectionOutput": Case("yolov3_detection_output_param { num_classes: 1 num_box: 1 biases: 1 biases: 1 "
                                  "anchors_scale: 8 mask_group_num: 1 mask: 0 confidence_threshold: 1 }",
                                  ((1, 6, 2, 2),), ((1, 1, 1, 7),)),
    "ConvolutionDepthwise": Case("convolution_param { kernel_size: 3 }", ((1, 2, 4, 4),), ((1, 2, 2, 2),)),
    "DepthwiseConvolution": Case("convolution_param { num_output: 2 group: 2 kernel_size: 3 }", ((1, 2, 4, 4),),
                                 ((1, 2, 2, 2),)),
}


# BVLC Caffe 1.0's caffe.layer_type_list(): the names its sources register with
# REGISTER_LAYER_CLASS and REGISTER_LAYER_CREATOR (src/caffe/layers/*.cpp,
# src/caffe/layer_factory.cpp; master 9b89154, the reference cases' build).
CAFFE_LAYER_TYPES = [
    "AbsVal", "Accuracy", "ArgMax", "BNLL", "BatchNorm", "BatchReindex", "Bias", "Clip", "Concat",
    "ContrastiveLoss", "Convolution", "Crop", "Data", "Deconvolution", "Dropout", "DummyData", "ELU",
    "Eltwise", "Embed", "EuclideanLoss", "Exp", "Filter", "Flatten", "HDF5Data", "HDF5Output", "HingeLoss",
    "Im2col", "ImageData", "InfogainLoss", "InnerProduct", "Input", "LRN", "LSTM", "LSTMUnit", "Log",
    "MVN", "MemoryData", "MultinomialLogisticLoss", "PReLU", "Parameter", "Pooling", "Power", "Python",
    "RNN", "ReLU", "Reduction", "Reshape", "SPP", "Scale", "Sigmoid", "SigmoidCrossEntropyLoss", "Silence",
    "Slice", "Softmax", "SoftmaxWithLoss", "Split", "Swish", "TanH", "Threshold", "Tile", "WindowData",
]


# The forks' types cct registers beside BVLC's (layers/ssd.py: weiliu89/caffe, branch ssd;
# layers/segmentation.py; layers/roi.py; layers/depthwise.py; layers/yolo.py; the small ones in the family
# modules).
FORK_LAYER_TYPES = ["Axpy", "BN", "ConvolutionDepthwise", "DepthwiseConvolution", "DetectionOutput", "Interp",
                    "Normalize", "PSROIPooling", "Permute", "PriorBox", "ROIPooling", "ReLU6", "Reorg",
                    "ShuffleChannel", "Upsample", "YoloDetectionOutput", "Yolov3DetectionOutput"]


def test_the_types_are_caffes():
    """cct.layer_type_list() is BVLC Caffe's, all 61, and the forks' (test-only types aside)."""
    assert len(CAFFE_LAYER_TYPES) == 61
    assert [name for name in layer_type_list() if name not in TEST_ONLY_TYPES] == sorted(
        CAFFE_LAYER_TYPES + FORK_LAYER_TYPES)


def test_every_registered_type_has_an_entry():
    """A new layer type needs a line in TYPES (and so this test's forward)."""
    registered = set(layer_type_list()) - TEST_ONLY_TYPES
    assert sorted(registered - set(TYPES)) == [], "registered types without an entry in TYPES"
    assert sorted(set(TYPES) - registered) == [], "entries in TYPES that are not registered"


@pytest.mark.parametrize("type_name", sorted(TYPES))
def test_create_set_up_and_forward(type_name, tmp_path):
    case = TYPES[type_name]
    fields = case.param.format(**case.sources(tmp_path)) if case.sources else case.param
    param = text_format.Parse(f'name: "{type_name.lower()}" type: "{type_name}" {fields}',
                              caffe_pb2.LayerParameter())
    layer = create_layer(param, TRAIN)
    # A Python layer is the user's class (pycaffe's); every other type is its registered class.
    assert isinstance(layer, Echo if type_name == "Python" else LAYER_TYPES[type_name])
    assert layer.type == type_name

    rng = np.random.default_rng(0)
    bottoms = []
    for given in case.bottoms:
        values = given if isinstance(given, np.ndarray) else rng.uniform(0.1, 0.9, given)
        blob = Blob(values.shape)
        blob.data[...] = values
        bottoms.append(blob)
    tops = [Blob() for _ in case.tops]
    layer.set_up(bottoms, tops)
    if case.prepare:
        case.prepare(layer)
    try:
        layer.reshape(bottoms, tops)
        layer.forward(bottoms, tops)
    finally:
        if hasattr(layer, "close"):
            layer.close()                           # data layers' prefetch threads
    assert [top.shape for top in tops] == [tuple(shape) for shape in case.tops]
    for top in tops:
        assert np.isfinite(top.data).all()
