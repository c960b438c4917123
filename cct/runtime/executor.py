"""Batch partitioning (Caffe con Troll, Sec. 3.2): a layer's batch is split into
p partitions that run in parallel on persistent worker threads, each GEMM
given T/p BLAS threads.

OpenBLAS's thread count is process-wide, so a partitioned layer sets it to T/p
for its duration and back to T after. numpy releases the GIL in GEMM and in
its array loops, so the lowering, pooling and element-wise work of the
partitions also runs in parallel, which one BLAS call with T threads cannot do.

A partition runs a shallow clone of the layer on BlobSlice views of the batch,
so per-forward state (pooling argmax, saved inputs) stays per partition; the
clones' parameter blobs share data with the layer's; the first clone
accumulates into the layer's own diffs, the others into diffs of their own,
which are summed into the layer's after backward (no race on `+=`).
The unit of work is (layer, partition, pass), what a scheduler places on a
worker with a chosen thread count.

Memory: partition k of every layer runs on the same thread (k = 0 on the
calling thread, k >= 1 on worker k), so the per-thread work stores
(Layer.work, the convolutions' lowering arenas) exist once per partition index,
not once per pool thread; a clone's lowering budget is the layer's divided by
p, so p partitions at once stay within one budget.
"""
import copy
import os
import time
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
from threadpoolctl import ThreadpoolController

from cct.core.blob import Blob
from cct.core.errors import ShapeError

# Layer types whose work is independent across the batch axis (axis 0) and safe
# to run as clones: no cross-sample statistics, no shared random stream.
PARTITIONABLE_TYPES = {
    "Convolution", "Deconvolution", "Im2col", "Pooling", "LRN", "InnerProduct", "MVN",
    "ReLU", "PReLU", "ELU", "Sigmoid", "TanH", "AbsVal", "BNLL", "Power", "Exp", "Log",
    "Swish", "Clip",
}


# Without a plan entry, a layer whose output has at least this many elements
# is split into one partition per thread (when each gets 2 images or more):
# what the tuner picks for CaffeNet's convolution, pooling, LRN and ReLU
# layers. Smaller layers and InnerProduct (one GEMM splits as well across
# BLAS threads, and its clones would copy the weights' diffs) run whole.
DEFAULT_SPLIT_ELEMENTS = 1 << 20

# The tuner skips partition counts whose clones' private parameter diffs
# ((p - 1) copies of the layer's parameters) would hold more than this: fc6's
# 151 MB of weights would cost 453 MB at p = 4, for a GEMM that splits no better.
TUNE_PARAM_COPY_BYTES = 64 << 20


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
        self._diff = None                 # the blob's diff is made only if a layer asks
        self._rows = (blob, start, stop)

    def _allocate_diff(self):
        blob, start, stop = self._rows
        self._diff = blob.diff[start:stop]
        return self._diff

    def reshape(self, *shape):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        if tuple(int(d) for d in shape) != self._shape:
            raise ShapeError(f"a batch partition of shape {self._shape} cannot be reshaped to {shape}")

    def share_data(self, other):
        raise ShapeError("a batch partition cannot share storage")

    share_diff = share_data


class ParamView(Blob):
    """A clone's parameter: the layer's data; the layer's diff (`shares_diff`) or
    a private one, made on first use."""

    def __init__(self, blob, shares_diff):
        self.dtype = blob.dtype
        self._shape = blob.shape
        self.shares_diff = shares_diff
        self._diff = None
        self.follow(blob)

    def follow(self, blob):
        """Track the layer's current storage (share_with and copy_from may replace it)."""
        self._data = blob.data
        if self.shares_diff:
            self._diff = None
            self._blob = blob

    def _allocate_diff(self):
        self._diff = self._blob.diff if self.shares_diff else np.zeros(self._shape, self.dtype)
        return self._diff

    def reshape(self, *shape):
        raise ShapeError("a partition clone cannot reshape a parameter")


