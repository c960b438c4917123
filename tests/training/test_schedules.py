"""Training in every schedule (cct.runtime.executor: sequential, streams,
auto) gives bitwise the same weights: LeNet, CaffeNet-mini, an inception unit,
residual blocks (BatchNorm, Scale, Eltwise), and a net with both, at 1 and 2
batch partitions. The schedule comes from the run settings (CCT_SCHEDULE, the
configuration's "schedule", settings.set_schedule)."""
import json
import statistics

import numpy as np
import pytest
from google.protobuf import text_format
from threadpoolctl import threadpool_limits

import cct
from cct.devices import blas as blas_module
from cct.core.errors import ConfigError
from cct.proto import caffe_pb2
from cct.runtime import settings
from cct.training.windows import SolverUpdates
from helpers.nets import FORK_RESIDUAL, INCEPTION, resnet
from helpers.paths import REPO
from helpers.schedules import loose

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


def test_with_two_blas_threads_streams_give_the_sequential_weights(monkeypatch):
    """With 2 BLAS threads too: each sub-task runs at the sequential schedule's
    width (a layer on both threads, as its BLAS threads or its partitions),
    so every GEMM is the same call. (When the streams gave each of two GEMM
    streams one thread, OpenBLAS summed conv1's weight gradient, K = 9216
    products, in another order, and the weights agreed only to rounding.)"""
    monkeypatch.setattr(blas_module, "_blas", None)          # a controller made under 2 threads
    with threadpool_limits(limits=2, user_api="blas"):
        weights = train_in_every_schedule("lenet", iterations=3)
    for ours, theirs in zip(weights["streams"], weights["sequential"]):
        assert np.array_equal(ours, theirs)


def test_auto_measures_both_then_keeps_one():
    """A solver in the "auto" schedule times windows of iterations in each
    mode (after one warm-up each; the tuned one's profiles) and keeps the faster; net.backward() from
    Python does the same for the backward alone (the executor's choice)."""
    settings.set_schedule("auto")
    try:
        solver, _ = train(NETS["blocks"](), iterations=16)
        net = cct.Net(NETS["blocks"](), cct.TRAIN)
        for _ in range(8):
            net.forward()
            net.backward()
    finally:
        settings.set_schedule(None)
    [choice] = solver._auto.values()
    _kept_the_fastest(choice, ("sequential", "streams", "tuned"))
    assert solver.auto_choice() == choice.chosen
    _, choice = net.executor._auto
    _kept_the_fastest(choice, ("sequential", "streams"))


def test_auto_choice_is_none_until_auto_has_chosen_and_where_the_schedule_is_not_auto():
    settings.set_schedule("auto")
    try:
        solver, _ = train(NETS["blocks"](), iterations=2)
        assert solver.auto_choice() is None              # still measuring
    finally:
        settings.set_schedule(None)
    settings.set_schedule("sequential")
    try:
        solver, _ = train(NETS["blocks"](), iterations=16)   # what made auto choose above
        assert solver.auto_choice() is None
    finally:
        settings.set_schedule(None)


def _kept_the_fastest(choice, modes):
    """Every mode counted at least once (a clearly slower one is measured no
    further: cct.runtime.choice.CLEARLY_SLOWER), the kept one three times,
    and its median the lowest."""
    assert set(choice.times) == set(modes) and choice.chosen in modes
    assert all(choice.times.values()) and len(choice.times[choice.chosen]) == 3
    medians = {mode: statistics.median(runs) for mode, runs in choice.times.items()}
    assert medians[choice.chosen] == min(medians.values())


def test_pycaffe_side_setting():
    cct.set_schedule("streams")
    try:
        assert cct.Net(NETS["blocks"](), cct.TRAIN).executor.schedule == "streams"
        with pytest.raises(ConfigError, match="schedule: must be sequential, streams, tuned or auto"):
            cct.set_schedule("fast")
    finally:
        cct.set_schedule(None)
    assert cct.Net(NETS["blocks"](), cct.TRAIN).executor.schedule == "auto"


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
    with pytest.raises(ConfigError, match="environment variable CCT_SCHEDULE: must be sequential, streams, tuned or auto, got 'fastest'"):
        settings.schedule()
    monkeypatch.delenv("CCT_SCHEDULE")
    assert settings.schedule(settings.parse('{"schedule": "auto"}')) == "auto"
    with pytest.raises(ConfigError, match="schedule: must be sequential, streams, tuned or auto, got 3"):
        settings.parse('{"schedule": 3}', "run.json")
    assert settings.schedule() == "auto"


