"""Zero and degenerate shapes (issue 15): where BVLC Caffe refuses them, cct
refuses with the layer and the field named; where Caffe runs them, cct runs
them, forward and backward, and gives Caffe's empty tops and losses.

Caffe's rules, from its sources (BVLC master, the reference cases' build):
- Blob::Reshape (blob.cpp) takes a 0 in any axis (CHECK_GE(shape[i], 0)) and
  refuses a negative one; so an output size computed as 0 runs (an empty top)
  and one computed negative is refused.
- Convolution, Deconvolution, Im2col compute their output size with no check
  of their own (conv_layer.cpp, deconv_layer.cpp, im2col_layer.cpp: C++
  integer division, truncating): a kernel that overruns the padded input by
  less than the stride gives 1 output, by the stride or more 0 (runs), by
  twice the stride or more a negative size (refused). num_output must be > 0
  (CHECK_GT, base_conv_layer.cpp).
- Every filler but bilinear refuses an empty blob (CHECK(count), filler.hpp):
  a Convolution of 0 input channels, or an InnerProduct of K = 0, is refused
  at its weight_filler; with a bilinear one a convolution of 0 channels runs
  (its output is the bias).
- Layers loop over their count or batch: an empty batch runs and gives empty
  tops. Where Caffe would divide an int by the empty batch (SIGFPE, no check)
  cct runs it too with the division defined; the losses are then Caffe's:
  0 through a normalizer of at least 1 (get_normalizer's max(1, n):
  SoftmaxWithLoss, SigmoidCrossEntropyLoss, InfogainLoss), NaN where Caffe
  divides a float by N = 0 (EuclideanLoss, HingeLoss, MultinomialLogisticLoss,
  ContrastiveLoss), and 0 for Accuracy (count == 0 ? 0 : ...).
"""
import math
import warnings

import numpy as np
import pytest

import cct
from cct.core.errors import ConfigError, ShapeError
from cct.lowering import ConvGeometry, conv_backward, conv_forward, reference
from cct.testing.gradient_check import make_layer, setup_layer

RNG = np.random.default_rng(15)
LOWERINGS = (1, 2, 3)
FILL = 'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "constant" value: 0.25 }'
BILINEAR = 'weight_filler { type: "bilinear" } bias_filler { type: "constant" value: 0.25 }'


@pytest.fixture(params=LOWERINGS, ids=lambda t: f"type{t}")
def lowering_type(request, monkeypatch):
    monkeypatch.setenv("CCT_LOWERING", str(request.param))
    return request.param


def layer_text(type_name, param="", bottoms=("data",)):
    named = " ".join(f'bottom: "{b}"' for b in bottoms)
    return f'name: "l" type: "{type_name}" {named} top: "out" {param}'


def conv(fields, kind="Convolution", filler=FILL):
    return layer_text(kind, f"convolution_param {{ {fields} {filler} }}")


def run_forward_backward(layer_param, arrays, num_tops=1):
    """Set up on float64 bottoms, forward, then backward from a top diff of ones
    into every bottom. Returns (layer, bottoms, tops)."""
    layer = make_layer(layer_param)
    bottoms, tops = setup_layer(layer, arrays, num_tops)
    layer.reshape(bottoms, tops)
    layer.forward(bottoms, tops)
    for top in tops:
        top.diff[...] = 1.0
    for blob in layer.blobs:
        blob.diff[...] = 0
    for bottom in bottoms:
        bottom.diff[...] = np.nan                   # backward must set every value it owns
    layer.backward(tops, [layer.allow_force_backward(i) for i in range(len(bottoms))], bottoms)
    return layer, bottoms, tops


def refused(error, layer_param, arrays, *fields):
    """The error a layer's set-up raises, which must name the layer and each field."""
    with pytest.raises(error) as caught:
        setup_layer(make_layer(layer_param), arrays)
    message = str(caught.value)
    assert "layer 'l' (" in message
    for field in fields:
        assert field in message, message
    return message


