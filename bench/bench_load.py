"""Start-up of a deploy net with its weights (issue 39): `import`, `Net(deploy,
TEST, weights=...)`, and with --batches the first forward against the later
ones, in a fresh process per run, cct (one or more installs of it) and, when
given, BVLC Caffe's pycaffe, in alternating rounds.

    python bench/bench_load.py [--nets caffenet,resnet50] [--rounds 5] \\
        [--cct before=/tmp/cct-before-site --cct after=] \\
        [--caffe-python /usr/bin/python3 --caffe-pythonpath /opt/caffe/python] [--caffe-saves] [--bare] \\
        [--batches 1,10 --forwards 5] [--warm-cache DIR]

Each net's .caffemodel holds seeded gaussian weights and is written once by
the cct this script runs under, into --cache (CaffeNet's is 244 MB, as BVLC's
bvlc_reference_caffenet.caffemodel). A child process imports its framework,
then times the Net construction alone; it reports the time, its resident
memory before the load and its peak (VmHWM) after, and the bytes of the
net's blobs (activations and parameters, data only). The peak is printed
against the file's size plus those blobs: what a loader that reads the file
once and copies each blob once needs.

--caffe-saves: the seeded weights are loaded by BVLC Caffe and saved again
with its own net.save, and every contender loads Caffe's file.

--batches B1,B2: after the load, the input is reshaped to each batch (a
fresh process per batch), one forward timed, then --forwards more: the
first forward's time over the later ones' median (cct's later forwards
after its numba start-up thread is done, untimed), and the slowest later
forward over that median: a one-time cost in a later forward (the third,
cct's first with an execution plan, once compiled numba's list code for
a second) shows there and not in the median. cct runs each process
with an empty measurement cache (CCT_CACHE_DIR, cct.runtime.settings), as
on a machine that never ran the net at that shape; --warm-cache DIR keeps
one folder instead (run once before the rounds, to fill it).

--bare adds, for each contender, the same net built without weights (NAME
bare): what the weights themselves cost is the difference.

--cct NAME=DIR runs cct with DIR first on PYTHONPATH (an install made with
`pip install --no-deps --target DIR REVISION_CHECKOUT`; an empty DIR is the
cct this Python imports). Each child's cct path is printed once.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NETS = {"caffenet": os.path.join(REPO, "models", "bvlc_reference_caffenet", "deploy.prototxt"),
        "googlenet": os.path.join(REPO, "models", "bvlc_googlenet", "deploy.prototxt"),
        "resnet50": os.path.join(REPO, "models", "resnet50", "deploy.prototxt")}


def status_kib(field):
    """A field of /proc/self/status in KiB (VmHWM: peak resident, VmRSS: now)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def blas_kernels(module_file):
    """The BLAS libraries loaded, as threadpoolctl names them: 'openblas
    SkylakeX x2'. threadpoolctl comes from this script's own Python when the
    child's cannot import it (the system Python that runs pycaffe)."""
    try:
        import threadpoolctl
    except ImportError:
        import importlib.util
        spec = importlib.util.spec_from_file_location("threadpoolctl", os.environ["BENCH_THREADPOOLCTL"])
        threadpoolctl = importlib.util.module_from_spec(spec)
        sys.modules["threadpoolctl"] = threadpoolctl
        spec.loader.exec_module(threadpoolctl)
    return ", ".join(f"{lib['internal_api']} {lib.get('architecture')} x{lib['num_threads']}"
                     for lib in threadpoolctl.threadpool_info() if lib["user_api"] == "blas")


def child(framework, proto, weights, batch, forwards):
    """One start-up in this process (weights "-": none; batch 0: no
    forward); prints one JSON line."""
    weights = None if weights == "-" else weights
    batch, forwards = int(batch), int(forwards)
    start = time.perf_counter()
    if framework == "caffe":
        os.environ.setdefault("GLOG_minloglevel", "2")
        import caffe as module
        load = lambda: (module.Net(proto, weights, module.TEST) if weights    # noqa: E731 (pycaffe's order)
                        else module.Net(proto, module.TEST))
    else:
        import cct as module
        load = lambda: module.Net(proto, module.TEST, weights=weights)    # noqa: E731
    import_seconds = time.perf_counter() - start
    rss_before = status_kib("VmRSS")
    start = time.perf_counter()
    net = load()
    seconds = time.perf_counter() - start
    hwm = status_kib("VmHWM")           # before reading .data, which pycaffe allocates on first touch
    blob_bytes = 4 * sum(blob.count for blob in net.blobs.values())             # float32
    blob_bytes += 4 * sum(blob.count for blobs in net.params.values() for blob in blobs)
    result = {"seconds": seconds, "import_seconds": import_seconds, "rss_before_kib": rss_before,
              "hwm_kib": hwm, "blob_bytes": blob_bytes, "module": module.__file__}
    if batch:
        import numpy as np
        data = net.blobs[net.inputs[0]]
        data.reshape(batch, *data.data.shape[1:])
        net.reshape()
        data.data[...] = np.random.default_rng(39).uniform(-1, 1, data.data.shape)
        times = []
        for index in range(1 + forwards):
            if index == 1 and framework == "cct":
                # the later forwards are the steady state: numba's start-up, which
                # cct begins on a thread after the first forward and which holds the
                # GIL for much of its second, is waited for first (not timed)
                from cct.devices import jit
                if hasattr(jit, "warmed_up"):
                    jit.warmed_up()
            start = time.perf_counter()
            net.forward()
            times.append(time.perf_counter() - start)
        result.update(first=times[0], later=statistics.median(times[1:]) if forwards else None,
                      slowest=max(times[1:]) if forwards else None)
    result["blas"] = blas_kernels(module.__file__)
    print(json.dumps(result))


