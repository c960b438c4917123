"""One-thread GEMMs side by side on the pool's threads at batch 1, against
the products on every thread one after the other (the paths before), in
one process per net, the two ways taking turns round after round, each
round timing --per-round forwards after two untimed ones, with the steps
concerned timed too:

--what bands: the first convolution's bands (cct.lowering.type1.
forward_in_bands), its output rows shared among the threads, each lowering
and multiplying its own bands (`pool`), against the whole image in one
piece, its band GEMMs on every thread (`before`: band_pieces held at one).

--what stacked: Winograd's alpha^2 tile products (cct.lowering.geometry.
stacked_matmul) side by side (`pool`), against numpy's stacked matmul
(`before`); the steps timed are the Winograd convolutions'.

--what groups: a grouped convolution's one-image GEMMs (cct.lowering.type1),
one group per thread (`pool`), against numpy's stacked matmul (`before`);
the steps timed are the grouped convolutions'.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_bands.py \\
        [--what bands|stacked|groups] [--nets res10,mobilenet_ssd,googlenet,resnet50,caffenet] [--rounds 12] [--per-round 8]

Prints, per net: the steps' time and the whole forward in ms (medians over
rounds) each way, pool / before, and the quartiles of the per-round ratios
(this host's noise in the ratio's own terms).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_deploy  # noqa: E402
import bench_forks  # noqa: E402
import common  # noqa: E402


def build(name, folder):
    """(net, input blob of batch 1) with the weights the other benches use."""
    import cct
    if name in ("res10", "mobilenet_ssd"):
        files = bench_forks.res10(folder) if name == "res10" else bench_forks.mobilenet_ssd(folder)
        if files is None:
            return None, None
        net = cct.Net(files[0], cct.TEST, weights=files[1])
        data = bench_forks.net_input(name, 1)
    else:
        net, _, _, size = bench_deploy.cct_net(name, 1, folder)
        data = np.random.default_rng(0).uniform(-50, 50, (1, 3, size, size)).astype(np.float32)
    net.blobs[net.inputs[0]].reshape(*data.shape)
    return net, data


def quartiles(values):
    values = sorted(values)
    return values[len(values) // 4], values[(3 * len(values)) // 4]


def ways(what):
    """{"pool": undo, "before": apply}: callables that put each way in place."""
    from cct.lowering import type1, winograd
    if what == "bands":
        shared = type1.band_pieces

        def one_piece(geom, rows, threads):
            return shared(geom, rows, 1)
        return {"pool": lambda: setattr(type1, "band_pieces", shared),
                "before": lambda: setattr(type1, "band_pieces", one_piece)}
    module = winograd if what == "stacked" else type1
    stacked = module.stacked_matmul

    def numpy_stack(a, b, out):
        return np.matmul(a, b, out=out)
    return {"pool": lambda: setattr(module, "stacked_matmul", stacked),
            "before": lambda: setattr(module, "stacked_matmul", numpy_stack)}


def steps_of(net, what):
    """The layers whose steps the change concerns: the first convolution, the
    grouped ones, or the Winograd ones."""
    convolutions = [i for i, layer in enumerate(net.layers) if layer.type == "Convolution"]
    if what == "bands":
        return convolutions[:1]
    if what == "groups":
        return [i for i in convolutions if net.layers[i].geom.group > 1 and not net.layers[i].winograd_tile]
    return [i for i in convolutions if net.layers[i].winograd_tile]


def run(name, args, folder):
    net, data = build(name, folder)
    if net is None:
        return
    put = ways(args.what)
    net.blobs[net.inputs[0]].data[...] = data
    for _ in range(6):
        net.forward()
    plan = net.executor._plan
    concerned = [i for i in steps_of(net, args.what) if plan.forward_steps[i] is not None]
    timed = {"steps": 0.0}

    def timing(step):
        def timed_step():
            start = time.perf_counter()
            result = step()
            timed["steps"] += time.perf_counter() - start
            return result
        return timed_step
    for index in concerned:
        plan.forward_steps[index] = timing(plan.forward_steps[index])
    results = {"pool": ([], []), "before": ([], [])}
    try:
        for _ in range(args.rounds):
            for way in ("pool", "before"):
                put[way]()
                net.forward()
                net.forward()
                timed["steps"], times = 0.0, []
                for _ in range(args.per_round):
                    start = time.perf_counter()
                    net.forward()
                    times.append(time.perf_counter() - start)
                results[way][0].append(1e3 * timed["steps"] / args.per_round)
                results[way][1].append(1e3 * statistics.median(times))
                time.sleep(args.settle)
    finally:
        put["pool"]()
    names = ", ".join(net.layers[i].name for i in concerned) if len(concerned) < 3 else f"{len(concerned)} layers"
    print(f"{name}: {args.what}, steps of {names or 'none'}; load {common.load_average():.2f}")
    for index, what in ((0, "their steps"), (1, "whole forward")):
        pooled, before = results["pool"][index], results["before"][index]
        if not statistics.median(before):
            continue
        low, high = quartiles([a / b for a, b in zip(pooled, before)])
        print(f"  {what:14s} pool {statistics.median(pooled):7.2f} ms, before {statistics.median(before):7.2f} ms, "
              f"pool/before {statistics.median(pooled) / statistics.median(before):.3f} (per-round quartiles "
              f"{low:.2f}-{high:.2f})")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--what", choices=("bands", "stacked", "groups"), default="bands")
    parser.add_argument("--nets", default="res10,mobilenet_ssd,googlenet,resnet50,caffenet")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--per-round", type=int, default=8)
    parser.add_argument("--settle", type=float, default=0.1, help="seconds of sleep after each round")
    args = parser.parse_args()
    print(common.machine_line())
    with tempfile.TemporaryDirectory() as folder:
        for name in args.nets.split(","):
            run(name, args, folder)


if __name__ == "__main__":
    main()
