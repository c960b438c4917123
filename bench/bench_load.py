"""Loading a deploy net with its weights (issue 39): `Net(deploy, TEST,
weights=...)` in a fresh process per run, cct (one or more installs of it)
and, when given, BVLC Caffe's pycaffe, in alternating rounds.

    python bench/bench_load.py [--nets caffenet,resnet50] [--rounds 5] \\
        [--cct before=/tmp/cct-before-site --cct after=] \\
        [--caffe-python /usr/bin/python3 --caffe-pythonpath /opt/caffe/python] [--bare]

Each net's .caffemodel holds seeded gaussian weights and is written once by
the cct this script runs under, into --cache (CaffeNet's is 244 MB, as BVLC's
bvlc_reference_caffenet.caffemodel). A child process imports its framework,
then times the Net construction alone; it reports the time, its resident
memory before the load and its peak (VmHWM) after, and the bytes of the
net's blobs (activations and parameters, data only). The peak is printed
against the file's size plus those blobs: what a loader that reads the file
once and copies each blob once needs.

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
        "resnet50": os.path.join(REPO, "models", "resnet50", "deploy.prototxt")}


def status_kib(field):
    """A field of /proc/self/status in KiB (VmHWM: peak resident, VmRSS: now)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def child(framework, proto, weights):
    """One load in this process (weights "-": none); prints one JSON line."""
    weights = None if weights == "-" else weights
    if framework == "caffe":
        os.environ.setdefault("GLOG_minloglevel", "2")
        import caffe as module
        load = lambda: (module.Net(proto, weights, module.TEST) if weights    # noqa: E731 (pycaffe's order)
                        else module.Net(proto, module.TEST))
    else:
        import cct as module
        load = lambda: module.Net(proto, module.TEST, weights=weights)    # noqa: E731
    rss_before = status_kib("VmRSS")
    start = time.perf_counter()
    net = load()
    seconds = time.perf_counter() - start
    hwm = status_kib("VmHWM")           # before reading .data, which pycaffe allocates on first touch
    blob_bytes = 4 * sum(blob.count for blob in net.blobs.values())             # float32
    blob_bytes += 4 * sum(blob.count for blobs in net.params.values() for blob in blobs)
    print(json.dumps({"seconds": seconds, "rss_before_kib": rss_before, "hwm_kib": hwm,
                      "blob_bytes": blob_bytes, "module": module.__file__}))


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


def run_child(contender, proto, weights):
    name, python, path = contender
    if name.endswith(" bare"):
        weights = "-"
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH")]))
    framework = "caffe" if name.split()[0] == "caffe" else "cct"
    done = subprocess.run([python, os.path.abspath(__file__), "--child", framework, proto, weights],
                          cwd=tempfile.gettempdir(), env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        sys.exit(f"{name} failed to load {weights}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return json.loads(lines[-1])


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
    file_mib = os.path.getsize(weights) / 2**20
    runs = {name: [] for name, _, _ in runners}
    for round_ in range(args.rounds):
        order = runners if round_ % 2 == 0 else runners[::-1]      # alternate who goes first
        for runner in order:
            result = run_child(runner, proto, weights)
            runs[runner[0]].append(result)
            if round_ == 0:
                print(f"  {runner[0]}: {result['module']}")
        print(f"  round {round_ + 1}: " + ", ".join(f"{name} {results[-1]['seconds']:.3f} s"
                                                   for name, results in runs.items())
              + f"; load {os.getloadavg()[0]:.2f}", flush=True)
    print(f"{net_name}: {os.path.relpath(proto, REPO)}, weights {file_mib:.1f} MiB")
    medians = {name: statistics.median(r["seconds"] for r in results) for name, results in runs.items()}
    for name, results in runs.items():
        report(name, results, medians[name], file_mib)
    first = runners[0][0]
    for name in medians:
        if name != first and not name.endswith(" bare"):
            print(f"  {name} / {first}: {medians[name] / medians[first]:.3f}")
        if f"{name} bare" in medians:
            print(f"  {name}: the weights add {medians[name] - medians[name + ' bare']:.3f} s to the bare net's "
                  f"{medians[name + ' bare']:.3f} s")


def report(name, results, median, file_mib):
    blobs_mib = results[0]["blob_bytes"] / 2**20
    peak = statistics.median((r["hwm_kib"] - r["rss_before_kib"]) / 1024 for r in results)
    base = statistics.median(r["rss_before_kib"] / 1024 for r in results)
    print(f"  {name:12s} load median {median:.3f} s of " + ", ".join(f"{r['seconds']:.3f}" for r in results)
          + f"; peak {peak:.0f} MiB over the {base:.0f} MiB before the load, file + blobs "
          f"{file_mib + blobs_mib:.0f} MiB ({peak / (file_mib + blobs_mib):.2f}x)")


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        child(*sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nets", default="caffenet,resnet50", help=f"comma-separated, of {sorted(NETS)}")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each a fresh process per contender")
    parser.add_argument("--cct", action="append", metavar="NAME=DIR",
                        help="a cct install to run (DIR first on PYTHONPATH; empty: this Python's); repeatable")
    parser.add_argument("--caffe-python", help="a Python whose `import caffe` is BVLC's pycaffe")
    parser.add_argument("--caffe-pythonpath", help="put first on PYTHONPATH for --caffe-python (caffe/python)")
    parser.add_argument("--bare", action="store_true", help="also build each net without weights")
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
