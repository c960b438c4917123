"""Issue 37's traffic figures: the bytes a training iteration moves between
the host and an OpenCL device (pocl here), each way, counted at the
device's upload and download calls and labelled by the store they touch:
parameters, their gradients, the solver's history, the rest (the input
batch, the loss, dropout masks, ...). The data layers are Input blobs
refilled on the host every iteration, as a data layer writes its batch.

    python bench/device_traffic.py [--net lenet|caffenet] [--batch 64] [--iterations 3]
                                   [--solver SGD] [--device 0]

Counted over --iterations after one warm-up iteration, with the times the
compute queue drained (a blocking copy or a finish waits for all before it). Runs against another
tree's install too (PYTHONPATH=DIR), which is how main's figures were taken.
"""
import argparse
import collections
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

NETS = {"lenet": (os.path.join(common.REPO, "models", "lenet", "lenet_train_test.prototxt"), 10,
                  lambda batch: [(batch, 1, 28, 28), (batch,)]),
        "caffenet": (common.CAFFENET, 1000, None)}


class Counter:
    """Wraps the device class's upload and download: bytes and calls per (way,
    label); and the times the compute queue drains: each blocking copy
    (pyopencl.enqueue_copy's default) and each finish."""

    def __init__(self, device_class):
        self.bytes, self.calls, self.stores = collections.Counter(), collections.Counter(), []
        self.drains = 0
        for way in ("upload", "download"):
            setattr(device_class, way, self._counted(getattr(device_class, way), way))
        import pyopencl
        copy, finish = pyopencl.enqueue_copy, device_class.finish

        def counted_copy(queue, *args, **kwargs):
            self.drains += bool(kwargs.get("is_blocking", True))
            return copy(queue, *args, **kwargs)

        def counted_finish(device):
            self.drains += 1
            return finish(device)
        pyopencl.enqueue_copy, device_class.finish = counted_copy, counted_finish

    def _counted(self, call, way):
        def counted(device, buffer, host, offset=0):
            label = next((name for name, store in self.stores if np.shares_memory(host, store)), "other")
            self.bytes[way, label] += host.nbytes
            self.calls[way, label] += 1
            return call(device, buffer, host, offset)
        return counted

    def watch(self, solver):
        """Label the solver's stores, read without a sync (reading .diff would make the host their owner)."""
        params = solver.net.learnable_params
        histories = getattr(solver, "history_blobs", None)      # blobs since issue 37, arrays before
        histories = solver.history if histories is None else [blob.data_view for blob in histories]
        self.stores = ([("parameters", blob.data_view) for blob in params]
                       + [("gradients", blob._diff_store) for blob in params]
                       + [("history", history) for history in histories])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--net", choices=sorted(NETS), default="lenet")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--solver", default="SGD")
    parser.add_argument("--device", type=int, default=0)
    args = parser.parse_args()
    import cct
    from cct.devices import opencl
    from cct.runtime import settings
    counter = Counter(opencl.OpenCLDevice)
    path, classes, shapes = NETS[args.net]
    param, inputs = common.net_param_with_inputs(path, args.batch, shapes and shapes(args.batch))
    settings.set_device_id(args.device)
    settings.set_mode("gpu")
    solver = common.sgd_solver(param)
    if args.solver != "SGD":
        solver.param.type = args.solver
        solver = cct.get_solver(solver.param)
    step = lambda: (common.fill_inputs(solver.net, inputs, classes), solver.step(1))
    step()                                      # warm-up: buffers made, weights and history uploaded once
    counter.watch(solver)
    counter.bytes.clear(), counter.calls.clear()
    counter.drains = 0
    start = time.perf_counter()
    for _ in range(args.iterations):
        step()
    seconds = (time.perf_counter() - start) / args.iterations
    batch_bytes = sum(4 * int(np.prod(shape)) for shape in inputs.values())
    common.print_flush(f"{args.net} batch {args.batch}, {args.solver}, on {opencl.device(args.device).name}; "
                       f"load {common.load_average():.1f}; per iteration ({seconds * 1e3:.0f} ms), input batch "
                       f"{batch_bytes / 1e6:.3f} MB:")
    for way in ("upload", "download"):
        for label in ("parameters", "gradients", "history", "other"):
            common.print_flush(f"  {way:8s} {label:10s} {counter.bytes[way, label] / args.iterations / 1e6:10.3f} MB"
                               f" in {counter.calls[way, label] / args.iterations:g} copies")
    common.print_flush(f"  the compute queue drained {counter.drains / args.iterations:g} times "
                       "(blocking copies and finishes)")


if __name__ == "__main__":
    main()
