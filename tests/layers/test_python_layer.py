"""Python layers (type "Python"): a user module's cct.Layer subclass, with
param_str/phase, learnable blobs added through BlobVec.add_blob, gradient
checked, trained in a net; and the errors for a bad module or class."""
import json
import logging
import sys
import textwrap

import numpy as np
import pytest

import cct
from cct.core.errors import ConfigError
from cct.testing.gradient_check import check_layer_gradient, make_layer
from helpers.layers import PYCAFFE_DOUBLE_LAYER

MODULE = "cct_test_py_layers"

SOURCE = '''
import json
import numpy as np
import cct

RECORDED = []


class ScaleShift(cct.Layer):
    """top = bottom * scale[c] + shift[c]; scale and shift are learnable."""

    def setup(self, bottom, top):
        if len(bottom) != 1 or len(top) != 1:
            raise Exception("ScaleShift takes one bottom and one top")
        init = json.loads(self.param_str or "{}")
        channels = bottom[0].data.shape[1]
        self.blobs.add_blob(channels)
        self.blobs.add_blob(channels)
        self.blobs[0].data[...] = init.get("scale", 1.0)
        self.blobs[1].data[...] = init.get("shift", 0.0)

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def _per_channel(self, values, ndim):
        return values.reshape((1, -1) + (1,) * (ndim - 2))

    def forward(self, bottom, top):
        x = bottom[0].data
        top[0].data[...] = x * self._per_channel(self.blobs[0].data, x.ndim) \\
            + self._per_channel(self.blobs[1].data, x.ndim)

    def backward(self, top, propagate_down, bottom):
        x, dy = bottom[0].data, top[0].diff
        axes = tuple(a for a in range(x.ndim) if a != 1)
        self.blobs[0].diff[...] += (dy * x).sum(axis=axes)
        self.blobs[1].diff[...] += dy.sum(axis=axes)
        if propagate_down[0]:
            bottom[0].diff[...] = dy * self._per_channel(self.blobs[0].data, x.ndim)


class EuclideanLossLayer(cct.Layer):
    """pycaffe's examples/pycaffe/layers/pyloss.py."""

    def setup(self, bottom, top):
        if len(bottom) != 2:
            raise Exception("Need two inputs to compute distance.")

    def reshape(self, bottom, top):
        if bottom[0].count != bottom[1].count:
            raise Exception("Inputs must have the same dimension.")
        self.diff = np.zeros_like(bottom[0].data)
        top[0].reshape(1)

    def forward(self, bottom, top):
        self.diff[...] = bottom[0].data - bottom[1].data
        top[0].data[...] = np.sum(self.diff ** 2) / bottom[0].num / 2.

    def backward(self, top, propagate_down, bottom):
        for i in range(2):
            if not propagate_down[i]:
                continue
            sign = 1 if i == 0 else -1
            bottom[i].diff[...] = sign * top[0].diff[0] * self.diff / bottom[i].num


class Recorder(cct.Layer):
    def __init__(self, param):
        super().__init__(param)
        self.constructed_with = param.name

    def setup(self, bottom, top):
        RECORDED.append((self.param_str, self.phase, self.type))

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = bottom[0].data

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            bottom[0].diff[...] = top[0].diff


class NotALayer:
    pass
'''


