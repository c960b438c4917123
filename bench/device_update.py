"""Issue 37: on an OpenCL device, the update as device kernels (the default)
against the host update of a device run (Solver.device_update False: the
gradients come down, the host steps, the weights go up at the next
forward), CaffeNet training at the given batch, the two solvers alternating
in one process; each round a whole step, then the update alone after a
forward and backward, the device finished before and after each timing.

    python bench/device_update.py [--batch 4] [--rounds 3] [--device 0]
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def timed(call, device):
    device.finish()
    start = time.perf_counter()
    call()
    device.finish()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", type=int, default=0)
    args = parser.parse_args()
    from cct.devices import opencl
    from cct.runtime import settings
    settings.set_device_id(args.device)
    settings.set_mode("gpu")
    device = opencl.device(args.device)
    param, inputs = common.net_param_with_inputs(common.CAFFENET, args.batch, None)
    solvers = {}
    for on_device in (True, False):
        solvers[on_device] = common.sgd_solver(param)
        solvers[on_device].device_update = on_device
    steps, updates = {True: [], False: []}, {True: [], False: []}
    for round_ in range(args.rounds + 1):          # the first round warms up
        for on_device, solver in solvers.items():
            common.fill_inputs(solver.net, inputs, 1000)
            step = timed(lambda: solver.step(1), device)
            solver.net.forward()
            solver.net.backward()
            update = timed(solver.apply_update, device)
            if round_:
                steps[on_device].append(step)
                updates[on_device].append(update)
    common.print_flush(f"CaffeNet batch {args.batch} on {device.name}; load {common.load_average():.1f}")
    for on_device, name in ((True, "device kernels"), (False, "host update")):
        common.print_flush(f"  {name:15s} step {1e3 * statistics.median(steps[on_device]):7.0f} ms, update alone "
                           f"{1e3 * statistics.median(updates[on_device]):5.0f} ms "
                           f"(rounds {', '.join(f'{1e3 * u:.0f}' for u in updates[on_device])})")


if __name__ == "__main__":
    main()