# --- Convolution, Deconvolution, Im2col: output sizes ------------------------------------
@pytest.mark.parametrize("size,fields,out", [
    ((2, 5), "kernel_size: 3", (0, 3)),                 # (2 - 3) / 1 + 1 = 0
    ((2, 2), "kernel_size: 5 stride: 2", (0, 0)),      # (2 - 5) / 2 = -1 (truncated) + 1 = 0
    ((4, 4), "kernel_size: 3 dilation: 2", (0, 0)),    # extent 5: (4 - 5) / 1 + 1 = 0
])
def test_a_kernel_past_the_padded_input_by_the_stride_gives_an_empty_top(size, fields, out, lowering_type):
    """Caffe's output size (H + 2p - extent) / s + 1 is 0: an empty top, and a
    backward that sets a zero data gradient and adds nothing to the weights'."""
    layer, bottoms, tops = run_forward_backward(conv(f"num_output: 2 {fields}"), [RNG.normal(size=(2, 2) + size)])
    assert tops[0].shape == (2, 2) + out
    np.testing.assert_array_equal(bottoms[0].diff, 0)
    assert not layer.blobs[0].diff.any() and not layer.blobs[1].diff.any()


def test_a_kernel_past_the_padded_input_by_twice_the_stride_is_refused_naming_the_fields():
    """(2 - 5) / 1 + 1 = -2: Caffe's Blob::Reshape refuses a negative size."""
    message = refused(ShapeError, conv("num_output: 2 kernel_size: 5 pad_h: 0 pad_w: 1"), [np.ones((1, 1, 2, 4))],
                      "convolution_param.kernel_size 5 x 5", "pad 0 x 1", "stride 1 x 1")
    assert "input 2 x 4 does not fit the kernel" in message and "-2 x 2" in message
    refused(ShapeError, conv("num_output: 2 kernel_size: 3 dilation: 2"), [np.ones((1, 1, 3, 3))],  # extent 5
            "convolution_param.kernel_size 3 x 3", "dilation 2 x 2", "-1 x -1")


def test_a_kernel_past_the_input_by_less_than_the_stride_still_gives_one_output(lowering_type):
    """(2 - 3) / 2 truncates to 0: one output, its window half outside (zeros), as Caffe's im2col."""
    x = RNG.normal(size=(1, 1, 2, 2))
    layer, _, tops = run_forward_backward(conv("num_output: 1 kernel_size: 3 stride: 2"), [x])
    w = layer.blobs[0].data[0, 0]
    assert tops[0].shape == (1, 1, 1, 1)
    np.testing.assert_allclose(tops[0].data[0, 0, 0, 0], (x[0, 0] * w[:2, :2]).sum() + 0.25)


def test_an_empty_input_with_padding_gives_the_bias(lowering_type):
    """H = 0 with pad 1, kernel 1: (0 + 2 - 1) / 1 + 1 = 2 rows of outputs that
    read only padding: each is the bias. The bias gradient is the sum of the
    top's; the weights' is zero; the data gradient is empty."""
    layer, bottoms, tops = run_forward_backward(conv("num_output: 3 kernel_size: 1 pad: 1"),
                                                [np.ones((2, 2, 0, 3))])
    assert tops[0].shape == (2, 3, 2, 5)
    np.testing.assert_array_equal(tops[0].data, 0.25)
    np.testing.assert_array_equal(layer.blobs[1].diff, 2 * 2 * 5)
    assert not layer.blobs[0].diff.any() and bottoms[0].diff.shape == (2, 2, 0, 3)


def test_an_empty_spatial_axis_without_padding_is_refused():
    refused(ShapeError, conv("num_output: 2 kernel_size: 3"), [np.ones((1, 1, 0, 5))],
            "input 0 x 5 does not fit the kernel", "convolution_param.kernel_size 3 x 3")


@pytest.mark.parametrize("fields", ["num_output: 0 kernel_size: 1", "kernel_size: 1"])
def test_num_output_zero_is_refused(fields):
    """CHECK_GT(num_output_, 0) (base_conv_layer.cpp); unset, it is 0."""
    refused(ConfigError, conv(fields), [np.ones((1, 1, 3, 3))], "convolution_param.num_output", "got 0")


@pytest.mark.parametrize("kind", ["Convolution", "Deconvolution"])
def test_no_input_channels_is_refused_at_the_weight_filler(kind):
    """Caffe's LayerSetUp takes 0 channels; its gaussian filler then refuses
    the empty weights (CHECK(count))."""
    refused(ShapeError, conv("num_output: 2 kernel_size: 3", kind), [np.ones((1, 0, 4, 4))],
            "has no channels", "convolution_param.weight_filler (gaussian)")


