"""The standard nets whole on the OpenCL device against the host: LeNet,
CIFAR-10 quick, CaffeNet, AlexNet, GoogLeNet, VGG-16 and ResNet-50 (the
deploy nets made train nets: labels and a SoftmaxWithLoss head; ResNet's
BatchNorm on batch statistics), their data layers replaced by Input blobs.
One training forward and backward of each on the host and on the device,
from the same weights, inputs and dropout masks; printed per net: the
largest error of any blob's data and diff and of any parameter gradient,
|device - host| / |host| over the whole array, the layers that fell back to
the host, and both times (the first device pass builds its kernels).

The weights are drawn afresh (He's scale, biases 0.1 * N(0, 1)): the
prototxts' own fillers leave a deploy net at zero (nothing to compare) and
put CaffeNet's conv5 around its bias of 1, where two outputs of one pooling
window differ in the 7th digit and the host's and the device's rounding
pick different maxima (seen: 2 of 86,528 gradients routed to the neighbour).

    python bench/check_device_nets.py [--batch 2] [--device 0] [--nets lenet,resnet50]

A check, not a benchmark. How far float32 results may move is measured,
not guessed: the host runs each net twice, every convolution lowered by
type 1 and then by type 3 (the same sums in another order), and the device
must stay within --factor (10) times the host's own difference, and
always within --floor (1e-5) in forward and --backward_floor (2e-2) in the
diffs and gradients. Deep nets with batch statistics on 2 images amplify
rounding (ResNet-50's last convolution moves by 1.4e-4 between the host's
two lowerings). A max pooling whose inputs tie to the 7th digit routes a
gradient to the other one where the rounding differs, and the difference
flows down: the host's two lowerings share one GEMM kernel and rarely do
that, the device's GEMM does (AlexNet: 9.2e-3 against the host's own
2.1e-6; with its poolings made average ones, 1.7e-6). Exit status 1 when a
net is outside; a wrong kernel is off by O(1).
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from bench_schedule import NETS, resnet50_train  # noqa: E402

MODELS = os.path.join(common.REPO, "models")
TRAIN_NETS = {**NETS,
              "cifar10_quick": (os.path.join(MODELS, "cifar10_quick", "cifar10_quick_train_test.prototxt"),
                                [(3, 32, 32), ()], 10),
              "alexnet": (os.path.join(MODELS, "bvlc_alexnet", "train_val.prototxt"), [(3, 227, 227), ()], 1000)}
ORDER = ["lenet", "cifar10_quick", "caffenet", "alexnet", "googlenet", "vgg16", "resnet50"]


def deploy_as_train(path, batch):
    """A deploy net with a label input and its last layer a SoftmaxWithLoss."""
    from cct.formats.prototxt import read_net
    param = read_net(path)
    source = param.layer[0]
    source.top.append("label")
    source.input_param.shape[0].dim[0] = batch
    source.input_param.shape.add().dim.append(batch)
    head = param.layer[-1]
    head.type, head.top[0] = "SoftmaxWithLoss", "loss"
    head.bottom.append("label")
    shape = tuple(source.input_param.shape[0].dim)
    return param, {"data": shape, "label": (batch,)}


def net_param(name, batch):
    if name == "resnet50":
        return resnet50_train(batch) + (1000,)
    if name == "vgg16":
        return deploy_as_train(os.path.join(MODELS, "vgg16", "deploy.prototxt"), batch) + (1000,)
    path, shapes, classes = TRAIN_NETS[name]
    param, inputs = common.net_param_with_inputs(path, batch, data_shapes=[(batch,) + s for s in shapes])
    return param, inputs, classes


def one_pass(net, seed):
    """A forward and backward from a fixed random state (Dropout's masks)."""
    from cct.core import rng
    rng.set_random_seed(seed)
    start = time.perf_counter()
    net.forward()
    net.backward()
    arrays = {f"{name} data": blob.data.copy() for name, blob in net.blobs.items()}
    arrays.update({f"{name} diff": blob.diff.copy() for name, blob in net.blobs.items()})
    arrays.update({f"{name}[{i}] gradient": p.diff.copy() for name, params in net.params.items()
                   for i, p in enumerate(params)})
    return arrays, time.perf_counter() - start


def draw_weights(net, seed=3):
    """Convolution and InnerProduct weights at He's scale, biases small."""
    rng = np.random.default_rng(seed)
    for layer in net.layers:
        if layer.type not in ("Convolution", "InnerProduct") or not layer.blobs:
            continue
        weights = layer.blobs[0]
        fan_in = weights.count // weights.shape[0]
        weights.data[...] = rng.standard_normal(weights.shape) * np.sqrt(2.0 / fan_in)
        for bias in layer.blobs[1:]:
            bias.data[...] = 0.1 * rng.standard_normal(bias.shape)


def relative_errors(on_device, on_host):
    """{key: |device - host| / |host|}, the norms over whole arrays; an array
    near zero (a bias before BatchNorm has a zero gradient in exact
    arithmetic, rounding noise here) is measured against a thousandth of the
    largest norm of its kind (data, diff, gradient) in the net instead."""
    norms = {key: float(np.linalg.norm(values)) for key, values in on_host.items()}
    largest = {}
    for key, norm in norms.items():
        kind = key.rsplit(" ", 1)[1]
        largest[kind] = max(largest.get(kind, 0.0), norm)
    errors = {}
    for key, expected in on_host.items():
        scale = max(norms[key], 1e-3 * largest[key.rsplit(" ", 1)[1]])
        errors[key] = float(np.linalg.norm(on_device[key] - expected)) / scale if scale else 0.0
    return errors


def worst_of(errors, forward):
    """The largest error among the blobs' data (forward) or the diffs and gradients."""
    chosen = {key: error for key, error in errors.items() if key.endswith(" data") == forward}
    key = max(chosen, key=lambda k: (not np.isfinite(chosen[k]), chosen[k]))
    return chosen[key], key


def host_pass(param, inputs, classes, lowering):
    """The net, its arrays after one pass on the host and the seconds, every
    convolution lowered by `lowering` (1 or 3: the same sums in another order)."""
    import cct
    from cct.runtime import settings
    settings.set_mode("cpu")
    os.environ[settings.LOWERING_ENV] = lowering
    try:
        net = cct.Net(param, cct.TRAIN)
    finally:
        del os.environ[settings.LOWERING_ENV]
    common.fill_inputs(net, inputs, classes=classes)
    draw_weights(net)
    return (net,) + one_pass(net, seed=7)


def check(name, batch, device):
    """(device's errors, the host's own under another lowering, the layers on
    the host, host seconds, device seconds); errors as (forward, backward)."""
    import cct
    from cct.core.settings import override
    from cct.runtime import settings
    param, inputs, classes = net_param(name, batch)
    host_net, on_host, host_seconds = host_pass(param, inputs, classes, "1")
    _, other_order, _ = host_pass(param, inputs, classes, "3")
    settings.set_mode("gpu")
    with override(device_masks=False):          # Dropout's masks: the host's draws, uploaded
        device_net = cct.Net(param, cct.TRAIN)
    for layer_name, params in host_net.params.items():
        for ours, theirs in zip(device_net.params[layer_name], params):
            ours.data[...] = theirs.data
    for blob_name in inputs:
        device_net.blobs[blob_name].data[...] = host_net.blobs[blob_name].data
    on_device, device_seconds = one_pass(device_net, seed=7)
    errors, own = relative_errors(on_device, on_host), relative_errors(other_order, on_host)
    fell_back = sorted({layer.type for i, layer in enumerate(device_net.layers)
                        if device_net.executor.placed.get(i) == "host" and layer.type != "Input"})
    return ((worst_of(errors, True), worst_of(errors, False)), (worst_of(own, True)[0], worst_of(own, False)[0]),
            fell_back, host_seconds, device_seconds)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--nets", default=",".join(ORDER))
    parser.add_argument("--factor", type=float, default=10.0,
                        help="the device may differ from the host this many times as much as the host does "
                             "from itself under another lowering")
    parser.add_argument("--floor", type=float, default=1e-5, help="and always this much in forward")
    parser.add_argument("--backward_floor", type=float, default=2e-2,
                        help="and in the diffs and gradients: max pooling's near-ties (see above)")
    args = parser.parse_args()
    from cct.devices import opencl
    from cct.runtime import settings
    settings.set_device_ids([args.device])
    device = opencl.device(args.device)
    common.print_flush(f"{common.machine_line()}\ndevice {args.device}: {device.name}; batch {args.batch}")
    failed = False
    for name in args.nets.split(","):
        (forward, backward), own, fell_back, host_seconds, device_seconds = check(name, args.batch, device)
        allowed = [max(args.factor * own[0], args.floor), max(args.factor * own[1], args.backward_floor)]
        failed |= not (forward[0] <= allowed[0] and backward[0] <= allowed[1])          # NaN fails too
        common.print_flush(f"  {name:14s} forward {forward[0]:.1e} ({forward[1]}; host's own {own[0]:.1e}), "
                           f"backward {backward[0]:.1e} ({backward[1]}; host's own {own[1]:.1e}); "
                           f"on the host: {', '.join(fell_back) or 'nothing'}; host {host_seconds:.2f} s, "
                           f"device {device_seconds:.2f} s (first pass)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
