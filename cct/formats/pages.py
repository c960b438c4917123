"""A mapped file's pages handed back behind a reader, for loading a .caffemodel.

A load maps the file and copies each blob's values out of it into the net's
arrays (cct.formats.weights); the pages it has read stay in the process until
the mapping goes, so the process would hold the whole file and the whole net
at once. Handed back behind the copy, they stay in the page cache, to be read
again from there if anything touches them, and out of the process's peak
(BENCHMARKS.md, issue 39). Where the platform lacks madvise, nothing changes
but the peak.
"""
import mmap
from typing import Any

import numpy as np

_PAGE = mmap.PAGESIZE


class ReleaseBehind:
    """Hands back the pages of `mapping` (an mmap.mmap; anything else, such as
    bytes read into memory, is left alone) behind a reader that goes through
    it in order: `done(view)` says every byte up to the end of `view`, a
    numpy view of the mapping, has been read."""

    def __init__(self, mapping: Any) -> None:
        self.mapping = mapping if isinstance(mapping, mmap.mmap) and hasattr(mapping, "madvise") else None
        self.base = np.frombuffer(mapping, np.uint8).ctypes.data if self.mapping is not None else 0
        self.released = 0                                  # bytes handed back from the start

    def done(self, view: np.ndarray) -> None:
        if self.mapping is None:
            return
        end = view.ctypes.data + view.nbytes - self.base
        if not 0 <= end <= len(self.mapping):              # a copy (concatenated, converted): not the file's
            return
        end = end // _PAGE * _PAGE
        if end > self.released:
            self.mapping.madvise(mmap.MADV_DONTNEED, self.released, end - self.released)
            self.released = end
