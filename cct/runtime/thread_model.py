"""Per-op thread counts: the performance model and the co-running choice of
Liu, Li, Kestor and Vetter, "Runtime Concurrency Control and Operation
Scheduling for High Performance Neural Network Training" (IPDPS 2019).

What the paper does (TensorFlow on a 68-core Knights Landing): every op has
its own best thread count, so over the first training steps each op runs
alone with 1, 1 + x, 1 + 2x, ... threads until its time rises or the cores
run out, and the counts not tried are linearly interpolated ("performance
model B": hill climbing with interpolation). The result is each op's
(threads -> time) curve. Changing a count costs cache and thread overhead, so
one count is kept per op type: the best count of the type's largest instance
(their Strategy 2). When cores go idle, a ready op is started on them if one
of its 3 best counts fits the idle cores and its predicted time is not longer
than the remaining time of what runs, preferring fewer threads; if none fits,
the most time-consuming ready op starts; a count more than 2 away from the
op's Strategy-2 count falls back to it (their Strategy 3, co-running).

What cct does here: the same three pieces as pure functions over numbers, so
that they hold on any machine and any core count (the tests give synthetic
curves for 68 cores; this machine has 2):

    hill_climb(measure, cores, step)   -> Curve: the model B curve, the counts
                                          tried and the profiling steps used
    per_type_counts(instances)         -> {op type: count}: Strategy 2
    pick(idle, remaining, ready)       -> Choice: Strategy 3, with the
                                          critical-path priorities
                                          (cct.runtime.critical_path) deciding
                                          among admissible ops

Where the paper leaves a choice open, cct decides and says so at the function.
The scheduler (cct.runtime.scheduler) does not call these yet: realizing a
count k inside cct (k batch partitions on k workers with one BLAS thread
each, or k BLAS threads for an op that runs alone: OpenBLAS's count is
process-wide) is measured by bench/bench_threads.py.
"""
import math
from dataclasses import dataclass, field
from typing import (Any, Callable, Dict, Hashable, Iterable, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union,
                    cast)

OpType = TypeVar("OpType", bound=Hashable)    # per_type_counts's: a name, or tuner's (type, kind, param)
Count = Tuple[int, float]                      # (threads, seconds)

# Strategy 3 keeps a candidate count only within this many threads of the
# op's Strategy-2 count (the paper's rule: changing counts costs).
FALLBACK_DISTANCE = 2

# Strategy 3 looks at this many best counts per ready op (the paper's 3).
CANDIDATES = 3


@dataclass(frozen=True)
class Curve:
    """One op's model: `times[n - 1]` is the predicted seconds at n threads,
    n = 1..cores (measured where n was tried, interpolated between tried
    counts, extrapolated past the last one); `tried` maps each count run to
    its measured seconds, in the order run; `steps` is how many profiling
    runs it took (len(tried))."""
    cores: int
    step: int
    times: Tuple[float, ...]
    tried: Dict[int, float] = field(compare=False)

    @property
    def steps(self) -> int:
        return len(self.tried)

    def time(self, threads: int) -> float:
        """Predicted seconds at `threads` (1..cores)."""
        if not 1 <= threads <= self.cores:
            raise ValueError(f"thread count {threads} outside 1..{self.cores}")
        return self.times[threads - 1]

    def best(self) -> int:
        """The count with the least predicted time (the fewest threads on a
        tie). Linear pieces have their minimum at an end, so this is always a
        count that was tried."""
        return min(range(1, self.cores + 1), key=lambda n: (self.times[n - 1], n))

    def candidates(self, count: int = CANDIDATES) -> List[Count]:
        """The `count` best (threads, seconds) on the curve, fastest first
        (Strategy 3's candidates)."""
        ranked = sorted(range(1, self.cores + 1), key=lambda n: (self.times[n - 1], n))
        return [(n, self.times[n - 1]) for n in ranked[:count]]


