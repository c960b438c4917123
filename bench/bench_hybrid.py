"""The hybrid CPU+device split's FLOPS rule (Caffe con Troll, Sec. 3.3) on
this machine: the host on one core (one BLAS thread, this thread pinned to
core 1) and the OpenCL device on the other (pocl with one worker thread,
POCL_MAX_PTHREAD_COUNT=1, bound to core 0 by POCL_AFFINITY=1). For CaffeNet's
conv2 alone and for a whole CaffeNet-mini training step (the reference
case's net, tests/reference/cases/caffenet_mini_sgd, at --mini_batch): the
time of a forward and backward (a solver step) with every splittable layer
at device shares 0, 0.05, ..., 1; the FLOPS rule's per-layer plan
(cct.runtime.hybrid.measure_shares, measured afresh) and its time, timed
alternately with the best swept share's (3 rounds, medians); and the ideal
1/(1/T_host + 1/T_device) from shares 0 and 1. Times are medians of
--repeats after a warm-up; the shares are swept in a shuffled order so that
drift in the machine's load spreads over them. bench_gpu.py runs the same
sweep on a real GPU (sweep() is imported from here; importing pins nothing).

    python bench/bench_hybrid.py [--batch 16] [--mini_batch 32] [--repeats 3]
"""
import argparse
import os
import random
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PINNED = {"POCL_MAX_PTHREAD_COUNT": "1", "POCL_AFFINITY": "1", "OPENBLAS_NUM_THREADS": "1", "CCT_THREADS": "1"}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONV2 = """name: "conv2" force_backward: true
layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ dim: {batch} dim: 96 dim: 27 dim: 27 }} }} }}
layer {{ name: "conv2" type: "Convolution" bottom: "data" top: "conv2"
        convolution_param {{ num_output: 256 pad: 2 kernel_size: 5 group: 2
                             weight_filler {{ type: "gaussian" std: 0.01 }} bias_filler {{ type: "constant" value: 1 }} }} }}
"""
SHARES = [round(0.05 * step, 2) for step in range(21)]


def sweep(name, net, device, run, repeats):
    """Time `run` with every splittable layer at each share, then at the rule's plan."""
    import common                       # (it imports numpy: here, after main()'s re-exec with PINNED)
    from cct.runtime import hybrid
    splittable = [i for i in range(len(net.layers)) if hybrid.splittable(net, i, device)]
    times = {}
    for share in random.Random(0).sample(SHARES, len(SHARES)):
        net.executor.hybrid = {index: share for index in splittable}
        times[share] = common.time_loop(run, repeats)[0]
    net.executor.hybrid = {}
    plan = hybrid.measure_shares(net, device)
    best_share = min(times, key=times.get)
    # the rule's plan and the best swept share timed again, alternately (the machine drifts)
    rule_times, best_times = [], []
    for _ in range(3):
        net.executor.hybrid = plan
        rule_times.append(common.time_loop(run, repeats)[0])
        net.executor.hybrid = {index: best_share for index in splittable}
        best_times.append(common.time_loop(run, repeats)[0])
    rule, times[best_share] = statistics.median(rule_times), statistics.median(best_times)
    host, on_device = times[0.0], times[1.0]
    ideal = 1 / (1 / host + 1 / on_device)
    print(f"\n{name}: ms per step at each device share (every splittable layer at it)")
    for share in SHARES:
        print(f"  {share:4.2f}  {1e3 * times[share]:9.1f}" + ("  <- best" if share == best_share else ""))
    shares = ", ".join(f"{net.layers[i].name} {s:.3f}" for i, s in sorted(plan.items()))
    print(f"  FLOPS rule's plan: {shares}")
    print(f"  host alone {1e3 * host:.1f} ms, device alone {1e3 * on_device:.1f} ms, "
          f"ideal 1/(1/T_host + 1/T_device) = {1e3 * ideal:.1f} ms")
    print(f"  the rule: {1e3 * rule:.1f} ms = {rule / times[best_share]:.3f}x the best swept "
          f"({1e3 * times[best_share]:.1f} ms at {best_share:.2f}); {rule / ideal:.3f}x the ideal")
    return {"name": name, "times": times, "plan": {net.layers[i].name: s for i, s in plan.items()},
            "best_share": best_share, "rule": rule, "ideal": ideal,
            "rule_over_best": rule / times[best_share], "rule_over_ideal": rule / ideal}


def layer_case(device, net_text, name, batch, repeats):
    """The sweep of one layer's forward and backward: the layer `name` of
    `net_text` (its input's batch given by {batch}), on random data."""
    import numpy as np

    import cct
    net = cct.Net(net_text.format(batch=batch), cct.TRAIN)
    net.blobs["data"].data[...] = np.random.default_rng(0).standard_normal(net.blobs["data"].shape)

    def step():
        net.forward()
        net.backward()
        net.params[name][0].diff.sum()             # the parameter gradient on the host: the device drained
        device.finish()
    return sweep(f"CaffeNet {name}, batch {batch}", net, device, step, repeats)


def mini_case(device, batch, repeats):
    import numpy as np
    from google.protobuf import text_format

    from cct.proto import caffe_pb2
    from cct.training import solver as solver_module
    folder = os.path.join(REPO, "tests", "reference", "cases", "caffenet_mini_sgd")
    with tempfile.TemporaryDirectory() as scratch:
        text = open(os.path.join(folder, "net.prototxt")).read().replace("dim: 2 ", f"dim: {batch} ")
        with open(os.path.join(scratch, "net.prototxt"), "w") as net_file:
            net_file.write(text)
        param = text_format.Parse(f'net: "{scratch}/net.prototxt" base_lr: 0.001 momentum: 0.9 '
                                  'lr_policy: "fixed" max_iter: 1000', caffe_pb2.SolverParameter())
        solver = solver_module.get_solver(param)
    net = solver.net
    rng = np.random.default_rng(1)
    net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].shape)
    net.blobs["label"].data[...] = rng.integers(0, 20, batch)

    def step():
        solver.step(1)
        device.finish()
    return sweep(f"CaffeNet-mini training step, batch {batch}", net, device, step, repeats)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16, help="conv2's batch")
    parser.add_argument("--mini_batch", type=int, default=32, help="CaffeNet-mini's batch")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.sched_setaffinity(0, {1})                 # this thread (the host's work) on core 1
    from cct.runtime import settings
    from cct.devices import opencl
    device = opencl.device(0)
    settings.set_mode("gpu")
    print(f"host: 1 core, 1 BLAS thread; device: {device.name}, "
          f"{device.cl_device.max_compute_units} compute unit(s); load {os.getloadavg()[0]:.2f}")
    results = [layer_case(device, CONV2, "conv2", args.batch, args.repeats),
               mini_case(device, args.mini_batch, args.repeats)]
    print("\nsummary: rule / best swept, rule / ideal:",
          "; ".join(f"{r['rule_over_best']:.3f}, {r['rule_over_ideal']:.3f}" for r in results))


if __name__ == "__main__":
    if any(os.environ.get(key) != value for key, value in PINNED.items()):
        os.execve(sys.executable, [sys.executable] + sys.argv, {**os.environ, **PINNED})   # before numpy loads
    main()
