"""The model zoo in models/: every prototxt parses and wires up, the generated
ones match their scripts, train_val and deploy nets agree, and the nets build
with the blob shapes Caffe reports for them (hard-coded below from Caffe's
logs and the papers, never computed by the code under test).

Nets are built at batch 1 or 2 (the Input shape is edited through caffe_pb2) to
keep the tests fast. train_val nets read LMDBs that do not exist here: they are
checked by phase filtering, or built with their Data layers swapped for Input.
A net whose layer types are not all registered yet is skipped, with the list.
"""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

import cct
from cct.core.passes import filter_net, insert_splits
from cct.formats.prototxt import read_net, read_solver
from cct.proto import caffe_pb2

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "models"

NET_FILES = sorted(p for p in MODELS.rglob("*.prototxt") if "solver" not in p.name)
SOLVER_FILES = sorted(p for p in MODELS.rglob("*.prototxt") if "solver" in p.name)


def model(path):
    return MODELS / path


def relative(path):
    return str(path.relative_to(MODELS))


def phase_net(net_param, phase):
    return filter_net(net_param, caffe_pb2.NetState(phase=phase))


def require_types(net_param, phase):
    """Skip the test unless every layer type the net uses in `phase` is registered."""
    used = {layer.type for layer in phase_net(net_param, phase).layer}
    missing = sorted(used - set(cct.layer_type_list()))
    if missing:
        pytest.skip(f"layer types not registered yet: {', '.join(missing)}")


def with_batch(path, batch):
    """The deploy net at `path` with dim 0 of its Input shape(s) set to `batch`."""
    net_param = caffe_pb2.NetParameter()
    net_param.CopyFrom(read_net(model(path)))
    inputs = [layer for layer in net_param.layer if layer.type == "Input"]
    assert inputs, f"{path}: no Input layer"
    for layer in inputs:
        for shape in layer.input_param.shape:
            shape.dim[0] = batch
    return net_param


def with_inputs(path, data_shape, label_shape):
    """The train_val net at `path` with its data layers (one per phase) replaced by
    a single Input layer making `data` and `label`."""
    source = read_net(model(path))
    net_param = caffe_pb2.NetParameter()
    net_param.CopyFrom(source)
    net_param.ClearField("layer")
    replaced = False
    for layer in source.layer:
        if layer.type in ("Data", "DummyData"):
            if not replaced:
                net_param.layer.add(name="data", type="Input", top=["data", "label"]).input_param.shape.extend(
                    [caffe_pb2.BlobShape(dim=data_shape), caffe_pb2.BlobShape(dim=label_shape)])
                replaced = True
            continue
        net_param.layer.add().CopyFrom(layer)
    assert replaced, f"{path}: no data layer"
    return net_param


def build(net_param, phase=cct.TEST):
    require_types(net_param, phase)
    return cct.Net(net_param, phase)


def assert_shapes(net, expected):
    got = {name: tuple(net.blobs[name].shape) for name in expected}
    wrong = {name: (got[name], shape) for name, shape in expected.items() if got[name] != tuple(shape)}
    assert not wrong, f"blob shapes (got, Caffe's): {wrong}"


