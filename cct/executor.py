"""Batch partitioning (Caffe con Troll, Sec. 3.2): a layer's batch is split into
p partitions that run in parallel on persistent worker threads, each GEMM
given T/p BLAS threads.

OpenBLAS's thread count is process-wide, so a partitioned layer sets it to T/p
for its duration and back to T after. numpy releases the GIL in GEMM and in
its array loops, so the lowering, pooling and element-wise work of the
partitions also runs in parallel, which one BLAS call with T threads cannot do.

A partition runs a shallow clone of the layer on BlobSlice views of the batch,
so per-forward state (pooling argmax, saved inputs) stays per partition; the
clones' parameter blobs share data with the layer's but own their diffs,
which are summed into the layer's after backward (no race on `+=`).
The unit of work is (layer, partition, pass), what a scheduler places on a
worker with a chosen thread count.
"""
import copy
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from threadpoolctl import ThreadpoolController

from .blob import Blob
from .errors import ShapeError

# Layer types whose work is independent across the batch axis (axis 0) and safe
# to run as clones: no cross-sample statistics, no shared random stream.
PARTITIONABLE_TYPES = {
    "Convolution", "Deconvolution", "Im2col", "Pooling", "LRN", "InnerProduct", "MVN",
    "ReLU", "PReLU", "ELU", "Sigmoid", "TanH", "AbsVal", "BNLL", "Power", "Exp", "Log",
    "Swish", "Clip",
}


class BlasThreads:
    """The BLAS libraries' thread count, set directly (threadpoolctl's
    context manager re-scans the loaded libraries on every call)."""

    def __init__(self):
        self._libraries = ThreadpoolController().select(user_api="blas").lib_controllers
        self.default = max([lib.num_threads for lib in self._libraries] or [1])
        self.current = self.default

    def set(self, count):
        count = max(1, int(count))
        if count != self.current:
            for lib in self._libraries:
                lib.set_num_threads(count)
            self.current = count


class BlobSlice(Blob):
    """Rows [start, stop) of a blob's batch axis, as a Blob of fixed shape."""

    def __init__(self, blob, start, stop):
        self.dtype = blob.dtype
        self._shape = (stop - start,) + blob.shape[1:]
        self._data = blob.data[start:stop]
        self._diff = blob.diff[start:stop]

    def reshape(self, *shape):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        if tuple(int(d) for d in shape) != self._shape:
            raise ShapeError(f"a batch partition of shape {self._shape} cannot be reshaped to {shape}")

    def share_data(self, other):
        raise ShapeError("a batch partition cannot share storage")

    share_diff = share_data


class ParamView(Blob):
    """A clone's parameter: the layer's data, a private diff."""

    def __init__(self, blob):
        self.dtype = blob.dtype
        self._shape = blob.shape
        self._data = blob.data
        self._diff = np.zeros_like(blob.diff)

    def reshape(self, *shape):
        raise ShapeError("a partition clone cannot reshape a parameter")


class PartitionedLayer:
    """Runs `layer` over `partitions` slices of the batch in parallel."""

    def __init__(self, layer, partitions):
        self.layer = layer
        self.partitions = partitions
        self.clones = []
        for _ in range(partitions):
            clone = copy.copy(layer)
            clone.blobs = [ParamView(blob) for blob in layer.blobs]
            self.clones.append(clone)

    def _bounds(self, batch):
        edges = np.linspace(0, batch, self.partitions + 1).astype(int)
        return list(zip(edges[:-1], edges[1:]))

    def _views(self, bottoms, tops):
        batch = bottoms[0].shape[0]
        for (start, stop), clone in zip(self._bounds(batch), self.clones):
            for view, blob in zip(clone.blobs, self.layer.blobs):
                view._data = blob.data        # follow the layer's storage (share_with, copy_from)
            bottom_views = [BlobSlice(b, start, stop) for b in bottoms]
            # An in-place top gets the very view of its bottom, so the clone sees in-place.
            top_views = [next((v for b, v in zip(bottoms, bottom_views) if b is t), None)
                         or BlobSlice(t, start, stop) for t in tops]
            yield clone, bottom_views, top_views

    def forward(self, pool, bottoms, tops):
        def run(clone, bottom_views, top_views):
            clone.reshape(bottom_views, top_views)
            clone.forward(bottom_views, top_views)
        _run_all(pool, run, self._views(bottoms, tops))

    def backward(self, pool, tops, propagate_down, bottoms):
        def run(clone, bottom_views, top_views):
            clone.param_propagate_down = self.layer.param_propagate_down
            clone.backward(top_views, propagate_down, bottom_views)
        _run_all(pool, run, self._views(bottoms, tops))
        for index, blob in enumerate(self.layer.blobs):
            if self.layer.param_propagate_down[index]:
                for clone in self.clones:
                    blob.diff += clone.blobs[index].diff
                    clone.blobs[index].diff[...] = 0


