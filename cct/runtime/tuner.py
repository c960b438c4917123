"""Per-sub-task thread counts for the "tuned" schedule: Liu et al.'s model B
(hill climbing with interpolation, cct.runtime.thread_model) profiled on real
training iterations, as the paper does, then handed to the streams' core
budget (cct.runtime.scheduler), which co-runs sub-tasks by Strategy 3.

Profiling: the first iterations run one at a time in the graph's order on
the calling thread, every sub-task timed. In profiling step j each tunable
sub-task runs at the next count of its climb (1, 1 + step, ...; all at once,
one count per step, so the steps spent are the longest climb: at most
2 * cores / step); a sub-task whose time rose stops climbing and runs at its
best count in the steps left. These iterations train as any other: they are
the graph's sub-tasks in an order that keeps every edge.

Tunable: a layer's sub-task run whole (its plan has one batch partition),
a count k realized as k BLAS threads. The run configuration's "threads"
(per layer, or as the default) fixes the count of a layer's sub-tasks
instead: they are not profiled, and Strategy 3 does not change it. Its layer's batch partitions, a data
layer (it must not draw extra batches), the clears, the rate and the
updates keep the widths of the streams schedule; they are timed too, so the
dispatcher can predict them.

Strategy 2 keeps one count per op type, (layer type, sub-task kind,
parameter), the best count of the type's largest instance by its 1-thread
time; Strategy 3 (thread_model.pick) may co-run a sub-task on one of its 3
best counts.

The profile is cached per net, shapes and batch partitions, thread count and
machine (host, CPU count, each BLAS library's kind, version and kernels):
`<cache dir>/tuned/<key>.json` (cct.runtime.settings.cache_dir), so a run
on the same net and machine starts tuned with no profiling iterations.
A file that does not parse is profiled afresh and rewritten.

A tuned run's numbers differ from the sequential schedule's in the last bits
where a GEMM runs on another thread count than there (OpenBLAS may split a
long reduction by threads), and a count chosen at dispatch depends on
timing: "tuned" is not bit-repeatable; "sequential" and "streams" are.
"""
import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import Dict, List, Optional, Protocol, Set, Tuple

from cct.formats.prototxt import atomic_write
from cct.runtime import graph as graph_module, settings, thread_model
from cct.runtime.graph import Net, Task, Width

log = logging.getLogger("cct.runtime.tuner")
CACHE_VERSION = 1

STEP = 1        # hill climbing's step x: every count on a few cores

Key = Tuple[str, int, int]        # a sub-task across iterations and windows: (kind, layer, param)
OpType = Tuple[str, str, int]     # Strategy 2's op type: (layer type, kind, param)


class Schedule(Protocol):
    """What the tuner reads of a cct.runtime.scheduler.Schedule (the scheduler
    imports this module: not imported back): its net, steps and loop's
    updates, its sub-tasks, their widths and the cores they share."""
    net: Net
    steps: graph_module.Steps
    updates: Optional[graph_module.Updates]
    tasks: List[Task]
    widths: Dict[Task, Width]
    cores: int


