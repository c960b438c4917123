"""Backward sub-tasks on concurrent streams, highest critical-path priority
first (TurboDL, rebuilt for CPU worker threads).

A net's backward becomes the sub-tasks of cct.runtime.graph: per layer its
data gradient (the critical chain: the layer below waits for it) and one
sub-task per parameter gradient (needed only by the update). They run on a
few streams, one worker thread each serving its stream in order:

    stream 0  data gradients, and the whole backward of layers that do not split it
    stream 1  weight gradients (parameter 0)
    stream 2  every other parameter's gradient (biases, Scale's bias, ...)

The stream count does not grow with depth. Nothing blocks a worker on an
unready input: the dispatcher (the calling thread) counts each sub-task's
unfinished predecessors and hands a stream its next sub-task only when that
stream is idle, choosing the highest-priority ready one, so a critical
sub-task that becomes ready later still overtakes waiting non-critical ones
(the CPU has no hardware stream priorities: the paper's "method one").

Priority: a sub-task's critical-path length, its own time plus the longest
chain of successors' times to the end of backward (an upward rank over the
graph: the fork-to-merge paths of an inception unit or a residual block get
their distances from it without naming blocks), less `alpha` for a weight
gradient and `beta` for other parameter gradients, which keeps them behind
data gradients of equal rank. Times come from the layers' FLOP counts until
`profile()` has measured them.

OpenBLAS's thread count is process-wide: while streams run, each GEMM gets
T / (streams that run GEMMs at once) threads (`blas_threads`), so two
concurrent GEMMs do not oversubscribe the cores.
"""
import heapq
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from cct.runtime import graph as graph_module

DATA_STREAM, WEIGHT_STREAM, OTHER_STREAM = 0, 1, 2


@dataclass(frozen=True)
class Span:
    """One sub-task of a run, perf_counter seconds: when the dispatcher saw it
    ready, handed it to its stream, and when it started and ended there."""
    task: object
    stream: int
    ready: float
    dispatched: float
    start: float
    end: float

ALPHA = 0.5            # priority taken off a weight gradient, in units of the critical path's mean task time
BETA = 1.0             # ... and off every other parameter gradient


def stream_of(task):
    if task.kind == graph_module.BACKWARD_PARAM:
        return WEIGHT_STREAM if task.param == 0 else OTHER_STREAM
    return DATA_STREAM


class CpuStream:
    """A stream served by one worker thread, in the order sub-tasks are given.
    (An OpenCL device's queue will be another kind of stream: submit and done.)"""

    def __init__(self, index):
        self.index = index
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"cct-stream-{index}")

    def submit(self, function, done):
        """Run function() on the stream, then done(error or None) on its thread."""
        def run():
            try:
                function()
            except BaseException as error:       # handed to the dispatcher, which re-raises
                done(error)
                return
            done(None)
        self._worker.submit(run)


_streams = []
_streams_lock = threading.Lock()


def cpu_streams(count):
    """The process's CPU streams (made on first use, kept for every net)."""
    with _streams_lock:
        while len(_streams) < count:
            _streams.append(CpuStream(len(_streams)))
        return _streams[:count]


