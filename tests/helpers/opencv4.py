"""OpenCV 4's DNN module as a reference for the forks' layers (OpenCV 5 has no
Caffe importer). It runs in a child process: the test environment may hold
OpenCV 5 as `cv2`, and two OpenCV builds do not load into one process. The
child puts OPENCV4_PATH (a `pip install --target` folder: tools/setup.sh
--test makes .venv/test-references/opencv4) first on its sys.path; where no
4.x is importable there, the callers skip with one reason, or under CI=true
fail."""
import functools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import cct
from helpers.requirements import REFERENCES, SETUP, reference_path, skip_or_fail

OPENCV4_PATH = reference_path("CCT_OPENCV4_PATH", "opencv4", "/tmp/cv4")
INSTALL = f'pip install --target {OPENCV4_PATH} "opencv-python-headless>=4.10,<5"'

# argv: the OpenCV 4 folder, a JSON spec, the inputs' .npz, the outputs' .npz.
_CHILD = r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import cv2
if not cv2.__version__.startswith("4."):
    sys.exit(f"cv2 {cv2.__version__} is not 4.x")
if sys.argv[2] == "version":
    print(cv2.__version__)
    sys.exit(0)
spec = json.loads(sys.argv[2])
net = cv2.dnn.readNetFromCaffe(spec["prototxt"], spec["caffemodel"]) if spec["caffemodel"] \
    else cv2.dnn.readNetFromCaffe(spec["prototxt"])
net.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
inputs = np.load(sys.argv[3])
results = {}
for run in range(spec["runs"]):
    for name in spec["inputs"]:
        net.setInput(np.ascontiguousarray(inputs[f"{run}/{name}"], np.float32), name)
    outs = net.forward(spec["outputs"])
    for name, out in zip(spec["outputs"], outs):
        results[f"{run}/{name}"] = out
np.savez(sys.argv[4], **results)
"""


def _run_child(*args):
    return subprocess.run([sys.executable, "-c", _CHILD, OPENCV4_PATH, *args],
                          capture_output=True, text=True, timeout=600)


@functools.lru_cache(maxsize=None)
def opencv4_version():
    """OpenCV 4's version string, or None where no 4.x is importable from OPENCV4_PATH."""
    result = _run_child("version")
    return result.stdout.strip() if result.returncode == 0 else None


def require_opencv4():
    """Skip the calling test, with one reason, where OpenCV 4 is not importable."""
    if opencv4_version() is None:
        skip_or_fail(f"OpenCV 4.x comparisons need OpenCV 4 at {OPENCV4_PATH}: {INSTALL} ({SETUP} puts it in "
                     f"{REFERENCES})")


def opencv4_forward(prototxt, caffemodel, runs, outputs):
    """OpenCV 4's outputs: runs is a list of {input name: array}, one forward
    each; returns a list of {output name: array}."""
    require_opencv4()
    with tempfile.TemporaryDirectory() as folder:
        given, taken = Path(folder, "in.npz"), Path(folder, "out.npz")
        np.savez(given, **{f"{k}/{name}": array for k, run in enumerate(runs) for name, array in run.items()})
        spec = {"prototxt": str(prototxt), "caffemodel": str(caffemodel or ""), "runs": len(runs),
                "inputs": list(runs[0]), "outputs": list(outputs)}
        result = _run_child(json.dumps(spec), str(given), str(taken))
        if result.returncode:
            raise AssertionError(f"OpenCV 4 failed on {prototxt}:\n{result.stderr[-3000:]}")
        with np.load(taken) as found:
            return [{name: found[f"{k}/{name}"] for name in outputs} for k in range(len(runs))]


def input_lines(shapes):
    return "".join(f'input: "{name}" input_shape {{ {" ".join(f"dim: {d}" for d in shape)} }}\n'
                   for name, shape in shapes.items())


def compare_with_opencv(tmp_path, layers_text, inputs, outputs, set_params=None):
    """Run the net (inputs as `input:` fields) through cct and OpenCV 4, the
    weights cct's (saved as a .caffemodel when the net has any)."""
    require_opencv4()
    prototxt = tmp_path / "net.prototxt"
    prototxt.write_text(input_lines({k: v.shape for k, v in inputs.items()}) + layers_text)
    net = cct.Net(str(prototxt), cct.TEST)
    if set_params:
        set_params(net)
    model = None
    if any(net.params.values()):
        model = tmp_path / "net.caffemodel"
        net.save(str(model))
    for name, value in inputs.items():
        net.blobs[name].data[...] = value
    net.forward()
    ours = {name: net.blobs[name].data.copy() for name in outputs}
    theirs = opencv4_forward(prototxt, model, [inputs], outputs)[0]
    return ours, theirs