def load_script(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- every file ----------------------------------------------------------------------
def test_the_zoo_is_complete():
    names = {relative(p) for p in NET_FILES + SOLVER_FILES}
    for path in ("cifar10_quick/cifar10_quick_train_test.prototxt", "cifar10_quick/cifar10_quick.prototxt",
                 "cifar10_quick/cifar10_quick_solver.prototxt",
                 "bvlc_reference_caffenet/train_val.prototxt", "bvlc_reference_caffenet/deploy.prototxt",
                 "bvlc_reference_caffenet/solver.prototxt", "bvlc_reference_caffenet/train_synthetic.prototxt",
                 "bvlc_alexnet/train_val.prototxt", "bvlc_alexnet/deploy.prototxt", "bvlc_alexnet/solver.prototxt",
                 "bvlc_googlenet/train_val.prototxt", "bvlc_googlenet/deploy.prototxt",
                 "vgg16/deploy.prototxt", "resnet50/deploy.prototxt"):
        assert path in names


@pytest.mark.parametrize("path", NET_FILES, ids=relative)
def test_net_parses_and_wires_up_in_both_phases(path):
    net_param = read_net(path)
    assert len(net_param.layer) > 0 and len(net_param.layers) == 0, "current (V2) syntax expected"
    for phase in (cct.TRAIN, cct.TEST):
        net = phase_net(net_param, phase)
        names = [layer.name for layer in net.layer]
        assert len(names) == len(set(names)), f"duplicate layer names in phase {phase}"
        assert all(layer.type for layer in net.layer)
        insert_splits(net, str(path))        # every bottom made by an earlier layer


@pytest.mark.parametrize("path", SOLVER_FILES, ids=relative)
def test_solver_parses_and_names_a_net_in_the_zoo(path):
    solver = read_solver(path)
    assert solver.net, "solver names no net"
    assert (REPO / solver.net).is_file(), f"net {solver.net!r} not found from the repository root"
    assert solver.base_lr > 0 and solver.max_iter > 0


@pytest.mark.parametrize("script, outputs", [
    ("bvlc_googlenet/make_googlenet.py", ("deploy.prototxt", "train_val.prototxt")),
    ("resnet50/make_resnet50.py", ("deploy.prototxt",)),
    ("digits_lstm/make_digits_lstm.py", ("train_test.prototxt",)),
], ids=["googlenet", "resnet50", "digits_lstm"])
def test_generated_prototxt_is_the_script_output(script, outputs, tmp_path, monkeypatch):
    module = load_script(model(script))
    monkeypatch.setattr(module, "HERE", str(tmp_path))
    module.main()
    for name in outputs:
        committed = (model(script).parent / name).read_text()
        assert committed == (tmp_path / name).read_text(), \
            f"models/{Path(script).parent / name} is stale: run python models/{script}"


# --- train_val nets, by phase ------------------------------------------------------
# Layers per phase: the data layer of that phase, the body, and the losses; TEST adds the
# Accuracy layers. CaffeNet/AlexNet: 22 body layers (5 conv + 7 relu + 3 pool + 2 LRN +
# 3 fc + 2 dropout). GoogLeNet: 159 in TRAIN (1 data + 155 + 3 losses), TEST adds 6 accuracies.
@pytest.mark.parametrize("path, train, test", [
    ("cifar10_quick/cifar10_quick_train_test.prototxt", 13, 14),
    ("bvlc_reference_caffenet/train_val.prototxt", 24, 25),
    ("bvlc_alexnet/train_val.prototxt", 24, 25),
    ("bvlc_googlenet/train_val.prototxt", 159, 165),
    ("bvlc_reference_caffenet/train_synthetic.prototxt", 24, 24),
])
def test_train_val_layer_counts_per_phase(path, train, test):
    net_param = read_net(model(path))
    assert len(phase_net(net_param, cct.TRAIN).layer) == train
    assert len(phase_net(net_param, cct.TEST).layer) == test


@pytest.mark.parametrize("path, train_source, test_source", [
    ("cifar10_quick/cifar10_quick_train_test.prototxt",
     "examples_out/cifar10_train_lmdb", "examples_out/cifar10_test_lmdb"),
    ("bvlc_reference_caffenet/train_val.prototxt",
     "examples/imagenet/ilsvrc12_train_lmdb", "examples/imagenet/ilsvrc12_val_lmdb"),
    ("bvlc_alexnet/train_val.prototxt",
     "examples/imagenet/ilsvrc12_train_lmdb", "examples/imagenet/ilsvrc12_val_lmdb"),
    ("bvlc_googlenet/train_val.prototxt",
     "examples/imagenet/ilsvrc12_train_lmdb", "examples/imagenet/ilsvrc12_val_lmdb"),
])
def test_each_phase_reads_its_own_data(path, train_source, test_source):
    net_param = read_net(model(path))
    for phase, source, mirror in ((cct.TRAIN, train_source, True), (cct.TEST, test_source, False)):
        data = phase_net(net_param, phase).layer[0]
        assert data.type == "Data" and list(data.top) == ["data", "label"]
        assert data.data_param.source == source and data.data_param.backend == caffe_pb2.DataParameter.LMDB
        if "imagenet" in source:
            assert data.transform_param.mirror == mirror
            assert data.transform_param.crop_size in (224, 227)
        else:
            assert data.transform_param.mean_file == "examples_out/cifar10_mean.binaryproto"


def test_googlenet_auxiliary_losses_weigh_0_3():
    net_param = read_net(model("bvlc_googlenet/train_val.prototxt"))
    weights = {layer.name: list(layer.loss_weight) for layer in net_param.layer if layer.type == "SoftmaxWithLoss"}
    assert weights == {"loss1/loss": [pytest.approx(0.3)], "loss2/loss": [pytest.approx(0.3)],
                       "loss3/loss3": [1.0]}


# --- deploy nets agree with their train_val nets ---------------------------------------
def body(net_param, skip_prefixes=()):
    """Layers minus data/loss/accuracy/output ones, stripped of what deploy nets drop."""
    layers = []
    for layer in net_param.layer:
        if layer.type in ("Data", "DummyData", "Input", "Accuracy", "SoftmaxWithLoss", "Softmax"):
            continue
        if layer.name.startswith(skip_prefixes):
            continue
        copy = caffe_pb2.LayerParameter()
        copy.CopyFrom(layer)
        copy.ClearField("param")
        for field in ("convolution_param", "inner_product_param"):
            if copy.HasField(field):
                getattr(copy, field).ClearField("weight_filler")
                getattr(copy, field).ClearField("bias_filler")
        layers.append(copy)
    return layers


@pytest.mark.parametrize("train_val, deploy, skip", [
    ("cifar10_quick/cifar10_quick_train_test.prototxt", "cifar10_quick/cifar10_quick.prototxt", ()),
    ("bvlc_reference_caffenet/train_val.prototxt", "bvlc_reference_caffenet/deploy.prototxt", ()),
    ("bvlc_reference_caffenet/train_val.prototxt", "bvlc_reference_caffenet/train_synthetic.prototxt", ()),
    ("bvlc_alexnet/train_val.prototxt", "bvlc_alexnet/deploy.prototxt", ()),
    ("bvlc_googlenet/train_val.prototxt", "bvlc_googlenet/deploy.prototxt", ("loss1/", "loss2/")),
])
def test_deploy_net_is_the_train_val_body(train_val, deploy, skip):
    assert body(read_net(model(train_val)), skip) == body(read_net(model(deploy)))


def test_caffenet_and_alexnet_differ_as_documented():
    """AlexNet: LRN before pooling, and biases 0.1 where CaffeNet has 1."""
    def summary(path):
        net_param = read_net(model(path))
        order = [layer.name for layer in net_param.layer if layer.type in ("Pooling", "LRN")]
        biases = {layer.name: (layer.convolution_param if layer.type == "Convolution"
                               else layer.inner_product_param).bias_filler.value
                  for layer in net_param.layer if layer.type in ("Convolution", "InnerProduct")}
        return order, biases
    caffenet = summary("bvlc_reference_caffenet/train_val.prototxt")
    alexnet = summary("bvlc_alexnet/train_val.prototxt")
    assert caffenet[0] == ["pool1", "norm1", "pool2", "norm2", "pool5"]
    assert alexnet[0] == ["norm1", "pool1", "norm2", "pool2", "pool5"]
    ones = {"conv2", "conv4", "conv5", "fc6", "fc7"}
    for name, value in caffenet[1].items():
        assert value == pytest.approx(1.0 if name in ones else 0.0)
        assert alexnet[1][name] == pytest.approx(0.1 if name in ones else 0.0)


# --- shapes --------------------------------------------------------------------------
def alexnet_shapes(batch, lrn_first=False):
    """CaffeNet's blob shapes; AlexNet (lrn_first) normalizes before pooling, at 55 and 27."""
    return {"conv1": (batch, 96, 55, 55), "pool1": (batch, 96, 27, 27),
            "norm1": (batch, 96, 55, 55) if lrn_first else (batch, 96, 27, 27),
            "conv2": (batch, 256, 27, 27), "pool2": (batch, 256, 13, 13),
            "norm2": (batch, 256, 27, 27) if lrn_first else (batch, 256, 13, 13),
            "conv3": (batch, 384, 13, 13), "conv4": (batch, 384, 13, 13), "conv5": (batch, 256, 13, 13),
            "pool5": (batch, 256, 6, 6), "fc6": (batch, 4096), "fc7": (batch, 4096), "fc8": (batch, 1000),
            "prob": (batch, 1000)}


@pytest.mark.slow
@pytest.mark.parametrize("path", ["bvlc_reference_caffenet/deploy.prototxt", "bvlc_alexnet/deploy.prototxt"])
def test_caffenet_and_alexnet_shapes(path):
    net = build(with_batch(path, 1))
    assert_shapes(net, dict(alexnet_shapes(1, lrn_first="alexnet" in path), data=(1, 3, 227, 227)))
    params = {name: [tuple(blob.shape) for blob in blobs] for name, blobs in net.params.items()}
    assert params["conv1"] == [(96, 3, 11, 11), (96,)]
    assert params["conv2"] == [(256, 48, 5, 5), (256,)]          # group 2: half the channels each
    assert params["conv3"] == [(384, 256, 3, 3), (384,)]
    assert params["conv4"] == [(384, 192, 3, 3), (384,)]
    assert params["fc6"] == [(4096, 9216), (4096,)]
    assert params["fc8"] == [(1000, 4096), (1000,)]
    # AlexNet's well-known parameter count.
    assert sum(blob.count for blobs in net.params.values() for blob in blobs) == 60_965_224


def test_caffenet_synthetic_builds_on_dummy_data():
    net_param = caffe_pb2.NetParameter()
    net_param.CopyFrom(read_net(model("bvlc_reference_caffenet/train_synthetic.prototxt")))
    assert net_param.layer[0].type == "DummyData"
    assert [list(shape.dim) for shape in net_param.layer[0].dummy_data_param.shape] == [[256, 3, 227, 227], [256]]
    for shape in net_param.layer[0].dummy_data_param.shape:
        shape.dim[0] = 2
    net = build(net_param, cct.TRAIN)
    shapes = alexnet_shapes(2)
    del shapes["prob"]
    assert_shapes(net, dict(shapes, data=(2, 3, 227, 227), label=(2,), loss=()))
    assert (net.blobs["label"].data == 0).all()


def test_cifar10_quick_deploy_shapes():
    net = build(with_batch("cifar10_quick/cifar10_quick.prototxt", 2))
    assert_shapes(net, {"data": (2, 3, 32, 32), "conv1": (2, 32, 32, 32), "pool1": (2, 32, 16, 16),
                        "conv2": (2, 32, 16, 16), "pool2": (2, 32, 8, 8), "conv3": (2, 64, 8, 8),
                        "pool3": (2, 64, 4, 4), "ip1": (2, 64), "ip2": (2, 10), "prob": (2, 10)})
    assert tuple(net.params["ip1"][0].shape) == (64, 1024)
    # Deploy weights default to zeros: the Softmax of zero scores is uniform.
    net.blobs["data"].data[...] = 1.0
    prob = net.forward()["prob"]
    assert prob.shape == (2, 10) and abs(prob - 0.1).max() < 1e-6


@pytest.mark.parametrize("phase", [cct.TRAIN, cct.TEST])
def test_cifar10_quick_train_test_builds_on_inputs(phase):
    net = build(with_inputs("cifar10_quick/cifar10_quick_train_test.prototxt", [2, 3, 32, 32], [2]), phase)
    assert_shapes(net, {"pool3": (2, 64, 4, 4), "ip2": (2, 10), "loss": ()})
    assert ("accuracy" in net.blobs) == (phase == cct.TEST)


GOOGLENET_SHAPES = {
    "conv1/7x7_s2": (64, 112, 112), "pool1/3x3_s2": (64, 56, 56), "conv2/3x3": (192, 56, 56),
    "pool2/3x3_s2": (192, 28, 28),
    "inception_3a/output": (256, 28, 28), "inception_3b/output": (480, 28, 28), "pool3/3x3_s2": (480, 14, 14),
    "inception_4a/output": (512, 14, 14), "inception_4b/output": (512, 14, 14),
    "inception_4c/output": (512, 14, 14), "inception_4d/output": (528, 14, 14),
    "inception_4e/output": (832, 14, 14), "pool4/3x3_s2": (832, 7, 7),
    "inception_5a/output": (832, 7, 7), "inception_5b/output": (1024, 7, 7),
    "pool5/7x7_s1": (1024, 1, 1), "loss3/classifier": (1000,),
}


@pytest.mark.slow
def test_googlenet_deploy_shapes():
    net = build(with_batch("bvlc_googlenet/deploy.prototxt", 1))
    assert_shapes(net, {name: (1,) + shape for name, shape in dict(GOOGLENET_SHAPES, prob=(1000,)).items()})
    assert tuple(net.params["inception_3a/3x3"][0].shape) == (128, 96, 3, 3)
    assert tuple(net.params["loss3/classifier"][0].shape) == (1000, 1024)


def test_googlenet_train_val_builds_with_its_auxiliary_classifiers():
    net = build(with_inputs("bvlc_googlenet/train_val.prototxt", [1, 3, 224, 224], [1]), cct.TRAIN)
    expected = {name: (1,) + shape for name, shape in GOOGLENET_SHAPES.items()}
    expected.update({"loss1/ave_pool": (1, 512, 4, 4), "loss1/conv": (1, 128, 4, 4), "loss1/fc": (1, 1024),
                     "loss1/classifier": (1, 1000), "loss2/ave_pool": (1, 528, 4, 4),
                     "loss1/loss1": (), "loss2/loss2": (), "loss3/loss3": ()})
    assert_shapes(net, expected)
    assert net.blob_loss_weights["loss1/loss1"] == pytest.approx(0.3)
    assert net.blob_loss_weights["loss2/loss2"] == pytest.approx(0.3)
    assert net.blob_loss_weights["loss3/loss3"] == pytest.approx(1.0)


@pytest.mark.slow
def test_vgg16_shapes_through_pool5():
    # Up to pool5 only: fc6 alone is 25088 x 4096 (400 MB of float32) and adds nothing here.
    net_param = with_batch("vgg16/deploy.prototxt", 1)
    names = [layer.name for layer in net_param.layer]
    assert names[-8:] == ["fc6", "relu6", "drop6", "fc7", "relu7", "drop7", "fc8", "prob"]
    del net_param.layer[names.index("fc6"):]
    net = build(net_param)
    assert_shapes(net, {"conv1_2": (1, 64, 224, 224), "pool1": (1, 64, 112, 112), "pool2": (1, 128, 56, 56),
                        "conv3_3": (1, 256, 56, 56), "pool3": (1, 256, 28, 28), "pool4": (1, 512, 14, 14),
                        "conv5_3": (1, 512, 14, 14), "pool5": (1, 512, 7, 7)})
    convs = [layer for layer in net_param.layer if layer.type == "Convolution"]
    assert len(convs) == 13
    # 13 conv + 3 fc = 16 weight layers; fc6 reads the 512 x 7 x 7 pool5.
    assert [c.convolution_param.num_output for c in convs] == [64] * 2 + [128] * 2 + [256] * 3 + [512] * 6
    fcs = [layer.inner_product_param.num_output for layer in read_net(model("vgg16/deploy.prototxt")).layer
           if layer.type == "InnerProduct"]
    assert fcs == [4096, 4096, 1000]


def test_resnet50_structure():
    net_param = read_net(model("resnet50/deploy.prototxt"))
    convs = [layer for layer in net_param.layer if layer.type == "Convolution"]
    # 1 + 16 blocks x 3 convolutions + fc1000 = 50 weight layers, plus 4 projection shortcuts.
    assert len(convs) == 53
    assert [c.name for c in convs if c.name.endswith("_branch1")] == \
        ["res2a_branch1", "res3a_branch1", "res4a_branch1", "res5a_branch1"]
    assert [c.name for c in convs if c.convolution_param.bias_term] == ["conv1"]
    eltwise = [layer for layer in net_param.layer if layer.type == "Eltwise"]
    assert len(eltwise) == 16
    assert all(layer.eltwise_param.operation == caffe_pb2.EltwiseParameter.SUM for layer in eltwise)
    assert all(layer.batch_norm_param.use_global_stats for layer in net_param.layer if layer.type == "BatchNorm")
    assert all(layer.scale_param.bias_term for layer in net_param.layer if layer.type == "Scale")
    # Every convolution is followed by its BatchNorm and Scale, named after it.
    layers = list(net_param.layer)
    for index, layer in enumerate(layers):
        if layer.type == "Convolution":
            suffix = "_conv1" if layer.name == "conv1" else layer.name[len("res"):]
            assert [layers[index + 1].name, layers[index + 2].name] == [f"bn{suffix}", f"scale{suffix}"]


def test_resnet50_shapes():
    net = build(with_batch("resnet50/deploy.prototxt", 1))
    expected = {"conv1": (64, 112, 112), "pool1": (64, 56, 56), "res2a": (256, 56, 56), "res2c": (256, 56, 56),
                "res3a_branch2a": (128, 28, 28), "res3a": (512, 28, 28), "res3d": (512, 28, 28),
                "res4a": (1024, 14, 14), "res4f": (1024, 14, 14), "res5a": (2048, 7, 7), "res5c": (2048, 7, 7),
                "pool5": (2048, 1, 1), "fc1000": (1000,), "prob": (1000,)}
    assert_shapes(net, {name: (1,) + shape for name, shape in expected.items()})
    params = {name: [tuple(blob.shape) for blob in blobs] for name, blobs in net.params.items()}
    assert params["conv1"] == [(64, 3, 7, 7), (64,)]
    assert params["res2a_branch2a"] == [(64, 64, 1, 1)]                # no bias
    assert params["res5c_branch2c"] == [(2048, 512, 1, 1)]
    assert params["bn2a_branch1"] == [(256,), (256,), (1,)]            # mean, variance, scale factor
    assert params["scale2a_branch1"] == [(256,), (256,)]
    assert params["fc1000"] == [(1000, 2048), (1000,)]


@pytest.mark.parametrize("phase, batch", [(cct.TRAIN, 64), (cct.TEST, 100)])
def test_digits_lstm_reads_rows_as_time_steps(phase, batch):
    """Each phase's images (its Data layer swapped for an Input of its batch)
    become 28 steps of 28 pixels, time first; the classifier sees the last step."""
    net_param = phase_net(read_net(model("digits_lstm/train_test.prototxt")), phase)
    assert net_param.layer[0].type == "Data" and net_param.layer[0].data_param.batch_size == batch
    data = caffe_pb2.LayerParameter(name="data", type="Input", top=["data", "label"])
    data.input_param.shape.extend([caffe_pb2.BlobShape(dim=[batch, 1, 28, 28]), caffe_pb2.BlobShape(dim=[batch])])
    net_param.layer[0].CopyFrom(data)
    net = build(net_param, phase)
    assert_shapes(net, {"x": (28, batch, 28), "cont": (28, batch), "lstm": (28, batch, 128),
                        "last": (1, batch, 128), "final": (batch, 128), "score": (batch, 10)})
    assert [tuple(blob.shape) for blob in net.params["lstm"]] == [(512, 28), (512,), (512, 128)]
    images = np.random.default_rng(0).random((batch, 1, 28, 28))
    net.blobs["data"].data[...] = images
    net.forward()
    np.testing.assert_array_equal(net.blobs["x"].data, images[:, 0].transpose(1, 0, 2).astype(np.float32))
    assert not net.blobs["cont"].data[0].any() and net.blobs["cont"].data[1:].all()