def with_dummy_data(net_param):
    """The net with its Input layers replaced by one DummyData drawing a new
    batch each forward (gaussian images, labels 0-4), so that iterations run
    as one graph see different data, as from a Data layer."""
    inputs = [layer for layer in net_param.layer if layer.type == "Input"]
    tops = [top for layer in inputs for top in layer.top]
    shapes = [shape for layer in inputs for shape in layer.input_param.shape]
    others = [layer for layer in net_param.layer if layer.type != "Input"]
    del net_param.layer[:]
    dummy = net_param.layer.add(name="data", type="DummyData", top=tops).dummy_data_param
    for top, shape in zip(tops, shapes):
        dummy.shape.add().CopyFrom(shape)
        if top == "label":
            dummy.data_filler.add(type="uniform", min=0.0, max=4.99)
        else:
            dummy.data_filler.add(type="gaussian", std=1.0)
    net_param.layer.extend(others)
    return net_param


def train_in_windows(name, schedule, solver_type="SGD", iterations=12, **extra):
    """Weights and smoothed loss after solver.step(iterations), display every 5
    (so the streams schedule runs windows of 1, 5, 5 and 1 iterations)."""
    param = caffe_pb2.SolverParameter(base_lr=0.01, lr_policy="fixed", weight_decay=0.001, display=5,
                                      snapshot_after_train=False, random_seed=7, type=solver_type, **extra)
    param.net_param.CopyFrom(with_dummy_data(NETS[name]()))
    settings.set_schedule(schedule)
    try:
        solver = cct.get_solver(param)
        solver.step(iterations)
    finally:
        settings.set_schedule(None)
    return [blob.data.copy() for blob in solver.net.learnable_params], solver.smoothed_loss, solver


@pytest.mark.parametrize("name", ["lenet", "inception", "resnet", "caffenet_mini"])
def test_iterations_run_as_one_graph_on_the_streams_give_the_sequential_weights(name, partitions):
    ours, our_loss, solver = train_in_windows(name, "streams", momentum=0.9)
    theirs, their_loss, _ = train_in_windows(name, "sequential", momentum=0.9)
    assert solver._stream_schedules and solver.iter == 12
    assert our_loss == their_loss
    for a, b in zip(ours, theirs):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("solver_type,extra", [
    ("Nesterov", {"momentum": 0.9}), ("Adam", {"momentum": 0.9, "momentum2": 0.999}),
    ("SGD", {"momentum": 0.9, "clip_gradients": 0.5}), ("AdaGrad", {}),
    ("SGD", {"momentum": 0.9, "iter_size": 3})])
def test_every_update_rule_clipping_and_iter_size_on_the_streams(solver_type, extra):
    """Per-parameter updates (Adam reads the iteration count), clip_gradients'
    barrier between the last gradient and the first update, and iter_size
    passes adding into the gradients before one update."""
    ours, our_loss, _ = train_in_windows("blocks", "streams", solver_type, iterations=7, **extra)
    theirs, their_loss, _ = train_in_windows("blocks", "sequential", solver_type, iterations=7, **extra)
    assert our_loss == their_loss
    for a, b in zip(ours, theirs):
        assert np.array_equal(a, b)


def test_the_next_iterations_forward_does_not_wait_for_the_whole_update():
    """The iteration boundary is no barrier: with conv1's bias update held
    back, the next iteration's data layer, which needs none of it, draws its
    batch before that update ends (given a core to run on: loose widths);
    the weights stay the sequential ones."""
    from cct.runtime import graph, scheduler
    _, _, reference = train_in_windows("blocks", "sequential", iterations=3)
    solver = cct.get_solver(reference.param)
    net = solver.net
    conv1 = net.layers[net.layer_names.index("conv1")]
    bias = next(p for p, blob in enumerate(net.learnable_params) if blob is conv1.blobs[1])
    late = graph.Task(graph.UPDATE, param=bias, iteration=0)
    schedule = loose(scheduler.Schedule(net, net.executor.steps(), updates=SolverUpdates(solver), iterations=3))
    schedule.run(delay=lambda task: 0.05 if task == late else 0.0)
    spans = {span.task: span for span in schedule.trace}
    assert spans[graph.Task(graph.FORWARD, net.layer_names.index("data"), iteration=1)].start < spans[late].end
    assert solver.iter == 3
    for ours, theirs in zip(net.learnable_params, reference.net.learnable_params):
        assert np.array_equal(ours.data, theirs.data)


# --- the "tuned" schedule (cct.runtime.tuner): thread counts per sub-task profiled
# on the first training iterations (Liu et al.'s model B), then the streams with
# Strategy 3's co-running inside the core budget

@pytest.fixture
def two_threads(monkeypatch, tmp_path):
    """Two BLAS threads, and a cache of tuned profiles of the test's own."""
    monkeypatch.setattr(blas_module, "_blas", None)      # a controller made under 2 threads
    monkeypatch.setenv("CCT_CACHE_DIR", str(tmp_path / "cache"))
    with threadpool_limits(limits=2, user_api="blas"):
        yield tmp_path / "cache"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lenet", "inception", "resnet"])
