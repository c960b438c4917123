"""cct.runtime.fusion: one test per fusion rule, each checking that the fused
and the unfused net agree and that every blob a user can read holds Caffe's
value (from naive numpy below, never from cct's layers); weights set after
the net was built, forwards over part of the net, backward after a fused
forward, callbacks, the switch, and the compiled pass against its numpy
reference."""
import numpy as np
import pytest

import cct
from cct.core.errors import ConfigError
from cct.runtime import fusion, settings
from helpers.reference import TOLERANCE, relative_error

RNG = np.random.default_rng(20)
EPS = 1e-5


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in (settings.FUSION_ENV, settings.CONFIG_ENV):
        monkeypatch.delenv(name, raising=False)
    settings.set_fusion(None)
    settings.load(None)
    yield
    settings.set_fusion(None)
    settings.load(None)


def build(text, fused, phase=cct.TEST):
    settings.set_fusion(fused)
    try:
        return cct.Net(text, phase)
    finally:
        settings.set_fusion(None)


def randomize(net, rng=RNG):
    """Every parameter random; BatchNorm statistics sane, with a factor != 1."""
    for layer in net.layers:
        if layer.type == "BatchNorm":
            mean, variance, factor = layer.blobs
            factor.data[...] = 2.5
            mean.data[...] = rng.normal(0, 0.5, mean.shape) * 2.5
            variance.data[...] = rng.uniform(0.2, 2.0, variance.shape) * 2.5
        else:
            for blob in layer.blobs:
                blob.data[...] = rng.normal(0, 0.5, blob.shape)


def pair(text, **inputs):
    """(fused net, unfused net) with the same parameters and inputs, both run forward."""
    fused, unfused = build(text, True), build(text, False)
    randomize(fused)
    unfused.share_with(fused)
    for net in (fused, unfused):
        for name, values in inputs.items():
            net.blobs[name].data[...] = values
        net.forward()
    return fused, unfused


def assert_agree(fused, unfused, expected):
    """Fused and unfused hold the same value in every blob, and each blob in
    `expected` holds it within the reference cases' tolerance."""
    for name in unfused.blobs:
        assert relative_error(fused.blobs[name].data, unfused.blobs[name].data) <= 1e-5, name
    for name, values in expected.items():
        for net in (fused, unfused):
            assert relative_error(net.blobs[name].data, values) <= TOLERANCE, name


# --- Caffe's layers, naively ------------------------------------------------------------------
def conv(x, w, b, pad):
    """Caffe's convolution, stride 1: x (N, C, H, W), w (O, C, KH, KW)."""
    n, c, h, width = x.shape
    o, _, kh, kw = w.shape
    xp = np.zeros((n, c, h + 2 * pad, width + 2 * pad))
    xp[:, :, pad:pad + h, pad:pad + width] = x
    oh, ow = h + 2 * pad - kh + 1, width + 2 * pad - kw + 1
    y = np.zeros((n, o, oh, ow))
    for i in range(kh):
        for j in range(kw):
            y += np.einsum("nchw,oc->nohw", xp[:, :, i:i + oh, j:j + ow], w[:, :, i, j])
    return y + b.reshape(1, -1, 1, 1)


def channels(values, ndim):
    return np.asarray(values, np.float64).reshape((1, -1) + (1,) * (ndim - 2))


def batch_norm(net, name, x):
    mean, variance, factor = (blob.data.astype(np.float64) for blob in net.params[name])
    scale = 1 / factor[0]
    return (x - channels(mean * scale, x.ndim)) / np.sqrt(channels(variance * scale, x.ndim) + EPS)


def scale(net, name, x):
    gamma, beta = net.params[name]
    return x * channels(gamma.data, x.ndim) + channels(beta.data, x.ndim)


def relu(x, slope=0.0):
    return np.where(x > 0, x, slope * x)


def params(net, name):
    return [blob.data.astype(np.float64) for blob in net.params[name]]


def runs(net):
    """The fused runs by layer name."""
    return [[net.layers[i].name for i in run] for run in net.executor.fusion.runs]


# --- rule 1: element-wise runs ----------------------------------------------------------------
CHAIN = """name: "chain"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 3 dim: 3 dim: 7 dim: 6 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 5 kernel_size: 3 pad: 1 } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "sc1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
"""


def chain_value(net, x):
    y = conv(x, *params(net, "conv1"), pad=1)
    return relu(scale(net, "sc1", batch_norm(net, "bn1", y)))


def assert_same_gradients(fused, unfused):
    """Every blob's and parameter's diff within 1e-5 of the unfused net's."""
    for name in unfused.blobs:
        assert relative_error(fused.blobs[name].diff, unfused.blobs[name].diff) <= 1e-5, name
    for name in unfused.params:
        for ours, theirs in zip(fused.params[name], unfused.params[name]):
            assert relative_error(ours.diff, theirs.diff) <= 1e-5, name


def test_convolution_batchnorm_scale_relu_in_place_run_as_one_pass(partitions):
    x = RNG.normal(size=(3, 3, 7, 6)).astype(np.float32)
    fused, unfused = pair(CHAIN, data=x)
    assert runs(fused) == [["bn1", "sc1", "relu1"]]
    weights = [blob.data.copy() for blob in fused.params["conv1"]]
    assert_agree(fused, unfused, {"data": x, "conv1": chain_value(unfused, x)})
    # the convolution's own parameters are what pycaffe set, not folded copies
    assert all(np.array_equal(blob.data, w) for blob, w in zip(fused.params["conv1"], weights))


