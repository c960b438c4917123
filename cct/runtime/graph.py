"""A net's training iterations as a graph of sub-tasks, with the edges derived
from what each sub-task reads and writes (TurboDL's sub-task split; the
scheduler that runs the graph on streams comes with it, issue 11).

Sub-tasks of one iteration, in the sequential reference order:

    clear(p)                 a learnable parameter's diff set to 0
    forward(i)               layer i forward (its loss tops' diffs set to their weights)
    backward_param(i, k)     parameter k's gradient of layer i (Layer.splits_backward)
    backward_data(i)         layer i's bottom gradients
    backward(i)              both, for a layer that does not split its backward
    sum(u)                   over MPI, unit u of the gradient sums (one Allreduce of
                             a bucket or piece of parameter diffs, scaled by 1/N:
                             cct.training.distributed.GradientSum); the sums share
                             one communicator, a resource every sum writes, so
                             they go in one order on every rank (MPI's collectives
                             must be issued alike): the units' order, the order
                             backward completes them
    rate                     the solver's learning rate for the iteration; with
                             clip_gradients it also scales every gradient by the
                             global norm, so it reads every diff: a barrier
                             between the last gradient and the first update
    update(p)                the solver's update of learnable parameter p

What a sub-task touches is derived from its layer's blobs by one rule, never
listed per layer type (`accesses`). A resource is a piece of memory: the
ndarray a blob's data or diff is a view of, so in-place tops, Flatten and
Reshape aliases, shared parameters and diffs sharing an arena are one resource
each without being told; plus each layer's own state (saved inputs, argmax,
data cursors) and the process's random stream for layers that draw from it
(Layer.draws_random). Reading a resource orders a sub-task after its last
writer; writing it orders a sub-task after the last writer and every reader
since; accumulating (+=, a parameter's gradient) counts as reading and writing,
so layers sharing a parameter add to its diff in the sequential order and the
sums are bitwise the sequential ones.

`build(net, iterations)` unrolls that many iterations, so the edges that cross
the iteration boundary are there too: a deferred weight gradient of layer i
reads layer i's bottom data, which the next iteration's forward of the layer
below overwrites (a write-after-read edge), and the next forward of a layer
reads parameters the update writes.
"""
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, Iterable, List, Optional, Protocol, Sequence, Set, Tuple

import numpy as np

from cct.core.arrays import Array, FloatArray
from cct.core.blob import Blob
from cct.core.settings import RunConfig
from cct.runtime.threads import run_all, workers

Net = Any                         # cct.core.net.Net, whose executor imports this module: not imported back
Resource = Tuple[Hashable, ...]   # a piece of memory ("memory", id), a layer's ("state", i), LOOP, ...
Sums = Sequence[Sequence[int]]    # per unit of the MPI gradient sums, the learnable parameters it holds
Width = Tuple[int, Optional[int]]     # (cores, BLAS count) a sub-task runs at; None: the count as it is

CLEAR, FORWARD, BACKWARD_PARAM, BACKWARD_DATA, BACKWARD, SUM, RATE, UPDATE = (
    "clear", "forward", "backward_param", "backward_data", "backward", "sum", "rate", "update")
LOOP: Resource = ("loop",)            # the training loop's learning rate, iteration count and clipping state (Updates)
COMMUNICATOR: Resource = ("communicator",)    # the gradient sums' MPI communicator


@dataclass(frozen=True)
class Task:
    """One sub-task: `kind`, its layer, its parameter (the layer's for
    backward_param, the net's learnable parameter for clear and update, the
    unit for sum), the iteration it belongs to and, for forward and
    backward, which of the iteration's iter_size passes."""
    kind: str
    layer: int = -1
    param: int = -1
    iteration: int = 0
    pass_: int = 0

    def __str__(self) -> str:
        where = {CLEAR: f"param {self.param}", UPDATE: f"param {self.param}", SUM: f"unit {self.param}",
                 RATE: ""}.get(self.kind, f"layer {self.layer}")
        extra = f".{self.param}" if self.kind == BACKWARD_PARAM else ""
        passes = f".{self.pass_}" if self.pass_ else ""
        return f"{self.kind}{extra}({where}) #{self.iteration}{passes}".replace("() ", " ")