def write_weights(name, proto, folder):
    """The net's .caffemodel with seeded weights, written once into `folder`."""
    path = os.path.join(folder, f"{name}-seeded.caffemodel")
    if os.path.exists(path):
        return path
    import numpy as np

    import cct
    net = cct.Net(proto, cct.TEST)
    rng = np.random.default_rng(39)
    for blobs in net.params.values():
        for blob in blobs:
            blob.data[...] = rng.standard_normal(blob.shape, dtype=np.float32) * 0.01
    os.makedirs(folder, exist_ok=True)
    net.save(path)
    return path


def run_child(contender, proto, weights, batch=0, args=None):
    name, python, path = contender
    if name.endswith(" bare"):
        weights = "-"
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH")]))
    import threadpoolctl
    env["BENCH_THREADPOOLCTL"] = threadpoolctl.__file__
    framework = "caffe" if name.split()[0] == "caffe" else "cct"
    forwards = args.forwards if args and batch else 0
    with tempfile.TemporaryDirectory(prefix="bench-load-cache-") as empty:
        # an empty measurement cache per process, unless a warm one is asked for
        env["CCT_CACHE_DIR"] = args.warm_cache if args and args.warm_cache else empty
        done = subprocess.run([python, os.path.abspath(__file__), "--child", framework, proto, weights, str(batch),
                               str(forwards)], cwd=tempfile.gettempdir(), env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        sys.exit(f"{name} failed to load {weights}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return json.loads(lines[-1])


def caffe_saved(weights, proto, runners):
    """`weights` loaded by BVLC Caffe and saved by it (net.save), once."""
    path = weights.replace(".caffemodel", "-caffe.caffemodel")
    if os.path.exists(path):
        return path
    name, python, caffe_path = next(runner for runner in runners if runner[0] == "caffe")
    env = dict(os.environ, GLOG_minloglevel="2")
    if caffe_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [caffe_path, os.environ.get("PYTHONPATH")]))
    script = (f"import caffe; net = caffe.Net({proto!r}, {weights!r}, caffe.TEST); "
              f"net.save({path + '.part'!r})")
    subprocess.run([python, "-c", script], cwd=tempfile.gettempdir(), env=env, check=True)
    os.replace(path + ".part", path)
    return path


def contenders(args):
    """[(name, python, PYTHONPATH entry)] in the order each round runs them."""
    found = []
    for spec in args.cct or ["cct="]:
        name, _, path = spec.partition("=")
        found.append((name, sys.executable, os.path.abspath(path) if path else ""))
    if args.caffe_python:
        python = os.path.abspath(args.caffe_python) if os.sep in args.caffe_python else args.caffe_python
        found.append(("caffe", python, os.path.abspath(args.caffe_pythonpath) if args.caffe_pythonpath else ""))
    return found + [(f"{name} bare", python, path) for name, python, path in found] if args.bare else found


def bench_net(net_name, args, runners):
    proto = NETS[net_name]
    weights = write_weights(net_name, proto, args.cache)
    if args.caffe_saves:
        weights = caffe_saved(weights, proto, runners)
    file_mib = os.path.getsize(weights) / 2**20
    for batch in [int(b) for b in args.batches.split(",")]:
        if args.warm_cache:
            for runner in runners:
                run_child(runner, proto, weights, batch, args)
        runs = {name: [] for name, _, _ in runners}
        for round_ in range(args.rounds):
            order = runners if round_ % 2 == 0 else runners[::-1]      # alternate who goes first
            for runner in order:
                result = run_child(runner, proto, weights, batch, args)
                runs[runner[0]].append(result)
                if round_ == 0:
                    print(f"  {runner[0]}: {result['module']}, BLAS {result['blas']}")
            print(f"  round {round_ + 1}: " + ", ".join(f"{name} {summary(results[-1])}"
                                                       for name, results in runs.items())
                  + f"; load {os.getloadavg()[0]:.2f}", flush=True)
        print(f"{net_name}: {os.path.relpath(proto, REPO)}, weights {file_mib:.1f} MiB"
              + (f", batch {batch}" if batch else ""))
        for name, results in runs.items():
            report(name, results, file_mib)
        compare(runs)


