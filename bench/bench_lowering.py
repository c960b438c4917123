"""Lowering types against d/o (Caffe con Troll, Fig. 8(c)), and the chooser.

A 3x3 convolution (pad 1) on n x n images, batch b, with d input and o output
channels whose product d*o is fixed (so every point does the same GEMM flops)
and d/o swept from 1/16 to 16. Each point times forward + backward (data and
weight gradients) of each lowering type, the three interleaved in every
repetition (a shared machine drifts; interleaving gives each type the same
conditions), and reports the medians, each type's ratio to the fastest, the
chooser's pick by the cost model and by measurement (measure=True), and whether
each pick is within 5% of the fastest. It ends with the crossover: the
smallest d/o at which type 3 beats type 1.

    python bench/bench_lowering.py                      # defaults below
    python bench/bench_lowering.py --threads 1 --repeats 9
"""
import argparse
import os
import platform
import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

from cct.lowering import ConvGeometry, chooser, conv_backward, conv_forward
from cct.core.workspace import Arena
from cct.lowering.chunking import DEFAULT_BUDGET_MB, chunk_size

TOLERANCE = 0.05


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=13, help="image height and width (default 13)")
    parser.add_argument("--k", type=int, default=3, help="kernel size, padded to keep n (default 3)")
    parser.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    parser.add_argument("--product", type=int, default=4096, help="d*o, fixed over the sweep (default 4096)")
    parser.add_argument("--steps", type=int, default=4, help="d/o from 2^-steps to 2^steps (default 4: 1/16..16)")
    parser.add_argument("--repeats", type=int, default=7, help="timed repetitions per point (default 7)")
    parser.add_argument("--threads", type=int, default=0, help="BLAS threads (default: as configured)")
    parser.add_argument("--budget-mb", type=float, default=DEFAULT_BUDGET_MB, help=f"workspace budget (default {DEFAULT_BUDGET_MB})")
    parser.add_argument("--cached-machine", action="store_true",
                        help="use load_machine() (this run's measurement merged with the cached "
                             "constants) instead of this run's measurement alone")
    return parser.parse_args(argv)


def sweep(args):
    """[(d, o)] with d*o = product and d/o = 2^e, e = -steps..steps."""
    points = []
    for e in range(-args.steps, args.steps + 1):
        d = max(1, int(round((args.product * 2.0 ** e) ** 0.5)))
        points.append((d, max(1, args.product // d)))
    return points


def time_point(geom, args, budget):
    rng = np.random.default_rng(0)
    b = args.batch
    x = rng.standard_normal(geom.input_shape(b)).astype(np.float32)
    w = rng.standard_normal(geom.weight_shape).astype(np.float32)
    dy = rng.standard_normal(geom.output_shape(b)).astype(np.float32)
    y, dx = np.empty(geom.output_shape(b), np.float32), np.empty_like(x)
    arena = Arena()                                    # as a layer runs: one reused workspace

    def run(kind):
        chunk = chunk_size(geom, kind, b, 4, budget)
        conv_forward(x, w, geom, kind, out=y, ws=arena, chunk=chunk)
        conv_backward(x, dy, w, geom, kind, ws=arena, chunk=chunk, dx_out=dx)

    for kind in chooser.TYPES:                         # warm-up: the arena grows, pages fault in
        run(kind)
    seconds = {kind: [] for kind in chooser.TYPES}
    for rep in range(args.repeats):
        order = chooser.TYPES[rep % 3:] + chooser.TYPES[:rep % 3]       # rotate who goes first
        for kind in order:
            start = time.perf_counter()
            run(kind)
            seconds[kind].append(time.perf_counter() - start)
    return {kind: float(np.median(times)) for kind, times in seconds.items()}


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        threadpool_limits(args.threads, user_api="blas")
    budget = int(args.budget_mb * 2 ** 20)
    machine = chooser.load_machine() if args.cached_machine else chooser.measure_machine()
    print(f"# {' '.join(['python'] + sys.argv)}")
    print(f"# host {platform.node()}, {os.cpu_count()} cpus, BLAS threads {chooser._blas_threads()}, "
          f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(f"# n={args.n} k={args.k} pad={(args.k - 1) // 2} batch={args.batch} d*o={args.product} "
          f"repeats={args.repeats} (medians, types interleaved)")
    print("# machine: " + ", ".join(f"{name}={getattr(machine, name):.3g}" for name in machine.FIELDS))
    print()
    print("|    d |    o |    d/o | type 1 ms | type 2 ms | type 3 ms | ratio to fastest   | fastest "
          "| model (ms 1/2/3)        | model pick | ok | measured pick | ok |")
    print("|-----:|-----:|-------:|----------:|----------:|----------:|:-------------------|:-------:"
          "|:------------------------|:----------:|:--:|:-------------:|:--:|")
    rows = []
    pad = (args.k - 1) // 2
    for d, o in sweep(args):
        geom = ConvGeometry(d, o, args.n, args.n, args.k, args.k, pad_h=pad, pad_w=pad)
        seconds = time_point(geom, args, budget)
        model = {t: chooser.estimate(geom, args.batch, t, machine, 4, budget) for t in chooser.TYPES}
        model_pick = min(chooser.TYPES, key=lambda t: (model[t], t))
        measured = chooser.measure_types(geom, chooser.measured_batch(geom, args.batch, 4))
        measured_pick = min(chooser.TYPES, key=lambda t: (measured[t], t))
        best = min(seconds.values())
        fastest = min(chooser.TYPES, key=lambda t: seconds[t])
        ratios = {t: seconds[t] / best for t in chooser.TYPES}
        rows.append((d, o, seconds, model_pick, measured_pick, model))
        print(f"| {d:4d} | {o:4d} | {d / o:6.3g} | " + " | ".join(f"{seconds[t] * 1e3:9.1f}" for t in chooser.TYPES)
              + f" | {' / '.join(f'{ratios[t]:.2f}' for t in chooser.TYPES):18s} | {fastest:^7d} | "
              + f"{' / '.join(f'{model[t] * 1e3:.1f}' for t in chooser.TYPES):23s} | {model_pick:^10d} | "
              + f"{'yes' if ratios[model_pick] <= 1 + TOLERANCE else 'NO':2s} | {measured_pick:^13d} | "
              + f"{'yes' if ratios[measured_pick] <= 1 + TOLERANCE else 'NO':2s} |", flush=True)
    print()
    crossing = next(((d, o) for d, o, seconds, *_ in rows if seconds[3] < seconds[1]), None)
    modelled = next(((d, o) for d, o, _, _, _, model in rows if model[3] < model[1]), None)
    for name, point in (("measured", crossing), ("modelled", modelled)):
        if point:
            print(f"{name} crossover: type 3 first beats type 1 at d={point[0]}, o={point[1]} (d/o = "
                  f"{point[0] / point[1]:.3g})")
        else:
            print(f"{name} crossover: type 3 never beats type 1 on this sweep")
    misses = [(d, o) for d, o, seconds, pick, *_ in rows if seconds[pick] > (1 + TOLERANCE) * min(seconds.values())]
    print(f"model pick within {TOLERANCE:.0%} of the fastest at {len(rows) - len(misses)} of {len(rows)} points"
          + (f"; missed at (d, o) = {misses}" if misses else ""))


if __name__ == "__main__":
    main()
