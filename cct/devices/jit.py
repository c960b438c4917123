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

Kernels are serial and release the GIL (`nogil`): cct's parallelism is the
executor's batch partitions (cct.runtime.executor), each on its own thread, so a
kernel never starts threads of its own that would compete with OpenBLAS's.
`cache` keeps the compiled code in __pycache__ (NUMBA_CACHE_DIR elsewhere),
so only the first run on a machine pays the compile time. numba itself is
imported on a kernel's first call (it was a quarter of `import cct`'s time):
`cct --help`, or a script that only reads weights, needs none of it. The first
call compiles under a lock, so partitions starting at once compile a kernel once.
numba's own start-up on the first kernel (its typing and lowering registries,
about a second) begins in a thread when a net is built (warm_up), beside the
net's construction and its weights' loading.
"""
import functools
import os
import threading


def kernel(function):
    """`function` compiled by numba (nogil, cached) on its first call. A kernel
    may call other kernels, of its module or imported into it: they are
    compiled first, and each compiled kernel replaces its wrapper in the
    caller's module, which is how numba finds it when compiling the caller."""
    @functools.wraps(function)
    def call(*args):
        return _compiled(call)(*args)
    call.python_function = function
    call.compiled = None
    return call


_compile_lock = threading.RLock()          # re-entrant: a kernel compiles its callees first


def _compiled(wrapper):
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
            if namespace.get(function.__name__) is wrapper:
                namespace[function.__name__] = compiled
            wrapper.compiled = compiled
    return wrapper.compiled


def _compile(function):
    # numba's colour highlighting (colorama) writes a colour reset to stdout
    # at exit where stdout is a pipe it thinks a terminal (every rank under
    # mpirun): stray bytes in the output of `cct time` and `cct train`
    os.environ.setdefault("NUMBA_DISABLE_ERROR_MESSAGE_HIGHLIGHTING", "1")
    import numba
    try:
        return numba.njit(nogil=True, cache=True, error_model="numpy")(function)
    except RuntimeError:
        # No writable cache place (a read-only install and no usable home or
        # NUMBA_CACHE_DIR): compile in memory, every process anew.
        return numba.njit(nogil=True, error_model="numpy")(function)


_warming = None


def warm_up():
    """Start numba's one-time start-up on a daemon thread, once per process:
    the first kernel a net calls then finds it done or under way. A failure
    here is left for that call to raise, where it names its kernel."""
    global _warming
    with _compile_lock:
        if _warming is not None:
            return
        _warming = threading.Thread(target=_warm, name="cct-numba-warm-up", daemon=True)
    _warming.start()


def warmed_up():
    """Wait until numba's start-up thread is done: before a fork (below), and
    for a benchmark of the steady state (while it runs it takes the GIL
    whenever a kernel lets go of it)."""
    thread = _warming
    if thread is not None and thread.is_alive() and thread is not threading.current_thread():
        thread.join()


# A fork while the thread compiles would leave it holding numba's and cct's
# compile locks in a child that has no such thread (the child's first kernel
# would wait for ever): the fork waits for it first.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=warmed_up)


def _warm():
    try:
        _touch(0)
    except Exception:        # noqa: BLE001  (the first real kernel call reports it)
        pass


@kernel
def _touch(value):
    """A kernel that does nothing: compiling it starts numba."""
    return value
