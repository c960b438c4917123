"""Test-wide settings. pytest runs with -n 2 on a 2-core machine: one BLAS
thread per worker, so two workers' GEMMs do not oversubscribe the cores
(OpenBLAS threads busy-wait, and a preempted one stalls the whole GEMM).
The lowering chooser's cache goes to a temporary folder, and this folder is
on sys.path for tests/siblings.py."""
import os
import sys
import tempfile

from threadpoolctl import threadpool_limits

threadpool_limits(limits=1, user_api="blas")
# The lowering chooser caches machine constants; keep tests off ~/.cache.
os.environ.setdefault("CCT_CACHE_DIR", tempfile.mkdtemp(prefix="cct-cache-"))
# Test files share helpers through tests/siblings.py (see its docstring).
sys.path.insert(0, os.path.dirname(__file__))
