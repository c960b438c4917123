"""Pooling forward and backward: the layer on its compiled kernels
(layers/pooling_kernels.py) against the numpy passes they replaced
(layers/pooling_reference.py, "old"), alternating in one process, medians of
the rounds, at GoogLeNet's and LeNet's pooling shapes; then every pooling
layer of GoogLeNet's deploy net, its kernels whole and split. The reference
runs each pass over the whole batch, where the layer's numpy passes ran in
cache-sized chunks before the kernels replaced them: "old" here is slower
than the old layer was (BENCHMARKS.md, "Pooling kernels", has those figures).

    python bench/bench_pooling.py [--rounds 15] [--batches 1,16] [--threads 2] [--split-from N] [--no-net]

Each round times old, new and, with --threads above 1, new with each call
of at least --split-from elements split into that many ranges of planes run
at once on cct's worker threads (the spread a layer run whole on several
threads gets: Layer.run_partitions, cct.runtime.threads.Spread).
A timed sample repeats the call until it has taken 20 ms at least, so short
layers are not timer-bound. Backward times the layer's backward alone (MAX
routes by the argmax the last forward kept). The GoogLeNet part runs
models/bvlc_googlenet/deploy.prototxt forward once per round and sums its
pooling layers' forward times, measured in each mode as the executor runs them.
"""
import argparse
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import cct  # noqa: E402
import cct.layers.pooling_reference as reference  # noqa: E402
from cct.layers import pooling  # noqa: E402
from cct.runtime import threads  # noqa: E402
from cct.testing.gradient_check import make_layer, setup_layer  # noqa: E402

GOOGLENET = os.path.join(common.REPO, "models", "bvlc_googlenet", "deploy.prototxt")
MAX_3S2 = "pool: MAX kernel_size: 3 stride: 2"
MAX_3S1 = "pool: MAX kernel_size: 3 stride: 1 pad: 1"
# (name, pooling_param fields, (C, H, W), batches): GoogLeNet's pooling layers
# (one of each inception shape) and LeNet's two at its training batch.
CASES = [
    ("pool1/3x3_s2", MAX_3S2, (64, 112, 112), None),
    ("pool2/3x3_s2", MAX_3S2, (192, 56, 56), None),
    ("inception_3a/pool", MAX_3S1, (192, 28, 28), None),
    ("pool3/3x3_s2", MAX_3S2, (480, 28, 28), None),
    ("inception_4a/pool", MAX_3S1, (480, 14, 14), None),
    ("pool4/3x3_s2", MAX_3S2, (832, 14, 14), None),
    ("inception_5a/pool", MAX_3S1, (832, 7, 7), None),
    ("pool5/7x7_s1 (AVE)", "pool: AVE kernel_size: 7 stride: 1", (1024, 7, 7), None),
    ("LeNet pool1", "pool: MAX kernel_size: 2 stride: 2", (20, 24, 24), [64]),
    ("LeNet pool2", "pool: MAX kernel_size: 2 stride: 2", (50, 8, 8), [64]),
    ("AVE 3x3/2 pad 1", "pool: AVE kernel_size: 3 stride: 2 pad: 1", (192, 56, 56), None),
]


def modes(parts):
    """{mode: threads}: the kernels whole (new), split in `parts`."""
    found = {"new": 1}
    if parts > 1:
        found[f"new x{parts}"] = parts
    return found


def run_whole_on(layer, count):
    """The layer run whole on `count` threads, as the executor tells it."""
    layer.run_partitions(1, count, threads.Spread(count) if count > 1 else None)


def numpy_passes(layer, x, dy):
    """(forward, backward) calls of the numpy passes on the layer's geometry, each
    returning its array (MAX routes by the passes' own mask)."""
    geometry = (layer.kernel, layer.stride, layer.pad)
    if layer.pool == pooling.MAX:
        mask = reference.max_pool(x, *geometry, layer.out_hw)[2]
        return (lambda: reference.max_pool(x, *geometry, layer.out_hw)[0],
                lambda: reference.max_backward(dy, mask, x.shape))
    return (lambda: reference.ave_pool(x, *geometry, layer.out_hw),
            lambda: reference.ave_backward(dy, x.shape, *geometry))


