"""Scratch memory for the lowerings, reused across iterations, and batch chunking
under a memory budget.

A lowering function asks its `ws` for every big intermediate (padded input,
lowered matrix, GEMM product, unlifted gradient) by slot name:

    ws.empty(slot, shape, dtype)     uninitialised
    ws.zeros(slot, shape, dtype)     zero-filled

`FRESH` (the default) allocates new arrays, so the functions stay pure. An
`Arena` keeps one flat store per slot that grows to the largest request and is
handed out again on the next call: no allocation and no page faults after the
first iteration. A slot's contents live only until the next request for the
same slot, so a function never returns arena memory to its caller.

The layers use `thread_arena()`, one arena per thread: layers run one after
another on a thread, so they share its stores (the arena holds the largest
layer's buffers, not the sum over layers, which is what keeps CaffeNet at batch
256 under Caffe's memory), and the batch-partition clones of a layer, which run
at the same time on different worker threads, never share a buffer.

A batch whose workspace (lowered matrix, GEMM product, padded input, output:
`slot_bytes`) would exceed the budget (default 64 MB, env
CCT_LOWERING_BUDGET_MB) is processed in chunks of whole images, one after
another (`chunk_size`), so the arena never holds more than the budget: CaffeNet
conv1 at batch 256 under type 1 would need 1.1 GB for its lowered matrix alone.
"""
import os
import threading

import numpy as np

# 64 MB: CaffeNet training at batch 256 then peaks at 2.48 GiB, within Caffe's
# 2.7 GB, at most a few % slower than with 256 MB (2.67 GiB; BENCHMARKS.md).
DEFAULT_BUDGET_MB = 64
BUDGET_ENV = "CCT_LOWERING_BUDGET_MB"


class Fresh:
    """Allocates a new array on every request."""

    @staticmethod
    def empty(slot, shape, dtype):
        return np.empty(shape, dtype)

    @staticmethod
    def zeros(slot, shape, dtype):
        return np.zeros(shape, dtype)

    @staticmethod
    def plan(sizes):
        pass


FRESH = Fresh()


class Arena:
    """Named buffers reused across calls.

    `plan({slot: nbytes})` lays the slots of one lowering call out in a single
    store, which grows to the largest plan seen and is reused: the memory held
    is the largest call's workspace, not a sum of per-slot maxima over layers.
    A request for a slot the plan does not cover (or bigger than planned) gets
    a store of its own, kept and reused in the same way."""

    def __init__(self):
        self.store = np.empty(0, np.uint8)
        self.layout = {}            # slot -> (offset, nbytes) in self.store
        self.stores = {}            # slot -> own store, for unplanned requests

    def plan(self, sizes):
        layout, offset = {}, 0
        for slot, nbytes in sizes.items():
            layout[slot] = (offset, int(nbytes))
            offset += -(-int(nbytes) // 64) * 64         # keep every slot 64-byte aligned
        if self.store.size < offset:
            self.store = np.empty(0, np.uint8)           # free the old store before the new one
            self.store = np.empty(offset, np.uint8)
        self.layout = layout

    def empty(self, slot, shape, dtype):
        dtype = np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        planned = self.layout.get(slot)
        if planned is not None and nbytes <= planned[1]:
            start = planned[0]
            return self.store[start:start + nbytes].view(dtype).reshape(shape)
        store = self.stores.get(slot)
        if store is None or store.size < nbytes:
            # The old store is freed once nothing views it (views never outlive a call).
            store = self.stores[slot] = np.empty(max(nbytes, 1), np.uint8)
        return store[:nbytes].view(dtype).reshape(shape)

    def zeros(self, slot, shape, dtype):
        array = self.empty(slot, shape, dtype)
        array.fill(0)
        return array

    @property
    def nbytes(self):
        return self.store.size + sum(store.size for store in self.stores.values())

    def clear(self):
        self.store = np.empty(0, np.uint8)
        self.layout = {}
        self.stores.clear()


_local = threading.local()


def thread_arena():
    """The calling thread's arena (created on first use)."""
    arena = getattr(_local, "arena", None)
    if arena is None:
        arena = _local.arena = Arena()
    return arena


def budget_from_env(default_mb=DEFAULT_BUDGET_MB):
    """Budget in bytes from CCT_LOWERING_BUDGET_MB, else `default_mb`."""
    value = os.environ.get(BUDGET_ENV, "").strip()
    if not value:
        return int(default_mb * 2 ** 20)
    try:
        megabytes = float(value)
    except ValueError:
        megabytes = -1.0
    if megabytes <= 0:
        raise ValueError(f"environment variable {BUDGET_ENV} must be a positive number of MB, got {value!r}")
    return int(megabytes * 2 ** 20)


def slot_bytes(geom, lowering_type, batch, itemsize):
    """{slot: bytes} that one call of a lowering type on `batch` images asks its
    workspace for, forward and backward (see the slots in each type's docstring)."""
    c, o = geom.channels, geom.num_output
    kh, kw = geom.kernel_h, geom.kernel_w
    pixels = batch * geom.out_h * geom.out_w
    frame = batch * geom.padded_h * geom.padded_w
    if lowering_type == 1:
        sizes = {"lowered": c * kh * kw * pixels, "product": o * pixels}
    elif lowering_type == 2:
        rows = batch * geom.padded_h * geom.out_w
        sizes = {"lowered": c * kw * rows, "product": o * kh * rows}
    else:
        sizes = {"product": o * kh * kw * frame}
    sizes.update(padded=c * frame, output=o * pixels)
    return {slot: count * itemsize for slot, count in sizes.items()}


def image_bytes(geom, lowering_type, itemsize):
    """Workspace bytes per image of a lowering type."""
    return sum(slot_bytes(geom, lowering_type, 1, itemsize).values())


def chunk_size(geom, lowering_type, batch, itemsize, budget):
    """Images per chunk so that the chunk's whole workspace fits `budget` bytes
    (at least one image, at most the batch)."""
    per_image = image_bytes(geom, lowering_type, itemsize)
    return int(max(1, min(batch, budget // per_image)))


CACHE_BYTES = 8 * 2 ** 20          # a lowered chunk this small is still in cache when its GEMM reads it
MIN_GEMM_COLUMNS = 4096            # ... but keep the GEMM wide enough to run at its full rate


def cache_chunk(geom, lowering_type, batch, itemsize):
    """Images per chunk for speed: type 1 on large images (CaffeNet conv1: 4.4 MB
    lowered per image) runs ~15% faster forward when its lowered matrix is
    consumed by the GEMM while still in cache, rather than written to memory for
    the whole batch and read back. Chunks keep at least MIN_GEMM_COLUMNS GEMM
    columns; other types, and type 1 on small images (batch-inner, see type1),
    measured fastest whole."""
    from .type1 import batch_inner
    if lowering_type != 1 or batch_inner(geom, batch):
        return batch
    pixels = geom.out_h * geom.out_w
    lowered = geom.channels * geom.kernel_h * geom.kernel_w * pixels * itemsize
    images = max(CACHE_BYTES // lowered, -(-MIN_GEMM_COLUMNS // pixels), 1)
    return int(min(batch, images))


def chunks(batch, size):
    """[(start, stop)] covering range(batch) in steps of `size`."""
    return [(start, min(start + size, batch)) for start in range(0, batch, size)]
