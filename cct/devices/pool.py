"""One pool of threads for cct's kernels and the BLAS (issue 36).

OpenBLAS runs a threaded call's jobs on threads of its own, which then spin
for about 2^28 cycles (a tenth of a second) waiting for the next call. Work
of cct's on the other cores in that time shares them with a spinning
thread: an OpenMP pass right after a 2-thread GEMM ran 7-50x slower than on
one thread (BENCHMARKS.md,
"One pool: OpenBLAS's jobs on numba's OpenMP threads (2026-12-07, d12282a-fdc61df)").
OpenBLAS 0.3.27 lets its caller run
the jobs (openblas_set_threads_callback_function): cct hands it a compiled
callback (cct.devices.openmp) that runs them on numba's OpenMP threads, the
threads cct's parallel kernels run on, so whatever comes next finds those
threads waiting for it.

The callback is lent to OpenBLAS only while a TEST-phase net runs a pass
(`acquire`, `release`; the executor decides which passes), where cct sets
the BLAS count and keeps it within the pool: OpenBLAS's jobs must all run
at once, and a count above the pool's size (a threadpool_limits(8) on a
2-core machine) would leave two jobs on one thread, each waiting for the
other. Outside such a pass OpenBLAS runs its own threads as always.

It is on where the `one_pool` setting is, an OpenBLAS of pthreads exports
the setter, and numba's threading layer is GNU OpenMP (thread-safe: two
threads' passes at once each get a team). cct puts OpenMP first in numba's
order unless the environment orders them: TBB ran ResNet-50 at batch 1 in
1.6x the time (the same section). numba starts on the warm-up thread (cct.devices.jit),
which calls start(), so a process's first forwards run without the pool. A
forked child never lends it (GNU OpenMP's threads are not the child's).
"""
import ctypes
import os
import re
import threading
from typing import Any, Dict, List, Optional

from cct.core import settings

from .blas import blas

# exported with the build's affixes, as openblas_set_num_threads (cct.devices.blas)
_SETTERS = [prefix + "openblas_set_threads_callback_function" + suffix
            for prefix in ("", "scipy_") for suffix in ("", "64_")]
_CONFIGS = [prefix + "openblas_get_config" + suffix for prefix in ("", "scipy_") for suffix in ("", "64_")]
_LAYERS = ("omp",)                    # numba's GNU OpenMP layer: thread-safe (TBB ran ResNet-50 slower here)


class _Pool:
    def __init__(self, address: int, setters: List[Any], size: int):
        self.address = address         # the compiled callback
        self.setters = setters         # each OpenBLAS's openblas_set_threads_callback_function
        self.size = size               # numba's threads: the most jobs run at once
        self.lenders: Dict[int, int] = {}   # thread ident -> its passes running with it (nested nets)
        self.lock = threading.Lock()
        from numba import get_num_threads, set_num_threads
        self.threads = get_num_threads   # the calling thread's numba count (numba.set_num_threads lowers it)
        self.set_threads = set_num_threads

    @property
    def lent(self) -> int:
        """Passes running with it, on every thread."""
        return sum(self.lenders.values())

    def install(self, address: Optional[int]) -> None:
        for setter in self.setters:
            setter(address)


_pool: Optional[_Pool] = None
_start_lock = threading.Lock()
_absent = "numba not started yet"      # why there is no pool (describe)


def _setters(top_slot: int) -> List[Any]:
    """The callback setter of each OpenBLAS (pthreads) cct sets the count of
    that has one (0.3.27 and later) and thread slots above `top_slot`; the
    others (OpenCV's OpenBLAS 0.3.15 in its wheel) keep their own threads."""
    found = []
    for lib in blas().libraries:
        if lib.internal_api != "openblas" or lib.threading_layer == "openmp":
            continue
        setter, config = _symbol(lib, _SETTERS), _symbol(lib, _CONFIGS)
        if setter is None or config is None:
            continue
        config.restype = ctypes.c_char_p
        slots = re.search(rb"MAX_THREADS=(\d+)", config() or b"")
        if slots is not None and int(slots.group(1)) > top_slot:
            setter.argtypes, setter.restype = [ctypes.c_void_p], None
            found.append(setter)
    return found


