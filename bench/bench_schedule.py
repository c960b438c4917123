"""Training iteration time in the streams schedule against layer after layer
(cct.runtime.scheduler), side by side in one process: the two modes alternate
in rounds of one solver.step(--iterations) each (in the streams schedule the
solver runs windows of up to 8 iterations as one graph), so a noisy host's
drift falls on both, and the ratio of the medians (per iteration) is printed,
with one streamed backward's span, busy time and dispatch cost per sub-task.

    python bench/bench_schedule.py [--net lenet|caffenet|googlenet|resnet50] [--batch 64] [--iterations 8] [--rounds 5] [--whole] [--tuned] [--decompose]

--whole adds both schedules with every layer whole (one batch partition,
instead of the default plan's one per thread for large layers), alternating
with the other two: what the streams give where partitions do not already
keep the cores busy.

--decompose then runs the streams' sub-tasks three ways, alternating: in the
graph's order on the calling thread, through the dispatcher on one stream,
and on the three streams, each against the sequential median: where the
streams' time goes.

--tuned adds the tuned schedule (cct.runtime.tuner: thread counts per
sub-task from profiling iterations, co-running by Strategy 3), alternating
with the others, and prints one tuned window's concurrency: sub-tasks
running at once, averaged over start and finish events (Liu et al.'s Fig. 4).

Nets: models/lenet (train net, batch 64 by default), CaffeNet
(models/bvlc_reference_caffenet/train_synthetic.prototxt), GoogLeNet
(models/bvlc_googlenet/train_val.prototxt), their data layers replaced by
Input blobs filled once, and ResNet-50 (models/resnet50/deploy.prototxt with
BatchNorm computing batch statistics and a SoftmaxWithLoss head: weights
constant, the time is the same).
"""
import argparse
import collections
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

NETS = {   # name -> (prototxt, data shapes without the batch, classes); and resnet50
    "lenet": (os.path.join(common.REPO, "models", "lenet", "lenet_train_test.prototxt"), [(1, 28, 28), ()], 10),
    "caffenet": (os.path.join(common.REPO, "models", "bvlc_reference_caffenet", "train_synthetic.prototxt"),
                 [(3, 227, 227), ()], 1000),
    "googlenet": (os.path.join(common.REPO, "models", "bvlc_googlenet", "train_val.prototxt"),
                  [(3, 224, 224), ()], 1000),
}


def resnet50_train(batch):
    """ResNet-50's deploy net made a train net: labels, batch statistics, a loss."""
    from cct.formats.prototxt import read_net
    param = read_net(os.path.join(common.REPO, "models", "resnet50", "deploy.prototxt"))
    source = param.layer[0]
    source.top.append("label")
    source.input_param.shape[0].dim[0] = batch
    source.input_param.shape.add().dim.append(batch)
    for layer in param.layer:
        if layer.type == "BatchNorm":
            layer.batch_norm_param.ClearField("use_global_stats")
    head = param.layer[-1]
    head.type, head.top[0] = "SoftmaxWithLoss", "loss"
    head.bottom.append("label")
    return param, {"data": (batch, 3, 224, 224), "label": (batch,)}


def solver_for(name, batch):
    if name == "resnet50":
        param, inputs = resnet50_train(batch)
        solver = common.sgd_solver(param, base_lr=0.001)
        common.fill_inputs(solver.net, inputs, classes=1000)
        return solver
    path, shapes, classes = NETS[name]
    param, inputs = common.net_param_with_inputs(path, batch, data_shapes=[(batch,) + s for s in shapes])
    solver = common.sgd_solver(param, base_lr=0.001)
    common.fill_inputs(solver.net, inputs, classes=classes)
    return solver


def whole_layers(executor, whole):
    """Every layer in one partition (whole=True), or the default plan back."""
    for index in range(len(executor.net.layers)):
        if whole:
            executor.set_partitions(index, 1)
        else:
            executor.plan.pop(index, None)


