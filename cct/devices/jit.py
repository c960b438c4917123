"""Compiled CPU kernels: the decorator every numba kernel in cct uses.

numpy expresses most layers as a few whole-array passes. Where an operation
takes numpy many passes, or a strided pass that reads one value per cache
line, a compiled loop that touches every element once is a numba kernel,
written next to the numpy code it replaces and checked in the tests against
that code or Caffe's loops: max and average pooling's forward and average
pooling's backward (unit-stride sweeps over column phases of a block of
planes), max pooling's backward (a scatter to each window's winner), col2im
of the batch-inner layout and the tiled transpose back from it
(cct.lowering.type1), LRN across channels, the SGD update, and Winograd's
input and output transforms (cct.lowering.winograd), and type 1's
lowering of a single image (its rows are short). Only where it pays:
compiled im2col of a batch (either layout) and channels-first col2im were
measured slower than numpy's strided copies (BENCHMARKS.md), and stay numpy.
A loop vectorises only over unit-stride slices indexed by its own counter
(or unsigned indices): numba's check for negative indices otherwise keeps
LLVM from vectorising, which is why a first compiled max-pooling forward
ran slower than numpy.

Kernels release the GIL (`nogil`) and are serial: cct's parallelism is the
executor's batch partitions (cct.runtime.executor), each on its own thread.
A `parallel_kernel` also has a parallel form, run only on the one pool
(cct.devices.pool), whose threads are OpenBLAS's for that pass too, so
that its threads never compete with OpenBLAS's: where the pool is not
lent, or a partition's step has one thread, the serial form runs.
`cache` keeps the compiled code in __pycache__ (NUMBA_CACHE_DIR elsewhere),
so only the first run on a machine pays the compile time.

numba's own start-up (`import numba`, then its typing and lowering
registries on the first kernel: about 1.3 s, loaded from the cache or not)
costs several times a deploy net's whole forward, so a deploy forward does
not wait for it: a kernel may have a numpy twin (`@some_kernel.twin`, the
llm.c way: the plain version next to the fast one), which does the same
float32 operations in the same order and so gives the same bits. Until
numba is started and the kernel compiled, a call runs the twin. numba starts
on a daemon thread (warm_up) once the first forward has finished, or when a
kernel without a twin is first called (that call then compiles at once, as
every kernel did before); the thread compiles the kernels whose twins ran,
and each one's compiled form replaces the twin from its next call (the
call's fast path reads one attribute and takes no lock). A twinned kernel
first called after that compiles on its call. The first call of a kernel
compiles under a lock, so partitions starting at once compile it once.
numba itself is imported only then: `cct --help`, or a script that only
reads weights, needs none of it. The tests check each twin against its
compiled kernel bit for bit (tests/devices/test_twins.py).
"""
import functools
import os
import threading
import types
from typing import Any, Dict, Iterable, List

import numpy as np

from . import pool


def kernel(function):
    """`function` compiled by numba (nogil, cached) on its first call. A kernel
    may call other kernels, of its module or imported into it: they are
    compiled first, and each compiled kernel replaces its wrapper in the
    caller's module, which is how numba finds it when compiling the caller.
    `@that_kernel.twin` above a numpy function of the same arguments makes
    it the kernel's twin (module docstring); it returns the function."""
    @functools.wraps(function)
    def call(*args):
        compiled = call.compiled
        if compiled is not None:
            return compiled(*args)
        if call.numpy_twin is not None and _twins_stand_in:
            calls = _stood_in.setdefault(call, {})
            types = _argument_types(args)
            if types not in calls:
                calls[types] = tuple(_stand_in(a) for a in args)
            with np.errstate(all="ignore"):       # a compiled kernel computes inf - inf silently too
                return call.numpy_twin(*args)
        if call.numpy_twin is None:
            warm_up()                      # numba is needed now: the thread switches the twinned kernels too
        return _compiled(call)(*args)

    def twin(numpy_function):
        call.numpy_twin = numpy_function
        _twinned.append(call)
        return numpy_function
    call.python_function = function
    call.compiled = None
    call.numpy_twin = None
    call.twin = twin
    return call


