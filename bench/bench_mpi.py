"""Data-parallel training over MPI (cct.training.distributed): for each net,
one rank against two, each rank on one core (CCT_THREADS=1), and on two
ranks three ways of summing the gradients, iterations in turns: after
backward and during it on a communication thread (the sequential schedule),
and as sub-tasks of the streams schedule:

    python bench/bench_mpi.py [--nets lenet:64,caffenet:16] [--iterations 20] [--warmup 3]

Each rank trains at the given batch (so two ranks train on twice the
images), SGD as bench_caffenet.py, the nets' data layers replaced by Input
blobs filled once (each rank its own gaussian images). Printed per run: the
median iteration (rank 0's solver.step(1)); on one rank, in the sequential
and the streams schedule (in turns), and its forward alone (net.forward),
the rest being backward and update; on two, each way's median iteration,
the seconds per iteration the gradient sums took (GradientSum.busy: on
their thread or stream, so stretched by sharing the core with backward),
the seconds the update waited for them (GradientSum.exposed; the streams'
updates wait through the graph, not counted) and the share of the wait
after backward that the wait during it hides, and what the sums cost the
iteration: its time less that of 2 ranks summing nothing (way "none": the
cost two ranks put on each other's cores and memory without sums taken
out), and the share of one sum of every gradient alone that this hides
(1 - cost / alone); one sum of every gradient alone
(nothing else running: the allreduce's own time) with its volume and rate.
Then a scaling model for N machines (model()).

    python bench/bench_mpi.py --buckets [--nets lenet:64,caffenet:16] [--repeats 7]

sweeps the sums' bucket size instead (distributed.BUCKET_BYTES): on 2
ranks, one sum of every gradient of each net (the diffs filled with
gaussian numbers, nothing else running) in the units GradientSum makes of
them (plan_units) at each size, 64 KiB to 64 MiB, and 0 (each parameter
whole, alone); the sizes taken in turns, `repeats` times, the median
printed: the sums alone (overlap off) and each after the ranks' agreement
on the ready units (overlap on: an Allreduce of a byte per unit first).
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

NETS = {
    "lenet": (os.path.join(common.REPO, "models", "lenet", "lenet_train_test.prototxt"),
              lambda b: [(b, 1, 28, 28), (b,)]),
    "caffenet": (common.CAFFENET, None),
}


# way: (schedule, GradientSum.overlap); "none" sums nothing (the ranks' weights
# drift apart): what two ranks cost each other on one host without the sums
WAYS = {"none": ("sequential", None), "after": ("sequential", False), "during": ("sequential", True),
        "streams": ("streams", False)}


def worker(args):
    """One rank: train, time, and (rank 0) print the RESULT line. Iterations
    alternate between the ways (WAYS: schedule, GradientSum.overlap; on one
    rank the schedules), so they share the machine's load."""
    import cct
    path, shapes = NETS[args.net]
    param, inputs = common.net_param_with_inputs(path, args.batch, shapes and shapes(args.batch))
    solver = common.sgd_solver(param)
    common.fill_inputs(solver.net, inputs, classes=10 if args.net == "lenet" else 1000, seed=solver.rank)
    for _ in range(args.warmup):
        solver.step(1)
    result = {"net": args.net, "batch": args.batch, "ranks": cct.solver_count(),
              "gradient_mb": sum(p.diff.nbytes for p in solver.net.learnable_params) / 2**20}
    summed = solver.gradient_sum
    ways = ({"sequential": ("sequential", False), "streams": ("streams", False)} if summed is None else WAYS)
    result["ways"] = _alternating(solver, summed, ways, args.iterations)
    if summed is None:
        result["forward_s"] = common.time_loop(solver.net.forward, 5, 1)[0]
    else:
        result["alone_s"] = _sum_alone(summed, 5)
    if solver.is_root:
        print("RESULT " + json.dumps(result), flush=True)


def _alternating(solver, summed, ways, iterations):
    """{way: {iteration_s (median), sums_s, waited_s (means)}} over
    `iterations` of each way, taken in turns (a warm-up step each first)."""
    seen = {way: [] for way in ways}
    executor = solver.net.executor
    for k in range(len(ways) * (iterations + 1)):
        way = list(ways)[k % len(ways)]
        executor.schedule, overlap = ways[way]
        if summed is not None:
            summed.overlap = bool(overlap)
            summed.busy = summed.exposed = 0.0
        start = time.perf_counter()
        if summed is not None and overlap is None:
            _without_sums(solver, summed)
        else:
            solver.step(1)
        if k >= len(ways):
            seen[way].append((time.perf_counter() - start, summed.busy if summed else 0.0,
                              summed.exposed if summed else 0.0))
    return {way: {"iteration_s": statistics.median(t for t, _, _ in rows),
                  "sums_s": statistics.mean(b for _, b, _ in rows),
                  "waited_s": statistics.mean(e for _, _, e in rows)} for way, rows in seen.items()}


