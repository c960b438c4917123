"""Depthwise convolution (group == channels == num_output, MobileNets'):
the direct kernels (cct.lowering.depthwise), which conv_forward and
conv_backward run for such a geometry, against the grouped GEMM path they
replaced (the lowering type the chooser picks for the shape, chunked to the
64 MB budget as the layer chunks it), alternating in one process, medians
of the rounds, at MobileNet v1's depthwise shapes (224 x 224 input).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_depthwise.py [--rounds 7] [--batches 1,16] [--threads 1]

Forward is y from x; backward is both gradients (data and weights), as a
training Convolution's backward asks for them. Each timed sample repeats
the call until it has taken 20 ms at least. --threads sets the BLAS threads
of the GEMM path (the kernels are serial: cct runs them on its batch
partitions' threads).
"""
import argparse
import os
import statistics
import sys

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from cct.core.workspace import thread_arena  # noqa: E402
from cct.lowering import ConvGeometry, chooser, depthwise, lowering  # noqa: E402
from cct.lowering.chunking import DEFAULT_BUDGET_MB, cache_chunk, chunk_size, chunks, slot_bytes  # noqa: E402

# (name, channels, input size, stride): MobileNet v1's depthwise 3 x 3 layers, pad 1
SHAPES = [("conv2_1/dw", 32, 112, 1), ("conv2_2/dw", 64, 112, 2), ("conv3_1/dw", 128, 56, 1),
          ("conv4_1/dw", 256, 28, 1), ("conv5_1/dw", 512, 14, 1), ("conv6/dw", 1024, 7, 1)]
BUDGET = DEFAULT_BUDGET_MB * 2 ** 20


def grouped_gemm(geom, batch):
    """(forward, backward) of the grouped lowering as conv_forward and
    conv_backward run it for a geometry that is not depthwise: the
    chooser's type, the batch in chunks within the budget, the thread's arena."""
    kind = chooser.choose(geom, batch, budget=BUDGET)
    impl, ws = lowering(kind), thread_arena()
    chunk = min(chunk_size(geom, kind, batch, 4, BUDGET), cache_chunk(geom, kind, batch, 4))
    parts = chunks(batch, chunk)

    def forward(x, w, y):
        ws.plan(slot_bytes(geom, kind, min(chunk, batch), 4))
        for start, stop in parts:
            impl.forward(x[start:stop], w, geom, out=y[start:stop], ws=ws)

    def backward(x, w, dy, dx):
        ws.plan(slot_bytes(geom, kind, min(chunk, batch), 4))
        for start, stop in parts:
            impl.backward(x[start:stop], dy[start:stop], w, geom, ws=ws, dx_out=dx[start:stop])
    return kind, forward, backward


def run_shape(name, channels, size, stride, batch, rounds):
    geom = ConvGeometry(channels, channels, size, size, 3, 3, stride, stride, 1, 1, group=channels)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(geom.input_shape(batch)).astype(np.float32)
    w = rng.standard_normal(geom.weight_shape).astype(np.float32)
    dy = rng.standard_normal(geom.output_shape(batch)).astype(np.float32)
    y, dx = np.empty_like(dy), np.empty_like(x)
    kind, gemm_forward, gemm_backward = grouped_gemm(geom, batch)
    calls = {"gemm forward": lambda: gemm_forward(x, w, y),
             "direct forward": lambda: depthwise.forward(x, w, geom, out=y),
             "gemm backward": lambda: gemm_backward(x, w, dy, dx),
             "direct backward": lambda: depthwise.backward(x, dy, w, geom, dx_out=dx)}
    for call in calls.values():
        call()                                    # compiled, arenas grown
    times = {key: [] for key in calls}
    for _ in range(rounds):
        for key, call in calls.items():
            times[key].append(common.sample(call))
    ms = {key: 1e3 * statistics.median(values) for key, values in times.items()}
    print(f"{name:11s} {channels:5d} {size:4d}/{stride} {batch:5d}  type {kind}  "
          f"{ms['gemm forward']:9.3f} {ms['direct forward']:9.3f} {ms['gemm forward'] / ms['direct forward']:6.1f}x  "
          f"{ms['gemm backward']:9.3f} {ms['direct backward']:9.3f} "
          f"{ms['gemm backward'] / ms['direct backward']:6.1f}x", flush=True)
    return ms


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads of the GEMM path")
    args = parser.parse_args()
    with threadpool_limits(limits=args.threads, user_api="blas"):
        print(common.machine_line())
        print(f"{'layer':11s} {'C':>5s} {'in/s':>6s} {'batch':>5s}  {'':6s}  {'forward ms: gemm':>19s} "
              f"{'direct':>9s} {'ratio':>7s}  {'backward: gemm':>9s} {'direct':>9s} {'ratio':>7s}")
        totals = {}
        for batch in [int(b) for b in args.batches.split(",")]:
            for name, channels, size, stride in SHAPES:
                for key, value in run_shape(name, channels, size, stride, batch, args.rounds).items():
                    totals[batch, key] = totals.get((batch, key), 0.0) + value
            print(f"{'all six':11s} {'':5s} {'':6s} {batch:5d}  {'':6s}  "
                  f"{totals[batch, 'gemm forward']:9.3f} {totals[batch, 'direct forward']:9.3f} "
                  f"{totals[batch, 'gemm forward'] / totals[batch, 'direct forward']:6.1f}x  "
                  f"{totals[batch, 'gemm backward']:9.3f} {totals[batch, 'direct backward']:9.3f} "
                  f"{totals[batch, 'gemm backward'] / totals[batch, 'direct backward']:6.1f}x", flush=True)


if __name__ == "__main__":
    main()