# A parallel kernel's outer loop (parallel_kernel): range, except in the
# kernel's parallel form, which numba compiles with its prange there.
prange = range
PARALLEL_ELEMENTS = 2 ** 15     # below this (the first array's size) a pass costs less than starting the pool
PLANE_GROUPS = 16               # a parallel kernel over planes takes them in this many groups, each with its scratch


def parallel_kernel(function):
    """A kernel whose outer loop is a `prange` (this module's): besides its
    serial form (`kernel`'s, where prange is range) numba compiles it with
    parallel=True, and a call runs that form on the one pool
    (cct.devices.pool) where the pass running it has the pool and this step
    more than one BLAS thread; elsewhere (a batch partition's step, a
    process without the pool, a small array) the serial form. Each value
    gets the same operations either way, so the same bits. It is called
    from Python, not from another kernel; `.twin` is the serial form's.
    `.parallel` runs the parallel form whatever the count: for a caller that
    asked pool.kernel_threads() itself before it changed the BLAS count."""
    serial = kernel(function)

    @functools.wraps(function)
    def call(*args):
        if pool.kernel_threads() > 1 and args[0].size >= PARALLEL_ELEMENTS:
            return (call.parallel_form or _parallel(call))(*args)
        return serial(*args)
    call.serial = serial
    call.parallel_form = None
    call.parallel = lambda *args: (call.parallel_form or _parallel(call))(*args)   # whatever the count
    call.twin = serial.twin
    _parallel_kernels.append(call)
    return call


def _parallel(call):
    """The parallel form of a parallel kernel: its code with numba's prange,
    under a name of its own (numba's cache tells forms apart by name)."""
    with _compile_lock:
        if call.parallel_form is None:
            _compiled(call.serial)                         # its callees compiled and bound first
            import numba
            function = call.serial.python_function
            code = function.__code__.replace(co_name=function.__name__ + "_parallel",
                                             co_qualname=function.__qualname__ + "_parallel")
            namespace = dict(function.__globals__, prange=numba.prange)
            parallel = types.FunctionType(code, namespace, code.co_name, function.__defaults__)
            call.parallel_form = _compile(parallel, parallel=True)
    return call.parallel_form


def twinned():
    """The wrappers of the kernels that have a twin (they keep `numpy_twin`
    after their compiled form replaced them in their modules): for the tests."""
    return list(_twinned)


def compiled(function):
    """The compiled form of a kernel (its wrapper or already the compiled
    function, which replaces the wrapper in its module), compiling it now:
    for the tests that compare it with its twin."""
    return _compiled(function) if hasattr(function, "python_function") else function


_compile_lock = threading.RLock()          # re-entrant: a kernel compiles its callees first
_twinned: List[Any] = []                   # the wrappers given a twin, in the order they were
_parallel_kernels: List[Any] = []          # parallel_kernel's wrappers
_twins_stand_in = True                     # until the warm-up thread has switched the kernels their twins ran for
# the wrappers whose twins ran -> {their arguments' types: stand-ins of those
# arguments}: the thread compiles each kernel for those types
_stood_in: Dict[Any, Dict[tuple, tuple]] = {}


def _argument_types(args: tuple) -> tuple:
    """What numba types a call's arguments by (an array's dtype, dimensions,
    layout and writability; a scalar's type), without numba."""
    return tuple((a.dtype.str, a.ndim, a.flags.c_contiguous, a.flags.f_contiguous, a.flags.writeable)
                 if isinstance(a, np.ndarray) else type(a) for a in args)


def _stand_in(value: Any) -> Any:
    """An empty array numba types as it types `value` (a scalar: itself), so
    that compiling for a call's types keeps none of its arrays alive."""
    if not isinstance(value, np.ndarray):
        return value
    if value.flags.c_contiguous:
        like = np.empty((0,) * value.ndim, value.dtype)
    elif value.flags.f_contiguous:
        like = np.empty((2,) * value.ndim, value.dtype, order="F")
    else:                                 # neither: numba's "A" layout
        like = np.empty((2,) * (value.ndim - 1) + (4,), value.dtype)[..., ::2]
    like.flags.writeable = value.flags.writeable
    return like


