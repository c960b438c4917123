"""TurboDL's Algorithm 1 (cct.runtime.critical_path) on nets written out as
prototxt: blocks from fork to merge, branches by distance, priorities
p / p - alpha / p - beta, and a stream count that does not grow with depth."""
import pytest
from google.protobuf import text_format

import cct
from cct.proto import caffe_pb2
from cct.runtime import critical_path, graph, scheduler
from helpers.nets import INCEPTION, INPUT, chain, conv, head, relu, resnet

def make(text):
    cct.set_random_seed(1)
    return cct.Net(text_format.Parse(text, caffe_pb2.NetParameter()), cct.TRAIN)


def names(net, layers):
    return [net.layer_names[i] for i in layers]


def layer(net, name):
    return net.layer_names.index(name)


def priorities(net, times=None):
    """{(kind, layer name, param): priority}, each sub-task timed 1 s unless `times` says."""
    base = scheduler.Schedule(net, net.executor.steps())
    given = {task: (times or {}).get(net.layer_names[task.layer], 1.0) for task in base.tasks}
    schedule = scheduler.Schedule(net, net.executor.steps(), alpha=0.25, beta=0.5, times=given)
    return {(task.kind, net.layer_names[task.layer], task.param): schedule.priority[task]
            for task in schedule.tasks}, schedule


def test_a_chain_has_no_block_one_priority_and_one_stream_per_sub_task_type():
    net = make(chain(3))
    assert critical_path.blocks(net, {}) == []
    priority, schedule = priorities(net)
    data = {value for (kind, _, _), value in priority.items()
            if kind in (graph.BACKWARD_DATA, graph.BACKWARD)}
    weights = {value for (kind, _, param), value in priority.items() if kind == graph.BACKWARD_PARAM and param == 0}
    biases = {value for (kind, _, param), value in priority.items() if kind == graph.BACKWARD_PARAM and param == 1}
    assert data == {0.0} and weights == {-0.25} and biases == {-0.5}
    assert {scheduler.stream_of(task) for task in schedule.tasks} == {
        scheduler.DATA_STREAM, scheduler.WEIGHT_STREAM, scheduler.OTHER_STREAM}


@pytest.mark.parametrize("longest", ["b3x3", "b5x5", "pool_proj"])
def test_the_longest_inception_branch_by_given_times_gets_the_highest_priority(longest):
    net = make(INCEPTION)
    times = {name: 1.0 for name in net.layer_names}
    times[longest] = 10.0
    [block] = critical_path.blocks(net, {layer(net, name): t for name, t in times.items()})
    assert net.layers[block.fork].type == "Split" and names(net, [block.merge]) == ["concat"]
    by_branch = [names(net, branch.layers) for branch in block.branches]
    assert longest in by_branch[0]
    assert sorted(map(tuple, by_branch)) == sorted([
        ("b1x1",), ("b3x3_reduce", "relu_b3x3_reduce", "b3x3"), ("b5x5_reduce", "b5x5"), ("pool", "pool_proj")])
    distances = [branch.distance for branch in block.branches]
    assert distances == sorted(distances, reverse=True)
    priority, _ = priorities(net, times)
    first = {kind_name: value for kind_name, value in priority.items() if kind_name[1] == longest}
    assert first[(graph.BACKWARD_DATA, longest, -1)] == 0.0
    others = [priority[(graph.BACKWARD_DATA, name, -1)] for name in ("b1x1", "b3x3", "b5x5", "pool_proj")
              if name != longest]
    assert sorted(others, reverse=True) == [-1.0, -2.0, -3.0]
    assert priority[(graph.BACKWARD_PARAM, longest, 0)] == -0.25


def test_a_residual_block_has_its_convolution_branch_and_an_empty_shortcut():
    net = make(resnet(1))
    [block] = critical_path.blocks(net, {i: 1.0 for i in range(len(net.layers))})
    assert net.layers[block.fork].type == "Split" and names(net, [block.merge]) == ["res0"]
    long, shortcut = block.branches
    assert names(net, long.layers) == ["res0_a", "res0_bn", "res0_scale", "relu_res0_a", "res0_b"]
    assert long.distance == 5.0 and shortcut.layers == () and shortcut.distance == 0.0
    priority, _ = priorities(net)
    assert priority[(graph.BACKWARD_DATA, "res0_b", -1)] == priority[(graph.BACKWARD, "res0", -1)] == 0.0


def test_a_projection_shortcut_is_the_second_branch():
    net = make(resnet(1, projection=True))
    [block] = critical_path.blocks(net, {i: 1.0 for i in range(len(net.layers))})
    assert [names(net, branch.layers) for branch in block.branches][1] == ["res0_proj"]
    priority, _ = priorities(net)
    assert priority[(graph.BACKWARD_DATA, "res0_proj", -1)] == -1.0
    assert priority[(graph.BACKWARD_PARAM, "res0_proj", 0)] == -1.25


def test_a_trunk_forking_into_two_losses_merges_at_the_end_and_the_trunk_goes_first():
    text = (INPUT + conv("stem", "data") + relu("stem") + conv("deep1", "stem") + conv("deep2", "deep1")
            + head("deep2") + head("stem", name="aux"))
    net = make(text)
    [block] = critical_path.blocks(net, {i: 1.0 for i in range(len(net.layers))})
    assert block.merge is critical_path.END
    trunk, aux = [names(net, branch.layers) for branch in block.branches]
    assert trunk == ["deep1", "deep2", "ip_loss", "loss"] and aux == ["ip_aux", "aux"]
    priority, _ = priorities(net)
    assert priority[(graph.BACKWARD_DATA, "ip_aux", -1)] == -1.0 and priority[(graph.BACKWARD_DATA, "deep1", -1)] == 0.0


@pytest.mark.parametrize("depth", [1, 4, 8])
def test_stream_count_and_priority_levels_do_not_grow_with_depth(depth):
    net = make(resnet(depth, projection=True))
    blocks = critical_path.blocks(net, {i: 1.0 for i in range(len(net.layers))})
    assert len(blocks) == depth
    priority, schedule = priorities(net)
    assert len({scheduler.stream_of(task) for task in schedule.tasks}) == 3
    assert set(priority.values()) <= {0.0, -0.25, -0.5, -1.0, -1.25, -1.5}