def test_a_batchnorm_with_its_own_top_leaves_the_convolution_output_visible():
    text = CHAIN.replace('"bn1" type: "BatchNorm" bottom: "conv1" top: "conv1"',
                         '"bn1" type: "BatchNorm" bottom: "conv1" top: "bn1"')
    text = text.replace('bottom: "conv1" top: "conv1" scale_param', 'bottom: "bn1" top: "bn1" scale_param')
    text = text.replace('"relu1" type: "ReLU" bottom: "conv1" top: "conv1"',
                        '"relu1" type: "ReLU" bottom: "bn1" top: "bn1"')
    x = RNG.normal(size=(3, 3, 7, 6)).astype(np.float32)
    fused, unfused = pair(text, data=x)
    assert runs(fused) == [["bn1", "sc1", "relu1"]]
    y = conv(x, *params(unfused, "conv1"), pad=1)
    assert_agree(fused, unfused, {"conv1": y, "bn1": relu(scale(unfused, "sc1", batch_norm(unfused, "bn1", y)))})


def test_inner_product_batchnorm_scale_relu():
    text = """name: "ip"
    layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 4 dim: 2 dim: 3 dim: 3 } } }
    layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 6 } }
    layer { name: "bn" type: "BatchNorm" bottom: "ip" top: "ip" }
    layer { name: "sc" type: "Scale" bottom: "ip" top: "ip" scale_param { bias_term: true } }
    layer { name: "relu" type: "ReLU" bottom: "ip" top: "ip" relu_param { negative_slope: 0.1 } }
    layer { name: "drop" type: "Dropout" bottom: "ip" top: "ip" }
    """
    x = RNG.normal(size=(4, 2, 3, 3)).astype(np.float32)
    fused, unfused = pair(text, data=x)
    assert runs(fused) == [["bn", "sc", "relu", "drop"]]
    w, b = params(unfused, "ip")
    y = x.reshape(4, -1) @ w.T + b
    assert_agree(fused, unfused, {"ip": relu(scale(unfused, "sc", batch_norm(unfused, "bn", y)), 0.1)})


RESIDUAL = """name: "residual"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 4 dim: 5 dim: 5 } } }
layer { name: "conv_a" type: "Convolution" bottom: "data" top: "a" convolution_param { num_output: 4 kernel_size: 1 } }
layer { name: "relu_a" type: "ReLU" bottom: "a" top: "a" }
layer { name: "conv_b" type: "Convolution" bottom: "a" top: "b"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 } }
layer { name: "bn_b" type: "BatchNorm" bottom: "b" top: "b" }
layer { name: "sc_b" type: "Scale" bottom: "b" top: "b" scale_param { bias_term: true } }
layer { name: "sum" type: "Eltwise" bottom: "a" bottom: "b" top: "sum" eltwise_param { coeff: 0.5 coeff: -2 } }
layer { name: "relu_sum" type: "ReLU" bottom: "sum" top: "sum" }
"""


def test_an_eltwise_sum_and_its_relu_join_the_branch_that_feeds_them():
    x = RNG.normal(size=(2, 4, 5, 5)).astype(np.float32)
    fused, unfused = pair(RESIDUAL, data=x)
    assert runs(fused) == [["bn_b", "sc_b", "sum", "relu_sum"]]
    a = relu(conv(x, *params(unfused, "conv_a"), pad=0))
    b = scale(unfused, "sc_b", batch_norm(unfused, "bn_b", conv(a, *params(unfused, "conv_b"), pad=1)))
    # the branch's blob keeps the Scale's value; the sum's blob gets the ReLU's
    assert_agree(fused, unfused, {"a": a, "b": b, "sum": relu(0.5 * a - 2 * b)})


def test_a_relu_after_relu_starts_a_new_pass():
    text = CHAIN + """layer { name: "sc2" type: "Scale" bottom: "conv1" top: "conv1" }
    layer { name: "relu2" type: "ReLU" bottom: "conv1" top: "conv1" }"""
    x = RNG.normal(size=(3, 3, 7, 6)).astype(np.float32)
    fused, unfused = pair(text, data=x)
    assert runs(fused) == [["bn1", "sc1", "relu1"], ["sc2", "relu2"]]
    gamma = params(unfused, "sc2")[0]
    assert_agree(fused, unfused, {"conv1": relu(chain_value(unfused, x) * channels(gamma, 4))})


# --- rule 2: output ReLUs ----------------------------------------------------------------------
CONV_RELU = """name: "conv_relu"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 3 dim: 3 dim: 7 dim: 6 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" relu_param { negative_slope: SLOPE } }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2" convolution_param { num_output: 2 kernel_size: 1 } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "relu2" }
"""


def output_relus(net):
    return {net.layers[index].name: net.layers[relu].name
            for index, (relu, _) in net.executor.fusion.output_relus.items()}


@pytest.mark.parametrize("slope", [0.0, 0.1])
@pytest.mark.parametrize("partitions", [1, 3])
def test_an_in_place_relu_runs_in_its_convolutions_output_store(slope, partitions, monkeypatch):
    """Bitwise the unfused values in every blob (batch partitions too); a
    ReLU with its own top is not folded (the convolution's blob stays
    visible)."""
    monkeypatch.setenv("CCT_PARTITIONS", str(partitions))
    x = RNG.normal(size=(3, 3, 7, 6)).astype(np.float32)
    fused, unfused = pair(CONV_RELU.replace("SLOPE", str(slope)), data=x)
    assert output_relus(fused) == {"conv1": "relu1"}
    for name in unfused.blobs:
        assert fused.blobs[name].data.tobytes() == unfused.blobs[name].data.tobytes(), name
    y = conv(x, *params(unfused, "conv1"), pad=1)
    assert_agree(fused, unfused, {"conv1": relu(y, slope)})
    calls = []
    relu_layer = fused.layers[list(fused.layer_names).index("relu1")]
    monkeypatch.setattr(relu_layer, "forward", lambda *args: calls.append(args))
    fused.forward()
    assert calls == []                          # skipped: its convolution ran it