def relative_difference(ours, theirs):
    """The largest difference relative to the blob's largest value (at least 1)."""
    assert ours.shape == theirs.shape
    return float(np.abs(ours - theirs).max(initial=0)) / max(1.0, float(np.abs(theirs).max(initial=0)))


def assert_close(ours, theirs, rtol=1e-5):
    """Within rtol of the blob's largest value (at least 1); returns the
    largest difference relative to that."""
    assert ours.shape == theirs.shape
    scale = max(1.0, float(np.abs(theirs).max()))
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=rtol * scale)
    return relative_difference(ours, theirs)


def detections_of(rows):
    """The detection rows of a (1, 1, D, 7) top: OpenCV 4 pads its top with rows
    of zeros (all zeros when nothing is found), the fork gives a row of -1 per
    image when nothing is found."""
    rows = rows.reshape(-1, 7)
    return rows[(rows != 0).any(axis=1) & (rows[:, 1] != -1)]


def assert_same_detections(ours, theirs, score_tolerance=1e-5, box_tolerance=1e-4):
    """Every detection of ours is one of theirs: same image and label, score
    within score_tolerance, box within box_tolerance; returns the largest box
    difference. Matched one to one, not row by row: scores that tie, or differ
    by rounding, may come in another order (std::sort is not stable)."""
    mine, cv = detections_of(ours), detections_of(theirs)
    assert mine.shape == cv.shape, f"{mine.shape[0]} detections, OpenCV 4 {cv.shape[0]}"
    free, worst = list(range(cv.shape[0])), 0.0
    for row in mine:
        near = [j for j in free if (cv[j, :2] == row[:2]).all() and abs(cv[j, 2] - row[2]) <= score_tolerance]
        assert near, f"no detection of OpenCV 4's matches {row}"
        best = min(near, key=lambda j: np.abs(cv[j, 3:] - row[3:]).max())
        difference = float(np.abs(cv[best, 3:] - row[3:]).max())
        assert difference <= box_tolerance, f"{row}: OpenCV 4's nearest box is {difference} away: {cv[best]}"
        free.remove(best)
        worst = max(worst, difference)
    return mine.shape[0], worst


def run_script(text, python_path, args):
    """A script's printed lines, split at tabs: under OpenCV 4 where python_path
    is OPENCV4_PATH, under this environment's packages where it is None."""
    env_path = f"import sys; sys.path.insert(0, {python_path!r})\n" if python_path else ""
    run = subprocess.run([sys.executable, "-c", env_path + text, *args], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return [line.split("\t") for line in run.stdout.splitlines()]


def compare_scripts(script, args):
    """Run an OpenCV 4 script that prints `path, score, x1, y1, x2, y2, ...` per
    box under OpenCV 4 and with cv2.dnn replaced by cct.dnn: as many lines,
    each of ours one of OpenCV's (same path, score within 1e-5, the nearest
    such box within 1e-4; matched one to one, as boxes whose scores agree to
    1e-7 may be printed in either order). Returns (line count, largest box
    difference)."""
    theirs = run_script(script, OPENCV4_PATH, args)
    mine = run_script("import cct\n" + script.replace("cv2.dnn.", "cct.dnn."), None, args)
    assert len(mine) == len(theirs), f"{len(mine)} boxes, OpenCV 4 {len(theirs)}"
    free, worst = list(theirs), 0.0
    for line in mine:
        near = [other for other in free if other[0] == line[0] and abs(float(other[1]) - float(line[1])) <= 1e-5]
        assert near, f"no line of OpenCV 4's matches {line}"
        distance = [max(abs(float(x) - float(y)) for x, y in zip(line[2:6], other[2:6])) for other in near]
        best = min(range(len(near)), key=distance.__getitem__)
        assert distance[best] <= 1e-4, f"{line}: OpenCV 4's nearest box is {distance[best]} away: {near[best]}"
        worst = max(worst, distance[best])
        free.remove(near[best])
    return len(mine), worst
