"""cct.jit: kernels compile on first use, and without a cache where none can be written."""
import numpy as np

from cct import jit


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
