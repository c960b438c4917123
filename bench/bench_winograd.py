"""Deploy forward with and without Winograd (cct.lowering.winograd), side by
side in one process: the same deploy net and seeded weights built twice, with
the run setting "winograd" left at "auto" (each 3 x 3 convolution at stride 1
times Winograd against its lowering on its shape, once per machine, and keeps
the fastest) and at false (every convolution lowers). Rounds alternate the
order (A B, then B A): in one order the second of two identical nets took
up to 13% longer here, so a fixed order would bias the ratio. Each timed
forward waits SETTLE_SECONDS first, as bench_deploy.py does.

    python bench/bench_winograd.py [--nets caffenet,googlenet,resnet50,res10] [--batches 1,16] [--rounds 8]
                                   [--per-layer] [--against lowered|serial]

--against measured compares them with a net built with the run setting
"measure" (every lowering type and Winograd tile size timed on each
convolution's shape, Winograd on the pool's threads where the layer's step
has them; the timings go to a fresh cache folder).

--against serial compares the chooser's picks with those of its model taking
Winograd's transforms as one thread's (chooser.choose_forward_by_model,
spread 1: the model before it knew they run on the pool's threads where the
layer runs whole on several): the second net is built with each layer's
serial-model pick forced by a per-layer "winograd" setting.

Prints per net and batch both medians, their ratio, how far the outputs
agree, and which convolutions run Winograd (W2 / W4: the tile size).
Whole forwards of two nets differ by more than the effect on this host (two
identical nets: 0.88x-1.13x), so --per-layer times, in the first net alone,
the forwards of the layers "auto" put on Winograd, switching them between
Winograd and their lowering every other forward (no wait between forwards):
each such layer's median both ways, and their sums.
"""
import argparse
import os
import statistics
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import bench_deploy  # noqa: E402
import bench_forks  # noqa: E402
from bench_deploy import logits_layer, run_cct, timed  # noqa: E402


def cct_net(name, batch, folder):
    """bench_deploy's deploy nets, or res10 (the face detector's own weights) at `batch`."""
    if name != "res10":
        return bench_deploy.cct_net(name, batch, folder)
    import cct
    prototxt, weights = bench_forks.res10(folder)
    net = cct.Net(prototxt, cct.TEST, weights=weights)
    net.blobs["data"].reshape(batch, 3, 300, 300)
    return net, prototxt, weights, 300


def reshaped(net, batch):
    net.blobs["data"].reshape(batch, *net.blobs["data"].data.shape[1:])
    return net


def without_winograd(prototxt, weights):
    import cct
    from cct.runtime import settings
    settings.load(settings.RunConfig({"default": {"winograd": False}}, "bench_winograd"))
    try:
        return cct.Net(prototxt, cct.TEST, weights=weights)
    finally:
        settings.load(None)


def serial_picks(net):
    """{layer: tile} for each convolution whose pick by the model with
    Winograd's transforms on one thread differs from the net's."""
    from cct.lowering import chooser, winograd
    machine = chooser.known_machine() or chooser.NOMINAL_MACHINE
    picks = {}
    for layer in net.layers:
        if layer.type != "Convolution" or layer.runs_backward or not winograd.applicable(layer.geom):
            continue
        batch = layer._shape_key[1]
        serial = (chooser.choose_forward_by_model(layer.geom, batch, layer._lowering(), machine)
                  if winograd.worth_timing(layer.geom, batch) else 0)
        if serial != layer.winograd_tile:
            picks[layer.name] = serial or False
    return picks


def with_serial_model(net, prototxt, weights):
    import cct
    from cct.runtime import settings
    layers = {name: {"winograd": tile} for name, tile in serial_picks(net).items()}
    settings.load(settings.RunConfig({"layers": layers}, "bench_winograd --against serial"))
    try:
        return cct.Net(prototxt, cct.TEST, weights=weights)
    finally:
        settings.load(None)


def measured(prototxt, weights, folder):
    import cct
    from cct.runtime import settings
    os.environ["CCT_CACHE_DIR"] = os.path.join(folder, "measured-cache")
    settings.load(settings.RunConfig({"default": {"measure": True}}, "bench_winograd --against measured"))
    try:
        return cct.Net(prototxt, cct.TEST, weights=weights)
    finally:
        settings.load(None)


