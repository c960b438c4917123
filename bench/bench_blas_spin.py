"""How long OpenBLAS's pool threads spin after a threaded call
(OPENBLAS_THREAD_TIMEOUT, 2^N cycles; OpenBLAS reads it once, when it is
loaded) against sequential training time: each value in fresh processes,
the values alternating for --rounds rounds, each process timing its own
solver.step(--iterations) after a warm-up step. cct sets 21 when imported
before numpy (cct/__init__.py); OpenBLAS's own default is 28. Ratios are to
the first value's median.

    python bench/bench_blas_spin.py [--values 28,21,24] [--nets lenet:64:16,caffenet:8:3,googlenet:8:2] [--rounds 3]
"""
import argparse
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# One process: the net's sequential iteration time, in ms, on stdout.
CHILD = """
import sys
sys.path.insert(0, {here!r})
import bench_schedule, statistics
solver = bench_schedule.solver_for({net!r}, {batch})
bench_schedule.step_time(solver, "sequential", {iterations})
print(1e3 * statistics.median(bench_schedule.step_time(solver, "sequential", {iterations}) for _ in range(3)))
"""


def one_run(net, batch, iterations, value):
    env = {**os.environ, "OPENBLAS_THREAD_TIMEOUT": value}
    code = CHILD.format(here=HERE, net=net, batch=batch, iterations=iterations)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return float(done.stdout.split()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--values", default="28,21,24", help="the first is the baseline")
    parser.add_argument("--nets", default="lenet:64:16,caffenet:8:3,googlenet:8:2", help="net:batch:iterations,...")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    values = args.values.split(",")
    nets = [(name, int(batch), int(iterations)) for name, batch, iterations in
            (item.split(":") for item in args.nets.split(","))]
    times = {(net, value): [] for net in nets for value in values}
    for _ in range(args.rounds):
        for value in values:
            for net in nets:
                times[net, value].append(one_run(*net, value))
    for net in nets:
        base = statistics.median(times[net, values[0]])
        print(f"{net[0]} batch {net[1]}: " + ", ".join(
            f"{value} {statistics.median(times[net, value]):.2f} ms ({statistics.median(times[net, value]) / base:.3f}) "
            f"[{' '.join(f'{t:.1f}' for t in times[net, value])}]" for value in values))


if __name__ == "__main__":
    main()
