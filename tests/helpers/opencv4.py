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
