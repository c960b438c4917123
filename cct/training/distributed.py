"""Data-parallel training over MPI (mpi4py): `mpirun -np N cct train ...`
runs N solvers, one per process, that train one model as one solver of N
times the batch, as Caffe's multi-GPU solver does (NCCL there, MPI here):

    at the start     rank 0's weights (after weights: / --snapshot) go to every rank
    every iteration  each rank reads its own part of every data source
                     (Layer.set_shard), runs forward and backward on it; the
                     parameter gradients are summed over the ranks and scaled
                     by 1/N (Caffe's NCCL::on_gradients_ready), before the
                     solver clips, normalizes and regularizes them
    on rank 0 only   display (the loss averaged over the ranks), tests, snapshots

A process is one of several ranks when mpirun (OpenMPI's OMPI_COMM_WORLD_SIZE,
MPICH's PMI_SIZE) started it with more than one, or when the script itself
made an MPI world of more than one (mpi4py.MPI already imported). Nothing
here runs, and mpi4py is not imported, in a single process.
"""
import logging
import os
import queue
import sys
import threading
import time

import numpy as np

from cct.core.errors import ConfigError
from cct.core.rng import get_rng
from cct.runtime import settings as run_config

log = logging.getLogger("cct.training.solver")

# Variables an MPI launcher sets to the number of ranks it started.
SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
ACTION_CODES = {"none": 0, "snapshot": 1, "stop": 2}    # agreed as their maximum over the ranks

_world = None            # World, or False once a single process is known


def launched_size(environ=None):
    """The number of ranks the MPI launcher says it started (1 without one)."""
    environ = os.environ if environ is None else environ
    for name in SIZE_VARIABLES:
        value = environ.get(name, "").strip()
        if value:
            try:
                return int(value)
            except ValueError:
                raise ConfigError(f"environment: {name}={value!r} is not a number of MPI ranks") from None
    return 1


def world():
    """This process's MPI world when it is one of several ranks, else None."""
    global _world
    if _world is None:
        mpi_loaded = "mpi4py.MPI" in sys.modules
        if launched_size() > 1 or (mpi_loaded and sys.modules["mpi4py.MPI"].COMM_WORLD.Get_size() > 1):
            _world = World(_comm_world())
        else:
            _world = False
    return _world or None


def running():
    """The world if this process has joined one of several ranks, else None
    (without importing mpi4py)."""
    return _world or None


def _comm_world():
    # A rank waiting in MPI (its gradient-sum thread, or for a slower rank)
    # polls on the cores backward needs: OpenMPI then yields them (read at MPI's start).
    os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    try:
        from mpi4py import MPI
    except ImportError:
        raise ConfigError(f"started by an MPI launcher with {launched_size()} ranks, but mpi4py is not "
                          "installed: pip install 'cct[mpi]' (needs an MPI library, e.g. Debian's "
                          "openmpi-bin libopenmpi-dev)") from None
    return MPI.COMM_WORLD


class World:
    """The ranks training together: collective operations on numpy arrays."""

    def __init__(self, comm):
        from mpi4py import MPI
        self._mpi = MPI
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.is_root = self.rank == 0
        # gradients summed on a thread of their own need MPI calls from two threads
        self.threads_allowed = MPI.Query_thread() >= MPI.THREAD_MULTIPLE

    def broadcast_arrays(self, arrays):
        """Every array (in place) gets rank 0's values."""
        for array in arrays:
            if array.flags.c_contiguous:
                self.comm.Bcast(array, root=0)
            else:                            # a view: MPI needs one contiguous buffer
                copy = np.ascontiguousarray(array)
                self.comm.Bcast(copy, root=0)
                array[...] = copy

    def spans_hosts(self):
        """Whether some ranks run on other hosts than this one's: sums then wait
        on the network, which overlap hides; on one host they are copies and
        additions on the cores backward needs, and overlap gained nothing
        measurable there (bench/bench_mpi.py)."""
        local = self.comm.Split_type(self._mpi.COMM_TYPE_SHARED)
        spans = local.Get_size() < self.size
        local.Free()
        return self.comm.allreduce(spans, op=self._mpi.LOR)

    def broadcast(self, value):
        """Rank 0's `value` (any picklable object)."""
        return self.comm.bcast(value, root=0)

    def agree(self, loss, action):
        """(the mean of the ranks' losses, the action every rank takes): a stop
        or snapshot request (SIGINT, SIGHUP) that reached any rank reaches all,
        at the same iteration, so no rank waits for one that has stopped."""
        values = np.array([loss, ACTION_CODES[action]], np.float64)
        self.comm.Allreduce(self._mpi.IN_PLACE, values[:1], op=self._mpi.SUM)
        self.comm.Allreduce(self._mpi.IN_PLACE, values[1:], op=self._mpi.MAX)
        code = int(values[1])
        return float(values[0]) / self.size, next(a for a, c in ACTION_CODES.items() if c == code)

    def abort(self, code=1):
        """End every rank (a failed rank would otherwise leave the others
        waiting in a collective forever)."""
        self.comm.Abort(code)


