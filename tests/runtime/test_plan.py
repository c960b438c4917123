"""The execution plan (cct.runtime.plan): made once per layout and settings,
run step after step, and made again whenever Caffe's semantics say the net
changed: a reshape (the user's, a Python layer's at forward), a setting, a
subscriber. The numbers are those of the per-layer path."""
import sys
import textwrap

import numpy as np
import pytest

import cct
from cct.core import settings as table
from cct.lowering import type1, type3
from cct.runtime import settings

NET = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
        convolution_param { num_output: 3 kernel_size: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2" pooling_param { pool: AVE kernel_size: 3 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool2" top: "ip"
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip" bottom: "target" top: "loss" }
layer { name: "target" type: "Input" top: "target" input_param { shape { dim: 2 dim: 5 } } }
"""


def make_net(fused=False, text=NET):
    settings.set_fusion(fused)
    try:
        # the target's Input after the loss would be out of order: put it first
        lines = text.strip().splitlines()
        ordered = [line for line in lines if '"target" type: "Input"' in line] + \
                  [line for line in lines if '"target" type: "Input"' not in line]
        net = cct.Net('name: "plan"\nforce_backward: true\n' + "\n".join(ordered), cct.TRAIN)
    finally:
        settings.set_fusion(None)
    rng = np.random.default_rng(5)
    for layer in net.layers:
        for blob in layer.blobs:
            blob.data[...] = rng.normal(0, 0.3, blob.shape)
    return net


def run(net, x, target):
    net.blobs["data"].reshape(x.shape)
    net.blobs["target"].reshape(target.shape)
    net.blobs["data"].data[...] = x
    net.blobs["target"].data[...] = target
    net.clear_param_diffs()
    loss = net.forward()["loss"].copy()
    net.backward()
    return loss, net.blobs["data"].diff.copy(), [blob.diff.copy() for layer in net.layers for blob in layer.blobs]


def per_layer(net, x, target):
    """The same pass with the plan out of the way (a subscriber runs the per-layer path)."""
    net.before_forward(lambda index: None)
    return run(net, x, target)


@pytest.mark.parametrize("fused", [False, True])
def test_a_steady_net_runs_its_plan_and_gets_the_per_layer_numbers(fused):
    rng = np.random.default_rng(0)
    x, target = rng.normal(size=(2, 3, 8, 8)).astype(np.float32), rng.normal(size=(2, 5)).astype(np.float32)
    net, reference = make_net(fused), make_net(fused)
    run(net, x, target)
    run(net, x, target)                      # the first backward made the diffs: the layout moved once
    assert net.executor._plan is None        # a plan for a layout two whole forwards saw
    run(net, x, target)
    plan = net.executor._plan
    assert plan is not None and plan.current(net.executor.settings.version)
    got = run(net, x, target)
    assert net.executor._plan is plan        # no reshape, no setting: the same plan
    expected = per_layer(reference, x, target)
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])
    for a, b in zip(got[2], expected[2]):
        np.testing.assert_array_equal(a, b)


def counting_binds(monkeypatch):
    """How many bound convolution paths the plans made, by kind."""
    bound = {"one image": 0, "pointwise backward": 0}

    def counted(name, bind):
        def binder(*args):
            made = bind(*args)
            bound[name] += made is not None
            return made
        return binder
    monkeypatch.setattr(type1, "bind_one_image", counted("one image", type1.bind_one_image))
    monkeypatch.setattr(type3, "bind_pointwise_backward", counted("pointwise backward", type3.bind_pointwise_backward))
    return bound


def lowered_by(kind, *nets):
    for net in nets:
        for name in ("conv1", "conv2"):
            net.layer_dict[name].lowering_type = kind


@pytest.mark.parametrize("kind", [1, 2, 3])
def test_one_images_bound_backward_gets_the_per_layer_numbers(kind, monkeypatch):
    """At batch 1 the plan binds type 3's pointwise backward
    (type3.bind_pointwise_backward): the per-layer path's bits."""
    bound = counting_binds(monkeypatch)
    rng = np.random.default_rng(7)
    x, target = rng.normal(size=(1, 3, 8, 8)).astype(np.float32), rng.normal(size=(1, 5)).astype(np.float32)
    net, reference = make_net(), make_net()
    lowered_by(kind, net, reference)
    for _ in range(3):
        run(net, x, target)
    assert net.executor._plan is not None
    # a training forward keeps its lowering for the backward: no bound forward
    assert (bound["one image"], bool(bound["pointwise backward"])) == (0, kind == 3)
    got, expected = run(net, x, target), per_layer(reference, x, target)
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])
    for a, b in zip(got[2], expected[2]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", [1, 2, 3])
def test_one_images_bound_forward_gets_the_per_layer_numbers(kind, monkeypatch):
    """At batch 1 a deploy net's plan binds type 1's lowering of a small
    image (type1.bind_one_image): the per-layer path's bits."""
    bound = counting_binds(monkeypatch)
    text = "\n".join(line for line in NET.splitlines() if '"loss"' not in line and '"target"' not in line)
    nets = [cct.Net('name: "deploy"\n' + text, cct.TEST) for _ in range(2)]
    rng = np.random.default_rng(8)
    for layers in zip(*(net.layers for net in nets)):
        for blobs in zip(*(layer.blobs for layer in layers)):
            values = rng.normal(0, 0.3, blobs[0].shape)
            for blob in blobs:
                blob.data[...] = values
    lowered_by(kind, *nets)
    net, reference = nets
    reference.before_forward(lambda index: None)           # the per-layer path
    x = rng.normal(size=(1, 3, 8, 8)).astype(np.float32)
    for _ in range(4):
        for each in nets:
            each.blobs["data"].reshape(x.shape)
            each.blobs["data"].data[...] = x
            each.forward()
    assert net.executor._plan is not None
    assert (bool(bound["one image"]), bound["pointwise backward"]) == (kind == 1, 0)
    for name in net.blobs:
        np.testing.assert_array_equal(net.blobs[name].data, reference.blobs[name].data)


def test_a_reshape_by_the_user_makes_a_new_plan():
    rng = np.random.default_rng(1)
    net, reference = make_net(), make_net()
    plans = []
    for batch in (2, 3, 1, 2):
        for _ in range(3):
            x = rng.normal(size=(batch, 3, 8, 8)).astype(np.float32)
            target = rng.normal(size=(batch, 5)).astype(np.float32)
            got, expected = run(net, x, target), per_layer(reference, x, target)
            np.testing.assert_array_equal(got[0], expected[0])
            np.testing.assert_array_equal(got[1], expected[1])
        assert net.executor._plan.current(net.executor.settings.version)
        plans.append(net.executor._plan)
    assert len({id(plan) for plan in plans}) == len(plans)


def test_shapes_that_change_at_every_forward_get_no_plan():
    """A plan binds tens of steps: not worth it for a layout one forward uses."""
    rng = np.random.default_rng(4)
    net = make_net()
    for batch in (1, 2, 3, 1, 2, 3):
        run(net, rng.normal(size=(batch, 3, 8, 8)).astype(np.float32), rng.normal(size=(batch, 5)).astype(np.float32))
        assert net.executor._plan is None


def test_a_setting_or_a_lowering_choice_makes_a_new_plan():
    rng = np.random.default_rng(2)
    x, target = rng.normal(size=(2, 3, 8, 8)).astype(np.float32), rng.normal(size=(2, 5)).astype(np.float32)
    net = make_net()
    expected = run(net, x, target)
    run(net, x, target)
    run(net, x, target)
    plan = net.executor._plan
    epoch = net.layout.epoch                 # the net's own part of the layout (a layer's choice)
    conv = net.layer_dict["conv1"]
    conv.lowering_type = 2 if conv.lowering_type != 2 else 3
    assert net.layout.epoch != epoch and not plan.current(net.executor.settings.version)
    got = run(net, x, target)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5)
    run(net, x, target)
    run(net, x, target)
    plan = net.executor._plan
    assert plan.current(net.executor.settings.version)
    with table.override(schedule="sequential"):
        net.executor.current_settings()      # as a forward's start: resolved again after the call
        assert not plan.current(net.executor.settings.version)
        got = run(net, x, target)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5)


