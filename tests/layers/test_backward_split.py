"""Backward as sub-tasks (Layer.splits_backward): a layer's parameter
gradients (backward_param) and data gradient (backward_data) run apart, in
either order, or alone, give bitwise the numbers of its pycaffe backward, so a
scheduler may run them on different streams. In place, the parameters go
first: the data gradient overwrites the top's diff they read (the negative
control shows the test would see it)."""
import numpy as np
import pytest

import cct
from cct.core.blob import Blob
from cct.core.layer import LAYER_TYPES
from cct.testing.gradient_check import make_layer

FILL = 'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 }'
CONV = f"num_output: 4 kernel_size: 3 pad: 1 {FILL}"
CASES = {   # name -> (layer text, bottom shapes, propagate_down, lowering type or None)
    "conv_type1": (f'type: "Convolution" convolution_param {{ {CONV} }}', [(3, 2, 7, 6)], [True], 1),
    "conv_type2": (f'type: "Convolution" convolution_param {{ {CONV} }}', [(3, 2, 7, 6)], [True], 2),
    "conv_type3": (f'type: "Convolution" convolution_param {{ {CONV} }}', [(3, 2, 7, 6)], [True], 3),
    "conv_two_bottoms_group": (f'type: "Convolution" convolution_param {{ {CONV} group: 2 stride: 2 }}',
                               [(2, 4, 6, 6), (2, 4, 6, 6)], [True, False], 2),
    "conv_no_data_gradient": (f'type: "Convolution" convolution_param {{ {CONV} }}', [(2, 2, 5, 5)], [False], 3),
    "deconv": (f'type: "Deconvolution" convolution_param {{ {CONV} stride: 2 }}', [(2, 3, 4, 4)], [True], 2),
    "inner_product": (f'type: "InnerProduct" inner_product_param {{ num_output: 5 {FILL} }}', [(4, 3, 2)], [True],
                      None),
    "inner_product_transpose_axis2": (f'type: "InnerProduct" inner_product_param {{ num_output: 3 axis: 2 '
                                      f'transpose: true {FILL} }}', [(2, 3, 4)], [True], None),
    "scale_learned_bias": ('type: "Scale" scale_param { bias_term: true filler { type: "gaussian" } '
                           'bias_filler { type: "gaussian" } }', [(2, 3, 4)], [True], None),
    "scale_from_bottom": ('type: "Scale" scale_param { axis: 0 bias_term: true bias_filler { type: "gaussian" } }',
                          [(2, 3, 4), (2, 3)], [True, True], None),
    "bias_learned": ('type: "Bias" bias_param { filler { type: "gaussian" } }', [(2, 3, 4)], [True], None),
    "bias_from_bottom": ('type: "Bias"', [(2, 3, 4), (3,)], [True, True], None),
    "prelu": ('type: "PReLU" prelu_param { filler { type: "gaussian" } }', [(2, 3, 4, 2)], [True], None),
    "prelu_shared": ('type: "PReLU" prelu_param { channel_shared: true }', [(2, 3, 4)], [True], None),
    "embed": (f'type: "Embed" embed_param {{ num_output: 4 input_dim: 5 {FILL} }}', [(3, 2)], [False], None),
}
IN_PLACE = ("scale_learned_bias", "scale_from_bottom", "bias_learned", "prelu")


def build(name, in_place, param_wanted=None):
    """The case's layer on seeded float32 blobs, run forward, top diffs set and
    parameter diffs holding earlier gradients (they must be added to)."""
    text, shapes, propagate_down, lowering = CASES[name]
    cct.set_random_seed(11)
    layer = make_layer(text)
    rng = np.random.default_rng(5)
    bottoms = []
    for shape in shapes:
        blob = Blob(shape)
        if layer.type == "Embed":
            blob.data[...] = rng.integers(0, 5, shape)
        else:
            blob.data[...] = rng.standard_normal(shape)
        bottoms.append(blob)
    tops = [bottoms[0]] if in_place else [Blob() for _ in range(len(shapes) if layer.type in (
        "Convolution", "Deconvolution") else 1)]
    layer.set_up(bottoms, tops)
    if lowering:
        layer.configure({"lowering": lowering, "lowering_budget_mb": 0.002})   # a few images per chunk
    layer.param_propagate_down = list(param_wanted or [True] * len(layer.blobs))
    for blob in layer.blobs:
        blob.diff[...] = rng.standard_normal(blob.shape)
    layer.reshape(bottoms, tops)
    layer.forward(bottoms, tops)
    for top in tops:
        top.diff[...] = rng.standard_normal(top.shape)
    return layer, bottoms, tops, propagate_down


def gradients(layer, bottoms, propagate_down):
    return ([b.diff.copy() for b, down in zip(bottoms, propagate_down) if down]
            + [blob.diff.copy() for blob in layer.blobs])


def run_pycaffe(name, in_place=False, param_wanted=None):
    layer, bottoms, tops, down = build(name, in_place, param_wanted)
    layer.backward(tops, down, bottoms)
    return gradients(layer, bottoms, down)


def run_sub_tasks(name, order, in_place=False, param_wanted=None):
    layer, bottoms, tops, down = build(name, in_place, param_wanted)
    params = [index for index in range(len(layer.blobs)) if layer.param_wanted(index)]
    tasks = [("param", index) for index in params] + [("data", None)]
    if order == "data first":
        tasks = tasks[-1:] + tasks[:-1]
    elif order == "reversed":
        tasks = tasks[::-1]
    for kind, index in tasks:
        if kind == "param":
            layer.backward_param(index, tops, bottoms)
        elif any(down):
            layer.backward_data(tops, down, bottoms)
    return gradients(layer, bottoms, down)


def assert_bitwise(ours, theirs):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype and np.array_equal(a, b)


@pytest.mark.parametrize("order", ["params first", "data first", "reversed"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_sub_tasks_in_any_order_are_bitwise_backward(name, order):
    assert_bitwise(run_sub_tasks(name, order), run_pycaffe(name))


@pytest.mark.parametrize("name", ["conv_type1", "conv_type3", "inner_product", "scale_learned_bias", "embed"])
def test_one_sub_task_alone(name):
    """A parameter's gradient needs no other sub-task: only the wanted ones change."""
    layer_blobs = len(build(name, False)[0].blobs)
    for wanted in range(layer_blobs):
        flags = [index == wanted for index in range(layer_blobs)]
        assert_bitwise(run_sub_tasks(name, "params first", param_wanted=flags),
                       run_pycaffe(name, param_wanted=flags))


@pytest.mark.parametrize("name", IN_PLACE)
def test_in_place_parameters_go_first(name):
    assert_bitwise(run_sub_tasks(name, "params first", in_place=True), run_pycaffe(name, in_place=True))


@pytest.mark.parametrize("name", ["scale_learned_bias", "prelu"])
def test_in_place_data_first_is_wrong(name):
    """Negative control: in place, the data gradient overwrites the top diff the
    parameter gradient reads; the comparison above would catch that order."""
    ours, theirs = run_sub_tasks(name, "data first", in_place=True), run_pycaffe(name, in_place=True)
    assert not all(np.array_equal(a, b) for a, b in zip(ours, theirs))


def test_every_layer_with_learned_gradients_splits():
    learns = {"Convolution", "Deconvolution", "InnerProduct", "Scale", "Bias", "PReLU", "Embed"}
    assert {name for name, cls in LAYER_TYPES.items() if cls.splits_backward} >= learns
    # BatchNorm's blobs are running statistics with no gradient; Python layers opt in
    assert not LAYER_TYPES["BatchNorm"].splits_backward and not LAYER_TYPES["Python"].splits_backward
