"""The BLAS libraries' thread count: process-wide in OpenBLAS, not per
calling thread, so there is exactly one `BlasThreads` (`blas()`). Its
`default` is the count the process had when cct first needed it, before any
partitioned layer lowered it: a net built later (a test net made after
`solver.step()`, a second pycaffe Net) gets the same default instead of
whatever count the last layer left behind. Below the runtime, so that the
lowering chooser times a forward at a partition's count itself.
"""
import ctypes
import functools
import os
import threading
from contextlib import contextmanager

import numpy as np
from threadpoolctl import ThreadpoolController

_lock = threading.Lock()
_blas = None


class BlasThreads:
    """The BLAS libraries' thread count, set directly (threadpoolctl's
    context manager re-scans the loaded libraries on every call)."""

    def __init__(self):
        # threadpoolctl 3.8 silently drops an OpenBLAS (pthreads) count set from any thread but the first that set one,
        # and streams set counts from their own threads: so cct calls OpenBLAS's own setter (`_setters`) under its own
        # lock (BENCHMARKS.md, "Streams and thread control (issues 11 and 12)"). set() compares with the count cct last
        # set; sync(), at each forward's start and each restore, with the libraries' own, so a count changed behind
        # cct's back is set again there, without a query of every library at every layer (2 us a layer).
        self._lock = threading.Lock()
        self.libraries = ThreadpoolController().select(user_api="blas").lib_controllers
        self._setters = [_setter(lib) for lib in self.libraries]
        # the lowest count: a limit the user set (threadpool_limits) may have
        # reached only the libraries loaded then (numpy's, not scipy's later one)
        self.default = min([lib.num_threads for lib in self.libraries] or [1])
        self.current = self.default

    def set(self, count):
        count = max(1, int(count))
        with self._lock:
            if count != self.current:
                for setter in self._setters:
                    setter(count)
                self.current = count

    def sync(self):
        """Set the count again in every library that reports another."""
        with self._lock:
            for lib, setter in zip(self.libraries, self._setters):
                if lib.get_num_threads() != self.current:
                    setter(self.current)

    def reported(self):
        """The largest count the libraries report now (1 without a BLAS
        library): a call into each, not threadpoolctl's scan of the process."""
        return max([lib.get_num_threads() for lib in self.libraries] or [1])

    def identity(self):
        """(internal API, version, architecture) of each library: what a
        timing measured through them depends on."""
        return [(lib.internal_api, lib.version, getattr(lib, "architecture", None)) for lib in self.libraries]

    def restore(self):
        """Back to the process's default count, in every library."""
        self.set(self.default)
        self.sync()


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


# OpenBLAS's cblas_sgemm with 64-bit integers (the ILP64 builds numpy's wheels bundle)
_SGEMM64 = ("scipy_cblas_sgemm64_", "cblas_sgemm64_")


@functools.lru_cache(maxsize=None)
def sgemm64():
    """cblas_sgemm of the OpenBLAS numpy's matmul calls, as a ctypes function
    that compiled kernels may call (order, transa, transb, m, n, k, alpha,
    a, lda, b, ldb, beta, c, ldc; int64 sizes); None where numpy's BLAS is
    not such an OpenBLAS (a system numpy, MKL, an LP64 build): the callers
    then keep np.matmul."""
    site = os.path.dirname(os.path.dirname(os.path.realpath(np.__file__)))
    for lib in blas().libraries:
        if lib.internal_api != "openblas" or not os.path.realpath(lib.filepath).startswith(site + os.sep):
            continue
        for name in _SGEMM64:
            function = getattr(lib.dynlib, name, None)
            if function is not None:
                size, pointer, value = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
                function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, size, size, size, value, pointer, size,
                                     pointer, size, value, pointer, size]
                function.restype = None
                return function
    return None


def blas():
    """The process's BlasThreads, made on first use."""
    global _blas
    with _lock:
        if _blas is None:
            _blas = BlasThreads()
        return _blas


def _after_fork_in_child():
    """A lock another thread held at a fork stays held in the child."""
    global _lock
    _lock = threading.Lock()
    if _blas is not None:
        _blas._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
