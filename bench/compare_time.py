"""`cct time` on two revisions of cct, side by side: runs alternate (A, B, A,
B, ...) and each layer's forward and backward times, limit and time over its
limit are printed as medians, with the load average at every run.

    python bench/compare_time.py 6701f63 HEAD --rounds 5 -- --model=models/lenet/lenet_train_test.prototxt \
        --iterations 50 --schedule sequential

The revisions are installed as bench/compare_revisions.py does (WORKTREE, the
default second, is the working tree). Each run's working folder links the
repository's models/ and examples_out/, so a net's relative paths resolve
as in the repository (LeNet reads examples_out/digits_*_lmdb: `cct digits`).
"""
import os
import re
import statistics
import subprocess
import sys
import tempfile

from compare_revisions import REPO, checkout, parse_before_dashes, revisions_parser

ROW = re.compile(r"\] (\S+)\s+\S+\s+([\d.]+)\s+([\d.]+)\s+\S+\s+\S+\s+\S+\s+([\d.]+)\s+([\d.]+)\s")
TOTAL = re.compile(r"Average Forward-Backward: ([\d.]+) ms")


def run(site, folder, args):
    """({layer: (fwd ms, bwd ms, limit ms)}, forward-backward ms) of one `cct time`."""
    done = subprocess.run([sys.executable, "-m", "cct.cli", "time", *args], cwd=folder, capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=site))
    text = done.stdout + done.stderr
    if done.returncode or not TOTAL.search(text):
        sys.exit(f"cct time failed:\n{text[-2000:]}")
    layers = {m.group(1): tuple(float(v) for v in m.group(2, 3, 4)) for m in ROW.finditer(text)}
    return layers, float(TOTAL.search(text).group(1))


def report(name, runs):
    medians = {}
    for layer in runs[0][0]:
        rows = [layers[layer] for layers, _ in runs]
        medians[layer] = [statistics.median(row[k] for row in rows) for k in range(3)]
    for layer, (forward, backward, limit) in medians.items():
        print(f"  {name:10s} {layer:8s} fwd {forward:8.3f}  bwd {backward:8.3f}  limit {limit:7.3f}  "
              f"x limit {(forward + backward) / limit:6.1f}")
    totals = [total for _, total in runs]
    print(f"  {name:10s} forward-backward: median {statistics.median(totals):.2f} ms of "
          + ", ".join(f"{t:.2f}" for t in totals))


def main():
    parser = revisions_parser(__doc__, "%(prog)s A [B] [--rounds N] -- CCT_TIME_ARGS")
    parser.add_argument("--rounds", type=int, default=3, help="A/B pairs of runs")
    args, time_args = parse_before_dashes(parser)
    with tempfile.TemporaryDirectory(prefix="cct-time-ab-") as scratch:
        sites = {name: checkout(name, scratch)[1] for name in (args.a, args.b)}
        folder = os.path.join(scratch, "run")
        os.mkdir(folder)
        for linked in ("models", "examples_out"):
            os.symlink(os.path.join(REPO, linked), os.path.join(folder, linked))
        runs = {name: [] for name in sites}
        for round_ in range(args.rounds):
            for name, site in sites.items():
                runs[name].append(run(site, folder, time_args))
                print(f"round {round_ + 1}: {name}: {runs[name][-1][1]:.2f} ms, load {os.getloadavg()[0]:.2f}",
                      flush=True)
    subprocess.run(["git", "-C", REPO, "worktree", "prune"], check=False)
    for name, name_runs in runs.items():
        report(name, name_runs)


if __name__ == "__main__":
    main()
