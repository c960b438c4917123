"""Sub-tasks on concurrent streams, highest critical-path priority first
(TurboDL, rebuilt for CPU worker threads).

A net's backward becomes the sub-tasks of cct.runtime.graph: per layer its
data gradient (the critical chain: the layer below waits for it) and one
sub-task per parameter gradient (needed only by the update). They run on a
few streams, one worker thread each serving its stream in order:

    stream 0  data gradients, and the whole backward of layers that do not split it
    stream 1  weight gradients (parameter 0)
    stream 2  every other parameter's gradient (biases, Scale's bias, ...)

A solver in the streams schedule runs whole iterations this way (a Schedule
with a solver): each layer's forward on stream 0, each parameter's update
(and the clearing of its diff) on its gradient's stream, the iteration's
learning rate on stream 2. A weight gradient is then deferred past the
iteration's end: the next forward of a layer waits only for the update of its
own parameters and for the sub-tasks still reading the blobs it overwrites,
so the next iteration's lower layers may start while upper layers' weight
gradients and updates are still running. clip_gradients makes the rate a
barrier (it scales every gradient by their global norm). Ready sub-tasks of
an earlier iteration go first.

The stream count does not grow with depth. Nothing blocks a worker on an
unready input: each sub-task's unfinished predecessors are counted, and a
stream's worker, when idle, takes the highest-priority ready sub-task of its
stream, so a critical sub-task that becomes ready later still overtakes
waiting non-critical ones (the CPU has no hardware stream priorities: the
paper's "method one", done by the workers themselves).

Priority: TurboDL's Algorithm 1 (cct.runtime.critical_path): blocks from a
fork layer to its merge, the longest branch first; a data gradient keeps its
layer's priority p, a weight gradient gets p - alpha and any other parameter
gradient p - beta. alpha and beta are in units of the step between two
branches of a block (ALPHA, BETA; the run configuration's "priorities"
entry). Branch distances come from the layers' FLOP counts until `profile()`
has measured the data-gradient times. Equal priorities keep the sequential
order.

OpenBLAS's thread count is process-wide: while streams run, each GEMM gets
T / (streams that run GEMM-heavy sub-tasks at that moment) threads
(`blas_threads`, set as each such sub-task starts), so two concurrent GEMMs
do not oversubscribe the cores and a lone one gets them all.
"""
import heapq
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from cct.runtime import critical_path, graph as graph_module

DATA_STREAM, WEIGHT_STREAM, OTHER_STREAM = 0, 1, 2


@dataclass(frozen=True)
class Span:
    """One sub-task of a run, perf_counter seconds: when it became ready, when
    its stream's worker took it, and when it started and ended there."""
    task: object
    stream: int
    ready: float
    dispatched: float
    start: float
    end: float

# Taken off a layer's priority for its weight gradient, and for its other
# parameter gradients: below the layer's data gradient and above the data
# gradients of the next branch down (a step of 1).
ALPHA = 0.25
BETA = 0.5


def stream_of(task, weights=frozenset()):
    """The stream a sub-task runs on. Whole iterations (Schedule with a solver):
    forward on the data stream, a parameter's clear and update on its
    gradient's stream (`weights`: the learnable parameters that are some
    layer's parameter 0), the learning rate on the third."""
    kind = task.kind
    if kind == graph_module.BACKWARD_PARAM:
        return WEIGHT_STREAM if task.param == 0 else OTHER_STREAM
    if kind in (graph_module.CLEAR, graph_module.UPDATE):
        return WEIGHT_STREAM if task.param in weights else OTHER_STREAM
    if kind == graph_module.RATE:
        return OTHER_STREAM
    return DATA_STREAM


class CpuStream:
    """A stream served by one worker thread, in the order work is given. Its
    own threads, not the partition workers (cct.runtime.threads): a stream may
    run a batch-partitioned layer, which waits on those. (An OpenCL device's
    queue will be another kind of stream.)"""

    def __init__(self, index):
        self.index = index
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"cct-stream-{index}")

    def submit(self, function):
        """Run function() on the stream's thread."""
        self._worker.submit(function)


