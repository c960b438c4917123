"""Work memory reused across iterations: named buffers per thread.

A function asks its `ws` for every big intermediate by slot name:

    ws.empty(slot, shape, dtype)     uninitialised
    ws.zeros(slot, shape, dtype)     zero-filled

`FRESH` allocates new arrays, so a function given it stays pure. An `Arena`
keeps one flat store per slot that grows to the largest request and is handed
out again on the next call: no allocation and no page faults after the first
iteration (big temporaries are mmapped and page-faulted afresh on every
allocation, tens of ms for CaffeNet's blobs). A slot's contents live only
until the next request for the same slot, so a function never returns arena
memory to its caller.

`thread_arena()` is the calling thread's arena, the one work store of cct: the
lowerings plan their slots in it, and Layer.work takes its temporaries from
it. Layers run one after another on a thread, so they share its stores (the
arena holds the largest layer's buffers, not the sum over layers, which is
what keeps CaffeNet at batch 256 under Caffe's memory), and the batch-partition
twins of a layer, which run at the same time on different worker threads,
never share a buffer.
"""
import contextlib
import math
import threading
from typing import Dict, Iterator, Mapping, Optional, Protocol, Sequence, Tuple

import numpy as np
import numpy.typing as npt

from cct.core.allocation import check_allocation
from cct.core.arrays import Array


class Workspace(Protocol):
    """What a function asks its `ws` for (FRESH, an Arena, cct.lowering.kept's)."""

    def empty(self, slot: str, shape: Sequence[int], dtype: npt.DTypeLike) -> Array: ...

    def zeros(self, slot: str, shape: Sequence[int], dtype: npt.DTypeLike) -> Array: ...

    def plan(self, sizes: Mapping[str, int]) -> None: ...


class Fresh:
    """Allocates a new array on every request."""

    @staticmethod
    def empty(slot: str, shape: Sequence[int], dtype: npt.DTypeLike) -> Array:
        check_allocation(shape, dtype, f"work array '{slot}'")
        return np.empty(shape, dtype)

    @staticmethod
    def zeros(slot: str, shape: Sequence[int], dtype: npt.DTypeLike) -> Array:
        check_allocation(shape, dtype, f"work array '{slot}'")
        return np.zeros(shape, dtype)

    @staticmethod
    def plan(sizes: Mapping[str, int]) -> None:
        pass


FRESH = Fresh()


class Arena:
    """Named buffers reused across calls.

    `plan({slot: nbytes})` lays the slots of one lowering call out in a single
    store, which grows to the largest plan seen and is reused: the memory held
    is the largest call's workspace, not a sum of per-slot maxima over layers.
    A request for a slot the plan does not cover (or bigger than planned) gets
    a store of its own, kept and reused in the same way."""

    def __init__(self) -> None:
        self.store: Array = np.empty(0, np.uint8)
        self.layout: Dict[str, Tuple[int, int]] = {}     # slot -> (offset, nbytes) in self.store
        self.stores: Dict[str, Array] = {}               # slot -> own store, for unplanned requests

    def plan(self, sizes: Mapping[str, int]) -> None:
        layout, offset = {}, 0
        for slot, nbytes in sizes.items():
            layout[slot] = (offset, int(nbytes))
            offset += -(-int(nbytes) // 64) * 64         # keep every slot 64-byte aligned
        self.reserve(offset)
        self.layout = layout

    def reserve(self, nbytes: int) -> Array:
        """Grow the planned store to at least `nbytes` now, ahead of the
        plans that will ask for it (a net just built: its pages can then be
        faulted in before its first forward); the store."""
        if self.store.size < nbytes:
            check_allocation((nbytes,), np.uint8, "lowering workspace")
            self.store = np.empty(0, np.uint8)           # free the old store before the new one
            self.store = np.empty(nbytes, np.uint8)
        return self.store

    def empty(self, slot: str, shape: Sequence[int], dtype: npt.DTypeLike) -> Array:
        dtype = np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        nbytes = math.prod(shape) * dtype.itemsize
        planned = self.layout.get(slot)
        if planned is not None and nbytes <= planned[1]:
            start = planned[0]
            return self.store[start:start + nbytes].view(dtype).reshape(shape)
        store = self.stores.get(slot)
        if store is None or store.size < nbytes:
            check_allocation(shape, dtype, f"work array '{slot}'")       # only where numpy allocates
            # The old store is freed once nothing views it (views never outlive a call).
            store = self.stores[slot] = np.empty(max(nbytes, 1), np.uint8)
        return store[:nbytes].view(dtype).reshape(shape)

    def zeros(self, slot: str, shape: Sequence[int], dtype: npt.DTypeLike) -> Array:
        array = self.empty(slot, shape, dtype)
        array.fill(0)
        return array

    @property
    def nbytes(self) -> int:
        return self.store.size + sum(store.size for store in self.stores.values())

    def clear(self) -> None:
        self.store = np.empty(0, np.uint8)
        self.layout = {}
        self.stores.clear()


_local = threading.local()


def thread_arena() -> Arena:
    """The calling thread's arena (created on first use), or the one lent to
    it for the while (`lent`)."""
    arena = getattr(_local, "lent", None)
    if arena is not None:
        return arena
    arena = getattr(_local, "arena", None)
    if arena is None:
        arena = _local.arena = Arena()
    return arena


@contextlib.contextmanager
def lent(arena: Optional[Arena]) -> Iterator[None]:
    """thread_arena() on this thread is `arena` inside the block: a stream
    thread runs each sub-task on an arena of a pool shared by the streams
    (cct.runtime.scheduler), so the streams hold one arena per sub-task that
    may run at once, not one per thread (None: the thread's own, for a
    sub-task that holds no cores)."""
    _local.lent = arena
    try:
        yield
    finally:
        _local.lent = None