def _without_sums(solver, summed):
    """One step with the solver's gradient sums taken off."""
    entry = (summed.on_start, summed.on_gradients_ready)
    solver.gradient_sum = None
    solver.callbacks.remove(entry)
    try:
        solver.step(1)
    finally:
        solver.callbacks.insert(0, entry)
        solver.gradient_sum = summed


def _sum_alone(summed, repeats, agreed=False):
    """Median seconds of one sum of every gradient with nothing else
    running, in summed's units; `agreed`: each unit after the ranks'
    agreement on the ready units, as the communication thread does."""
    import numpy as np
    flags = np.ones(len(summed.units), np.uint8)
    times = []
    for _ in range(repeats):
        summed.comm.Barrier()
        start = time.perf_counter()
        for number in range(len(summed.units)):
            if agreed:
                summed.comm.Allreduce(summed._mpi.IN_PLACE, flags, op=summed._mpi.MIN)
            summed.sum_unit(number)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


BUCKETS = [0] + [2**k for k in range(16, 27)]       # 0 (each parameter alone), 64 KiB .. 64 MiB


def bucket_worker(args):
    """One rank of the bucket sweep: rank 0 prints a BUCKETS line."""
    import numpy as np
    from cct.training import distributed
    path, shapes = NETS[args.net]
    param, _ = common.net_param_with_inputs(path, args.batch, shapes and shapes(args.batch))
    solver = common.sgd_solver(param)
    rng = np.random.default_rng(solver.rank)
    for blob in solver.net.learnable_params:
        blob.diff[...] = rng.standard_normal(blob.diff.shape, np.float32)
    sums = {bucket: distributed.GradientSum(solver.world, solver.net, 1, False, threads=False, bucket=bucket)
            for bucket in BUCKETS}
    times = {(bucket, agreed): [] for bucket in BUCKETS for agreed in (False, True)}
    for _ in range(args.repeats):                  # the sizes in turns: they share the load's drift
        for (bucket, agreed), seen in times.items():
            seen.append(_sum_alone(sums[bucket], 1, agreed))
    if solver.is_root:
        rows = [{"bucket": bucket, "units": len(sums[bucket].units),
                 "sums_s": statistics.median(times[bucket, False]),
                 "agreed_s": statistics.median(times[bucket, True])} for bucket in BUCKETS]
        result = {"net": args.net, "gradient_mb": sum(p.diff.nbytes for p in solver.net.learnable_params) / 2**20,
                  "rows": rows}
        print("RESULT " + json.dumps(result), flush=True)
    for summed in sums.values():
        summed.close()
    solver.close()


def bucket_report(result):
    common.print_flush(f"{result['net']}: one sum of every gradient ({result['gradient_mb']:.1f} MiB) on 2 ranks")
    common.print_flush("   bucket   units   sums alone ms   after agreement ms")
    for row in result["rows"]:
        size = "each" if row["bucket"] == 0 else f"{row['bucket'] // 1024} KiB"
        common.print_flush(f"  {size:>9s} {row['units']:6d}   {row['sums_s'] * 1e3:13.1f}   "
                           f"{row['agreed_s'] * 1e3:18.1f}")


def run(args, net, batch, ranks):
    command = [sys.executable, os.path.abspath(__file__), "--worker", "--net", net, "--batch", str(batch),
               "--iterations", str(args.iterations), "--warmup", str(args.warmup), "--repeats", str(args.repeats)]
    if args.buckets:
        command.append("--buckets")
    if ranks > 1:
        root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        command = ["mpirun", *root, "--oversubscribe", "-np", str(ranks), *command]
    env = {**os.environ, "CCT_THREADS": "1", "CCT_SCHEDULE": "sequential"}
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, cwd=common.REPO, env=env)
    if done.returncode:
        raise SystemExit(f"{net} on {ranks} ranks failed ({done.returncode})")
    # ranks share mpirun's stdout: another rank's bytes may precede ours on the line
    line = [line for line in done.stdout.splitlines() if "RESULT " in line][-1]
    return json.loads(line.split("RESULT ", 1)[1])


