"""One benchmark, two revisions of cct, side by side: the runs alternate
(A, B, A, B, ...) so that a noisy host's drift falls on both, and the medians
and their ratio are printed.

    python bench/compare_revisions.py f5a0c1c --pairs 3 -- bench_lenet.py --iterations 200 --no-torch
    python bench/compare_revisions.py f5a0c1c HEAD --pairs 2 -- bench_caffenet.py --batch 256 --no-torch

A revision is any git revision; WORKTREE (the default second one) is the
working tree as it is. Each is installed once into a temporary folder (pip
--no-deps --target) and its own bench/ script runs with that folder first on
PYTHONPATH, so each side runs its own code and its own benchmark script. The
figure compared is the first match of --metric (a regex with one group) in the
script's output; bench_lenet's and bench_caffenet's headline lines are known.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METRICS = {   # script -> (regex of its headline figure, unit, True if larger is better)
    "bench_lenet.py": (r"cct LeNet training iteration, batch \d+: ([\d.]+) ms", "ms/iteration", False),
    "bench_caffenet.py": (r"cct CaffeNet training, batch \d+: (\d+) ms/iteration", "ms/iteration", False),
}


def checkout(revision, scratch):
    """(source folder, install folder) of `revision`."""
    if revision == "WORKTREE":
        source = REPO
    else:
        source = os.path.join(scratch, f"src-{revision}")
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", "-f", source, revision],
                       check=True, capture_output=True)
    site = os.path.join(scratch, f"site-{revision}")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, source],
                   check=True, capture_output=True)
    return source, site


def run(source, site, script, args, metric):
    # the revision's install first; the caller's own path after it (wheels installed by
    # hand for a comparison: OpenCV 4 for bench_deploy, PyTorch)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, os.path.join(source, "bench", script), *args], cwd=scratch_cwd(),
                            env=env, capture_output=True, text=True)
    found = re.search(metric, result.stdout + result.stderr)
    if result.returncode or not found:
        sys.exit(f"{script} at {source} failed or printed no figure:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return float(found.group(1))


def scratch_cwd():
    # not the repository: `import cct` there would find the working tree's package first
    return tempfile.gettempdir()


def revisions_parser(doc, usage):
    """A command line parser of the two revisions: A, and B (the working tree by default)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0], usage=usage)
    parser.add_argument("a", help="the first revision (the baseline)")
    parser.add_argument("b", nargs="?", default="WORKTREE", help="the second revision (default: the working tree)")
    return parser


def parse_before_dashes(parser):
    """(the options before `--`, parsed; the words after it, as they are)."""
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    return parser.parse_args(argv[:split]), argv[split + 1:]


def main():
    parser = revisions_parser(__doc__, "%(prog)s A [B] [--pairs N] [--metric REGEX] -- SCRIPT [ARGS]")
    parser.add_argument("--pairs", type=int, default=3, help="A/B pairs of runs")
    parser.add_argument("--metric", help="regex with one group: the figure to compare (default: by script)")
    args, command = parse_before_dashes(parser)
    if not command:
        parser.error("name the benchmark after --, e.g. -- bench_lenet.py --iterations 200")
    script, script_args = command[0], command[1:]
    metric, unit, larger_better = METRICS.get(script, (None, "", True))
    if args.metric:                   # a figure of the user's: its unit and direction unknown
        metric, unit, larger_better = args.metric, "", None
    if not metric:
        parser.error(f"no known figure for {script}: give --metric")
    with tempfile.TemporaryDirectory(prefix="cct-ab-") as scratch:
        trees = {name: checkout(name, scratch) for name in (args.a, args.b)}
        figures = {args.a: [], args.b: []}
        for pair in range(args.pairs):
            for name in (args.a, args.b):
                figures[name].append(run(*trees[name], script, script_args, metric))
                print(f"pair {pair + 1}: {name}: {figures[name][-1]:g} {unit}", flush=True)
    subprocess.run(["git", "-C", REPO, "worktree", "prune"], check=False)     # the checkouts are gone
    medians = {name: statistics.median(values) for name, values in figures.items()}
    for name, values in figures.items():
        print(f"{name}: median {medians[name]:g} {unit} of {', '.join(f'{v:g}' for v in values)}")
    ratio = medians[args.b] / medians[args.a]
    print(f"{args.b} / {args.a}: {ratio:.3f}" + (" (time: below 1 is faster)" if larger_better is False else ""))


if __name__ == "__main__":
    main()