def test_a_forward_ending_at_the_convolution_leaves_its_output_before_the_relu():
    x = RNG.normal(size=(3, 3, 7, 6)).astype(np.float32)
    fused, unfused = pair(CONV_RELU.replace("SLOPE", "0"), data=x)
    y = conv(x, *params(unfused, "conv1"), pad=1)
    fused.forward(end="conv1")
    assert relative_error(fused.blobs["conv1"].data, y) <= TOLERANCE
    fused.forward(start="relu1", end="relu1")     # the ReLU runs itself: its convolution did not
    assert relative_error(fused.blobs["conv1"].data, relu(y)) <= TOLERANCE
    seen = {}
    fused.after_forward(lambda index: seen.setdefault(fused.layers[index].name, fused.blobs["conv1"].data.copy()))
    fused.forward()                                # callbacks: every layer by itself
    assert relative_error(seen["conv1"], y) <= TOLERANCE


def test_a_relu_whose_backward_reads_its_input_is_not_folded():
    """In place, a negative slope below 0 keeps the input for backward, which
    the output store does not: never folded."""
    fused = build(CONV_RELU.replace("SLOPE", "-0.5"), True)
    assert output_relus(fused) == {}
    fusion.forward_only(fused)
    assert output_relus(fused) == {}


# --- rule 3: Split as aliases -----------------------------------------------------------------
def test_split_tops_alias_their_bottom_unless_a_later_layer_writes_them():
    x = RNG.normal(size=(2, 4, 5, 5)).astype(np.float32)
    # an explicit Split whose first top a later ReLU writes in place
    text = RESIDUAL + """layer { name: "fork" type: "Split" bottom: "sum" top: "s1" top: "s2" }
    layer { name: "relu_s1" type: "ReLU" bottom: "s1" top: "s1" relu_param { negative_slope: -1 } }
    layer { name: "conv_c" type: "Convolution" bottom: "s2" top: "c"
            convolution_param { num_output: 2 kernel_size: 1 } }
    layer { name: "conv_d" type: "Convolution" bottom: "s1" top: "d"
            convolution_param { num_output: 2 kernel_size: 1 } }"""
    fused, unfused = pair(text, data=x)
    aliased = [fused.layers[i].name for i in fused.executor.fusion.aliases]
    (split_a,) = [layer.name for layer in fused.layers if layer.type == "Split" and layer.name != "fork"]
    assert aliased == [split_a]
    for name in fused.top_names[split_a]:
        assert np.shares_memory(fused.blobs[name].data, fused.blobs["a"].data)
        assert not np.shares_memory(unfused.blobs[name].data, unfused.blobs["a"].data)
    a = relu(conv(x, *params(unfused, "conv_a"), pad=0))
    b = scale(unfused, "sc_b", batch_norm(unfused, "bn_b", conv(a, *params(unfused, "conv_b"), pad=1)))
    total = relu(0.5 * a - 2 * b)
    expected = {name: a for name in fused.top_names[split_a]}
    expected.update({"s1": np.abs(total), "s2": total, "c": conv(total, *params(unfused, "conv_c"), pad=0),
                     "d": conv(np.abs(total), *params(unfused, "conv_d"), pad=0)})
    assert_agree(fused, unfused, expected)


# --- rule 4: Concat as views ------------------------------------------------------------------
CONCAT = """name: "concat"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 6 dim: 5 } } }
layer { name: "conv_a" type: "Convolution" bottom: "data" top: "a" convolution_param { num_output: 2 kernel_size: 1 } }
layer { name: "relu_a" type: "ReLU" bottom: "a" top: "a" }
layer { name: "conv_b" type: "Convolution" bottom: "data" top: "b"
        convolution_param { num_output: 3 kernel_size: 3 pad: 1 } }
layer { name: "cat" type: "Concat" bottom: "a" bottom: "b" top: "cat" }
layer { name: "conv_c" type: "Convolution" bottom: "cat" top: "c" convolution_param { num_output: 2 kernel_size: 1 } }
"""


def concat_values(net, x):
    a = relu(conv(x, *params(net, "conv_a"), pad=0))
    b = conv(x, *params(net, "conv_b"), pad=1)
    joined = np.concatenate([a, b], axis=1)
    return {"a": a, "b": b, "cat": joined, "c": conv(joined, *params(net, "conv_c"), pad=0)}


def concat_views(net):
    return [net.layers[i].name for i in net.executor.fusion.concat_views]


def placed(net, names=("a", "b")):
    """Whether each bottom's data lives in the Concat's top."""
    return [np.shares_memory(net.blobs[name].data, net.blobs["cat"].data) for name in names]


def test_concat_bottoms_live_in_the_top_where_its_pieces_are_contiguous():
    x = RNG.normal(size=(1, 3, 6, 5)).astype(np.float32)
    fused, unfused = pair(CONCAT, data=x)
    assert concat_views(fused) == ["cat"]
    assert fusion.describe(fused)[-1] == "  cat: 'a', 'b' written in place in 'cat' (where contiguous)"
    assert placed(fused) == [True, True] and placed(unfused) == [False, False]
    assert_agree(fused, unfused, concat_values(unfused, x))
    # the next forwards write the top through the bottoms, nothing copied
    for batch in (1, 2, 1):           # at batch 2 the pieces are strided: copied as Caffe does
        x = RNG.normal(size=(batch, 3, 6, 5)).astype(np.float32)
        for net in (fused, unfused):
            net.blobs["data"].reshape(x.shape)
            net.blobs["data"].data[...] = x
            net.forward()
        assert placed(fused) == [batch == 1] * 2
        assert_agree(fused, unfused, concat_values(unfused, x))


