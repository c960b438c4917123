"""cct.devices.jit: kernels compile on first use, and without a cache where none can be written."""
import numpy as np

from cct.devices import jit


def test_kernel_compiles_on_first_call_and_computes():
    @jit.kernel
    def total(values):
        result = 0.0
        for value in values:
            result += value
        return result

    assert total(np.arange(5.0)) == 10.0
    assert total.__name__ == "total"


def test_no_writable_cache_falls_back_to_compiling_in_memory(monkeypatch):
    jit.warm_up()
    jit.warmed_up()                 # numba's start-up thread compiles nothing while njit is replaced
    import numba
    real_njit = numba.njit
    asked = []

    def njit(**options):
        asked.append(options.get("cache", False))
        if options.get("cache"):
            raise RuntimeError("cannot cache function: no locator available")
        return real_njit(**options)
    monkeypatch.setattr(numba, "njit", njit)

    @jit.kernel
    def double(value):
        return 2 * value

    assert double(21) == 42 and asked == [True, False]


def test_a_kernel_calls_another_kernel_of_its_module():
    """The callee compiles first and replaces its wrapper in the module, where
    numba looks it up while compiling the caller."""
    import types
    module = types.ModuleType("kernels_for_test")
    exec("from cct.devices.jit import kernel\n"
         "@kernel\n"
         "def square(v):\n"
         "    return v * v\n"
         "@kernel\n"
         "def sum_of_squares(values):\n"
         "    total = 0.0\n"
         "    for v in values:\n"
         "        total += square(v)\n"
         "    return total\n", module.__dict__)
    wrapper = module.sum_of_squares
    assert wrapper(np.arange(4.0)) == 14.0
    assert module.square is not None and not hasattr(module.square, "python_function")   # compiled in place
    assert wrapper(np.arange(3.0)) == 5.0 and module.sum_of_squares(np.arange(2.0)) == 1.0


FIRST_FORWARD = """
import sys
import numpy as np
import cct
from cct.devices import jit
from cct.layers import pooling_kernels
net = cct.Net('name: "w" input: "data" input_shape { dim: 1 dim: 2 dim: 7 dim: 7 }\\n'
              'layer { name: "pool" type: "Pooling" bottom: "data" top: "pool" '
              'pooling_param { pool: AVE global_pooling: true } }', cct.TEST)
assert jit._warming is None and "numba" not in sys.modules, "numba started before the first forward"
net.blobs["data"].data[...] = np.random.default_rng(0).standard_normal((1, 2, 7, 7))
first = net.forward()["pool"].copy()
wrapper = next(w for w in jit.twinned() if w.__name__ == "ave_whole")
assert wrapper.compiled is None, "the first forward waited for numba"
assert jit._warming is not None and jit._warming.daemon          # started after it
jit.warmed_up()
assert jit.ready() and wrapper.compiled is not None               # compiled for the types its twin ran
assert pooling_kernels.ave_whole is wrapper.compiled              # and in the wrapper's place
second = net.forward()["pool"]
assert first.tobytes() == second.tobytes()
print("ok")
"""


def test_a_first_forward_runs_twins_then_starts_numba_on_a_thread():
    """In a fresh process, a net's first forward runs its kernels' numpy twins
    without importing numba; numba starts on a daemon thread after it and
    compiles those kernels, whose compiled forms give the same bits."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", FIRST_FORWARD], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_a_kernel_without_a_twin_compiles_on_its_first_call_and_starts_numba():
    from cct.devices import jit

    @jit.kernel
    def halved(value):
        return value / 2

    assert halved(3.0) == 1.5 and halved.compiled is not None and jit._warming is not None


def test_a_fork_while_numba_starts_leaves_the_child_able_to_compile():
    """A fork right after a first forward (numba starting on its thread)
    waits for it, so the child's kernels compile instead of waiting on a
    lock no thread of the child holds."""
    import os
    import numpy as np
    import cct
    from cct.devices import jit
    jit._warming = None                                 # as in a fresh process: the next forward starts it again
    cct.Net('name: "f" input: "data" input_shape { dim: 1 dim: 1 dim: 2 dim: 2 }', cct.TEST).forward()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            @jit.kernel
            def doubled(values):
                return values * 2

            os.write(write, str(float(doubled(np.float64(21.0)))).encode())
        finally:
            os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    assert os.read(read, 32) == b"42.0" and status == 0
