"""OpenBLAS's threaded jobs run on numba's OpenMP threads: the compiled C
callback cct.devices.pool hands to OpenBLAS. numba is imported here at the
top, so only pool.start() imports this module (numba's start-up thread).

OpenBLAS calls `callback(sync, dojob, numjobs, job_size, jobs, dojob_data)`
and expects `dojob(i, jobs + i * job_size, dojob_data)` run for every i, all
at once (its level-3 jobs wait for each other's packed panels), then the
return. numba has no call through a function address, so `_call_job`
emits the indirect call itself.
"""
import numba
from llvmlite import ir
from numba import cfunc, njit, prange, types
from numba.extending import intrinsic

# The thread slot job i runs in (exec_threads' `cpu`: OpenBLAS's per-thread
# buffer and status) is TOP_SLOT - i. OpenBLAS's own threads hold slots 0, 1,
# ..., and one whose slot a job marks busy keeps spinning instead of going to
# sleep, on the cores the jobs need; pool.start() requires MAX_THREADS > TOP_SLOT.
TOP_SLOT = 63


@intrinsic
def _call_job(typingctx, dojob, index, job, dojob_data):
    """dojob(index, job, dojob_data): OpenBLAS's exec_threads, at its address."""
    signature = types.void(dojob, index, job, dojob_data)

    def codegen(context, builder, sig, args):
        address, position, data, extra = args
        int32 = ir.IntType(32)
        job_type = ir.FunctionType(ir.VoidType(), [int32, ir.IntType(8).as_pointer(), int32])

        def narrowed(value):
            return value if value.type.width == 32 else builder.trunc(value, int32)
        builder.call(builder.inttoptr(address, job_type.as_pointer()),
                     [narrowed(position), builder.inttoptr(data, ir.IntType(8).as_pointer()), narrowed(extra)])
        return context.get_dummy_value()
    return signature, codegen


@njit(parallel=True, nogil=True, cache=True)
def run_jobs(dojob, numjobs, job_size, jobs, dojob_data):
    """Every job at once: numba's static schedule gives job i to thread i
    where the calling thread's numba count is at least numjobs (pool.acquire
    checks it; setting the count here would keep this from numba's cache).
    Job i runs in OpenBLAS's thread slot TOP_SLOT - i."""
    for index in prange(numjobs):
        _call_job(dojob, numba.int64(TOP_SLOT - index), jobs + numba.uintp(index) * job_size, dojob_data)


@cfunc(types.void(types.int32, types.uintp, types.int32, types.uintp, types.uintp, types.int32), cache=True)
def callback(sync, dojob, numjobs, job_size, jobs, dojob_data):
    run_jobs(dojob, numjobs, job_size, jobs, dojob_data)


@cfunc(types.void(types.int32, types.uintp, types.int32), cache=True)
def nothing(index, job, dojob_data):
    """A job that does nothing: pool.start() runs it to start the threads."""
