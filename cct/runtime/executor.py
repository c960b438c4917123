"""The executor: runs a net's layers, each with its chosen number of batch
partitions (Caffe con Troll, Sec. 3.2; cct.runtime.partition), and tells
subscribers about every layer it runs (events).

A partitioned layer's p twins run at once on the process's worker threads
(cct.runtime.threads), each GEMM given T/p BLAS threads. OpenBLAS's thread
count is process-wide, so a partitioned layer sets it to T/p for its duration;
the next whole layer, and the end of every net-level pass (finish), set it
back to T. numpy releases the GIL in GEMM and in its array loops, so the
lowering, pooling and element-wise work of the partitions also runs in
parallel, which one BLAS call with T threads cannot do.

Memory: partition k of every layer runs on the same thread (k = 0 on the
calling thread, k >= 1 on worker k), so the per-thread arenas exist once per
partition index, not once per layer; a twin's lowering budget is the layer's
divided by p, so p partitions at once stay within one budget.

Inference fusion (cct.runtime.fusion): a TEST-phase net, unless the run
settings turn it off, gets a Fusion plan when its executor is made (before
the memory plan, so aliased Split tops count once); forward(i) hands the
layers of a fused run to it, and finish() and every backward run a pass it
still holds.

Events: `subscribe(kind, callback)` with kind before_forward, after_forward,
before_backward or after_backward calls callback(layer_index) around every
layer forward(i) or backward(i) runs (pycaffe's Net.before_forward & co.).
"""
import functools
import logging
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

from cct.core import workspace
from cct.core.arrays import Array
from cct.core.blob import Blob, Layout
from cct.core.layer import TEST, Layer
from cct.core.progress import Progress
from cct.devices import jit, pool
from cct.runtime import fusion as fusion_module
from cct.runtime import hybrid as hybrid_module
from cct.runtime import memory_plan, scheduler
from cct.runtime.plan import Layers, Plan
from cct.runtime import cores, settings
from cct.runtime.choice import FasterOf
from cct.runtime import threads as threads_module
from cct.runtime.partition import PartitionedLayer

# Without a plan entry, a layer whose output has at least this many elements
# splits into one partition per thread (each with 2 images or more); smaller
# layers and InnerProduct run whole; a layer its net never runs backward
# splits at any size, so no OpenBLAS pool thread spins between layers.
# Measured: BENCHMARKS.md, "Batch partitions (Fig. 3)".
DEFAULT_SPLIT_ELEMENTS = 1 << 20

# The tuner skips partition counts whose clones' private parameter diffs
# ((p - 1) copies of the layer's parameters) would hold more than this: fc6's
# 151 MB of weights would cost 453 MB at p = 4, for a GEMM that splits no better.
TUNE_PARAM_COPY_BYTES = 64 << 20

EVENTS = ("before_forward", "after_forward", "before_backward", "after_backward")
_ASK = object()                # Executor._forward_device outside a Net.forward: ask self.device()

log = logging.getLogger("cct.runtime.executor")

Net = Any                             # cct.core.net.Net, which imports this module: not imported back


def _unread_value_shaped_tops(net: Net) -> List[Blob]:
    """The tops of layers that reshape them in forward to the values' count
    (Layer.tops_follow_values) and reshape in their plan step (not
    reshape_reads_layout: the step holds the blobs, not their views) that
    no layer reads: no plan step holds their views."""
    read = {id(blob) for bottoms in net.bottom_vecs for blob in bottoms}
    return [top for layer, tops in zip(net.layers, net.top_vecs)
            if layer.tops_follow_values and not layer.reshape_reads_layout
            for top in tops if id(top) not in read]


def on_host(call: Callable[[], Any], read: List[Blob], written: List[Blob], diffs: bool = False) -> None:
    """Run `call` on the host for a layer without a device path: what it reads
    and writes copied down first; afterwards the blobs it only read are
    current on the device again (their host views were read, not written),
    so the next device layer copies nothing up. `diffs`: it reads and
    writes diffs too (a backward)."""
    for blob in read + written:
        blob.sync_to_host()
    call()
    for blob in read:
        if not any(blob is other for other in written):
            blob.keep_device_copy(diff=diffs)


