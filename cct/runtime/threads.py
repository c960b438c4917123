"""The process's threads: one BLAS thread controller and one pool of worker
threads, shared by every net, executor and solver of the process.

OpenBLAS's thread count is process-wide, not per calling thread, so there is
exactly one `BlasThreads` (`blas()`). Its `default` is the count the process
had when cct first needed it, before any partitioned layer lowered it: a net
built later (a test net made after `solver.step()`, a second pycaffe Net)
gets the same default instead of whatever count the last layer left behind.

Worker k - 1 of `workers()` runs unit k of every parallel run (a batch
partition, an update stripe), so the per-thread work stores (the lowering
arenas, Layer.work) exist once per worker, not once per net. A stream's
sub-task runs its units on the workers it leased (`leased`) instead.
"""
import os
import threading
from contextlib import contextmanager

from threadpoolctl import ThreadpoolController

_lock = threading.Lock()
_blas = None
_workers = []
_lease = threading.local()     # .workers: the workers a stream's sub-task holds (leased), or None


class BlasThreads:
    """The BLAS libraries' thread count, set directly (threadpoolctl's
    context manager re-scans the loaded libraries on every call)."""

    def __init__(self):
        # Streams set the count from their own threads. threadpoolctl 3.8 lets
        # only the first thread that set an OpenBLAS (pthreads) count set it
        # again and silently drops the others' calls, so the stream threads'
        # sets went nowhere: a lone GEMM on a stream ran on the one thread the
        # main thread had left. cct serializes every set under its own lock,
        # so it calls OpenBLAS's own setter (`_setters`) from any thread. A set
        # compares with the count the library reports, not only the one last
        # asked: a count changed behind cct's back is set again.
        self._lock = threading.Lock()
        self._libraries = ThreadpoolController().select(user_api="blas").lib_controllers
        self._setters = [_setter(lib) for lib in self._libraries]
        # the lowest count: a limit the user set (threadpool_limits) may have
        # reached only the libraries loaded then (numpy's, not scipy's later one)
        self.default = min([lib.num_threads for lib in self._libraries] or [1])
        self.current = self.default

    def set(self, count):
        count = max(1, int(count))
        with self._lock:
            for lib, setter in zip(self._libraries, self._setters):
                if count != self.current or lib.get_num_threads() != count:
                    setter(count)
            self.current = count

    def restore(self):
        """Back to the process's default count."""
        self.set(self.default)


@contextmanager
def blas_limited(count):
    """The BLAS libraries at `count` threads inside the block, then back to
    the count in force before it."""
    library = blas()
    previous = library.current
    library.set(count)
    try:
        yield
    finally:
        library.set(previous)


# OpenBLAS's setter is exported with the build's affixes: plain, 64-bit
# integer ("64_"), and the scipy-openblas wheels' prefix ("scipy_").
_OPENBLAS_SETTERS = [prefix + "openblas_set_num_threads" + suffix
                     for prefix in ("", "scipy_") for suffix in ("", "64_")]


def _setter(lib):
    """The function that sets `lib`'s process-wide count from any thread:
    OpenBLAS's own symbol for its pthreads builds (threadpoolctl's set would
    drop calls from threads other than the first that set it), else
    threadpoolctl's set (OpenMP builds and other libraries)."""
    if lib.internal_api == "openblas" and lib.threading_layer != "openmp":
        for name in _OPENBLAS_SETTERS:
            function = getattr(lib.dynlib, name, None)
            if function is not None:
                return function
    return lib.set_num_threads


def blas():
    """The process's BlasThreads, made on first use."""
    global _blas
    with _lock:
        if _blas is None:
            _blas = BlasThreads()
        return _blas


class Worker:
    """A persistent thread that runs one call at a time, handed over and back
    through two locks: the cheapest wake-up Python has. A ThreadPoolExecutor
    (a queue, a future and a waiter per call) took 82 us for a run of two
    no-op units on the 2-core host, 148 for four, 377 for eight; the lock
    hand-off takes 16 us there, and LeNet's batch partitions make dozens of
    runs an iteration."""

    def __init__(self, name):
        self._start = threading.Lock()
        self._start.acquire()
        self._finished = threading.Lock()
        self._finished.acquire()
        self._call = self._error = None
        self._pending = False         # a call submitted and not yet joined
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def _serve(self):
        while True:
            self._start.acquire()
            function, args = self._call
            self._call = None
            try:
                function(*args)
            except BaseException as error:        # re-raised by join, on the caller's thread
                self._error = error
            self._finished.release()

    def submit(self, function, *args):
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

    def join(self):
        """Wait for the submitted call to end; re-raise its exception."""
        self._finished.acquire()
        self._pending = False
        error, self._error = self._error, None
        if error is not None:
            raise error


def _after_fork_in_child():
    """A forked child has only the thread that forked: the parent's workers
    are gone, and a run handed to one would wait for ever (a net run in a
    multiprocessing worker forked from a process that had run it). Start the
    pool and the locks afresh: a lock another thread held at the fork stays
    held in the child."""
    global _lock, _workers, _lease
    _lock = threading.Lock()
    _workers = []
    _lease = threading.local()
    if _blas is not None:
        _blas._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def workers(count):
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
def leased(lease):
    """Parallel runs started on this thread inside the block use the workers of
    `lease` only. Sub-tasks running at once on several streams each lease
    their own, so their batch partitions never queue behind each other's on
    one worker (each worker serves one unit at a time)."""
    _lease.workers = lease
    try:
        yield
    finally:
        _lease.workers = None


def run_all(workers, function, work):
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