@pytest.mark.parametrize("kind,top_shape", [("Convolution", (2, 4, 4, 4)), ("Deconvolution", (2, 4, 6, 6))])
def test_no_input_channels_with_a_bilinear_filler_gives_the_bias(kind, top_shape, lowering_type):
    """Caffe's bilinear filler fills an empty blob (no CHECK(count)): the layer
    runs, every output the bias; the bias gradient sums the top's."""
    layer, bottoms, tops = run_forward_backward(conv("num_output: 4 kernel_size: 2", kind, BILINEAR),
                                                [np.ones((2, 0, 5, 5))])
    assert layer.blobs[0].count == 0
    assert tops[0].shape == top_shape
    np.testing.assert_array_equal(tops[0].data, 0.25)
    np.testing.assert_array_equal(layer.blobs[1].diff, math.prod(top_shape) / 4)
    assert bottoms[0].diff.shape == (2, 0, 5, 5)


@pytest.mark.parametrize("fields,out", [
    ("kernel_size: 4 stride: 2", (2, 2)),          # 2 * (0 - 1) + 4 = 2: the bias
    ("kernel_size: 2 stride: 2", (0, 0)),          # 2 * (0 - 1) + 2 = 0: empty
])
def test_deconvolution_of_an_empty_input(fields, out, lowering_type):
    """Caffe's deconvolution output stride * (H - 1) + extent - 2 * pad (deconv_layer.cpp)."""
    layer, bottoms, tops = run_forward_backward(conv(f"num_output: 3 {fields}", "Deconvolution"),
                                                [np.ones((2, 2, 0, 0))])
    assert tops[0].shape == (2, 3) + out
    np.testing.assert_array_equal(tops[0].data, 0.25)
    assert not layer.blobs[0].diff.any() and bottoms[0].diff.shape == (2, 2, 0, 0)


def test_deconvolution_to_a_negative_size_is_refused():
    """2 * (0 - 1) + 1 = -1: Blob::Reshape refuses it."""
    refused(ShapeError, conv("num_output: 3 kernel_size: 1 stride: 2", "Deconvolution"), [np.ones((1, 2, 0, 0))],
            "output would be -1 x -1", "convolution_param.kernel_size 1 x 1", "stride 2 x 2")


@pytest.mark.parametrize("shape,fields,top_shape", [
    ((0, 2, 3, 3), "kernel_size: 2", (0, 8, 2, 2)),               # an empty batch
    ((2, 2, 2, 2), "kernel_size: 3", (2, 18, 0, 0)),              # an empty output
    ((2, 0, 3, 3), "kernel_size: 2", (2, 0, 2, 2)),               # no channels (Im2col has no weights)
    ((1, 2, 0, 2), "kernel_size: 1 pad: 1", (1, 2, 2, 4)),        # only padding: zeros
])
def test_im2col_of_empty_shapes(shape, fields, top_shape):
    """Caffe's Im2colLayer loops over the batch and im2col over the output: it runs."""
    _, bottoms, tops = run_forward_backward(layer_text("Im2col", f"convolution_param {{ {fields} }}"),
                                            [RNG.normal(size=shape)])
    assert tops[0].shape == top_shape
    np.testing.assert_array_equal(tops[0].data, 0)
    np.testing.assert_array_equal(bottoms[0].diff, 0)


def test_im2col_to_a_negative_size_is_refused():
    refused(ShapeError, layer_text("Im2col", "convolution_param { kernel_size: 5 }"), [np.ones((1, 1, 2, 2))],
            "convolution_param.kernel_size 5 x 5", "-2 x -2")


# --- InnerProduct ----------------------------------------------------------------------------
def test_inner_product_of_no_inputs_is_refused_at_the_weight_filler():
    """K = count(axis) = 0: the (N, 0) weights are empty, which Caffe's fillers refuse."""
    refused(ShapeError, layer_text("InnerProduct", "inner_product_param { num_output: 2 }"), [np.ones((3, 0, 4))],
            "inner_product_param.axis 1", "inner_product_param.weight_filler (constant)", "(2, 0)")


def test_inner_product_of_num_output_zero_is_refused():
    refused(ConfigError, layer_text("InnerProduct", "inner_product_param { num_output: 0 }"), [np.ones((3, 2))],
            "inner_product_param.num_output")


# --- an empty batch, layer by layer -------------------------------------------------------------
def labels(n, classes=3):
    return RNG.integers(0, classes, n).astype(np.float64)