class PartitionedLayer:
    """Runs `layer` over `partitions` slices of the batch in parallel."""

    # Settings a scheduler or the user may change on the layer after its clones
    # were made, passed on before every run (a convolution's lowering_type
    # needs none: the clones read their original's).
    FOLLOWED = ("lowering_budget",)

    def __init__(self, layer, partitions):
        self.layer = layer
        self.partitions = partitions
        self.clones = []
        for index in range(partitions):
            clone = copy.copy(layer)
            clone.blobs = [ParamView(blob, shares_diff=index == 0) for blob in layer.blobs]
            self.clones.append(clone)

    def _follow_settings(self):
        for name in self.FOLLOWED:
            if name not in vars(self.layer):
                continue
            value = getattr(self.layer, name)
            if name == "lowering_budget" and value:
                # the partitions run at once: together within the layer's budget
                value = max(1, value // self.partitions)
            for clone in self.clones:
                setattr(clone, name, value)

    def _bounds(self, batch):
        edges = np.linspace(0, batch, self.partitions + 1).astype(int)
        return list(zip(edges[:-1], edges[1:]))

    def _views(self, bottoms, tops):
        self._follow_settings()
        batch = bottoms[0].shape[0]
        for (start, stop), clone in zip(self._bounds(batch), self.clones):
            for view, blob in zip(clone.blobs, self.layer.blobs):
                view.follow(blob)
            bottom_views = [BlobSlice(b, start, stop) for b in bottoms]
            # An in-place top gets the very view of its bottom, so the clone sees in-place.
            top_views = [next((v for b, v in zip(bottoms, bottom_views) if b is t), None)
                         or BlobSlice(t, start, stop) for t in tops]
            yield clone, bottom_views, top_views

    def forward(self, workers, bottoms, tops):
        def run(clone, bottom_views, top_views):
            clone.reshape(bottom_views, top_views)
            clone.forward(bottom_views, top_views)
        run_all(workers, run, self._views(bottoms, tops))

    def backward(self, workers, tops, propagate_down, bottoms):
        def run(clone, bottom_views, top_views):
            clone.param_propagate_down = self.layer.param_propagate_down
            clone.backward(top_views, propagate_down, bottom_views)
        run_all(workers, run, self._views(bottoms, tops))
        for index, blob in enumerate(self.layer.blobs):
            if self.layer.param_propagate_down[index]:
                for clone in self.clones[1:]:        # clone 0 wrote into blob.diff itself
                    private = clone.blobs[index]._diff
                    if private is not None:
                        blob.diff += private
                        private[...] = 0


def run_all(workers, function, work):
    """Unit k on workers[k - 1], unit 0 on this thread; waits for all of them
    and re-raises the first exception (in partition order)."""
    work = list(work)
    futures = [worker.submit(function, *unit) for worker, unit in zip(workers, work[1:])]
    try:
        function(*work[0])
    finally:
        wait(futures)                 # no partition may still write when this returns
    for future in futures:
        future.result()


class Executor:
    """Runs a net's layers, each with its chosen number of batch partitions.

    `plan[layer_index] = p` (1: the layer runs as is, with all BLAS threads),
    set by CCT_PARTITIONS, the run configuration, set_partitions or tune();
    a layer without an entry gets default_partitions.
    """

    def __init__(self, net, threads=None):
        self.net = net
        self.blas = BlasThreads()
        self.threads = int(threads or os.environ.get("CCT_THREADS", 0) or self.blas.default)
        self.plan = {}
        self._partitioned = {}
        self._defaults = {}           # layer index -> (its top shape and settings, default partitions)
        self._workers = []            # worker k - 1 runs partition k of every layer
        # CCT_PARTITIONS=p partitions every layer that allows it (the conformance
        # suite runs with it to check partitioned results equal unpartitioned
        # ones); CCT_PARTITIONS=1 runs every layer whole.
        forced = int(os.environ.get("CCT_PARTITIONS", 0) or 0)
        if forced >= 1:                    # 1: every layer whole, the default plan off
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
        partitions = self.plan.get(index)
        return self.default_partitions(index) if partitions is None else partitions

    def default_partitions(self, index):
        """One partition per thread for a large partitionable layer other than
        InnerProduct (see DEFAULT_SPLIT_ELEMENTS), fewer where the clones'
        parameter diffs would exceed TUNE_PARAM_COPY_BYTES, else 1. Kept per
        top shape: this runs twice per layer and iteration, small nets included."""
        tops = self.net.top_vecs[index]
        key = (tops[0].shape if tops else None, self.threads, DEFAULT_SPLIT_ELEMENTS, TUNE_PARAM_COPY_BYTES)
        known = self._defaults.get(index)
        if known is not None and known[0] == key:
            return known[1]
        partitions = 1
        if (self.threads >= 2 and self.net.layers[index].type != "InnerProduct" and tops
                and tops[0].count >= DEFAULT_SPLIT_ELEMENTS and self.partitionable(index)
                and tops[0].shape[0] >= 2 * self.threads):
            # (on a many-core host, p - 1 copies of a convolution's weights add up)
            partitions = min(self.threads, self._most_partitions(index))
        self._defaults[index] = (key, partitions)
        return partitions

    def _most_partitions(self, index):
        """The most partitions whose clones' private parameter diffs ((p - 1)
        copies of the layer's parameters) stay within TUNE_PARAM_COPY_BYTES."""
        param_bytes = sum(blob.count * blob.dtype.itemsize for blob in self.net.layers[index].blobs)
        return 1 + TUNE_PARAM_COPY_BYTES // param_bytes if param_bytes else float("inf")

    # --- running -----------------------------------------------------------------
    def workers(self, count):
        """The persistent worker threads for `count` units run at once (the
        caller runs one itself): worker k - 1 runs unit k."""
        return self._workers_for(count)

    def _workers_for(self, partitions):
        while len(self._workers) < partitions - 1:
            self._workers.append(ThreadPoolExecutor(max_workers=1,
                                                    thread_name_prefix=f"cct-partition-{len(self._workers) + 1}"))
        return self._workers

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
        self._runner(index).forward(self._workers_for(partitions), bottoms, tops)

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
        self._runner(index).backward(self._workers_for(partitions), tops, propagate_down, bottoms)

    def finish(self):
        self.blas.set(self.threads)

    # --- choosing p per layer by measurement ---------------------------------------
    def tune(self, candidates=None, repeats=2):
        """Time each partitionable layer's forward+backward with every candidate p
        on the net's current data, keep the fastest per layer. Returns the plan.
        Candidates whose parameter copies exceed TUNE_PARAM_COPY_BYTES are not tried."""
        net = self.net
        candidates = candidates or sorted({1, self.threads, 2 * self.threads})
        net._forward()                            # blobs hold real shapes and values
        chosen = {}
        for index in range(len(net.layers)):
            if not self.partitionable(index):
                continue
            best = None
            most = min(net.bottom_vecs[index][0].shape[0], self._most_partitions(index))
            for partitions in candidates:
                if partitions > most:
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