def graph_on_this_thread(solver, count):
    """`count` iterations of the streams' graph run on the calling thread, one
    sub-task after another in the graph's order at the widths the streams
    give them: the sub-tasks' own cost, without any dispatching."""
    from cct.runtime import graph
    from cct.training.windows import SolverUpdates
    schedule = solver._stream_schedule(count)
    runner = graph.Runner(solver.net, solver.net.executor.steps(), SolverUpdates(solver))
    first = solver.iter
    for task in graph.topological_order(graph.Graph(schedule.tasks, schedule.edges), lambda ready: ready[0]):
        runner.alone(task, schedule.widths[task])
    runner.finish()
    solver.net.executor.finish()
    solver._count_iterations([runner.loss(k) for k in range(count)], first)


def decomposed_time(solver, variant, iterations, caches):
    """Seconds per iteration of the streams' work run three ways: "graph" on
    this thread (graph_on_this_thread), "one stream" (every sub-task on
    stream 0: the dispatcher, no concurrency), "three streams" (as run)."""
    from cct.runtime import scheduler
    start = time.perf_counter()
    if variant == "graph":
        graph_on_this_thread(solver, iterations)
        return (time.perf_counter() - start) / iterations
    chosen = scheduler.stream_of
    if variant == "one stream":
        scheduler.stream_of = lambda task, weights=frozenset(): scheduler.DATA_STREAM
    solver._stream_schedules = caches.setdefault(variant, {})
    try:
        return step_time(solver, "streams", iterations)
    finally:
        scheduler.stream_of = chosen


def step_time(solver, mode, iterations, whole=False):
    """Seconds per iteration of one solver.step(iterations) in `mode`."""
    whole_layers(solver.net.executor, whole)
    solver.net.executor.schedule = mode
    start = time.perf_counter()
    solver.step(iterations)
    return (time.perf_counter() - start) / iterations


def concurrency(spans):
    """The paper's Fig. 4 measure: sub-tasks running at once, averaged over
    the start and finish events of a trace (each event counts what runs just
    after it)."""
    events = sorted([(span.start, 1) for span in spans] + [(span.end, -1) for span in spans])
    running, counts = 0, []
    for _, change in events:
        running += change
        counts.append(running)
    counts = [count for count in counts if count > 0]
    return statistics.mean(counts) if counts else 0.0


def tuned_window(solver, iterations):
    """One window in the tuned schedule: its trace and the profiling steps spent."""
    solver.net.executor.schedule = "tuned"
    solver.step(iterations)
    schedule = next(s for key, s in reversed(solver._stream_schedules.items()) if key[1] and s.trace)
    [tuner] = solver._tuners.values()
    return schedule.trace, tuner


def at_once(spans):
    """(the most sub-tasks running at once, the streams they ran on, the
    seconds in which two or more ran) of a trace."""
    events = sorted([(span.start, 1, span) for span in spans] + [(span.end, -1, span) for span in spans],
                    key=lambda event: (event[0], event[1]))
    running, most, streams, shared, since = set(), 0, set(), 0.0, None
    for moment, change, span in events:
        if len(running) >= 2:
            shared += moment - since
        if change > 0:
            running.add(span)
        else:
            running.discard(span)
        since = moment
        if len(running) > most:
            most, streams = len(running), {s.stream for s in running}
    return most, sorted(streams), shared


def trace_figures(solver):
    """(span, summed sub-task time, dispatch cost per sub-task) of one
    streamed backward in ms, its sub-task count, and at_once()."""
    schedule = solver.net.executor.stream_schedule()
    solver.net.forward()
    from cct.runtime import scheduler
    scheduler.run_on_streams(schedule)
    spans = schedule.trace
    span = max(s.end for s in spans) - min(s.ready for s in spans)
    busy = sum(s.end - s.start for s in spans)
    from cct.runtime import scheduler
    dispatch = statistics.median(scheduler.dispatch_costs(spans))
    solver.net.clear_param_diffs()
    return span * 1e3, busy * 1e3, dispatch * 1e6, len(spans), at_once(spans)


