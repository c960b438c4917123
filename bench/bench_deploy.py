"""Deploy-net forward time of cct against OpenCV's DNN module, side by side in
one process (issue 20's baseline): the same seeded weights (cct fills the net,
saves a .caffemodel, OpenCV reads it with cv2.dnn.readNetFromCaffe), the same
input, the two frameworks alternating in rounds so a noisy host's drift falls
on both; medians in ms per forward, their ratio, and how far the logits (the
final Softmax's input) agree: largest difference over the largest value.
A second line gives the quartiles of the per-round ratio (cct's time over
the other framework's in the same round): the host's noise, in the
ratio's own terms.

    python bench/bench_deploy.py [--nets caffenet,googlenet,resnet50] [--batches 1,16] [--rounds 5] [--threads 2]
                                 [--settle 0.5]

--settle is the pause before each timed forward (SETTLE_SECONDS below);
shorter pauses show how the ratio depends on the other framework's threads
still holding the cores.

Where PyTorch is importable (installed by hand too), CaffeNet also runs as a
torch.nn model built layer for layer from the deploy net (grouped
convolutions, Caffe's ceil-mode pooling, LocalResponseNorm) with cct's
weights, in the same rounds (torch.set_num_threads(--threads), no autograd).

OpenCV 5 dropped the Caffe importer, so the comparison needs a 4.x wheel
beside cct's own OpenCV, first on the path: `tools/setup.sh --test` puts one
(without numpy, so cct runs on the venv's) in .venv/test-references/opencv4:

    PYTHONPATH=.venv/test-references/opencv4 python bench/bench_deploy.py

cv2.setNumThreads(--threads), and cct's BLAS at the same count. Deploy nets:
models/bvlc_reference_caffenet, models/bvlc_googlenet, models/resnet50.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

DEPLOY = {
    "caffenet": ("bvlc_reference_caffenet", 227),
    "googlenet": ("bvlc_googlenet", 224),
    "resnet50": ("resnet50", 224),
}


def cct_net(name, batch, folder):
    """The deploy net at `batch` with seeded gaussian weights (BatchNorm's
    statistics made sane), and the .caffemodel OpenCV will read."""
    import cct
    from cct.formats.prototxt import read_net
    model, size = DEPLOY[name]
    param = read_net(os.path.join(common.REPO, "models", model, "deploy.prototxt"))
    param.layer[0].input_param.shape[0].dim[0] = batch
    cct.set_random_seed(0)
    net = cct.Net(param, cct.TEST)
    rng = np.random.default_rng(0)
    for layer in net.layers:
        fill(layer, rng)
    prototxt = os.path.join(folder, f"{name}.prototxt")
    with open(prototxt, "w") as out:
        out.write(str(param))
    weights = os.path.join(folder, f"{name}.caffemodel")
    net.save(weights)
    return net, prototxt, weights, size


def fill(layer, rng):
    """He-scaled weights, small biases, sane BatchNorm statistics and Scale
    factors: activations keep their size through 50 layers."""
    if layer.type == "BatchNorm":
        mean, variance, factor = layer.blobs
        mean.data[...] = rng.normal(0, 0.1, mean.shape)
        variance.data[...] = rng.uniform(0.5, 1.5, variance.shape)
        factor.data[...] = 1.0
        return
    for index, blob in enumerate(layer.blobs):
        if blob.data.ndim > 1:
            fan_in = blob.count // blob.shape[0]
            blob.data[...] = rng.normal(0, (2.0 / fan_in) ** 0.5, blob.shape)
        elif layer.type == "Scale" and index == 0:
            blob.data[...] = rng.uniform(0.5, 1.5, blob.shape)
        else:
            blob.data[...] = rng.normal(0, 0.01, blob.shape)


def logits_layer(net):
    """The layer whose top the final Softmax reads: its output is compared
    (probabilities of random weights saturate to 0 and 1, which agree trivially)."""
    logits = net.bottom_names[net.layer_names[-1]][0]
    return next(name for name in net.layer_names if logits in net.top_names[name])


def run_cct(net, images, layer):
    net.blobs["data"].data[...] = images
    net.forward()
    return net.blobs[net.top_names[layer][0]].data


def run_opencv(cv_net, images, layer):
    cv_net.setInput(images)
    return cv_net.forward(layer)


# Before each timed forward: the other framework's worker threads (OpenBLAS's
# spin after a GEMM, OpenCV's pool) would otherwise still hold the cores.
# Without it, OpenCV right after cct measured 1.5x its time alone (GoogLeNet
# at batch 1: 54 against 37 ms), which flattered cct.
SETTLE_SECONDS = 0.5


def timed(function, *args, settle=SETTLE_SECONDS):
    time.sleep(settle)
    start = time.perf_counter()
    result = function(*args)
    return time.perf_counter() - start, result


def torch_caffenet(net):
    """CaffeNet's deploy net as a torch.nn.Sequential with `net`'s weights, up
    to fc8 (the logits), or None without PyTorch."""
    try:
        import torch
    except ImportError:
        return None
    nn = torch.nn
    lrn = dict(size=5, alpha=1e-4, beta=0.75, k=1.0)        # alpha / size, as Caffe's across channels
    layers = [nn.Conv2d(3, 96, 11, 4), nn.ReLU(), nn.MaxPool2d(3, 2, ceil_mode=True), nn.LocalResponseNorm(**lrn),
              nn.Conv2d(96, 256, 5, padding=2, groups=2), nn.ReLU(), nn.MaxPool2d(3, 2, ceil_mode=True),
              nn.LocalResponseNorm(**lrn), nn.Conv2d(256, 384, 3, padding=1), nn.ReLU(),
              nn.Conv2d(384, 384, 3, padding=1, groups=2), nn.ReLU(), nn.Conv2d(384, 256, 3, padding=1, groups=2),
              nn.ReLU(), nn.MaxPool2d(3, 2, ceil_mode=True), nn.Flatten(), nn.Linear(9216, 4096), nn.ReLU(),
              nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 1000)]
    learned = [layer for layer in layers if isinstance(layer, (nn.Conv2d, nn.Linear))]
    names = ["conv1", "conv2", "conv3", "conv4", "conv5", "fc6", "fc7", "fc8"]
    with torch.no_grad():
        for layer, name in zip(learned, names):
            weight, bias = net.params[name]
            layer.weight.copy_(torch.from_numpy(weight.data.reshape(layer.weight.shape)))
            layer.bias.copy_(torch.from_numpy(bias.data))
    return nn.Sequential(*layers).eval()


def run_torch(model, images, layer):
    import torch
    with torch.no_grad():
        return model(torch.from_numpy(images)).numpy()


def compare(name, batch, rounds, folder, settle=SETTLE_SECONDS):
    import cv2
    if not hasattr(cv2.dnn, "readNetFromCaffe"):
        sys.exit(f"OpenCV {cv2.__version__} has no Caffe importer (OpenCV 5 dropped it): "
                 "install a 4.x wheel as the docstring says")
    net, prototxt, weights, size = cct_net(name, batch, folder)
    cv_net = cv2.dnn.readNetFromCaffe(prototxt, weights)
    images = np.random.default_rng(1).normal(0, 50, (batch, 3, size, size)).astype(np.float32)
    layer = logits_layer(net)
    ours, theirs = run_cct(net, images, layer).copy(), run_opencv(cv_net, images, layer)     # warm both
    agreement = {"opencv": _agreement(ours, theirs)}
    runs = {"cct": (run_cct, net), "opencv": (run_opencv, cv_net)}
    model = torch_caffenet(net) if name == "caffenet" else None
    if model is not None:
        agreement["torch"] = _agreement(ours, run_torch(model, images, layer))
        runs["torch"] = (run_torch, model)
    times = {key: [] for key in runs}
    for _ in range(rounds):
        for key, (run, subject) in runs.items():
            times[key].append(timed(run, subject, images, layer, settle=settle)[0])
    medians = {key: 1e3 * statistics.median(values) for key, values in times.items()}
    return medians, agreement, times


def _paired_spread(ours, theirs):
    """The quartiles of cct's time over the other's, round by round: how far
    the host's noise moves the ratio the medians give."""
    ratios = sorted(a / b for a, b in zip(ours, theirs))
    if len(ratios) < 4:
        return f"{ratios[0]:.2f}-{ratios[-1]:.2f}"
    quartiles = statistics.quantiles(ratios, n=4)
    return f"{quartiles[0]:.2f}-{quartiles[2]:.2f}"