@pytest.mark.parametrize("change, kept", [
    ('layer { name: "relu_cat" type: "ReLU" bottom: "cat" top: "cat" }', False),     # a later layer writes the top
    ('layer { name: "conv_d" type: "Convolution" bottom: "b" top: "d" '               # b is read twice: by a Split
     'convolution_param { num_output: 1 kernel_size: 1 } }', False),
    ('layer { name: "flat" type: "Flatten" bottom: "cat" top: "flat" }', True)])      # the top read, shared
def test_concat_views_only_where_no_other_layer_or_blob_can_see_the_difference(change, kept):
    x = RNG.normal(size=(1, 3, 6, 5)).astype(np.float32)
    text = CONCAT.replace('layer { name: "conv_c"', change + '\nlayer { name: "conv_c"')
    fused, unfused = pair(text, data=x)
    assert concat_views(fused) == (["cat"] if kept else [])
    assert_agree(fused, unfused, {})


def test_a_net_input_is_not_placed_in_a_concat():
    text = CONCAT.replace('bottom: "a" bottom: "b" top: "cat"', 'bottom: "a" bottom: "side" top: "cat"') + \
        'layer { name: "side" type: "Input" top: "side" input_param { shape { dim: 1 dim: 1 dim: 6 dim: 5 } } }'
    text = text.replace('layer { name: "cat"', 'layer { name: "side" type: "Input" top: "side" '
                        'input_param { shape { dim: 1 dim: 1 dim: 6 dim: 5 } } }\nlayer { name: "cat"', 1)
    text = text[:text.rindex('layer { name: "side"')]
    fused, unfused = pair(text, data=RNG.normal(size=(1, 3, 6, 5)), side=RNG.normal(size=(1, 1, 6, 5)))
    assert concat_views(fused) == []
    assert_agree(fused, unfused, {})


def test_a_reshape_to_strided_pieces_of_the_same_size_moves_the_bottoms_out():
    x = RNG.normal(size=(1, 3, 6, 5)).astype(np.float32)
    fused, unfused = pair(CONCAT, data=x)
    x = RNG.normal(size=(2, 3, 3, 5)).astype(np.float32)     # every blob keeps its count
    for net in (fused, unfused):
        net.blobs["data"].reshape(x.shape)
        net.blobs["data"].data[...] = x
        net.forward()
    assert placed(fused) == [False, False]
    assert_agree(fused, unfused, concat_values(unfused, x))


# Each step: (mode, whether the Concat runs on the device in "gpu" mode: False
# runs it on the host, as a layer without a device path or of a hybrid share 0).
@pytest.mark.opencl
@pytest.mark.parametrize("steps", [
    [("gpu", True), ("cpu", True)],
    [("cpu", True), ("gpu", True)],
    [("gpu", True), ("gpu", False)],                   # the top's device copy is stale: never copied down
    [("gpu", False), ("gpu", False)],                  # ... nor read by the device layer after the Concat
    [("gpu", False), ("cpu", True), ("gpu", True), ("cpu", True)],
    [("gpu", True), ("cpu", True), ("cpu", True)]])             # placed again, its reshape not skipped
def test_concat_views_hold_through_forwards_on_a_device_and_back(steps, monkeypatch):
    """Forwards one after the other with nothing read in between (a read
    makes the host current), then every blob against the unfused net's."""
    from cct.layers.shape import Concat
    from helpers.devices import opencl_or_skip
    device = opencl_or_skip()
    fused, unfused = pair(CONCAT, data=RNG.normal(size=(1, 3, 6, 5)))
    settings.set_device_id(device.index)
    runs_on = Concat.runs_on
    for mode, concat_on_device in steps:
        x = RNG.normal(size=(1, 3, 6, 5)).astype(np.float32)
        settings.set_mode(mode)
        monkeypatch.setattr(Concat, "runs_on", runs_on if concat_on_device else lambda *args: False)
        fused.blobs["data"].data[...] = x
        fused.forward()
    settings.set_mode("cpu")
    unfused.blobs["data"].data[...] = x
    unfused.forward()
    assert_agree(fused, unfused, concat_values(unfused, x))
    # placed again at the reshape after a host forward of the Concat, so from the second
    on_host = [mode == "cpu" or not concat_on_device for mode, concat_on_device in steps]
    assert placed(fused) == [on_host[-1] and (len(steps) == 1 or on_host[-2])] * 2


# --- what the rules keep: current weights, any range, backward, callbacks -----------------------------
def test_weights_set_or_loaded_after_building_take_effect(tmp_path):
    x = RNG.normal(size=(3, 3, 7, 6)).astype(np.float32)
    fused, unfused = pair(CHAIN, data=x)
    # set in place through pycaffe's views
    fused.params["conv1"][0].data[...] *= -1.5
    fused.params["bn1"][1].data[...] *= 3
    fused.params["sc1"][0].data[...] += 0.25
    fused.forward()
    unfused.forward()
    assert_agree(fused, unfused, {"conv1": chain_value(unfused, x)})
    # loaded from another net's weights
    other = build(CHAIN, False)
    randomize(other, np.random.default_rng(3))
    other.save(str(tmp_path / "other.caffemodel"))
    fused.copy_from(str(tmp_path / "other.caffemodel"))
    fused.forward()
    for name in ("conv1", "bn1", "sc1"):
        assert all(np.array_equal(a.data, b.data) for a, b in zip(fused.params[name], other.params[name]))
    assert relative_error(fused.blobs["conv1"].data, chain_value(other, x)) <= TOLERANCE


def _counting_epilogues(monkeypatch):
    """Calls of BatchNorm's epilogue, counted: a replayed run asks none."""
    from cct.layers.normalization import BatchNorm
    calls = []
    original = BatchNorm.epilogue
    monkeypatch.setattr(BatchNorm, "epilogue", lambda self, *a: calls.append(self.name) or original(self, *a))
    return calls


