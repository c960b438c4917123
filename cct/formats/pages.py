"""Pages: a mapped file's handed back behind a reader, for loading a
.caffemodel, and a new net's blobs faulted in beside the load.

A load maps the file and copies each blob's values out of it into the net's
arrays (cct.formats.weights); the pages it has read stay in the process until
the mapping goes, so the process would hold the whole file and the whole net
at once. Handed back behind the copy, they stay in the page cache, to be read
again from there if anything touches them, and out of the process's peak
(BENCHMARKS.md, issue 39). Where the platform lacks madvise, nothing changes
but the peak.

A new net's blobs are zeroed stores whose pages the kernel has not given
yet: the first forward would take a page fault per 4 KiB it writes (ResNet-50
at batch 1: 24,000, a third of its first forward on this project's VMs).
`fault_in` has a thread take them while the weights load, on a core the
load leaves idle.
"""
import ctypes
import mmap
import os
import sys
import threading
from typing import Any, List, Optional

import numpy as np

_PAGE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = 23           # Linux 5.14: fault in writable, the values left as they are
FAULT_IN_BYTES = 4 << 20            # a net whose blobs take less gains less than a thread costs


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


class FaultIn:
    """Faults in the pages of `arrays` (their values unchanged), one array
    after the other, on a daemon thread. madvise runs without the GIL
    (ctypes lets it go), so the thread takes the faults while the caller
    goes on; a page both touch is faulted by whichever comes first. stop()
    before the arrays' first use: a thread left running there takes a core
    from OpenBLAS's threads, which wait for it (BENCHMARKS.md, issue 36)."""

    def __init__(self, arrays: List[np.ndarray]) -> None:
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._populate, args=(list(arrays),), name="cct-fault-in", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop after the array being faulted in, and wait for that."""
        self._stopping.set()
        self._thread.join()

    def wait(self) -> None:
        """Wait until every array is faulted in (tests, benchmarks)."""
        self._thread.join()

    def _populate(self, arrays: List[np.ndarray]) -> None:
        try:        # a core no one else wants, only: not one OpenBLAS's threads of another net wait for
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))   # 0: this thread (Linux)
        except (AttributeError, OSError):
            pass
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        for array in arrays:                       # held in the list: none is freed meanwhile
            if self._stopping.is_set():
                return
            start = array.ctypes.data // _PAGE * _PAGE
            end = -(-(array.ctypes.data + array.nbytes) // _PAGE) * _PAGE
            if end > start and madvise(start, end - start, _MADV_POPULATE_WRITE) != 0:
                return                             # an older kernel (EINVAL): the forward faults them


def fault_in(arrays: List[np.ndarray]) -> Optional[FaultIn]:
    """A FaultIn of `arrays`; None where they hold under FAULT_IN_BYTES or
    the platform has no MADV_POPULATE_WRITE."""
    if sys.platform != "linux" or sum(array.nbytes for array in arrays) < FAULT_IN_BYTES:
        return None
    return FaultIn(arrays)
