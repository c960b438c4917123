"""The sub-task graph (cct.runtime.graph): edges derived from what sub-tasks
read and write keep the numbers of the sequential order under any order that
respects them, iterations overlapping included; and leaving out one derived
edge lets some order change them (the negative control)."""
import random

import numpy as np
import pytest
from google.protobuf import text_format

import cct
from cct.proto import caffe_pb2
from cct.runtime import graph, scheduler
from cct.training.windows import SolverUpdates
from helpers.data import raw_datum, write_lmdb
from helpers.nets import FORK_RESIDUAL

# An LMDB data layer (no random draws, a cursor that moves every forward), a
# convolution whose weight gradient reads the data blob, an inception-like fork
# joined by Concat, a residual block (BatchNorm, Scale and ReLU in place, an
# Eltwise sum with the shortcut), shared InnerProduct weights and a loss.
NET = """
name: "graph"
layer { name: "data" type: "Data" top: "data" top: "label"
  data_param { source: "{source}" batch_size: 4 backend: LMDB } transform_param { scale: 0.0039 } }
{body}
layer { name: "pool" type: "Pooling" bottom: "sum" top: "pool" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip_a" type: "InnerProduct" bottom: "pool" top: "ip_a" param { name: "shared_w" }
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "ip_b" type: "InnerProduct" bottom: "pool" top: "ip_b" param { name: "shared_w" }
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "logits" type: "Eltwise" bottom: "ip_a" bottom: "ip_b" top: "logits" }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "logits" bottom: "label" top: "loss" }
"""
ITERATIONS = 3


pytestmark = pytest.mark.usefixtures("one_lowering_type")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    rng = np.random.default_rng(0)
    datums = [raw_datum(rng.integers(0, 256, (2, 6, 6), dtype=np.uint8), int(rng.integers(0, 5)))
              for _ in range(10)]           # 10 records, batch 4: the cursor wraps within 3 iterations
    return write_lmdb(tmp_path_factory.mktemp("graph") / "lmdb", datums)


def make_solver(source):
    text = NET.replace("{source}", source).replace("{body}", FORK_RESIDUAL)
    net = text_format.Parse(text, caffe_pb2.NetParameter())
    param = caffe_pb2.SolverParameter(base_lr=0.05, lr_policy="fixed", momentum=0.9, weight_decay=0.01,
                                      display=0, snapshot_after_train=False, random_seed=3)
    param.net_param.CopyFrom(net)
    return cct.SGDSolver(param)


def weights(solver):
    return [blob.data.copy() for blob in solver.net.learnable_params]


def run_in_random_order(solver, seed, drop=()):
    unrolled = graph.build(solver.net, ITERATIONS, drop=drop)
    chooser = random.Random(seed)
    run = graph.Runner(solver.net, solver.net.executor.steps(), SolverUpdates(solver))
    for task in graph.topological_order(unrolled, lambda ready: chooser.choice(ready)):
        run(task)
    return weights(solver)


@pytest.fixture
def sequential(source):
    solver = make_solver(source)
    solver.step(ITERATIONS)
    return weights(solver)


def assert_same(ours, theirs):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert np.array_equal(a, b)


def test_the_sequential_order_is_the_solvers(source, sequential):
    solver = make_solver(source)
    unrolled = graph.build(solver.net, ITERATIONS)
    run = graph.Runner(solver.net, solver.net.executor.steps(), SolverUpdates(solver))
    for task in unrolled.tasks:
        run(task)
    assert_same(weights(solver), sequential)


@pytest.mark.parametrize("seed", range(20))
def test_any_order_the_edges_allow_gives_the_same_weights(source, sequential, seed):
    assert_same(run_in_random_order(make_solver(source), seed), sequential)


def test_iterations_overlap_in_the_random_orders(source):
    """The orders tested are not iteration after iteration: in most of them the
    data layer's next forward runs before the update of the iteration before."""
    solver = make_solver(source)
    unrolled = graph.build(solver.net, ITERATIONS)
    overlapping = 0
    for seed in range(20):
        chooser = random.Random(seed)
        order = graph.topological_order(unrolled, lambda ready: chooser.choice(ready))
        position = {(task.kind, task.layer, task.iteration): index for index, task in enumerate(order)}
        overlapping += position["forward", 0, 1] < position["update", -1, 0]     # its last update
    assert overlapping >= 10


