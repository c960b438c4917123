"""Training in every schedule (cct.runtime.executor: sequential, streams,
auto) gives bitwise the same weights: LeNet, CaffeNet-mini, an inception unit,
residual blocks (BatchNorm, Scale, Eltwise), and a net with both, at 1 and 2
batch partitions. The schedule comes from the run settings (CCT_SCHEDULE, the
configuration's "schedule", settings.set_schedule)."""
import numpy as np
import pytest
from google.protobuf import text_format
from threadpoolctl import threadpool_limits

import cct
from cct.core.errors import ConfigError
from cct.proto import caffe_pb2
from cct.runtime import settings, threads
from helpers.nets import FORK_RESIDUAL, INCEPTION, resnet
from helpers.paths import REPO

BLOCKS = f"""
layer {{ name: "data" type: "Input" top: "data" top: "label"
  input_param {{ shape {{ dim: 8 dim: 3 dim: 8 dim: 8 }} shape {{ dim: 8 }} }} }}
{FORK_RESIDUAL}
layer {{ name: "ip" type: "InnerProduct" bottom: "sum" top: "ip"
  inner_product_param {{ num_output: 5 weight_filler {{ type: "gaussian" std: 0.1 }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}
"""


pytestmark = pytest.mark.usefixtures("one_lowering_type")


def lenet():
    """models/lenet's train net with its Data layers replaced by an Input of batch 16."""
    net = text_format.Parse((REPO / "models" / "lenet" / "lenet_train_test.prototxt").read_text(),
                            caffe_pb2.NetParameter())
    layers = [layer for layer in net.layer if layer.type != "Data" and layer.type != "Accuracy"]
    del net.layer[:]
    data = net.layer.add(name="data", type="Input", top=["data", "label"])
    data.input_param.shape.add(dim=[16, 1, 28, 28])
    data.input_param.shape.add(dim=[16])
    net.layer.extend(layers)
    return net


def caffenet_mini():
    """The reference cases' CaffeNet-mini (every CaffeNet layer kind, batch 2)."""
    path = REPO / "tests" / "reference" / "cases" / "caffenet_mini_sgd" / "net.prototxt"
    return text_format.Parse(path.read_text(), caffe_pb2.NetParameter())


NETS = {"lenet": lenet, "blocks": lambda: text_format.Parse(BLOCKS, caffe_pb2.NetParameter()),
        "caffenet_mini": caffenet_mini,
        # an inception unit (four branches, Concat), and two residual blocks
        # (BatchNorm, Scale, Eltwise; the first with a projection shortcut)
        "inception": lambda: text_format.Parse(INCEPTION, caffe_pb2.NetParameter()),
        "resnet": lambda: text_format.Parse(resnet(2, projection=True), caffe_pb2.NetParameter())}


def train(net_param, iterations=10, base_lr=0.02):
    param = caffe_pb2.SolverParameter(base_lr=base_lr, lr_policy="fixed", momentum=0.9, weight_decay=0.001,
                                      display=0, snapshot_after_train=False, random_seed=7)
    param.net_param.CopyFrom(net_param)
    solver = cct.SGDSolver(param)
    rng = np.random.default_rng(1)
    data, label = solver.net.blobs["data"], solver.net.blobs["label"]
    for _ in range(iterations):
        data.data[...] = rng.standard_normal(data.shape)
        label.data[...] = rng.integers(0, 5, label.shape)
        solver.step(1)
    return solver, [blob.data.copy() for blob in solver.net.learnable_params]


def train_in_every_schedule(name, iterations=10, base_lr=0.02):
    """{mode: weights after training} for sequential, streams and auto."""
    weights = {}
    try:
        for mode in ("sequential", "streams", "auto"):
            settings.set_schedule(mode)
            solver, weights[mode] = train(NETS[name](), iterations, base_lr)
            assert solver.net.executor.schedule == mode
    finally:
        settings.set_schedule(None)
    return weights


@pytest.mark.parametrize("name", sorted(NETS))
def test_every_schedule_trains_to_the_same_weights(name, partitions):
    """One BLAS thread (the suite's): each GEMM is the same call in every mode."""
    weights = train_in_every_schedule(name)
    for mode in ("streams", "auto"):
        for ours, theirs in zip(weights[mode], weights["sequential"]):
            assert np.array_equal(ours, theirs), mode


def test_with_two_blas_threads_streams_differ_only_in_the_last_bits(monkeypatch):
    """With 2 BLAS threads the streams mode gives each of its two GEMM streams
    one thread, and OpenBLAS splits a GEMM's work differently for 1 and 2
    threads (conv1's weight gradient sums its K = 9216 products in another
    order): one update's weights then agree to float32 rounding, not bitwise
    (and training amplifies the difference as any change of summation order does)."""
    monkeypatch.setattr(threads, "_blas", None)          # a controller made under 2 threads
    with threadpool_limits(limits=2, user_api="blas"):
        weights = train_in_every_schedule("lenet", iterations=1)
    for ours, theirs in zip(weights["streams"], weights["sequential"]):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)


def test_auto_measures_both_then_keeps_one():
    settings.set_schedule("auto")
    try:
        solver, _ = train(NETS["blocks"](), iterations=8)
    finally:
        settings.set_schedule(None)
    _, times, chosen = solver.net.executor._auto
    assert chosen in ("sequential", "streams") and all(len(runs) >= 3 for runs in times.values())


def test_the_configuration_sets_alpha_and_beta(tmp_path):
    path = tmp_path / "run.json"
    path.write_text('{"schedule": "streams", "priorities": {"alpha": 0.125, "beta": 0.75}}')
    settings.load(path)
    try:
        net = cct.Net(NETS["blocks"](), cct.TRAIN)
        net.forward()
        net.backward()
        schedule = net.executor.stream_schedule()
    finally:
        settings.load(None)
    assert (schedule.alpha, schedule.beta) == (0.125, 0.75)


def test_schedule_from_the_environment_and_the_configuration(monkeypatch, tmp_path):
    monkeypatch.setenv("CCT_SCHEDULE", "streams")
    assert settings.schedule() == "streams"
    monkeypatch.setenv("CCT_SCHEDULE", "fastest")
    with pytest.raises(ConfigError, match="CCT_SCHEDULE: must be one of sequential, streams, auto"):
        settings.schedule()
    monkeypatch.delenv("CCT_SCHEDULE")
    assert settings.schedule(settings.parse('{"schedule": "auto"}')) == "auto"
    with pytest.raises(ConfigError, match="schedule: must be one of"):
        settings.parse('{"schedule": 3}', "run.json")
    assert settings.schedule() == "sequential"
