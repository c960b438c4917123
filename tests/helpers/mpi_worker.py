"""Run under mpirun by tests/training/test_distributed.py: trains each case
the test names (a solver prototxt per case) with pycaffe, so every rank's
solver joins the MPI world by itself, and rank 0 writes the weights it ends
with, and every rank the solver_count and solver_rank pycaffe reports and
whether each solver summed gradients during backward.

    python mpi_worker.py OUT_FOLDER SOLVER.prototxt...
"""
import json
import os
import sys

import numpy as np

import cct as caffe


def main(out, solvers):
    overlap = []
    for path in solvers:
        solver = caffe.get_solver(path)
        overlap.append(solver.gradient_sum.overlap)
        solver.step(solver.param.max_iter)
        if solver.is_root:
            weights = {f"{name}.{i}": blob.data for name, blobs in solver.net.params.items()
                       for i, blob in enumerate(blobs)}
            np.savez(os.path.join(out, os.path.basename(path) + ".npz"), **weights)
        solver.close()
    seen = {"solver_count": caffe.solver_count(), "solver_rank": caffe.solver_rank(), "overlap": overlap}
    with open(os.path.join(out, f"rank{caffe.solver_rank()}.json"), "w") as handle:
        json.dump(seen, handle)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
