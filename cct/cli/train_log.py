"""Training logs: the tables Caffe's tools/extra/parse_log.py makes, and a plot.

A log is what `cct train` (or `caffe train`) writes: glog-style lines
`I1122 13:56:01.123456 solver] ...`. From them:

    <log>.train  NumIters, Seconds, LearningRate, then every "Train net output" name
    <log>.test   NumIters, Seconds, LearningRate, then every "Test net output" name

Seconds count from the first timestamped line. The learning rate of a row is
the one logged for its iteration ("Iteration N, lr = x"), else the latest
one logged before it.
"""
import math
import os
import re
from datetime import datetime, timedelta

from cct.core.errors import ConfigError
from cct.formats.prototxt import atomic_path, atomic_write

_STAMP = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)(?:\.(\d+))?\s")
_ITERATION = re.compile(r"Iteration (\d+)")
_LEARNING_RATE = re.compile(r"Iteration (\d+), lr = (\S+)")
_OUTPUT = re.compile(r"(Train|Test) net output #\d+: (\S+) = (\S+)")
FIXED_COLUMNS = ("NumIters", "Seconds", "LearningRate")


def _timestamp(match):
    month, day, hour, minute, second = (int(match.group(k)) for k in range(1, 6))
    fraction = match.group(6) or "0"
    # Year 2000 is a leap year, so a Feb 29 stamp parses; rollovers are handled by the caller.
    return datetime(2000, month, day, hour, minute, second) + timedelta(seconds=float("0." + fraction))


def parse_log(path):
    """(train_rows, test_rows): lists of dicts keyed by FIXED_COLUMNS and output names."""
    try:
        with open(path, errors="replace") as handle:
            lines = handle.readlines()
    except FileNotFoundError:
        raise ConfigError(f"{path}: log file not found") from None
    rows = {"Train": [], "Test": []}
    rates = {}                                   # iteration -> learning rate logged for it
    start = previous = None
    offset = timedelta(0)
    iteration, seconds = None, math.nan
    for line in lines:
        stamp = _STAMP.match(line)
        if stamp:
            moment = _timestamp(stamp)
            if previous is not None and moment + offset < previous:
                offset += timedelta(days=366 if moment.month <= 2 else 365)   # new year
            moment += offset
            previous = moment
            start = moment if start is None else start
            seconds = (moment - start).total_seconds()
        rate = _LEARNING_RATE.search(line)
        if rate:
            rates[int(rate.group(1))] = _number(rate.group(2))
        found = _ITERATION.search(line)
        if found:
            iteration = int(found.group(1))
        output = _OUTPUT.search(line)
        if output and iteration is not None:
            kind, name, value = output.groups()
            table = rows[kind]
            if not table or table[-1]["NumIters"] != iteration or name in table[-1]:
                table.append({"NumIters": iteration, "Seconds": seconds})
            table[-1][name] = _number(value)
    for table in rows.values():
        for row in table:
            row["LearningRate"] = _rate_at(rates, row["NumIters"])
    return rows["Train"], rows["Test"]


def _number(text):
    try:
        return float(text)
    except ValueError:
        return math.nan


def _rate_at(rates, iteration):
    if iteration in rates:
        return rates[iteration]
    earlier = [i for i in rates if i <= iteration]
    if earlier:
        return rates[max(earlier)]
    return rates[min(rates)] if rates else math.nan


def columns_of(rows):
    names = []
    for row in rows:
        names += [key for key in row if key not in FIXED_COLUMNS and key not in names]
    return list(FIXED_COLUMNS) + names


def write_tables(log_path, output_dir, delimiter=","):
    """Write <output_dir>/<log name>.train and .test; returns their paths."""
    train, test = parse_log(log_path)
    base = os.path.join(output_dir, os.path.basename(log_path))
    paths = []
    for rows, suffix in ((train, ".train"), (test, ".test")):
        columns = columns_of(rows)
        lines = [delimiter.join(columns)]
        for row in rows:
            lines.append(delimiter.join(_cell(row.get(c)) for c in columns))
        atomic_write(base + suffix, ("\n".join(lines) + "\n").encode())
        paths.append(base + suffix)
    return tuple(paths)


def _cell(value):
    if value is None:
        return ""
    if isinstance(value, int):
        return str(value)
    return repr(round(value, 6)) if math.isfinite(value) else str(value)


def plot_training_log(log_path, png_path, x="iters"):
    """Loss (left) and the other outputs, e.g. accuracy (right), of the train
    and test tables against iterations or seconds, into a PNG."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("plot_training_log needs matplotlib (pip install matplotlib); "
                          "`cct parse_log` writes the same data as tables") from None
    train, test = parse_log(log_path)
    if not train and not test:
        raise ConfigError(f"{log_path}: no 'Train net output' or 'Test net output' lines to plot")
    x_column = "NumIters" if x == "iters" else "Seconds"
    figure, (loss_axes, other_axes) = plt.subplots(1, 2, figsize=(12, 4.5))
    for kind, rows in (("train", train), ("test", test)):
        for name in columns_of(rows)[len(FIXED_COLUMNS):]:
            points = [(row[x_column], row[name]) for row in rows if name in row]
            axes = loss_axes if "loss" in name.lower() else other_axes
            axes.plot([p[0] for p in points], [p[1] for p in points], label=f"{kind} {name}")
    for axes, title in ((loss_axes, "loss"), (other_axes, "other outputs")):
        axes.set_xlabel("iterations" if x == "iters" else "seconds")
        axes.set_title(title)
        if axes.lines:
            axes.legend()
        axes.grid(True, alpha=0.3)
    figure.suptitle(os.path.basename(log_path))
    figure.tight_layout()
    try:
        with atomic_path(png_path) as temp_path:
            # format given: matplotlib would otherwise add ".png" to a name without an extension
            figure.savefig(temp_path, dpi=100, format="png")
    finally:
        plt.close(figure)
    return png_path
