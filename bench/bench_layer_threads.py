"""Per-layer BLAS thread counts in the sequential schedule (issue 12's thread
control without co-running): LeNet at batch 64, every layer's forward and
backward timed inside training iterations at each count, then iterations
with each layer at its fastest count against every layer at one count, in
turns.

    python bench/bench_layer_threads.py [--batch 64] [--iterations 60]

Counts are 1, 2, 4, 8, 16 up to the executor's threads. A layer's count is
set through the executor's thread count before its forward and backward (the
BLAS count the sequential schedule gives a whole layer)."""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_lenet  # noqa: E402
import common  # noqa: E402


class LayerCounts:
    """Runs each layer's forward and backward at the count `plan` names
    (default: the executor's own), timing each call."""

    def __init__(self, executor):
        self.executor, self.full = executor, executor.threads
        self.plan = {}                                  # ("f" or "b", layer index) -> count
        self.seconds = {}                               # same key -> [seconds]
        self._forward, self._backward = executor.forward, executor.backward
        executor.forward = lambda index, *args, **kw: self._run("f", index, self._forward, args, kw)
        executor.backward = lambda index, *args, **kw: self._run("b", index, self._backward, args, kw)

    def _run(self, kind, index, call, args, kwargs):
        self.executor.threads = self.plan.get((kind, index), self.full)
        start = time.perf_counter()
        result = call(index, *args, **kwargs)
        self.seconds.setdefault((kind, index), []).append(time.perf_counter() - start)
        return result


def iteration_ms(solver, iterations, warmup=5):
    for _ in range(warmup):
        solver.step(1)
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        solver.step(1)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=60)
    args = parser.parse_args()
    p = common.print_flush
    p(common.machine_line())
    solver = bench_lenet.lenet_solver(args.batch)
    executor = solver.net.executor
    executor.schedule = "sequential"
    counts = [count for count in (1, 2, 4, 8, 16) if count <= executor.threads]
    layers = LayerCounts(executor)
    keys = [(kind, index) for index in range(len(solver.net.layers)) for kind in "fb"]
    per_count = {}
    for count in counts:
        layers.plan = {key: count for key in keys}
        layers.seconds = {}
        iteration_ms(solver, args.iterations // 2)
        per_count[count] = {key: statistics.median(times[5:]) for key, times in layers.seconds.items()}
    best = {key: min(counts, key=lambda count: per_count[count].get(key, 0.0)) for key in keys}
    names = solver.net.layer_names
    p("fastest count per layer (forward/backward): " + ", ".join(
        f"{names[index]} {best['f', index]}/{best['b', index]}" for index in range(len(names))))
    plans = {f"every layer at {count}": {key: count for key in keys} for count in (counts[-1], min(4, counts[-1]))}
    plans["each layer at its fastest"] = best
    results = {label: [] for label in plans}
    for _ in range(2):                                   # in turns: they share the host's drift
        for label, plan in plans.items():
            layers.plan = plan
            results[label].append(iteration_ms(solver, args.iterations))
    for label, values in results.items():
        p(f"LeNet batch {args.batch}, {label}: " + ", ".join(f"{value:.2f}" for value in values) + " ms")
    p(f"load after: {common.load_average():.2f}")


if __name__ == "__main__":
    main()