class Schedule:
    """The backward sub-tasks of one net, their streams and priorities; run()
    runs one backward. Built for the net's current shapes and needs."""

    def __init__(self, net, alpha=ALPHA, beta=BETA, times=None):
        self.net = net
        self.alpha, self.beta = alpha, beta
        built = graph_module.build(net, iterations=1, update=False)
        backward = [task for task in built.tasks if task.kind not in (graph_module.FORWARD, graph_module.CLEAR)]
        members = set(backward)
        self.tasks = backward
        # edges from forward sub-tasks are met before backward starts
        self.edges = {task: {earlier for earlier in built.edges[task] if earlier in members} for task in backward}
        self.following = {task: [] for task in backward}
        for task, before in self.edges.items():
            for earlier in before:
                self.following[earlier].append(task)
        self.times = dict(times) if times else self._estimated_times()
        self.priority = self._priorities()
        self.trace = []                     # Span per sub-task of the last run

    # --- priorities -----------------------------------------------------------------
    def _estimated_times(self):
        """Seconds per sub-task from FLOP counts at 50 GFLOP/s, plus a floor for
        the memory-bound ones: only their ratios matter, until measured."""
        net, times = self.net, {}
        for task in self.tasks:
            layer = net.layers[task.layer]
            forward, data, params = layer.flops(net.bottom_vecs[task.layer], net.top_vecs[task.layer])
            flops = {graph_module.BACKWARD_DATA: data, graph_module.BACKWARD_PARAM: params,
                     graph_module.BACKWARD: data + params}[task.kind]
            times[task] = 1e-5 + flops / 50e9
        return times

    def _priorities(self):
        """Upward rank (critical-path length to the end of backward), less
        alpha / beta (scaled by the mean time) for parameter gradients."""
        rank = {}
        for task in reversed(self.tasks):              # the sequential order is topological
            later = [rank[successor] for successor in self.following[task]]
            rank[task] = self.times[task] + (max(later) if later else 0.0)
        unit = sum(self.times.values()) / max(1, len(self.times))
        priority = {}
        for task in self.tasks:
            offset = 0.0
            if task.kind == graph_module.BACKWARD_PARAM:
                offset = (self.alpha if task.param == 0 else self.beta) * unit
            priority[task] = rank[task] - offset
        return priority

    def profile(self, runs=2):
        """Measure each sub-task's time (sequentially, `runs` times, keeping the
        fastest) and recompute the priorities from the measurements."""
        run = graph_module.Runner(self.net)
        best = {}
        for _ in range(runs):
            for task in self.tasks:
                start = time.perf_counter()
                run(task)
                elapsed = time.perf_counter() - start
                best[task] = min(elapsed, best.get(task, elapsed))
        self.times = best
        self.priority = self._priorities()
        return best

    # --- running --------------------------------------------------------------------
    def run(self, streams=None, delay=None):
        """One backward on the streams; returns once every sub-task is done.
        `delay(task)`: seconds to sleep before a sub-task (tests shake timing)."""
        streams = streams or cpu_streams(3)
        run = graph_module.Runner(self.net)
        waiting = {task: len(self.edges[task]) for task in self.tasks}
        ready = [[] for _ in streams]                       # per stream: heap of (-priority, order, task)
        order = {task: index for index, task in enumerate(self.tasks)}
        for task in self.tasks:
            if not waiting[task]:
                heapq.heappush(ready[stream_of(task)], (-self.priority[task], order[task], task))
        finished = queue.SimpleQueue()
        busy = [False] * len(streams)
        left, clock, failure = len(self.tasks), time.perf_counter, None
        became_ready = {task: clock() for task in self.tasks if not waiting[task]}
        spans = {}

        def start(index):
            _, _, task = heapq.heappop(ready[index])
            busy[index] = True
            dispatched = clock()

            def work(task=task, index=index):
                if delay is not None:
                    time.sleep(delay(task))
                began = clock()
                run(task)
                spans[task] = Span(task, index, became_ready[task], dispatched, began, clock())
            streams[index].submit(work, lambda error, task=task, index=index: finished.put((task, index, error)))

        while left:
            for index in range(len(streams)):
                if not busy[index] and ready[index] and failure is None:
                    start(index)
            if not any(busy):
                break                                        # a failure stopped new work
            task, index, error = finished.get()
            busy[index] = False
            left -= 1
            if error is not None and failure is None:
                failure = error
            for successor in self.following[task]:
                waiting[successor] -= 1
                if not waiting[successor]:
                    became_ready[successor] = clock()
                    heapq.heappush(ready[stream_of(successor)],
                                   (-self.priority[successor], order[successor], successor))
        self.trace = sorted(spans.values(), key=lambda span: span.start)
        if failure is not None:
            raise failure


def blas_threads(total, streams_running_gemms=2):
    """BLAS threads per GEMM while streams run (the count is process-wide)."""
    return max(1, total // streams_running_gemms)


def run_backward(net, schedule):
    """The net's whole backward on the streams, BLAS threads split between the
    GEMM streams, the count restored after."""
    executor = net.executor
    executor.blas.set(blas_threads(executor.threads))
    try:
        schedule.run()
    finally:
        executor.finish()