RESHAPER = textwrap.dedent('''
    import numpy as np
    import cct

    class Alternate(cct.Layer):
        """Its top has 1 + (forward count % 3) rows: a reshape at every forward."""
        def setup(self, bottom, top):
            self.count = 0
        def reshape(self, bottom, top):
            top[0].reshape(1 + self.count % 3, bottom[0].count)
        def forward(self, bottom, top):
            top[0].data[...] = bottom[0].data.reshape(1, -1) * (1 + np.arange(top[0].shape[0]))[:, None]
            self.count += 1
        def backward(self, top, propagate_down, bottom):
            pass
    ''')


@pytest.fixture
def reshaper(tmp_path, monkeypatch):
    (tmp_path / "plan_reshaper.py").write_text(RESHAPER)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("plan_reshaper", None)


def test_a_python_layer_reshaping_at_forward_gets_the_rest_of_the_net_reshaped(reshaper):
    """Caffe reshapes every layer at every forward: after a Python layer
    changes its top's shape, the layers after it run for the new shape."""
    text = """
    layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 4 } } }
    layer { name: "alt" type: "Python" bottom: "data" top: "alt" python_param { module: "plan_reshaper" layer: "Alternate" } }
    layer { name: "ip" type: "InnerProduct" bottom: "alt" top: "ip"
            inner_product_param { num_output: 2 weight_filler { type: "constant" value: 0.5 } } }
    layer { name: "relu" type: "ReLU" bottom: "ip" top: "ip" }
    """
    net = cct.Net(text, cct.TEST)
    net.blobs["data"].data[...] = [[1, -2, 3, 4]]
    for count in range(7):
        out = net.forward()["ip"]
        rows = 1 + count % 3
        assert out.shape == (rows, 2)
        np.testing.assert_allclose(out, np.maximum(0, 3.0 * (1 + np.arange(rows)))[:, None].repeat(2, 1))