@dataclass
class Access:
    reads: Set[Resource] = field(default_factory=set)
    writes: Set[Resource] = field(default_factory=set)


@dataclass
class Graph:
    """tasks in the sequential order; edges[task] = the tasks it waits for."""
    tasks: List[Task]
    edges: Dict[Task, Set[Task]]

    def successors(self) -> Dict[Task, List[Task]]:
        following: Dict[Task, List[Task]] = {task: [] for task in self.tasks}
        for task, before in self.edges.items():
            for earlier in before:
                following[earlier].append(task)
        return following


def _memory(array: Array) -> Resource:
    """The resource an ndarray is a view of: its base array's identity."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return ("memory", id(array))


def _data(blob: Blob) -> Resource:
    return _memory(blob.data)


def _diff(blob: Blob) -> Resource:
    return _memory(blob.diff)


def accesses(net: Net, task: Task, clip: bool = False, sums: Sums = ()) -> Access:
    """The resources `task` reads and writes (see the module docstring);
    `clip`: the solver clips gradients, so its rate task touches every diff;
    `sums`: per unit of the gradient sums, the learnable parameters it holds."""
    if task.kind == CLEAR:
        return Access(writes={_diff(net.learnable_params[task.param])})
    if task.kind == SUM:
        diffs = {_diff(net.learnable_params[index]) for index in sums[task.param]}
        return Access(reads=diffs, writes=diffs | {COMMUNICATOR})
    if task.kind == RATE:
        diffs = {_diff(blob) for blob in net.learnable_params} if clip else set()
        return Access(reads={LOOP} | diffs, writes={LOOP} | diffs)
    if task.kind == UPDATE:
        blob = net.learnable_params[task.param]
        touched = {_data(blob), _diff(blob), ("history", task.param)}
        return Access(reads=touched | {LOOP}, writes=touched)
    i = task.layer
    layer, bottoms, tops = net.layers[i], net.bottom_vecs[i], net.top_vecs[i]
    state = ("state", i)
    random = {("random",)} if layer.draws_random else set()
    params = {_data(blob) for blob in layer.blobs}
    if task.kind == FORWARD:
        loss_tops = {_diff(top) for top, weight in zip(tops, layer.loss_weights) if weight}
        # (params written too: BatchNorm's forward updates its running statistics)
        return Access(reads={_data(b) for b in bottoms} | params | random,
                      writes={_data(t) for t in tops} | loss_tops | params | {state} | random)
    # a backward sub-task may read any of the layer's blobs' data, its tops' diffs and its state
    reads = ({_data(b) for b in bottoms} | {_data(t) for t in tops} | {_diff(t) for t in tops}
             | params | {state})
    wanted = [k for k in range(len(layer.blobs)) if layer.param_wanted(k)]
    data_writes = {_diff(b) for b, down in zip(bottoms, net.bottom_need_backward[i]) if down}
    if task.kind == BACKWARD_PARAM:
        gradient = {_diff(layer.blobs[task.param])}
        return Access(reads=reads | gradient, writes=gradient)
    if task.kind == BACKWARD_DATA:
        return Access(reads=reads, writes=data_writes)
    gradients = {_diff(layer.blobs[k]) for k in wanted}
    return Access(reads=reads | gradients, writes=data_writes | gradients | {state})


def iteration_tasks(net: Net, iteration: int = 0, update: bool = True, splits: Optional[Callable[[int], bool]] = None,
                    passes: int = 1, sums: Sums = ()) -> List[Task]:
    """The sub-tasks of one iteration in the sequential reference order:
    `passes` forward and backward passes (the solver's iter_size) adding into
    the parameter gradients, then a sum per unit of `sums` (as in accesses)
    where the iteration updates. `splits(i)`: whether layer i's backward runs as
    sub-tasks (default: the layer's splits_backward; a batch-partitioned
    layer's sub-tasks run in the same twins as its forward, which keep its
    forward state)."""
    splits = splits or (lambda i: net.layers[i].splits_backward)
    tasks = [Task(CLEAR, param=p, iteration=iteration) for p in range(len(net.learnable_params))] if update else []
    for pass_ in range(passes):
        tasks += [Task(FORWARD, i, iteration=iteration, pass_=pass_) for i in range(len(net.layers))]
        tasks += _backward_tasks(net, iteration, pass_, splits)
    if update:
        tasks += [Task(SUM, param=unit, iteration=iteration) for unit in range(len(sums))]
        tasks.append(Task(RATE, iteration=iteration))
        tasks += [Task(UPDATE, param=p, iteration=iteration) for p in range(len(net.learnable_params))]
    return tasks


def _backward_tasks(net: Net, iteration: int, pass_: int, splits: Callable[[int], bool]) -> List[Task]:
    tasks: List[Task] = []
    for i in reversed(range(len(net.layers))):
        if not net.layer_need_backward[i]:
            continue
        layer = net.layers[i]
        if splits(i):
            tasks += [Task(BACKWARD_PARAM, i, k, iteration, pass_) for k in range(len(layer.blobs))
                      if layer.param_wanted(k)]
            if any(net.bottom_need_backward[i]):
                tasks.append(Task(BACKWARD_DATA, i, iteration=iteration, pass_=pass_))
        else:
            tasks.append(Task(BACKWARD, i, iteration=iteration, pass_=pass_))
    return tasks


def build(net: Net, iterations: int = 1, update: bool = True, drop: Iterable[Tuple[Task, Task]] = (),
          splits: Optional[Callable[[int], bool]] = None, clip: bool = False, passes: int = 1, sums: Sums = ()) -> Graph:
    """The graph of `iterations` unrolled training iterations (update=False:
    forward and backward only). `drop`: (earlier, later) edges to leave out,
    for tests that show an edge matters; `splits`, `passes` and `sums` as in
    iteration_tasks; `clip` as in accesses."""
    tasks = [task for k in range(iterations) for task in iteration_tasks(net, k, update, splits, passes, sums)]
    last_writer: Dict[Resource, Task] = {}
    readers: Dict[Resource, Set[Task]] = {}
    edges: Dict[Task, Set[Task]] = {task: set() for task in tasks}
    for task in tasks:
        access = accesses(net, task, clip, sums)
        for resource in access.reads:
            if resource in last_writer:
                edges[task].add(last_writer[resource])
        for resource in access.writes:
            if resource in last_writer:
                edges[task].add(last_writer[resource])
            edges[task].update(readers.get(resource, ()))
        for resource in access.reads:
            readers.setdefault(resource, set()).add(task)
        for resource in access.writes:
            last_writer[resource] = task
            readers[resource] = set()
        edges[task].discard(task)
    for earlier, later in drop:
        edges[later].discard(earlier)
    return Graph(tasks, edges)


class Blas(Protocol):
    """The process's BLAS thread count, as the sub-tasks that call BLAS at once share it."""
    current: int

    def set(self, count: int) -> None: ...

    def identity(self) -> list: ...                          # the libraries a timing ran through


class Steps(Protocol):
    """What the sub-tasks of a net run, and what sizes them, for its current
    shapes: the one way the graph's runner, the schedules and the tuner reach
    the net's execution (cct.runtime.executor.Executor.steps hands it down;
    they never name the executor). `threads`: the cores the net runs on;
    `blas`: the process's BLAS count; `config`: the run configuration, or
    None; `identity`: the shapes, partitions and count the steps are for."""
    threads: int
    blas: Blas
    config: Optional[RunConfig]
    identity: tuple

    def partitions(self, layer: int) -> int: ...             # the layer's batch partitions

    def forward(self, layer: int) -> float: ...              # its weighted loss; the BLAS count left as it is

    def backward(self, layer: int) -> None: ...

    def backward_data(self, layer: int) -> None: ...

    def backward_param(self, layer: int, param: int) -> None: ...

    def finish(self) -> None: ...                            # after the last sub-task: every BLAS thread again


class Updates(Protocol):
    """What whole-iteration sub-tasks ask of a training loop: the one way the
    runtime reaches it (cct.training.windows.SolverUpdates gives a solver's).
    `clips`: the rate clips the gradients, so its task reads every diff;
    `passes`: forward and backward passes an iteration (iter_size); `sums`:
    per unit of the MPI gradient sums, its parameters."""
    clips: bool
    passes: int
    sums: Sums

    def start(self) -> None: ...                             # a window of iterations starts

    def sum_gradients(self, unit: int) -> None: ...

    def begin(self, iteration: int) -> None: ...             # iteration k of the window: its rate

    def update(self, param: int, stripes: int) -> None: ...

    def finish(self, iterations: int) -> None: ...           # the window ran this many


class Runner:
    """Runs sub-tasks on a net (and, through `updates`, a training loop's
    sums, rates and updates) on the calling thread: what a scheduler's
    streams call. A layer's forward, whole backward and split sub-tasks run
    in its batch partitions (each partition's twin on a worker thread); the
    BLAS thread count is left to the caller. `finish()` tells the loop how
    many iterations ran. `losses`: each forward's weighted loss, by
    (iteration, pass, layer)."""

    def __init__(self, net: Net, steps: Steps, updates: Optional[Updates] = None) -> None:
        self.net, self.steps = net, steps
        self.updates = updates
        if updates is not None:
            updates.start()
        self.last_iteration = -1
        self.losses: Dict[Tuple[int, int, int], float] = {}

    def __call__(self, task: Task, threads: int = 1) -> None:
        """Run `task`; a clear or an update on `threads` threads at once (the
        caller's and the workers it holds)."""
        steps = self.steps
        if task.kind == CLEAR:
            clear(self.net.learnable_params[task.param].diff, threads)
        elif task.kind == FORWARD:
            self.losses[task.iteration, task.pass_, task.layer] = steps.forward(task.layer)
        elif task.kind == SUM:
            assert self.updates is not None         # sums, rates and updates come with a loop's updates
            self.updates.sum_gradients(task.param)
        elif task.kind == RATE:
            self.last_iteration = max(self.last_iteration, task.iteration)
            assert self.updates is not None
            self.updates.begin(task.iteration)
        elif task.kind == UPDATE:
            assert self.updates is not None
            self.updates.update(task.param, threads)
        else:
            if task.kind == BACKWARD_PARAM:
                steps.backward_param(task.layer, task.param)
            elif task.kind == BACKWARD_DATA:
                steps.backward_data(task.layer)
            else:
                steps.backward(task.layer)

    def alone(self, task: Task, width: Width) -> None:
        """Run `task` on this thread at `width`, (cores, BLAS count) as a
        scheduler gives it: the BLAS count set first (None: left as it is),
        the cores a clear's or an update's stripes (a layer's partitions are
        its plan's)."""
        cores, blas = width
        if blas is not None:
            self.steps.blas.set(blas)
        self(task, cores if task.layer < 0 else 1)

    def finish(self) -> None:
        """After the last task: the loop counts the iterations run."""
        if self.updates is not None and self.last_iteration >= 0:
            self.updates.finish(self.last_iteration + 1)

    def loss(self, iteration: int) -> float:
        """The iteration's loss, as the solver's loop sums it: each pass's
        layers in order (Net.forward), the passes in order, over their count."""
        passes = sorted({key[1] for key in self.losses if key[0] == iteration})
        total = 0.0
        for pass_ in passes:
            total += sum((self.losses[key] for key in sorted(self.losses) if key[:2] == (iteration, pass_)), 0.0)
        return total / len(passes)


def clear(diff: FloatArray, threads: int = 1) -> None:
    """Zero `diff` in `threads` contiguous pieces at once (a memset: the
    bandwidth of one core does not fill the memory's)."""
    if threads == 1 or not diff.flags.c_contiguous:
        diff[...] = 0
        return
    flat = diff.reshape(-1)
    edges = [flat.size * k // threads for k in range(threads + 1)]

    def zero(start: int, stop: int) -> None:
        flat[start:stop] = 0
    run_all(workers(threads), zero, zip(edges[:-1], edges[1:]))


def topological_order(graph: Graph, choose: Callable[[List[Task]], Task]) -> List[Task]:
    """The tasks in an order that keeps every edge, `choose(ready)` picking the
    next among the ready ones (a list, in the sequential order)."""
    following = graph.successors()
    waiting = {task: len(before) for task, before in graph.edges.items()}
    position = {task: index for index, task in enumerate(graph.tasks)}
    ready = [task for task in graph.tasks if not waiting[task]]
    order = []
    while ready:
        task = choose(ready)
        ready.remove(task)
        order.append(task)
        for later in following[task]:
            waiting[later] -= 1
            if not waiting[later]:
                ready.append(later)
        ready.sort(key=position.__getitem__)
    if len(order) != len(graph.tasks):
        raise RuntimeError("the sub-task graph has a cycle")
    return order
