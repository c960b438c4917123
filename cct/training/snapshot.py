"""Snapshots: a solver's weights and state written the way Caffe writes them
(BINARYPROTO .caffemodel + .solverstate, or HDF5 .caffemodel.h5 +
.solverstate.h5), each file replaced atomically and durably, and restored
from (Caffe's Solver::Snapshot and Solver::Restore)."""
import logging
import os

import numpy as np

from cct.core.errors import ConfigError, WeightsError
from cct.formats import hdf5
from cct.formats.prototxt import atomic_path, atomic_write, read_binary
from cct.formats.weights import blob_pieces, blob_proto_to_array, field_pieces
from cct.proto import caffe_pb2

log = logging.getLogger("cct.training.solver")

_STATE_HISTORY = 3                        # SolverState.history


def filename(solver, extension):
    """The snapshot file of the solver's current iteration: PREFIX_iter_N.EXT."""
    return f"{solver.param.snapshot_prefix}_iter_{solver.iter}{extension}"

def write(solver):
    """Write the weights and the solver state; returns the state's path."""
    param = solver.param
    if not param.snapshot_prefix:
        raise ConfigError(f"{solver.source}: snapshot_prefix: needed to write a snapshot")
    hdf5 = param.snapshot_format == caffe_pb2.SolverParameter.HDF5
    if hdf5:
        model = filename(solver, ".caffemodel.h5")
        log.info("Snapshotting to HDF5 file %s", model)
        solver.net.save_hdf5(model, write_diff=param.snapshot_diff)
        state_path = filename(solver, ".solverstate.h5")
        log.info("Snapshotting solver state to HDF5 file %s", state_path)
        _write_state_hdf5(solver, state_path, model)
    else:
        model = filename(solver, ".caffemodel")
        log.info("Snapshotting to binary proto file %s", model)
        solver.net.save(model, write_diff=param.snapshot_diff)
        state_path = filename(solver, ".solverstate")
        log.info("Snapshotting solver state to binary proto file %s", state_path)
        # SolverState's fields in protobuf's order: iter (1), learned_net (2), history (3), current_step (4)
        pieces = [caffe_pb2.SolverState(iter=solver.iter, learned_net=model).SerializeToString()]
        for history in solver.history_blobs:
            pieces += field_pieces(_STATE_HISTORY, blob_pieces(history.read_data()))
        pieces.append(caffe_pb2.SolverState(current_step=solver.current_step).SerializeToString())
        atomic_write(state_path, pieces)
    return state_path

def _write_state_hdf5(solver, path, model):
    import h5py
    with atomic_path(path) as temp_path, h5py.File(temp_path, "w") as out:
        out.create_dataset("iter", data=np.array([solver.iter], np.int32))
        out.create_dataset("learned_net", data=np.bytes_(model.encode()))
        out.create_dataset("current_step", data=np.array([solver.current_step], np.int32))
        group = out.create_group("history")
        for index, history in enumerate(solver.history_blobs):
            group.create_dataset(str(index), data=history.read_data())

def restore(solver, state_file):
    """Continue from a .solverstate(.h5): iteration, step counter, history and
    the weights file it names (Caffe's Solver::Restore)."""
    state_file = os.fspath(state_file)
    if not os.path.isfile(state_file):
        raise ConfigError(f"{state_file}: solver state file not found")
    if state_file.endswith(".h5"):
        sizes = [history.size for history in solver.history]
        iteration, model, current_step, histories = _read_state_hdf5(state_file, sizes)
    else:
        state = read_binary(state_file, caffe_pb2.SolverState())
        iteration, current_step = state.iter, state.current_step
        model = state.learned_net if state.HasField("learned_net") else None
        try:
            histories = [blob_proto_to_array(h) for h in state.history]
        except WeightsError as error:
            raise ConfigError(f"{state_file}: history: {error}") from None
    if len(histories) != len(solver.history):
        raise ConfigError(f"{state_file}: has {len(histories)} history blobs, a {solver.type} solver "
                          f"on this net needs {len(solver.history)} (a state from another solver "
                          "type or net?)")
    for index, (ours, theirs) in enumerate(zip(solver.history, histories)):
        if theirs.size != ours.size:
            raise ConfigError(f"{state_file}: history[{index}] has shape {theirs.shape}, the "
                              f"parameter has shape {ours.shape}")
    if model:
        solver.net.copy_from(_locate_learned_net(model, state_file))
    for ours, theirs in zip(solver.history, histories):
        ours[...] = theirs.reshape(ours.shape)
    solver.iter, solver.current_step = int(iteration), int(current_step)

def _locate_learned_net(model, state_file):
    """As written (relative to the working folder, as Caffe reads it), else
    beside the state file: a run moved to another folder still resumes."""
    if isinstance(model, bytes):        # a string field holding bytes that are not UTF-8
        model = model.decode(errors="surrogateescape")
    if os.path.isfile(model):
        return model
    beside = os.path.join(os.path.dirname(state_file), os.path.basename(model))
    if os.path.isfile(beside):
        return beside
    raise ConfigError(f"{state_file}: learned_net: weight file {model!r} not found "
                      f"(nor beside the state file)")

def _read_state_hdf5(path, sizes):
    """(iteration, learned net, current step, histories); each history's size
    is checked against `sizes` (the solver's) before it is read."""
    with hdf5.reading(path, ConfigError, "HDF5 solver state") as state:
        iteration = _scalar(state, "iter", path)
        current_step = _scalar(state, "current_step", path) if "current_step" in state else 0
        model = None
        if "learned_net" in state:
            model = _text(state, "learned_net", path)
        group = hdf5.group(state, "history", ConfigError, path)
        if len(group) != len(sizes):
            return iteration, model, current_step, [None] * len(group)   # restore() says what is wrong
        histories = []
        for index, size in enumerate(sizes):
            values = hdf5.dataset(group, str(index), ConfigError, f"{path}: history")
            if values.size != size:
                raise ConfigError(f"{path}: history[{index}] has shape {values.shape}, the parameter "
                                  f"has {size} values")
            histories.append(np.asarray(values[()], np.float32))
    return iteration, model, current_step, histories


def _scalar(state, name, path):
    """An integer stored as one number (Caffe's hdf5_load_int)."""
    values = hdf5.dataset(state, name, ConfigError, path)
    if values.size != 1:
        raise ConfigError(f"{path}: '{name}' has shape {values.shape}, expected one integer")
    value = np.asarray(values[()]).ravel()[0]
    if not np.isfinite(value) or value != int(value) or not -2**31 <= value < 2**31:
        raise ConfigError(f"{path}: '{name}' is {value}, expected an int32")
    return int(value)


def _text(state, name, path):
    """A string stored as a scalar dataset of bytes (Caffe's hdf5_save_string)."""
    import h5py
    item = state[name]
    if not isinstance(item, h5py.Dataset) or item.shape != () or item.dtype.kind not in "SOU":
        raise ConfigError(f"{path}: '{name}' must be a string, got {item}")
    value = item[()]
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