def compare(name, batch, rounds, folder, against):
    with_it, prototxt, weights, size = cct_net(name, batch, folder)
    if against == "measured":
        other = reshaped(measured(prototxt, weights, folder), batch)
        run_cct(other, np.zeros((batch, 3, size, size), np.float32), logits_layer(other))   # timed now
    elif against == "serial":
        run_cct(with_it, np.zeros((batch, 3, size, size), np.float32), logits_layer(with_it))   # choices made
        other = reshaped(with_serial_model(with_it, prototxt, weights), batch)
    else:
        other = reshaped(without_winograd(prototxt, weights), batch)
    nets = {"with": with_it, "without": other}
    images = np.random.default_rng(1).normal(0, 50, (batch, 3, size, size)).astype(np.float32)
    layer = logits_layer(with_it)
    outputs = {key: run_cct(net, images, layer).copy() for key, net in nets.items()}
    times = {key: [] for key in nets}
    for index in range(rounds):
        order = ("with", "without") if index % 2 == 0 else ("without", "with")
        for key in order:
            times[key].append(timed(run_cct, nets[key], images, layer)[0])
    medians = {key: 1e3 * statistics.median(values) for key, values in times.items()}
    agree = float(np.abs(outputs["with"] - outputs["without"]).max() / np.abs(outputs["without"]).max())
    tiles = [f"{l.name} W{l.winograd_tile}" for l in with_it.layers if getattr(l, "winograd_tile", 0)]
    if against == "measured":          # and where the timings chose otherwise
        tiles += [f"(timed: {l.name} W{l.winograd_tile} t{l._lowering()})" for l, mine in zip(other.layers, with_it.layers)
                  if l.type == "Convolution" and (l.winograd_tile, l._lowering()) != (mine.winograd_tile, mine._lowering())]
    return medians, agree, tiles


def per_layer(name, batch, rounds, folder):
    """{layer name: (median ms on Winograd, median ms lowered)} in one net."""
    import time
    net, _, _, size = cct_net(name, batch, folder)
    net.blobs["data"].data[...] = np.random.default_rng(1).normal(0, 50, (batch, 3, size, size))
    chosen = {l.name: l for l in net.layers if getattr(l, "winograd_tile", 0)}
    tiles = {lname: layer.winograd_tile for lname, layer in chosen.items()}
    times = {(lname, on): [] for lname in chosen for on in (True, False)}
    for lname, layer in chosen.items():
        forward = layer.forward

        def timed_forward(bottom, top, forward=forward, lname=lname, layer=layer):
            start = time.perf_counter()
            forward(bottom, top)
            times[(lname, bool(layer._winograd_m))].append(time.perf_counter() - start)
        layer.forward = timed_forward
    for index in range(2 * rounds):
        on = index % 2 == 0
        for lname, layer in chosen.items():
            layer._winograd_m = tiles[lname] if on else 0       # the choice stays, its use flips
        net.forward()
    return {lname: tuple(1e3 * statistics.median(times[(lname, on)][1:]) for on in (True, False))
            for lname in chosen}, tiles


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nets", default="caffenet,googlenet,resnet50")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--per-layer", action="store_true", help="time the Winograd layers in one net, both ways")
    parser.add_argument("--against", choices=("lowered", "serial", "measured"), default="lowered",
                        help="the second net: every convolution lowered, the serial-transform model's picks, "
                             "or every choice timed")
    args = parser.parse_args()
    p = common.print_flush
    p(common.machine_line())
    with tempfile.TemporaryDirectory() as folder:
        for name in args.nets.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                if args.per_layer:
                    found, tiles = per_layer(name, batch, args.rounds, folder)
                    for lname, (on, off) in found.items():
                        p(f"  {name} batch {batch} {lname} W{tiles[lname]}: {on:.3f} ms, lowered {off:.3f} ms, "
                          f"{on / off:.3f}")
                    total_on, total_off = (sum(v[k] for v in found.values()) for k in (0, 1))
                    if found:
                        p(f"{name} batch {batch}: {len(found)} layers on Winograd {total_on:.2f} ms, lowered "
                          f"{total_off:.2f} ms, {total_on / total_off:.3f}")
                    continue
                medians, agree, tiles = compare(name, batch, args.rounds, folder, args.against)
                first, second = {"serial": ("picks", "serial model's"), "measured": ("model's picks", "timed picks"),
                                 "lowered": ("with Winograd", "without")}[args.against]
                p(f"{name} batch {batch}: {first} {medians['with']:.1f} ms, {second} {medians['without']:.1f} ms, "
                  f"ratio {medians['with'] / medians['without']:.3f}; outputs agree to {agree:.1e} of "
                  f"the largest; {len(tiles)} on Winograd: {', '.join(tiles) or '-'}")
    p(f"load after the runs: {common.load_average():.2f}")


if __name__ == "__main__":
    main()
