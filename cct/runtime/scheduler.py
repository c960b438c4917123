"""Sub-tasks on concurrent streams, highest critical-path priority first
(TurboDL, rebuilt for CPU worker threads).

A net's backward becomes the sub-tasks of cct.runtime.graph: per layer its
data gradient (the critical chain: the layer below waits for it) and one
sub-task per parameter gradient (needed only by the update). They run on a
few streams, each an ordered queue with one sub-task running at a time, served
by as many threads as streams:

    stream 0  data gradients, and the whole backward of layers that do not split it
    stream 1  weight gradients (parameter 0)
    stream 2  every other parameter's gradient (biases, Scale's bias, ...)
    stream 3  over MPI, the gradient sums (cct.training.distributed)

A solver in the streams schedule runs whole iterations this way (a Schedule
with a solver's updates, cct.runtime.graph.Updates): each layer's forward on stream 0, each parameter's update
(and the clearing of its diff) on its gradient's stream, the iteration's
learning rate on stream 2. A weight gradient is then deferred past the
iteration's end: the next forward of a layer waits only for the update of its
own parameters and for the sub-tasks still reading the blobs it overwrites,
so the next iteration's lower layers may start while upper layers' weight
gradients and updates are still running. clip_gradients makes the rate a
barrier (it scales every gradient by their global norm). Ready sub-tasks of
an earlier iteration go first.

Over MPI the gradient sums are one more stream (TurboDL's data-transfer
paths): a unit's sum starts as soon as the last gradient sub-task writing its
parameters has ended, while backward goes on, and an update waits only for
the sums of its own parameter (the graph's edges). A sum holds no cores (its
thread waits in MPI, or copies a bucket); the sums go one at a time, in the
units' order on every rank (graph.COMMUNICATOR).

The stream count does not grow with depth. Nothing blocks a thread on an
unready input: each sub-task's unfinished predecessors are counted, and a
free thread starts the highest-priority ready sub-task of a stream with none
running, so a critical sub-task that becomes ready later still overtakes
waiting non-critical ones (the CPU has no hardware stream priorities: the
paper's "method one", done by the threads themselves). A stream's sub-tasks
need not run on one thread: the thread that ends a sub-task starts the next
one itself, whatever its stream, so a chain hands over no work between
threads (a hand-over cost LeNet 16% of an iteration: the woken thread waits
for the GIL and the cores).

Priority: TurboDL's Algorithm 1 (cct.runtime.critical_path): blocks from a
fork layer to its merge, the longest branch first; a data gradient keeps its
layer's priority p, a weight gradient gets p - alpha and any other parameter
gradient p - beta. alpha and beta are in units of the step between two
branches of a block (ALPHA, BETA; the run configuration's "priorities"
entry). Branch distances come from the layers' FLOP counts until `profile()`
has measured the data-gradient times. Equal priorities keep the sequential
order.

Cores: a sub-task holds its width (Schedule.widths) of the executor's
threads while it runs, and starts only when they are idle and the BLAS count
it needs is the one in force (OpenBLAS's count is process-wide), so streams
never oversubscribe the cores; a sub-task's batch partitions run on workers
it leases for the while (cct.runtime.threads.leased). The widths are the
sequential schedule's, so the two give the same numbers bitwise.
"""
import bisect
import heapq
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AbstractSet, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, cast

from cct.core import workspace
from cct.runtime import critical_path, graph as graph_module, thread_model, threads as threads_module
from cct.runtime import tuner as tuner_module
from cct.runtime.graph import Net, Task, Width

Entry = Tuple[int, int, float, int, Task]    # a ready heap's: (iteration, pass, -priority, order, task)

DATA_STREAM, WEIGHT_STREAM, OTHER_STREAM, COMM_STREAM = 0, 1, 2, 3


@dataclass(frozen=True)
class Span:
    """One sub-task of a run, perf_counter seconds: when it became ready, when
    its stream's worker took it, and when it started and ended there; and
    the threads (cores) it held."""
    task: Task
    stream: int
    ready: float
    dispatched: float
    start: float
    end: float
    threads: int = 1

# Taken off a layer's priority for its weight gradient, and for its other
# parameter gradients: below the layer's data gradient and above the data
# gradients of the next branch down (a step of 1).
ALPHA = 0.25
BETA = 0.5


