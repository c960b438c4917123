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

from cct.core import settings as table
from cct.core.errors import ConfigError
from cct.core.rng import get_rng
from cct.runtime import settings as run_config
from cct.training import nets

log = logging.getLogger("cct.training.solver")

# Variables an MPI launcher sets to the number of ranks it started.
SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
ACTION_CODES = {"none": 0, "snapshot": 1, "stop": 2}    # agreed as their maximum over the ranks
BUCKET_ENV = "CCT_MPI_BUCKET"
# The gradient sums' bucket size (GradientSum; CCT_MPI_BUCKET overrides): pieces of about a cache's size beat both
# many small Allreduces and one 151 MB fc6 (BENCHMARKS.md, "Behind cct/training/distributed.py").
BUCKET_BYTES = table.BY_NAME["mpi_bucket"].default

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

    def agree(self, losses, action):
        """(the ranks' mean of each of `losses`, the action every rank takes):
        a stop or snapshot request (SIGINT, SIGHUP) that reached any rank
        reaches all, at the same iteration, so no rank waits for one that
        has stopped."""
        values = np.array(list(losses) + [ACTION_CODES[action]], np.float64)
        self.comm.Allreduce(self._mpi.IN_PLACE, values[:-1], op=self._mpi.SUM)
        self.comm.Allreduce(self._mpi.IN_PLACE, values[-1:], op=self._mpi.MAX)
        code = int(values[-1])
        return [float(value) / self.size for value in values[:-1]], next(
            a for a, c in ACTION_CODES.items() if c == code)

    def slowest(self, seconds):
        """The largest of the ranks' `seconds`."""
        return self.comm.allreduce(seconds, op=self._mpi.MAX)

    def abort(self, code=1):
        """End every rank (a failed rank would otherwise leave the others
        waiting in a collective forever)."""
        self.comm.Abort(code)