def summary(result):
    line = f"load {result['seconds']:.3f} s"
    if "first" in result:
        line += f" first {1e3 * result['first']:.1f} ms"
        if result["later"]:
            line += f" later {1e3 * result['later']:.1f}"
    return line


def median_of(results, key):
    return statistics.median(r[key] for r in results)


def report(name, results, file_mib):
    blobs_mib = results[0]["blob_bytes"] / 2**20
    peak = statistics.median((r["hwm_kib"] - r["rss_before_kib"]) / 1024 for r in results)
    base = statistics.median(r["rss_before_kib"] / 1024 for r in results)
    print(f"  {name:12s} load median {median_of(results, 'seconds'):.3f} s of "
          + ", ".join(f"{r['seconds']:.3f}" for r in results)
          + f"; import {median_of(results, 'import_seconds'):.3f} s; peak {peak:.0f} MiB over the {base:.0f} MiB "
          f"before the load, file + blobs {file_mib + blobs_mib:.0f} MiB ({peak / (file_mib + blobs_mib):.2f}x)")
    if "first" in results[0] and results[0]["later"]:
        first, later = median_of(results, "first"), median_of(results, "later")
        ratios = [r["first"] / r["later"] for r in results]
        print(f"  {name:12s} first forward {1e3 * first:.1f} ms, later {1e3 * later:.1f} ms (median of "
              f"each run's median): first / later {statistics.median(ratios):.2f} (runs "
              + ", ".join(f"{ratio:.2f}" for ratio in ratios) + ")")
        slowest = [r["slowest"] / r["later"] for r in results]
        print(f"  {name:12s} slowest later forward / later median: {max(slowest):.2f} at most (runs "
              + ", ".join(f"{ratio:.2f}" for ratio in slowest) + ")")


def compare(runs):
    """Each contender against Caffe (else the first), by the medians and
    round by round: load, import + load, and import + load + first forward."""
    names = list(runs)
    reference = "caffe" if "caffe" in runs else names[0]
    keys = [("load", lambda r: r["seconds"]), ("import + load", lambda r: r["import_seconds"] + r["seconds"])]
    if "first" in runs[reference][0]:
        keys.append(("import + load + first forward", lambda r: r["import_seconds"] + r["seconds"] + r["first"]))
    for name in names:
        if name == reference or name.endswith(" bare"):
            continue
        for label, value in keys:
            pairs = [value(a) / value(b) for a, b in zip(runs[name], runs[reference])]
            print(f"  {name} / {reference}, {label}: medians "
                  f"{statistics.median(map(value, runs[name])) / statistics.median(map(value, runs[reference])):.3f}"
                  f", pairs' median {statistics.median(pairs):.3f}")
    for name in names:
        if f"{name} bare" in runs:
            with_weights, bare = median_of(runs[name], "seconds"), median_of(runs[f"{name} bare"], "seconds")
            print(f"  {name}: the weights add {with_weights - bare:.3f} s to the bare net's {bare:.3f} s")


def main():
    if len(sys.argv) == 7 and sys.argv[1] == "--child":
        child(*sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nets", default="caffenet,resnet50", help=f"comma-separated, of {sorted(NETS)}")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each a fresh process per contender")
    parser.add_argument("--cct", action="append", metavar="NAME=DIR",
                        help="a cct install to run (DIR first on PYTHONPATH; empty: this Python's); repeatable")
    parser.add_argument("--caffe-python", help="a Python whose `import caffe` is BVLC's pycaffe")
    parser.add_argument("--caffe-pythonpath", help="put first on PYTHONPATH for --caffe-python (caffe/python)")
    parser.add_argument("--caffe-saves", action="store_true",
                        help="load BVLC Caffe's own save of the seeded weights (needs --caffe-python)")
    parser.add_argument("--bare", action="store_true", help="also build each net without weights")
    parser.add_argument("--batches", default="0",
                        help="comma-separated input batches to time forwards at after the load (0: none)")
    parser.add_argument("--forwards", type=int, default=5, help="forwards timed after the first one")
    parser.add_argument("--warm-cache", help="cct's measurement cache folder, kept across runs (default: an "
                                             "empty one per process)")
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "cct-bench-load"),
                        help="folder of the seeded .caffemodels, written once")
    args = parser.parse_args()
    print(f"load {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores; "
          f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}")
    runners = contenders(args)
    for net_name in args.nets.split(","):
        bench_net(net_name, args, runners)


if __name__ == "__main__":
    main()
