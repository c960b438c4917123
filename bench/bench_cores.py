"""Every core busy (issue 36): LeNet at batch 64 on this machine's cores,
side by side in one run.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_cores.py [--parts] [--busy] [--rounds 5]

--parts: one forward+backward with every partitionable layer in 2 batch
partitions on 2 threads (one BLAS thread each) against every layer whole
on 1 thread, alternating in one process (--per-round passes each way a
round): the medians and their ratio.

--busy: a training step (solver.step) in fresh processes, in rounds: cct
with the thread count nobody gave (fitted to the cores free,
cct.runtime.cores), cct with CCT_THREADS=1, and PyTorch (when importable)
at its default and at 1 thread; first on the quiet machine, then with one
busy process (a shell loop the bench starts before the round and ends
after it) on the other core. Each process warms up for --settle seconds
(the fit's windows close in a quarter second) and prints the median of
--iterations steps, and the count cct ended on; "cct not fitted" is the
default count with the fit off (CCT_FIT_CORES=0), as before it. Ratios: cct's default
against its own 1-thread time, and cct against PyTorch, under the same
load. Neither section is given, both run.

The BLAS library and its kernel (threadpoolctl) are printed first.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

CHILD_CCT = """
import sys, time, json, statistics
sys.path.insert(0, {bench!r})
import bench_lenet
solver = bench_lenet.lenet_solver({batch})
end = time.perf_counter() + {settle}
while time.perf_counter() < end:
    solver.step(1)
times = []
for _ in range({iterations}):
    start = time.perf_counter(); solver.step(1); times.append(time.perf_counter() - start)
print("RESULT " + json.dumps({{"ms": 1e3 * statistics.median(times), "threads": solver.net.executor.threads}}))
"""

CHILD_TORCH = """
import sys, time, json, statistics
sys.path.insert(0, {bench!r})
import argparse, bench_lenet, common
args = argparse.Namespace(batch={batch}, iterations={iterations}, warmup=0, threads={threads})
common.time_loop = lambda step, iterations, warmup: _timed(step, iterations)
def _timed(step, iterations):
    end = time.perf_counter() + {settle}
    while time.perf_counter() < end:
        step()
    times = []
    for _ in range(iterations):
        start = time.perf_counter(); step(); times.append(time.perf_counter() - start)
    return statistics.median(times), times