def test_a_run_is_replayed_while_nothing_it_reads_changes(monkeypatch):
    x = RNG.normal(size=(3, 3, 7, 6)).astype(np.float32)
    fused, unfused = pair(CHAIN, data=x)
    calls = _counting_epilogues(monkeypatch)
    for _ in range(2):
        x = RNG.normal(size=(3, 3, 7, 6)).astype(np.float32)
        fused.blobs["data"].data[...] = x
        fused.forward()
        assert relative_error(fused.blobs["conv1"].data, chain_value(unfused, x)) <= TOLERANCE
    assert calls == []                          # the input's values changed, nothing the run composes did
    fused.blobs["data"].reshape(2, 3, 7, 6)     # a new shape: composed again, then replayed again
    fused.blobs["data"].data[...] = x[:2]
    fused.forward()
    fused.forward()
    assert calls == ["bn1"]
    assert relative_error(fused.blobs["conv1"].data, chain_value(unfused, x[:2])) <= TOLERANCE


def test_a_sum_reading_an_aliased_split_is_replayed_too(monkeypatch):
    """ResNet's identity blocks: the sum's other operand is a Split top that
    shares its bottom's data, shared again at every forward (Blob.share_data
    keeps the views it has, so the run still reads the same arrays)."""
    x = RNG.normal(size=(2, 4, 5, 5)).astype(np.float32)
    fused, unfused = pair(RESIDUAL, data=x)
    assert fused.executor.fusion.aliases
    calls = _counting_epilogues(monkeypatch)
    x = RNG.normal(size=(2, 4, 5, 5)).astype(np.float32)
    for net in (fused, unfused):
        net.blobs["data"].data[...] = x
        net.forward()
    assert calls == []                          # replayed (the unfused net runs BatchNorm's forward)
    a = relu(conv(x, *params(unfused, "conv_a"), pad=0))
    b = scale(unfused, "sc_b", batch_norm(unfused, "bn_b", conv(a, *params(unfused, "conv_b"), pad=1)))
    assert_agree(fused, unfused, {"a": a, "b": b, "sum": relu(0.5 * a - 2 * b)})


