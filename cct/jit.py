"""Compiled CPU kernels: the decorator every numba kernel in cct uses.

numpy expresses most layers as a few whole-array passes. A window loop
(max pooling's argmax, im2col, col2im) takes a dozen such passes per window
offset, each over the whole batch, where one compiled loop reads every input
once: those loops are numba kernels, written next to the numpy code that
uses them, with a plain reference beside them in the tests.

Kernels are serial and release the GIL (`nogil`): cct's parallelism is the
executor's batch partitions (cct.executor), each on its own thread, so a
kernel never starts threads of its own that would compete with OpenBLAS's.
`cache` keeps the compiled code in __pycache__ (NUMBA_CACHE_DIR elsewhere),
so only the first run on a machine pays the compile time.
"""
import numba

kernel = numba.njit(nogil=True, cache=True, error_model="numpy")
