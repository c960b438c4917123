"""Run under mpirun by tests/training/test_distributed.py: trains each case
the test names (a solver prototxt per case) with pycaffe, so every rank's
solver joins the MPI world by itself, and rank 0 writes the weights it ends
with, and every rank the solver_count and solver_rank pycaffe reports,
whether each solver summed gradients during backward, its sums' units and
the order it issued them in (GradientSum.trace), and, of the iterations it
ran on the streams, in how many a sum started before the iteration's last
gradient sub-task ended.

    [MPI_WORKER_HOLD=1] [CCT_GPU=0] python mpi_worker.py OUT_FOLDER SOLVER.prototxt...

MPI_WORKER_HOLD=1: the communication thread sees an iteration's sums only
once backward has made every one ready here, so it chooses among all and
their order shows.

CCT_GPU=0 (the ranks train on OpenCL device 0): each rank also writes, per
solver, the most times one gradient came down from the device in one
iteration (the sums read each once).
"""
import json
import os
import sys

import numpy as np

import cct as caffe


def main(out, solvers):
    overlap, units, traces, early, downloads = [], [], [], [], []
    for path in solvers:
        solver = caffe.get_solver(path)
        counted = counting_gradient_downloads(solver) if os.environ.get("CCT_GPU") else None
        summed = solver.gradient_sum
        overlap.append(summed.overlap)
        units.append(summed.units)
        summed.trace = []
        traces.append(summed.trace)
        if os.environ.get("MPI_WORKER_HOLD") == "1" and summed.overlap:
            held(summed._queue, len(summed.units))
        if counted is None:
            solver.step(solver.param.max_iter)
        for _ in range(solver.param.max_iter if counted is not None else 0):
            counted.clear()
            solver.step(1)
            downloads.append(max(counted.values(), default=0))
        early.append(sums_during_backward(solver))
        if solver.is_root:
            weights = {f"{name}.{i}": blob.data for name, blobs in solver.net.params.items()
                       for i, blob in enumerate(blobs)}
            np.savez(os.path.join(out, os.path.basename(path) + ".npz"), **weights)
        solver.close()
    seen = {"solver_count": caffe.solver_count(), "solver_rank": caffe.solver_rank(), "overlap": overlap,
            "units": units, "traces": traces,
            "sums_during_backward": early, "most_downloads_of_a_gradient": max(downloads, default=None)}
    with open(os.path.join(out, f"rank{caffe.solver_rank()}.json"), "w") as handle:
        json.dump(seen, handle)


def counting_gradient_downloads(solver):
    """{parameter index: downloads of its gradient since cleared}, counted at
    the OpenCL device's download."""
    from cct.devices import opencl
    counted, params, download = {}, solver.net.learnable_params, opencl.OpenCLDevice.download

    def counting(device, buffer, host, offset=0):
        for index, blob in enumerate(params):
            store = blob._diff_store
            if store is not None and np.shares_memory(host, store):
                counted[index] = counted.get(index, 0) + 1
        return download(device, buffer, host, offset)
    opencl.OpenCLDevice.download = counting
    return counted


def sums_during_backward(solver):
    """[iterations where a sum started before the last gradient sub-task of
    its iteration ended, iterations], over the last run of each streams
    schedule the solver made."""
    counts = [0, 0]
    for schedule in solver._stream_schedules.values():
        iterations = {span.task.iteration for span in schedule.trace}
        for iteration in iterations:
            spans = [span for span in schedule.trace if span.task.iteration == iteration]
            sums = [span.start for span in spans if span.task.kind == "sum"]
            gradients = [span.end for span in spans if span.task.kind.startswith("backward")]
            counts[0] += bool(sums and gradients and min(sums) < max(gradients))
            counts[1] += 1
    return counts


def held(queued, count):
    """The units backward makes ready reach the queue all at once, when the
    last is ready (put under the queue's lock: the thread takes them together)."""
    put, waiting = queued.put, []

    def gathered(item, *args, **kwargs):
        if item is None:
            return put(item, *args, **kwargs)
        waiting.append(item)
        if len(waiting) == count:
            with queued.mutex:
                queued.queue.extend(waiting)
                queued.not_empty.notify()
            waiting.clear()
    queued.put = gathered


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