def _agreement(ours, theirs):
    """The largest difference over the largest value of theirs."""
    return float(np.abs(ours.reshape(theirs.shape) - theirs).max() / max(1e-30, np.abs(theirs).max()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nets", default="caffenet,googlenet,resnet50")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--settle", type=float, default=SETTLE_SECONDS,
                        help="seconds of pause before each timed forward")
    args = parser.parse_args()
    import cv2
    from threadpoolctl import threadpool_limits
    cv2.setNumThreads(args.threads)
    threadpool_limits(args.threads, "blas")
    p = common.print_flush
    p(common.machine_line())
    p(f"OpenCV {cv2.__version__}, {cv2.getNumThreads()} threads")
    try:
        import torch
        torch.set_num_threads(args.threads)
        p(f"PyTorch {torch.__version__}, {torch.get_num_threads()} threads (CaffeNet)")
    except ImportError:
        p("PyTorch: not importable, CaffeNet without it")
    with tempfile.TemporaryDirectory() as folder:
        for name in args.nets.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                medians, agreement, times = compare(name, batch, args.rounds, folder, args.settle)
                line = (f"{name} batch {batch}: cct {medians['cct']:.1f} ms, OpenCV DNN {medians['opencv']:.1f} ms, "
                        f"cct / OpenCV time {medians['cct'] / medians['opencv']:.2f}")
                if "torch" in medians:
                    line += (f"; PyTorch {medians['torch']:.1f} ms, cct / PyTorch time "
                             f"{medians['cct'] / medians['torch']:.2f}")
                agree = ", ".join(f"{key} {value:.1e}" for key, value in agreement.items())
                p(f"{line}; logits agree to ({agree}) of the largest")
                spread = ", ".join(f"/ {label} {_paired_spread(times['cct'], times[key])}"
                                   for key, label in (("opencv", "OpenCV"), ("torch", "PyTorch")) if key in times)
                p(f"  cct's time round by round (quartiles): {spread}")
    p(f"load after the runs: {common.load_average():.2f}")


if __name__ == "__main__":
    main()