CPU_STREAMS = 3          # a chain's sub-task types: data gradients, weight gradients, the rest (critical_path)
_streams = []
_streams_lock = threading.Lock()


def cpu_streams(count):
    """The process's CPU streams (made on first use, kept for every net)."""
    with _streams_lock:
        while len(_streams) < count:
            _streams.append(CpuStream(len(_streams)))
        return _streams[:count]


class Schedule:
    """Sub-tasks of one net, their streams and priorities. Without a solver:
    the backward sub-tasks, and run() runs one backward. With a solver:
    `iterations` whole training iterations (forward, backward, the solver's
    rate and per-parameter updates), and run() runs them with the weight
    gradients of one iteration deferred past the next one's forward as far as
    the derived edges allow. Built for the net's current shapes and needs."""

    def __init__(self, net, alpha=ALPHA, beta=BETA, times=None, solver=None, iterations=1):
        self.net, self.solver = net, solver
        self.alpha, self.beta = alpha, beta
        if solver is None:
            built = graph_module.build(net, iterations=1, update=False)
            # edges from forward sub-tasks are met before backward starts
            tasks = [task for task in built.tasks if task.kind not in (graph_module.FORWARD, graph_module.CLEAR)]
        else:
            built = graph_module.build(net, iterations, clip=solver.param.clip_gradients >= 0,
                                       passes=solver.param.iter_size)
            tasks = built.tasks
        members = set(tasks)
        self.tasks = tasks
        self.edges = {task: {earlier for earlier in built.edges[task] if earlier in members} for task in tasks}
        self.following = graph_module.Graph(tasks, self.edges).successors()
        weights = {index for index, blob in enumerate(net.learnable_params)
                   if any(layer.blobs and layer.blobs[0] is blob for layer in net.layers)}
        self.stream = {task: stream_of(task, weights) for task in tasks}
        self.times = dict(times) if times else self._estimated_times()
        self.priority = self._priorities()
        self.trace = []                     # Span per sub-task of the last run

    # --- priorities -----------------------------------------------------------------
    def _estimated_times(self):
        """Seconds per sub-task from FLOP counts at 50 GFLOP/s, plus a floor for
        the memory-bound ones: only their ratios matter, until measured."""
        net, times = self.net, {}
        for task in self.tasks:
            if task.layer < 0:                          # clear, rate, update: memory-bound
                count = net.learnable_params[task.param].count if task.param >= 0 else 0
                times[task] = 1e-5 + count / 1e9
                continue
            layer = net.layers[task.layer]
            forward, data, params = layer.flops(net.bottom_vecs[task.layer], net.top_vecs[task.layer])
            flops = {graph_module.FORWARD: forward, graph_module.BACKWARD_DATA: data,
                     graph_module.BACKWARD_PARAM: params, graph_module.BACKWARD: data + params}[task.kind]
            times[task] = 1e-5 + flops / 50e9
        return times

    def _priorities(self):
        """Algorithm 1's layer priorities from the data-gradient times, less
        alpha / beta for parameter gradients."""
        data_times = {task.layer: self.times[task] for task in self.tasks
                      if task.kind in (graph_module.BACKWARD_DATA, graph_module.BACKWARD)}
        layer_priority = critical_path.layer_priorities(self.net, data_times)
        priority = {}
        for task in self.tasks:
            offset = 0.0
            if task.kind == graph_module.BACKWARD_PARAM:
                offset = self.alpha if task.param == 0 else self.beta
            elif task.kind in (graph_module.CLEAR, graph_module.RATE, graph_module.UPDATE):
                offset = self.beta                   # off the critical chain, like a gradient
            priority[task] = layer_priority.get(task.layer, 0.0) - offset
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
        """The sub-tasks on the streams (one backward, or the iterations);
        returns the graph.Runner that ran them once every one is done.
        `delay(task)`: seconds to sleep before a sub-task (tests shake timing).

        Each stream's worker runs a loop (one submission per stream and run):
        when idle it takes its stream's highest-priority ready sub-task; when
        a sub-task ends, the worker that ran it counts down its successors'
        inputs and makes the ready ones available. A worker that finishes a
        sub-task goes straight on to its next one, with no hop through another
        thread."""
        streams = streams or cpu_streams(CPU_STREAMS)
        state = _RunState(self, len(streams), delay)
        done = threading.Barrier(len(streams) + 1)

        def serve(index):
            try:
                state.serve(index)
            finally:
                done.wait()
        for index, stream in enumerate(streams):
            stream.submit(lambda index=index: serve(index))
        done.wait()
        self.trace = sorted(state.spans.values(), key=lambda span: span.start)
        if state.failure is not None:
            raise state.failure
        state.runner.finish()
        return state.runner


