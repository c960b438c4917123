"""cct.Net on small prototxt texts: blob/param/layer tables, in-place and split
wiring, weight sharing, which layers run backward (Caffe's rules), loss weights,
weight files, and the errors a user sees for a broken net."""
import re

import numpy as np
import pytest

import cct
from cct.core.errors import ConfigError, WeightsError

def make_net(text, phase=cct.TRAIN, **kwargs):
    return cct.Net(text, phase, **kwargs)


def random(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def input_layer(name="data", shape=(2, 3, 4, 4), tops=None):
    dims = " ".join(f"dim: {d}" for d in shape)
    tops = " ".join(f'top: "{t}"' for t in (tops or [name]))
    return f'layer {{ name: "{name}" type: "Input" {tops} input_param {{ shape {{ {dims} }} }} }}'


NORM_NET = f"""
name: "norm"
{input_layer()}
layer {{ name: "mvn" type: "MVN" bottom: "data" top: "mvn" }}
layer {{ name: "bn" type: "BatchNorm" bottom: "mvn" top: "bn" }}
layer {{ name: "lrn" type: "LRN" bottom: "bn" top: "lrn" lrn_param {{ local_size: 3 }} }}
"""


# --- tables -------------------------------------------------------------------------
def test_blob_layer_and_param_tables():
    net = make_net(NORM_NET)
    assert net.name == "norm"
    assert list(net.blobs) == ["data", "mvn", "bn", "lrn"]
    assert all(blob.shape == (2, 3, 4, 4) for blob in net.blobs.values())
    assert net.layer_names == ["data", "mvn", "bn", "lrn"]
    assert list(net.layer_dict) == net.layer_names
    assert [layer.type for layer in net.layers] == ["Input", "MVN", "BatchNorm", "LRN"]
    assert list(net.params) == ["bn"]
    assert [blob.shape for blob in net.params["bn"]] == [(3,), (3,), (1,)]
    assert net.inputs == ["data"] and net.outputs == ["lrn"]
    assert net.bottom_names["bn"] == ["mvn"] and net.top_names["bn"] == ["bn"]
    assert net.top_names["data"] == ["data"] and net.bottom_names["data"] == []


def test_forward_with_input_arguments_returns_outputs():
    net = make_net(NORM_NET)
    x = random((2, 3, 4, 4))
    out = net.forward(data=x)
    assert list(out) == ["lrn"]
    np.testing.assert_allclose(net.blobs["data"].data, x.astype(np.float32))
    # MVN then batch statistics: every channel of 'bn' has mean 0
    np.testing.assert_allclose(net.blobs["bn"].data.mean(axis=(0, 2, 3)), 0, atol=1e-5)
    assert set(net.forward(blobs=["mvn"])) == {"lrn", "mvn"}
    with pytest.raises(ConfigError, match="do not match the net's inputs"):
        net.forward(mvn=x)



# Layer names differ from their tops' names, as in pycaffe's test_net ('ip' -> 'ip_blob').
RENAMED_TOPS_NET = f"""force_backward: true
{input_layer(shape=(2, 3))}
layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "ip_blob"
        inner_product_param {{ num_output: 4 weight_filler {{ type: "gaussian" }} }} }}
layer {{ name: "pair" type: "Slice" bottom: "ip_blob" top: "left" top: "right" slice_param {{ axis: 1 }} }}
layer {{ name: "sum" type: "Eltwise" bottom: "left" bottom: "right" top: "total" }}
"""


def test_forward_start_end_are_layer_names_and_return_the_end_layers_tops():
    net = make_net(RENAMED_TOPS_NET)
    net.blobs["data"].data[...] = random((2, 3))
    assert set(net.forward(start="ip", end="ip")) == {"ip_blob"}
    weights, bias = (blob.data for blob in net.params["ip"])
    np.testing.assert_allclose(net.blobs["ip_blob"].data, net.blobs["data"].data @ weights.T + bias, rtol=1e-5)
    assert set(net.forward(start="pair", end="pair", blobs=["data"])) == {"left", "right", "data"}
    assert set(net.forward()) == {"total"}
    with pytest.raises(ConfigError, match="no layer named 'ip_blob'"):
        net.forward(end="ip_blob")


def test_backward_start_end_are_layer_names_and_return_the_end_layers_bottoms():
    net = make_net(RENAMED_TOPS_NET)
    net.forward()
    top_diff = random((2, 4), seed=1).astype(np.float32)
    net.blobs["ip_blob"].diff[...] = top_diff
    assert set(net.backward(start="ip", end="ip")) == {"data"}
    np.testing.assert_allclose(net.blobs["data"].diff, top_diff @ net.params["ip"][0].data, rtol=1e-5)
    assert set(net.backward(start="sum", end="pair", diffs=["total"])) == {"ip_blob", "total"}
    assert set(net.backward()) == {"data"}
def test_in_place_layer_shares_its_blob():
    net = make_net(f"""{input_layer()}
        layer {{ name: "mvn" type: "MVN" bottom: "data" top: "mvn" mvn_param {{ normalize_variance: false }} }}
        layer {{ name: "bn" type: "BatchNorm" bottom: "mvn" top: "mvn" batch_norm_param {{ eps: 0 }} }}""")
    assert list(net.blobs) == ["data", "mvn"]
    index = net.layer_names.index("bn")
    assert net.top_vecs[index][0] is net.bottom_vecs[index][0] is net.blobs["mvn"]
    x = random((2, 3, 4, 4)) * 3 + 2
    net.forward(data=x)
    centred = x - x.mean(axis=(2, 3), keepdims=True)
    expected = centred / centred.std(axis=(0, 2, 3), keepdims=True)
    np.testing.assert_allclose(net.blobs["mvn"].data, expected, rtol=1e-4, atol=1e-5)


def test_top_may_only_reuse_its_own_bottom():
    with pytest.raises(ConfigError, match=r"layer 'b' \(MVN\): top\[0\]: blob 'data' is produced by an earlier layer"):
        make_net(f"""{input_layer(tops=["data", "other"])}
            layer {{ name: "b" type: "MVN" bottom: "other" top: "data" }}""")


def test_fan_out_gets_a_split_and_sums_the_gradients():
    # BatchNorm with global stats of zero: y = x / sqrt(eps), so dL/dx is w / sqrt(eps)
    net = make_net(f"""force_backward: true
        {input_layer()}
        layer {{ name: "a" type: "BatchNorm" bottom: "data" top: "a" loss_weight: 2
                batch_norm_param {{ eps: 0.25 }} }}
        layer {{ name: "b" type: "BatchNorm" bottom: "data" top: "b" loss_weight: 3
                batch_norm_param {{ eps: 0.25 }} }}""", cct.TEST)
    assert net.layer_names == ["data", "data_data_0_split", "a", "b"]
    assert net.bottom_names["a"] == ["data_data_0_split_0"]
    assert net.bottom_names["b"] == ["data_data_0_split_1"]
    x = random((2, 3, 4, 4))
    net.blobs["data"].data[...] = x
    loss = net.forward_backward()
    np.testing.assert_allclose(loss, 5 * (x.astype(np.float32) / 0.5).sum(), rtol=1e-5)
    np.testing.assert_allclose(net.blobs["data"].diff, (2 + 3) / 0.5, rtol=1e-6)


# --- backward: force_backward, propagate_down, loss weights -----------------------------
MVN_ONLY = f"""{input_layer()}
layer {{ name: "mvn" type: "MVN" bottom: "data" top: "mvn" mvn_param {{ normalize_variance: false }} }}"""


def test_without_loss_or_learnable_params_nothing_runs_backward():
    net = make_net(MVN_ONLY)
    assert net.layer_need_backward == [False, False]
    assert net.bottom_need_backward[1] == [False]
    net.backward(mvn=np.ones((2, 3, 4, 4)))
    assert not net.blobs["data"].diff.any()


def test_force_backward_reaches_the_inputs():
    net = make_net("force_backward: true\n" + MVN_ONLY)
    assert net.layer_need_backward == [True, True]
    assert net.bottom_need_backward[1] == [True]
    g = random((2, 3, 4, 4), seed=3)
    diffs = net.backward(mvn=g)
    expected = g - g.mean(axis=(2, 3), keepdims=True)
    np.testing.assert_allclose(diffs["data"], expected, rtol=1e-5, atol=1e-6)


def test_force_backward_overrides_propagate_down_false():
    # Caffe: force_backward sets every bottom that the layer allows, even one
    # whose propagate_down is false.
    net = make_net("force_backward: true\n" + MVN_ONLY.replace('top: "mvn"', 'top: "mvn" propagate_down: false'))
    assert net.bottom_need_backward[1] == [True]


def test_propagate_down_count_must_match_bottoms():
    with pytest.raises(ConfigError, match=r"layer 'mvn' \(MVN\): propagate_down: give none or one per bottom"):
        make_net(MVN_ONLY.replace('top: "mvn"', 'top: "mvn" propagate_down: true propagate_down: false'))


def test_loss_weight_on_a_non_loss_layer():
    net = make_net(f"""force_backward: true
        {input_layer()}
        layer {{ name: "bn" type: "BatchNorm" bottom: "data" top: "bn" loss_weight: 2
                batch_norm_param {{ eps: 0.25 }} }}""", cct.TEST)
    assert net.blob_loss_weights["bn"] == 2 and net.blob_loss_weights["data"] == 0
    x = random((2, 3, 4, 4))
    net.blobs["data"].data[...] = x
    loss = net.forward_backward()
    np.testing.assert_allclose(loss, 2 * (x.astype(np.float32) / 0.5).sum(), rtol=1e-5)
    np.testing.assert_allclose(net.blobs["bn"].diff, 2.0)
    np.testing.assert_allclose(net.blobs["data"].diff, 2.0 / 0.5)


def test_loss_weight_count_must_match_tops():
    with pytest.raises(ConfigError, match=r"layer 'mvn' \(MVN\): loss_weight: give none or one per top"):
        make_net(MVN_ONLY.replace('top: "mvn"', 'top: "mvn" loss_weight: 1 loss_weight: 2'))


# --- weight sharing ---------------------------------------------------------------------
SHARED_BN = """
layer {{ name: "{name}" type: "BatchNorm" bottom: "{bottom}" top: "{name}"
        param {{ name: "mean" lr_mult: 0 }} param {{ name: "var" lr_mult: 0 }} param {{ name: "factor" lr_mult: 0 }} }}
"""


def test_params_shared_by_name_share_storage():
    net = make_net(input_layer(tops=["x", "y"]) + SHARED_BN.format(name="bn1", bottom="x")
                   + SHARED_BN.format(name="bn2", bottom="y"))
    for first, second in zip(net.params["bn1"], net.params["bn2"]):
        assert first is second
    assert len(net.learnable_params) == 3
    net.forward(x=random((2, 3, 4, 4)), y=random((2, 3, 4, 4), seed=1))
    # both layers updated the one set of running sums: the factor counts two batches
    np.testing.assert_allclose(net.params["bn1"][2].data, [np.float32(0.999) + 1])


def test_shared_param_with_another_shape_is_an_error():
    with pytest.raises(ConfigError, match=r"layer 'bn2' \(BatchNorm\): param\[0\] 'mean'.*\(4,\).*\(3,\)"):
        make_net(input_layer("x") + input_layer("y", (2, 4, 4, 4))
                 + SHARED_BN.format(name="bn1", bottom="x") + SHARED_BN.format(name="bn2", bottom="y"))


# --- construction errors ---------------------------------------------------------------
def test_unknown_layer_type_lists_the_known_ones():
    with pytest.raises(ConfigError) as error:
        make_net(f'{input_layer()} layer {{ name: "odd" type: "Bogus" bottom: "data" top: "o" }}')
    message = str(error.value)
    assert "layer 'odd' (Bogus): type: unknown layer type 'Bogus'; known types: " in message
    assert message.split("known types: ", 1)[1].split(", ") == cct.layer_type_list()


def test_unknown_prototxt_field_names_the_file_and_line(tmp_path):
    path = tmp_path / "bad.prototxt"
    path.write_text(f'name: "bad"\n{input_layer()}\nlayer {{ name: "m" type: "MVN" bogus_field: 1 }}\n')
    with pytest.raises(ConfigError, match=re.escape(f"{path}:3:") + ".*bogus_field"):
        cct.Net(str(path), cct.TRAIN)


def test_missing_bottom_names_the_layer():
    with pytest.raises(ConfigError, match=r"layer 'mvn' \(MVN\): bottom\[0\]: unknown blob 'nothing'"):
        make_net(f'{input_layer()} layer {{ name: "mvn" type: "MVN" bottom: "nothing" top: "mvn" }}')


def test_layer_without_a_name():
    with pytest.raises(ConfigError, match=r"layer #1 \(MVN\): name: missing"):
        make_net(f'{input_layer()} layer {{ type: "MVN" bottom: "data" top: "mvn" }}')


def test_phase_is_required():
    with pytest.raises(ConfigError, match="phase must be cct.TRAIN or cct.TEST"):
        cct.Net(MVN_ONLY)


def test_layer_setup_errors_propagate():
    with pytest.raises(ConfigError, match=r"layer 'lrn' \(LRN\): lrn_param.local_size"):
        make_net(f'{input_layer()} layer {{ name: "lrn" type: "LRN" bottom: "data" top: "l" '
                 'lrn_param { local_size: 2 } }')


# --- phase, level, stages ----------------------------------------------------------------
STAGED_NET = f"""{input_layer()}
layer {{ name: "train_only" type: "MVN" bottom: "data" top: "a" include {{ phase: TRAIN }} }}
layer {{ name: "test_only" type: "MVN" bottom: "data" top: "b" include {{ phase: TEST }} }}
layer {{ name: "deploy" type: "MVN" bottom: "data" top: "c" include {{ stage: "deploy" }} }}
layer {{ name: "level2" type: "MVN" bottom: "data" top: "d" include {{ min_level: 2 }} }}
"""


@pytest.mark.parametrize("phase,kwargs,names", [
    (cct.TRAIN, {}, ["data", "train_only"]),
    (cct.TEST, {}, ["data", "test_only"]),
    (cct.TEST, {"stages": ["deploy"]}, ["data", "test_only", "deploy"]),
    (cct.TRAIN, {"level": 2}, ["data", "train_only", "level2"]),
])
def test_phase_level_and_stages_filter_layers(phase, kwargs, names):
    net = make_net(STAGED_NET, phase, **kwargs)
    assert [name for name in net.layer_names if not name.endswith("_split")] == names


def test_given_stages_add_to_the_prototxt_state():
    # Caffe's Net(file, phase, level, stages) appends the stages to the file's state.
    net = make_net('state { stage: "a" }\n' + input_layer() +
                   'layer { name: "ab" type: "MVN" bottom: "data" top: "ab" include { stage: "a" stage: "b" } }',
                   cct.TEST, stages=["b"])
    assert net.layer_names == ["data", "ab"]


# --- weights ----------------------------------------------------------------------------
def trained_norm_net():
    net = make_net(NORM_NET)
    net.forward(data=random((2, 3, 4, 4)) * 2 + 1)     # TRAIN: fills BatchNorm's running sums
    assert net.params["bn"][2].data[0] == 1
    return net


@pytest.mark.parametrize("save", ["save", "save_hdf5"])
def test_save_and_copy_from_roundtrip(tmp_path, save):
    net = trained_norm_net()
    path = tmp_path / ("w.caffemodel" if save == "save" else "w.h5")
    getattr(net, save)(str(path))
    other = make_net(NORM_NET, cct.TEST)
    other.copy_from(str(path))
    for mine, theirs in zip(net.params["bn"], other.params["bn"]):
        np.testing.assert_array_equal(mine.data, theirs.data)


def test_legacy_constructor_loads_weights(tmp_path):
    net = trained_norm_net()
    weights = tmp_path / "w.caffemodel"
    net.save(str(weights))
    prototxt = tmp_path / "net.prototxt"
    prototxt.write_text(NORM_NET)
    for loaded in (cct.Net(str(prototxt), str(weights), cct.TEST),
                   cct.Net(str(prototxt), cct.TEST, weights=str(weights))):
        assert loaded.phase == cct.TEST
        np.testing.assert_array_equal(loaded.params["bn"][0].data, net.params["bn"][0].data)


def test_copy_from_ignores_layers_the_net_lacks(tmp_path):
    net = trained_norm_net()
    path = tmp_path / "w.caffemodel"
    net.save(str(path))
    # 'bn' is not in this net: its weights are skipped, without an error, and
    # land nowhere else (not in 'other_bn', whose blobs have the same shapes).
    smaller = make_net(MVN_ONLY + '\nlayer { name: "other_bn" type: "BatchNorm" bottom: "mvn" top: "other_bn" }')
    smaller.copy_from(str(path))
    assert list(smaller.params) == ["other_bn"]
    assert net.params["bn"][2].data[0] == 1
    assert not any(blob.data.any() for blob in smaller.params["other_bn"])


@pytest.mark.parametrize("save", ["save", "save_hdf5"])
def test_copy_from_shape_mismatch_names_the_layer(tmp_path, save):
    net = trained_norm_net()
    path = tmp_path / ("w.caffemodel" if save == "save" else "w.h5")
    getattr(net, save)(str(path))
    wider = make_net(NORM_NET.replace("dim: 3", "dim: 5"))
    with pytest.raises(WeightsError, match=re.escape(f"{path}: layer 'bn' (BatchNorm): ") + r".*blobs\[0\].*shape"):
        wider.copy_from(str(path))


def test_copy_from_missing_file(tmp_path):
    with pytest.raises(WeightsError, match="not found"):
        make_net(NORM_NET).copy_from(str(tmp_path / "nope.caffemodel"))


# --- nets with InnerProduct and losses ------------------------------------------------
IP = ('layer {{ name: "{name}" type: "InnerProduct" bottom: "{bottom}" top: "{name}" {extra} '
      'inner_product_param {{ num_output: {n} weight_filler {{ type: "gaussian" std: 0.5 }} '
      'bias_filler {{ type: "constant" value: 0.1 }} }} }}\n')


def ip(name, bottom, n=3, extra=""):
    return IP.format(name=name, bottom=bottom, n=n, extra=extra)


def euclidean(a, b, extra=""):
    return f'layer {{ name: "loss" type: "EuclideanLoss" bottom: "{a}" bottom: "{b}" top: "loss" {extra} }}\n'


def test_layers_not_under_a_loss_skip_backward():
    net = make_net(input_layer(shape=(4, 5), tops=["data"]) + input_layer("label", (4, 3))
                   + ip("ip1", "data") + ip("ip2", "ip1") + ip("ip3", "ip1") + euclidean("ip2", "label"))
    need = dict(zip(net.layer_names, net.layer_need_backward))
    assert need == {"data": False, "label": False, "ip1": True, "ip1_ip1_0_split": True,
                    "ip2": True, "ip3": False, "loss": True}
    assert net.bottom_need_backward[net.layer_names.index("loss")] == [True, False]
    assert net.bottom_need_backward[net.layer_names.index("ip1")] == [False]
    net.blobs["data"].data[...] = random((4, 5))
    net.blobs["label"].data[...] = random((4, 3), seed=1)
    net.clear_param_diffs()
    net.forward_backward()
    assert net.params["ip1"][0].diff.any() and net.params["ip2"][0].diff.any()
    assert not net.params["ip3"][0].diff.any()


def test_params_with_lr_mult_zero_do_not_make_a_layer_need_backward():
    frozen = 'param { lr_mult: 0 } param { lr_mult: 0 }'
    net = make_net(input_layer(shape=(4, 5)) + input_layer("label", (4, 3))
                   + ip("ip1", "data", extra=frozen) + ip("ip2", "ip1") + euclidean("ip2", "label"))
    need = dict(zip(net.layer_names, net.layer_need_backward))
    assert need["ip1"] is False and need["ip2"] is True
    assert net.bottom_need_backward[net.layer_names.index("ip2")] == [False]


SKIP_PROPAGATION_NET = """
name: "SkipPropTestNetwork"
layer { name: "data" type: "DummyData" top: "data" top: "label"
        dummy_data_param { shape { dim: 5 dim: 2 dim: 3 dim: 4 } data_filler { type: "gaussian" std: 0.01 }
                           shape { dim: 5 } data_filler { type: "constant" value: 0 } } }
layer { name: "silence" type: "Silence" bottom: "label" }
layer { name: "innerproduct" type: "InnerProduct" bottom: "data" top: "innerproduct"
        param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
        inner_product_param { num_output: 1 weight_filler { type: "gaussian" std: 0.01 }
                              bias_filler { type: "constant" value: 0 } } }
layer { name: "ip_fake_labels" type: "InnerProduct" bottom: "data" top: "fake_labels"
        param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
        inner_product_param { num_output: 1 weight_filler { type: "gaussian" std: 0.01 }
                              bias_filler { type: "constant" value: 0 } } }
layer { name: "argmax" type: "ArgMax" bottom: "fake_labels" top: "label_argmax" }
layer { name: "loss" type: "SigmoidCrossEntropyLoss" bottom: "innerproduct" bottom: "label_argmax"
        propagate_down: true propagate_down: PROPAGATE_LABEL top: "cross_entropy_loss" loss_weight: 0.1 }
"""


@pytest.mark.parametrize("propagate_label", [True, False])
def test_propagate_down_as_caffes_skip_propagation_test(propagate_label):
    """Caffe's NetTest.TestSkipPropagateDown."""
    net = make_net(SKIP_PROPAGATION_NET.replace("PROPAGATE_LABEL", str(propagate_label).lower()))
    need = dict(zip(net.layer_names, net.layer_need_backward))
    assert net.bottom_need_backward[net.layer_names.index("loss")][1] is propagate_label
    if propagate_label:
        expected = {name: "data" not in name and name != "silence" for name in net.layer_names}
    else:
        expected = {name: name in ("innerproduct", "loss") for name in net.layer_names}
    assert need == expected


def test_propagate_down_false_stops_gradients_below():
    net = make_net(input_layer(shape=(4, 5)) + input_layer("label", (4, 3))
                   + ip("ip1", "data") + ip("ip2", "ip1", extra="propagate_down: false")
                   + euclidean("ip2", "label"))
    need = dict(zip(net.layer_names, net.layer_need_backward))
    assert need["ip1"] is False and need["ip2"] is True
    assert net.bottom_need_backward[net.layer_names.index("ip2")] == [False]


def test_propagate_down_true_forces_a_gradient_to_an_input():
    # Caffe's AppendBottom: a given propagate_down decides the bottom's flag by itself
    # ("if set to true for some inputs, backpropagation to those inputs is forced").
    net = make_net(input_layer(shape=(4, 5)) + input_layer("label", (4, 3))
                   + ip("ip1", "data", extra="propagate_down: true") + euclidean("ip1", "label"))
    assert net.bottom_need_backward[net.layer_names.index("ip1")] == [True]
    net.blobs["data"].data[...] = random((4, 5))
    net.blobs["label"].data[...] = random((4, 3), seed=1)
    net.forward_backward()
    weights = net.params["ip1"][0].data
    expected = net.blobs["ip1"].diff @ weights
    np.testing.assert_allclose(net.blobs["data"].diff, expected, rtol=1e-5)


def test_shared_inner_product_weights_accumulate_both_gradients():
    shared = 'param { name: "w" } param { name: "b" }'
    net = make_net(input_layer(shape=(4, 5), tops=["x", "y"]) + input_layer("label", (4, 3))
                   + ip("ip1", "x", extra=shared) + ip("ip2", "y", extra=shared)
                   + 'layer { name: "sum" type: "Eltwise" bottom: "ip1" bottom: "ip2" top: "sum" }\n'
                   + euclidean("sum", "label"))
    assert net.params["ip1"][0] is net.params["ip2"][0]
    assert len(net.learnable_params) == 2
    x, y, label = random((4, 5)), random((4, 5), seed=1), random((4, 3), seed=2)
    net.blobs["x"].data[...] = x
    net.blobs["y"].data[...] = y
    net.blobs["label"].data[...] = label
    net.clear_param_diffs()
    net.forward_backward()
    w, b = net.params["ip1"][0].data, net.params["ip1"][1].data
    residual = (x @ w.T + b) + (y @ w.T + b) - label          # EuclideanLoss: sum(r^2) / (2N)
    g = residual / 4
    np.testing.assert_allclose(net.params["ip1"][0].diff, g.T @ x + g.T @ y, rtol=1e-4)
    np.testing.assert_allclose(net.params["ip1"][1].diff, 2 * g.sum(axis=0), rtol=1e-4)


def test_shared_inner_product_with_another_shape_is_an_error():
    with pytest.raises(ConfigError, match=r"layer 'ip2' \(InnerProduct\): param\[0\] 'w'"):
        make_net(input_layer(shape=(4, 5), tops=["x", "y"])
                 + ip("ip1", "x", extra='param { name: "w" }') + ip("ip2", "y", n=4, extra='param { name: "w" }'))


def test_shared_params_with_conflicting_lr_mult():
    with pytest.raises(ConfigError, match=r"layer 'ip2'.*lr_mult"):
        make_net(input_layer(shape=(4, 5), tops=["x", "y"])
                 + ip("ip1", "x", extra='param { name: "w" lr_mult: 1 }')
                 + ip("ip2", "y", extra='param { name: "w" lr_mult: 2 }'))


def test_softmax_loss_gets_loss_weight_one_and_an_automatic_top():
    net = make_net(input_layer(shape=(4, 5)) + input_layer("label", (4,))
                   + ip("ip", "data")
                   + 'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" }')
    loss_index = net.layer_names.index("loss")
    assert len(net.top_vecs[loss_index]) == 1
    assert net.layers[loss_index].loss_weights == [1.0]
    assert net.bottom_need_backward[loss_index] == [True, False]


def test_copy_from_inner_product_shape_mismatch(tmp_path):
    net = make_net(input_layer(shape=(4, 5)) + ip("fc", "data"))
    path = tmp_path / "w.caffemodel"
    net.save(str(path))
    wider = make_net(input_layer(shape=(4, 5)) + ip("fc", "data", n=6))
    with pytest.raises(WeightsError, match=r"layer 'fc' \(InnerProduct\): blobs\[0\]: shape mismatch"):
        wider.copy_from(str(path))


def test_v0_prototxt_builds_an_upgraded_net():
    net = make_net("""name: "old"
        input: "data" input_dim: 2 input_dim: 3 input_dim: 4 input_dim: 4
        layers { layer { name: "norm" type: "lrn" local_size: 3 alpha: 0.5 } bottom: "data" top: "norm" }""")
    assert net.layer_names == ["input", "norm"]
    assert [layer.type for layer in net.layers] == ["Input", "LRN"]
    assert net.layers[1].size == 3 and net.blobs["norm"].shape == (2, 3, 4, 4)


# --- behaviours checked against BVLC Caffe's net.cpp / pycaffe.py -------------------
FAN_OUT = '''name: "fan"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }
layer { name: "zz" type: "Sigmoid" bottom: "data" top: "zz" }
layer { name: "aa" type: "TanH" bottom: "data" top: "aa" }
'''

SHARED = '''name: "shared"
layer { name: "in" type: "Input" top: "in" input_param { shape { dim: 2 dim: 3 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "in" top: "ip1" param { name: "w" } param { name: "b" }
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 1 } } }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2" param { name: "w" } param { name: "b" }
        inner_product_param { num_output: 3 } }
'''


def test_outputs_are_sorted_like_caffes_set():
    assert cct.Net(FAN_OUT, cct.TEST).outputs == ["aa", "zz"]


def test_a_layers_own_phase_wins():
    net = cct.Net('''layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 4 dim: 50 } } }
                     layer { name: "drop" type: "Dropout" bottom: "data" top: "out" phase: TEST }''', cct.TRAIN)
    net.blobs["data"].data[...] = 1
    np.testing.assert_array_equal(net.forward()["out"], 1)


def test_to_proto_holds_name_and_layers_with_their_phase():
    proto = cct.Net(FAN_OUT, cct.TEST).to_proto()
    assert [f.name for f, _ in proto.ListFields()] == ["name", "layer"]
    assert all(layer.phase == cct.TEST for layer in proto.layer)


def test_backward_end_returns_the_end_layers_bottoms():
    """Caffe 1.0's pycaffe (commit 35a7b87): bottom_names[end], not the layer's name."""
    net = cct.Net(SHARED, cct.TRAIN)
    net.forward()
    assert set(net.backward(end="ip2")) == {"ip1"}


def test_hdf5_stores_shared_params_once_and_loads_them(tmp_path):
    import h5py
    net = cct.Net(SHARED, cct.TRAIN)
    path = str(tmp_path / "shared.h5")
    net.save_hdf5(path)
    with h5py.File(path, "r") as stored:
        assert {name: sorted(stored["data"][name]) for name in stored["data"]} == \
            {"in": [], "ip1": ["0", "1"], "ip2": []}
    other = cct.Net(SHARED, cct.TRAIN)
    other.copy_from(path)
    np.testing.assert_array_equal(other.params["ip2"][0].data, net.params["ip1"][0].data)


def test_parse_error_names_file_line_and_layer(tmp_path):
    path = tmp_path / "bad.prototxt"
    path.write_text('name: "x"\nlayer { name: "data" type: "Input" top: "data" }\n'
                    'layer {\n  name: "ip"\n  type: "InnerProduct"\n  bogus: 3\n}\n'
                    'layer { name: "after" type: "ReLU" }\n')
    with pytest.raises(cct.ConfigError, match=r"bad.prototxt:6:3 .*no field named \"bogus\".*\(in layer 'ip'\)"):
        cct.Net(str(path), cct.TEST)


def test_unknown_type_is_named_before_its_blobs(tmp_path):
    with pytest.raises(cct.ConfigError, match=r"layer 'c' \(Convolutio\): type: unknown layer type"):
        cct.Net('layer { name: "c" type: "Convolutio" bottom: "a" top: "c" }', cct.TEST)


def test_a_net_given_as_text_is_named_so_in_errors():
    """Not by its whole text: a message names "<prototxt text>", the layer and the field."""
    text = """layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 0 dim: 4 dim: 5 } } }
    layer { name: "l" type: "PReLU" bottom: "data" top: "data" }"""
    with pytest.raises(cct.ConfigError) as refused:
        cct.Net(text, cct.TRAIN)
    assert str(refused.value).startswith("<prototxt text>: layer 'l' (PReLU): prelu_param.filler: ")
    with pytest.raises(cct.ConfigError, match=r"^<prototxt text>:1:"):
        cct.Net("layer { nme: 'x' }", cct.TRAIN)


def test_loading_derives_every_layers_values_and_raises_their_error(tmp_path, monkeypatch):
    """Net._loaded runs each layer's params_loaded once, several at a time
    (LOAD_THREADS), and an error in one reaches the caller, whichever thread
    met it."""
    text = "\n".join(['name: "many" input: "data" input_shape { dim: 1 dim: 2 }']
                     + [f'layer {{ name: "bn{i}" type: "BatchNorm" bottom: "data" top: "bn{i}" }}' for i in range(12)])
    prototxt, weights = tmp_path / "net.prototxt", tmp_path / "w.caffemodel"
    prototxt.write_text(text)
    make_net(text, cct.TEST).save(str(weights))
    seen = []
    layer_class = type(make_net(text, cct.TEST).layer_dict["bn0"])
    monkeypatch.setattr(layer_class, "params_loaded", lambda layer: seen.append(layer.name))
    cct.Net(str(prototxt), cct.TEST, weights=str(weights))
    assert sorted(seen) == sorted(f"bn{i}" for i in range(12))

    def failing(layer):
        if layer.name == "bn7":
            raise WeightsError("bn7: cannot derive")
    monkeypatch.setattr(layer_class, "params_loaded", failing)
    with pytest.raises(WeightsError, match="bn7: cannot derive"):
        cct.Net(str(prototxt), cct.TEST, weights=str(weights))
