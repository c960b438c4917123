"""The cores this process may run on, and how many of them other processes
hold now: measured from the kernel's CPU-time accounting, not guessed from
the load average (issue 36).

OpenBLAS's threads and cct's partitions wait for each other at every GEMM
and every layer. When another process holds one of the cores, the thread
that shares it runs a time slice in turn with it, and the others wait for
it: LeNet's iteration on 2 threads took 5x its 1-thread time with one
busy process on the other core ("Cores held by other processes" in
BENCHMARKS.md). So a net whose thread count nobody set runs on the cores
that are free (`Executor.fit_threads`), and follows them as they change.

A window of Watch is the CPU time every allowed core spent busy (the
/proc/stat lines of the cores in the process's affinity mask, steal time
included: a virtual machine's core that its host gave to another guest is
held too) less this process's own CPU time (its spinning BLAS threads
included), over the wall time: the cores' worth that others ran. A core
counts as held once others ran a quarter of one (HELD_SHARE): a
neighbour that runs a quarter of the time already stalls every partner
wait it falls into. Where /proc/stat cannot be read (not Linux), every
allowed core counts as free.

Only the time this process's nets run counts: a pause between two passes
(idle(), then free()) of IDLE_SECONDS or more in which the process ran less
than half a core starts the window again, so another process that runs in
the pause (another framework's turn in a benchmark, a service's other work
between requests) holds nothing of this one's. A benchmark's batch-1
forwards half a second apart ran on 1 thread after the other side's turns
(BENCHMARKS.md, "Cores held while this process waited").
"""
import math
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Tuple

WINDOW_SECONDS = 0.25          # a decision's measurement window (25 ticks of the usual 100 Hz clock per core)
HELD_SHARE = 0.25              # others' cores' worth above this many whole cores: one more core held
IDLE_SECONDS = WINDOW_SECONDS / 2   # a pause of this process at least this long starts the window again
STAT = "/proc/stat"


@dataclass(frozen=True)
class Reading:
    """One window: the cores of the affinity mask (`cores`), the cores'
    worth other processes ran on them over `seconds`, a cgroup's CPU quota
    in cores (None: none), and the cores free (at least 1)."""
    cores: int
    others: float
    seconds: float
    quota: Optional[int] = None

    @property
    def allowed(self) -> int:
        return min(self.cores, self.quota) if self.quota else self.cores

    @property
    def held(self) -> int:
        return max(0, math.ceil(self.others - HELD_SHARE))

    @property
    def free(self) -> int:
        # a quota caps what this process may run, whatever others run on the
        # host's other cores (a container's 2 CPUs on a busy 64-core host)
        return max(1, min(self.allowed, self.cores - self.held))

    def describe(self) -> str:
        return (f"{self.free} of {self.allowed} cores free (other processes ran {self.others:.2f} "
                f"cores' worth over {self.seconds:.2f} s)")


def affinity_cores() -> int:
    """The cores the scheduler lets this process run on (its affinity mask)."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


def _cgroup_quota() -> Optional[int]:
    """cgroup v2's cpu.max ("max 100000" or "200000 100000"), in whole cores rounded up."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as file:
            quota, period = file.read().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))


def busy_ticks(cpus: Optional[set] = None, path: str = STAT) -> Optional[int]:
    """The clock ticks the given cores (all where None) spent busy since
    boot: user, nice, system, irq, softirq and steal; None where the file
    cannot be read."""
    try:
        with open(path) as file:
            lines = file.read().splitlines()
    except OSError:
        return None
    total = 0
    for line in lines:
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *fields = line.split()
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        values = [int(v) for v in fields[:8]] + [0] * (8 - len(fields[:8]))
        user, nice, system, _idle, _iowait, irq, softirq, steal = values
        total += user + nice + system + irq + softirq + steal
    return total


class Watch:
    """Windows of at least WINDOW_SECONDS, each closed by the first `free()`
    asked after it: the count of cores free in the last closed window
    (every allowed core before the first closes). Thread-safe; one per
    process (`watch()`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 own_seconds: Callable[[], float] = time.process_time,
                 ticks: Optional[Callable[[], Optional[int]]] = None, cores: Optional[int] = None,
                 quota: Optional[int] = None, tick_seconds: Optional[float] = None) -> None:
        self._clock, self._own = clock, own_seconds
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        self._ticks = ticks if ticks is not None else (lambda: busy_ticks(cpus))
        if cores is None:                       # this process's, not a test's machine
            cores, quota = affinity_cores(), _cgroup_quota()
        self.cores, self.quota = cores, quota
        self.allowed = Reading(self.cores, 0.0, 0.0, self.quota).allowed
        self._tick = tick_seconds or 1.0 / os.sysconf("SC_CLK_TCK")
        self._lock = threading.Lock()
        self.last: Optional[Reading] = None
        self.history: List[Reading] = []        # the windows that changed the count
        self._start: Optional[Tuple[float, float, int]] = None
        self._paused: Optional[Tuple[float, float]] = None    # (clock, own seconds) at the last idle()
        self._begin()

    def _begin(self) -> None:
        self._pid = os.getpid()
        ticks = self._ticks()
        self._start = None if ticks is None else (self._clock(), self._own(), ticks)

    def free(self) -> int:
        """The cores free as the last closed window measured them."""
        if self._pid != os.getpid():
            # a forked child: its own CPU time starts from zero, so a window the
            # parent opened would count the parent's seconds as others'
            self._lock = threading.Lock()
            self._begin()
        start, paused, self._paused = self._start, self._paused, None
        if start is not None and paused is not None and self._paused_since(paused):
            self._begin()                       # the window so far spans a pause: others held nothing of ours
        elif start is not None and self._clock() - start[0] >= WINDOW_SECONDS:
            self._close()
        return self.last.free if self.last is not None else self.allowed

    def idle(self) -> None:
        """This process's pass has ended: the next free() sees how long it paused."""
        self._paused = (self._clock(), self._own())

    def _paused_since(self, paused: Tuple[float, float]) -> bool:
        seconds = self._clock() - paused[0]
        return seconds >= IDLE_SECONDS and self._own() - paused[1] < seconds / 2

    def _close(self) -> None:
        with self._lock:
            start = self._start
            now = self._clock()
            if start is None or now - start[0] < WINDOW_SECONDS:
                return                          # another thread closed it
            ticks, own = self._ticks(), self._own()
            if ticks is None:
                self._start = None
                return
            seconds = now - start[0]
            others = max(0.0, ((ticks - start[2]) * self._tick - (own - start[1])) / seconds)
            reading = Reading(self.cores, others, seconds, self.quota)
            if self.last is None or reading.free != self.last.free:
                self.history.append(reading)
            self.last = reading
            self._start = (now, own, ticks)


_watch: Optional[Watch] = None
_watch_lock = threading.Lock()


def watch() -> Watch:
    """The process's Watch, started on first use."""
    global _watch
    with _watch_lock:
        if _watch is None:
            _watch = Watch()
        return _watch


def _after_fork_in_child() -> None:
    """A lock another thread held at a fork stays held in the child."""
    global _watch_lock
    _watch_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextmanager
def watching(replacement: Watch) -> Iterator[Watch]:
    """watch() is `replacement` inside the block (a Watch on a test's clock)."""
    global _watch
    with _watch_lock:
        previous, _watch = _watch, replacement
    try:
        yield replacement
    finally:
        with _watch_lock:
            _watch = previous