def test_tuned_training_keeps_the_sequential_weights_to_rounding(name, two_threads):
    """A GEMM's thread count may differ from the sequential schedule's (OpenBLAS
    may then sum a long product in another order): the same weights to float32
    rounding, after 12 iterations (2 of them profiling)."""
    theirs, their_loss, _ = train_in_windows(name, "sequential")
    ours, our_loss, solver = train_in_windows(name, "tuned")
    [tuner] = solver._tuners.values()
    assert tuner.done and solver.iter == 12
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert our_loss == pytest.approx(their_loss, rel=1e-4)


def test_profiling_steps_stay_within_the_papers_bound(two_threads):
    """Every tunable sub-task climbs 1, 2 (step 1 on 2 cores): at most
    2 * cores / step profiling iterations, each count's time measured, and
    one Strategy-2 count per op type, the best of its largest instance."""
    _, _, solver = train_in_windows("lenet", "tuned", iterations=4)
    [tuner] = solver._tuners.values()
    assert tuner.cores == 2 and tuner.steps <= 2 * tuner.cores / tuner.step
    report = tuner.report()
    assert report and all(set(tried) <= {1, 2} and 1 in tried for _, _, tried, _ in report)
    for key, op_type, tried, count in report:
        largest = max((curve.tried[1], key_) for key_, curve in tuner.curves.items()
                      if tuner_type(tuner, key_) == op_type)[1]
        assert count == tuner.curves[largest].best()


def tuner_type(tuner, key):
    from cct.runtime.tuner import op_type
    return op_type(tuner.schedule.net, key)


def test_a_tuned_window_never_holds_more_cores_than_the_budget(two_threads):
    """From the trace of a tuned window: at every start the threads held by
    the sub-tasks running add up to the cores at most, and a sub-task ran
    on one of its counts."""
    _, _, solver = train_in_windows("inception", "tuned", iterations=8)
    schedule = next(s for key, s in solver._stream_schedules.items() if key[1] and s.trace)
    for span in schedule.trace:
        running = [other for other in schedule.trace if other.dispatched <= span.dispatched < other.end]
        assert sum(other.threads for other in running) <= schedule.cores
        assert 1 <= span.threads <= schedule.cores


def test_the_tuned_profile_is_cached_per_net_and_machine(two_threads, caplog):
    """A second run of the same net and shapes on this machine starts tuned
    from the cached profile, with no profiling iteration and the same counts;
    a damaged file is profiled afresh (and said so), then rewritten."""
    _, _, first = train_in_windows("lenet", "tuned", iterations=4)
    [profiled] = first._tuners.values()
    assert profiled.steps == 2 and profiled.cache.is_file()
    _, _, second = train_in_windows("lenet", "tuned", iterations=4)
    [cached] = second._tuners.values()
    assert cached.steps == 0 and cached.done and cached.type_counts == profiled.type_counts
    assert cached.cache == profiled.cache
    profiled.cache.write_text("{ not json")
    with caplog.at_level("WARNING", logger="cct.runtime.tuner"):
        _, _, third = train_in_windows("lenet", "tuned", iterations=4)
    [afresh] = third._tuners.values()
    assert afresh.steps == 2 and "not a tuned profile" in caplog.text
    assert json.loads(profiled.cache.read_text())["version"] == 1


def test_the_configuration_fixes_a_layers_thread_count(two_threads):
    """"threads" in the run configuration: the layer's sub-tasks are not
    profiled and run on that many threads in every tuned window."""
    settings.load(settings.parse('{"layers": {"ip1": {"threads": 1}, "conv2": {"threads": 2}}}', "run.json"))
    try:
        _, _, solver = train_in_windows("lenet", "tuned", iterations=8)
    finally:
        settings.load(None)
    [tuner] = solver._tuners.values()
    net = solver.net
    pinned = {net.layer_names[layer]: count for (_, layer, _), count in tuner.pinned.items()}
    assert pinned == {"ip1": 1, "conv2": 2}
    assert not any(net.layer_names[layer] in pinned for _, layer, _ in tuner.tried)
    spans = [span for key, schedule in solver._stream_schedules.items() if key[1] for span in schedule.trace]
    held = {(net.layer_names[span.task.layer], span.threads) for span in spans
            if span.task.layer >= 0 and net.layer_names[span.task.layer] in pinned}
    assert held == {("ip1", 1), ("conv2", 2)}


def test_tuned_is_a_schedule_setting():
    settings.set_schedule("tuned")
    try:
        assert settings.schedule() == "tuned"
    finally:
        settings.set_schedule(None)
