"""pycaffe flows end to end on cct: the LeNet notebook (NetSpec -> SGDSolver ->
step loop), classification (Transformer, Classifier, top-5), net surgery,
forward_all / forward_backward_all, callbacks, set_input_arrays, Timer, Detector."""
import textwrap
import time

import numpy as np
import pytest
from PIL import Image

import cct
from cct import io as cio
from cct import pycaffe  # noqa: F401  (attaches forward_all & co. to Net)
from cct.classifier import Classifier
from cct.detector import Detector
from cct.core.errors import CctError, ConfigError
from cct.net_spec import NetSpec, layers as L, params as P
from cct.pycaffe import Timer


# --- the LeNet notebook ------------------------------------------------------------------

def small_lenet(batch_size, with_accuracy):
    n = NetSpec()
    n.data, n.label = L.Input(shape=[dict(dim=[batch_size, 1, 12, 12]), dict(dim=[batch_size])], ntop=2)
    n.conv1 = L.Convolution(n.data, kernel_size=3, num_output=4, weight_filler=dict(type="xavier"))
    n.pool1 = L.Pooling(n.conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.fc1 = L.InnerProduct(n.pool1, num_output=16, weight_filler=dict(type="xavier"))
    n.relu1 = L.ReLU(n.fc1, in_place=True)
    n.score = L.InnerProduct(n.relu1, num_output=2, weight_filler=dict(type="xavier"))
    n.loss = L.SoftmaxWithLoss(n.score, n.label)
    if with_accuracy:
        n.accuracy = L.Accuracy(n.score, n.label)
    return n.to_proto()


def separable_batch(rng, batch_size):
    """Class 0: the left half is bright; class 1: the right half."""
    labels = rng.integers(0, 2, batch_size)
    images = rng.normal(0.0, 0.3, (batch_size, 1, 12, 12)).astype(np.float32)
    images[labels == 0, :, :, :6] += 1.0
    images[labels == 1, :, :, 6:] += 1.0
    return images, labels.astype(np.float32)


def test_lenet_notebook_flow(tmp_path):
    (tmp_path / "train.prototxt").write_text(str(small_lenet(16, False)))
    (tmp_path / "test.prototxt").write_text(str(small_lenet(32, True)))
    (tmp_path / "solver.prototxt").write_text(textwrap.dedent(f"""\
        train_net: "{tmp_path / 'train.prototxt'}"
        test_net: "{tmp_path / 'test.prototxt'}"
        test_iter: 1 test_interval: 1000
        base_lr: 0.05 momentum: 0.9 weight_decay: 0.0005 lr_policy: "fixed"
        display: 0 max_iter: 1000 random_seed: 3 snapshot_prefix: "{tmp_path / 'lenet'}"
        """))
    solver = cct.SGDSolver(str(tmp_path / "solver.prototxt"))
    assert [(k, v[0].data.shape) for k, v in solver.net.params.items()] == [
        ("conv1", (4, 1, 3, 3)), ("fc1", (16, 100)), ("score", (2, 16))]
    rng = np.random.default_rng(0)
    test_images, test_labels = separable_batch(rng, 32)
    niter, test_interval = 60, 20
    train_loss = np.zeros(niter)
    test_acc = []
    for it in range(niter):
        images, labels = separable_batch(rng, 16)
        solver.net.blobs["data"].data[...] = images
        solver.net.blobs["label"].data[...] = labels
        solver.step(1)                         # the first step also shares weights with the test net
        train_loss[it] = solver.net.blobs["loss"].data
        if it % test_interval == 0 or it == niter - 1:
            test_net = solver.test_nets[0]
            test_net.blobs["data"].data[...] = test_images
            test_net.blobs["label"].data[...] = test_labels
            test_net.forward()
            correct = np.sum(test_net.blobs["score"].data.argmax(1) == test_labels)
            test_acc.append(correct / 32.0)
            assert float(test_net.blobs["accuracy"].data) == pytest.approx(correct / 32.0)
    assert train_loss[-10:].mean() < 0.5 * train_loss[:10].mean()
    assert test_acc[-1] >= 0.95


# --- classification ---------------------------------------------------------------------

CLASSIFIER_NET = """name: "tiny"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 10 dim: 3 dim: 8 dim: 8 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "fc" type: "InnerProduct" bottom: "conv" top: "fc"
        inner_product_param { num_output: 7 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" }
"""


@pytest.fixture
def tiny_model(tmp_path):
    cct.set_random_seed(11)
    model = tmp_path / "deploy.prototxt"
    model.write_text(CLASSIFIER_NET)
    weights = tmp_path / "tiny.caffemodel"
    cct.Net(str(model), cct.TEST).save(str(weights))
    rng = np.random.default_rng(4)
    image_path = tmp_path / "cat.png"
    Image.fromarray(rng.integers(0, 256, (11, 13, 3), dtype=np.uint8)).save(image_path)
    return str(model), str(weights), str(image_path)


def test_classification_notebook_flow_and_classifier(tiny_model):
    model, weights, image_path = tiny_model
    mean = np.array([104.0, 117.0, 123.0])
    net = cct.Net(model, weights, cct.TEST)                  # pycaffe's legacy argument order
    transformer = cio.Transformer({"data": net.blobs["data"].data.shape})
    transformer.set_transpose("data", (2, 0, 1))
    transformer.set_mean("data", mean)
    transformer.set_raw_scale("data", 255)
    transformer.set_channel_swap("data", (2, 1, 0))
    net.blobs["data"].reshape(1, 3, 8, 8)
    image = cio.load_image(image_path)
    net.blobs["data"].data[...] = transformer.preprocess("data", image)
    output_prob = net.forward()["prob"][0].copy()
    assert output_prob.shape == (7,) and output_prob.sum() == pytest.approx(1.0, rel=1e-5)
    top_inds = output_prob.argsort()[::-1][:5]
    assert len(set(top_inds)) == 5 and output_prob[top_inds[0]] == output_prob.max()

    classifier = Classifier(model, weights, image_dims=(8, 8), mean=mean, raw_scale=255,
                            channel_swap=(2, 1, 0))
    center = classifier.predict([image], oversample=False)
    np.testing.assert_allclose(center[0], output_prob, rtol=1e-5)

    # Oversampling: 10 crops of the image resized to image_dims, predictions averaged.
    classifier = Classifier(model, weights, image_dims=(12, 12), mean=mean, raw_scale=255,
                            channel_swap=(2, 1, 0))
    predictions = classifier.predict([image, image[::-1]])
    assert predictions.shape == (2, 7)
    crops = cio.oversample([cio.resize_image(image, (12, 12))], (8, 8))
    probs = []
    for crop in crops:
        net.blobs["data"].data[...] = transformer.preprocess("data", crop)
        probs.append(net.forward()["prob"][0].copy())
    # atol: float32 probabilities near 1e-28 carry no relative precision.
    np.testing.assert_allclose(predictions[0], np.mean(probs, axis=0), rtol=1e-5, atol=1e-9)


def test_detector_windows_and_context_pad(tiny_model):
    model, weights, image_path = tiny_model
    detector = Detector(model, weights, raw_scale=255)
    windows = [np.array([0, 0, 8, 8]), np.array([2, 3, 11, 13])]
    detections = detector.detect_windows([(image_path, windows)])
    assert [d["filename"] for d in detections] == [image_path] * 2
    image = cio.load_image(image_path)
    net = cct.Net(model, cct.TEST, weights=weights)
    net.blobs["data"].reshape(1, 3, 8, 8)
    for detection, window in zip(detections, windows):
        crop = image[window[0]:window[2], window[1]:window[3]]
        net.blobs["data"].data[...] = detector.transformer.preprocess("data", crop)
        np.testing.assert_allclose(detection["prediction"], net.forward()["prob"][0], rtol=1e-5)
    padded = Detector(model, weights, raw_scale=255, mean=np.array([0.5, 0.5, 0.5]) * 255, context_pad=2)
    crop = padded.crop(image, np.array([0, 0, 6, 6]))
    assert crop.shape == (8, 8, 3)
    np.testing.assert_allclose(crop[0, 0], 0.5)              # outside the image: the mean
    with pytest.raises(CctError, match="selective_search_ijcv_with_python"):
        detector.detect_selective_search([image_path])


# --- net surgery, forward_all, forward_backward_all ---------------------------------------------

FC_NET = """layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 6 dim: 6 } } }
layer { name: "fc" type: "InnerProduct" bottom: "data" top: "fc"
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "gaussian" std: 1 } } }
"""
CONV_NET = """layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 6 dim: 6 } } }
layer { name: "fc-conv" type: "Convolution" bottom: "data" top: "fc-conv"
        convolution_param { num_output: 4 kernel_size: 6 } }
"""


def test_net_surgery_fully_convolutional(tmp_path):
    (tmp_path / "fc.prototxt").write_text(FC_NET)
    (tmp_path / "conv.prototxt").write_text(CONV_NET)
    net = cct.Net(str(tmp_path / "fc.prototxt"), cct.TEST)
    conv = cct.Net(str(tmp_path / "conv.prototxt"), cct.TEST)
    conv.params["fc-conv"][0].data.flat = net.params["fc"][0].data.flat
    conv.params["fc-conv"][1].data[...] = net.params["fc"][1].data
    x = np.random.default_rng(0).standard_normal((2, 3, 6, 6)).astype(np.float32)
    expected = net.forward(data=x)["fc"].copy()
    np.testing.assert_allclose(conv.forward(data=x)["fc-conv"][:, :, 0, 0], expected, rtol=1e-4, atol=1e-5)
    # Reshape the input, then the net: a 3x3 map of the fc's scores.
    big = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)
    conv.blobs["data"].reshape(*big.shape)
    conv.reshape()
    scores = conv.forward(data=big)["fc-conv"]
    assert scores.shape == (1, 4, 3, 3)
    net.blobs["data"].reshape(1, 3, 6, 6)
    net.reshape()
    window = net.forward(data=big[:, :, 1:7, 2:8])["fc"]
    np.testing.assert_allclose(scores[0, :, 1, 2], window[0], rtol=1e-4, atol=1e-5)