def bench_case(fields, shape, rounds, mode_setters):
    layer = make_layer(f'type: "Pooling" pooling_param {{ {fields} }}', cct.TRAIN)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    bottoms, tops = setup_layer(layer, [x], dtype=np.float32)
    tops[0].diff[...] = rng.standard_normal(tops[0].shape).astype(np.float32)
    old_forward, old_backward = numpy_passes(layer, x, tops[0].diff.copy())
    results = {"old": (old_forward(), old_backward(), [], [])}
    for name, count in mode_setters.items():     # warm: compiled, work arrays made
        run_whole_on(layer, count)
        layer.forward(bottoms, tops)
        layer.backward(tops, [True], bottoms)
        results[name] = (tops[0].data.copy(), bottoms[0].diff.copy(), [], [])
    for _ in range(rounds):
        results["old"][2].append(common.sample(old_forward))
        results["old"][3].append(common.sample(old_backward))
        for name, count in mode_setters.items():
            run_whole_on(layer, count)
            results[name][2].append(common.sample(lambda: layer.forward(bottoms, tops)))
            results[name][3].append(common.sample(lambda: layer.backward(tops, [True], bottoms)))
    old = results["old"]
    for name, (value, diff, _, _) in results.items():
        same = np.array_equal(value, old[0]) and np.array_equal(diff, old[1])
        if not same:
            close = np.allclose(value, old[0], rtol=1e-5, atol=1e-6) and np.allclose(diff, old[1], rtol=1e-5, atol=1e-6)
            print(f"    ({name}: {'within 1e-5 of' if close else 'DIFFERENT from'} the numpy passes)")
    return {name: (statistics.median(f), statistics.median(b)) for name, (_, _, f, b) in results.items()}


def bench_googlenet(rounds, mode_setters):
    """Sum of the deploy net's pooling layers' forward times (ms) per mode, batch 1."""
    net = cct.Net(GOOGLENET, cct.TEST)
    net.blobs["data"].reshape(1, *net.blobs["data"].shape[1:])         # the prototxt's batch is 10
    net.reshape()
    net.blobs["data"].data[...] = np.random.default_rng(0).standard_normal(net.blobs["data"].shape)
    indices = [i for i, layer in enumerate(net.layers) if layer.type == "Pooling"]
    executor = net.executor
    totals = {name: [] for name in mode_setters}
    outputs = {}
    net.forward()
    for name, count in mode_setters.items():
        executor.threads = count                    # the pooling layers whole on `count` threads
        net.forward()                               # warm
        outputs[name] = net.blobs["prob"].data.copy()
    for _ in range(rounds):
        for name, count in mode_setters.items():
            executor.threads = count
            total = 0.0
            for index in indices:
                total += common.sample(lambda: executor.forward(index), least=0.005)
            executor.finish()
            totals[name].append(total)
    scale = np.abs(outputs["new"]).max()
    differs = max(float(np.abs(outputs[name] - outputs["new"]).max()) / scale for name in outputs)
    return len(indices), {name: statistics.median(t) for name, t in totals.items()}, differs


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15, help="alternating rounds; medians are reported")
    parser.add_argument("--batches", default="1,16", help="batch sizes of the GoogLeNet shapes")
    parser.add_argument("--threads", type=int, default=2, help="also time new split into this many parts (1: not)")
    parser.add_argument("--split-from", type=int, default=pooling.PARALLEL_ELEMENTS,
                        help="split calls whose largest array has this many elements or more "
                             f"(default pooling.PARALLEL_ELEMENTS, {pooling.PARALLEL_ELEMENTS}; 0: every call)")
    parser.add_argument("--no-net", action="store_true", help="skip the GoogLeNet deploy net")
    args = parser.parse_args()
    pooling.PARALLEL_ELEMENTS = args.split_from
    print(common.machine_line())
    setters = modes(args.threads)
    names = ["old", *setters]
    header = "  ".join(f"{name + ' fwd':>11}" for name in names) + "  " + "  ".join(
        f"{name + ' bwd':>11}" for name in names)
    print(f"{'layer':22} {'batch':>5}  {header}  (ms; ratios old / new)")
    for label, fields, chw, batches in CASES:
        for batch in batches or [int(b) for b in args.batches.split(",")]:
            times = bench_case(fields, (batch, *chw), args.rounds, setters)
            cells = "  ".join(f"{times[n][0] * 1e3:11.3f}" for n in names) + "  " + "  ".join(
                f"{times[n][1] * 1e3:11.3f}" for n in names)
            ratios = ", ".join(f"{n}: fwd {times['old'][0] / times[n][0]:.2f} bwd {times['old'][1] / times[n][1]:.2f}"
                               for n in names[1:])
            print(f"{label:22} {batch:5d}  {cells}  ({ratios})", flush=True)
    if not args.no_net:
        count, totals, differs = bench_googlenet(args.rounds, setters)
        print(f"GoogLeNet deploy, batch 1, its {count} pooling layers' forward: " +
              ", ".join(f"{name} {ms * 1e3:.2f} ms" for name, ms in totals.items()) +
              (f"; new / new x{args.threads} {totals['new'] / totals[names[2]]:.2f}" if len(names) > 2 else "") +
              f"; probabilities: largest difference from new's {differs:.1e} of the largest")
    print(f"load after: {common.load_average():.2f}")


if __name__ == "__main__":
    main()
