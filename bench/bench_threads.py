"""Per-sub-task thread counts on this machine (issue 12): every sub-task of
LeNet and CaffeNet timed at 1..C threads, a count realized two ways, and the
count hill climbing (cct.runtime.thread_model, Liu et al.'s model B) picks
from its profiling runs against the best of the repeated runs.

    python bench/bench_threads.py [--nets lenet:64,lenet:8,caffenet:8,caffenet:64] [--repeats 7]
                                  [--profile-runs 3] [--step 1] [--cores C]

Sub-tasks are the graph's (cct.runtime.graph.iteration_tasks, every layer
that splits its backward split): forward, backward_param per parameter and
backward_data, or backward where the layer does not split it; data layers
(Input in place of Data/DummyData, bench/common.py) are left out.

A count k is realized
  blas   the layer run whole with k BLAS threads (cct.runtime.threads.blas().set(k));
  parts  k batch partitions on k workers, one BLAS thread each (the executor's
         partitions, cct.runtime.partition; a split sub-task runs on each
         partition's twin, parameter gradients summed after), only for
         layers that may be batch-partitioned. k = 1 is the same for both.

Per layer the configurations are timed round-robin, their order rotated each
round: one untimed warm-up round, --profile-runs profiling rounds (what hill
climbing sees: the paper profiles one training step per count; judged on
the first run alone and on the median of all of them), then --repeats rounds
whose medians are the measured times. Before every run the layer's blobs
(data and diff) are restored to what they held after a whole forward and
backward, so in-place layers see the same inputs every time.

"right": the count hill climbing picked has the least median; "near": its
median is within --tolerance (3%) or --floor-us (10 us) of the least, a tie
within noise (a BLAS count does not touch an op without GEMM at all). The
noise ceiling: how often the first half of the timed rounds names the same
best count as the second half; a model cannot be judged above it.
"""
import os

# OpenBLAS reads this once, when numpy loads it. With its default (2^28
# cycles, about 0.1 s) its idle pool thread spins after every 2-thread call
# and takes a core from the partition workers: the "parts" runs that follow a
# "blas 2" run here ran at half speed (LeNet 64 conv2 forward, 2 partitions:
# 4.0-4.5 ms against 2.0-2.5). The bench measures each op alone, so it keeps
# the spin short unless told otherwise, and prints the value.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "21")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

LENET = os.path.join(common.REPO, "models", "lenet", "lenet_train_test.prototxt")


def build_net(name, batch):
    import cct
    from cct.core.net import Net
    if name == "lenet":
        param, inputs = common.net_param_with_inputs(LENET, batch, data_shapes=[(batch, 1, 28, 28), (batch,)])
        classes = 10
    elif name == "caffenet":
        param, inputs = common.net_param_with_inputs(common.CAFFENET, batch)
        classes = 1000
    else:
        raise SystemExit(f"unknown net {name!r}: lenet or caffenet")
    cct.set_random_seed(1)
    net = Net(param, cct.TRAIN)
    common.fill_inputs(net, inputs, classes=classes)
    return net