@pytest.mark.parametrize("layer, param", [("bn1", 0), ("bn1", 1), ("bn1", 2), ("sc1", 0), ("sc1", 1)])
def test_a_parameter_written_through_its_view_ends_the_replay(layer, param, monkeypatch):
    x = RNG.normal(size=(3, 3, 7, 6)).astype(np.float32)
    fused, unfused = pair(CHAIN, data=x)
    fused.forward()                             # replayed
    calls = _counting_epilogues(monkeypatch)
    view = fused.params[layer][param].data
    view[view.size // 2 if view.ndim else ()] *= 1.75       # one value, in place
    fused.forward()
    assert calls == ["bn1"]
    assert relative_error(fused.blobs["conv1"].data, chain_value(fused, x)) <= TOLERANCE


def test_a_zero_whose_sign_changes_ends_the_replay_and_a_nan_left_alone_does_not(monkeypatch):
    """Bit for bit: -0.0 and 0.0 compare equal as values, but a BatchNorm
    mean of -0.0 gives shift +0.0 and a -0.0 input a +0.0 output; a NaN kept
    as it was is unchanged."""
    x = RNG.normal(size=(3, 3, 7, 6)).astype(np.float32)
    fused, _ = pair(CHAIN, data=x)
    mean = fused.params["bn1"][0].data
    mean[0] = 0.0
    fused.forward()                             # composed with +0.0, then kept
    calls = _counting_epilogues(monkeypatch)
    fused.forward()
    assert calls == []
    mean[0] = -0.0
    fused.forward()
    assert calls == ["bn1"]
    fused.params["sc1"][1].data[1] = np.nan     # a NaN bias: composed once, then kept
    fused.forward()
    fused.forward()
    assert calls == ["bn1", "bn1"]


def test_a_forward_ending_inside_a_kept_run_leaves_caffes_values():
    x = RNG.normal(size=(3, 3, 7, 6)).astype(np.float32)
    fused, unfused = pair(CHAIN, data=x)
    fused.forward()                             # the run's pass is kept
    y = conv(x, *params(unfused, "conv1"), pad=1)
    fused.forward(end="sc1")
    assert relative_error(fused.blobs["conv1"].data, scale(unfused, "sc1", batch_norm(unfused, "bn1", y))) \
        <= TOLERANCE
    fused.forward()
    assert relative_error(fused.blobs["conv1"].data, chain_value(unfused, x)) <= TOLERANCE


def test_a_forward_over_part_of_a_run_leaves_caffes_values():
    x = RNG.normal(size=(3, 3, 7, 6)).astype(np.float32)
    fused, unfused = pair(CHAIN, data=x)
    y = conv(x, *params(unfused, "conv1"), pad=1)
    fused.forward(end="conv1")
    assert relative_error(fused.blobs["conv1"].data, y) <= TOLERANCE
    fused.forward(end="bn1")
    assert relative_error(fused.blobs["conv1"].data, batch_norm(unfused, "bn1", y)) <= TOLERANCE
    fused.forward(start="sc1")                  # the rest of the run, from where the last forward stopped
    assert relative_error(fused.blobs["conv1"].data, chain_value(unfused, x)) <= TOLERANCE
    fused.forward(end="sc1")
    assert relative_error(fused.blobs["conv1"].data, scale(unfused, "sc1", batch_norm(unfused, "bn1", y))) \
        <= TOLERANCE
    fused.forward(start="relu1", end="relu1")
    assert relative_error(fused.blobs["conv1"].data, chain_value(unfused, x)) <= TOLERANCE


LOSS = CHAIN.replace('scale_param { bias_term: true }',
                     'param { lr_mult: 0 } param { lr_mult: 0 } scale_param { bias_term: true }') + """
layer { name: "label" type: "Input" top: "label" input_param { shape { dim: 3 } } }
layer { name: "ip" type: "InnerProduct" bottom: "conv1" top: "ip" inner_product_param { num_output: 4 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


@pytest.mark.parametrize("learned_scale", [False, True])
def test_backward_after_a_fused_forward_gives_the_unfused_gradients(learned_scale):
    """A TEST net with a loss runs backward: a Scale in place whose parameters
    learn needs its input back, so it stays out of the run; one that does
    not learn joins it."""
    text = LOSS.replace("lr_mult: 0", "lr_mult: 1") if learned_scale else LOSS
    x = RNG.normal(size=(3, 3, 7, 6)).astype(np.float32)
    fused, unfused = pair(text, data=x, label=np.array([0, 3, 1], np.float32))
    assert runs(fused) == ([] if learned_scale else [["bn1", "sc1", "relu1"]])
    for net in (fused, unfused):
        net.backward()
    assert_same_gradients(fused, unfused)


def test_a_net_told_it_runs_forward_only_fuses_learning_scales_and_refuses_backward():
    text = LOSS.replace("lr_mult: 0", "lr_mult: 1")
    x = RNG.normal(size=(3, 3, 7, 6)).astype(np.float32)
    fused, unfused = pair(text, data=x, label=np.array([0, 3, 1], np.float32))
    assert runs(fused) == []
    assert fusion.forward_only(fused) is fused.executor.fusion
    assert runs(fused) == [["bn1", "sc1", "relu1"]]
    fused.forward()
    assert_agree(fused, unfused, {"conv1": chain_value(unfused, x)})
    with pytest.raises(ConfigError, match="net 'chain': its fusion was planned forward only"):
        fused.backward()
    assert fusion.forward_only(build(text, False)) is None


def test_backward_with_force_backward_after_a_fused_forward_gives_the_unfused_gradients():
    """force_backward: every layer runs backward and every Scale learns, so
    the Scales stay out; the sum and its ReLU still run as one pass."""
    text = RESIDUAL.replace('name: "residual"', 'name: "residual" force_backward: true')
    x = RNG.normal(size=(2, 4, 5, 5)).astype(np.float32)
    fused, unfused = pair(text, data=x)
    assert runs(fused) == [["sum", "relu_sum"]]
    diff = RNG.normal(size=(2, 4, 5, 5)).astype(np.float32)
    for net in (fused, unfused):
        net.backward(sum=diff)
    assert_same_gradients(fused, unfused)


def test_backward_through_a_concat_of_views_gives_the_unfused_gradients():
    """The placed bottoms keep diffs of their own: the Concat's backward
    hands each its slice of the top's diff, as unfused."""
    text = CONCAT.replace('name: "concat"', 'name: "concat" force_backward: true')
    x = RNG.normal(size=(1, 3, 6, 5)).astype(np.float32)
    fused, unfused = pair(text, data=x)
    assert placed(fused) == [True, True]
    diff = RNG.normal(size=fused.blobs["c"].shape).astype(np.float32)
    for net in (fused, unfused):
        net.backward(c=diff)
    assert_same_gradients(fused, unfused)
    assert not np.shares_memory(fused.blobs["a"].diff, fused.blobs["cat"].diff)


def test_callbacks_see_every_layer_run_by_itself():
    x = RNG.normal(size=(3, 3, 7, 6)).astype(np.float32)
    fused, unfused = pair(CHAIN, data=x)
    seen = {}
    fused.after_forward(lambda index: seen.setdefault(fused.layers[index].name, fused.blobs["conv1"].data.copy()))
    fused.forward()
    y = conv(x, *params(unfused, "conv1"), pad=1)
    assert relative_error(seen["bn1"], batch_norm(unfused, "bn1", y)) <= TOLERANCE
    assert relative_error(seen["relu1"], chain_value(unfused, x)) <= TOLERANCE


def test_cct_time_style_forced_backward_runs_after_a_fused_forward():
    """`cct time` runs every layer forward one by one, then every backward
    with force=True: no fused layer lacks what its backward reads."""
    fused = build(RESIDUAL, True)
    randomize(fused)
    executor = fused.executor
    for index in range(len(fused.layers)):
        executor.forward(index)
    for index in reversed(range(len(fused.layers))):
        executor.backward(index, force=True)
    executor.finish()


# --- the switch -------------------------------------------------------------------------------
def test_on_for_test_nets_off_by_switch_never_for_train_nets(tmp_path, monkeypatch):
    assert build(CHAIN, None).executor.fusion is not None
    assert build(CHAIN, None, cct.TRAIN).executor.fusion is None
    assert build(CHAIN, True, cct.TRAIN).executor.fusion is None
    assert build(CHAIN, False).executor.fusion is None
    assert fusion.describe(build(CHAIN, False)) == [
        'Fusion: off (switched off by the run configuration\'s "fusion", CCT_FUSION or set_fusion)']
    assert fusion.describe(build(CHAIN, None, cct.TRAIN)) == ["Fusion: off (a TRAIN-phase net)"]
    config = tmp_path / "run.json"
    config.write_text('{"fusion": false}')
    settings.load(config)
    assert build(CHAIN, None).executor.fusion is None
    monkeypatch.setenv(settings.FUSION_ENV, "1")            # the file, named for this run, wins
    assert build(CHAIN, None).executor.fusion is None
    settings.load(None)
    assert build(CHAIN, None).executor.fusion is not None
    monkeypatch.setenv(settings.FUSION_ENV, "maybe")
    with pytest.raises(ConfigError, match="environment variable CCT_FUSION: must be 1 or 0, got 'maybe'"):
        build(CHAIN, None)
    with pytest.raises(ConfigError, match=r"run.json: fusion: must be true or false, got \"no\""):
        settings.parse('{"fusion": "no"}', "run.json")
    with pytest.raises(ConfigError, match="set_fusion: must be true or false, got 1"):
        settings.set_fusion(1)


def test_describe_names_each_pass_and_alias():
    fused = build(RESIDUAL + """layer { name: "conv_c" type: "Convolution" bottom: "a" top: "c"
                                 convolution_param { num_output: 2 kernel_size: 1 } }""", True)
    split = next(layer for layer in fused.layers if layer.type == "Split")
    tops = ", ".join(repr(name) for name in fused.top_names[split.name])
    assert fusion.describe(fused) == [
        "Fusion: 4 layers run as 1 passes; 1 ReLUs in their convolution's output store; 1 Split layers as aliases; "
        "0 Concat layers as views",
        "  after conv_b: bn_b + sc_b + sum + relu_sum (one pass writing 'b', 'sum')",
        "  conv_a + relu_a (the ReLU in the output store)",
        f"  {split.name}: {tops} share 'a'"]


# --- the compiled pass ------------------------------------------------------------------------
@pytest.mark.parametrize("affine, relu1, summed, relu2", [(True, True, False, False), (True, False, True, True),
                                                          (False, True, True, False), (True, True, True, True),
                                                          (False, False, True, False)])
@pytest.mark.parametrize("slope", [0.0, 0.2])
def test_the_compiled_pass_matches_its_numpy_reference(affine, relu1, summed, relu2, slope):
    shape = (3, 5, 7)
    source = RNG.normal(size=shape).astype(np.float32)
    other = RNG.normal(size=shape).astype(np.float32)
    shift, gain, bias = (RNG.normal(size=5).astype(np.float32) for _ in range(3))
    f = np.float32
    results = []
    for function in (fusion._fused_pass, fusion.reference_pass):
        value, out = np.empty(shape, np.float32), np.empty(shape, np.float32)
        function(source, shift, gain, bias, affine, f(slope), relu1, value, summed, other, f(0.5), f(-2.0),
                 summed, f(slope), relu2, out)
        results.append((out, value if summed else None))
    (out, value), (expected_out, expected_value) = results
    np.testing.assert_allclose(out, expected_out, rtol=1e-6, atol=1e-6)
    if summed:
        np.testing.assert_allclose(value, expected_value, rtol=1e-6, atol=1e-6)
    # in place: the source is the output
    in_place = source.copy()
    fusion._fused_pass(in_place, shift, gain, bias, affine, f(slope), relu1, np.zeros((0, 0, 0), np.float32),
                       False, other, f(0.5), f(-2.0), summed, f(slope), relu2, in_place)
    np.testing.assert_allclose(in_place, expected_out, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("slope", [0.0, 0.2])
def test_the_compiled_pass_is_the_reference_bit_for_bit_across_chunks_and_special_values(slope):
    """Rows longer than the pass's scratch chunk (a row ending in a partial
    chunk), in place and not, with NaN, infinities and -0.0 among the values:
    the same bits as the numpy steps (a ReLU of slope 0 is np.maximum: NaN
    stays NaN, -0.0 becomes 0)."""
    inner = 2 * fusion.PASS_CHUNK + 3
    source = RNG.normal(size=(2, 3, inner)).astype(np.float32)
    source[:, :, :4] = [np.nan, -0.0, np.inf, -np.inf]
    source[:, :, -2:] = [-0.0, np.nan]
    other = RNG.normal(size=source.shape).astype(np.float32)
    shift, gain, bias = (RNG.normal(size=3).astype(np.float32) for _ in range(3))
    f = np.float32
    for affine, relu1, summed, relu2 in ((True, True, False, False), (True, False, True, True),
                                         (False, True, False, False)):
        expected_value, expected = np.empty_like(source), np.empty_like(source)
        fusion.reference_pass(source, shift, gain, bias, affine, f(slope), relu1, expected_value, summed, other,
                              f(0.5), f(-2.0), summed, f(slope), relu2, expected)
        value, out = np.empty_like(source), np.empty_like(source)
        fusion._fused_pass(source, shift, gain, bias, affine, f(slope), relu1, value, summed, other, f(0.5),
                           f(-2.0), summed, f(slope), relu2, out)
        in_place = source.copy()          # the value kept in place too, as ResNet's BatchNorm before a sum
        fusion._fused_pass(in_place, shift, gain, bias, affine, f(slope), relu1, in_place, summed, other, f(0.5),
                           f(-2.0), summed, f(slope), relu2, out if summed else in_place)
        results = [(out, expected), (in_place, expected_value if summed else expected)]
        if summed:
            results.append((value, expected_value))
        for got, want in results:
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)) or (
                np.array_equal(got, want, equal_nan=True) and np.array_equal(np.signbit(got), np.signbit(want)))