# type, parameters, bottoms at batch n, top shapes at batch n (None: a loss or a metric, a scalar)
BATCH_CASES = {
    "Convolution": ("convolution_param { num_output: 2 kernel_size: 3 %s }" % FILL,
                    lambda n: [RNG.normal(size=(n, 2, 4, 4))], lambda n: [(n, 2, 2, 2)]),
    "Deconvolution": ("convolution_param { num_output: 2 kernel_size: 2 stride: 2 %s }" % FILL,
                      lambda n: [RNG.normal(size=(n, 2, 2, 2))], lambda n: [(n, 2, 4, 4)]),
    "Im2col": ("convolution_param { kernel_size: 2 }", lambda n: [RNG.normal(size=(n, 1, 3, 3))],
               lambda n: [(n, 4, 2, 2)]),
    "InnerProduct": ("inner_product_param { num_output: 2 weight_filler { type: 'gaussian' } }",
                     lambda n: [RNG.normal(size=(n, 3, 2))], lambda n: [(n, 2)]),
    "LRN": ("lrn_param { local_size: 3 }", lambda n: [RNG.normal(size=(n, 3, 2, 2))], lambda n: [(n, 3, 2, 2)]),
    "LRN-within": ("lrn_param { local_size: 3 norm_region: WITHIN_CHANNEL }",
                   lambda n: [RNG.normal(size=(n, 3, 4, 4))], lambda n: [(n, 3, 4, 4)]),
    "MVN": ("mvn_param { normalize_variance: true }", lambda n: [RNG.normal(size=(n, 3, 2, 2))],
            lambda n: [(n, 3, 2, 2)]),
    "BatchNorm": ("", lambda n: [RNG.normal(size=(n, 3, 2, 2))], lambda n: [(n, 3, 2, 2)]),
    "Softmax": ("", lambda n: [RNG.normal(size=(n, 3, 2))], lambda n: [(n, 3, 2)]),
    "ArgMax": ("argmax_param { top_k: 2 }", lambda n: [RNG.normal(size=(n, 3, 2))], lambda n: [(n, 1, 2)]),
    "ArgMax-values": ("argmax_param { top_k: 2 out_max_val: true }", lambda n: [RNG.normal(size=(n, 4))],
                      lambda n: [(n, 2, 2)]),
    "Eltwise": ("", lambda n: [RNG.normal(size=(n, 3)), RNG.normal(size=(n, 3))], lambda n: [(n, 3)]),
    "Concat": ("", lambda n: [RNG.normal(size=(n, 3)), RNG.normal(size=(n, 1))], lambda n: [(n, 4)]),
    "Flatten": ("", lambda n: [RNG.normal(size=(n, 3, 2))], lambda n: [(n, 6)]),
    "PReLU": ("", lambda n: [RNG.normal(size=(n, 3, 2))], lambda n: [(n, 3, 2)]),
    "Scale": ("scale_param { bias_term: true }", lambda n: [RNG.normal(size=(n, 3))], lambda n: [(n, 3)]),
    "SoftmaxWithLoss": ("", lambda n: [RNG.normal(size=(n, 3)), labels(n)], None),
    "SigmoidCrossEntropyLoss": ("", lambda n: [RNG.normal(size=(n, 3)), RNG.integers(0, 2, (n, 3)) * 1.0], None),
    "InfogainLoss": ("", lambda n: [RNG.normal(size=(n, 3)), labels(n), np.eye(3)], None),
    "EuclideanLoss": ("", lambda n: [RNG.normal(size=(n, 3)), RNG.normal(size=(n, 3))], None),
    "HingeLoss": ("", lambda n: [RNG.normal(size=(n, 3)), labels(n)], None),
    "MultinomialLogisticLoss": ("", lambda n: [RNG.uniform(0.1, 1, size=(n, 3)), labels(n)], None),
    "ContrastiveLoss": ("", lambda n: [RNG.normal(size=(n, 3, 1, 1)), RNG.normal(size=(n, 3, 1, 1)),
                                       RNG.integers(0, 2, n) * 1.0], None),
    "Accuracy": ("", lambda n: [RNG.normal(size=(n, 3)), labels(n)], None),
}
# What Caffe's formulas give at N = 0 (see the module docstring).
EMPTY_BATCH_LOSS = {"SoftmaxWithLoss": 0.0, "SigmoidCrossEntropyLoss": 0.0, "InfogainLoss": 0.0, "Accuracy": 0.0,
                    "EuclideanLoss": np.nan, "HingeLoss": np.nan, "MultinomialLogisticLoss": np.nan,
                    "ContrastiveLoss": np.nan}


LOWERED = ("Convolution", "Deconvolution")


@pytest.mark.parametrize("case,lowering", [(case, kind) for case in sorted(BATCH_CASES)
                                           for kind in (LOWERINGS if case in LOWERED else ("auto",))])
