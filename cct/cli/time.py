"""`cct time`: Caffe's per-layer forward and backward timings, then cct's
profile table (GFLOP/s, share of the GEMM peak, lowering type, partitions),
and the start-up apart: building the net, loading its weights, and what the
first forward costs over the average one (a one-shot tool pays all three)."""
import json
import logging
import statistics
import time

import numpy as np

from cct.core.errors import ConfigError
from cct.core.layer import TEST
from cct.devices import jit, pool
from cct.cli.commands import (GPU, HYBRID, LEVEL, MEMORY_LIMIT, PHASE, SCHEDULE, STAGE, apply_gpu,
                              apply_memory_limit, apply_schedule, arguments, check_iterations, command, flag, fmt,
                              phase, require, stages)

log = logging.getLogger("cct.cli")


# --- time --------------------------------------------------------------------------------------
@command("time", "benchmark a model's forward and backward, layer by layer")
@arguments(
    flag("--model", default="", help="the net definition (prototxt); a Python layer in it runs the code of "
                                     "the module it names, as in Caffe: time only files you trust"),
    flag("--weights", default="", help="optional weights, comma separated"),
    flag("--iterations", type=int, default=50, help="number of forward-backward passes to time"),
    flag("--tune", action="store_true",
         help="first choose each layer's batch partitions by measurement (net.executor.tune())"),
    flag("--peak_size", type=int, default=2048,
         help="square sgemm size for the GEMM peak measured at the start, with the memory bandwidth "
              "(0: skip both, and the ops' limits)"),
    PHASE, LEVEL, STAGE, GPU, HYBRID, SCHEDULE, MEMORY_LIMIT,
    flag("--trace", default="",
         help="with --schedule streams or auto: write one streamed backward as a Chrome trace (.json, for "
              "Perfetto or chrome://tracing) or a timeline picture (.png, needs matplotlib)"),
)
def time_command(args):
    from cct.runtime import fusion, memory_plan, profile, settings
    from cct.core.allocation import reset_peak_resident
    from cct.core.layer import TRAIN
    from cct.core.net import Net
    require(args.model, "--model", "need a model definition to time")
    check_iterations(args.iterations)
    if args.peak_size < 0:
        raise ConfigError(f"--peak_size: must be >= 0, got {args.peak_size}")
    if args.trace and (args.schedule not in STREAMED or not args.trace.endswith((".json", ".png"))):
        raise ConfigError(f"--trace: needs --schedule streams (or tuned, or auto) and a .json or .png file, "
                          f"got --trace={args.trace} --schedule={args.schedule or 'sequential'}")
    apply_gpu(args)
    apply_schedule(args)
    apply_memory_limit(args)
    clock = time.perf_counter
    start = clock()
    net = Net(args.model, phase(args, TRAIN), level=args.level, stages=stages(args.stage))
    startup = {"net construction": clock() - start}
    for line in fusion.describe(net):
        log.info("%s", line)
    memory = net.executor.memory_plan
    memory.add("runtime", "numba and OpenBLAS buffers", memory_plan.runtime_bytes())     # what timing loads
    log.info("Memory plan: %s", memory)
    start = clock()
    for path in stages(args.weights):
        net.copy_from(path)
    startup["weights"] = clock() - start if args.weights else None
    peak = bandwidth = None
    if args.peak_size and settings.device() is not None:
        from cct.devices.query import measured_gflops
        peak = measured_gflops(settings.device(), min(args.peak_size, 1024))
        log.info("GEMM peak: %.1f GFLOP/s (sgemm %d on OpenCL device %s)", peak, min(args.peak_size, 1024),
                 settings.device().name)
    elif args.peak_size:
        net.executor.finish()                   # all BLAS threads, as the layers get them
        peak = profile.gemm_peak(args.peak_size, repeats=3)
        log.info("GEMM peak: %.1f GFLOP/s (sgemm %d, %d BLAS threads)", peak, args.peak_size,
                 net.executor.threads)
        bandwidth = profile.memory_bandwidth(net.executor.threads)
        log.info("Memory bandwidth: %.1f GB/s (copies of 64 MB, %d threads)", bandwidth, net.executor.threads)
        reset_peak_resident()           # the measured peak is the net's, not these measurements' arrays
    if args.tune:
        log.info("Tuning batch partitions")
        plan = net.executor.tune()
        log.info("Partitions: %s", ", ".join(f"{name}={p}" for name, p in plan.items()) or "no layer")
    log.info("Performing Forward")
    start = clock()
    loss = net._forward()
    startup["first forward"] = clock() - start
    log.info("Initial loss: %s", fmt(loss))
    log.info("Performing Backward")
    net._backward()
    if settings.device() is not None and settings.hybrid() is not None:
        net._forward()                  # the hybrid split's plan, made (timed) outside the benchmark
    count = len(net.layers)
    forward_ms, backward_ms = np.zeros(count), np.zeros(count)
    jit.warmed_up()                     # the kernels compiled, numba's start-up thread off the cores
    log.info("*** Benchmark begins ***")
    log.info("Testing for %d iterations.", args.iterations)
    # on a device, each layer's time is up to its last kernel's end (Caffe's GPU timer)
    wait = settings.device().finish if settings.device() is not None else (lambda: None)
    moved = settings.device().moved if settings.device() is not None else None
    total_start = clock()
    for iteration in range(args.iterations):
        net.executor.fit_threads()              # each iteration on the cores free now, as a Net.forward
        iteration_start = clock()
        for i in range(count):
            start = clock()
            net.executor.forward(i)
            wait()
            forward_ms[i] += (clock() - start) * 1e3
        for i in reversed(range(count)):
            start = clock()
            # Caffe times every layer's Backward, needed or not (weight gradients of a
            # deploy net still count); bottoms that need no gradient still get none.
            net.executor.backward(i, force=True)
            wait()
            backward_ms[i] += (clock() - start) * 1e3
        log.info("Iteration: %d forward-backward time: %s ms.", iteration + 1,
                 fmt((clock() - iteration_start) * 1e3))
        if moved is not None and iteration == 0:
            moved.reset()               # counted from the second: the first makes what force=True adds
    total_ms = (clock() - total_start) * 1e3
    net.executor.finish()
    forward_ms /= args.iterations
    backward_ms /= args.iterations
    log.info("Average time per layer: ")
    for layer, fwd, bwd in zip(net.layers, forward_ms, backward_ms):
        for label, value in (("forward", fwd), ("backward", bwd)):
            log.info("%10s\t%s: %s ms.", layer.name, label, fmt(value))
    log.info("Average Forward pass: %s ms.", fmt(forward_ms.sum()))
    log.info("Average Backward pass: %s ms.", fmt(backward_ms.sum()))
    log.info("Average Forward-Backward: %s ms.", fmt(total_ms / args.iterations))
    log.info("Total Time: %s ms.", fmt(total_ms))
    log.info("%s", startup_line(startup, forward_ms.sum()))
    log.info("Threads: %s", net.executor.threads_reason())
    log.info("One pool: %s", pool.describe(net.phase == TEST, net.executor.partitioned()))
    for line in profile_table(net, forward_ms, backward_ms, peak, bandwidth):
        log.info("%s", line)
    for line in placement_lines(net):
        log.info("%s", line)
    if moved is not None and args.iterations > 1:
        log.info("%s", traffic_line(moved, args.iterations - 1, settings.device().name))
    if args.schedule in STREAMED:
        _time_streams(net, args.trace, tuned=args.schedule == "tuned")
    log.info("%s", memory_plan.measured_line(memory))
    log.info("*** Benchmark ends ***")
    return 0


