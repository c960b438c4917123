"""Test-wide settings. pytest runs with -n 2 on a 2-core machine: one BLAS
thread per worker, so two workers' GEMMs do not oversubscribe the cores
(OpenBLAS threads busy-wait, and a preempted one stalls the whole GEMM)."""
from threadpoolctl import threadpool_limits

threadpool_limits(limits=1, user_api="blas")