def stream_of(task: Task, weights: AbstractSet[int] = frozenset()) -> int:
    """The stream a sub-task runs on. Whole iterations (Schedule with updates):
    forward on the data stream, a parameter's clear and update on its
    gradient's stream (`weights`: the learnable parameters that are some
    layer's parameter 0), the learning rate on the third, the gradient sums
    on the fourth."""
    kind = task.kind
    if kind == graph_module.SUM:
        return COMM_STREAM
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

    def __init__(self, index: int) -> None:
        self.index = index
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"cct-stream-{index}")

    def submit(self, function: Callable[[], None]) -> None:
        """Run function() on the stream's thread."""
        self._worker.submit(function)


CPU_STREAMS = 3          # a chain's sub-task types: data gradients, weight gradients, the rest (critical_path)
_streams: List[CpuStream] = []
_streams_lock = threading.Lock()


_spare_arenas: List[workspace.Arena] = []


def spare_arenas(count: int) -> List[workspace.Arena]:
    """`count` arenas the streams lend to sub-tasks beside the calling thread's
    (made on first use, kept for every run: their stores stay grown)."""
    with _streams_lock:
        while len(_spare_arenas) < count:
            _spare_arenas.append(workspace.Arena())
        return _spare_arenas[:count]


def cpu_streams(count: int) -> List[CpuStream]:
    """The process's CPU streams (made on first use, kept for every net)."""
    with _streams_lock:
        while len(_streams) < count:
            _streams.append(CpuStream(len(_streams)))
        return _streams[:count]