def test_the_graph_keeps_the_hazards(source):
    solver = make_solver(source)
    net = solver.net
    unrolled = graph.build(net, 2)
    index = {name: i for i, name in enumerate(net.layer_names)}
    task = {(t.kind, t.layer, t.param, t.iteration): t for t in unrolled.tasks}
    conv_weights = task["backward_param", index["conv1"], 0, 0]
    # the weight gradient reads the data blob the next forward of the data layer overwrites
    assert conv_weights in unrolled.edges[task["forward", index["data"], -1, 1]]
    # in place: Scale's parameter gradients before its data gradient, which overwrites the top diff
    for k in (0, 1):
        assert task["backward_param", index["scale"], k, 0] in unrolled.edges[task["backward_data", index["scale"], -1, 0]]
    # the shared InnerProduct weight: ip_b's gradient is added before ip_a's, as in the sequential order
    assert task["backward_param", index["ip_b"], 0, 0] in unrolled.edges[task["backward_param", index["ip_a"], 0, 0]]
    # the next forward of a layer waits for the update of its parameters, which
    # waits for the parameter's gradient and the iteration's learning rate only
    conv1_weight = next(p for p, blob in enumerate(net.learnable_params) if blob is net.layers[index["conv1"]].blobs[0])
    update = task["update", -1, conv1_weight, 0]
    assert update in unrolled.edges[task["forward", index["conv1"], -1, 1]]
    assert {conv_weights, task["rate", -1, -1, 0]} <= unrolled.edges[update]
    assert {t.layer for t in unrolled.edges[update]} == {index["conv1"], -1}
    # the two branches' backward do not wait for each other
    a, b = task["backward_data", index["short"], -1, 0], task["backward_data", index["long1"], -1, 0]
    assert a not in unrolled.edges[b] and b not in unrolled.edges[a]


def test_clip_gradients_makes_the_rate_a_barrier(source):
    """clip_gradients scales every gradient by their global norm: the rate
    sub-task then waits for every gradient, and every update for it."""
    solver = make_solver(source)
    net = solver.net
    plain, clipped = graph.build(net, 1), graph.build(net, 1, clip=True)
    rate = graph.Task(graph.RATE)
    gradients = {t for t in plain.tasks if t.kind in (graph.BACKWARD_PARAM, graph.BACKWARD)
                 and net.layers[t.layer].blobs}
    assert not plain.edges[rate] and gradients <= set(graph.topological_order(
        graph.Graph(clipped.tasks, clipped.edges), lambda ready: ready[0])[:clipped.tasks.index(rate)])
    assert all(t.kind in (graph.BACKWARD_PARAM, graph.BACKWARD, graph.CLEAR) for t in clipped.edges[rate])
    assert all(rate in clipped.edges[t] for t in clipped.tasks if t.kind == graph.UPDATE)


@pytest.mark.slow
def test_without_one_derived_edge_some_order_differs(source, sequential):
    """Negative control: the data layer's next forward may then overwrite the
    batch before conv1's weight gradient of the iteration before has read it."""
    solver = make_solver(source)
    net = solver.net
    unrolled = graph.build(net, ITERATIONS)
    conv1, data = net.layer_names.index("conv1"), net.layer_names.index("data")
    edge = next((earlier, later) for later, before in unrolled.edges.items() for earlier in before
                if (earlier.kind, earlier.layer, earlier.param, earlier.iteration) == ("backward_param", conv1, 0, 0)
                and (later.kind, later.layer, later.iteration) == ("forward", data, 1))
    results = [run_in_random_order(make_solver(source), seed, drop=[edge]) for seed in range(20)]
    assert any(not all(np.array_equal(a, b) for a, b in zip(result, sequential)) for result in results)


def test_a_partitioned_layer_splits_its_backward_too(source, monkeypatch):
    """With every layer in 2 batch partitions, a convolution's backward is still
    a data-gradient and parameter-gradient sub-task each (run in the partitions'
    twins, which keep the forward state), and any order the edges allow gives
    the partitioned sequential weights bitwise (each parameter's partition
    parts are added in the same order as in the whole backward)."""
    monkeypatch.setenv("CCT_PARTITIONS", "2")
    solver = make_solver(source)
    net = solver.net
    convs = [i for i, layer in enumerate(net.layers) if layer.type == "Convolution"]
    assert convs and all(net.executor.partitions(i) == 2 for i in convs)
    kinds = {(task.layer, task.kind) for task in graph.iteration_tasks(net)}
    for i in convs:
        assert (i, graph.BACKWARD_DATA) in kinds or not any(net.bottom_need_backward[i])
        assert (i, graph.BACKWARD_PARAM) in kinds and (i, graph.BACKWARD) not in kinds
    partitioned_sequential = make_solver(source)
    partitioned_sequential.step(ITERATIONS)
    for seed in range(3):
        assert_same(run_in_random_order(make_solver(source), seed), weights(partitioned_sequential))


