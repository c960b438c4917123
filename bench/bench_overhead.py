"""What cct's forward costs beyond the arithmetic, per layer: TEST-phase nets
of many layers on a 1 x 4 x 2 x 2 blob, where the arithmetic is next to
nothing, timed forward after forward (median, microseconds per layer or per
block). Kinds:

    relu      ReLUs, each with its own top (no fusion applies)
    conv      1x1 convolutions, 4 -> 4 channels
    pool      1x1 max poolings
    block     Convolution + BatchNorm + Scale + ReLU in place (ResNet's unit,
              one fused run after the convolution)
    residual  ResNet's identity block: a Split, a convolution + BatchNorm +
              Scale on one branch, an Eltwise sum with the other and a ReLU

plus ResNet-50 and GoogLeNet at batch 1 on 32 x 32 images (their global
pooling made global), where the per-layer costs are a large part of a
forward: ms per forward.

    python bench/bench_overhead.py [--kinds relu,conv,pool,block,residual] [--layers 50] [--repeats 300] [--nets resnet50,googlenet] [--backward]

--backward times forward + backward of the same nets built for TRAIN with
force_backward (every layer's backward runs, the input's gradient too).
--stub replaces every layer's forward (and, where the tree has them, its
bound forward) and the fused passes with calls that do nothing: what is left
of a forward is the runtime's own cost, in any revision.

Run one revision against another by putting an install of the other first on
PYTHONPATH (pip install --no-deps --target DIR REV's checkout), in turns.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

INPUT = 'layer { name: "data" type: "Input" top: "b0" input_param { shape { dim: 1 dim: 4 dim: 2 dim: 2 } } }\n'
CONV = ('layer {{ name: "{name}" type: "Convolution" bottom: "{bottom}" top: "{top}" convolution_param {{ '
        'num_output: 4 kernel_size: 1 bias_term: false weight_filler {{ type: "gaussian" std: 0.5 }} }} }}\n')
BN_SCALE = ('layer {{ name: "bn{i}" type: "BatchNorm" bottom: "{blob}" top: "{blob}" '
            'batch_norm_param {{ use_global_stats: true }} }}\n'
            'layer {{ name: "sc{i}" type: "Scale" bottom: "{blob}" top: "{blob}" scale_param {{ bias_term: true }} }}\n')


def unit(kind, i):
    """(prototxt of unit i, its layer count): it reads b{i} and writes b{i+1}."""
    bottom, top = f"b{i}", f"b{i + 1}"
    if kind == "relu":
        return f'layer {{ name: "r{i}" type: "ReLU" bottom: "{bottom}" top: "{top}" }}\n', 1
    if kind == "conv":
        return CONV.format(name=f"c{i}", bottom=bottom, top=top), 1
    if kind == "pool":
        return (f'layer {{ name: "p{i}" type: "Pooling" bottom: "{bottom}" top: "{top}" '
                'pooling_param { pool: MAX kernel_size: 1 stride: 1 } }\n'), 1
    if kind == "block":
        return (CONV.format(name=f"c{i}", bottom=bottom, top=top) + BN_SCALE.format(i=i, blob=top)
                + f'layer {{ name: "r{i}" type: "ReLU" bottom: "{top}" top: "{top}" }}\n'), 4
    if kind == "residual":     # the net inserts the Split: b{i} is read twice
        branch = f"branch{i}"
        return (CONV.format(name=f"c{i}", bottom=bottom, top=branch) + BN_SCALE.format(i=i, blob=branch)
                + f'layer {{ name: "sum{i}" type: "Eltwise" bottom: "{bottom}" bottom: "{branch}" top: "{top}" }}\n'
                + f'layer {{ name: "r{i}" type: "ReLU" bottom: "{top}" top: "{top}" }}\n'), 6
    raise SystemExit(f"unknown kind {kind!r}: relu, conv, pool, block, residual")


def stub_kernels():
    """Every layer's forward, bound forward and fused pass does nothing."""
    from cct.core.layer import LAYER_TYPES
    from cct.runtime import fusion

    def nothing(self, bottom, top):
        pass

    def bound_nothing(self, bottom, top, output_relu=None):
        return lambda: None
    for cls in LAYER_TYPES.values():
        cls.forward = nothing
        if hasattr(cls, "bind_forward"):
            cls.bind_forward = bound_nothing
    fusion._execute = lambda prepared, threads: None


