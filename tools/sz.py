#!/usr/bin/env python3
"""Lines of Python per folder, in the spirit of tinygrad's sz.py: CI prints it
so that the size of each part of cct stays visible.

    python tools/sz.py

Per folder: files, lines, and code lines. Code lines are the lines left after
dropping blank lines and lines that hold only a `#` comment; docstrings count
as code. Folders are not recursive (`cct` means its top-level files only, the
pycaffe API), except `tests`, which counts every file under it. The generated
proto/caffe_pb2.py is left out.

Soft budgets print a warning and never fail: the exit status is always 0.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (label, folder relative to ROOT, recursive), in import order, tests last.
FOLDERS = (
    ("proto", "proto", False),
    ("cct/core", "cct/core", False),
    ("cct/formats", "cct/formats", False),
    ("cct/devices", "cct/devices", False),
    ("cct/data", "cct/data", False),
    ("layers", "layers", False),
    ("lowering", "lowering", False),
    ("cct/runtime", "cct/runtime", False),
    ("cct/training", "cct/training", False),
    ("cct/cli", "cct/cli", False),
    ("cct/testing", "cct/testing", False),
    ("cct (pycaffe API)", "cct", False),
    ("tests", "tests", True),
)
EXCLUDED = {os.path.join("proto", "caffe_pb2.py")}

# Soft budgets in code lines: warn when a folder grows past them.
BUDGETS = {"cct/core": 1200, "cct/runtime": 2000}


def python_files(folder, recursive):
    """The .py files of ROOT/folder (relative paths), sorted; none if it is missing."""
    top = os.path.join(ROOT, folder)
    if not os.path.isdir(top):
        return []
    if recursive:
        found = []
        for directory, subdirs, names in os.walk(top):
            subdirs[:] = sorted(d for d in subdirs if d != "__pycache__" and not d.startswith("."))
            found += [os.path.join(directory, name) for name in names if name.endswith(".py")]
    else:
        found = [os.path.join(top, name) for name in os.listdir(top) if name.endswith(".py")]
    relative = (os.path.relpath(path, ROOT) for path in found)
    return sorted(path for path in relative if path not in EXCLUDED)


def count(path):
    """(lines, code lines) of one file; code: not blank and not only a comment."""
    with open(os.path.join(ROOT, path), encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    code = sum(1 for line in lines if line.strip() and not line.lstrip().startswith("#"))
    return len(lines), code


def main():
    rows = []
    for label, folder, recursive in FOLDERS:
        counts = [count(path) for path in python_files(folder, recursive)]
        rows.append((label, len(counts), sum(c[0] for c in counts), sum(c[1] for c in counts)))
    total = ("total", sum(r[1] for r in rows), sum(r[2] for r in rows), sum(r[3] for r in rows))

    header = ("folder", "files", "lines", "code")
    width = max(len(r[0]) for r in rows + [total, header])
    line = f"{{:<{width}}}  {{:>5}}  {{:>7}}  {{:>7}}"
    rule = "-" * len(line.format(*header))
    print(line.format(*header))
    print(rule)
    for row in rows:
        print(line.format(*row))
    print(rule)
    print(line.format(*total))
    print("(code: lines that are not blank and not only a comment; docstrings count as code)")

    for label, _, _, code in rows:
        if label in BUDGETS and code > BUDGETS[label]:
            print(f"warning: {label} has {code} code lines, over its soft budget of {BUDGETS[label]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