def _compiled(wrapper, calls: Iterable[tuple] = ()):
    """The wrapper's kernel compiled (and each of `calls`' argument types,
    before the compiled form takes the wrapper's place)."""
    if wrapper.compiled is not None:
        return wrapper.compiled
    with _compile_lock:
        if wrapper.compiled is None:
            function = wrapper.python_function
            namespace = function.__globals__
            for name in function.__code__.co_names:      # the kernels it calls, first
                callee = namespace.get(name)
                if hasattr(callee, "python_function"):
                    namespace[name] = _compiled(callee)  # an imported one is bound here too
            compiled = _compile(function)
            _compile_for(compiled, calls)
            if namespace.get(function.__name__) is wrapper:
                namespace[function.__name__] = compiled
            wrapper.compiled = compiled
    return wrapper.compiled


def _compile(function, parallel=False):
    # numba's colour highlighting (colorama) writes a colour reset to stdout
    # at exit where stdout is a pipe it thinks a terminal (every rank under
    # mpirun): stray bytes in the output of `cct time` and `cct train`
    os.environ.setdefault("NUMBA_DISABLE_ERROR_MESSAGE_HIGHLIGHTING", "1")
    import numba
    try:
        return numba.njit(nogil=True, cache=True, error_model="numpy", parallel=parallel)(function)
    except RuntimeError:
        # No writable cache place (a read-only install and no usable home or
        # NUMBA_CACHE_DIR): compile in memory, every process anew.
        return numba.njit(nogil=True, error_model="numpy", parallel=parallel)(function)


_warming = None


def warm_up():
    """Start numba's one-time start-up on a daemon thread, once per process
    (the executor calls it after each forward; a kernel without a twin
    before it compiles): the thread then compiles the kernels whose twins
    ran. A failure here is left for a kernel's own compile to raise, where
    it names its kernel."""
    global _warming
    if _warming is not None:
        return
    with _compile_lock:
        if _warming is not None:
            return
        _warming = threading.Thread(target=_warm, name="cct-numba-warm-up", daemon=True)
    _warming.start()


def ready():
    """Whether numba is started and the kernels whose twins ran compiled
    (from then on every kernel runs compiled)."""
    return not _twins_stand_in


def warmed_up():
    """Wait until numba's start-up thread is done, every kernel whose twin ran
    compiled: before a fork (below), and for a benchmark of the steady state
    or a test of the compiled kernels (while it runs it takes the GIL
    whenever a kernel lets go of it). Nothing to wait for before warm_up."""
    thread = _warming
    if thread is not None and thread.is_alive() and thread is not threading.current_thread():
        thread.join()


# A fork while the thread compiles would leave it holding numba's and cct's
# compile locks in a child that has no such thread (the child's first kernel
# would wait for ever): the fork waits for it first.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=warmed_up)


def _warm():
    global _twins_stand_in
    try:
        _touch(0)
        pooled = _start_pool()
        while True:
            with _compile_lock:
                # copies (one C call each: a partition's thread may add a call's types meanwhile)
                waiting = [wrapper for wrapper in _stood_in.copy() if wrapper.compiled is None]
                if not waiting:
                    _twins_stand_in = False    # from now a twinned kernel compiles on its first call
                    break
            for wrapper in waiting:
                _compiled(wrapper, list(_stood_in[wrapper].copy().values()))
        if pooled:
            _parallel_forms()
    except Exception:        # noqa: BLE001  (the first compile on a call reports it)
        _twins_stand_in = False


def _parallel_forms():
    """The parallel forms of the parallel kernels whose serial forms ran,
    for the argument types they ran with: compiled here, not in a forward."""
    for call in _parallel_kernels:
        calls = _stood_in.get(call.serial)
        if calls:
            _compile_for(_parallel(call), list(calls.copy().values()))


def _compile_for(dispatcher, calls: Iterable[tuple]) -> None:
    """numba's `dispatcher` compiled for each call's argument types (stand-ins)."""
    if calls:
        from numba import typeof
        for args in calls:
            dispatcher.compile(tuple(typeof(a) for a in args))


def _start_pool():
    """The one pool (cct.devices.pool) once numba runs, and whether it did;
    without it OpenBLAS keeps its own threads, so a failure only costs the pool."""
    try:
        return pool.start()
    except Exception:        # noqa: BLE001
        return False


@kernel
def _touch(value):
    """A kernel that does nothing: compiling it starts numba."""
    return value
