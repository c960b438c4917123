"""The memory plan: what a net, or a solver with its nets, will hold at its
peak, added up at setup, before training touches the big arrays, and checked
against the memory there is (or a limit the user sets).

At setup a blob's store is allocated by np.zeros, which the kernel maps
lazily: the memory is taken at first touch, in the first iteration. So the
plan is made from what setup allocated and from what the run will add:

    process        what the process held before the nets (interpreter, libraries)
    runtime        what the run loads that setup does not: numba and LLVM
                   (started by the first compiled kernel) and OpenBLAS's
                   per-thread buffers (the first GEMM on each thread),
                   measured by loading them now
    blobs          every blob's data store, the nets' and the layers' own
                   arrays (parameters, masks, scales), each store counted once
                   (in-place tops and shared parameters share one)
    diffs          the diffs backward will ask for: every blob a layer that
                   needs backward reads or writes the gradient of (shared
                   diff arenas counted once), parameter diffs, and the private
                   parameter diffs of batch-partition twins
    workspace      each thread's arena: per slot (the lowering's, a layer's
                   work array), the largest request of any layer that runs
                   on that thread (cct.core.workspace)
    kept lowerings what training convolutions keep from forward to backward
                   (cct.lowering.kept), each layer's own; where the plan would
                   not fit with them, they are given up (the layers'
                   keep_lowering turned off) and the plan made again
    prefetch       batches a data layer's prefetch thread keeps ready
    solver history the solver's per-parameter state (momentum, Adam's moments)

Under "streams" or "auto" the streams lend each running sub-task an arena
from a pool, the calling thread's and one spare per further thread: the plan
counts every slot on each spare, an upper bound. Not planned: Python objects,
the kernels numba compiles or loads, heap memory the C library keeps after
freeing, and pages of a database file the kernel maps (LMDB). `cct train` and
`cct time` print the plan at the start and the measured peak at the end, so
the gap shows: CaffeNet training at batch 256 plans 2.39 GiB and peaks at
2.53 (BENCHMARKS.md).

While a net is built, cct.core.allocation.charging refuses the blob store
that would take the net past what the limit leaves, before numpy allocates
it: a net far too large for the machine fails at its first top that does not
fit, in well under a second, naming that layer and top. The executor checks
a net's plan when the net is built, the solver its whole plan before the
first iteration.
"""
from typing import (Any, Callable, Dict, Hashable, Iterable, Iterator, List, Optional, Protocol, Sequence, Set, Tuple,
                    Union)

import numpy as np

from cct.core.arrays import Array, FloatArray
from cct.core.blob import Blob
from cct.core.allocation import available, format_bytes, peak_resident_bytes, resident_bytes
from cct.core.errors import MemoryLimitError
from cct.core.layer import TRAIN, Layer
from cct.devices.jit import kernel

Net = Any                         # cct.core.net.Net, whose executor imports this module: not imported back
Thread = Union[int, str]          # an arena's thread: a partition's index, or "spare k"


class Partitions(Protocol):
    """What a plan asks of a net's executor (cct.runtime.executor.Executor,
    which imports this module): its batch partitions, schedule and threads."""
    schedule: str
    threads: int

    def partitions(self, index: int) -> int: ...


KINDS = ("process", "runtime", "blobs", "diffs", "workspace", "kept lowerings", "prefetch", "solver history")


