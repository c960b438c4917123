"""Each way cct can run a 3x3 convolution's forward at batch 1 (lowering
types 1, 2, 3 and Winograd's tile sizes), alone on the layer's shape, on
the one pool as a deploy net's pass runs it, beside what the chooser's cost
model estimates for them (cct.lowering.chooser: the lowering types and
choose_forward_by_model's Winograd estimates, the transforms shared among
the pool's two threads where it is lent). Where the model and the
timings disagree, a deploy net runs the slower way.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_conv_ways.py \\
        [--shapes 256x24x19,128x16x38,128x8x38,256x24x10] [--repeats 40]

A shape is CxOxS: C input channels, O outputs, an S x S input, kernel 3,
pad 1, stride 1 (the default ones are res10's SSD heads). Medians in ms.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def median_ms(function, repeats):
    for _ in range(3):
        function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def run(shape, repeats):
    from cct.core.workspace import thread_arena
    from cct.devices import pool
    from cct.lowering import ConvGeometry, chooser, conv_forward, winograd
    channels, outputs, size = (int(part) for part in shape.split("x"))
    geom = ConvGeometry(channels, outputs, size, size, 3, 3, pad_h=1, pad_w=1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, channels, size, size), dtype=np.float32)
    w = rng.standard_normal(geom.weight_shape, dtype=np.float32)
    out, arena = np.empty(geom.output_shape(1), np.float32), thread_arena()
    lent = pool.acquire(2)
    try:
        timed = {f"type {kind}": median_ms(lambda: conv_forward(x, w, geom, kind, out=out, ws=arena), repeats)
                 for kind in (1, 2, 3)}
        for m in winograd.tile_sizes(3):
            u = winograd.TransformedWeights().get(w, geom, m)
            timed[f"F({m}x{m})"] = median_ms(lambda: winograd.forward(x, u, geom, m, out=out, ws=arena), repeats)
    finally:
        if lent:
            pool.release()
    machine = chooser.known_machine() or chooser.NOMINAL_MACHINE
    model = {f"type {kind}": 1e3 * chooser.estimate(geom, 1, kind, machine, 4, chooser.DEFAULT_BUDGET_MB * 2 ** 20,
                                                    forward_only=True) for kind in (1, 2, 3)}
    for m in winograd.timing_tiles(geom, 1):
        model[f"F({m}x{m})"] = 1e3 * chooser.winograd_estimate(geom, 1, m, machine, 4, spread=2 if lent else 1)
    print(f"{shape}: pool {'lent' if lent else 'not lent'}; timed / model ms")
    for way, ms in timed.items():
        estimate = f"{model[way]:.3f}" if way in model else "-"
        print(f"  {way:10s} {ms:7.3f} / {estimate}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="256x24x19,128x16x38,128x8x38,256x24x10")
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    from cct.devices import jit, pool
    jit.compiled(jit._touch)                 # numba and the pool started, as after a net's first forward
    pool.start()
    print(common.machine_line())
    for shape in args.shapes.split(","):
        run(shape, args.repeats)


if __name__ == "__main__":
    main()
