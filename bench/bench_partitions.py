"""CaffeNet training throughput against the number of batch partitions, as
Fig. 3 of the Caffe con Troll paper: every partitionable layer at p in
{1, 2, 4, 8} (each partition a worker thread with T/p BLAS threads, see
cct/runtime/executor.py), then the per-layer plan net.executor.tune() picks.

    python bench/bench_partitions.py [--batch 256] [--iterations 3] [--partitions 1,2,4,8]

One iteration is cct.SGDSolver.step(1) (forward, backward, update) on
train_synthetic.prototxt with Input blobs in place of its DummyData. All
configurations run in one process on one net, one after the other, so they
share the machine state; the load is printed next to each.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256, help="images per iteration (default 256)")
    parser.add_argument("--iterations", type=int, default=3, help="timed iterations per configuration")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations per configuration")
    parser.add_argument("--partitions", default="1,2,4,8", help="comma-separated p to try")
    parser.add_argument("--no-tune", action="store_true", help="skip the tuned per-layer plan")
    args = parser.parse_args(argv)
    p = common.print_flush
    from cct.runtime import profile
    param, inputs = common.net_param_with_inputs(common.CAFFENET, args.batch)
    solver = common.sgd_solver(param)
    net = solver.net
    common.fill_inputs(net, inputs)
    executor = net.executor
    partitionable = [i for i in range(len(net.layers)) if executor.partitionable(i)]
    flops = sum(f + b for f, b in profile.net_flops(net))
    p(common.machine_line())
    p(f"GEMM peak: {common.gemm_peak():.1f} GFLOP/s; CaffeNet batch {args.batch}, "
      f"{len(partitionable)} partitionable layers, {executor.threads} threads")
    results = []

    def measure(label):
        median, times = common.time_loop(lambda: solver.step(1), args.iterations, args.warmup)
        results.append((label, median))
        base = results[0][1]
        p(f"{label:>8s}: {median:7.2f} s/iteration, {args.batch / median:6.1f} images/s, "
          f"{flops / median / 1e9:6.1f} GFLOP/s, speedup vs p=1 {base / median:4.2f} "
          f"(load {common.load_average():.2f})")

    for partitions in [int(v) for v in args.partitions.split(",")]:
        for index in partitionable:
            executor.set_partitions(index, min(partitions, args.batch))
        measure(f"p={partitions}")
    if not args.no_tune:
        plan = executor.tune()
        p("tuned plan: " + ", ".join(f"{name}={value}" for name, value in plan.items()))
        measure("tuned")
    p(f"peak RSS {common.peak_rss_mb() / 1024:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
