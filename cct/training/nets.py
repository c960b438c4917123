"""The solver's nets: the train net and the test nets a SolverParameter
names (Caffe's Solver::InitTrainNet and InitTestNets), built with their
NetStates, and the weights its `weights` field loads into them."""
import logging
import os

from cct.core.errors import ConfigError
from cct.core.layer import TEST, TRAIN
from cct.core.net import Net
from cct.formats.prototxt import read_net
from cct.proto import caffe_pb2

log = logging.getLogger("cct.training.solver")


def read_net_file(source, field, path):
    """Caffe reads net files relative to the working folder, not the solver's."""
    if not os.path.isfile(path):
        hint = ""
        beside = os.path.join(os.path.dirname(os.path.abspath(source)), path)
        if not os.path.isabs(path) and os.path.isfile(beside):
            hint = (f"; it exists beside the solver file ({beside}): run from that folder, "
                    "as Caffe resolves it against the working folder")
        raise ConfigError(f"{source}: {field}: net file '{path}' not found "
                          f"(working folder {os.getcwd()}){hint}")
    return read_net(path)


def train_net(param, source):
    """The train net of the solver `param` (read from `source`)."""
    fields = [f for f in ("net", "net_param", "train_net", "train_net_param") if param.HasField(f)]
    if len(fields) != 1:
        problem = "none" if not fields else ", ".join(fields)
        raise ConfigError(f"{source}: give the train net in exactly one of net, net_param, "
                          f"train_net, train_net_param; got {problem}")
    field = fields[0]
    if field in ("net", "train_net"):
        network = getattr(param, field)                 # a path: the net's errors name the file
        net_param = read_net_file(source, field, network)
        log.info("Creating training net from %s file: %s", field, network)
    else:
        network = net_param = getattr(param, field)
        log.info("Creating training net specified in %s", field)
    state = caffe_pb2.NetState(phase=TRAIN)
    state.MergeFrom(net_param.state)
    state.MergeFrom(param.train_state)
    return make_net(network, state)


def test_nets(param, source):
    """The test nets of the solver `param`, one per test_iter."""
    _check_test_fields(param, source)
    num_instances = len(param.test_iter)
    sources = []                                   # (description, network, NetParameter)
    for net_param in param.test_net_param:
        sources.append(("test_net_param", net_param, net_param))
    for path in param.test_net:
        sources.append((f"test_net file: {path}", path, read_net_file(source, "test_net", path)))
    remaining = num_instances - len(sources)
    if param.HasField("net_param"):
        sources += [("net_param", param.net_param, param.net_param)] * remaining
    elif param.HasField("net") and remaining:
        net_param = read_net_file(source, "net", param.net)
        sources += [(f"net file: {param.net}", param.net, net_param)] * remaining
    nets = []
    for index, (description, network, net_param) in enumerate(sources):
        state = caffe_pb2.NetState(phase=TEST)
        state.MergeFrom(net_param.state)
        if len(param.test_state):
            state.MergeFrom(param.test_state[index])
        log.info("Creating test net (#%d) specified by %s", index, description)
        nets.append(make_net(network, state))
    return nets


def _check_test_fields(param, source):
    generic = [f for f in ("net", "net_param") if param.HasField(f)]
    if len(generic) > 1:
        raise ConfigError(f"{source}: give net or net_param, not both")
    num_given = len(param.test_net_param) + len(param.test_net)
    if generic and len(param.test_iter) < num_given:
        raise ConfigError(f"{source}: test_iter: give one per test net ({num_given}), "
                          f"got {len(param.test_iter)}")
    if not generic and len(param.test_iter) != num_given:
        raise ConfigError(f"{source}: test_iter: give one per test net ({num_given}), "
                          f"got {len(param.test_iter)}")
    num_instances = len(param.test_iter)
    if len(param.test_state) and len(param.test_state) != num_instances:
        raise ConfigError(f"{source}: test_state: give none or one per test net "
                          f"({num_instances}), got {len(param.test_state)}")
    if num_instances and param.test_interval <= 0:
        raise ConfigError(f"{source}: test_interval: must be > 0 when test nets are given "
                          f"(test_iter), got {param.test_interval}")
    for index, count in enumerate(param.test_iter):
        if count < 0:
            raise ConfigError(f"{source}: test_iter[{index}]: must be >= 0, got {count}")


def make_net(network, state):
    if isinstance(network, caffe_pb2.NetParameter):
        net_param = caffe_pb2.NetParameter()
        net_param.CopyFrom(network)
        net_param.state.CopyFrom(state)
        network = net_param
    return Net(network, state.phase, level=state.level, stages=tuple(state.stage))


def load_weights(param, net):
    """The weights files the solver's `weights` field names (comma-separated), in order."""
    for entry in param.weights:
        for path in filter(None, (p.strip() for p in entry.split(","))):
            log.info("Loading weights from %s", path)
            net.copy_from(path)


def batch_size(net):
    """Images per forward: the first axis of the first layer's first top."""
    for tops in net.top_vecs:
        if tops and tops[0].shape:
            return tops[0].shape[0]
    return 0