@pytest.mark.parametrize("slope", [0.0, 0.2])
@pytest.mark.parametrize("affine, relu1, relu2", [(True, True, False), (True, False, False), (False, True, False),
                                                  (True, True, True)])
def test_the_in_place_pass_is_the_reference_bit_for_bit(affine, relu1, relu2, slope):
    """The kernel a pass that writes its source and neither sums nor keeps a
    value runs (_in_place_pass, a BatchNorm + Scale + ReLU in place): the
    numpy steps' bits, NaN, infinities and -0.0 included."""
    source = RNG.normal(size=(2, 3, 37)).astype(np.float32)
    source[:, :, :4] = [np.nan, -0.0, np.inf, -np.inf]
    shift, gain, bias = (RNG.normal(size=3).astype(np.float32) for _ in range(3))
    f = np.float32
    expected, unused = np.empty_like(source), np.zeros((0, 0, 0), np.float32)
    fusion.reference_pass(source, shift, gain, bias, affine, f(slope), relu1, unused, False, unused, f(1), f(1),
                          False, f(slope), relu2, expected)
    got = source.copy()
    fusion._in_place_pass(got, shift, gain, bias, affine, f(slope), relu1, f(slope), relu2)
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)) or (
        np.array_equal(got, expected, equal_nan=True) and np.array_equal(np.signbit(got), np.signbit(expected)))


