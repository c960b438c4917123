"""Backward on streams (cct.runtime.scheduler): the same gradients, bitwise, as
the sequential backward, whatever the timing; one stream per sub-task type
whatever the depth; critical-path priorities that put the longest path first
and parameter gradients behind data gradients."""
import random

import numpy as np
import pytest
from google.protobuf import text_format

import cct
from cct.devices import blas as blas_module
from cct.proto import caffe_pb2
from cct.runtime import graph, scheduler
from helpers.nets import FORK_RESIDUAL
from helpers.schedules import loose

FILL = 'weight_filler { type: "gaussian" std: 0.2 } bias_filler { type: "gaussian" std: 0.1 }'
NET = f"""
name: "streams"
layer {{ name: "data" type: "Input" top: "data" top: "label"
  input_param {{ shape {{ dim: 4 dim: 3 dim: 8 dim: 8 }} shape {{ dim: 4 }} }} }}
{FORK_RESIDUAL}
layer {{ name: "ip" type: "InnerProduct" bottom: "sum" top: "ip" inner_product_param {{ num_output: 5 {FILL} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}
"""


def make_net():
    cct.set_random_seed(5)
    net = cct.Net(text_format.Parse(NET, caffe_pb2.NetParameter()), cct.TRAIN)
    rng = np.random.default_rng(2)
    net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].shape)
    net.blobs["label"].data[...] = [0, 4, 2, 1]
    net.forward()
    return net


def gradients(net):
    return ([blob.diff.copy() for blob in net.learnable_params]
            + [net.blobs[name].diff.copy() for name in net.blobs if name not in ("data", "label")])


pytestmark = pytest.mark.usefixtures("one_lowering_type")


@pytest.fixture
def sequential():
    net = make_net()
    net.backward()
    return gradients(net)


def assert_bitwise(ours, theirs):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert np.array_equal(a, b)


def test_streams_give_the_sequential_gradients(sequential):
    net = make_net()
    scheduler.run_on_streams(scheduler.Schedule(net, net.executor.steps()))
    assert_bitwise(gradients(net), sequential)


@pytest.mark.parametrize("seed", range(100))
def test_random_delays_on_every_stream_change_nothing(sequential, seed):
    net = make_net()
    shaker = random.Random(seed)
    loose(scheduler.Schedule(net, net.executor.steps())).run(delay=lambda task: shaker.random() * 2e-4)
    assert_bitwise(gradients(net), sequential)


def test_without_one_derived_edge_some_timing_differs(sequential):
    """Negative control: Scale runs in place, so its bias gradient must read
    the top diff before its data gradient overwrites it; without that edge,
    delaying the bias gradient changes it."""
    net = make_net()
    schedule = loose(scheduler.Schedule(net, net.executor.steps()))
    scale = net.layer_names.index("scale")
    bias_gradient = next(task for task in schedule.tasks if (task.kind, task.layer, task.param)
                         == (graph.BACKWARD_PARAM, scale, 1))
    data_gradient = next(task for task in schedule.tasks if (task.kind, task.layer) == (graph.BACKWARD_DATA, scale))
    assert bias_gradient in schedule.edges[data_gradient]
    schedule.edges[data_gradient].discard(bias_gradient)
    schedule.following[bias_gradient].remove(data_gradient)
    schedule.run(delay=lambda task: 0.05 if task == bias_gradient else 0.0)     # long enough under load
    assert not all(np.array_equal(a, b) for a, b in zip(gradients(net), sequential))


def test_one_stream_per_sub_task_type_whatever_the_depth():
    net = make_net()
    schedule = scheduler.Schedule(net, net.executor.steps())
    used = {scheduler.stream_of(task) for task in schedule.tasks}
    assert used == {scheduler.DATA_STREAM, scheduler.WEIGHT_STREAM, scheduler.OTHER_STREAM}
    assert all(scheduler.stream_of(task) == scheduler.WEIGHT_STREAM
               for task in schedule.tasks if task.kind == graph.BACKWARD_PARAM and task.param == 0)


def test_priorities_follow_the_critical_path():
    net = make_net()
    index = {name: i for i, name in enumerate(net.layer_names)}
    base = scheduler.Schedule(net, net.executor.steps())
    times = {task: 1.0 for task in base.tasks}              # every sub-task 1 s: paths count layers
    schedule = scheduler.Schedule(net, net.executor.steps(), alpha=0.25, beta=0.5, times=times)

    def priority(kind, name, param=-1):
        return next(schedule.priority[t] for t in schedule.tasks if (t.kind, t.layer, t.param) == (kind, index[name], param))
    # the long branch (two convolutions) outranks the short one by one step
    assert priority(graph.BACKWARD_DATA, "long2") == priority(graph.BACKWARD_DATA, "short") + 1
    # within a layer: data gradient p, weight gradient p - alpha, bias p - beta
    data = priority(graph.BACKWARD_DATA, "res")
    assert priority(graph.BACKWARD_PARAM, "res", 0) == data - 0.25
    assert priority(graph.BACKWARD_PARAM, "res", 1) == data - 0.5
    # along the chain and on each block's longest branch, one priority
    assert (priority(graph.BACKWARD_DATA, "ip") == data == priority(graph.BACKWARD_DATA, "long2")
            == priority(graph.BACKWARD, "relu1"))


def test_a_ready_sub_task_never_waits_behind_a_lower_priority_one():
    """From the trace: a sub-task handed to its stream while a higher-priority
    sub-task of the same stream was already ready is an inversion; there are none."""
    net = make_net()
    schedule = loose(scheduler.Schedule(net, net.executor.steps()))
    shaker = random.Random(3)
    schedule.run(delay=lambda task: shaker.random() * 3e-4)
    inversions = [(span.task, other.task) for span in schedule.trace for other in schedule.trace
                  if other.stream == span.stream and other.ready <= span.dispatched < other.dispatched
                  and schedule.priority[other.task] > schedule.priority[span.task]]
    assert len(schedule.trace) == len(schedule.tasks) and inversions == []


def test_sub_tasks_at_once_never_hold_more_cores_than_the_budget(monkeypatch):
    """From the trace of a streamed run at the real widths on two threads: at
    every sub-task's start, the widths of the sub-tasks running then add up
    to at most the budget, and those calling BLAS agree on its count."""
    from threadpoolctl import threadpool_limits
    monkeypatch.setattr(blas_module, "_blas", None)
    with threadpool_limits(limits=2, user_api="blas"):
        net = make_net()
        schedule = scheduler.Schedule(net, net.executor.steps())
        assert schedule.cores == 2
        shaker = random.Random(4)
        schedule.run(delay=lambda task: shaker.random() * 2e-4)
    for span in schedule.trace:
        running = [other.task for other in schedule.trace if other.dispatched <= span.dispatched < other.end]
        assert sum(schedule.widths[task][0] for task in running) <= schedule.cores
        assert len({schedule.widths[task][1] for task in running} - {None}) <= 1
