"""Snapshots: a solver's weights and state written the way Caffe writes them
(BINARYPROTO .caffemodel + .solverstate, or HDF5 .caffemodel.h5 +
.solverstate.h5), each file replaced atomically and durably, and restored
from (Caffe's Solver::Snapshot and Solver::Restore)."""
import logging
import os

import numpy as np

from cct.core.errors import ConfigError, WeightsError
from cct.formats.prototxt import atomic_path, atomic_write, read_binary
from cct.formats.weights import array_to_blob_proto, blob_proto_to_array
from cct.proto import caffe_pb2

log = logging.getLogger("cct.training.solver")


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
        state = caffe_pb2.SolverState(iter=solver.iter, learned_net=model, current_step=solver.current_step)
        for history in solver.history:
            state.history.add().CopyFrom(array_to_blob_proto(history))
        atomic_write(state_path, state.SerializeToString())
    return state_path

def _write_state_hdf5(solver, path, model):
    import h5py
    with atomic_path(path) as temp_path, h5py.File(temp_path, "w") as out:
        out.create_dataset("iter", data=np.array([solver.iter], np.int32))
        out.create_dataset("learned_net", data=np.bytes_(model.encode()))
        out.create_dataset("current_step", data=np.array([solver.current_step], np.int32))
        group = out.create_group("history")
        for index, history in enumerate(solver.history):
            group.create_dataset(str(index), data=history)

def restore(solver, state_file):
    """Continue from a .solverstate(.h5): iteration, step counter, history and
    the weights file it names (Caffe's Solver::Restore)."""
    state_file = os.fspath(state_file)
    if not os.path.isfile(state_file):
        raise ConfigError(f"{state_file}: solver state file not found")
    if state_file.endswith(".h5"):
        iteration, model, current_step, histories = _read_state_hdf5(state_file)
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
    if os.path.exists(model):
        return model
    beside = os.path.join(os.path.dirname(state_file), os.path.basename(model))
    if os.path.exists(beside):
        return beside
    raise ConfigError(f"{state_file}: learned_net: weight file '{model}' not found "
                      f"(nor beside the state file)")

def _read_state_hdf5(path):
    import h5py
    try:
        with h5py.File(path, "r") as state:
            iteration = int(np.asarray(state["iter"][()]).ravel()[0])
            current_step = (int(np.asarray(state["current_step"][()]).ravel()[0])
                            if "current_step" in state else 0)
            model = None
            if "learned_net" in state:
                model = state["learned_net"][()]
                model = model.decode() if isinstance(model, bytes) else str(model)
            group = state["history"]
            histories = [np.asarray(group[str(i)][...], np.float32) for i in range(len(group))]
    except (OSError, KeyError) as error:
        raise ConfigError(f"{path}: not a readable HDF5 solver state: {error}") from None
    return iteration, model, current_step, histories