result = bench_lenet.run_torch(args)
print("RESULT " + json.dumps({{"ms": result["ms"], "threads": result["threads"]}}))
"""


def blas_line():
    from threadpoolctl import threadpool_info
    import numpy  # noqa: F401  (loads its BLAS)
    pools = [pool for pool in threadpool_info() if pool["user_api"] == "blas"]
    return "; ".join(f"{pool['internal_api']} {pool['version']} {pool.get('architecture')} kernels, "
                     f"{pool['num_threads']} threads" for pool in pools)


def parts(args):
    """2 partitions on 2 threads against whole on 1 thread, alternating."""
    import bench_lenet
    from cct.runtime import threads as threads_module
    p = common.print_flush
    solver = bench_lenet.lenet_solver(args.batch)
    net = solver.net
    executor = net.executor
    partitionable = [i for i in range(len(net.layers)) if executor.partitionable(i)]

    def configure(partitions):
        executor.threads = partitions            # a given count: 1 whole, 2 split in 2 (1 BLAS thread each)
        for index in partitionable:
            executor.set_partitions(index, partitions)

    def passes():
        start = time.perf_counter()
        for _ in range(args.per_round):
            net.forward()
            net.backward()
        return (time.perf_counter() - start) / args.per_round

    times = {1: [], 2: []}
    for round_ in range(args.rounds + 1):
        for partitions in (1, 2):
            configure(partitions)
            net.forward()
            net.backward()                       # the plan for this configuration, made untimed
            elapsed = passes()
            if round_:
                times[partitions].append(elapsed)
    threads_module.blas().restore()
    whole, split = statistics.median(times[1]) * 1e3, statistics.median(times[2]) * 1e3
    ratios = sorted(a / b for a, b in zip(times[1], times[2]))
    p(f"LeNet batch {args.batch} forward+backward ({len(partitionable)} partitionable layers):")
    p(f"  whole on 1 thread:             {whole:7.2f} ms")
    p(f"  2 partitions on 2 threads:     {split:7.2f} ms")
    p(f"  speed-up {whole / split:.2f}x (per-round range {ratios[0]:.2f}-{ratios[-1]:.2f}), "
      f"load {common.load_average():.2f}")


def child(kind, args, threads=None):
    env = dict(os.environ)
    fields = dict(bench=os.path.dirname(os.path.abspath(__file__)), batch=args.batch, settle=args.settle,
                  iterations=args.iterations, threads=threads if isinstance(threads, int) else 0)
    if kind == "cct":
        script = CHILD_CCT.format(**fields)
        env.pop("CCT_THREADS", None)
        env.pop("CCT_FIT_CORES", None)
        if threads == "unfitted":
            env["CCT_FIT_CORES"] = "0"           # the thread count before cct.runtime.cores
        elif threads:
            env["CCT_THREADS"] = str(threads)
    else:
        script = CHILD_TORCH.format(**fields)
    done = subprocess.run([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env,
                          cwd=common.REPO)
    if done.returncode:
        raise SystemExit(f"{kind} child failed ({done.returncode})")
    line = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def busy(args):
    """cct's default and 1-thread steps, and PyTorch's, quiet and beside a busy loop."""
    p = common.print_flush
    torch = common.torch_available() and not args.no_torch
    contenders = [("cct default", "cct", None), ("cct not fitted", "cct", "unfitted"), ("cct 1 thread", "cct", 1)]
    if torch:
        contenders += [("torch default", "torch", None), ("torch 1 thread", "torch", 1)]
    results = {(load, name): [] for load in ("quiet", "busy") for name, _, _ in contenders}
    threads_seen = {(load, name): set() for load, name in results}
    for round_ in range(args.rounds):
        for load in ("quiet", "busy"):
            loop = subprocess.Popen(["sh", "-c", "while :; do :; done"]) if load == "busy" else None
            try:
                for name, kind, threads in contenders[round_ % len(contenders):] + contenders[:round_ % len(contenders)]:
                    result = child(kind, args, threads)
                    results[load, name].append(result["ms"])
                    threads_seen[load, name].add(result["threads"])
            finally:
                if loop is not None:
                    loop.kill()
                    loop.wait()
        p(f"round {round_ + 1}: " + ", ".join(f"{load} {name} {results[load, name][-1]:.2f}"
                                             for load, name in results))
    p(f"LeNet batch {args.batch} training step, median of {args.rounds} processes' medians (ms):")
    p(f"  {'':16s} {'quiet':>8s} {'busy':>8s}  threads quiet/busy")
    median = {key: statistics.median(values) for key, values in results.items()}
    for name, _, _ in contenders:
        seen = "/".join(",".join(str(t) for t in sorted(threads_seen[load, name])) for load in ("quiet", "busy"))
        p(f"  {name:16s} {median['quiet', name]:8.2f} {median['busy', name]:8.2f}  {seen}")
    for load in ("quiet", "busy"):
        line = (f"  {load}: cct default / cct 1 thread {median[load, 'cct default'] / median[load, 'cct 1 thread']:.2f}"
                f"; not fitted / 1 thread {median[load, 'cct not fitted'] / median[load, 'cct 1 thread']:.2f}")
        if torch:
            line += (f"; cct default / torch default {median[load, 'cct default'] / median[load, 'torch default']:.2f}"
                     f"; torch default / torch 1 thread "
                     f"{median[load, 'torch default'] / median[load, 'torch 1 thread']:.2f}")
        p(line)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", action="store_true", help="2 partitions on 2 threads against whole on 1")
    parser.add_argument("--busy", action="store_true", help="the training step beside a busy process")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=20, help="--parts: passes each way a round")
    parser.add_argument("--iterations", type=int, default=30, help="--busy: timed steps per process")
    parser.add_argument("--settle", type=float, default=1.5, help="--busy: seconds of untimed steps first")
    parser.add_argument("--no-torch", action="store_true")
    args = parser.parse_args(argv)
    both = not (args.parts or args.busy)
    common.print_flush(common.machine_line())
    common.print_flush("BLAS: " + blas_line())
    if args.parts or both:
        parts(args)
    if args.busy or both:
        busy(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