class GradientSum:
    """Sums each learnable parameter's gradient over the ranks and scales it
    by 1/N, in place, before the update (Caffe's NCCL::on_gradients_ready):
    N ranks of batch b then update as one of batch N*b, whose loss layers
    average over N*b. The sums go over a communicator of their own, in the
    backward's order, the same on every rank, so the ranks' sums pair up.

    overlap False: all at once when the gradients are ready (the solver's
    on_gradients_ready callback). True: a communication thread sums a
    parameter's gradient as soon as the backward of the last layer adding to
    it has run (after the last of iter_size passes), while the layers below
    run theirs; the update of a parameter waits for its own sum only (wait).
    The two give the same numbers. `overlap` may change between iterations
    (alike on every rank) where MPI allows threads (`threads`).
    `busy`: seconds spent summing; `exposed`: seconds the solver waited."""

    def __init__(self, world, net, passes, overlap, threads=True):
        self.comm, self._mpi = world.comm.Dup(), world._mpi
        self.params, self.passes = net.learnable_params, passes
        self.overlap = self._overlapping = overlap and threads
        self.scale = np.float32(1.0 / world.size)
        self.busy = self.exposed = 0.0
        self._queue = None
        if threads:
            self._start_thread(net)

    def _start_thread(self, net):
        self._ready_after = _last_layers(net)       # {layer index: learnable params it completes}
        self._passes_seen = {}
        self._done = [threading.Event() for _ in self.params]
        self._failure = None
        self._queue = queue.Queue()
        threading.Thread(target=self._sum_queued, name="cct-gradient-sum", daemon=True).start()
        net.executor.subscribe("after_backward", self._after_backward)

    def on_start(self):
        self._overlapping = self.overlap          # this iteration's way
        if self._overlapping:
            self._passes_seen.clear()
            for done in self._done:
                done.clear()

    def on_gradients_ready(self):
        if not self._overlapping:
            start = time.perf_counter()
            for index in range(len(self.params)):
                self._sum(index)
            self.exposed += time.perf_counter() - start

    def wait(self, index=None, timed=True):
        """Until parameter `index`'s sum (every one's: None) is in its diff."""
        if not self._overlapping:
            return
        start = time.perf_counter()
        for done in self._done if index is None else [self._done[index]]:
            done.wait()
        if self._failure is not None:
            raise self._failure
        if timed:
            self.exposed += time.perf_counter() - start

    def _sum(self, index):
        start = time.perf_counter()
        diff = self.params[index].diff
        self.comm.Allreduce(self._mpi.IN_PLACE, diff, op=self._mpi.SUM)
        diff *= self.scale
        self.busy += time.perf_counter() - start

    def _after_backward(self, layer_index):
        if not self._overlapping:
            return
        seen = self._passes_seen[layer_index] = self._passes_seen.get(layer_index, 0) + 1
        if seen == self.passes:
            for index in self._ready_after.get(layer_index, ()):
                self._queue.put(index)

    def close(self):
        """End the communication thread (it holds the net's parameters) and
        free the communicator; every rank closes its solver alike."""
        if self._queue is not None:
            self._queue.put(None)
            self._queue = None
        if self.comm is not None:
            self.comm.Free()
            self.comm = None

    def _sum_queued(self):
        queued = self._queue
        while True:
            index = queued.get()
            if index is None:
                return
            try:
                self._sum(index)
            except BaseException as error:       # the waiting update raises it
                self._failure = error
            self._done[index].set()


