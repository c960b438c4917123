"""Helpers shared by the benchmarks: the machine's GEMM peak measured in the
same run, peak memory, a timing loop, the machine's load, and building the
benchmark nets with their data layers replaced by Input blobs filled once.

Run the benchmarks from the repository root: `python bench/bench_caffenet.py`.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAFFENET = os.path.join(REPO, "models", "bvlc_reference_caffenet", "train_synthetic.prototxt")


def gemm_peak(size=2048, repeats=5):
    """Best sgemm rate (GFLOP/s) with numpy's BLAS at its current threads
    (cct.runtime.profile.gemm_peak: square `size`, best of `repeats`)."""
    from cct.runtime.profile import gemm_peak as measure
    return measure(size, repeats)


def _timed(function):
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def time_loop(function, iterations=5, warmup=1):
    """Median and all wall times (seconds) of `function()` after `warmup` calls."""
    for _ in range(warmup):
        function()
    times = [_timed(function) for _ in range(iterations)]
    return statistics.median(times), times


def sample(function, least=0.02):
    """Seconds per call of function(), repeated until `least` seconds passed
    (so that short calls are not timer-bound)."""
    calls, start = 0, time.perf_counter()
    while True:
        function()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= least:
            return elapsed / calls


def peak_rss_mb():
    """This process's peak resident memory (MiB): VmHWM where /proc has it,
    else getrusage (kilobytes on Linux)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def load_average():
    """The 1-minute load average: on a shared 2-core machine a load above ~0.5
    before a run means another process competes for the cores, and OpenBLAS's
    busy-waiting threads then slow 2-thread GEMMs by up to 10-50x."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def machine_line():
    from threadpoolctl import threadpool_info
    blas = [f"{p.get('internal_api')} {p.get('version')} ({p.get('architecture', '?')}, "
            f"{p.get('num_threads')} threads)" for p in threadpool_info() if p.get("user_api") == "blas"]
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "?")
    except OSError:
        pass
    return (f"CPU: {cpu}, {os.cpu_count()} cores; numpy {np.__version__}; BLAS: {', '.join(blas) or 'none'}; "
            f"load {load_average():.2f}")


def net_param_with_inputs(path, batch=None, data_shapes=None):
    """The net's NetParameter with its data layers replaced by Input layers, so a
    benchmark times the net, not its data (Caffe's DummyData refills a gaussian
    every forward; Data reads a database). DummyData keeps its shapes (batch axis
    set to `batch`); a Data layer included in TRAIN (or in every phase) becomes
    an Input of `data_shapes` (one shape per top, batch axis first), and Data
    layers of the TEST phase are dropped. Returns (param, {top name: shape})."""
    from cct.formats.prototxt import read_net
    from cct.proto import caffe_pb2
    param = read_net(path)
    inputs = {}
    kept = []
    for layer in param.layer:
        if layer.type not in ("DummyData", "Data"):
            kept.append(layer)
            continue
        if layer.type == "Data":
            if any(rule.phase == caffe_pb2.TEST for rule in layer.include if rule.HasField("phase")):
                continue
            if data_shapes is None:
                raise ValueError(f"{path}: layer '{layer.name}' is a Data layer: give data_shapes")
            shapes = [list(shape) for shape in data_shapes]
        else:
            shapes = [list(shape.dim) for shape in layer.dummy_data_param.shape]
        if batch:
            for shape in shapes:
                shape[0] = batch
        tops = list(layer.top)
        replacement = caffe_pb2.LayerParameter(name=layer.name, type="Input", top=tops)
        for shape in shapes:
            replacement.input_param.shape.add().dim.extend(shape)
        kept.append(replacement)
        inputs.update(zip(tops, [tuple(s) for s in shapes]))
    del param.layer[:]
    param.layer.extend(kept)
    return param, inputs


def fill_inputs(net, inputs, classes=1000, seed=0):
    """Gaussian data, random integer labels (a blob named like 'label')."""
    rng = np.random.default_rng(seed)
    for name, shape in inputs.items():
        blob = net.blobs[name]
        if "label" in name:
            blob.data[...] = rng.integers(0, classes, size=shape)
        else:
            blob.data[...] = rng.standard_normal(shape, dtype=np.float32)


def sgd_solver(net_param, base_lr=0.001, momentum=0.9, weight_decay=0.0005):
    """cct.SGDSolver over `net_param` (Caffe's CaffeNet solver settings, no
    display, tests or snapshots): solver.step(1) is forward, backward and update."""
    import cct
    from cct.proto import caffe_pb2
    param = caffe_pb2.SolverParameter(base_lr=base_lr, momentum=momentum, weight_decay=weight_decay,
                                      lr_policy="fixed", max_iter=10 ** 9, display=0)
    param.net_param.CopyFrom(net_param)
    return cct.SGDSolver(param)


def layer_breakdown(net, iterations):
    """Median forward and backward ms per layer over `iterations` passes."""
    count = len(net.layers)
    forward, backward = np.zeros((iterations, count)), np.zeros((iterations, count))
    clock = time.perf_counter
    for it in range(iterations):
        for i in range(count):
            start = clock()
            net.executor.forward(i)
            forward[it, i] = clock() - start
        for i in reversed(range(count)):
            start = clock()
            net.executor.backward(i)
            backward[it, i] = clock() - start
    net.executor.finish()
    net.clear_param_diffs()
    return np.median(forward, axis=0) * 1e3, np.median(backward, axis=0) * 1e3


def torch_available():
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def print_flush(*args):
    print(*args)
    sys.stdout.flush()


def framework_parser(doc, batch, iterations, warmup):
    """The flags every cct-against-torch benchmark takes (its own are added after)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=batch, help=f"images per iteration (default {batch})")
    parser.add_argument("--iterations", type=int, default=iterations, help="timed iterations (median reported)")
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed iterations first")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    parser.add_argument("--child", choices=("cct", "torch"), help=argparse.SUPPRESS)
    return parser


def child_flags(args):
    """The common flags of `args`, for run_child."""
    flags = ["--batch", args.batch, "--iterations", args.iterations, "--warmup", args.warmup]
    if args.threads:
        flags += ["--threads", args.threads]
    return flags


def serve_child(args, run_cct, run_torch):
    """In a --child process: run the one framework and print its RESULT line.
    Returns whether this process was a child."""
    if not args.child:
        return False
    result = run_cct(args) if args.child == "cct" else run_torch(args)
    print("RESULT " + json.dumps(result))
    return True


def run_child(script, framework, flags):
    """Run `script --child framework flags...` in a fresh process (so peak memory
    is its own) and return the dict it printed on its last `RESULT {json}` line."""
    command = [sys.executable, os.path.abspath(script), "--child", framework, *map(str, flags)]
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, cwd=REPO)
    if done.returncode:
        raise SystemExit(f"{framework} child failed ({done.returncode})")
    line = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])