class GradientSum:
    """Sums each learnable parameter's gradient over the ranks and scales it
    by 1/N, in place, before the update (Caffe's NCCL::on_gradients_ready):
    N ranks of batch b then update as one of batch N*b, whose loss layers
    average over N*b. The sums go over a communicator of their own.

    The unit of a sum (one Allreduce) is a bucket (plan_units): parameters
    of at most `bucket` bytes gathered, in the order backward completes
    them, until they hold `bucket` bytes (one call instead of several: on
    small sums the call's latency dominates), and a larger parameter cut
    into pieces of at most `bucket` bytes (so its sum does not hold up the
    layers below). Each element is summed alone, so the buckets change no
    number (of 2 ranks bitwise; of more, MPI may pick another reduction
    order for another message size).

    Where the solver runs iterations on the streams (cct.runtime.scheduler),
    each unit's sum is a sub-task of the graph (sum_unit, unit_params): it
    starts once the gradient sub-tasks writing its parameters have ended,
    and the units go in their order on every rank. Where it runs them
    layer after layer:

    overlap False: all at once when the gradients are ready (the solver's
    on_gradients_ready callback), units in order. True: a communication
    thread sums a unit as soon as the backward of the last layer adding to
    its parameters has run (after the last of iter_size passes), while the
    layers below run theirs; the update of a parameter waits for its own
    sums only (wait, summed_order). Of the units ready on every rank, the
    one the next forward needs first goes first (reuse distance, TurboDL:
    the lowest layer; _next_unit). Blocking collectives must be issued in
    one order on every rank, so the ranks agree on which units are ready
    before each sum (an Allreduce of a byte per unit, their minimum): the
    choice is then a function of what every rank knows, whatever each
    one's timing. The two give the same numbers. `overlap` may change
    between iterations (alike on every rank) where MPI allows threads
    (`threads`). `busy`: seconds spent summing; `exposed`: seconds the
    solver waited. `trace`: None, or a list to which the thread appends
    (unit, the units it chose from) per sum.
    """

    def __init__(self, world, net, passes, overlap, threads=True, bucket=None):
        self.comm, self._mpi = world.comm.Dup(), world._mpi
        self.params, self.passes = net.learnable_params, passes
        self.overlap = self._overlapping = overlap and threads
        self.scale = np.float32(1.0 / world.size)
        self.busy = self.exposed = 0.0
        self.trace = None
        self.bucket = bucket_bytes() if bucket is None else bucket
        completes = _last_layers(net)
        ready_order = [index for layer in sorted(completes, reverse=True) for index in completes[layer]]
        self.units = plan_units(self.params, ready_order, self.bucket)
        first_layer = {index: layer for layer, indices in completes.items() for index in indices}
        # reuse distance: the lowest first layer of its parameters, then its place
        self._priority = [(min(first_layer[index] for index, _, _ in unit), number)
                          for number, unit in enumerate(self.units)]
        self._buffers = [None if len(unit) == 1 else          # a bucket's: one contiguous buffer
                         np.empty(sum(end - begin for _, begin, end in unit), self.params[unit[0][0]].diff.dtype)
                         for unit in self.units]
        self._units_of = [[] for _ in self.params]        # {parameter: the units holding part of it}
        for number, unit in enumerate(self.units):
            for index, _, _ in unit:
                self._units_of[index].append(number)
        self._completes = completes
        self._queue = None
        if threads:
            self._start_thread(net)

    def _start_thread(self, net):
        self._passes_seen = {}
        self._done = [threading.Event() for _ in self.params]
        self._finished = []                       # parameters whose sums are in, in that order
        self._finished_changed = threading.Condition()
        self._failure = None
        self._queue = queue.Queue()
        threading.Thread(target=self._sum_queued, name="cct-gradient-sum", daemon=True).start()
        net.executor.subscribe("after_backward", self.after_backward)

    def unit_params(self):
        """Per unit, the learnable parameters (indices) it holds part of."""
        return [tuple(dict.fromkeys(index for index, _, _ in unit)) for unit in self.units]

    def on_window(self):
        """Iterations on the streams follow: their graph orders the sums, so
        nothing waits here (wait, summed_order) until the next on_start."""
        self._overlapping = False

    def on_start(self):
        self._overlapping = self.overlap          # this iteration's way
        if self._overlapping:
            self._passes_seen.clear()
            self._missing = [len(unit) for unit in self.units]          # parameters each unit waits for
            self._unsummed = [len(units) for units in self._units_of]   # units each parameter waits for
            with self._finished_changed:
                self._finished.clear()
            for done in self._done:
                done.clear()

    def on_gradients_ready(self):
        if not self._overlapping:
            start = time.perf_counter()
            for number in range(len(self.units)):
                self.sum_unit(number)
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

    def summed_order(self, timed=True):
        """Every parameter index once, each as soon as its sum is in: the
        update starts with the parameters whose sums finished (in index
        order without overlap). Each parameter's update is its own, so any
        order gives the same numbers."""
        if not self._overlapping:
            yield from range(len(self.params))
            return
        for position in range(len(self.params)):
            start = time.perf_counter()
            with self._finished_changed:
                while len(self._finished) <= position and self._failure is None:
                    self._finished_changed.wait()
                if self._failure is not None:
                    raise self._failure
                index = self._finished[position]
            if timed:
                self.exposed += time.perf_counter() - start
            yield index

    def sum_unit(self, number):
        """Unit `number`'s Allreduce, scaled: in place where it is one piece of
        one parameter, else through its bucket's buffer (also a sub-task of
        the streams' graph)."""
        start = time.perf_counter()
        pieces = [self._flat(index)[begin:end] for index, begin, end in self.units[number]]
        buffer = self._buffers[number]
        if buffer is None:
            buffer = pieces[0]
        else:
            np.concatenate(pieces, out=buffer)
        self.comm.Allreduce(self._mpi.IN_PLACE, buffer, op=self._mpi.SUM)
        buffer *= self.scale
        if buffer is not pieces[0]:
            at = 0
            for piece in pieces:
                piece[...] = buffer[at:at + piece.size]
                at += piece.size
        self.busy += time.perf_counter() - start

    def _flat(self, index):
        """Parameter `index`'s diff as one axis: a view (never a copy, which
        the sum would not reach), of the diff it has now."""
        flat = self.params[index].diff.view()
        flat.shape = (-1,)
        return flat

    def after_backward(self, layer_index):
        """The executor's after_backward callback: under overlap, queues the
        units whose last parameter this layer's backward completed."""
        if not self._overlapping:
            return
        seen = self._passes_seen[layer_index] = self._passes_seen.get(layer_index, 0) + 1
        if seen == self.passes:
            for index in self._completes.get(layer_index, ()):
                for number in self._units_of[index]:
                    self._missing[number] -= 1
                    if self._missing[number] == 0:
                        self._queue.put(number)

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
        """The communication thread: an iteration's units, each once every
        rank has it ready, by reuse distance (_next_unit)."""
        try:
            while self._sum_iteration():
                pass
        except BaseException as error:             # the waiting update raises it
            self._failure = error
            for done in self._done:
                done.set()
            with self._finished_changed:
                self._finished_changed.notify_all()

    def _sum_iteration(self):
        """One iteration's sums; False once closed."""
        count = len(self.units)
        if not count:                               # nothing to sum, ever: until closed
            self._queue.get()
            return False
        ready = np.zeros(count, np.uint8)           # here
        agreed = np.zeros(count, np.uint8)          # on every rank (the minimum)
        summed = np.zeros(count, bool)
        for _ in range(count):
            while True:
                if not (agreed.astype(bool) & ~summed).any() and (ready == agreed).all():
                    number = self._queue.get()      # nothing to sum before more is ready here
                    if number is None:
                        return False
                    ready[number] = 1
                while not self._queue.empty():
                    number = self._queue.get_nowait()
                    if number is None:
                        return False
                    ready[number] = 1
                agreed[...] = ready                 # the same decision on every rank
                self.comm.Allreduce(self._mpi.IN_PLACE, agreed, op=self._mpi.MIN)
                choice = self._next_unit(agreed.astype(bool) & ~summed)
                if choice is not None:
                    break
            self.sum_unit(choice)
            summed[choice] = True
            self._summed(choice)
        return True

    def _next_unit(self, candidates):
        """Of the units every rank has ready and none has summed, the one the
        next forward needs first (its lowest layer), or None."""
        numbers = np.flatnonzero(candidates).tolist()
        if not numbers:
            return None
        choice = min(numbers, key=self._priority.__getitem__)
        if self.trace is not None:
            self.trace.append((choice, numbers))
        return choice

    def _summed(self, number):
        for index, _, _ in self.units[number]:
            self._unsummed[index] -= 1
            if self._unsummed[index] == 0:
                self._done[index].set()
                with self._finished_changed:
                    self._finished.append(index)
                    self._finished_changed.notify_all()