STREAMED = ("streams", "tuned", "auto")


def startup_line(seconds, forward_ms):
    """The start-up, apart from the benchmark: building the net, its weights
    (None: no --weights), and the first forward with what it took over `forward_ms`,
    the average forward (machine-specific choices, compiled kernels loaded,
    buffers first touched)."""
    first_ms = 1e3 * seconds["first forward"]
    weights = "none" if seconds["weights"] is None else f"{fmt(1e3 * seconds['weights'])} ms"
    return (f"Start-up: net construction {fmt(1e3 * seconds['net construction'])} ms, weights {weights}, "
            f"first forward {fmt(first_ms)} ms "
            f"({fmt(first_ms - forward_ms)} ms over the average forward, "
            f"{first_ms / forward_ms if forward_ms > 0 else float('inf'):.2f}x).")


def traffic_line(moved, iterations, device):
    """Bytes moved each way per forward-backward after the first, counted at
    the device's upload and download calls."""
    per = {way: (moved.bytes[way] / iterations / 1e6, moved.calls[way] / iterations) for way in ("up", "down")}
    return (f"Device traffic per iteration on {device}: up {per['up'][0]:.3f} MB in {fmt(per['up'][1])} "
            f"copies, down {per['down'][0]:.3f} MB in {fmt(per['down'][1])} copies")


