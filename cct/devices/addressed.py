"""Compiled loops over many arrays in one call, each array given by its
address. A numba typed List of arrays would carry them, but the first one a
process makes compiles numba's list machinery, which numba does not cache:
0.7-1.2 s, which a deploy net paid in its third forward, the first with an
execution plan (BENCHMARKS.md, issue 39). numba is imported at the top, so
only code that has seen numba started (cct.devices.jit.ready()) imports
this module; the caller keeps the arrays alive while their addresses are in
use.
"""
import numba
import numpy as np
from numba import njit, types
from numba.extending import intrinsic


@intrinsic
def _values_at(typingctx, address, like):
    """A pointer to values of `like`'s type (an array) at `address`, an integer."""
    signature = types.CPointer(like.dtype)(address, like)

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(sig.return_type))
    return signature, codegen


@njit(nogil=True, cache=True)
def first_changed(addresses, snapshot, offsets):
    """The index of the first array (at addresses[i], offsets[i + 1] -
    offsets[i] values of snapshot's unsigned type) whose bits are not its
    piece of `snapshot`, else -1. The loop over one array has no early exit
    and unsigned indices, so it vectorises."""
    for i in range(addresses.shape[0]):
        start = offsets[i]
        current = numba.carray(_values_at(addresses[i], snapshot), (offsets[i + 1] - start,))
        differs = snapshot.dtype.type(0)
        for j in range(current.shape[0]):
            differs |= current[j] ^ snapshot[start + np.uint64(j)]
        if differs:
            return i
    return -1