def profiled_counts(cores: int, step: int) -> List[int]:
    """The counts hill climbing may try, in order: 1, 1 + step, 1 + 2 step,
    ... while they fit the cores, then `cores` itself if the grid missed it
    (cct's addition: the paper's grid on 68 cores with x = 4 ends at 65 and
    would never see the last 3 cores; it costs at most one step)."""
    if cores < 1 or step < 1:
        raise ValueError(f"hill climbing needs cores >= 1 and step >= 1, got cores={cores}, step={step}")
    counts = list(range(1, cores + 1, step))
    if counts[-1] != cores:
        counts.append(cores)
    return counts


def hill_climb(measure: Callable[[int], float], cores: int, step: int) -> Curve:
    """Model B: run `measure(threads) -> seconds` at 1, 1 + step, 1 + 2 step,
    ... (profiled_counts), stopping at the first count whose time is above
    the previous one's or when the cores run out, and interpolate the rest.

    Counts between two tried ones get the straight line between them; counts
    past the last tried one continue the last segment's line (a rise, when
    the climb stopped at one; flat when only one count could be tried),
    never below zero. Returns a Curve; curve.steps <= 2 * cores / step for
    step <= (cores + 1) / 2, the paper's bound (they profile one count per
    training step, all ops at once, so the training steps spent are the
    largest curve.steps over the ops).

    On a convex time curve the first rise comes just past the optimum, so the
    best tried count is the grid's best. On a curve with a local bump the
    climb stops at the bump and never sees a better count beyond it: model B
    assumes convexity (tests/runtime/test_thread_model.py shows both)."""
    tried: Dict[int, float] = {}
    previous: Optional[float] = None
    for threads in profiled_counts(cores, step):
        seconds = float(measure(threads))
        tried[threads] = seconds
        if previous is not None and seconds > previous:
            break
        previous = seconds
    counts = sorted(tried)
    times = []
    for n in range(1, cores + 1):
        if n in tried:
            times.append(tried[n])
            continue
        if n > counts[-1]:                       # past the last tried count: the last segment's line
            if len(counts) == 1:
                times.append(tried[counts[0]])
                continue
            low, high = counts[-2], counts[-1]
        else:
            high = next(c for c in counts if c > n)
            low = max(c for c in counts if c < n)
        slope = (tried[high] - tried[low]) / (high - low)
        times.append(max(0.0, tried[low] + slope * (n - low)))
    return Curve(cores, step, tuple(times), tried)


def per_type_counts(instances: Iterable[Tuple[OpType, float, Curve]]) -> Dict[OpType, int]:
    """Strategy 2: one count per op type, the best count of the type's
    largest instance. `instances`: (op type, size, Curve) triples, size by
    FLOPs or by measured time (size_by_time gives the latter); the first of
    equally large instances wins. Returns {op type: threads}."""
    largest: Dict[OpType, Tuple[float, Curve]] = {}
    for op_type, size, curve in instances:
        if op_type not in largest or size > largest[op_type][0]:
            largest[op_type] = (size, curve)
    return {op_type: curve.best() for op_type, (_, curve) in largest.items()}


def size_by_time(curve: Curve) -> float:
    """An instance's size as its measured time at 1 thread (when FLOPs say
    nothing, as for memory-bound ops)."""
    return curve.tried[1]


@dataclass(frozen=True)
class Ready:
    """A ready op for Strategy 3: its `candidates`, its best (threads,
    seconds) counts (Curve.candidates), and its Strategy-2 `count` with the
    seconds predicted there (`count_time`), or None where it has none;
    `curve`, where known, predicts the counts that are neither."""
    op: Hashable
    candidates: Tuple[Count, ...]
    count: Optional[int] = None
    count_time: Optional[float] = None     # set with count
    curve: Optional[Curve] = None

    @classmethod
    def of(cls, op: Hashable, curve: Curve, count: Optional[int] = None) -> "Ready":
        """From a Curve and the op type's Strategy-2 count."""
        return cls(op, tuple(curve.candidates()), count, None if count is None else curve.time(count), curve)


@dataclass(frozen=True)
class Choice:
    """What Strategy 3 starts: `op` on `threads`, predicted to take
    `seconds`; `rule` says which rule chose it (fits, alone, longest) and
    whether the Strategy-2 fallback changed the count (+fallback)."""
    op: Hashable
    threads: int
    seconds: float
    rule: str


