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
A FaultIn has a thread take them while the net is built, layer by layer, on
a core the building leaves idle.

The weights a load copies into take small pages (small_pages), as Caffe's
do: numpy asks for 2 MiB pages on arrays of 4 MiB and more, and on virtual
machines the first touch of such a page sometimes costs several times the
512 small pages it stands for (BENCHMARKS.md, "Small pages for the weights").
"""
import ctypes
import functools
import mmap
import os
import sys
import queue
import threading
from typing import Any, Iterable, List, Optional, Set

import numpy as np

_PAGE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = 23           # Linux 5.14: fault in writable, the values left as they are
FAULT_IN_BYTES = 4 << 20            # a net whose blobs take less gains less than a thread costs
# Bytes per madvise: it holds the process's memory map for reading meanwhile,
# and the building thread's next allocation waits for that (64 pages: the
# wait is a few microseconds, the calls a few percent of the work)
FAULT_IN_CHUNK = 64 * _PAGE
HUGE_ADVICE_BYTES = 4 << 20         # numpy advises huge pages on allocations of this size and more


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


def small_pages(array: np.ndarray) -> None:
    """Have the pages of `array` not yet touched come as small ones, against
    the huge-page advice numpy gave its allocation (where it has the size for
    that advice and the platform has madvise; else nothing)."""
    if array.nbytes < HUGE_ADVICE_BYTES or not hasattr(mmap, "MADV_NOHUGEPAGE"):
        return
    start = -(-array.ctypes.data // _PAGE) * _PAGE          # whole pages inside the array only
    end = (array.ctypes.data + array.nbytes) // _PAGE * _PAGE
    _libc().madvise(start, end - start, mmap.MADV_NOHUGEPAGE)   # advice: a refusal changes nothing


@functools.lru_cache(maxsize=None)
def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


class FaultIn:
    """Faults in the pages of the arrays given to add() (their values
    unchanged), one after the other, on a daemon thread started once they
    hold FAULT_IN_BYTES. madvise runs without the GIL (ctypes lets it go),
    so the thread takes the faults while the caller goes on building; a page
    both touch is faulted by whichever comes first. close() says no more
    arrays come (the thread ends when it has done them); stop() before the
    arrays' first use: a thread left running there takes a core from
    OpenBLAS's threads, which wait for it (BENCHMARKS.md, issue 36)."""

    def __init__(self) -> None:
        self._queue: "queue.SimpleQueue[Optional[np.ndarray]]" = queue.SimpleQueue()
        self._seen: Set[int] = set()
        self._waiting: List[np.ndarray] = []          # until they make FAULT_IN_BYTES
        self._waiting_bytes = 0
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self._closed = False

    def add(self, arrays: Iterable[np.ndarray]) -> None:
        for array in arrays:
            if self._closed or id(array) in self._seen or array.nbytes == 0:
                continue
            self._seen.add(id(array))
            if self._thread is not None:
                self._queue.put(array)
                continue
            self._waiting.append(array)
            self._waiting_bytes += array.nbytes
            if self._waiting_bytes >= FAULT_IN_BYTES and sys.platform == "linux":
                for waiting in self._waiting:
                    self._queue.put(waiting)
                self._waiting = []
                self._thread = threading.Thread(target=self._populate, name="cct-fault-in", daemon=True)
                self._thread.start()

    def close(self) -> None:
        """No more arrays: the thread ends once it has faulted in those it has."""
        if not self._closed:
            self._closed = True
            self._waiting = []
            self._queue.put(None)

    def stop(self) -> None:
        """Stop after the array being faulted in, and wait for that (at once
        when it is done)."""
        self._stopping = True
        self.close()
        self.wait()

    def wait(self) -> None:
        """Wait until the thread is done (after close(): every array faulted in)."""
        if self._thread is not None:
            self._thread.join()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def _populate(self) -> None:
        try:        # a core no one else wants, only: not one OpenBLAS's threads of another net wait for
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))   # 0: this thread (Linux)
        except (AttributeError, OSError):
            pass
        madvise = _libc().madvise
        while True:
            array = self._queue.get()
            if array is None or self._stopping:
                return
            small_pages(array)
            start = array.ctypes.data // _PAGE * _PAGE
            end = -(-(array.ctypes.data + array.nbytes) // _PAGE) * _PAGE
            for chunk in range(start, end, FAULT_IN_CHUNK):
                if madvise(chunk, min(FAULT_IN_CHUNK, end - chunk), _MADV_POPULATE_WRITE) != 0:
                    self._stopping = True            # an older kernel (EINVAL): the forward faults them
                    return