class MemoryPlan:
    """Planned bytes by kind, and by owner ("layer 'conv1' (Convolution): top 'conv1'"),
    each array counted once (Plan.add ignores a store seen before)."""

    def __init__(self, baseline: int) -> None:
        self.bytes: Dict[str, int] = dict.fromkeys(KINDS, 0)
        self.bytes["process"] = int(baseline)
        self.owners: Dict[Tuple[str, str], int] = {}       # (kind, owner) -> bytes
        self._seen: Set[Hashable] = set()                   # ids of the root arrays counted
        self._keep: List[Optional[Array]] = []              # ... kept alive, so that an id is not reused
        # (thread, arena slot) -> (largest request, its layer)
        self._slots: Dict[Tuple[Thread, str], Tuple[int, str]] = {}

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def add(self, kind: str, owner: str, nbytes: int, array: Optional[Array] = None,
            key: Optional[Hashable] = None) -> None:
        """Add `nbytes` of `kind` for `owner`; given an `array`, its whole
        memory (the array it views) instead, unless that was added before.
        `key` names memory still to come, to count once (a lazy diff)."""
        if array is not None:
            array = _root(array)
            key, nbytes = id(array), array.nbytes
        if key is not None:
            if key in self._seen:
                return
            self._seen.add(key)
            self._keep.append(array)
        if nbytes:
            self.bytes[kind] += int(nbytes)
            self.owners[(kind, owner)] = self.owners.get((kind, owner), 0) + int(nbytes)

    def add_workspace(self, owner: str, thread: Thread, slot: str, nbytes: int) -> None:
        """A layer's request for `slot` of worker `thread`'s arena: an arena
        keeps each slot's largest request (cct.core.workspace)."""
        largest = self._slots.get((thread, slot), (0, None))
        if nbytes > largest[0]:
            self._slots[(thread, slot)] = (int(nbytes), owner)
            self.bytes["workspace"] = sum(size for size, _ in self._slots.values())

    def workspace(self, thread: Thread, slot: str) -> int:
        """The largest request planned for `slot` of `thread`'s arena."""
        return self._slots.get((thread, slot), (0, None))[0]

    def largest(self, count: int = 5) -> List[Tuple[int, str, str]]:
        """The `count` largest planned arrays or workspaces: [(bytes, kind, owner)]."""
        entries = [(nbytes, kind, owner) for (kind, owner), nbytes in self.owners.items()]
        entries += [(nbytes, "workspace", f"{owner} ({slot}, thread {thread})")
                    for (thread, slot), (nbytes, owner) in self._slots.items()]
        return sorted(entries, key=lambda entry: -entry[0])[:count]

    def __str__(self) -> str:
        parts = ", ".join(f"{kind} {format_bytes(nbytes)}" for kind, nbytes in self.bytes.items() if nbytes)
        return f"planned peak {format_bytes(self.total)} ({parts})"

    def fits(self) -> bool:
        return self.total <= available()[0]

    def check(self, source: str) -> None:
        """Raise MemoryLimitError when the plan does not fit, naming the largest arrays."""
        limit, what = available()
        if self.total <= limit:
            return
        largest = "; ".join(f"{owner}: {kind} {format_bytes(nbytes)}" for nbytes, kind, owner in self.largest())
        raise MemoryLimitError(f"{source}", f": the {self} needs more than {what}. Largest: {largest}",
                               named=True)


def _root(array: Array) -> Array:
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


def plan_net(net: Net, plan: MemoryPlan, backward: Optional[bool] = None,
             executor: Optional[Partitions] = None) -> None:
    """Add a net's blobs, its diffs (when it runs backward: by default, a TRAIN
    net), its layers' workspaces and prefetch buffers to `plan`; `executor`
    says the partitions (the net's own, by default)."""
    backward = net.phase == TRAIN if backward is None else backward
    executor = executor or net.executor
    for name, blob in net.blobs.items():
        plan.add("blobs", f"blob '{name}'", 0, blob._data_store)
    for index, layer in enumerate(net.layers):
        where = layer.where()
        for param_index, blob in enumerate(layer.blobs):
            plan.add("blobs", f"{where}: parameter {param_index}", 0, blob._data_store)
        for attribute, array in _own_arrays(layer):
            plan.add("blobs", f"{where}: {attribute}", 0, array)
        partitions = executor.partitions(index)
        needs = layer.planned_bytes(net.bottom_vecs[index], net.top_vecs[index], max(1, partitions))
        for slot, nbytes in needs.items():
            if slot == "prefetch":
                plan.add("prefetch", where, nbytes)
            elif slot == "held":                # arrays the layer keeps, shared by its partitions
                plan.add("blobs", f"{where}: {slot}", nbytes)
            elif slot == "kept":                # one per partition twin, read only by a backward
                if backward:
                    plan.add("kept lowerings", where, nbytes * max(1, partitions))
            else:
                for thread in _threads(executor, partitions, backward):
                    plan.add_workspace(where, thread, slot, nbytes)
        if backward and net.layer_need_backward[index]:
            _plan_diffs(net, index, partitions, plan)


def _threads(executor: Partitions, partitions: int, backward: bool) -> List[Thread]:
    """The arenas a layer's work arrays may end up in: one per partition's
    thread, and in training under streams (or "auto", which times them) the
    spare arenas the streams lend to sub-tasks running beside another (a
    sub-task's first partition may run on one; the calling thread's own is
    partition 0's)."""
    threads: List[Thread] = list(range(max(1, partitions)))
    if backward and executor.schedule != "sequential":
        threads += [f"spare {index}" for index in range(1, executor.threads)]
    return threads