def pick(idle: int, remaining: Union[float, Iterable[float], None], ready: Sequence[Ready],
         priority: Optional[Mapping[Any, float]] = None, fewest_first: bool = False) -> Optional[Choice]:
    """Strategy 3: which ready op to start on `idle` cores, and on how many.

    `remaining`: the seconds the running ops still need (one number, or one
    per running op: cct takes the longest, the time until every core is free
    again; empty or None when nothing runs). `ready`: Ready ops, in priority
    order unless `priority` ({op: value}, higher first; ties keep the list's
    order) gives one: the critical-path priorities.

    1. Admissible: a candidate that fits the idle cores and whose predicted
       time is not longer than `remaining`. Among the ops with one, the
       priority order decides (the issue's rule: the critical path first);
       the op runs its admissible candidate with the fewest threads. With
       fewest_first=True the fewest threads over all ops decide and the
       priority breaks ties (the paper's wording, which has no priorities).
    2. Nothing runs (cct's rule; the paper does not say): nothing to finish
       with, so the highest-priority op starts on its Strategy-2 count, or its
       best candidate without one, at most the idle cores.
    3. None admissible: the most time-consuming ready op (by its best
       candidate's time) on its fastest candidate that fits the idle cores,
       else on all idle cores.
    Then the fallback: a count more than FALLBACK_DISTANCE from the op's
    Strategy-2 count becomes the Strategy-2 count, when that fits the idle
    cores (cct never oversubscribes: otherwise the count stays).

    Returns a Choice, or None when no core is idle or nothing is ready."""
    if idle < 1 or not ready:
        return None
    # (sorted is stable: equal priorities keep the list's order)
    ordered = list(ready) if priority is None else sorted(ready, key=lambda item: -priority[item.op])
    position = {id(item): index for index, item in enumerate(ordered)}
    if isinstance(remaining, (int, float)):
        remaining = [remaining]
    remaining = list(remaining or [])
    if not remaining:
        first = ordered[0]
        if first.count is not None:
            threads = min(first.count, idle)
            seconds = cast(float, first.count_time) if threads == first.count else _predicted(first, threads)
        else:
            threads, seconds = min(first.candidates, key=lambda c: (c[0] > idle, c[1], c[0]))
            if threads > idle:
                threads, seconds = idle, _predicted(first, idle)
        return Choice(first.op, threads, seconds, "alone")
    bound = max(remaining)
    admissible = [(item, threads, seconds) for item in ordered for threads, seconds in item.candidates
                  if threads <= idle and seconds <= bound]
    if admissible:
        if fewest_first:
            item, threads, seconds = min(admissible, key=lambda a: (a[1], position[id(a[0])]))
        else:
            item, threads, seconds = min(admissible, key=lambda a: (position[id(a[0])], a[1]))
        return _fallback(Choice(item.op, threads, seconds, "fits"), item, idle)
    item = max(ordered, key=lambda r: (min(s for _, s in r.candidates), -position[id(r)]))
    fitting = [(threads, seconds) for threads, seconds in item.candidates if threads <= idle]
    if fitting:
        threads, seconds = min(fitting, key=lambda c: (c[1], c[0]))
    else:
        threads, seconds = idle, _predicted(item, idle)
    return _fallback(Choice(item.op, threads, seconds, "longest"), item, idle)


def _fallback(choice: Choice, item: Ready, idle: int) -> Choice:
    """The Strategy-2 count in place of a count more than FALLBACK_DISTANCE
    away from it, when it fits the idle cores."""
    if (item.count is not None and abs(choice.threads - item.count) > FALLBACK_DISTANCE
            and item.count <= idle):
        return Choice(choice.op, item.count, cast(float, item.count_time), choice.rule + "+fallback")
    return choice


def _predicted(item: Ready, threads: int) -> float:
    """Seconds at a count that may be no candidate: the curve's where the op
    has one, else the Strategy-2 count's or a candidate's, else unknown (nan)."""
    if item.curve is not None and threads <= item.curve.cores:
        return item.curve.time(threads)
    if threads == item.count and item.count_time is not None:
        return item.count_time
    return dict(item.candidates).get(threads, math.nan)