def placement_lines(net):
    """On a device: which layers ran there and which on the host (no device
    path for their settings; Caffe's fallback to Forward_cpu). None on the host."""
    placed = net.executor.placed
    if not placed:
        return []
    where = {}
    for index, layer in enumerate(net.layers):
        where.setdefault(placed.get(index, "host"), []).append(f"{layer.name} ({layer.type})")
    return [f"Ran on {place}: {len(names)} layers: {', '.join(names)}" for place, names in where.items()]


def _time_streams(net, trace_path, tuned=False):
    """The backward as sub-tasks: each one's stream, priority and time measured
    alone, then one streamed backward's span (and its trace, when asked).
    tuned: first each sub-task's thread counts profiled (cct.runtime.tuner,
    one backward per count), and the streamed backward co-runs by them."""
    from cct.runtime import scheduler
    schedule = net.executor.stream_schedule()
    if not schedule.tasks:
        log.info("Backward sub-tasks on streams: none (no layer of this net needs a backward)")
        return
    net._forward()
    schedule.profile()                     # sub-tasks one at a time: times, then priorities from them
    alone = schedule.times, schedule.priority
    try:
        if tuned:
            schedule.tune(_tuned_counts(net, schedule))
        net._forward()
        scheduler.run_on_streams(schedule)
    finally:                               # the executor's streams schedule, shared with "streams"
        schedule.tuner = None
        schedule.times, schedule.priority = alone
    started = {span.task: span for span in schedule.trace}
    origin = min(span.ready for span in schedule.trace)
    log.info("Backward sub-tasks on streams (priority: Algorithm 1's, the layer's branch rank; "
             "alpha %g / beta %g off parameter gradients; threads: the cores it held):",
             schedule.alpha, schedule.beta)
    log.info("  %-36s %6s %10s %9s %7s %12s", "sub-task", "stream", "priority", "alone ms", "threads", "streamed at")
    for task in schedule.tasks:
        span = started[task]
        log.info("  %-36s %6d %10.3f %9.3f %7d %5.2f-%.2f", f"{net.layers[task.layer].name}: {task.kind}"
                 + (f".{task.param}" if task.kind == "backward_param" else ""), span.stream,
                 schedule.priority[task], 1e3 * schedule.times[task], span.threads,
                 1e3 * (span.start - origin), 1e3 * (span.end - origin))
    end = max(span.end for span in schedule.trace)
    alone = sum(schedule.times.values())
    log.info("Streamed backward: %s ms (sub-tasks alone, one after another: %s ms)", fmt(1e3 * (end - origin)),
             fmt(1e3 * alone))
    costs = scheduler.dispatch_costs(schedule.trace)
    log.info("Scheduling cost per sub-task: %s us median, %s us mean (from ready with its cores free to started)",
             fmt(1e6 * statistics.median(costs)), fmt(1e6 * statistics.mean(costs)))
    critical = [span for span in schedule.trace if scheduler.stream_of(span.task) == scheduler.DATA_STREAM]
    log.info("Last data gradient at %s ms (the data gradients alone, one after another: %s ms)",
             fmt(1e3 * (max(span.end for span in critical) - origin)),
             fmt(1e3 * sum(schedule.times[span.task] for span in critical)))
    if trace_path:
        _write_trace(net, schedule, trace_path)
        log.info("Trace written to %s", trace_path)
    net.clear_param_diffs()