class Schedule:
    """Sub-tasks of one net, their streams and priorities. Without `updates`:
    the backward sub-tasks, and run() runs one backward. With a training
    loop's updates (graph.Updates):
    `iterations` whole training iterations (forward, backward, the solver's
    rate and per-parameter updates), and run() runs them with the weight
    gradients of one iteration deferred past the next one's forward as far as
    the derived edges allow. Built for the net's current shapes and needs."""

    def __init__(self, net: Net, steps: graph_module.Steps, alpha: float = ALPHA, beta: float = BETA,
                 times: Optional[Mapping[Task, float]] = None, updates: Optional[graph_module.Updates] = None,
                 iterations: int = 1) -> None:
        self.net, self.steps, self.updates = net, steps, updates
        self.sums: graph_module.Sums = ()        # per unit of the MPI gradient sums, its parameters
        self.alpha, self.beta = alpha, beta
        if updates is None:
            built = graph_module.build(net, iterations=1, update=False)
            # edges from forward sub-tasks are met before backward starts
            tasks = [task for task in built.tasks if task.kind not in (graph_module.FORWARD, graph_module.CLEAR)]
        else:
            self.sums = updates.sums
            built = graph_module.build(net, iterations, clip=updates.clips, passes=updates.passes, sums=self.sums)
            tasks = built.tasks
        members = set(tasks)
        self.tasks = tasks
        self.edges = {task: {earlier for earlier in built.edges[task] if earlier in members} for task in tasks}
        self.following = graph_module.Graph(tasks, self.edges).successors()
        weights = {index for index, blob in enumerate(net.learnable_params)
                   if any(layer.blobs and layer.blobs[0] is blob for layer in net.layers)}
        self.stream = {task: stream_of(task, weights) for task in tasks}
        self.stream_count = CPU_STREAMS + bool(self.sums)
        self.times = dict(times) if times else self._estimated_times()
        self.priority = self._priorities()
        self.widths = self._widths(clip=updates is not None and updates.clips)
        # the budget the widths share: the executor's threads, or more where
        # a layer was asked for more batch partitions than that
        self.cores = max([steps.threads] + [cores for cores, _ in self.widths.values()])
        self.tuner: Optional[tuner_module.Tuner] = None    # a done one: the "tuned" schedule's counts (tune())
        self.trace: List[Span] = []         # Span per sub-task of the last run

    def _widths(self, clip: bool) -> Dict[Task, Width]:
        """(cores, BLAS count) per sub-task, as the sequential schedule runs
        it, so both give the same numbers whatever the timing: a layer's
        sub-task on all the executor's threads, as its batch partitions (one
        BLAS count of threads / partitions each) or as the BLAS threads of a
        whole layer; the clears and updates (element-wise, no BLAS) on one
        core, so they fill in beside each other and before the next forward;
        the rate too, unless it clips the gradients (a dot product over all
        of them, in BLAS); a gradient sum on none."""
        steps = self.steps
        widths: Dict[Task, Width] = {}
        total = steps.threads
        for task in self.tasks:
            if task.kind == graph_module.SUM:
                widths[task] = (0, None)
            elif task.layer >= 0:
                partitions = steps.partitions(task.layer)
                widths[task] = (partitions, max(1, total // partitions)) if partitions > 1 else (total, total)
            elif task.kind == graph_module.RATE and clip:
                widths[task] = (total, total)
            else:
                widths[task] = (1, None)
        return widths

    # --- priorities -----------------------------------------------------------------
    def _estimated_times(self) -> Dict[Task, float]:
        """Seconds per sub-task from FLOP counts at 50 GFLOP/s, plus a floor for
        the memory-bound ones: only their ratios matter, until measured."""
        net = self.net
        times: Dict[Task, float] = {}
        for task in self.tasks:
            if task.layer < 0:                          # clear, sum, rate, update: memory-bound
                params = self.sums[task.param] if task.kind == graph_module.SUM else (
                    [task.param] if task.param >= 0 else [])
                times[task] = 1e-5 + sum(net.learnable_params[index].count for index in params) / 1e9
                continue
            layer = net.layers[task.layer]
            forward, data, params = layer.flops(net.bottom_vecs[task.layer], net.top_vecs[task.layer])
            flops = {graph_module.FORWARD: forward, graph_module.BACKWARD_DATA: data,
                     graph_module.BACKWARD_PARAM: params, graph_module.BACKWARD: data + params}[task.kind]
            times[task] = 1e-5 + flops / 50e9
        return times

    def _priorities(self) -> Dict[Task, float]:
        """Algorithm 1's layer priorities from the data-gradient times, less
        alpha / beta for parameter gradients."""
        data_times = {task.layer: self.times[task] for task in self.tasks
                      if task.kind in (graph_module.BACKWARD_DATA, graph_module.BACKWARD)}
        layer_priority = critical_path.layer_priorities(self.net, data_times)
        priority: Dict[Task, float] = {}
        for task in self.tasks:
            offset = 0.0
            if task.kind == graph_module.BACKWARD_PARAM:
                offset = self.alpha if task.param == 0 else self.beta
            elif task.kind in (graph_module.CLEAR, graph_module.SUM, graph_module.RATE, graph_module.UPDATE):
                offset = self.beta                   # off the critical chain, like a gradient
            priority[task] = layer_priority.get(task.layer, 0.0) - offset
        return priority

    def tune(self, tuner: tuner_module.Tuner) -> None:
        """Run by `tuner`'s thread counts and co-running (the tuned schedule),
        with its measured times as the critical-path distances: one profile
        for both."""
        self.tuner = tuner
        self.times = tuner.times_for(self)
        self.priority = self._priorities()

    def profile(self, runs: int = 2) -> Dict[Task, float]:
        """Measure each sub-task's time (sequentially, `runs` times, keeping the
        fastest) and recompute the priorities from the measurements."""
        run = graph_module.Runner(self.net, self.steps)
        best: Dict[Task, float] = {}
        for _ in range(runs):
            for task in self.tasks:
                start = time.perf_counter()
                run.alone(task, self.widths[task])
                elapsed = time.perf_counter() - start
                best[task] = min(elapsed, best.get(task, elapsed))
        self.times = best
        self.priority = self._priorities()
        return best

    # --- running --------------------------------------------------------------------
    def run(self, streams: Optional[Sequence[CpuStream]] = None,
            delay: Optional[Callable[[Task], float]] = None) -> graph_module.Runner:
        """The sub-tasks on the streams (one backward, or the iterations);
        returns the graph.Runner that ran them once every one is done.
        `delay(task)`: seconds to sleep before a sub-task (tests shake timing).

        Each stream thread runs _RunState.serve (one submission per thread
        and run): a stream runs one sub-task at a time, its most urgent ready
        one first, on whichever stream thread is free; the thread that ends a
        sub-task counts down its successors' inputs and starts the next one
        itself, with no hop through another thread."""
        streams = streams or cpu_streams(self.stream_count)
        state = _RunState(self, len(streams), delay)
        done = threading.Barrier(len(streams) + 1)

        def serve() -> None:
            try:
                state.serve()
            except BaseException as error:        # the bookkeeping's own: the other workers stop too
                state.fail(error)
            finally:
                done.wait()
        for stream in streams:
            stream.submit(serve)
        done.wait()
        self.trace = sorted(state.spans.values(), key=lambda span: span.start)
        if state.failure is not None:
            raise state.failure
        state.runner.finish()
        return state.runner


class _RunState:
    """The counts, ready heaps, core budget and trace of one Schedule.run,
    shared by its stream workers under one condition variable.

    The cores: a sub-task holds `cores` of the executor's threads while it
    runs (Schedule.widths): its batch partitions' threads, its stream's own
    thread first and workers leased from the pool after, or the BLAS threads
    of its one GEMM call at a time. A stream's next sub-task starts when its
    cores are idle and the BLAS count it needs is the one in force (the
    count is process-wide: sub-tasks that call BLAS at once must agree on
    it), so the cores are never oversubscribed. A sub-task may not take
    cores ahead of a more urgent one another stream waits with, unless its
    own estimated time ends before the running sub-tasks' (Liu et al.'s
    Strategy 3: it cannot delay the waiting one)."""

    def __init__(self, schedule: Schedule, stream_count: int, delay: Optional[Callable[[Task], float]]) -> None:
        self.schedule, self.delay = schedule, delay
        self.runner = graph_module.Runner(schedule.net, schedule.steps, schedule.updates)
        self.waiting = {task: len(schedule.edges[task]) for task in schedule.tasks}
        self.order = {task: index for index, task in enumerate(schedule.tasks)}
        self.ready: List[List[Entry]] = [[] for _ in range(stream_count)]    # per stream: a heap
        self.became_ready: Dict[Task, float] = {}
        self.spans: Dict[Task, Span] = {}
        self.left = len(schedule.tasks)
        self.failure: Optional[BaseException] = None
        self.condition = threading.Condition()
        self.blas = schedule.steps.blas
        self.idle = schedule.cores
        self.pool = list(threads_module.workers(schedule.cores))     # leased to sub-tasks, a part each
        # one arena per sub-task that may run at once: the calling thread's
        # (it waits for the run) and spares, lent to the sub-tasks as they
        # start, last given back first: the calling thread's, grown already,
        # serves every sub-task while they run one at a time
        self.arenas = spare_arenas(schedule.cores - 1) + [workspace.thread_arena()]
        self.blas_users = 0
        self.running: Dict[Task, float] = {}            # running: task -> estimated end (perf_counter)
        self.granted: Dict[Task, Width] = {}            # running: task -> (cores, BLAS count) it holds
        self.busy = [False] * stream_count              # per stream: a sub-task of it runs
        for task in schedule.tasks:
            if not self.waiting[task]:
                self._make_ready(task)

    def _make_ready(self, task: Task) -> None:
        self.became_ready[task] = time.perf_counter()
        # an earlier iteration's (and pass's) sub-tasks first, then by priority
        heapq.heappush(self.ready[self.schedule.stream[task]],
                       (task.iteration, task.pass_, -self.schedule.priority[task], self.order[task], task))

    def _fits(self, task: Task, width: Optional[Width] = None) -> bool:
        cores, blas = width or self.schedule.widths[task]
        return cores <= self.idle and (blas is None or not self.blas_users or blas == self.blas.current)

    def _candidates(self) -> List[Entry]:
        """The most urgent ready sub-task of each stream with none running,
        most urgent first (their heap entries)."""
        return sorted(heap[0] for stream, heap in enumerate(self.ready) if heap and not self.busy[stream])

    def _next(self) -> Optional[Tuple[Task, Width]]:
        """The sub-task to start now and its width, taken off its stream's
        heap (under the lock), or None: the most urgent one that fits the
        idle cores, except that a sub-task may not take cores ahead of a more
        urgent one that waits for them unless it is estimated to end before
        the running ones (it cannot delay the waiting one)."""
        coreless = self._coreless()
        if coreless is not None:
            return coreless
        if self.schedule.tuner is not None:
            return self._chosen()
        blocked = False
        for entry in self._candidates():
            task = entry[-1]
            if not self._fits(task):
                blocked = True
                continue
            if blocked and time.perf_counter() + self.schedule.times[task] > max(self.running.values(), default=0.0):
                continue
            heapq.heappop(self.ready[self.schedule.stream[task]])
            return task, self.schedule.widths[task]
        return None

    def _coreless(self) -> Optional[Tuple[Task, Width]]:
        """A ready sub-task that holds no cores (a gradient sum), taken off its
        heap, with its width; else None. It starts at once: it delays no one."""
        for stream, heap in enumerate(self.ready):
            if heap and not self.busy[stream] and self.schedule.widths[heap[0][-1]][0] == 0:
                task = heapq.heappop(heap)[-1]
                return task, self.schedule.widths[task]
        return None

    def _chosen(self) -> Optional[Tuple[Task, Width]]:
        """The tuned schedule: Strategy 3 (thread_model.pick) over the
        candidates, each with its counts that fit the idle cores and the BLAS
        count in force (its 3 best, its type's Strategy-2 count as the
        fallback), or its fixed width; the critical-path order ranks them."""
        tuner, now = self.schedule.tuner, time.perf_counter()
        assert tuner is not None and tuner.curves is not None     # (the tuned schedule's: a done tuner)
        if self.idle < 1:
            return None
        items = []
        for entry in self._candidates():
            task = entry[-1]
            key = tuner_module.key_of(task)
            if key in tuner.curves:
                curve = tuner.curves[key]
                fitting = tuple((threads, seconds) for threads, seconds in curve.candidates()
                                if self._fits(task, (threads, threads)))
                count = tuner.count(key)
                if fitting:
                    items.append(thread_model.Ready(task, fitting, count, curve.time(count), curve))
            elif self._fits(task, tuner.width(task, self.schedule)):
                cores = tuner.width(task, self.schedule)[0]
                items.append(thread_model.Ready(task, ((cores, tuner.predicted(task, cores)),)))
        remaining = [end - now for end in self.running.values()]
        choice = thread_model.pick(self.idle, remaining, items, {item.op: -n for n, item in enumerate(items)})
        if choice is None:
            return None
        task = cast(Task, choice.op)
        tuned = tuner_module.key_of(task) in tuner.curves
        width = (choice.threads, choice.threads) if tuned else tuner.width(task, self.schedule)
        if not self._fits(task, width):              # a fallback count the BLAS count in force rules out
            return None
        heap = self.ready[self.schedule.stream[task]]
        assert heap[0][-1] is task
        heapq.heappop(heap)
        return task, width

    def _take(self, task: Task, width: Width) -> List[threads_module.Worker]:
        """Its cores, leased workers and BLAS count (under the lock)."""
        cores, blas = width
        self.granted[task] = width
        self.idle -= cores
        lease = [self.pool.pop() for _ in range(cores - 1)]
        if blas is not None:
            if not self.blas_users:
                self.blas.set(blas)
            self.blas_users += 1
        tuner = self.schedule.tuner
        seconds = tuner.predicted(task, cores) if tuner is not None else self.schedule.times[task]
        self.running[task] = time.perf_counter() + seconds
        return lease

    def _give_back(self, task: Task, lease: List[threads_module.Worker]) -> None:
        cores, blas = self.granted.pop(task)
        self.idle += cores
        self.pool.extend(lease)
        self.blas_users -= blas is not None
        del self.running[task]

    def fail(self, error: BaseException) -> None:
        """Record the first failure and wake every worker to stop."""
        with self.condition:
            self.failure = self.failure or error
            self.condition.notify_all()

    def serve(self) -> None:
        """One stream thread's loop: start the next sub-task (_next) of any
        stream with none running, run it, count its successors' inputs down,
        and go on. The thread that ends a sub-task starts the next one
        itself, so a chain runs on one thread with no hand-over; the others
        are woken only when cores stay idle beside what runs."""
        clock, condition = time.perf_counter, self.condition
        while True:
            with condition:
                while True:
                    if not self.left or self.failure is not None:
                        return
                    started = self._next()
                    if started is not None:
                        break
                    condition.wait()
                task, width = started
                stream = self.schedule.stream[task]
                self.busy[stream] = True
                lease = self._take(task, width)
                arena = self.arenas.pop() if width[0] else None     # one per core
                if self.idle and any(heap and not busy for heap, busy in zip(self.ready, self.busy)):
                    condition.notify_all()          # another sub-task may start beside this one
            dispatched = clock()
            try:
                if self.delay is not None:
                    time.sleep(self.delay(task))
                began = clock()
                with threads_module.leased(lease), workspace.lent(arena):
                    self.runner(task, width[0])
            except BaseException as error:          # re-raised by run(); the other workers stop
                self.fail(error)
                return
            self.spans[task] = Span(task, stream, self.became_ready[task], dispatched, began, clock(), width[0])
            with condition:
                self._give_back(task, lease)
                if arena is not None:
                    self.arenas.append(arena)
                self.busy[stream] = False
                self.left -= 1
                for successor in self.schedule.following[task]:
                    self.waiting[successor] -= 1
                    if not self.waiting[successor]:
                        self._make_ready(successor)
                if not self.left:
                    condition.notify_all()


def dispatch_costs(trace: Sequence[Span]) -> List[float]:
    """Per Span of a trace, the scheduler's own cost: the time from the last
    event that could have let the sub-task start (it became ready, or the
    latest sub-task before it ended and gave back its cores) to its start,
    not the time it waited for cores."""
    ends = sorted(span.end for span in trace)
    costs = []
    for span in trace:
        before = bisect.bisect_right(ends, span.start)
        freed = ends[before - 1] if before else span.ready
        costs.append(span.start - max(span.ready, freed))
    return costs


def run_on_streams(schedule: Schedule) -> graph_module.Runner:
    """schedule.run(), every BLAS thread given back after; returns its graph.Runner."""
    try:
        return schedule.run()
    finally:
        schedule.steps.finish()