# Sub-tasks with no GEMM: they leave the BLAS thread count alone.
MEMORY_BOUND = (graph_module.CLEAR, graph_module.RATE, graph_module.UPDATE)
ADAPTIVE_BLAS = True


class _RunState:
    """The counts, ready heaps and trace of one Schedule.run, shared by its
    stream workers under one condition variable."""

    def __init__(self, schedule, stream_count, delay):
        self.schedule, self.delay = schedule, delay
        self.runner = graph_module.Runner(schedule.net, schedule.solver)
        self.waiting = {task: len(schedule.edges[task]) for task in schedule.tasks}
        self.order = {task: index for index, task in enumerate(schedule.tasks)}
        self.ready = [[] for _ in range(stream_count)]    # per stream: heap of (iteration, pass, -priority, order, task)
        self.became_ready, self.spans = {}, {}
        self.left, self.failure = len(schedule.tasks), None
        self.condition = threading.Condition()
        self.computing = [0] * stream_count             # per stream: GEMMs at once in its running sub-task
        for task in schedule.tasks:
            if not self.waiting[task]:
                self._make_ready(task)

    def _make_ready(self, task):
        self.became_ready[task] = time.perf_counter()
        # an earlier iteration's (and pass's) sub-tasks first, then by priority
        heapq.heappush(self.ready[self.schedule.stream[task]],
                       (task.iteration, task.pass_, -self.schedule.priority[task], self.order[task], task))

    def _share_blas(self, index, task):
        """Before a GEMM-heavy sub-task (under the lock): the BLAS threads
        shared among the GEMMs that run at once, this sub-task's (one per
        batch partition of its layer) and the other streams'. The count
        is process-wide, so a change also reaches the other streams' next
        BLAS calls: the shares follow which streams compute, call by call."""
        executor = self.schedule.net.executor
        self.computing[index] = executor.partitions(task.layer) if task.layer >= 0 else 1
        executor.blas.set(blas_threads(executor.threads, sum(self.computing)))

    def serve(self, index):
        clock, condition = time.perf_counter, self.condition
        while True:
            with condition:
                while not self.ready[index] and self.left and self.failure is None:
                    condition.wait()
                if not self.left or self.failure is not None:
                    return
                task = heapq.heappop(self.ready[index])[-1]
                if ADAPTIVE_BLAS and task.kind not in MEMORY_BOUND:
                    self._share_blas(index, task)
            dispatched = clock()
            try:
                if self.delay is not None:
                    time.sleep(self.delay(task))
                began = clock()
                self.runner(task)
            except BaseException as error:          # re-raised by run(); the other workers stop
                with condition:
                    self.failure = self.failure or error
                    condition.notify_all()
                return
            self.spans[task] = Span(task, index, self.became_ready[task], dispatched, began, clock())
            with condition:
                self.computing[index] = 0
                self.left -= 1
                woken = False
                for successor in self.schedule.following[task]:
                    self.waiting[successor] -= 1
                    if not self.waiting[successor]:
                        self._make_ready(successor)
                        woken = woken or self.schedule.stream[successor] != index
                if woken or not self.left:
                    condition.notify_all()


def blas_threads(total, streams_running_gemms=2):
    """BLAS threads per GEMM while streams run (the count is process-wide)."""
    return max(1, total // streams_running_gemms)


def run_on_streams(net, schedule):
    """schedule.run() with the BLAS threads split between the GEMM streams,
    the count restored after; returns its graph.Runner."""
    executor = net.executor
    executor.blas.set(blas_threads(executor.threads))
    try:
        return schedule.run()
    finally:
        executor.finish()