def _tuned_counts(net, schedule):
    """The backward's sub-tasks profiled at each thread count (a forward, then
    one backward per profiling step), their times and counts logged."""
    from cct.runtime import tuner as tuner_module
    tuner = tuner_module.Tuner(schedule, cache=tuner_module.cache_path(net, schedule.steps, scope="backward"))
    while not tuner.done:
        net._forward()
        tuner.profile_step()
    source = (f"hill climbing over {tuner.steps} profiling backwards" if tuner.steps
              else f"the profile cached in {tuner.cache}")
    log.info("Thread counts per sub-task (%s; ms at each count tried):", source)
    for (kind, layer, param), op_type, tried, count in tuner.report():
        name = f"{net.layers[layer].name}: {kind}" + (f".{param}" if param >= 0 else "")
        times = ", ".join(f"{threads}: {1e3 * seconds:.3f}" for threads, seconds in tried.items())
        log.info("  %-36s %s -> best %d, its type's %d", name, times, tuner.curves[kind, layer, param].best(), count)
    for (kind, layer, param), count in tuner.pinned.items():
        name = f"{net.layers[layer].name}: {kind}" + (f".{param}" if param >= 0 else "")
        log.info("  %-36s fixed by the run configuration: %d", name, count)
    return tuner


def _write_trace(net, schedule, path):
    from cct.formats.prototxt import atomic_write
    origin = min(span.ready for span in schedule.trace)
    names = {span.task: f"{net.layers[span.task.layer].name} {span.task.kind}" for span in schedule.trace}
    if path.endswith(".json"):
        atomic_write(path, json.dumps(scheduler_trace(schedule, names, origin), indent=1).encode())
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from cct.formats.prototxt import atomic_path
    figure, axes = plt.subplots(figsize=(12, 2.5))
    for span in schedule.trace:
        axes.broken_barh([(1e3 * (span.start - origin), 1e3 * (span.end - span.start))], (span.stream - 0.4, 0.8),
                         color=("tab:red", "tab:blue", "tab:green")[span.stream % 3], edgecolor="white",
                         linewidth=0.5)
    axes.set_yticks([0, 1, 2], ["data gradients", "weight gradients", "other gradients"])
    axes.set_xlabel("ms from the start of backward")
    figure.tight_layout()
    with atomic_path(path) as temp_path:
        figure.savefig(temp_path, format="png", dpi=120)
    plt.close(figure)