def decompose(solver, args, sequential_ms):
    """The streams' work on this thread, on one stream and on three, alternating."""
    caches, variants = {}, ("graph", "one stream", "three streams")
    for variant in variants:
        decomposed_time(solver, variant, args.iterations, caches)
    times = {variant: [] for variant in variants}
    for _ in range(args.rounds):
        for variant in variants:
            times[variant].append(decomposed_time(solver, variant, args.iterations, caches))
    common.print_flush("  the streams' sub-tasks / sequential: " + ", ".join(
        f"{variant} {statistics.median(times[variant]) * 1e3 / sequential_ms:.3f}" for variant in variants)
        + " (graph: in the graph's order on this thread; one stream: through the dispatcher)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--net", choices=sorted(NETS) + ["resnet50"], default="lenet")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=8, help="iterations per mode and round (one step)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    parser.add_argument("--whole", action="store_true", help="also both schedules with every layer whole")
    parser.add_argument("--decompose", action="store_true",
                        help="also the streams' sub-tasks on this thread and on one stream (where the time goes)")
    parser.add_argument("--tuned", action="store_true",
                        help="also the tuned schedule (per-sub-task thread counts and co-running, issue 12)")
    args = parser.parse_args()
    p = common.print_flush
    p(common.machine_line())
    solver = solver_for(args.net, args.batch)
    modes = ["sequential", "streams"] + (["tuned"] if args.tuned else [])
    variants = [(mode, False) for mode in modes] + ([("sequential", True), ("streams", True)]
                                                    if args.whole else [])
    for mode, whole in variants:
        step_time(solver, mode, args.iterations, whole)  # warm: buffers, the streams' schedules
    times = {variant: [] for variant in variants}
    for _ in range(args.rounds):
        for mode, whole in variants:
            times[mode, whole].append(step_time(solver, mode, args.iterations, whole))
    whole_layers(solver.net.executor, False)
    medians = {mode: statistics.median(times[mode, False]) * 1e3 for mode in modes}
    span, busy, dispatch, count, (most, streams, shared) = trace_figures(solver)
    p(f"{args.net} batch {args.batch}, training iteration: sequential {medians['sequential']:.2f} ms, "
      f"streams {medians['streams']:.2f} ms; streams / sequential time {medians['streams'] / medians['sequential']:.3f}")
    if args.decompose:
        decompose(solver, args, medians["sequential"])
    if args.tuned:
        spans, tuner = tuned_window(solver, args.iterations)
        overhead = tuner.seconds - tuner.steps * medians["sequential"] / 1e3    # over sequential iterations
        p(f"  tuned {medians['tuned']:.2f} ms; tuned / sequential time {medians['tuned'] / medians['sequential']:.3f}, "
          f"tuned / streams {medians['tuned'] / medians['streams']:.3f}; {tuner.steps} profiling iterations "
          f"({1e3 * tuner.seconds:.1f} ms, {1e3 * overhead:.1f} ms over sequential ones: "
          f"{100 * overhead / (10000 * medians['sequential'] / 1e3):.4f}% of 10,000 sequential iterations); "
          f"sub-tasks at once per start/finish {concurrency(spans):.2f}; threads per sub-task "
          f"{dict(sorted(collections.Counter(span.threads for span in spans).items()))}")
        widest, on, together = at_once(spans)
        window = max(span.end for span in spans) - min(span.start for span in spans)
        p(f"  one tuned window: at most {widest} sub-tasks at once (streams {', '.join(map(str, on))}), "
          f"two or more running for {together * 1e3:.2f} ms of its {window * 1e3:.2f} ms")
    if args.whole:
        seq, streams = (statistics.median(times[mode, True]) * 1e3 for mode in ("sequential", "streams"))
        p(f"  every layer whole: sequential {seq:.2f} ms, streams {streams:.2f} ms; "
          f"streams / sequential time {streams / seq:.3f}")
    p(f"  one streamed backward: {count} sub-tasks, span {span:.2f} ms, sub-tasks' own time {busy:.2f} ms "
      f"(overlap {busy / span:.2f}x), dispatch {dispatch:.0f} us per sub-task (median, from the "
      f"sub-task being ready and cores free to its start); at most {most} sub-tasks at once "
      f"(streams {', '.join(map(str, streams))}), two or more running for {shared * 1e3:.2f} ms of the span")
    p(f"load after the runs: {common.load_average():.2f}")


if __name__ == "__main__":
    main()