def _symbol(lib: Any, names: List[str]) -> Any:
    for name in names:
        function = getattr(lib.dynlib, name, None)
        if function is not None:
            return function
    return None


def start() -> bool:
    """Compile the callback and start numba's threads (numba's warm-up
    thread calls this once numba runs); whether the pool is there."""
    global _pool, _absent
    with _start_lock:
        if _pool is not None:
            return True
        if not settings.value("one_pool"):
            _absent = "off (the one_pool setting, CCT_ONE_POOL=0)"
            return False
        import numba
        from numba.np.ufunc import parallel
        if not any(name in os.environ for name in ("NUMBA_THREADING_LAYER", "NUMBA_THREADING_LAYER_PRIORITY")):
            # numba's default order takes TBB first where it is installed
            numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]
        parallel._launch_threads()          # before the cached callback loads: it links to the layer's symbols
        from . import openmp
        openmp.run_jobs(openmp.nothing.address, 1, 0, 0, 0)    # compiled, and the threading layer chosen
        setters = _setters(openmp.TOP_SLOT)
        if not setters or numba.threading_layer() not in _LAYERS:
            _absent = (f"none: numba's threading layer is {numba.threading_layer()}, not GNU OpenMP" if setters
                       else "none: no OpenBLAS 0.3.27 or later (pthreads, MAX_THREADS > 63) with the callback")
            return False
        _pool = _Pool(openmp.callback.address, setters, numba.config.NUMBA_NUM_THREADS)
        return True


_local = threading.local()           # the numba count this thread last set (kernel_threads)


def describe(phase_test: bool, partitioned: bool = False) -> str:
    """One line for `cct time`: whether a net of this phase (with layers in
    batch partitions or not) runs on the pool, and why not."""
    pool = _pool
    if pool is None:
        return _absent
    if not phase_test:
        return f"{pool.size} GNU OpenMP threads, not lent to a TRAIN-phase net (OpenBLAS's own threads)"
    if partitioned:
        return (f"{pool.size} GNU OpenMP threads, not lent to a pass with layers in batch partitions "
                "(OpenBLAS's own threads)")
    return f"{pool.size} GNU OpenMP threads run OpenBLAS's jobs and cct's parallel kernels"


def kernel_threads() -> int:
    """Threads a parallel kernel (cct.devices.jit.parallel_kernel) runs on
    now: the step's BLAS count where a pass has the pool, else 1. numba's
    count for this thread is set to it (thread-local, and at least the jobs
    OpenBLAS hands the pool from this thread at that count)."""
    pool = _pool
    if pool is None or threading.get_ident() not in pool.lenders:
        # another thread (an executor's worker with a piece of a pass) runs its
        # kernels serially: a parallel region there starts a second team of
        # OpenMP threads, after which the process's batch-1 forwards took
        # 1.4-2x their time (BENCHMARKS.md, "Cores held while this process waited (2026-12-07)")
        return 1
    count = min(blas().current, pool.size)
    if count > 1 and getattr(_local, "count", None) != count:
        pool.set_threads(count)
        _local.count = count
    return count


def acquire(threads: int) -> bool:
    """A pass begins that sets BLAS counts up to `threads`: OpenBLAS's jobs
    go to the pool during it where the pool holds them all. Returns whether
    it did; pair each True with a release()."""
    pool = _pool
    if pool is None or max(threads, blas().current) > pool.threads():      # at most pool.size
        return False
    with pool.lock:
        if not pool.lenders:
            pool.install(pool.address)
        ident = threading.get_ident()
        pool.lenders[ident] = pool.lenders.get(ident, 0) + 1
    return True


def release() -> None:
    pool = _pool
    if pool is None:
        return
    with pool.lock:
        ident = threading.get_ident()
        pool.lenders[ident] -= 1
        if not pool.lenders[ident]:
            del pool.lenders[ident]
        if not pool.lenders:
            pool.install(None)


def _after_fork_in_child() -> None:
    """A child forked mid-pass: OpenBLAS back on its own threads, the pool gone."""
    global _pool, _absent
    pool, _pool = _pool, None
    _absent = "none in a forked child"
    if pool is not None:
        pool.install(None)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