@pytest.mark.parametrize("slope", [0.0, 0.2])
@pytest.mark.parametrize("affine, relu1, relu2", [(True, True, False), (True, False, False), (False, True, False),
                                                  (True, True, True)])
def test_the_mapped_pass_is_the_reference_bit_for_bit(affine, relu1, relu2, slope):
    """The kernel a pass that reads one blob and writes another, neither
    summing nor keeping a value, runs (_mapped_pass, a BatchNorm + Scale +
    ReLU out of place): the numpy steps' bits, its source untouched."""
    source = RNG.normal(size=(2, 3, 37)).astype(np.float32)
    source[:, :, :4] = [np.nan, -0.0, np.inf, -np.inf]
    kept = source.copy()
    shift, gain, bias = (RNG.normal(size=3).astype(np.float32) for _ in range(3))
    f = np.float32
    expected, unused = np.empty_like(source), np.zeros((0, 0, 0), np.float32)
    fusion.reference_pass(source, shift, gain, bias, affine, f(slope), relu1, unused, False, unused, f(1), f(1),
                          False, f(slope), relu2, expected)
    got = np.empty_like(source)
    fusion._mapped_pass(source, shift, gain, bias, affine, f(slope), relu1, f(slope), relu2, got)
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)) or (
        np.array_equal(got, expected, equal_nan=True) and np.array_equal(np.signbit(got), np.signbit(expected)))
    assert np.array_equal(source.view(np.uint32), kept.view(np.uint32))


@pytest.mark.parametrize("slope", [0.0, 0.2])
@pytest.mark.parametrize("affine, relu1, relu2", [(True, False, True), (True, True, True), (False, False, False)])
def test_the_kept_sum_pass_is_the_reference_bit_for_bit(affine, relu1, relu2, slope):
    """The kernel a pass runs whose kept value is its source and which sums
    into another blob (_kept_sum_pass, ResNet's BatchNorm + Scale + Eltwise
    + ReLU): the kept value and the sum hold the numpy steps' bits."""
    source = RNG.normal(size=(2, 3, 37)).astype(np.float32)
    source[:, :, :4] = [np.nan, -0.0, np.inf, -np.inf]
    other = RNG.normal(size=source.shape).astype(np.float32)
    other[:, :, 4:6] = [-0.0, np.nan]
    shift, gain, bias = (RNG.normal(size=3).astype(np.float32) for _ in range(3))
    f = np.float32
    expected_value, expected = np.empty_like(source), np.empty_like(source)
    fusion.reference_pass(source, shift, gain, bias, affine, f(slope), relu1, expected_value, True, other, f(0.5),
                          f(-2.0), True, f(slope), relu2, expected)
    values, out = source.copy(), np.empty_like(source)
    fusion._kept_sum_pass(values, shift, gain, bias, affine, f(slope), relu1, other, f(0.5), f(-2.0), f(slope), relu2,
                          out)
    for got, want in ((values, expected_value), (out, expected)):
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)) or (
            np.array_equal(got, want, equal_nan=True) and np.array_equal(np.signbit(got), np.signbit(want)))


FC_RELU_DROPOUT = """name: "fc"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 6 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 40 } }
layer { name: "relu" type: "ReLU" bottom: "ip" top: "ip" }
layer { name: "drop" type: "Dropout" bottom: "ip" top: "ip" }
"""


@pytest.mark.parametrize("batch, parallel_elements", [(1, None), (3, None), (1, 16)])
def test_a_pass_without_channel_maps_runs_each_image_as_one_row(batch, parallel_elements, monkeypatch):
    """A ReLU + Dropout run has no per-channel maps, so its pass takes each
    image as one row of C*S values instead of C rows (an FC output: C rows of
    one value); a single image large enough to split between threads keeps
    its channels, the pieces the split takes. Either way: Caffe's numbers."""
    if parallel_elements:
        monkeypatch.setattr(fusion, "PARALLEL_ELEMENTS", parallel_elements)
    x = RNG.normal(size=(batch, 6)).astype(np.float32)
    text = FC_RELU_DROPOUT.replace("dim: 1 dim: 6", f"dim: {batch} dim: 6")
    fused, unfused = build(text, True), build(text, False)
    randomize(fused)
    unfused.share_with(fused)
    fused.executor.threads = 2
    for net in (fused, unfused):
        net.blobs["data"].data[...] = x
        net.forward()
    assert runs(fused) == [["relu", "drop"]]
    (replay,) = fused.executor.fusion._replays.values()
    rows = 40 if parallel_elements else 1
    assert replay.prepared[0][0].shape == (batch, rows, 40 // rows)
    w, b = params(unfused, "ip")
    assert_agree(fused, unfused, {"ip": relu(x @ w.T + b)})


@pytest.mark.parametrize("batch", [1, 4])
def test_a_pass_split_between_threads_gives_the_same_numbers(batch, monkeypatch):
    """Pieces of the batch, or of the channels for a batch of one."""
    x = RNG.normal(size=(batch, 4, 5, 5)).astype(np.float32)
    text = RESIDUAL.replace("dim: 2 dim: 4", f"dim: {batch} dim: 4")
    whole, pieces = build(text, True), build(text, True)
    randomize(whole)
    pieces.share_with(whole)
    for net, elements in ((whole, fusion.PARALLEL_ELEMENTS), (pieces, 16)):
        monkeypatch.setattr(fusion, "PARALLEL_ELEMENTS", elements)
        net.executor.threads = 2
        net.blobs["data"].data[...] = x
        net.forward()
    for name in whole.blobs:
        assert np.array_equal(pieces.blobs[name].data, whole.blobs[name].data), name