class LayerRig:
    """Runs one layer's sub-tasks in one configuration, its blobs restored first."""

    def __init__(self, net, index):
        from cct.runtime import graph
        self.net, self.index = net, index
        self.executor = net.executor
        self.layer = net.layers[index]
        self.bottoms, self.tops = net.bottom_vecs[index], net.top_vecs[index]
        tasks = graph.iteration_tasks(net, update=False, splits=lambda i: net.layers[i].splits_backward)
        self.tasks = [t for t in tasks if t.layer == index]
        blobs = {id(b): b for b in self.bottoms + self.tops}
        self.saved = [(b, b.data.copy(), b.diff.copy()) for b in blobs.values()]
        self.partitionable = self.executor.partitionable(index)

    def restore(self):
        for blob, data, diff in self.saved:
            blob.data[...] = data
            blob.diff[...] = diff

    def configure(self, realization, count):
        """Partitions and BLAS threads of one configuration; and whether the
        partitions changed (the executor then builds new twins, whose first
        run pays for their arrays)."""
        partitions = count if realization == "parts" else 1
        switched = self.executor.plan.get(self.index) != partitions
        if switched:
            self.executor.set_partitions(self.index, partitions)
        self.executor.blas.set(1 if realization == "parts" else count)
        return partitions, switched

    def run(self, realization, count):
        """Seconds of each sub-task, in order (forward first). A run right
        after the partitions changed is preceded by an untimed one: the
        configurations alternate, and timing the new twins' first run charged
        every `parts` run with building them (LeNet 64's conv2 forward: 6.2 ms
        timed so, 2.2 ms in steady state)."""
        partitions, switched = self.configure(realization, count)
        if switched:
            self.restore()
            self._timed_pass(partitions)
        self.restore()
        return self._timed_pass(partitions)

    def _timed_pass(self, partitions):
        from cct.runtime import graph
        from cct.runtime.threads import run_all
        clock, times = time.perf_counter, []
        executor, layer, net, i = self.executor, self.layer, self.net, self.index
        need = net.bottom_need_backward[i]
        for task in self.tasks:
            start = clock()
            if task.kind == graph.FORWARD:
                executor.forward(i, set_blas=False)
            elif task.kind == graph.BACKWARD:
                executor.layer_backward(i, partitions)
            elif partitions == 1:
                if task.kind == graph.BACKWARD_PARAM:
                    layer.backward_param(task.param, self.tops, self.bottoms)
                else:
                    layer.backward_data(self.tops, need, self.bottoms)
            else:
                # A split sub-task on each partition's twin: what the executor
                # would need as PartitionedLayer.backward_param / backward_data.
                runner = executor._runner(i, partitions)
                workers = executor.workers(partitions)
                views = runner._views(self.bottoms, self.tops)
                if task.kind == graph.BACKWARD_PARAM:
                    k = task.param
                    run_all(workers, lambda clone, bv, tv: clone.backward_param(k, tv, bv), views)
                    for clone in runner.clones[1:]:
                        private = clone.blobs[k]._diff
                        if private is not None:
                            layer.blobs[k].diff += private
                            private[...] = 0
                else:
                    run_all(workers, lambda clone, bv, tv: clone.backward_data(tv, need, bv), views)
            times.append(clock() - start)
        return times


def task_name(net, task):
    from cct.runtime import graph
    name = net.layer_names[task.layer]
    kind = {graph.FORWARD: "fwd", graph.BACKWARD: "bwd", graph.BACKWARD_DATA: "bwd_data",
            graph.BACKWARD_PARAM: f"bwd_param{task.param}"}[task.kind]
    return f"{name}.{kind}"


def measure_net(name, batch, args, cores):
    """The net and its rows: (sub-task, layer type, {config: median seconds},
    {config: [seconds of each profiling run]}, the medians of the first and of
    the second half of the timed rounds), config = (realization, count)."""
    net = build_net(name, batch)
    executor = net.executor
    for i in range(len(net.layers)):
        if executor.batch(i) is not None:
            executor.set_partitions(i, 1)
    executor.blas.set(cores)
    net.forward()
    net.backward()
    rows = []
    for i, layer in enumerate(net.layers):
        if not net.bottom_vecs[i]:
            continue                                      # Input: nothing to time
        rig = LayerRig(net, i)
        if not rig.tasks:
            continue
        configs = [("blas", k) for k in range(1, cores + 1)]
        if rig.partitionable:
            configs += [("parts", k) for k in range(2, min(cores, executor.batch(i)) + 1)]
        samples = {c: [] for c in configs}
        profiles = {c: [] for c in configs}
        profiling = 1 + args.profile_runs                 # after the warm-up round
        for round_ in range(profiling + args.repeats):
            shift = round_ % len(configs)
            for config in configs[shift:] + configs[:shift]:
                times = rig.run(*config)
                if round_ >= profiling:
                    samples[config].append(times)
                elif round_ >= 1:
                    profiles[config].append(times)
        for position, task in enumerate(rig.tasks):
            medians = {c: statistics.median(s[position] for s in samples[c]) for c in configs}
            profile = {c: [run[position] for run in profiles[c]] for c in configs}
            half = args.repeats // 2
            halves = tuple({c: statistics.median(s[position] for s in part) for c, part in
                            ((c, samples[c][:half] if first else samples[c][half:]) for c in configs)}
                           for first in (True, False)) if half else None
            rows.append((task_name(net, task), layer.type, medians, profile, halves))
        rig.restore()
        if executor.batch(i) is not None:
            executor.set_partitions(i, 1)
    executor.blas.set(cores)
    return net, rows


def best_count(medians, realization):
    """The count with the least median in one realization (or "either")."""
    truth = {}
    for (realization_, count), seconds in medians.items():
        if realization in ("either", realization_) or count == 1:
            truth[count] = min(seconds, truth.get(count, float("inf")))
    return min(truth, key=truth.get) if len(truth) > 1 else None