def _last_layers(net):
    """{layer index: the learnable parameters whose gradient is complete once
    that layer's backward has run}: the first layer (in forward order) of the
    layers sharing the parameter, as backward runs them last to first."""
    index_of = {_base_id(blob.diff): index for index, blob in enumerate(net.learnable_params)}
    first = {}
    for layer_index, layer in enumerate(net.layers):
        for blob in layer.blobs:
            first.setdefault(index_of[_base_id(blob.diff)], layer_index)
    completes = {}
    for param, layer_index in first.items():
        completes.setdefault(layer_index, []).append(param)
    return completes


def _base_id(array):
    """Which memory an array views (a shared parameter's blobs view one)."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return id(array)


def join(solver, world):
    """Make `solver` one of the world's ranks: rank 0's weights on every rank,
    each data layer of the train net reading its own shard, gradients summed
    before every update (solver.gradient_sum)."""
    _check_alike(solver, world)
    world.broadcast_arrays(_weights(solver.net))
    # One seed for every rank: shuffles then agree, so the shards stay disjoint.
    # Drawn from rank 0's seeded stream: a run with random_seed repeats.
    seed = world.broadcast(int(get_rng().integers(2**63)) if world.is_root else None)
    for layer in solver.net.layers:
        layer.set_shard(world.rank, world.size, seed)
    overlap = run_config.mpi_overlap()
    if overlap is None:
        overlap = world.spans_hosts()
    solver.gradient_sum = GradientSum(world, solver.net, solver.param.iter_size, overlap, world.threads_allowed)
    solver.callbacks.insert(0, (solver.gradient_sum.on_start, solver.gradient_sum.on_gradients_ready))
    log.info("MPI: %d ranks, each of batch %d x iter_size %d; gradients summed %s", world.size,
             solver._batch_size(solver.net), solver.param.iter_size,
             "during backward" if solver.gradient_sum.overlap else "after backward")


def _check_alike(solver, world):
    """Every rank must train the same net at the same batch (their sums would
    pair up parameters of other shapes, or weigh batches unequally): each
    rank compares every rank's with rank 0's, so all raise the same error."""
    net = solver.net
    mine = {"batch size": solver._batch_size(net), "iter_size": solver.param.iter_size,
            "parameters": [f"{name}[{i}] {tuple(blob.shape)}" for name, blobs in net.params.items()
                           for i, blob in enumerate(blobs)]}
    every = world.comm.allgather(mine)
    for rank, theirs in enumerate(every):
        difference = _difference(theirs, every[0])
        if difference:
            raise ConfigError(f"{solver.source}: MPI rank {rank} trains with {difference}: every rank "
                              "needs the same net at the same batch")


def _difference(theirs, root):
    """What differs between two ranks' nets, as 'X, rank 0 with Y', or None."""
    for key, value in theirs.items():
        if key == "parameters" and value != root[key]:
            pairs = [(a, b) for a, b in zip(value, root[key]) if a != b]
            ours, first = pairs[0] if pairs else (f"{len(value)} parameters", f"{len(root[key])}")
            return f"{ours}, rank 0 with {first}"
        if value != root[key]:
            return f"{key} {value}, rank 0 with {root[key]}"
    return None


def share_state(solver, world):
    """After rank 0 restored a snapshot: its iteration, step count, history
    and weights on every rank (only rank 0 reads the files, so the other
    hosts need no copy of them)."""
    solver.iter, solver.current_step = world.broadcast((solver.iter, solver.current_step))
    world.broadcast_arrays(solver.history)
    world.broadcast_arrays(_weights(solver.net))


def _weights(net):
    """Every parameter blob's data (learnable or not, such as BatchNorm's statistics)."""
    return [blob.data for layer in net.layers for blob in layer.blobs]