class RecordedSums:
    """A stand-in for the MPI gradient sums (distributed.GradientSum) of one
    rank: each unit's sum leaves the diffs as they are (a world of one) and
    is recorded, with the diffs it found."""

    def __init__(self, net, units):
        self.net, self.units, self.summed = net, units, []

    def unit_params(self):
        return self.units

    def sum_unit(self, number):
        self.summed.append((number, [self.net.learnable_params[p].diff.copy() for p in self.units[number]]))

    def wait(self, index=None, timed=True):
        """In the graph, the edges do the waiting."""


def test_gradient_sums_wait_for_their_gradients_and_each_update_for_its_own(source):
    solver = make_solver(source)
    net = solver.net
    count = len(net.learnable_params)
    units = [(p,) for p in reversed(range(2, count))] + [(0, 1)]     # the last a bucket of two
    unrolled = graph.build(net, 2, sums=units)
    sums = [[t for t in unrolled.tasks if t.kind == graph.SUM and t.iteration == k] for k in (0, 1)]
    assert [t.param for t in sums[0]] == list(range(len(units)))
    for unit, task in zip(units, sums[0]):
        writers = {t for t in unrolled.edges[task] if t.kind in (graph.BACKWARD_PARAM, graph.BACKWARD)}
        for p in unit:     # the last gradient sub-task adding into the parameter's diff
            last = [t for t in unrolled.tasks[:unrolled.tasks.index(task)]
                    if t.kind in (graph.BACKWARD_PARAM, graph.BACKWARD) and graph._diff(net.learnable_params[p])
                    in graph.accesses(net, t).writes][-1]
            assert last in writers
    # one order on every rank: each sum after the one before, across iterations too
    chain = sums[0] + sums[1]
    assert all(a in unrolled.edges[b] for a, b in zip(chain, chain[1:]))
    for task in unrolled.tasks:
        if task.kind == graph.UPDATE:
            waited = {t.param for t in unrolled.edges[task] if t.kind == graph.SUM}
            assert waited == {u for u, unit in enumerate(units) if task.param in unit}
    assert not any(t.kind == graph.SUM for t in unrolled.edges[graph.Task(graph.RATE)])
    clipped = graph.build(net, 1, sums=units, clip=True)
    assert set(sums[0]) <= clipped.edges[graph.Task(graph.RATE)]


@pytest.mark.parametrize("seed", range(5))
def test_any_order_with_the_sums_gives_the_same_weights_and_sums(source, sequential, seed):
    """The sums see each iteration's whole gradients, whatever the order."""
    solver = make_solver(source)
    units = [(p,) for p in reversed(range(len(solver.net.learnable_params)))]
    solver.gradient_sum = RecordedSums(solver.net, units)
    unrolled = graph.build(solver.net, ITERATIONS, sums=units)
    in_order = make_solver(source)
    in_order.gradient_sum = RecordedSums(in_order.net, units)
    chooser = random.Random(seed)
    run = graph.Runner(solver.net, solver.net.executor.steps(), SolverUpdates(solver))
    reference = graph.Runner(in_order.net, in_order.net.executor.steps(), SolverUpdates(in_order))
    for task in graph.topological_order(unrolled, lambda ready: chooser.choice(ready)):
        run(task)
    for task in unrolled.tasks:
        reference(task)
    assert_same(weights(solver), sequential)
    assert [n for n, _ in solver.gradient_sum.summed] == [n for n, _ in in_order.gradient_sum.summed]
    for (_, ours), (_, theirs) in zip(solver.gradient_sum.summed, in_order.gradient_sum.summed):
        assert_same(ours, theirs)


@pytest.mark.parametrize("seed", range(3))
def test_the_streams_run_the_sums_on_a_stream_of_their_own(source, sequential, seed):
    """The scheduler (cct.runtime.scheduler) runs the sums on a fourth stream,
    holding no cores, in the units' order, and the weights stay the
    sequential ones under random delays."""
    solver = make_solver(source)
    units = [(p,) for p in reversed(range(len(solver.net.learnable_params)))]
    solver.gradient_sum = RecordedSums(solver.net, units)
    schedule = scheduler.Schedule(solver.net, solver.net.executor.steps(), updates=SolverUpdates(solver),
                                  iterations=ITERATIONS)
    shaker = random.Random(seed)
    scheduler.run_on_streams(schedule) if seed == 0 else schedule.run(
        delay=lambda task: shaker.random() * 2e-4)
    assert_same(weights(solver), sequential)
    sums = [span for span in schedule.trace if span.task.kind == graph.SUM]
    assert schedule.stream_count == 4 and len(sums) == ITERATIONS * len(units)
    assert all(span.stream == scheduler.COMM_STREAM and span.threads == 0 for span in sums)
    assert [n for n, _ in solver.gradient_sum.summed] == list(range(len(units))) * ITERATIONS