def scheduler_trace(schedule, names, origin):
    """Chrome trace events (one row per stream) of the schedule's last run."""
    events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": index,
               "args": {"name": ("stream 0: data gradients", "stream 1: weight gradients",
                                 "stream 2: other gradients")[index]}} for index in range(3)]
    for span in schedule.trace:
        events.append({"name": names[span.task], "ph": "X", "pid": 0, "tid": span.stream,
                       "ts": 1e6 * (span.start - origin), "dur": 1e6 * (span.end - span.start),
                       "args": {"priority_ms": 1e3 * schedule.priority[span.task], "threads": span.threads,
                                "waited_ms": 1e3 * (span.start - span.ready)}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


PROFILE_HEADER = ("layer", "type", "fwd ms", "bwd ms", "fwd GFLOP/s", "bwd GFLOP/s", "% peak",
                  "limit ms", "x limit", "lowering", "partitions")


def profile_table(net, forward_ms, backward_ms, peak, bandwidth=None):
    """`cct time`'s profile: per layer its times, achieved GFLOP/s (cct.runtime.profile's
    counts), the share of the GEMM peak (forward and backward together), its
    limit on this machine (FLOPs at the GEMM peak or bytes at the memory
    bandwidth, whichever is longer) and its time over that limit, the
    lowering type of convolutions (W2, W4: Winograd's tile size, for a
    forward its net never runs backward) and the batch partitions; then the net's
    total and the ops furthest from their limits."""
    from cct.runtime import profile
    flops = profile.net_flops(net, every_backward=True)
    limits = [[profile.limit_ms(count, nbytes, peak, bandwidth) for count, nbytes in zip(layer_flops, layer_bytes)]
              for layer_flops, layer_bytes in zip(flops, profile.net_bytes(net))] if peak and bandwidth else None

    def rate(count, ms):
        return count / ms / 1e6 if count and ms > 0 else None

    def cell(value, spec):
        return "-" if value is None else format(value, spec)

    rows = [PROFILE_HEADER]
    for i, layer in enumerate(net.layers):
        (fwd_flops, bwd_flops), fwd, bwd = flops[i], forward_ms[i], backward_ms[i]
        both = rate(fwd_flops + bwd_flops, fwd + bwd)
        limit = sum(limits[i]) if limits else None
        rows.append((layer.name, layer.type, f"{fwd:.3f}", f"{bwd:.3f}", cell(rate(fwd_flops, fwd), ".1f"),
                     cell(rate(bwd_flops, bwd), ".1f"),
                     cell(100 * both / peak if both is not None and peak else None, ".0f"),
                     cell(limit, ".3g"), cell((fwd + bwd) / limit if limit else None, ".1f"),
                     _algorithm(layer), str(net.executor.partitions(i))))
    total_flops = sum(f + b for f, b in flops)
    total_ms = float(np.sum(forward_ms) + np.sum(backward_ms))
    total = rate(total_flops, total_ms)
    widths = [max(len(row[k]) for row in rows) for k in range(len(PROFILE_HEADER))]
    lines = ["Profile per layer" + (f" (GEMM peak {peak:.1f} GFLOP/s):" if peak else ":")]
    lines += ["  ".join(text.rjust(width) if k > 1 else text.ljust(width)
                        for k, (text, width) in enumerate(zip(row, widths))).rstrip() for row in rows]
    lines.append(f"Net: {total_flops / 1e9:.4g} GFLOP per forward-backward, "
                 + (f"{total:.1f} GFLOP/s" if total is not None else "- GFLOP/s")
                 + (f" = {100 * total / peak:.0f}% of the GEMM peak" if total is not None and peak else ""))
    if limits:
        lines += furthest_from_limits(net, forward_ms, backward_ms, limits, bandwidth)
    return lines + fewer_partitions(net)


def _algorithm(layer):
    """A convolution's lowering type, or "W2"/"W4" where its forward runs
    Winograd with 2 x 2 / 4 x 4 output tiles (F(2x2, 3x3) or F(2x2, 5x5),
    F(4x4, 3x3): cct.lowering.winograd); "-" elsewhere."""
    tile = getattr(layer, "winograd_tile", 0)
    return f"W{tile}" if tile else str(getattr(layer, "lowering_type", "-"))


def furthest_from_limits(net, forward_ms, backward_ms, limits, bandwidth, count=5):
    """The net's time over the sum of its ops' limits, and the `count` ops
    that lose the most time to their limits, forward and backward apart."""
    ops = [(ms - limit, ms, limit, f"{layer.name} {direction}")
           for layer, times, layer_limits in zip(net.layers, zip(forward_ms, backward_ms), limits)
           for direction, ms, limit in zip(("forward", "backward"), times, layer_limits)]
    total_ms, total_limit = sum(op[1] for op in ops), sum(op[2] for op in ops)
    lines = [f"Limits (memory bandwidth {bandwidth:.1f} GB/s): the net takes {total_ms:.3f} ms against "
             f"{total_limit:.3f} ms" + (f", {total_ms / total_limit:.1f}x" if total_limit else "")]
    worst = sorted(ops, key=lambda op: -op[0])[:count]
    lines.append("Most time over the limit: " + ", ".join(
        f"{name} {ms:.3f} ms (limit {limit:.3f}" + (f", {ms / limit:.1f}x)" if limit else ")")
        for _, ms, limit, name in worst))
    return lines


def fewer_partitions(net):
    """A line per (asked, run) pair for the layers whose batch is too small for
    the partitions their plan asks (at most one per sample runs): the table
    shows what ran, this what was asked for."""
    executor, cut = net.executor, {}
    for i, layer in enumerate(net.layers):
        asked, run = executor.plan.get(i), executor.partitions(i)
        if asked is not None and run < asked:
            cut.setdefault((asked, run), []).append(layer.name)
    return [f"Partitions cut to the batch (a partition needs a sample): {asked} asked, {run} run on "
            f"{', '.join(names)}" for (asked, run), names in cut.items()]