def test_forward_all_odd_count_and_forward_backward_all(tmp_path):
    (tmp_path / "fc.prototxt").write_text("force_backward: true\n" + FC_NET)
    net = cct.Net(str(tmp_path / "fc.prototxt"), cct.TEST)
    images = np.random.default_rng(2).standard_normal((7, 3, 6, 6)).astype(np.float32)
    out = net.forward_all(data=images, blobs=["data"])
    assert set(out) == {"fc", "data"} and out["fc"].shape == (7, 4)
    weights = net.params["fc"][0].data.astype(np.float64)
    bias = net.params["fc"][1].data
    expected = np.array([weights @ image.ravel() + bias for image in images])     # one image at a time
    np.testing.assert_allclose(out["fc"], expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(out["data"], images)
    top_diffs = np.random.default_rng(3).standard_normal((7, 4)).astype(np.float32)
    blobs, diffs = net.forward_backward_all(data=images, fc=top_diffs)
    assert blobs["fc"].shape == (7, 4) and diffs["data"].shape == (7, 3, 6, 6)
    np.testing.assert_allclose(diffs["data"].reshape(7, -1), top_diffs @ weights, rtol=1e-4, atol=1e-5)
    assert list(net._batch({"data": images})) [-1]["data"].shape == (2, 3, 6, 6)


def test_layer_callbacks_run_around_every_layer(tmp_path):
    (tmp_path / "fc.prototxt").write_text("force_backward: true\n" + FC_NET)
    net = cct.Net(str(tmp_path / "fc.prototxt"), cct.TEST)
    plain = cct.Net(str(tmp_path / "fc.prototxt"), cct.TEST)
    calls = []
    net.before_forward(lambda i: calls.append(("before_forward", i)))
    net.after_forward(lambda i: calls.append(("after_forward", i)))
    net.before_backward(lambda i: calls.append(("before_backward", i)))
    net.after_backward(lambda i: calls.append(("after_backward", i)))
    net.forward()
    net.backward()
    assert calls == [("before_forward", 0), ("after_forward", 0), ("before_forward", 1), ("after_forward", 1),
                     ("before_backward", 1), ("after_backward", 1), ("before_backward", 0), ("after_backward", 0)]
    calls.clear()
    net.forward(start="fc")
    assert calls == [("before_forward", 1), ("after_forward", 1)]
    plain.forward()                                  # other nets' layers call nobody
    assert len(calls) == 2
    with pytest.raises(TypeError, match="callable"):
        net.before_forward(3)


def test_set_input_arrays_needs_a_memory_data_first_layer(tmp_path):
    (tmp_path / "fc.prototxt").write_text(FC_NET)
    net = cct.Net(str(tmp_path / "fc.prototxt"), cct.TEST)
    with pytest.raises(ConfigError, match="first layer is a MemoryData layer; net .* starts with 'data' \\(Input\\)"):
        net.set_input_arrays(np.zeros((2, 3, 6, 6), np.float32), np.zeros(2, np.float32))


def test_set_input_arrays_feeds_memory_data(tmp_path):
    (tmp_path / "mem.prototxt").write_text(
        'layer { name: "data" type: "MemoryData" top: "data" top: "label" '
        'memory_data_param { batch_size: 2 channels: 1 height: 2 width: 2 } }')
    net = cct.Net(str(tmp_path / "mem.prototxt"), cct.TEST)
    data = np.arange(16, dtype=np.float32).reshape(4, 1, 2, 2)
    labels = np.array([1, 0, 1, 0], np.float32)
    net.set_input_arrays(data, labels)
    net.forward()
    np.testing.assert_array_equal(net.blobs["data"].data, data[:2])
    np.testing.assert_array_equal(net.blobs["label"].data.ravel(), labels[:2])
    net.forward()
    np.testing.assert_array_equal(net.blobs["data"].data, data[2:])


def test_timer():
    timer = Timer()
    assert timer.ms == 0.0
    timer.start()
    time.sleep(0.01)
    timer.stop()
    assert 5.0 < timer.ms < 1000.0 and timer.seconds() == pytest.approx(timer.ms / 1000.0)
    timer.start()
    assert timer.running
    timer.milliseconds()                             # reading a running timer stops it
    assert not timer.running


@pytest.mark.opencl
def test_set_mode_gpu_and_set_device_pick_the_opencl_device_layers_run_on():
    from cct.runtime import settings
    from helpers.devices import opencl_or_skip
    device = opencl_or_skip()
    try:
        cct.set_device(0)
        cct.set_mode_gpu()
        assert settings.device() is device
        cct.set_mode_cpu()
        assert settings.device() is None
    finally:
        settings.set_mode(None)


def test_multi_process_api_as_a_build_without_nccl(monkeypatch):
    """pycaffe's python/train.py calls: has_nccl() is False; NCCL(solver, uid) is made
    and handed to the solver and the net, where it does nothing; the solver
    count/rank and multiprocess settings are kept."""
    from helpers.linreg import make_solver
    monkeypatch.setattr(cct.pycaffe, "_multiprocess", dict(cct.pycaffe._multiprocess))
    assert cct.has_nccl() is False
    assert (cct.solver_count(), cct.solver_rank()) == (1, 0)
    cct.set_solver_count(4)
    cct.set_solver_rank(2)
    cct.set_multiprocess(True)
    assert (cct.solver_count(), cct.solver_rank(), cct.pycaffe._multiprocess["multiprocess"]) == (4, 2, True)
    solver = make_solver('type: "SGD" base_lr: 0.01 lr_policy: "fixed"')
    nccl = cct.NCCL(solver, b"uid")
    assert not hasattr(cct.NCCL, "new_uid") and not hasattr(nccl, "bcast")
    solver.add_callback(nccl)
    solver.net.after_backward(nccl)
    calls = []
    solver.add_callback(lambda: calls.append("start"), lambda: calls.append("gradients"))
    solver.step(2)
    assert calls == ["start", "gradients"] * 2


def test_init_log_and_log_write_glog_lines(capsys):
    """pycaffe's init_log(level, stderr) and log(message), as Caffe's python/train.py calls them."""
    import logging
    logger = logging.getLogger("cct")
    level = logger.level
    try:
        cct.init_log(0, True)
        cct.log("Using devices [0]")
        cct.init_log(1)
        cct.log("not shown at WARNING")
        err = capsys.readouterr().err
        assert any(line.startswith("I") and line.endswith("] Using devices [0]") for line in err.splitlines())
        assert "not shown" not in err
        with pytest.raises(ValueError, match="init_log: level must be 0"):
            cct.init_log(4)
    finally:
        logger.setLevel(level)
        logger.removeHandler(cct.pycaffe._log_handler)       # later tests install their own
        cct.pycaffe._log_handler = None