def test_an_empty_batch_runs_forward_and_backward(case, lowering, monkeypatch):
    """Every layer at batch 0 (the convolutions under each lowering): tops of
    batch 0 (losses and metrics Caffe's value), bottom gradients of batch 0,
    parameter gradients unchanged (0), and no numpy warning (an empty mean or
    0 / 0 is not an accident here)."""
    monkeypatch.setenv("CCT_LOWERING", str(lowering))
    param, bottoms, tops = BATCH_CASES[case]
    type_name = case.split("-")[0]
    arrays = bottoms(0)
    names = [f"b{i}" for i in range(len(arrays))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer, bottom_blobs, top_blobs = run_forward_backward(layer_text(type_name, param, names), arrays)
    if tops is None:
        assert top_blobs[0].shape == ()
        np.testing.assert_equal(float(top_blobs[0].data), EMPTY_BATCH_LOSS[type_name])
    else:
        assert [t.shape for t in top_blobs] == tops(0)
    for blob, array in zip(bottom_blobs, arrays):
        assert blob.diff.shape == array.shape
    for blob in layer.blobs:
        assert not blob.diff.any()
    # and the same layer then runs a batch of 2 (nothing kept from the empty one)
    for blob, array in zip(bottom_blobs, bottoms(2)):
        blob.reshape(array.shape)
        blob.data[...] = array
    layer.reshape(bottom_blobs, top_blobs)
    layer.forward(bottom_blobs, top_blobs)
    assert all(np.isfinite(t.data).all() for t in top_blobs)


def test_batch_norm_keeps_its_statistics_over_an_empty_batch():
    """No samples, nothing to average: the running statistics stay."""
    layer = make_layer(layer_text("BatchNorm", "batch_norm_param { use_global_stats: false }"))
    bottoms, tops = setup_layer(layer, [RNG.normal(size=(4, 3, 2, 2))])
    layer.forward(bottoms, tops)
    before = [blob.data.copy() for blob in layer.blobs]
    bottoms[0].reshape((0, 3, 2, 2))
    layer.reshape(bottoms, tops)
    layer.forward(bottoms, tops)
    for blob, kept in zip(layer.blobs, before):
        np.testing.assert_array_equal(blob.data, kept)


@pytest.mark.parametrize("case,shape,top_shape", [
    ("Softmax", (2, 0, 3), (2, 0, 3)),              # no channels: dim = 0, Caffe's loops run none
    ("LRN", (2, 0, 3, 3), (2, 0, 3, 3)),
    ("LRN", (2, 3, 0, 3), (2, 3, 0, 3)),
    ("MVN", (2, 3, 0, 0), (2, 3, 0, 0)),
    ("Flatten", (2, 0, 3), (2, 0)),
])
def test_an_empty_axis_other_than_the_batch_runs(case, shape, top_shape):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, bottoms, tops = run_forward_backward(layer_text(case), [np.ones(shape)])
    assert tops[0].shape == top_shape and bottoms[0].diff.shape == shape


@pytest.mark.parametrize("case,bottoms,match", [
    ("SoftmaxWithLoss", [np.ones((2, 0)), np.zeros(2)], r"label 0 is outside \[0, 0\)"),
    ("HingeLoss", [np.ones((2, 0)), np.zeros(2)], r"labels must lie in \[0, 0\)"),
    ("Accuracy", [np.ones((2, 0)), np.zeros(2)], r"accuracy_param.top_k: must not exceed the number of classes \(0\)"),
    ("ArgMax", [np.ones((2, 0))], r"argmax_param.top_k: must not exceed the values per item \(0\)"),
])
def test_no_classes_is_refused_naming_the_field_or_the_labels(case, bottoms, match):
    """With 0 classes no label is valid (Caffe reads past its array: DCHECK
    only) and top_k cannot be met (CHECK_LE(top_k_, ...))."""
    with pytest.raises(cct.CctError, match=match):
        run_forward_backward(layer_text(case, bottoms=[f"b{i}" for i in range(len(bottoms))]), bottoms)


# --- Pooling (layers/pooling.py) ---------------------------------------------------------------


@pytest.mark.parametrize("pool", ["MAX", "AVE"])
def test_pooling_to_an_empty_output_runs(pool):
    """ceil((2 - 3) / 1) + 1 = 0 (pooling_layer.cpp): Blob::Reshape takes it."""
    _, bottoms, tops = run_forward_backward(layer_text("Pooling", f"pooling_param {{ pool: {pool} kernel_size: 3 }}"),
                                            [np.ones((1, 1, 2, 4))])
    assert tops[0].shape == (1, 1, 0, 2)
    np.testing.assert_array_equal(bottoms[0].diff, 0)


def test_pooling_to_a_negative_size_is_refused():
    """ceil((2 - 5) / 1) + 1 = -2: Blob::Reshape refuses it."""
    with pytest.raises(ShapeError, match=r"layer 'l' \(Pooling\): input 2 x 2 .*-2"):
        setup_layer(make_layer(layer_text("Pooling", "pooling_param { pool: MAX kernel_size: 5 }")),
                    [np.ones((1, 1, 2, 2))])


def test_pooling_to_a_negative_size_names_the_fields():
    refused(ShapeError, layer_text("Pooling", "pooling_param { pool: MAX kernel_size: 5 }"), [np.ones((1, 1, 2, 2))],
            "pooling_param.kernel_size")


def test_global_pooling_of_an_empty_plane_is_refused():
    """The kernel is the bottom's H x W, here 0 x 2: Caffe's CHECK_GT(kernel_h_, 0)
    ("Filter dimensions cannot be zero", pooling_layer.cpp) refuses it."""
    refused(ShapeError, layer_text("Pooling", "pooling_param { pool: MAX global_pooling: true }"),
            [np.ones((1, 1, 0, 2))], "pooling_param.global_pooling")


def test_spp_of_an_empty_batch_runs():
    _, _, tops = run_forward_backward(layer_text("SPP", "spp_param { pyramid_height: 2 }"), [np.ones((0, 2, 4, 4))])
    assert tops[0].shape == (0, 10)


@pytest.mark.parametrize("pool", ["MAX", "AVE"])
def test_an_empty_batch_runs_through_pooling(pool):
    _, bottoms, tops = run_forward_backward(
        layer_text("Pooling", f"pooling_param {{ pool: {pool} kernel_size: 2 stride: 2 }}"), [np.ones((0, 2, 4, 4))])
    assert tops[0].shape == (0, 2, 2, 2) and bottoms[0].diff.shape == (0, 2, 4, 4)


# --- the lowerings themselves (cct.lowering), against the plain reference ----------------------
EMPTY_GEOMETRIES = {
    "empty output": ConvGeometry(2, 4, 2, 5, 3, 3),                          # (2 - 3) / 1 + 1 = 0 rows
    "empty output, strided": ConvGeometry(4, 2, 2, 2, 5, 5, 2, 2, group=2),   # (2 - 5) / 2 + 1 = 0
    "no channels": ConvGeometry(0, 3, 4, 4, 2, 2),
    "empty input, padded": ConvGeometry(2, 3, 0, 3, 1, 1, pad_h=1, pad_w=1),  # outputs read only padding
}


@pytest.mark.parametrize("batch", [0, 3])
@pytest.mark.parametrize("name", sorted(EMPTY_GEOMETRIES))
@pytest.mark.parametrize("kind", LOWERINGS)
def test_every_lowering_of_a_geometry_with_nothing_to_lower(kind, name, batch):
    """conv_forward / conv_backward under each type, whole and in chunks, give
    the plain reference's numbers (zeros, or the bias where windows read only
    padding) for geometries with nothing to multiply."""
    geom = EMPTY_GEOMETRIES[name]
    assert geom.empty
    x = RNG.normal(size=geom.input_shape(batch))
    w = RNG.normal(size=geom.weight_shape)
    dy = RNG.normal(size=geom.output_shape(batch))
    bias = RNG.normal(size=geom.num_output)
    for chunk in (None, 1):
        y = conv_forward(x, w, geom, kind, chunk=chunk, bias=bias)
        expected = reference.forward(x, w, geom) + bias.reshape(1, -1, 1, 1)
        assert y.shape == geom.output_shape(batch)
        np.testing.assert_array_equal(y, expected)
        dx, dw = conv_backward(x, dy, w, geom, kind, chunk=chunk)
        assert dx.shape == x.shape and dw.shape == geom.weight_shape
        np.testing.assert_array_equal(dx, reference.backward_data(dy, w, geom))
        np.testing.assert_array_equal(dw, reference.backward_weights(x, dy, geom))
    if batch:                                       # the geometry is not always trivially empty
        assert y.size or not dy.size


def test_a_negative_output_size_is_refused_by_the_geometry():
    with pytest.raises(ValueError, match="the output would be -2 x 1"):
        ConvGeometry(1, 1, 2, 3, 5, 3)