def report(one, two):
    for schedule, figures in one["ways"].items():
        common.print_flush(f"{one['net']:9s} batch {one['batch']:3d}/rank  1 rank   {schedule:10s} iteration "
                           f"{figures['iteration_s'] * 1e3:8.1f} ms")
    common.print_flush(f"  forward alone {one['forward_s'] * 1e3:.1f} ms")
    ways = two["ways"]
    for way, figures in ways.items():
        alone = one["ways"][WAYS[way][0]]["iteration_s"]
        line = (f"{two['net']:9s} batch {two['batch']:3d}/rank  2 ranks  sums {way:8s} iteration "
                f"{figures['iteration_s'] * 1e3:8.1f} ms ({2 * alone / figures['iteration_s']:.2f}x the images/s "
                f"of 1)")
        if way != "none":
            cost = figures["iteration_s"] - ways["none"]["iteration_s"]
            line += (f"  sums {figures['sums_s'] * 1e3:7.1f} ms, waited {figures['waited_s'] * 1e3:7.1f} ms, "
                     f"cost {cost * 1e3:7.1f} ms (hides {max(0.0, 1 - cost / two['alone_s']):.0%} of one sum alone)")
        if way == "during" and ways["after"]["waited_s"] > 0:
            line += f", hides {1 - figures['waited_s'] / ways['after']['waited_s']:.0%} of the wait after"
        common.print_flush(line)
    common.print_flush(f"  one sum of every gradient alone: {two['alone_s'] * 1e3:.1f} ms "
                       f"({two['gradient_mb']:.1f} MiB, {two['gradient_mb'] / 1024 / two['alone_s']:.2f} GiB/s)")


LINKS_GBIT = (10, 100)
GLOBAL_BATCH = 256


def model(one):
    """N machines, each one rank, on a link of B bytes/s: a ring allreduce
    sends 2 (N - 1) / N of the gradients' V bytes per machine, so it takes
    2 (N - 1) V / (N B), under 2 V / B for any N. It hides behind the
    backward that runs after the first (top) layers' gradients are ready,
    about backward_time = b * (iteration - forward) / batch (the update
    included: an upper bound). Same batch b per machine: it hides at every N
    when 2 V / B < b * t_backward per image, else never. One global batch of
    GLOBAL_BATCH split over N: b = GLOBAL_BATCH / N, so it stops hiding at
    the N where GLOBAL_BATCH / N * t_backward = 2 (N - 1) V / (N B), i.e.
    N = 1 + GLOBAL_BATCH * t_backward * B / (2 V)."""
    volume = one["gradient_mb"] * 2**20
    per_image = (one["ways"]["sequential"]["iteration_s"] - one["forward_s"]) / one["batch"]
    for gbit in LINKS_GBIT:
        rate = gbit * 1e9 / 8
        ring = 2 * volume / rate
        weak = one["batch"] * per_image
        limit = 1 + GLOBAL_BATCH * per_image * rate / (2 * volume)
        common.print_flush(
            f"  model {one['net']}, {gbit:3d} Gbit/s: allreduce <= {ring * 1e3:7.1f} ms; backward "
            f"{per_image * 1e3:.1f} ms/image on one core: batch {one['batch']} per machine "
            f"{'hides' if ring < weak else 'does not hide'} ({weak * 1e3:.0f} ms of backward) at any N; "
            f"global batch {GLOBAL_BATCH} stops hiding past N = {limit:.0f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nets", default="lenet:64,caffenet:16", help="NET:BATCH per rank, comma separated")
    parser.add_argument("--iterations", type=int, default=20, help="timed iterations (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations first")
    parser.add_argument("--buckets", action="store_true", help="sweep the sums' bucket size on 2 ranks")
    parser.add_argument("--repeats", type=int, default=7, help="sums per bucket size (median reported)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--net", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return bucket_worker(args) if args.buckets else worker(args)
    common.print_flush(common.machine_line())
    for item in args.nets.split(","):
        net, batch = item.split(":")
        if args.buckets:
            bucket_report(run(args, net, int(batch), 2))
            continue
        one = run(args, net, int(batch), 1)
        report(one, run(args, net, int(batch), 2))
        model(one)
    common.print_flush(f"load after: {common.load_average():.2f}")


if __name__ == "__main__":
    main()
