"""Training iteration time with the backward as sub-tasks on streams against
layer after layer (cct.runtime.scheduler), side by side in one process: the
two modes alternate in rounds of `--iterations` steps, so a noisy host's
drift falls on both, and the ratio of the medians is printed, with the
streams' span, busy time and dispatch cost per sub-task from a trace.

    python bench/bench_schedule.py [--net lenet|caffenet|googlenet] [--batch 64] [--iterations 10] [--rounds 3]

Nets: models/lenet (train net, batch 64 by default), CaffeNet
(models/bvlc_reference_caffenet/train_synthetic.prototxt) and GoogLeNet
(models/bvlc_googlenet/train_val.prototxt), their data layers replaced by
Input blobs filled once.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

NETS = {   # name -> (prototxt, data shapes without the batch, classes)
    "lenet": (os.path.join(common.REPO, "models", "lenet", "lenet_train_test.prototxt"), [(1, 28, 28), ()], 10),
    "caffenet": (os.path.join(common.REPO, "models", "bvlc_reference_caffenet", "train_synthetic.prototxt"),
                 [(3, 227, 227), ()], 1000),
    "googlenet": (os.path.join(common.REPO, "models", "bvlc_googlenet", "train_val.prototxt"),
                  [(3, 224, 224), ()], 1000),
}


def solver_for(name, batch):
    path, shapes, classes = NETS[name]
    param, inputs = common.net_param_with_inputs(path, batch, data_shapes=[(batch,) + s for s in shapes])
    solver = common.sgd_solver(param, base_lr=0.001)
    common.fill_inputs(solver.net, inputs, classes=classes)
    return solver


def step_times(solver, mode, iterations):
    solver.net.executor.schedule = mode
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        solver.step(1)
        times.append(time.perf_counter() - start)
    return times


def trace_figures(solver):
    """(span, summed sub-task time, dispatch cost per sub-task) of one streamed backward, ms."""
    schedule = solver.net.executor.stream_schedule()
    solver.net.forward()
    from cct.runtime import scheduler
    scheduler.run_backward(solver.net, schedule)
    spans = schedule.trace
    span = max(s.end for s in spans) - min(s.ready for s in spans)
    busy = sum(s.end - s.start for s in spans)
    dispatch = statistics.median(s.start - s.ready for s in spans)
    solver.net.clear_param_diffs()
    return span * 1e3, busy * 1e3, dispatch * 1e6, len(spans)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--net", choices=sorted(NETS), default="lenet")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=10, help="steps per mode and round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    args = parser.parse_args()
    p = common.print_flush
    p(common.machine_line())
    solver = solver_for(args.net, args.batch)
    for mode in ("sequential", "streams"):
        step_times(solver, mode, 2)                     # warm: buffers, the streams' schedule
    times = {"sequential": [], "streams": []}
    for _ in range(args.rounds):
        for mode in times:
            times[mode] += step_times(solver, mode, args.iterations)
    medians = {mode: statistics.median(values) * 1e3 for mode, values in times.items()}
    span, busy, dispatch, count = trace_figures(solver)
    p(f"{args.net} batch {args.batch}, training iteration: sequential {medians['sequential']:.2f} ms, "
      f"streams {medians['streams']:.2f} ms; streams / sequential time {medians['streams'] / medians['sequential']:.3f}")
    p(f"  one streamed backward: {count} sub-tasks, span {span:.2f} ms, sub-tasks' own time {busy:.2f} ms "
      f"(overlap {busy / span:.2f}x), dispatch {dispatch:.0f} us per sub-task (ready to started, median)")
    p(f"load after the runs: {common.load_average():.2f}")


if __name__ == "__main__":
    main()
