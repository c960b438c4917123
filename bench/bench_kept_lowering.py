"""A convolution's forward then backward (both gradients), with the forward's
lowering kept for the backward (cct.lowering.kept) and without, alternating
in one process: medians of the rounds' medians, ms.

    OPENBLAS_NUM_THREADS=1 python bench/bench_kept_lowering.py [--rounds 25] [--batch 64]

The shapes are LeNet's conv1 (type 1 image by image; no data gradient, as in
the net) and conv2 (type 1 batch-inner), float32.
"""
import argparse
import statistics
import time

import numpy as np

import common
from cct.core.workspace import Arena
from cct.lowering import ConvGeometry, conv_backward, conv_forward
from cct.lowering.kept import KeptLowering

SHAPES = {"conv1": (ConvGeometry(1, 20, 28, 28, 5, 5), False), "conv2": (ConvGeometry(20, 50, 12, 12, 5, 5), True)}


def passes(geom, batch, data):
    """(forward(keep), backward(keep)) on random arrays, sharing one arena."""
    rng = np.random.default_rng(0)
    x, dy = (rng.standard_normal(shape).astype(np.float32) for shape in (geom.input_shape(batch),
                                                                           geom.output_shape(batch)))
    w = rng.standard_normal(geom.weight_shape).astype(np.float32)
    bias = rng.standard_normal(geom.num_output).astype(np.float32)
    y, dx, arena, kept = np.empty(geom.output_shape(batch), np.float32), np.empty_like(x), Arena(), KeptLowering()

    def forward(keep):
        conv_forward(x, w, geom, 1, out=y, ws=arena, bias=bias, keep=kept if keep else None)

    def backward(keep):            # as Convolution.backward: the data gradient spends the kept matrix
        lowered = kept.matrix_for(x, 1, geom) if keep else None
        space = kept.workspace(arena, 1) if lowered is not None and data else arena
        conv_backward(x, dy, w, geom, 1, data=data, ws=space, dx_out=dx if data else None, lowered=lowered)
    return forward, backward


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    for name, (geom, data) in SHAPES.items():
        forward, backward = passes(geom, args.batch, data)
        times = {}
        for _ in range(args.rounds):
            for keep in (False, True):
                rows = []
                for _ in range(10):
                    start = time.perf_counter()
                    forward(keep)
                    middle = time.perf_counter()
                    backward(keep)
                    rows.append((middle - start, time.perf_counter() - middle))
                for part, values in zip(("forward", "backward"), zip(*rows)):
                    times.setdefault((keep, part), []).append(statistics.median(values) * 1e3)
        medians = {key: statistics.median(values) for key, values in times.items()}
        print(f"{name}: " + ", ".join(f"{part} {medians[(False, part)]:.3f} -> {medians[(True, part)]:.3f} ms"
                                      for part in ("forward", "backward")) + " (lowered again -> kept)")
    print(f"load {common.load_average():.2f}")


if __name__ == "__main__":
    main()
