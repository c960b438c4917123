"""Issue 37's split-K weight gradients, as far as pocl shows them: the
work-groups the GEMMs of CaffeNet's conv1 and conv2 weight gradients launch
(read from pocl's own log: the script runs itself again under
POCL_DEBUG=general), and their time (in this process, without the log),
unsplit and split as split_k splits them for a device of --units compute
units (132: an H100's). The batch is lowered in one chunk, as a GPU's
memory share lowers CaffeNet's (cct.lowering.device.MEMORY_SHARE). pocl runs
every work-group on its few CPU cores, so the times show what the split
costs there, not what it gains on a GPU.

    python bench/device_split_k.py [--batch 32] [--units 132] [--repeat 3] [--device 0]
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402,F401  (the repository on the path, as the other benchmarks)
from cct.devices import opencl  # noqa: E402
from cct.lowering import ConvGeometry, device as device_lowering  # noqa: E402

LAYERS = {"conv1": ConvGeometry(3, 96, 227, 227, 11, 11, stride_h=4, stride_w=4),
          "conv2": ConvGeometry(96, 256, 27, 27, 5, 5, pad_h=2, pad_w=2, group=2)}
LAUNCH = re.compile(r"Preparing kernel (\w+) with local size .* group sizes (\d+) x (\d+) x (\d+)")


def launches(argv):
    """{(layer, units): {kernel: [work-groups per launch]}} from this script
    run again under pocl's log, with --count (one run of each case, marked)."""
    log = subprocess.run([sys.executable, __file__, *argv, "--count"], env=dict(os.environ, POCL_DEBUG="general"),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=True).stderr
    found, case = {}, None
    for line in log.splitlines():
        if line.startswith("@@ "):
            _, layer, units = line.split() if line != "@@ end" else (None, None, None)
            case = None if layer is None else found.setdefault((layer, int(units)), collections.defaultdict(list))
        match = LAUNCH.search(line)
        if match and case is not None:
            name, x, y, z = match.groups()
            case[name].append(int(x) * int(y) * int(z))
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="images (CaffeNet trains at 256)")
    parser.add_argument("--units", type=int, default=132, help="compute units split_k sizes the split for")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs (the median is printed)")
    parser.add_argument("--device", type=int, default=0, help="OpenCL device id")
    parser.add_argument("--count", action="store_true", help=argparse.SUPPRESS)     # the logged run
    args = parser.parse_args()
    counts = {} if args.count else launches(sys.argv[1:])
    device = opencl.device(args.device)
    rng = np.random.default_rng(0)
    if not args.count:
        print(f"{device.name}: {device.compute_units} compute units; batch {args.batch}")
    for name, geom in LAYERS.items():
        rows, outputs, pixels = device_lowering._sizes(geom)
        x, dy = (device.empty(count) for count in (args.batch * geom.channels * geom.in_h * geom.in_w,
                                                   args.batch * geom.num_output * pixels))
        for buffer, count in ((x, x.size), (dy, dy.size)):
            device.upload(buffer, rng.standard_normal(count).astype(np.float32))
        dw = device.empty(geom.num_output * rows)
        budget = args.batch * geom.channels * geom.kernel_h * geom.kernel_w * pixels     # the batch in one chunk
        device.fill(dw, 0.0, dw.size)
        for units in (1, args.units):
            device.compute_units = units

            def run():
                device_lowering.backward(device, x, dy, None, geom, args.batch, dw=dw, budget=budget)
                device.finish()
            run()                                                   # kernels built, buffers made
            if args.count:
                sys.stderr.flush()
                os.write(2, f"\n@@ {name} {units}\n".encode())
                run()
                os.write(2, b"\n@@ end\n")
                continue
            times = []
            for _ in range(args.repeat):
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
            slices = device_lowering.split_k(device, outputs, rows, args.batch * pixels)
            print(f"{name} weight gradient ({outputs} x {rows} per group, K {args.batch * pixels}), split_k for "
                  f"{units} unit(s): {slices} slice(s); {np.median(times) * 1e3:.0f} ms")
            for kernel, groups in sorted(counts[name, units].items()):
                role = "GEMM" if "gemm" in kernel.lower() else "other"
                print(f"    {role:5} {kernel:34} {len(groups)} launch(es), work-groups {groups}")

if __name__ == "__main__":
    main()