def plan_units(params, order, bucket):
    """The sums' units: lists of pieces (parameter index, first, end element
    of its flattened diff). Parameters taken in `order` (as backward
    completes them): one of more than `bucket` bytes is cut into equal
    pieces of at most `bucket` bytes, each a unit; the others gather into a
    bucket until it holds `bucket` bytes (of one dtype). bucket 0: each
    parameter whole, alone."""
    units, open_bucket, held = [], [], 0
    for index in order:
        diff = params[index].diff
        size, item = diff.size, diff.itemsize
        if bucket <= 0:
            units.append([(index, 0, size)])
            continue
        if size * item > bucket:
            count = -(-size * item // bucket)
            bounds = [size * k // count for k in range(count + 1)]
            units.extend([(index, begin, end)] for begin, end in zip(bounds, bounds[1:]))
            continue
        if open_bucket and params[open_bucket[0][0]].diff.dtype != diff.dtype:
            units.append(open_bucket)
            open_bucket, held = [], 0
        open_bucket.append((index, 0, size))
        held += size * item
        if held >= bucket:
            units.append(open_bucket)
            open_bucket, held = [], 0
    if open_bucket:
        units.append(open_bucket)
    return units


def bucket_bytes(environ=None):
    """The sums' bucket size in bytes: the mpi_bucket knob (CCT_MPI_BUCKET:
    bytes, or with a K or M suffix: KiB, MiB; 0: each parameter alone);
    `environ` in place of the process's environment."""
    return table.value("mpi_bucket", environ=environ)


def _last_layers(net):
    """{layer index: the learnable parameters whose gradient is complete once
    that layer's backward has run}: the first layer (in forward order) of the
    layers sharing the parameter, as backward runs them last to first."""
    completes = {}
    for param, layers in enumerate(net.learnable_param_layers()):
        completes.setdefault(layers[0], []).append(param)
    return completes


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
             nets.batch_size(solver.net), solver.param.iter_size,
             "during backward" if solver.gradient_sum.overlap else "after backward")


def _check_alike(solver, world):
    """Every rank must train the same net at the same batch (their sums would
    pair up parameters of other shapes, or weigh batches unequally): each
    rank compares every rank's with rank 0's, so all raise the same error."""
    net = solver.net
    mine = {"batch size": nets.batch_size(net), "iter_size": solver.param.iter_size,
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