def tiny_net(kind, units, backward=False):
    import cct
    import numpy as np
    head = 'name: "overhead"\n' + ("force_backward: true\n" if backward else "")
    net = cct.Net(head + INPUT + "".join(unit(kind, i)[0] for i in range(units)), cct.TRAIN if backward else cct.TEST)
    for layer in net.layers:
        if layer.type == "BatchNorm":
            layer.blobs[1].data[...] = 1.0             # variance
            layer.blobs[2].data[...] = 1.0             # the moving average's factor
    net.blobs["b0"].data[...] = np.random.default_rng(0).normal(size=net.blobs["b0"].shape)
    return net


def per_forward(net, repeats, backward=False):
    run = net.forward_backward if backward else net.forward
    for _ in range(20):
        run()
    from cct.devices import jit
    if hasattr(jit, "warmed_up"):        # (an install from before it times with numba's start-up beside)
        jit.warmed_up()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def small_image_net(name):
    """A deploy net at batch 1 on 32 x 32 images, global pooling made global."""
    import cct
    import numpy as np
    import bench_deploy
    from cct.formats.prototxt import read_net
    model, _ = bench_deploy.DEPLOY[name]
    param = read_net(os.path.join(common.REPO, "models", model, "deploy.prototxt"))
    dims = param.layer[0].input_param.shape[0].dim
    dims[0], dims[2], dims[3] = 1, 32, 32
    for layer in param.layer:
        if layer.type == "Pooling" and layer.pooling_param.kernel_size == 7:
            layer.pooling_param.ClearField("kernel_size")
            layer.pooling_param.global_pooling = True
    net = cct.Net(param, cct.TEST)
    rng = np.random.default_rng(0)
    for layer in net.layers:
        bench_deploy.fill(layer, rng)
    net.blobs["data"].data[...] = rng.normal(0, 50, net.blobs["data"].shape)
    return net


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default="relu,conv,pool,block,residual")
    parser.add_argument("--layers", type=int, default=50, help="units of each kind")
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--nets", default="resnet50,googlenet", help="'' for none")
    parser.add_argument("--backward", action="store_true", help="forward + backward of TRAIN nets")
    parser.add_argument("--stub", action="store_true", help="every compute kernel replaced by a call doing nothing")
    args = parser.parse_args()
    import cct
    p = common.print_flush
    p(common.machine_line())
    p(f"cct from {os.path.dirname(cct.__file__)}")
    if args.stub:
        stub_kernels()
        p("every layer's forward and fused pass stubbed out")
    for kind in args.kinds.split(","):
        if not kind:
            continue
        net = tiny_net(kind, args.layers, args.backward)
        seconds = per_forward(net, args.repeats, args.backward)
        size = unit(kind, 0)[1]
        what = "layer" if size == 1 else f"block of {size} layers"
        passes = "forward + backward" if args.backward else "forward"
        p(f"{kind}: {seconds / args.layers * 1e6:.1f} us per {what} ({passes}, {len(net.layers)} layers)")
    for name in filter(None, args.nets.split(",")):
        net = small_image_net(name)
        p(f"{name} at batch 1, 32 x 32: {per_forward(net, max(30, args.repeats // 5)) * 1e3:.2f} ms per forward "
          f"({len(net.layers)} layers)")
    p(f"load after the runs: {common.load_average():.2f}")


if __name__ == "__main__":
    main()
