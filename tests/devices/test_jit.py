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


def test_building_a_net_starts_numba_once_on_a_thread():
    """Net() starts numba's start-up on a daemon thread (jit.warm_up), once per
    process; kernels called after it, or while it runs, compute."""
    import numpy as np
    import cct
    from cct.devices import jit
    net = cct.Net('name: "w" input: "data" input_shape { dim: 1 dim: 1 dim: 4 dim: 4 }\n'
                  'layer { name: "pool" type: "Pooling" bottom: "data" top: "pool" '
                  'pooling_param { pool: MAX kernel_size: 2 stride: 2 } }', cct.TEST)
    first = jit._warming
    assert first is not None and first.daemon
    cct.Net('name: "v" input: "data" input_shape { dim: 1 dim: 1 dim: 2 dim: 2 }', cct.TEST)
    assert jit._warming is first                       # started once
    net.blobs["data"].data[...] = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    np.testing.assert_array_equal(net.forward()["pool"].ravel(), [5, 7, 13, 15])
    first.join(timeout=60)
    assert not first.is_alive() and not hasattr(jit._touch, "python_function")    # compiled: the wrapper replaced


def test_a_fork_while_numba_starts_leaves_the_child_able_to_compile():
    """A fork right after Net() (numba starting on its thread) waits for it,
    so the child's kernels compile instead of waiting on a lock no thread
    of the child holds."""
    import os
    import numpy as np
    import cct
    from cct.devices import jit
    jit._warming = None                                 # as in a fresh process: the next Net starts it again
    cct.Net('name: "f" input: "data" input_shape { dim: 1 dim: 1 dim: 2 dim: 2 }', cct.TEST)
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
