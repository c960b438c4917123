"""`cct compare`: run a net in cct and compare every blob with a reference run
(BVLC Caffe's, typically), blob by blob, to find the first layer that differs.

The reference is either
- a folder laid out as tests/reference/cases/<case>: forward.npz (every blob's
  data by name, parameters as `param/<layer>/<index>`), optionally backward.npz
  (the diffs, same keys), inputs.npz, top_diffs.npz and phase.txt;
- one .npz or HDF5 file of name -> array: blob data under the blob's name,
  parameters under `param/<layer>/<index>`, diffs under `diff/<name>`;
- or made on the spot by a reference Caffe (`--caffe-python PYTHON`): a small
  script run by that interpreter loads pycaffe, runs forward and backward on
  the same inputs and writes such a folder.
The net's inputs come from inputs.npz, else from the reference's data of the
input blobs (else, with --caffe-python, seeded random values; `label` inputs 0);
non-loss outputs get the reference's diffs before backward.

Error of a blob: max |ours - reference| / max |reference| (floored at 1e-6),
the measure of tests/reference. Rows that fail come first, in net order.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cct.core.errors import CctError
from cct.core.layer import TEST, TRAIN

DIFF_PREFIX = "diff/"


@dataclass
class Row:
    """One compared array: `name` (blob or param/<layer>/<index>), `kind` data or diff."""
    name: str
    kind: str
    shape: tuple
    max_abs_error: float
    relative_error: float
    passed: bool
    first_index: tuple = None      # first element off by more than tolerance * scale
    note: str = ""
    order: tuple = (math.inf,)


@dataclass
class Reference:
    data: dict
    diff: dict
    inputs: dict
    top_diffs: dict
    phase: int = None


# --- reading references ------------------------------------------------------------

def load_reference(path):
    """A Reference from a case folder or a single .npz / HDF5 dump."""
    path = Path(path)
    if path.is_dir():
        return _load_folder(path)
    if not path.exists():
        raise CctError(f"{path}: reference not found (give a case folder, an .npz or an HDF5 file)")
    arrays = _load_arrays(path)
    data = {k: v for k, v in arrays.items() if not k.startswith(DIFF_PREFIX)}
    diff = {k[len(DIFF_PREFIX):]: v for k, v in arrays.items() if k.startswith(DIFF_PREFIX)}
    return Reference(data, diff, {}, {})


def _load_folder(folder):
    forward, backward = folder / "forward.npz", folder / "backward.npz"
    if not forward.exists() and not backward.exists():
        raise CctError(f"{folder}: no forward.npz or backward.npz: not a reference folder")
    phase = None
    if (folder / "phase.txt").exists():
        text = (folder / "phase.txt").read_text().strip().upper()
        if text not in ("TRAIN", "TEST"):
            raise CctError(f"{folder / 'phase.txt'}: must say TRAIN or TEST, got {text!r}")
        phase = TRAIN if text == "TRAIN" else TEST

    def optional(name):
        return _load_arrays(folder / name) if (folder / name).exists() else {}
    return Reference(optional("forward.npz"), optional("backward.npz"), optional("inputs.npz"),
                     optional("top_diffs.npz"), phase)


def _load_arrays(path):
    path = Path(path)
    with open(path, "rb") as handle:
        magic = handle.read(8)
    if magic == b"\x89HDF\r\n\x1a\n":
        import h5py
        arrays = {}
        with h5py.File(path, "r") as dump:
            dump.visititems(lambda name, item: arrays.__setitem__(name, item[...])
                            if isinstance(item, h5py.Dataset) else None)
        return arrays
    try:
        with np.load(path) as dump:
            return {key: dump[key] for key in dump.files}
    except (ValueError, OSError) as error:
        raise CctError(f"{path}: not an .npz or HDF5 file of arrays ({error})") from None


# --- comparing -----------------------------------------------------------------------

def compare(prototxt, weights, reference, phase=None, tolerance=1e-3, inputs=None):
    """Run `prototxt` with `weights` in cct on the reference's inputs; return a
    Row per reference array, failing rows first, each group in net order.

    reference: a path (folder or file) or a Reference. phase: cct.TRAIN/TEST,
    default the reference's phase.txt, else TEST. inputs: optional {name: array}.
    """
    from cct.core.net import Net
    ref = reference if isinstance(reference, Reference) else load_reference(reference)
    phase = phase if phase is not None else (ref.phase if ref.phase is not None else TEST)
    net = Net(str(prototxt), phase, weights=str(weights) if weights else None)
    feed = dict(inputs or ref.inputs or {})
    for name in net.inputs:
        if name not in feed and name in ref.data:
            feed[name] = ref.data[name]
    missing = [name for name in net.inputs if name not in feed]
    if missing:
        raise CctError(f"no values for the net's inputs {missing}: the reference holds neither "
                       "inputs.npz nor their data")
    _set_inputs(net, feed)
    net.forward()
    order = _net_order(net)
    rows = [_compare_one(net, name, "data", expected, tolerance, order) for name, expected in ref.data.items()]
    if ref.diff:
        top_diffs = dict(ref.top_diffs)
        if not top_diffs:
            top_diffs = {name: ref.diff[name] for name in net.outputs
                         if name in ref.diff and net.blob_loss_weights.get(name, 0) == 0}
        for name, values in top_diffs.items():
            if name not in net.blobs:
                raise CctError(f"top_diffs: the net has no blob '{name}'")
            net.blobs[name].diff[...] = np.asarray(values).reshape(net.blobs[name].shape)
        net.backward()
        rows += [_compare_one(net, name, "diff", expected, tolerance, order)
                 for name, expected in ref.diff.items()]
    return sorted(rows, key=lambda row: (row.passed, row.kind != "data", row.order, row.name))


def _set_inputs(net, feed):
    reshaped = False
    for name, values in feed.items():
        if name not in net.blobs:
            raise CctError(f"input '{name}': the net has no such blob (blobs: {list(net.blobs)[:10]}...)")
        values = np.asarray(values)
        blob = net.blobs[name]
        if blob.shape != values.shape:
            if blob.count == values.size and name not in net.inputs:
                values = values.reshape(blob.shape)
            else:
                blob.reshape(values.shape)
                reshaped = True
        blob.data[...] = values
    if reshaped:
        net.reshape()


def _net_order(net):
    """Sort keys: a blob's first producing layer, a parameter's layer (before its tops)."""
    order = {}
    for index, (layer, tops) in enumerate(zip(net.layers, net.top_names.values())):
        for param_index in range(len(layer.blobs)):
            order.setdefault(f"param/{layer.name}/{param_index}", (index, 0, param_index))
        for top_index, name in enumerate(tops):
            order.setdefault(name, (index, 1, top_index))
    return order


def _value(net, name, kind):
    if name.startswith("param/"):
        parts = name.split("/")
        if len(parts) == 3 and parts[1] in net.layer_dict and parts[2].isdigit():
            blobs = net.layer_dict[parts[1]].blobs
            if int(parts[2]) < len(blobs):
                return getattr(blobs[int(parts[2])], kind)
        return None
    blob = net.blobs.get(name)
    return None if blob is None else getattr(blob, kind)


def _compare_one(net, name, kind, expected, tolerance, order):
    expected = np.asarray(expected, np.float64)
    position = order.get(name, (math.inf,))
    ours = _value(net, name, kind)
    if ours is None:
        return Row(name, kind, expected.shape, math.inf, math.inf, False, None,
                   "not in the cct net", position)
    ours = np.asarray(ours, np.float64)
    if ours.size != expected.size:
        return Row(name, kind, expected.shape, math.inf, math.inf, False, None,
                   f"shape {ours.shape} here, {expected.shape} in the reference", position)
    ours = ours.reshape(expected.shape)
    error = np.abs(ours - expected)
    same = (ours == expected) | (np.isnan(ours) & np.isnan(expected))
    error = np.where(same, 0.0, np.where(np.isnan(error), np.inf, error))
    max_error = float(error.max(initial=0.0))
    finite_ref = np.abs(expected[np.isfinite(expected)])
    scale = max(float(finite_ref.max(initial=0.0)), 1e-6)
    relative = max_error / scale
    passed = relative <= tolerance
    first = None
    if not passed:
        flat = np.flatnonzero(error.reshape(-1) > tolerance * scale)
        first = tuple(int(i) for i in np.unravel_index(int(flat[0]), expected.shape)) if flat.size else None
    return Row(name, kind, expected.shape, max_error, relative, passed, first, "", position)


def format_table(rows, tolerance):
    header = ("", "kind", "blob", "shape", "max abs err", "rel err", "first diff at")
    lines = [header]
    for row in rows:
        lines.append(("PASS" if row.passed else "FAIL", row.kind, row.name,
                      "x".join(str(d) for d in row.shape) or "scalar",
                      f"{row.max_abs_error:.3g}", f"{row.relative_error:.3g}",
                      (str(list(row.first_index)) if row.first_index is not None else "-")
                      + (f"  ({row.note})" if row.note else "")))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    text = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)) + "  " + line[-1]
            for line in lines]
    failed = sum(not row.passed for row in rows)
    text.append(f"{len(rows) - failed} of {len(rows)} arrays within relative error {tolerance:g}"
                + (f"; {failed} FAIL" if failed else ""))
    return "\n".join(line.rstrip() for line in text)


# --- a reference made by BVLC Caffe in another interpreter -------------------------

_REFERENCE_SCRIPT = r'''
# Written by cct compare; runs under the reference Caffe's Python (2 or 3).
import json, os, sys
import numpy as np
config = json.load(open(sys.argv[1]))
for folder in config["pythonpath"]:
    sys.path.insert(0, folder)
import caffe
caffe.set_mode_cpu()
phase = caffe.TRAIN if config["phase"] == "TRAIN" else caffe.TEST
if config["weights"]:
    net = caffe.Net(str(config["prototxt"]), str(config["weights"]), phase)
else:
    net = caffe.Net(str(config["prototxt"]), phase)
inputs = np.load(config["inputs"])
for name in inputs.files:
    if tuple(net.blobs[name].data.shape) != inputs[name].shape:
        net.blobs[name].reshape(*inputs[name].shape)
if inputs.files:
    net.reshape()
for name in inputs.files:
    net.blobs[name].data[...] = inputs[name]
net.forward()
def dump(field):
    arrays = {}
    for name in net.blobs:
        arrays[name] = np.array(getattr(net.blobs[name], field))
    for layer in net.params:
        for index, blob in enumerate(net.params[layer]):
            arrays["param/%s/%d" % (layer, index)] = np.array(getattr(blob, field))
    return arrays
np.savez(os.path.join(config["out"], "forward.npz"), **dump("data"))
if config["backward"]:
    top_diffs = np.load(config["top_diffs"])
    for name in top_diffs.files:
        net.blobs[name].diff[...] = top_diffs[name]
    net.backward()
    np.savez(os.path.join(config["out"], "backward.npz"), **dump("diff"))
'''


def run_reference_caffe(python, prototxt, weights, phase, out_folder, inputs=None, pythonpath=(), seed=1701):
    """Run the net in the Caffe importable by interpreter `python`; write a
    reference folder (forward.npz, backward.npz, inputs.npz, top_diffs.npz,
    phase.txt) into out_folder and return its path."""
    from cct.core.net import Net
    out_folder = Path(out_folder)
    out_folder.mkdir(parents=True, exist_ok=True)
    net = Net(str(prototxt), phase, weights=str(weights) if weights else None)
    rng = np.random.default_rng(seed)
    feed = dict(inputs or {})
    for name in net.inputs:
        if name not in feed:
            shape = net.blobs[name].shape
            feed[name] = (np.zeros(shape, np.float32) if "label" in name.lower()
                          else rng.standard_normal(shape).astype(np.float32))
    _set_inputs(net, feed)
    net.forward()
    backward = any(net.layer_need_backward)
    top_diffs = {name: rng.standard_normal(net.blobs[name].shape).astype(np.float32)
                 for name in net.outputs if net.blob_loss_weights.get(name, 0) == 0}
    np.savez(out_folder / "inputs.npz", **{k: np.asarray(v, np.float32) for k, v in feed.items()})
    np.savez(out_folder / "top_diffs.npz", **top_diffs)
    (out_folder / "phase.txt").write_text("TRAIN\n" if phase == TRAIN else "TEST\n")
    config = {"prototxt": os.path.abspath(str(prototxt)),
              "weights": os.path.abspath(str(weights)) if weights else "",
              "phase": "TRAIN" if phase == TRAIN else "TEST",
              "inputs": str((out_folder / "inputs.npz").resolve()),
              "top_diffs": str((out_folder / "top_diffs.npz").resolve()),
              "backward": backward, "out": str(out_folder.resolve()),
              "pythonpath": [os.path.abspath(p) for p in pythonpath]}
    script, config_path = out_folder / "run_reference.py", out_folder / "config.json"
    script.write_text(_REFERENCE_SCRIPT)
    config_path.write_text(json.dumps(config))
    try:
        result = subprocess.run([python, str(script), str(config_path)], capture_output=True, text=True)
    except OSError as error:
        raise CctError(f"--caffe-python {python}: cannot run it ({error})") from None
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-15:])
        raise CctError(f"the reference Caffe run ({python}) failed with status {result.returncode}:\n{tail}")
    return out_folder


# --- the command line -----------------------------------------------------------------

def _parser():
    parser = argparse.ArgumentParser(
        prog="cct compare",
        description="Run a net in cct and compare every blob's data (and diff) with a reference "
                    "run; print a table, failing blobs first; exit 0 iff all are within tolerance.")
    parser.add_argument("prototxt", help="the net (prototxt)")
    parser.add_argument("weights", help="its weights (.caffemodel or Caffe HDF5); '' for none")
    parser.add_argument("reference", nargs="?",
                        help="reference dumps: a folder with forward.npz [backward.npz inputs.npz "
                             "top_diffs.npz phase.txt], or one .npz/HDF5 file (diffs under diff/<name>)")
    parser.add_argument("--caffe-python", metavar="PYTHON",
                        help="instead of REFERENCE: a Python interpreter that can `import caffe` "
                             "(BVLC Caffe); the reference is computed with it on the same inputs")
    parser.add_argument("--caffe-pythonpath", metavar="DIR", action="append", default=[],
                        help="folder to put on the reference interpreter's path (e.g. caffe/python); repeatable")
    parser.add_argument("--inputs", metavar="NPZ", help="input arrays by blob name (default: the "
                        "reference's inputs, else seeded random values)")
    parser.add_argument("--phase", choices=("TRAIN", "TEST"),
                        help="phase to build the net in (default: the reference's phase.txt, else TEST)")
    parser.add_argument("--tolerance", type=float, default=1e-3,
                        help="largest relative error (max abs err / max abs reference) that passes (default 1e-3)")
    parser.add_argument("--keep", metavar="DIR", help="with --caffe-python: write the reference folder here "
                        "(default: a temporary folder, removed afterwards)")
    return parser


def main(argv=None):
    """`cct compare ...`; returns the exit status: 0 all pass, 1 some fail, 2 error."""
    args = _parser().parse_args(argv)
    if (args.reference is None) == (args.caffe_python is None):
        print("cct compare: error: give either REFERENCE or --caffe-python PYTHON (exactly one)",
              file=sys.stderr)
        return 2
    phase = None if args.phase is None else (TRAIN if args.phase == "TRAIN" else TEST)
    try:
        inputs = _load_arrays(args.inputs) if args.inputs else None
        if args.caffe_python:
            with tempfile.TemporaryDirectory(prefix="cct-compare-") as temp:
                folder = run_reference_caffe(args.caffe_python, args.prototxt, args.weights,
                                             phase if phase is not None else TEST, args.keep or temp,
                                             inputs, args.caffe_pythonpath)
                rows = compare(args.prototxt, args.weights, folder, phase, args.tolerance)
        else:
            rows = compare(args.prototxt, args.weights, args.reference, phase, args.tolerance, inputs)
    except CctError as error:
        print(f"cct compare: error: {error}", file=sys.stderr)
        return 2
    print(format_table(rows, args.tolerance))
    return 0 if all(row.passed for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