class Tuner:
    """The profile of one net shape: per sub-task, the times measured at each
    count tried, and once done, its Curve and its type's Strategy-2 count.
    `schedule`: a one-iteration scheduler.Schedule of the net (its tasks of
    iteration 0 key the profile; a window's sub-tasks look theirs up by
    (kind, layer, param))."""

    def __init__(self, schedule: Schedule, step: int = STEP, cache: Optional[Path] = None) -> None:
        """cache: the profile's file (cache_path), read now if it holds one, written when done."""
        self.schedule, self.step, self.cache = schedule, step, cache
        self.cores = schedule.cores
        self.counts = thread_model.profiled_counts(self.cores, step)
        self.tried: Dict[Key, Dict[int, float]] = {}     # key -> {count: seconds}
        self.fixed: Dict[Key, float] = {}                # key -> seconds at its fixed width (the fastest seen)
        self.climbing: Set[Key] = set()
        self.pinned: Dict[Key, int] = {}                 # key -> the count the run configuration fixes ("threads")
        net, config = schedule.net, schedule.steps.config
        for task in schedule.tasks:
            if not self.tunable(schedule, task):
                continue
            count = config.value(net.layers[task.layer].name, "threads") if config else None
            if count is not None:
                self.pinned[key_of(task)] = min(count, self.cores)
            else:
                self.tried[key_of(task)] = {}
                self.climbing.add(key_of(task))
        self.steps, self.seconds = 0, 0.0       # profiling iterations run, and their wall time
        self.curves: Optional[Dict[Key, thread_model.Curve]] = None
        self.type_counts: Optional[Dict[OpType, int]] = None
        if cache is not None:
            self._load()

    @staticmethod
    def tunable(schedule: Schedule, task: Task) -> bool:
        return (task.layer >= 0 and schedule.steps.partitions(task.layer) == 1
                and bool(schedule.net.bottom_vecs[task.layer]))

    @property
    def done(self) -> bool:
        return self.curves is not None

    def next_count(self, key: Key) -> int:
        """The count a climbing sub-task runs at in the coming step, else its best so far."""
        tried = self.tried[key]
        if key in self.climbing:
            return self.counts[len(tried)]
        return min(tried, key=lambda count: (tried[count], count))

    def profile_step(self) -> graph_module.Runner:
        """One training iteration, sub-task after sub-task on this thread, each
        timed at its count; returns the graph.Runner that ran it."""
        schedule, net = self.schedule, self.schedule.net
        began = time.perf_counter()
        runner = graph_module.Runner(net, schedule.steps, schedule.updates)
        for task in schedule.tasks:
            key = key_of(task)
            width: Width
            if key in self.tried:
                count = self.next_count(key)
                width = (count, count)
            else:
                width = self.width(task)
            start = time.perf_counter()
            runner.alone(task, width)
            seconds = time.perf_counter() - start
            if key in self.tried:
                self._record(key, width[0], seconds)
            else:
                self.fixed[key] = min(seconds, self.fixed.get(key, seconds))
        runner.finish()
        schedule.steps.finish()
        self.steps += 1
        self.seconds += time.perf_counter() - began
        if not self.climbing or self.steps >= len(self.counts):
            self._finish()
        return runner

    def _record(self, key: Key, count: int, seconds: float) -> None:
        tried = self.tried[key]
        if key not in self.climbing:
            tried[count] = min(seconds, tried.get(count, seconds))
            return
        previous = tried[self.counts[len(tried) - 1]] if tried else None
        tried[count] = seconds
        if (previous is not None and seconds > previous) or len(tried) == len(self.counts):
            self.climbing.discard(key)

    def _load(self) -> None:
        assert self.cache is not None               # (called where there is one)
        try:
            contents = json.loads(self.cache.read_text())
            if contents.get("version") != CACHE_VERSION or contents.get("step") != self.step:
                return
            tried = {tuple(key): {int(count): float(seconds) for count, seconds in counts.items()}
                     for key, counts in contents["tried"]}
            fixed = {tuple(key): float(seconds) for key, seconds in contents["fixed"]}
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            log.warning("%s: not a tuned profile (%s); profiling afresh", self.cache, error)
            return
        if set(tried) != set(self.tried):
            log.warning("%s: its sub-tasks are not the ones this net tunes (the configuration's "
                        "\"threads\" changed?); profiling afresh", self.cache)
            return
        self.tried, self.fixed, self.climbing = tried, fixed, set()
        self._finish(save=False)
        log.info("Tuned thread counts from %s: %s", self.cache, self.summary())

    def _save(self) -> None:
        assert self.cache is not None               # (called where there is one)
        contents = {"version": CACHE_VERSION, "step": self.step, "cores": self.cores,
                    "tried": [[list(key), {str(count): seconds for count, seconds in counts.items()}]
                              for key, counts in self.tried.items()],
                    "fixed": [[list(key), seconds] for key, seconds in self.fixed.items()]}
        try:
            self.cache.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.cache, json.dumps(contents, indent=1).encode())
        except OSError as error:                  # a read-only cache only loses the caching
            log.warning("%s: could not save the tuned profile (%s)", self.cache, error)

    def summary(self) -> str:
        """The Strategy-2 count per op type, one line."""
        assert self.type_counts is not None         # (once done)
        return ", ".join(f"{layer_type} {kind}{'' if param < 0 else f'.{param}'}: {count}"
                         for (layer_type, kind, param), count in sorted(self.type_counts.items()))

    def _finish(self, save: bool = True) -> None:
        net = self.schedule.net
        self.curves = {}
        for key, tried in self.tried.items():
            self.curves[key] = thread_model.hill_climb(tried.__getitem__, self.cores, self.step)
        self.type_counts = thread_model.per_type_counts(
            (op_type(net, key), thread_model.size_by_time(curve), curve) for key, curve in self.curves.items())
        if save:
            log.info("Tuned thread counts after %d profiling iterations: %s", self.steps, self.summary())
            if self.cache is not None:
                self._save()

    def count(self, key: Key) -> int:
        """The Strategy-2 count of a tunable sub-task's type."""
        assert self.type_counts is not None         # (once done)
        return self.type_counts[op_type(self.schedule.net, key)]

    def width(self, task: Task, schedule: Optional[Schedule] = None) -> Width:
        """(cores, BLAS count) of a sub-task the tuner does not choose for:
        the count the configuration fixes, else its width in `schedule` (the
        tuner's own by default)."""
        count = self.pinned.get(key_of(task))
        if count is not None:
            return count, count
        return (schedule or self.schedule).widths[task]

    def times_for(self, schedule: Schedule) -> Dict[Task, float]:
        """Seconds per sub-task of `schedule` (a window of the same net) at its
        type's Strategy-2 count, or its fixed width: the profile the
        critical-path priorities are computed from too."""
        assert self.curves is not None              # (once done)
        return {task: self.predicted(task, self.count(key_of(task)) if key_of(task) in self.curves
                                     else self.width(task, schedule)[0]) for task in schedule.tasks}

    def predicted(self, task: Task, cores: int) -> float:
        """Seconds a sub-task is predicted to take on `cores` (tunable), or at
        its fixed width."""
        key = key_of(task)
        assert self.curves is not None              # (once done)
        if key in self.curves:
            return self.curves[key].time(cores)
        return self.fixed.get(key, 0.0)

    def report(self) -> List[Tuple[Key, OpType, Dict[int, float], int]]:
        """(sub-task key, op type, {count: seconds tried}, Strategy-2 count) per tunable sub-task."""
        net = self.schedule.net
        return [(key, op_type(net, key), dict(sorted(self.tried[key].items())), self.count(key))
                for key in self.tried]


def key_of(task: Task) -> Key:
    """What identifies a sub-task across iterations and windows."""
    return task.kind, task.layer, task.param


def op_type(net: Net, key: Key) -> OpType:
    kind, layer, param = key
    return net.layers[layer].type, kind, param


def cache_path(net: Net, steps: graph_module.Steps, scope: str = "iteration") -> Path:
    """Where the profile of `net` at its steps' shapes, partitions and thread
    count on this machine is kept: of whole training iterations, or of the
    backward alone (scope "backward": `cct time`)."""
    shapes, partitions, threads = steps.identity
    identity = json.dumps([net.net_param.SerializeToString(deterministic=True).hex(),
                           [list(shape) for shape in shapes], list(partitions), threads, platform.node(),
                           platform.machine(), os.cpu_count(), steps.blas.identity(), scope],
                          default=str)
    return settings.cache_dir() / "tuned" / (hashlib.sha256(identity.encode()).hexdigest()[:24] + ".json")