def judge(medians, profile, realization, step, runs, tolerance, floor):
    """Hill climbing on one sub-task for one realization ("blas", "parts" or
    "either": per count the faster of the two), fed the median of its first
    `runs` profiling runs per count. Returns (picked count, best count by the
    medians, right, within tolerance or floor seconds of the best), or None
    where the realization has one count only."""
    from cct.runtime.thread_model import hill_climb
    seen, truth = {}, {}
    for config, seconds in medians.items():
        realization_, count = config
        if realization not in ("either", realization_) and count != 1:
            continue
        sample = statistics.median(profile[config][:runs])
        seen[count] = min(sample, seen.get(count, float("inf")))
        truth[count] = min(seconds, truth.get(count, float("inf")))
    if len(seen) < 2:
        return None
    counts = sorted(seen)
    if counts == list(range(1, counts[-1] + 1)):
        picked = hill_climb(seen.__getitem__, counts[-1], step).best()
    else:                                                 # (a batch smaller than the cores)
        picked = min(counts, key=seen.get)
    best = min(truth, key=truth.get)
    near = truth[picked] <= max((1 + tolerance) * truth[best], truth[best] + floor)
    return picked, best, picked == best, near


def change_costs(cores):
    """Seconds per BLAS count change, and per partition switch of a layer."""
    from cct.runtime.threads import blas
    controller = blas()
    counts = [1, max(2, cores)]
    spent = []
    for n in range(2000):
        start = time.perf_counter()
        controller.set(counts[n % 2])
        spent.append(time.perf_counter() - start)
    controller.set(cores)
    # a 256^3 sgemm at the high count: right after a change to it, and at a steady count
    a = np.ones((256, 256), np.float32)
    first, steady = [], []
    for n in range(200):
        controller.set(counts[0])
        controller.set(counts[1])
        start = time.perf_counter()
        a @ a
        first.append(time.perf_counter() - start)
    for n in range(200):
        start = time.perf_counter()
        a @ a
        steady.append(time.perf_counter() - start)
    controller.set(cores)
    return statistics.median(spent), statistics.median(first), statistics.median(steady)