class Executor:
    """Runs a net's layers, each with its chosen number of batch partitions.

    `plan[layer_index] = p` (1: the layer runs as is, with all BLAS threads),
    set by CCT_PARTITIONS, the run configuration, set_partitions or tune();
    a layer without an entry gets default_partitions. An entry is what was
    asked for: each forward runs at most one partition per sample of the
    batch it has then (fit), so one plan serves every batch size (a test net
    smaller than its train net, a pycaffe reshape to one image). Creating it
    applies the run settings to the net's layers (cct.runtime.settings.apply).
    """

    def __init__(self, net: Net, threads: Optional[int] = None) -> None:
        # The net owns its executor; a weak pointer back, so that a dropped net
        # is freed at once, with no cycle for the garbage collector to find.
        self._net = weakref.ref(net)
        self.blas = threads_module.blas()
        self.settings = settings.resolve(net.phase)
        given = threads or self.settings.workers
        # a count nobody gave follows the cores other processes leave free (fit_threads)
        self._cores = None if given or not self.settings.fit_cores else cores.watch()
        self._threads = self.most_threads = int(given or self.blas.default)
        self._spread = threads_module.Spread(self._threads)
        self.plan: Dict[int, int] = {}
        self._partitioned: Dict[int, PartitionedLayer] = {}
        self._defaults: Dict[int, Tuple[tuple, int]] = {}   # layer index -> (its top shape and settings, default partitions)
        self._listeners: Dict[str, List[Callable[[int], Any]]] = {}   # kind -> callbacks; empty until a subscription
        self.schedule = self.settings.schedule   # sequential, streams, tuned or auto (cct.runtime.scheduler)
        self._streams: Optional[Tuple[tuple, scheduler.Schedule]] = None   # for the streams mode, per net shape
        self._auto: Optional[Tuple[tuple, FasterOf]] = None   # "auto"'s choice for the backward alone, per shape
        self.placed: Dict[int, str] = {}   # layer index -> where its last forward ran on a device: its name or "host"
        self.hybrid: Dict[int, float] = {}  # layer index -> the device's share of its batch (cct.runtime.hybrid)
        self._hybrid_runners: Dict[int, hybrid_module.HybridLayer] = {}
        self._hybrid_key: Optional[tuple] = None   # (shape key, device) the hybrid plan was made for
        self._forwarded: Optional[tuple] = None    # the shape key of the last whole forward on a device
        self._plan: Optional[Plan] = None   # the host's execution plan (cct.runtime.plan), made after a whole forward
        # (Layout.epoch, the net's layout epoch) after the last whole forward layer by layer
        self._laid_out: Optional[Tuple[int, int]] = None
        # CCT_PARTITIONS=p partitions every layer that allows it (the conformance
        # suite runs with it to check partitioned results equal unpartitioned
        # ones); CCT_PARTITIONS=1 runs every layer whole.
        forced = self.settings.forced_partitions
        if forced:                         # 1: every layer whole, the default plan off
            for index in range(len(net.layers)):
                if self.batch(index) is not None:
                    self.plan[index] = forced
        settings.apply(self, self.settings.config)
        self.fusion = fusion_module.plan(net, self.threads) if self.settings.fusion else None
        for blob in _unread_value_shaped_tops(net):
            blob.in_layout = False              # its new rows at every forward keep the plan (Blob.in_layout)
        self.forward_end: Optional[int] = None   # the last layer of the Net.forward under way (fusion's output ReLUs)
        self._forward_device = _ASK   # the device of the Net.forward under way, looked up once for its layers
        # Refused now, before the first forward touches the blobs setup mapped.
        self.memory_plan = memory_plan.net_plan(net, self)
        self.memory_plan.check(f"net '{net.name}' ({net.source})")
        # ... and the rest of what its first forward writes faulted in (cct.formats.pages): now, beside the load
        net.pages.add(self._ahead())
        net.pages.close()

    def _ahead(self) -> List[Array]:
        """What a first forward writes besides the tops (which the net gives
        its FaultIn as it builds them): the calling thread's arena, grown now
        to the largest lowering the memory plan counts for it, and what the
        layers fill ahead (Layer.ahead)."""
        arena = workspace.thread_arena().reserve(self.memory_plan.workspace(0, "lowering"))
        return [arena, *(array for layer in self.net.layers for array in layer.ahead())]

    @property
    def net(self) -> Net:
        net = self._net()
        assert net is not None, "the executor outlived its net"
        return net

    def current_settings(self) -> settings.NetSettings:
        """The net's settings, made again where an explicit call changed a knob."""
        if self.settings.stale():
            self.settings = settings.resolve(self.net.phase)
        return self.settings

    @property
    def threads(self) -> int:
        """The threads the net's layers run on: the count given (the workers
        knob, the constructor, this setter), else the BLAS library's count
        within the cores other processes leave free (fit_threads)."""
        return self._threads

    @threads.setter
    def threads(self, count: int) -> None:
        self._threads = self.most_threads = int(count)
        self._cores = None                      # given: no longer fitted
        self._changed_threads()

    def fit_threads(self) -> None:
        """Where no count was given, run on the cores free now (as the
        process's cores.Watch last measured them), at most most_threads; a
        new count makes a new plan. Asked at every whole forward and
        solver window: a clock read, and /proc/stat every WINDOW_SECONDS."""
        if self._cores is None:
            return
        count = min(self.most_threads, self._cores.free())
        if count != self._threads:
            log.info("threads: %d; %s", count, self._cores.last.describe() if self._cores.last else "")
            self._threads = count
            self._changed_threads()

    def threads_reason(self) -> str:
        """The thread count and why (cct time prints it)."""
        if self._cores is None:
            return f"{self._threads} (given, or fitting turned off)"
        last = self._cores.last
        measured = last.describe() if last is not None else "no window measured yet"
        return f"{self._threads} of at most {self.most_threads}, fitted to the cores free: {measured}"

    def _changed_threads(self) -> None:
        self._plan = None
        self._spread = threads_module.Spread(self._threads)
        if self.fusion is not None:
            self.fusion.threads = self._threads

    def device(self) -> Any:
        """The OpenCL device this net's layers run on now, or None (the host)."""
        return self.current_settings().device()

    # --- events ---------------------------------------------------------------------
    def subscribe(self, kind: str, callback: Callable[[int], Any]) -> None:
        """Call callback(layer_index) at every `kind` event (EVENTS)."""
        if kind not in EVENTS:
            raise ValueError(f"unknown executor event {kind!r}; known: {', '.join(EVENTS)}")
        if not callable(callback):
            raise TypeError(f"{kind}(): the callback must be callable (fn(layer_index)), got {callback!r}")
        self._listeners.setdefault(kind, []).append(callback)
        self._plan = None

    def _emit(self, kind: str, index: int) -> None:
        for callback in self._listeners.get(kind, ()):
            callback(index)

    # --- which layers may be partitioned, and into how many ------------------------
    def batch(self, index: int) -> Optional[int]:
        """The batch size every blob of the layer shares, when the layer may be
        split along it (Layer.can_partition); else None."""
        layer, bottoms, tops = self._layer(index)
        blobs = bottoms + tops
        if not blobs or not layer.can_partition(bottoms, tops):
            return None
        batch = blobs[0].shape[0] if blobs[0].shape else 0
        return batch if all(b.shape and b.shape[0] == batch for b in blobs) else None

    def partitionable(self, index: int) -> bool:
        """The layer may be split (batch() is not None) and its batch has more than one sample."""
        batch = self.batch(index)
        return batch is not None and batch > 1

    def fit(self, index: int, partitions: int) -> int:
        """`partitions` as the layer's current shapes allow: at most one per
        sample of its batch (partitions may then differ by one sample), 1 where
        it cannot be split. A plan entry holds what was asked for at whatever
        batch; this is what runs at the batch of the last reshape."""
        if partitions <= 1:
            return 1
        batch = self.batch(index)
        return min(partitions, batch) if batch else 1

    def set_partitions(self, index: int, partitions: int) -> None:
        """Ask for `partitions` batch partitions of layer `index`, at every
        batch size: a forward runs fit(index, partitions) of them."""
        partitions = int(partitions)
        if partitions < 1:
            raise ValueError(f"{self.net.layers[index].where()}: partitions must be >= 1, got {partitions}")
        if partitions > 1 and self.batch(index) is None:
            raise ValueError(f"{self.net.layers[index].where()}: cannot be batch-partitioned")
        self.plan[index] = partitions
        self._partitioned.pop(index, None)
        self._plan = None

    def partitions(self, index: int) -> int:
        """The batch partitions layer `index` runs at its current shapes: its
        plan entry as fit() allows, else default_partitions."""
        requested = self.plan.get(index)
        return self.default_partitions(index) if requested is None else self.fit(index, requested)

    def default_partitions(self, index: int) -> int:
        """One partition per thread for a large partitionable layer that splits
        by default (Layer.split_by_default; see DEFAULT_SPLIT_ELEMENTS), fewer
        where the twins' parameter diffs would exceed TUNE_PARAM_COPY_BYTES,
        else 1. Kept per top shape: this runs twice per layer and iteration,
        small nets included."""
        tops = self.net.top_vecs[index]
        key = (tops[0].shape if tops else None, self.threads, DEFAULT_SPLIT_ELEMENTS, TUNE_PARAM_COPY_BYTES)
        known = self._defaults.get(index)
        if known is not None and known[0] == key:
            return known[1]
        partitions: int = 1
        layer = self.net.layers[index]
        if (self.threads >= 2 and layer.split_by_default and tops
                and (tops[0].count >= DEFAULT_SPLIT_ELEMENTS or not layer.runs_backward)
                and self.partitionable(index) and tops[0].shape[0] >= 2 * self.threads):
            # (on a many-core host, p - 1 copies of a convolution's weights add up)
            partitions = int(min(self.threads, self._most_partitions(index)))
        self._defaults[index] = (key, partitions)
        return partitions

    def _most_partitions(self, index: int) -> float:
        """The most partitions whose twins' private parameter diffs ((p - 1)
        copies of the layer's parameters) stay within TUNE_PARAM_COPY_BYTES."""
        param_bytes = sum(blob.count * blob.dtype.itemsize for blob in self.net.layers[index].blobs)
        return 1 + TUNE_PARAM_COPY_BYTES // param_bytes if param_bytes else float("inf")

    # --- running -----------------------------------------------------------------
    def workers(self, count: int) -> list:
        """The process's worker threads for `count` units run at once (the
        caller runs one itself): worker k - 1 runs unit k."""
        return threads_module.workers(count)

    def spread(self, partitions: int) -> Optional[threads_module.Spread]:
        """How a layer run in `partitions` spreads its own passes: on every
        thread where it runs whole (Layer.run_partitions), else not."""
        return self._spread if partitions == 1 and self._spread.count > 1 else None

    def blas_count(self, partitions: int) -> int:
        """The BLAS threads each of `partitions` batch partitions runs with."""
        return self.threads if partitions == 1 else max(1, self.threads // partitions)

    def _layer(self, index: int) -> Tuple[Layer, List[Blob], List[Blob]]:
        net = self.net
        return net.layers[index], net.bottom_vecs[index], net.top_vecs[index]

    def _runner(self, index: int, partitions: Optional[int] = None) -> PartitionedLayer:
        partitions = self.partitions(index) if partitions is None else partitions
        runner = self._partitioned.get(index)
        if runner is None or runner.partitions != partitions:
            runner = self._partitioned[index] = PartitionedLayer(self.net.layers[index], partitions)
        return runner

    def forward(self, index: int, set_blas: bool = True) -> float:
        """Run layer `index` forward (reshape first, as Caffe's Layer::Forward,
        where its blobs changed: Layer.reshape_if_changed),
        set its loss tops' diffs to their loss weights, and return its weighted
        loss. set_blas=False leaves the BLAS thread count as it is (a stream
        of cct.runtime.scheduler, which sets it for the sub-tasks it runs at once).
        A layer of a fused run (cct.runtime.fusion) is reshaped and left to
        its run's pass; per-layer callbacks and streams see every layer run."""
        if self._listeners:
            self._emit("before_forward", index)
        fusion = self.fusion
        device = self._forward_device
        if device is _ASK:
            device = self.device()
        if device is not None:
            if fusion is not None:
                fusion.flush()
            if index == 0:
                self._plan_hybrid(device)
            self.run_on(device, index)
            if index == len(self.net.layers) - 1:
                self._forwarded = self.shape_key()
            loss = self._loss(index, device)
            if self._listeners:
                self._emit("after_forward", index)
            return loss
        relu = None
        if fusion is not None:
            if self._listeners or not set_blas:
                fusion.flush()
            elif fusion.forward(index, self.forward_end):
                return self._loss(index)
            else:
                relu = fusion.output_relu(index, self.forward_end)
        if relu is None:
            self.run_layer(index, set_blas)
        else:
            self._run_with_relu(index, relu)
        loss = self._loss(index)
        if self._listeners:
            self._emit("after_forward", index)
        return loss

    # --- whole passes: the plan's steps where one holds ---------------------------------
    def _current_plan(self) -> Optional[Plan]:
        """The execution plan, where the host runs every layer in turn with
        nobody listening and a plan for this layout and these settings exists."""
        plan = self._plan
        if plan is None or self._listeners or self._forward_device is not None:
            return None
        return plan if plan.current(self.settings.version) else None

    def drop_plan(self) -> None:
        """The next whole forward runs layer by layer and makes a new plan."""
        self._plan = None

    def forward_range(self, start: int, end: int) -> float:
        """Layers start..end forward (Net.forward); their summed loss."""
        pooled = False
        try:
            self.begin_forward(end)             # inside: a bad CCT_GPU still ends the forward
            pooled = self._lend_pool()
            plan = self._current_plan()
            if plan is not None and plan.params_changed():
                self.drop_plan()                # remade after this forward, with the new parameters
            elif plan is not None and plan.covers(start, end):
                return self._forward_planned(plan, start, end)
            loss = 0.0
            for index in range(start, end + 1):
                loss += self.forward(index)
            if (start == 0 and end == len(self.net.layers) - 1 and not self._listeners
                    and self._forward_device is None):
                # every layer reshaped and chose for these shapes; a plan (tens of binds) only
                # for a layout a whole forward saw twice, not for shapes that change every time
                laid_out = (Layout.epoch, self.net.layout.epoch)
                if self._laid_out == laid_out:
                    self._plan = None
                    self._plan = self._make_plan()
                self._laid_out = laid_out
        finally:
            self.end_forward()                  # a failing layer leaves no lowered BLAS count
            if pooled:
                pool.release()
            jit.warm_up()                       # numba's start-up after the first forward: its kernels' twins ran
        return loss

    def _forward_planned(self, plan: Plan, start: int, end: int) -> float:
        """The plan's steps, and the executor's per-layer path where the plan
        hands a layer back: a step it left to it, a fused run without a kept
        pass (the next plan keeps the one this composes), or the rest of a
        forward whose layout a reshape changed."""
        loss, index = plan.forward(start, end)
        while index <= end:
            if not plan.current(self.settings.version):
                for rest in range(index, end + 1):
                    loss += self.forward(rest)
                return loss
            last = plan.group_end.get(index, index)
            for member in range(index, last + 1):
                loss += self.forward(member)
            if index in plan.run_starts:
                self.drop_plan()                # its pass is kept now, outside this plan's ParamWatch
            part, index = plan.forward(last + 1, end)
            loss += part
        return loss

    def _make_plan(self) -> Plan:
        """The plan for the net's current shapes: each layer's partitions,
        BLAS threads and partition runners decided here, bound by the plan."""
        count = len(self.net.layers)
        partitions = [self.partitions(index) for index in range(count)]
        split = [index for index in range(count) if partitions[index] > 1]
        decided = Layers(partitions=partitions, blas=[self.blas_count(p) for p in partitions],
                         runners={index: self._runner(index, partitions[index]) for index in split},
                         workers={index: self.workers(partitions[index]) for index in split})
        return Plan(self.net, decided, self.blas, self.settings.version, self.shape_key(), self.fusion)

    def backward_range(self, start: int, end: int) -> None:
        """Layers start..end backward (Net.backward; start >= end)."""
        pooled = self._lend_pool()
        try:
            if start == len(self.net.layers) - 1 and end == 0:
                self.backward_all()             # the whole net: the schedule decides
                return
            plan = self._backward_plan()
            if plan is not None:
                plan.backward(start, end)
                return
            for index in range(start, end - 1, -1):
                self.backward(index)
        finally:
            self.finish()
            if pooled:
                pool.release()

    def _backward_plan(self) -> Optional[Plan]:
        """The plan for a backward on the host, layer after layer."""
        plan = self._plan
        if plan is None or self._listeners or not plan.current(self.settings.version) or self.device() is not None:
            return None
        if self.fusion is not None:
            self.fusion.before_backward()
        return plan

    def _loss(self, index: int, device: Any = None) -> float:
        net = self.net
        if device is not None:
            return net.layers[index].weighted_loss_on(device, net.top_vecs[index])
        return net.layers[index].weighted_loss(net.top_vecs[index])

    def _lend_pool(self) -> bool:
        """A pass of a TEST-phase net runs OpenBLAS's jobs on the one pool,
        where its parallel kernels (fused passes, Winograd's transforms,
        poolings, ...) run too; a training net has none, and its steps took
        1.02-1.12x the time with its GEMMs on the pool, so it keeps OpenBLAS's
        threads (BENCHMARKS.md,
        "One pool: OpenBLAS's jobs on numba's OpenMP threads (2026-12-07, d12282a-fdc61df)").
        So does a pass with layers in batch partitions: the pool's threads,
        still spinning after a whole layer's parallel kernel, held the cores
        the partitions' workers needed (BENCHMARKS.md, "Batch partitions beside
        the pool"). Pair a True with pool.release()."""
        return self.net.phase == TEST and not self.partitioned() and pool.acquire(self.threads)

    def partitioned(self) -> bool:
        """Whether some layer runs in batch partitions at the current shapes (the plan's answer where there is one)."""
        plan = self._current_plan()
        if plan is not None:
            return plan.partitioned
        return any(self.partitions(index) > 1 for index in range(len(self.net.layers)))

    def begin_forward(self, end: Optional[int]) -> None:
        """A Net.forward through layer `end` starts: a ReLU is fused only into a
        forward that reaches it, and the device is looked up once for all its
        layers."""
        self.forward_end = end
        self._forward_device = self.device()
        self.fit_threads()
        self.blas.sync()

    def end_forward(self) -> None:
        self.forward_end = None
        self._forward_device = _ASK
        if self._cores is not None:
            self._cores.idle()                  # a pause until the next forward is not measured (cores.Watch)
        self.finish()

    def _run_with_relu(self, index: int, relu: Tuple[int, float]) -> None:
        """Convolution `index` with the ReLU after it in its output store
        (cct.runtime.fusion, rule 2), which then skips that ReLU."""
        relu_index, slope = relu
        layer = self.net.layers[index]
        layer.fuse_output_relu(slope)
        try:
            self.run_layer(index)
        finally:
            layer.fuse_output_relu(None)
        if self.fusion is not None:
            self.fusion.applied = relu_index

    def run_layer(self, index: int, set_blas: bool = True) -> None:
        """Layer `index`'s reshape and forward, in its batch partitions."""
        layer, bottoms, tops = self._layer(index)
        with layer.naming_allocations(tops):
            layer.reshape_if_changed(bottoms, tops)
            # decided anew at every reshape: a batch that shrank gets fewer partitions
            partitions = self.partitions(index)
            layer.run_partitions(partitions, self.blas_count(partitions), self.spread(partitions))
            if set_blas:
                self.blas.set(self.blas_count(partitions))
            if partitions == 1:
                layer.forward(bottoms, tops)
            else:
                self._runner(index, partitions).forward(self.workers(partitions), bottoms, tops)

    def run_on(self, device: Any, index: int) -> None:
        """Layer `index`'s reshape and forward on `device`, whole: with its
        device path where it has one for these blobs, else on the host with
        the blobs synced (Caffe's fallback to Forward_cpu)."""
        layer, bottoms, tops = self._layer(index)
        with layer.naming_allocations(tops):
            layer.reshape_if_changed(bottoms, tops)
            layer.run_partitions(1)
            split = self._split(device, index)
            if split is not None:
                split.forward(bottoms, tops)
                self.placed[index] = f"hybrid: {split.share:.2f} of the batch on {device.name}"
            elif layer.runs_on(device, bottoms, tops) and self.hybrid.get(index) != 0:
                layer.forward_on(device, bottoms, tops)
                self.placed[index] = device.name
            else:
                self.blas.set(self.threads)
                on_host(lambda: layer.forward(bottoms, tops), read=bottoms, written=tops)
                self.placed[index] = "host"

    def _plan_hybrid(self, device: Any) -> None:
        """At a forward's start on a device, with the hybrid split on: the
        plan for the net's shapes (cct.runtime.hybrid.plan), made once a whole
        forward at those shapes ran (its blobs are what the FLOPS rule times
        each layer on); until then layers run whole."""
        wanted = self.current_settings().hybrid
        if wanted is None:
            return
        key = (self.shape_key(), device)
        if self._hybrid_key == key or self._forwarded != key[0]:
            return
        self.hybrid = hybrid_module.plan(self.net, device, wanted)
        self._hybrid_key = key
        log.info("Hybrid split on %s: %s", device.name, ", ".join(
            f"{self.net.layers[index].name} {share:.2f}" for index, share in sorted(self.hybrid.items())) or "none")

    def _split(self, device: Any, index: int) -> Optional[hybrid_module.HybridLayer]:
        """The HybridLayer running layer `index` split between the host and
        `device` at its hybrid share, or None: no share, a share of 0 or 1
        (the layer runs whole: on the host, on the device), no device path,
        or a batch it cannot split."""
        share = self.hybrid.get(index)
        if share is None or not 0 < share < 1 or self.batch(index) is None:
            return None
        layer, bottoms, tops = self._layer(index)
        if not layer.runs_on(device, bottoms, tops):
            return None
        runner = self._hybrid_runners.get(index)
        if runner is None or runner.device is not device or runner.share != share:
            runner = self._hybrid_runners[index] = hybrid_module.HybridLayer(layer, device, share)
        return runner

    def backward_on(self, device: Any, index: int) -> None:
        """Layer `index`'s backward on `device` (see run_on)."""
        layer, bottoms, tops = self._layer(index)
        propagate_down = self.net.bottom_need_backward[index]
        with layer.naming_allocations(tops):
            split = self._split(device, index)
            if split is not None:
                split.backward(tops, propagate_down, bottoms)
            elif layer.runs_on(device, bottoms, tops) and self.hybrid.get(index) != 0:
                layer.backward_on(device, tops, propagate_down, bottoms)
            else:
                self.blas.set(self.threads)
                on_host(lambda: layer.backward(tops, propagate_down, bottoms), read=tops + layer.blobs,
                        written=bottoms + layer.blobs, diffs=True)

    def backward(self, index: int, force: bool = False) -> None:
        """Run layer `index` backward if the net needs its backward (or `force`:
        `cct time` runs every layer's, as Caffe's does). The events fire either way."""
        if self.fusion is not None:
            self.fusion.before_backward()
        if self._listeners:
            self._emit("before_backward", index)
        device = self.device()
        if device is not None and (force or self.net.layer_need_backward[index]):
            self.backward_on(device, index)
        elif force or self.net.layer_need_backward[index]:
            partitions = self.partitions(index)
            self.blas.set(self.threads if partitions == 1 else max(1, self.threads // partitions))
            self.layer_backward(index, partitions)
        if self._listeners:
            self._emit("after_backward", index)

    def layer_backward(self, index: int, partitions: Optional[int] = None) -> None:
        """Layer `index`'s whole backward in its batch partitions (its plan's,
        unless the caller looked them up already), the BLAS count left as it is
        (a stream of cct.runtime.scheduler calls this)."""
        layer, bottoms, tops = self._layer(index)
        propagate_down = self.net.bottom_need_backward[index]
        partitions = self.partitions(index) if partitions is None else partitions
        with layer.naming_allocations(tops):
            if partitions == 1:
                layer.backward(tops, propagate_down, bottoms)
            else:
                self._runner(index, partitions).backward(self.workers(partitions), tops, propagate_down, bottoms)

    def layer_backward_param(self, index: int, param: int) -> None:
        """Layer `index`'s gradient of parameter `param` (Layer.backward_param),
        in its batch partitions: a stream's sub-task, the BLAS count left as it is."""
        layer, bottoms, tops = self._layer(index)
        partitions = self.partitions(index)
        with layer.naming_allocations(tops):
            if partitions == 1:
                layer.backward_param(param, tops, bottoms)
            else:
                self._runner(index, partitions).backward_param(self.workers(partitions), param, tops, bottoms)

    def layer_backward_data(self, index: int) -> None:
        """Layer `index`'s bottom gradients (Layer.backward_data), in its batch partitions."""
        layer, bottoms, tops = self._layer(index)
        propagate_down = self.net.bottom_need_backward[index]
        partitions = self.partitions(index)
        with layer.naming_allocations(tops):
            if partitions == 1:
                layer.backward_data(tops, propagate_down, bottoms)
            else:
                self._runner(index, partitions).backward_data(self.workers(partitions), tops, propagate_down,
                                                              bottoms)

    def finish(self) -> None:
        """The pass of a fused run a forward stopped inside, then all BLAS
        threads again, for whatever runs after the net."""
        if self.fusion is not None:
            self.fusion.flush()
        self.blas.set(self.threads)

    @property
    def listened(self) -> bool:
        """Whether per-layer callbacks are subscribed (they see layers one at a time)."""
        return bool(self._listeners)

    def listeners(self) -> List[Callable[[int], Any]]:
        """Every subscribed callback, of any kind."""
        return [callback for callbacks in self._listeners.values() for callback in callbacks]

    # --- the whole backward, in the schedule's mode ----------------------------------
    def backward_all(self) -> None:
        """Every layer's backward: layer after layer (sequential), or as
        sub-tasks on streams (cct.runtime.scheduler), or, with "auto", the
        faster of the two as measured on this net and shape. Per-layer
        callbacks see layers one at a time, so with a subscriber the mode is
        sequential. The numbers are the same in every mode."""
        if self.fusion is not None:
            self.fusion.before_backward()
        device = self.device()
        if self._listeners or self.schedule != "auto" or device is not None:
            # a device's one in-order queue runs the layers in turn: sequential
            sequential = self._listeners or device is not None
            self._backward_in("sequential" if sequential else self.schedule)
            return
        key = self.shape_key()
        if self._auto is None or self._auto[0] != key:
            self._auto = (key, FasterOf(("sequential", "streams"), "schedule auto (backward)"))
        choice = self._auto[1]
        mode = choice.next()
        start = time.perf_counter()
        self._backward_in(mode)
        choice.record(mode, time.perf_counter() - start)

    def _backward_in(self, mode: str) -> None:
        if mode in ("streams", "tuned"):       # a backward alone is not tuned: streams
            scheduler.run_on_streams(self.stream_schedule())
            return
        last = len(self.net.layers) - 1
        plan = self._backward_plan()
        if plan is not None:
            plan.backward(last, 0)
            return
        for index in range(last, -1, -1):
            self.backward(index)

    def shape_key(self) -> tuple:
        """What a schedule is built for: every blob's shape, every layer's
        batch partitions at those shapes and the thread count (the plan's,
        while it holds)."""
        plan = self._plan
        if plan is not None and plan.current(self.settings.version):
            return plan.shape_key
        return (tuple(blob.shape for blob in self.net.blobs.values()),
                tuple(self.partitions(i) for i in range(len(self.net.layers))), self._threads)

    def stream_schedule(self) -> scheduler.Schedule:
        """The streams mode's Schedule for the net's current shapes and batch
        partitions (built once for each)."""
        key = self.shape_key()
        if self._streams is None or self._streams[0] != key:
            self._streams = (key, scheduler.Schedule(self.net, self.steps(), **self.settings.priorities))
        return self._streams[1]

    def steps(self) -> "Steps":
        """The net's sub-tasks as this executor runs them at its current
        shapes (cct.runtime.graph.Steps): what the schedules and the tuner
        are handed, so that they never call the executor by name."""
        return Steps(self)

    # --- choosing p per layer by measurement ---------------------------------------
    def tune(self, candidates: Optional[List[int]] = None, repeats: int = 2) -> Dict[str, int]:
        """Time each partitionable layer's forward+backward with every candidate p
        on the net's current data, keep the fastest per layer. Returns the plan.
        Candidates whose parameter copies exceed TUNE_PARAM_COPY_BYTES are not tried."""
        net = self.net
        candidates = candidates or sorted({1, self.threads, 2 * self.threads})
        net.forward()                             # blobs hold real shapes and values
        chosen = {}
        tunable = [index for index in range(len(net.layers)) if self.partitionable(index)]
        try:
            with Progress("tune partitions", total=len(tunable), unit="layers") as progress:
                for index in progress.track(tunable):
                    chosen[net.layers[index].name] = self._tune_layer(index, candidates, repeats)
        finally:
            self.finish()
        net.clear_param_diffs()
        return chosen

    def _tune_layer(self, index: int, candidates: List[int], repeats: int) -> int:
        """The fastest candidate p for layer `index`, set in the plan and returned."""
        best = None
        most = self._most_partitions(index)
        for partitions in candidates:
            if partitions > most or self.fit(index, partitions) != partitions:
                continue                          # a count this batch cannot run is not timed
            self.set_partitions(index, partitions)
            elapsed = self._time_layer(index, repeats)
            if best is None or elapsed < best[0]:
                best = (elapsed, partitions)
        chosen = 1 if best is None else best[1]       # no candidate fits: the layer runs whole
        self.set_partitions(index, chosen)
        return chosen

    def _time_layer(self, index: int, repeats: int) -> float:
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


class Steps:
    """cct.runtime.graph.Steps for an executor at the shapes, partitions and
    thread count it had when made: a sub-task's layer forward, backward or
    split gradient in the layer's batch partitions, the BLAS count left to
    the schedule that runs it."""

    def __init__(self, executor: Executor) -> None:
        self.threads, self.blas, self.config = executor.threads, executor.blas, executor.settings.config
        self.identity = executor.shape_key()
        self.partitions = executor.partitions
        self.forward = functools.partial(executor.forward, set_blas=False)
        self.backward = executor.layer_backward
        self.backward_data = executor.layer_backward_data
        self.backward_param = executor.layer_backward_param
        self.finish = executor.finish
