"""The process's threads: one pool of worker threads, shared by every net,
executor and solver of the process, beside the one BLAS thread controller
(cct.devices.blas).

Worker k - 1 of `workers()` runs unit k of every parallel run (a batch
partition, an update stripe), so the per-thread work stores (the lowering
arenas, Layer.work) exist once per worker, not once per net. A stream's
sub-task runs its units on the workers it leased (`leased`) instead.
"""
import os
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, List, Optional, Sequence

from cct.devices.blas import BlasThreads, blas, blas_limited  # noqa: F401  (the runtime's names for them)

_lock = threading.Lock()
_workers: List["Worker"] = []
_lease = threading.local()     # .workers: the workers a stream's sub-task holds (leased), or None


class Worker:
    """A persistent thread that runs one call at a time, handed over and back
    through two locks: the cheapest wake-up Python has, cheaper than a
    ThreadPoolExecutor's queue, future and waiter per call, and LeNet's batch
    partitions make dozens of runs an iteration (BENCHMARKS.md, "Behind cct/runtime/threads.py")."""

    def __init__(self, name: str) -> None:
        self._start = threading.Lock()
        self._start.acquire()
        self._finished = threading.Lock()
        self._finished.acquire()
        self._call: Optional[tuple] = None
        self._error: Optional[BaseException] = None
        self._pending = False         # a call submitted and not yet joined
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def _serve(self) -> None:
        while True:
            self._start.acquire()
            assert self._call is not None
            function, args = self._call
            self._call = None
            try:
                function(*args)
            except BaseException as error:        # re-raised by join, on the caller's thread
                self._error = error
            self._finished.release()

    def submit(self, function: Callable[..., Any], *args: Any) -> "Worker":
        """Start function(*args) on this worker; join() waits for it. One call
        at a time: a call whose join was interrupted (Ctrl-C in the waiting
        thread) is waited for first, and its exception dropped."""
        if self._pending:
            self._finished.acquire()
            self._error = None
        self._call = (function, args)
        self._pending = True
        self._start.release()
        return self

    def join(self) -> None:
        """Wait for the submitted call to end; re-raise its exception."""
        self._finished.acquire()
        self._pending = False
        error, self._error = self._error, None
        if error is not None:
            raise error


def _after_fork_in_child() -> None:
    """A forked child has only the thread that forked: the parent's workers
    are gone, and a run handed to one would wait for ever (a net run in a
    multiprocessing worker forked from a process that had run it). Start the
    pool and the locks afresh: a lock another thread held at the fork stays
    held in the child."""
    global _lock, _workers, _lease
    _lock = threading.Lock()
    _workers = []
    _lease = threading.local()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def workers(count: int) -> List[Worker]:
    """The persistent worker threads for `count` units run at once (the caller
    runs unit 0 itself): worker k - 1 runs unit k. The list may be longer.
    On a thread that holds a lease (a stream's sub-task), the leased workers."""
    lease = getattr(_lease, "workers", None)
    if lease is not None:
        if len(lease) < count - 1:
            raise RuntimeError(f"a run of {count} units on a lease of {len(lease)} workers")
        return lease
    with _lock:
        while len(_workers) < count - 1:
            _workers.append(Worker(f"cct-worker-{len(_workers) + 1}"))
        return list(_workers)


@contextmanager
def leased(lease: List[Worker]) -> Iterator[None]:
    """Parallel runs started on this thread inside the block use the workers of
    `lease` only. Sub-tasks running at once on several streams each lease
    their own, so their batch partitions never queue behind each other's on
    one worker (each worker serves one unit at a time)."""
    _lease.workers = lease
    try:
        yield
    finally:
        _lease.workers = None


class Spread:
    """A whole layer's own passes on the threads its step runs with
    (Layer.run_partitions): spread(function, pieces) runs function(*piece)
    for every piece at once, piece 0 on the calling thread. `parts`: the
    most pieces worth making now, `count` or, on a stream's sub-task, the
    workers it leased and itself."""

    def __init__(self, count: int) -> None:
        self.count = count

    @property
    def parts(self) -> int:
        lease = getattr(_lease, "workers", None)
        return self.count if lease is None else min(self.count, len(lease) + 1)

    def __call__(self, function: Callable[..., Any], pieces: Sequence[Sequence[Any]]) -> None:
        run_all(workers(len(pieces)), function, pieces)


def run_all(workers: Sequence[Worker], function: Callable[..., Any], work: Iterable[Sequence[Any]]) -> None:
    """Unit k on workers[k - 1], unit 0 on this thread; waits for all of them
    and re-raises the first exception (in unit order)."""
    work = list(work)
    if not work:
        return
    started = [worker.submit(function, *unit) for worker, unit in zip(workers, work[1:])]
    errors = []
    try:
        function(*work[0])
    finally:
        for worker in started:        # no unit may still write when this returns
            try:
                worker.join()
            except BaseException as error:
                errors.append(error)
    if errors:
        raise errors[0]