def partition_switch_cost(net, cores):
    """Seconds of set_partitions + building the partitioned runner (its twins),
    and of the first forward after a switch less a steady one, on the
    partitionable layer with the largest top."""
    executor = net.executor
    layers = [i for i in range(len(net.layers)) if executor.partitionable(i) and net.bottom_vecs[i]]
    if not layers or cores < 2:
        return None
    i = max(layers, key=lambda j: net.top_vecs[j][0].count)
    build, first, steady = [], [], []
    executor.blas.set(1)
    for n in range(10):
        p = 2 if n % 2 == 0 else 1
        start = time.perf_counter()
        executor.set_partitions(i, p)
        executor._runner(i, p)
        build.append(time.perf_counter() - start)
        start = time.perf_counter()
        executor.forward(i, set_blas=False)
        first.append(time.perf_counter() - start)
        start = time.perf_counter()
        executor.forward(i, set_blas=False)
        steady.append(time.perf_counter() - start)
    executor.set_partitions(i, 1)
    executor.blas.set(cores)
    return (net.layer_names[i], statistics.median(build), statistics.median(first) - statistics.median(steady),
            statistics.median(steady))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nets", default="lenet:64,lenet:8,caffenet:8,caffenet:64",
                        help="comma-separated net:batch (net: lenet or caffenet)")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds per configuration (median)")
    parser.add_argument("--step", type=int, default=1, help="hill climbing's step x")
    parser.add_argument("--cores", type=int, default=0, help="thread counts up to this (default: the BLAS default)")
    parser.add_argument("--profile-runs", type=int, default=3,
                        help="profiling runs per count; hill climbing is judged on the first and on their median")
    parser.add_argument("--tolerance", type=float, default=0.03, help="'near' within this share of the best")
    parser.add_argument("--floor-us", type=float, default=10.0, help="... or within this many microseconds")
    args = parser.parse_args(argv)
    p = common.print_flush
    from cct.runtime.threads import blas
    cores = args.cores or blas().default
    p(common.machine_line() + f"; OPENBLAS_THREAD_TIMEOUT {os.environ['OPENBLAS_THREAD_TIMEOUT']}")
    p(f"counts 1..{cores}, hill climbing step {args.step}; per layer 1 warm-up round, {args.profile_runs} "
      f"profiling rounds, {args.repeats} timed rounds")
    realizations = ("blas", "parts", "either")
    runs_compared = sorted({1, args.profile_runs})
    # (realization, profiling runs, all or >= 1 ms) -> [sub-tasks, right, near]
    summary = {}
    agreement = {}      # (realization, scope) -> [sub-tasks, halves agreeing on the best count]
    winners = {"blas": 0, "parts": 0}
    switch = None
    for spec in args.nets.split(","):
        name, batch = spec.split(":")
        batch = int(batch)
        started = time.perf_counter()
        net, rows = measure_net(name, batch, args, cores)
        p(f"\n{name} batch {batch} ({time.perf_counter() - started:.0f} s; load {common.load_average():.2f}); "
          f"times in ms, medians of {args.repeats}; HC: hill climbing's pick from the first profiling run "
          "per count (* the measured best, ~ within the tolerance)")
        header = f"{'sub-task':26s} {'type':15s} {'1 thr':>9s}"
        for k in range(2, cores + 1):
            header += f" {f'blas {k}':>9s} {f'parts {k}':>9s}"
        p(header + f" {'best':>9s} {'HC blas':>8s} {'HC parts':>8s} {'HC any':>8s}")
        for task, layer_type, medians, profile, halves in rows:
            best_config = min(medians, key=medians.get)
            line = f"{task:26s} {layer_type:15s} {medians[('blas', 1)] * 1e3:9.3f}"
            for k in range(2, cores + 1):
                line += f" {medians[('blas', k)] * 1e3:9.3f}"
                line += f" {medians[('parts', k)] * 1e3:9.3f}" if ("parts", k) in medians else f" {'-':>9s}"
            line += f" {best_config[0] + ' ' + str(best_config[1]):>9s}"
            big = medians[best_config] >= 1e-3
            picks = []
            for realization in realizations:
                for runs in runs_compared:
                    verdict = judge(medians, profile, realization, args.step, runs, args.tolerance,
                                    args.floor_us * 1e-6)
                    if verdict is None:
                        if runs == 1:
                            picks.append("-")
                        continue
                    picked, _, right, near = verdict
                    for scope in ("all", "big") if big else ("all",):
                        tally = summary.setdefault((realization, runs, scope), [0, 0, 0])
                        tally[0] += 1
                        tally[1] += right
                        tally[2] += near
                    if runs == 1:
                        picks.append(f"{picked}{'*' if right else ('~' if near else ' ')}")
                if halves and best_count(medians, realization) is not None:
                    for scope in ("all", "big") if big else ("all",):
                        tally = agreement.setdefault((realization, scope), [0, 0])
                        tally[0] += 1
                        tally[1] += best_count(halves[0], realization) == best_count(halves[1], realization)
            p(line + "".join(f" {pick:>8s}" for pick in picks))
            if ("parts", 2) in medians:
                winners["blas" if medians[("blas", 2)] <= medians[("parts", 2)] else "parts"] += 1
        if switch is None or name == "caffenet":
            switch = (spec,) + (partition_switch_cost(net, cores) or (None,) * 4)
        del net
    p(f"\nhill climbing's pick against the medians (right: the least median; near: within "
      f"{args.tolerance:.0%} or {args.floor_us:g} us of it):")
    for (realization, runs, scope), (total, right, near) in sorted(
            summary.items(), key=lambda item: (realizations.index(item[0][0]), item[0][1:])):
        what = "all sub-tasks" if scope == "all" else "sub-tasks >= 1 ms"
        p(f"  {realization:6s} profiled {runs} run{'s' if runs > 1 else ' '} per count, {what:17s}: "
          f"{right:3d}/{total:3d} right ({100 * right / total:3.0f}%), {near:3d}/{total:3d} near "
          f"({100 * near / total:3.0f}%)")
    p("the noise ceiling: the best count by the first half of the timed rounds equals the second half's on")
    for realization in realizations:
        for scope in ("all", "big"):
            total, same = agreement.get((realization, scope), (0, 0))
            if total:
                what = "all sub-tasks" if scope == "all" else "sub-tasks >= 1 ms"
                p(f"  {realization:6s} {what:17s}: {same:3d}/{total:3d} ({100 * same / total:3.0f}%)")
    p(f"at 2 threads, partitionable sub-tasks: BLAS threads faster on {winners['blas']}, "
      f"partitions on {winners['parts']}")
    set_cost, first_gemm, steady_gemm = change_costs(cores)
    p(f"cost of a change: blas().set(k) {set_cost * 1e6:.1f} us; a 256^3 sgemm right after a change "
      f"{first_gemm * 1e6:.0f} us against {steady_gemm * 1e6:.0f} us at a steady count")
    if switch and switch[1]:
        spec, layer, build, penalty, steady = switch
        p(f"switching partitions 1 <-> 2 on {spec}'s {layer}: set_partitions + new twins {build * 1e6:.0f} us, "
          f"first forward after it {penalty * 1e3:+.2f} ms over a steady one ({steady * 1e3:.2f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
