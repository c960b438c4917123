"""Bit-for-bit equality of two arrays, as one memcmp.

cct keeps copies to learn whether an array that a user may write through a
numpy view has changed since it was last read: Winograd's transformed
weights (cct.lowering.winograd) and a kept lowering's bottom
(cct.lowering.kept). Nothing flags such a write, so every use compares.
np.array_equal on bit views makes a boolean array and then reduces it, three
passes; libc's memcmp reads the two arrays once, releases the GIL (ctypes
does for every foreign call) and stops at the first difference.
Small arrays compared at every forward go another way: a fused run's
Replay (cct.runtime.fusion) keeps bit views of its parameters and compares
them in a compiled loop, without this function's checks and ctypes pointers
(BENCHMARKS.md, "Behind cct/core/bits.py").
"""
import ctypes
import ctypes.util
import sys
from typing import Any, Optional

import numpy as np

from cct.core.arrays import Array


def _libc_memcmp() -> Optional[Any]:
    name = "msvcrt" if sys.platform == "win32" else ctypes.util.find_library("c")
    try:
        memcmp = ctypes.CDLL(name).memcmp
    except (OSError, AttributeError, TypeError):
        return None
    memcmp.restype = ctypes.c_int
    memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    return memcmp


_memcmp = _libc_memcmp()


def same_bits(a: Array, b: Array) -> bool:
    """Whether `a` and `b` have the same shape and dtype and hold the same
    bytes in C order: -0.0 is not 0.0, and a NaN equals the same NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    if a.nbytes == 0:
        return True
    if _memcmp is None:
        return np.array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))
    return _memcmp(a.ctypes.data, b.ctypes.data, a.nbytes) == 0