def test_a_forward_between_layers_runs_the_plans_steps():
    rng = np.random.default_rng(3)
    x, target = rng.normal(size=(2, 3, 8, 8)).astype(np.float32), rng.normal(size=(2, 5)).astype(np.float32)
    net = make_net()
    for _ in range(3):
        run(net, x, target)
    assert net.executor._plan.current(net.executor.settings.version)
    whole = net.blobs["ip"].data.copy()
    net.blobs["ip"].data[...] = 0
    net.forward(start="pool2", end="ip")
    np.testing.assert_array_equal(net.blobs["ip"].data, whole)


def test_batch_partitions_run_as_one_step_with_the_per_layer_numbers(monkeypatch):
    """Consecutive layers in the same 2 partitions run as one partition run
    (each partition's twins in turn on its thread), forward and backward:
    bitwise the per-layer path's numbers, and a pass that starts or ends
    inside a run takes the run's layers one by one."""
    monkeypatch.setenv(settings.PARTITIONS_ENV, "2")
    rng = np.random.default_rng(6)
    x, target = rng.normal(size=(4, 3, 8, 8)).astype(np.float32), rng.normal(size=(4, 5)).astype(np.float32)
    net, reference = make_net(), make_net()
    for _ in range(3):
        run(net, x, target)
    plan = net.executor._plan
    names = net.layer_names
    runs = {(names[first], names[last]) for first, (last, _) in plan.forward_runs.items()}
    assert ("conv1", "ip") in runs           # conv1 .. ip all split in 2: one step (the loss is not split)
    assert [(names[last], names[first]) for last, (first, _) in plan.backward_runs.items()] == [("ip", "conv1")]
    got = run(net, x, target)
    assert net.executor._plan is plan
    expected = per_layer(reference, x, target)
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])
    for a, b in zip(got[2], expected[2]):
        np.testing.assert_array_equal(a, b)
    for net_ in (net, reference):            # inside the run: its layers one by one
        net_.blobs["conv2"].data[...] = 0
        net_.forward(start="pool1", end="conv2")
        net_.blobs["pool1"].diff[...] = 0
        net_.backward(start="pool2", end="pool1")
    np.testing.assert_array_equal(net.blobs["conv2"].data, reference.blobs["conv2"].data)
    np.testing.assert_array_equal(net.blobs["pool1"].diff, reference.blobs["pool1"].diff)
    assert net.executor._plan is plan


FUSED = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 6 dim: 6 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
        convolution_param { num_output: 4 kernel_size: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "bn2" type: "BatchNorm" bottom: "conv2" top: "conv2" batch_norm_param { use_global_stats: true } }
layer { name: "sc2" type: "Scale" bottom: "conv2" top: "conv2" scale_param { bias_term: true } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "pool" type: "Pooling" bottom: "conv2" top: "pool" pooling_param { pool: AVE global_pooling: true } }
"""


def fused_net():
    net = cct.Net(FUSED, cct.TEST)
    rng = np.random.default_rng(7)
    for layer in net.layers:
        for blob in layer.blobs:
            blob.data[...] = rng.uniform(0.5, 1.5, blob.shape)
    return net


def per_layer_fused(net, **ends):
    """A forward of a fused net on the executor's per-layer path (its plan
    dropped; a subscriber would turn fusion off)."""
    net.executor.drop_plan()
    return net.forward(**ends)


def test_fused_runs_and_output_relus_are_steps_with_the_per_layer_numbers():
    net, reference = fused_net(), fused_net()
    for seed in range(4):
        x = np.random.default_rng(seed).normal(size=(1, 3, 6, 6)).astype(np.float32)
        net.blobs["data"].data[...] = reference.blobs["data"].data[...] = x
        got, expected = net.forward()["pool"].copy(), per_layer_fused(reference)["pool"]
        np.testing.assert_array_equal(got, expected)
    groups = net.executor._plan.groups
    names = [net.layers[i].name for first, last in groups for i in (first, last)]
    assert {"conv1", "relu1", "bn2", "relu2"} <= set(names)
    # a forward that ends inside a group runs layer by layer and leaves Caffe's blobs
    net.forward(end="sc2")
    per_layer_fused(reference, end="sc2")
    np.testing.assert_array_equal(net.blobs["conv2"].data, reference.blobs["conv2"].data)
    net.forward()
    # a parameter written through net.params is read by the next forward's step
    net.params["sc2"][0].data[...] *= 2
    reference.params["sc2"][0].data[...] *= 2
    np.testing.assert_array_equal(net.forward()["pool"], per_layer_fused(reference)["pool"])
