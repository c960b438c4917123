"""Memory checked before it is taken: the limit, one array against it, and a
net being built against what is left of it.

The limit is the machine's memory (or a smaller cgroup limit, which is what
the kernel kills at), or one the user sets (set_memory_limit, which
`--memory_limit` on the command line and cct.set_memory_limit call); and where
the process has resource limits on its address space or data segment
(`ulimit -v`, `ulimit -d`), whichever of them leaves the least. An array larger
than the limit is refused before numpy tries (check_allocation): numpy would
raise MemoryError or "array is too big", or the kernel would kill the process
at first touch of a lazily mapped one. While a net is built (`charging`), the
blob stores it makes are added up and the one that would take the sum past
what the limit leaves is refused the same way; the whole run's plan (diffs,
workspaces, solver history) is cct.runtime.memory_plan's.
"""
import contextlib
import functools
import math
import os
import resource
import threading
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np
import numpy.typing as npt

from cct.core.errors import MemoryLimitError

_limit: Optional[int] = None   # bytes the process may take; None: the machine's memory
_building = threading.local()  # .charge: the _Charge of the net this thread builds (charging), or None


def set_memory_limit(nbytes: Optional[int]) -> Optional[int]:
    """Refuse any one blob or work array larger than `nbytes`, and a net whose
    memory plan (cct.runtime.memory_plan) exceeds it (None: the machine's
    memory, the default). Returns the previous setting."""
    global _limit
    previous, _limit = _limit, None if nbytes is None else int(nbytes)
    return previous


def memory_limit() -> Optional[int]:
    """The limit set_memory_limit set, or None."""
    return _limit


@functools.lru_cache(maxsize=None)
def machine_memory() -> Tuple[int, str]:
    """(bytes, what they are): the physical memory, or a smaller cgroup limit
    (a container's memory.max)."""
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as limit_file:
                text = limit_file.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < physical:
            return int(text), f"the {format_bytes(int(text))} this process's cgroup may use ({path})"
    return physical, f"the {format_bytes(physical)} of memory this machine has"


def available() -> Tuple[int, str]:
    """(bytes, what they are): the user's limit, else the machine's memory; or
    less, where a resource limit of the process (process_limits) leaves less."""
    if _limit is not None:
        smallest = _limit, f"the memory limit of {format_bytes(_limit)}"
    else:
        smallest = machine_memory()
    return min([smallest, *process_limits()], key=lambda limit: limit[0])


# The kernel refuses a mapping that takes the address space (VmSize) past
# RLIMIT_AS, or the private writable memory (VmData, numpy's arrays among it:
# Linux 4.7 on) past RLIMIT_DATA, when it is mapped, not when it is touched.
_RLIMITS = (("RLIMIT_AS", "VmSize", "address space", "ulimit -v"),
            ("RLIMIT_DATA", "VmData", "data segment", "ulimit -d"))


def process_limits() -> List[Tuple[int, str]]:
    """[(bytes, what they are)] for each of RLIMIT_AS and RLIMIT_DATA that is
    set, in the terms the plan counts: the plan adds what will be allocated
    to the resident memory, and these limits count mappings, so what the
    process has mapped beyond its resident memory is taken off the limit:
    resident + new <= limit - (mapped - resident) is mapped + new <= limit."""
    found = []
    for name, field, what, command in _RLIMITS:
        soft = resource.getrlimit(getattr(resource, name))[0]
        if soft == resource.RLIM_INFINITY:
            continue
        mapped, resident = _status_bytes(field), resident_bytes()
        if mapped is None:
            continue
        found.append((soft - (mapped - resident),
                      f"what this process's {what} limit of {format_bytes(soft)} leaves ({name}, `{command}`; "
                      f"{format_bytes(mapped)} of it mapped, {format_bytes(resident)} resident)"))
    return found


def _status_bytes(field: str) -> Optional[int]:
    """A /proc/self/status field in bytes (VmSize, VmData), or None off Linux."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def resident_bytes() -> int:
    """This process's resident memory now (Linux: /proc/self/statm; elsewhere its peak so far)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_resident_bytes()


def peak_resident_bytes() -> int:
    """This process's peak resident memory so far: Linux's VmHWM, which starts
    afresh at exec (ru_maxrss, the fallback, keeps the parent's peak across a
    fork and exec, so a run started from a big process would report that)."""
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if os.uname().sysname == "Darwin" else peak * 1024      # KiB on Linux


def reset_peak_resident() -> bool:
    """Start the peak (VmHWM) afresh from the current resident memory, where
    Linux allows it (/proc/self/clear_refs); returns whether it did."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def check_allocation(shape: Sequence[int], dtype: npt.DTypeLike, what: str = "blob", blob: object = None) -> None:
    """Raise MemoryLimitError, before numpy tries, when an array of `shape` and
    `dtype` could not fit in the limit, or numpy could not make it at all."""
    shape, itemsize = tuple(int(d) for d in shape), np.dtype(dtype).itemsize
    nbytes = math.prod(shape) * itemsize                                  # Python ints: no overflow
    limit, limit_text = available()
    if nbytes > limit:
        raise MemoryLimitError(what, f" of shape {shape} needs {format_bytes(nbytes)}, more than {limit_text}",
                               blob)
    if math.prod(d for d in shape if d) * itemsize >= 1 << 63:     # numpy refuses even an empty one
        raise MemoryLimitError(what, f" of shape {shape} is too large for numpy (its non-zero axes "
                                     "would take 2^63 bytes or more)", blob)


class _Charge:
    def __init__(self, in_use: int, budget: int, what: str):
        self.in_use, self.budget, self.what, self.taken = in_use, budget, what, 0


@contextlib.contextmanager
def charging(source: str) -> Iterator[_Charge]:
    """Inside the block (a net being built from `source`), add up the bytes of
    every blob store made or grown, and refuse the one that would take the sum
    past what the limit leaves after the process's own memory, before numpy
    allocates it. A block inside another counts in the outer one. Stores are
    mapped at allocation and taken at first touch (np.zeros), so this is what
    keeps a net that cannot fit from filling its first parameters anyway."""
    outer = getattr(_building, "charge", None)
    if outer is not None:
        yield outer
        return
    limit, limit_text = available()
    in_use = resident_bytes()
    _building.charge = _Charge(in_use, limit - in_use, f"{limit_text} leaves ({format_bytes(in_use)} of it in "
                                                       f"use before {source})")
    try:
        yield _building.charge
    finally:
        _building.charge = None


def charge_store(nbytes: int, shape: Sequence[int], blob: object) -> None:
    """Count a blob store of `nbytes` (of a blob of `shape`) made inside `charging`
    on this thread (a prefetch thread's batches are the plan's, not the build's)."""
    charge = getattr(_building, "charge", None)
    if charge is None:
        return
    if charge.taken + nbytes > charge.budget:
        raise MemoryLimitError("blob", f" of shape {shape} would take the net being built to "
                                       f"{format_bytes(charge.taken + nbytes)}, more than {charge.what}", blob)
    charge.taken += nbytes


def format_bytes(nbytes: float) -> str:
    """238 GiB, 12.5 MiB, 512 bytes."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            value = nbytes / size
            return f"{value:.0f} {unit}" if value >= 100 else f"{value:.4g} {unit}"
    return f"{nbytes} bytes"