def _run_all(pool, function, work):
    futures = [pool.submit(function, *unit) for unit in work]
    for future in futures:
        future.result()               # re-raises a partition's exception here


class Executor:
    """Runs a net's layers, each with its chosen number of batch partitions.

    `plan[layer_index] = p` (1: the layer runs as is, with all BLAS threads).
    """

    def __init__(self, net, threads=None):
        self.net = net
        self.blas = BlasThreads()
        self.threads = int(threads or os.environ.get("CCT_THREADS", 0) or self.blas.default)
        self.plan = {}
        self._partitioned = {}
        self._pool = None
        # CCT_PARTITIONS=p partitions every layer that allows it (the conformance
        # suite runs with it to check partitioned results equal unpartitioned ones).
        forced = int(os.environ.get("CCT_PARTITIONS", 0) or 0)
        if forced > 1:
            for index in range(len(net.layers)):
                if self.partitionable(index):
                    self.plan[index] = min(forced, net.bottom_vecs[index][0].shape[0])

    # --- which layers may be partitioned -----------------------------------------
    def partitionable(self, index):
        layer = self.net.layers[index]
        if layer.type not in PARTITIONABLE_TYPES:
            return False
        if layer.type == "Pooling" and layer.layer_param.pooling_param.pool == 2:   # STOCHASTIC
            return False
        if layer.type == "InnerProduct" and self.net.bottom_vecs[index][0].canonical_axis(
                layer.layer_param.inner_product_param.axis) == 0:
            return False
        blobs = self.net.bottom_vecs[index] + self.net.top_vecs[index]
        batch = blobs[0].shape[0] if blobs[0].shape else 0
        return batch > 1 and all(b.shape and b.shape[0] == batch for b in blobs)

    def set_partitions(self, index, partitions):
        partitions = int(partitions)
        if partitions > 1 and not self.partitionable(index):
            raise ValueError(f"{self.net.layers[index].where()}: cannot be batch-partitioned")
        self.plan[index] = partitions
        self._partitioned.pop(index, None)

    def partitions(self, index):
        return self.plan.get(index, 1)

    # --- running -----------------------------------------------------------------
    def _pool_for(self, partitions):
        if self._pool is None or self._pool._max_workers < partitions:
            self._pool = ThreadPoolExecutor(max_workers=max(partitions, self.threads),
                                            thread_name_prefix="cct-partition")
        return self._pool

    def _runner(self, index):
        partitions = self.partitions(index)
        runner = self._partitioned.get(index)
        if runner is None or runner.partitions != partitions:
            runner = self._partitioned[index] = PartitionedLayer(self.net.layers[index], partitions)
        return runner

    def forward(self, index):
        net = self.net
        layer, bottoms, tops = net.layers[index], net.bottom_vecs[index], net.top_vecs[index]
        layer.reshape(bottoms, tops)
        partitions = self.partitions(index)
        if partitions == 1:
            self.blas.set(self.threads)
            layer.forward(bottoms, tops)
            return
        self.blas.set(max(1, self.threads // partitions))
        self._runner(index).forward(self._pool_for(partitions), bottoms, tops)

    def backward(self, index):
        net = self.net
        layer, bottoms, tops = net.layers[index], net.bottom_vecs[index], net.top_vecs[index]
        propagate_down = net.bottom_need_backward[index]
        partitions = self.partitions(index)
        if partitions == 1:
            self.blas.set(self.threads)
            layer.backward(tops, propagate_down, bottoms)
            return
        self.blas.set(max(1, self.threads // partitions))
        self._runner(index).backward(self._pool_for(partitions), tops, propagate_down, bottoms)

    def finish(self):
        self.blas.set(self.threads)

    # --- choosing p per layer by measurement ---------------------------------------
    def tune(self, candidates=None, repeats=2):
        """Time each partitionable layer's forward+backward with every candidate p
        on the net's current data, keep the fastest per layer. Returns the plan."""
        net = self.net
        candidates = candidates or sorted({1, self.threads, 2 * self.threads})
        net._forward()                            # blobs hold real shapes and values
        chosen = {}
        for index in range(len(net.layers)):
            if not self.partitionable(index):
                continue
            best = None
            for partitions in candidates:
                if partitions > net.bottom_vecs[index][0].shape[0]:
                    continue
                self.set_partitions(index, partitions)
                elapsed = self._time_layer(index, repeats)
                if best is None or elapsed < best[0]:
                    best = (elapsed, partitions)
            self.set_partitions(index, best[1])
            chosen[net.layers[index].name] = best[1]
        net.clear_param_diffs()
        self.finish()
        return chosen

    def _time_layer(self, index, repeats):
        self.forward(index)                       # warm: buffers allocated, clones built
        needs_backward = self.net.layer_need_backward[index]
        if needs_backward:
            self.backward(index)
        start = time.perf_counter()
        for _ in range(repeats):
            self.forward(index)
            if needs_backward:
                self.backward(index)
        return (time.perf_counter() - start) / repeats
