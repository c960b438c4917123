"""The forward's lowered matrix, kept for the backward's weight gradient.

The weight gradient multiplies dy by the very matrix the forward lowered the
bottom into. When the bottom still holds what the forward lowered, the
backward reads the kept matrix instead of lowering again (that second
lowering was most of LeNet's lowering copies:
BENCHMARKS.md, "Behind lowering/kept.py").

Whether the bottom is unchanged cannot be told from the blob: Blob.data is a
writable numpy view (pycaffe's mutable_cpu_data), so an in-place layer, a
blob sharing the store, or a script between forward and backward may write
it without a trace. So the forward also keeps a copy of its bottom, and the
backward compares the two bit for bit: one pass over the bottom, a KH*KW-th
of the lowering it saves. A mismatch (or another shape, type or geometry)
lowers again, as before.

The forward writes the lowered matrix into the kept store instead of its
thread's arena: `workspace(ws, kind)` hands out the kept store for the slot
holding the lowering type's matrix (LOWERED_SLOT) and the arena's for the rest.
A backward of both gradients runs on such a workspace too: every lowering
type computes the weight gradient first, so the data gradient's product,
which asks for the same slot, then overwrites the spent matrix (written
elsewhere, that product evicted the store, and the forward wrote it slower:
BENCHMARKS.md, "After the lowering work: image-major conv1, kept lowerings").
"""
from typing import Dict, Mapping, Optional, Sequence, Tuple

import numpy as np
import numpy.typing as npt

from cct.core.arrays import Array, FloatArray, Shape
from cct.core.bits import same_bits
from cct.core.workspace import Workspace

from .geometry import ConvGeometry

KeptKey = Tuple[int, ConvGeometry, Shape, np.dtype]      # (lowering type, geometry, bottom shape, dtype)
LOWERED_SLOT: Dict[int, str] = {1: "lowered", 2: "lowered", 3: "padded"}  # type 3's lowered matrix is the padded input


def kept_bytes(slots: Mapping[str, int], lowering_type: int, bottom_bytes: int) -> int:
    """What keeping costs: the lowered matrix (its slot in `slots`, see
    cct.lowering.chunking.slot_bytes) and the copy of the bottom."""
    return slots[LOWERED_SLOT[lowering_type]] + bottom_bytes


class KeptLowering:
    """One bottom's lowered matrix and the bottom it was lowered from."""

    def __init__(self) -> None:
        self.store: Array = np.empty(0, np.uint8)
        self.bottom: Array = np.empty(0, np.uint8)
        self.matrix: Optional[Array] = None  # the last lowering written into store, as its type shaped it
        self.key: Optional[KeptKey] = None  # the matrix's; None: nothing kept

    def workspace(self, ws: Workspace, lowering_type: int) -> "_Keeping":
        """`ws` with the lowered matrix's slot in this store; forgets what was kept."""
        self.key = self.matrix = None
        return _Keeping(ws, self, LOWERED_SLOT[lowering_type])

    def record(self, x: FloatArray, lowering_type: int, geom: ConvGeometry) -> None:
        """After a forward on `workspace`: keep a copy of its bottom `x`."""
        if self.matrix is None:
            return
        if self.bottom.size < x.nbytes:
            self.bottom = np.empty(x.nbytes, np.uint8)
        np.copyto(self._bottom_as(x), x)
        self.key = (lowering_type, geom, x.shape, x.dtype)

    def matrix_for(self, x: FloatArray, lowering_type: int, geom: ConvGeometry) -> Optional[Array]:
        """The kept matrix when `x` is bitwise the bottom it was lowered from, else None."""
        if self.key != (lowering_type, geom, x.shape, x.dtype):
            return None
        return self.matrix if same_bits(self._bottom_as(x), x) else None     # -0.0 is not 0.0, NaN is itself

    def forget(self) -> None:
        self.key = self.matrix = None

    def _bottom_as(self, x: FloatArray) -> FloatArray:
        return self.bottom[:x.nbytes].view(x.dtype).reshape(x.shape)

    def _array(self, shape: Shape, dtype: np.dtype) -> Array:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if self.store.size < nbytes:
            self.store = np.empty(nbytes, np.uint8)
        self.matrix = self.store[:nbytes].view(dtype).reshape(shape)
        return self.matrix


class _Keeping:
    """A workspace whose `slot` is a KeptLowering's store, the rest `ws`'s."""

    def __init__(self, ws: Workspace, kept: KeptLowering, slot: str):
        self.ws, self.kept, self.slot = ws, kept, slot

    def plan(self, sizes: Mapping[str, int]) -> None:
        self.ws.plan(sizes)

    def empty(self, slot: str, shape: Sequence[int], dtype: npt.DTypeLike) -> Array:
        if slot == self.slot:
            return self.kept._array(tuple(int(d) for d in shape), np.dtype(dtype))
        return self.ws.empty(slot, shape, dtype)

    def zeros(self, slot: str, shape: Sequence[int], dtype: npt.DTypeLike) -> Array:
        array = self.empty(slot, shape, dtype)
        array.fill(0)
        return array
