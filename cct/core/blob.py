"""Blob: an N-d array of data and the same-shaped array of its gradient (diff).

As in Caffe, a blob keeps its storage when reshaped to a smaller or equal count,
so views handed out before a reshape stay valid and iterations reuse memory.
`data` and `diff` are writable numpy views, as pycaffe exposes them.

The diff's storage is allocated on first use of `diff` (Caffe's SyncedMemory is
lazy too): in training, the input images' gradient (158 MB for CaffeNet at batch
256) and the labels' are never asked for.
"""
import math
import threading

import numpy as np

from cct.core.errors import ShapeError
from cct.core.allocation import charge_store, check_allocation

# Batch partitions (cct.runtime.executor) may ask for one blob's diff from several
# threads at once: it must be made once, not once per thread.
_ALLOCATION_LOCK = threading.Lock()


class Blob:
    def __init__(self, shape=(), dtype=np.float32):
        self.dtype = np.dtype(dtype)
        self._data_store = np.zeros(0, self.dtype)   # flat storage, may exceed count
        self._diff_store = None                      # same capacity as the data's, once used
        self._shape = ()
        self.reshape(shape)

    # --- shape -------------------------------------------------------------------
    def reshape(self, *shape):
        """Reshape to `shape` (ints, or one tuple/list). Storage grows, never shrinks."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list, np.ndarray)):
            shape = tuple(shape[0])
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ShapeError(f"blob shape must be non-negative, got {shape}")
        check_allocation(shape, self.dtype, blob=self)
        count = math.prod(shape)
        if count > self._data_store.size:
            charge_store((count - self._data_store.size) * self.dtype.itemsize, shape, self)
            self._data_store = _grown(self._data_store, count)
            if self._diff_store is not None:
                self._diff_store = _grown(self._diff_store, count)
        self._shape = shape
        self._make_views()

    def reshape_like(self, other):
        self.reshape(other.shape)

    def _make_views(self):
        count = self.count
        self._data = self._data_store[:count].reshape(self._shape)
        self._diff = None if self._diff_store is None else self._diff_store[:count].reshape(self._shape)

    @property
    def shape(self):
        return self._shape

    @property
    def count(self):
        return int(np.prod(self._shape, dtype=np.int64))

    def count_range(self, start, end=None):
        """Product of dims [start, end), Caffe's count(start, end)."""
        return int(np.prod(self._shape[start:end], dtype=np.int64))

    def canonical_axis(self, axis):
        """Caffe's CanonicalAxisIndex: negative axes count from the end."""
        n = len(self._shape)
        if not -n <= axis < max(n, 1):
            raise ShapeError(f"axis {axis} out of range for a {n}-d blob {self._shape}")
        return axis + n if axis < 0 else axis

    # Caffe's legacy 4-d accessors (LegacyShape): axis i, or 1 past the last axis.
    def _legacy(self, index):
        if len(self._shape) > 4:
            raise ShapeError(f"num/channels/height/width need a blob of at most 4 axes, got {self._shape}")
        return self._shape[index] if index < len(self._shape) else 1

    num = property(lambda self: self._legacy(0))
    channels = property(lambda self: self._legacy(1))
    height = property(lambda self: self._legacy(2))
    width = property(lambda self: self._legacy(3))

    # --- data and diff -----------------------------------------------------------
    @property
    def data(self):
        return self._data

    @data.setter
    def data(self, value):
        self._data[...] = value

    @property
    def diff(self):
        diff = self._diff
        return diff if diff is not None else self._allocate_diff()

    @diff.setter
    def diff(self, value):
        self.diff[...] = value

    def _allocate_diff(self):
        """The diff view, its zeroed storage made now (capacity as the data's)."""
        with _ALLOCATION_LOCK:
            if self._diff_store is None:
                self._diff_store = np.zeros(self._data_store.size, self.dtype)
                self._make_views()
        return self._diff

    def share_data(self, other):
        """Use `other`'s data storage (Caffe's ShareData); counts must agree."""
        self._check_same_count(other)
        self._data_store = other._data_store
        self._make_views()

    def share_diff(self, other):
        """Use `other`'s diff storage (Caffe's ShareDiff); counts must agree."""
        self._check_same_count(other)
        if other._diff_store is None:
            other._allocate_diff()
        self._diff_store = other._diff_store
        self._make_views()

    def use_diff_storage(self, store):
        """Keep the diff in `store`, a flat array of the data's capacity (diff
        sharing hands out slices of shared arenas, cct.runtime.memory); None: in
        a store of its own, made on first use."""
        with _ALLOCATION_LOCK:                     # no lazy allocation racing the swap
            self._diff_store = store
            self._make_views()

    def _check_same_count(self, other):
        if other.count != self.count:
            raise ShapeError(f"cannot share a blob of count {other.count} into one of count {self.count}")

    def __repr__(self):
        return f"Blob(shape={self._shape})"


def _grown(store, count):
    grown = np.zeros(count, store.dtype)
    grown[:store.size] = store
    return grown