def _plan_diffs(net: Net, index: int, partitions: int, plan: MemoryPlan) -> None:
    layer, where = net.layers[index], net.layers[index].where()
    blobs = [(f"top '{name}'", blob) for name, blob in zip(net._top_names[index], net.top_vecs[index])]
    blobs += [(f"bottom '{name}'", blob)
              for name, blob, needed in zip(net._bottom_names[index], net.bottom_vecs[index],
                                            net.bottom_need_backward[index]) if needed]
    blobs += [(f"parameter {k}", blob) for k, blob in enumerate(layer.blobs)]
    for what, blob in blobs:
        _plan_diff(plan, f"{where}: {what}", blob)
    if partitions > 1 and layer.blobs:      # each twin but the first sums into a private copy
        twin_bytes = sum(blob.count * blob.dtype.itemsize for blob in layer.blobs)
        plan.add("diffs", f"{where}: partition twins' parameter diffs", (partitions - 1) * twin_bytes)


def _plan_diff(plan: MemoryPlan, owner: str, blob: Blob) -> None:
    if blob._diff_store is not None:
        plan.add("diffs", owner, 0, blob._diff_store)
    else:       # made on first use, as large as the data's store
        plan.add("diffs", owner, blob._data_store.nbytes, key=("diff of", id(blob._data_store)))
        plan._keep.append(blob._data_store)


def _own_arrays(layer: Layer) -> Iterator[Tuple[str, Array]]:
    """(attribute, array) for the numpy arrays and Blobs a layer keeps besides
    its parameters: masks, scales, winner indices sized at reshape."""
    for attribute, value in vars(layer).items():
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, np.ndarray):
                yield attribute, item
            elif isinstance(item, Blob) and not any(item is blob for blob in layer.blobs):
                yield attribute, item._data_store


def net_plan(net: Net, executor: Partitions) -> MemoryPlan:
    """The plan of a net alone, from the process's memory before it was built."""
    def make() -> MemoryPlan:
        plan = MemoryPlan(net.memory_baseline)
        plan_net(net, plan, executor=executor)
        return plan
    return _fitted(make, [net])


def _fitted(make: Callable[[], MemoryPlan], nets: Sequence[Net]) -> MemoryPlan:
    """The plan make() gives; if it does not fit only with kept lowerings,
    the plan after the nets' layers give them up (their backwards lower again)."""
    plan = make()
    if plan.bytes["kept lowerings"] and not plan.fits():
        for net in nets:
            for layer in net.layers:
                if layer.keep_lowering:
                    layer.keep_lowering = False
        plan = make()
    return plan


def training_plan(train_net: Net, test_nets: Iterable[Net], history: Iterable[Array], baseline: int) -> MemoryPlan:
    """The plan of a training run: its train net (with diffs), test nets
    (forward only; parameters shared with the train net count once), the
    update's history arrays, and the runtime a training run loads."""
    runtime = runtime_bytes()

    def make() -> MemoryPlan:
        plan = MemoryPlan(baseline)
        plan.add("runtime", "numba and OpenBLAS buffers", runtime)
        plan_net(train_net, plan, backward=True)
        for net in test_nets:
            plan_net(net, plan, backward=False)
        for index, array in enumerate(history):
            plan.add("solver history", f"history {index}", 0, array)
        return plan
    return _fitted(make, [train_net])


def runtime_bytes() -> int:
    """The resident memory that starting numba (the first compiled kernel a
    run calls imports numba and starts LLVM: about 120 MiB) and a GEMM on
    every BLAS thread add, measured now by doing both."""
    before = resident_bytes()
    _first_kernel(np.zeros(1))
    matrix = np.ones((1024, 1024), np.float32)
    np.matmul(matrix, matrix, out=np.empty_like(matrix))
    return max(0, resident_bytes() - before - 2 * matrix.nbytes)


@kernel
def _first_kernel(values: FloatArray) -> None:
    values[0] += 1.0


def measured_line(plan: MemoryPlan) -> str:
    """`Peak memory: 2.61 GiB measured, 2.55 GiB planned (-2.3%)`."""
    measured = peak_resident_bytes()
    change = 100.0 * (plan.total - measured) / measured
    return (f"Peak memory: {format_bytes(measured)} measured, {format_bytes(plan.total)} planned "
            f"({change:+.1f}%)")