@pytest.fixture(scope="module")
def py_module(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pylayers")
    (folder / f"{MODULE}.py").write_text(SOURCE)
    sys.path.insert(0, str(folder))
    yield __import__(MODULE)
    sys.path.remove(str(folder))
    sys.modules.pop(MODULE, None)


def python_layer(layer, param_str="", phase=cct.TRAIN):
    return make_layer(f'type: "Python" python_param {{ module: "{MODULE}" layer: "{layer}" '
                      f'param_str: {json.dumps(param_str)} }}', phase)


def test_factory_returns_the_user_object_with_param_str_phase_and_blobvec(py_module):
    layer = python_layer("Recorder", "hello", cct.TEST)
    assert isinstance(layer, py_module.Recorder) and isinstance(layer, cct.Layer)
    assert (layer.param_str, layer.phase, layer.type, layer.constructed_with) == ("hello", cct.TEST, "Python", "python")
    assert layer.param_str_ == "hello"            # older pycaffe's name, which py-faster-rcnn's layers read
    layer.blobs.add_blob(2, 3)
    layer.blobs.add_blob((4,))
    assert [b.shape for b in layer.blobs] == [(2, 3), (4,)]
    assert layer.blobs[0].data.dtype == np.float32


def test_loading_logs_the_module_a_python_layer_runs(py_module, caplog):
    with caplog.at_level(logging.INFO, logger="cct"):
        python_layer("Recorder")
    assert [r.getMessage() for r in caplog.records if r.name == "cct.layers.python_layer"] == [
        f"layer 'python' (Python): runs Python code: imported module '{MODULE}' ({py_module.__file__}) "
        "for class 'Recorder'"]


@pytest.mark.parametrize("shape,init", [((2, 3, 4, 5), {}), ((3, 2), {"scale": -0.5, "shift": 2.0})])
def test_scale_shift_gradient(py_module, shape, init):
    x = np.random.default_rng(0).standard_normal(shape)
    check_layer_gradient(python_layer("ScaleShift", json.dumps(init)), [x])


def test_scale_shift_forward_against_naive(py_module):
    from cct.testing.gradient_check import setup_layer
    layer = python_layer("ScaleShift", json.dumps({"scale": 3.0, "shift": -1.0}))
    x = np.random.default_rng(1).standard_normal((2, 3, 2))
    bottoms, tops = setup_layer(layer, [x])
    layer.forward(bottoms, tops)
    expected = np.empty_like(x)
    for n in range(2):
        for c in range(3):
            expected[n, c] = x[n, c] * 3.0 - 1.0
    np.testing.assert_allclose(tops[0].data, expected)


def test_python_loss_layer_gradient(py_module):
    rng = np.random.default_rng(2)
    check_layer_gradient(python_layer("EuclideanLossLayer"),
                         [rng.standard_normal((3, 4)), rng.standard_normal((3, 4))])


NET = """name: "pynet"
layer {{ name: "data" type: "Input" top: "data" top: "target"
        input_param {{ shape {{ dim: 8 dim: 2 dim: 3 }} }} }}
layer {{ name: "affine" type: "Python" bottom: "data" top: "out"
        python_param {{ module: "{module}" layer: "ScaleShift" param_str: "{{}}" }} }}
layer {{ name: "record" type: "Python" bottom: "out" top: "out2"
        python_param {{ module: "{module}" layer: "Recorder" param_str: "in net" }} }}
layer {{ name: "loss" type: "Python" bottom: "out2" bottom: "target" top: "loss"
        python_param {{ module: "{module}" layer: "EuclideanLossLayer" }} loss_weight: 1 }}
"""


def test_python_layers_train_in_a_net(py_module, tmp_path):
    (tmp_path / "net.prototxt").write_text(NET.format(module=MODULE))
    (tmp_path / "solver.prototxt").write_text(textwrap.dedent(f"""\
        net: "{tmp_path / 'net.prototxt'}"
        base_lr: 0.1 momentum: 0.5 lr_policy: "fixed" max_iter: 1000 display: 0
        snapshot_prefix: "{tmp_path / 'snap'}" random_seed: 1
        """))
    py_module.RECORDED.clear()
    solver = cct.SGDSolver(str(tmp_path / "solver.prototxt"))
    net = solver.net
    assert py_module.RECORDED == [("in net", cct.TRAIN, "Python")]
    assert list(net.params) == ["affine"] and len(net.params["affine"]) == 2
    rng = np.random.default_rng(5)
    losses = []
    for _ in range(150):
        x = rng.standard_normal((8, 2, 3)).astype(np.float32)
        net.blobs["data"].data[...] = x
        net.blobs["target"].data[...] = x * np.array([2.0, -1.0])[None, :, None] + 0.5
        solver.step(1)
        losses.append(float(net.blobs["loss"].data[0]))
    assert losses[-1] < 1e-3 * losses[0]
    np.testing.assert_allclose(net.params["affine"][0].data, [2.0, -1.0], atol=1e-2)
    np.testing.assert_allclose(net.params["affine"][1].data, [0.5, 0.5], atol=1e-2)


def test_errors_name_the_module_and_class(py_module):
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module_xyz'"):
        make_layer('type: "Python" python_param { module: "no_such_module_xyz" layer: "X" }')
    with pytest.raises(ConfigError, match=f"module '{MODULE}' .* has no class 'Missing'"):
        python_layer("Missing")
    with pytest.raises(ConfigError, match="must be a class derived from cct.Layer"):
        python_layer("NotALayer")
    with pytest.raises(ConfigError, match="python_param.module: missing"):
        make_layer('type: "Python" python_param { layer: "X" }')
    with pytest.raises(ConfigError, match="python_param.layer: missing"):
        make_layer(f'type: "Python" python_param {{ module: "{MODULE}" }}')


@pytest.fixture
def module_folder(tmp_path, monkeypatch):
    """A folder on sys.path for one-off layer modules, removed with their modules."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith("cct_broken_") or name == "cct_caffe_layer":
            del sys.modules[name]


@pytest.mark.parametrize("body, shown", [
    ("import json\nimport no_such_dependency_xyz\n",
     r"failed to import: ModuleNotFoundError: No module named 'no_such_dependency_xyz' \(at .*cct_broken_\w+\.py:2\)"),
    ("X = 1\nraise ValueError('bad constant')\n", r"failed to import: ValueError: bad constant \(at .*:2\)"),
    ("def f(:\n", r"failed to import: SyntaxError: .*cct_broken_\w+\.py, line 1"),
])
def test_a_module_that_fails_to_import_shows_its_own_exception(module_folder, body, shown):
    name = f"cct_broken_{abs(hash(body)) % 10**6}"
    (module_folder / f"{name}.py").write_text(body)
    with pytest.raises(ConfigError, match=f"python_param.module: module '{name}' {shown}") as caught:
        make_layer(f'type: "Python" python_param {{ module: "{name}" layer: "X" }}')
    assert "PYTHONPATH" not in str(caught.value)
    assert caught.value.__cause__ is not None                 # the module's own traceback follows


def test_a_module_whose_import_caffe_fails_names_the_alias(module_folder, monkeypatch):
    (module_folder / "cct_broken_caffe.py").write_text("import caffe\n")
    monkeypatch.setitem(sys.modules, "caffe", None)            # as with CCT_CAFFE_ALIAS=0
    with pytest.raises(ConfigError, match="ModuleNotFoundError: import of caffe.*cct's alias.*CCT_CAFFE_ALIAS=0"):
        make_layer('type: "Python" python_param { module: "cct_broken_caffe" layer: "X" }')


def test_a_pycaffe_layer_module_runs_unchanged(module_folder):
    (module_folder / "cct_caffe_layer.py").write_text(PYCAFFE_DOUBLE_LAYER)
    layer = make_layer('type: "Python" python_param { module: "cct_caffe_layer" layer: "Double" }')
    assert isinstance(layer, cct.Layer)
    check_layer_gradient(layer, [np.random.default_rng(1).standard_normal((2, 3))])
