"""CaffeNet training speed: images/s, achieved GFLOP/s against the GEMM peak
measured in the same run, peak memory; and PyTorch on the same net when it is
importable (it is not a cct dependency).

    python bench/bench_caffenet.py [--batch 256] [--iterations 5] [--settle 16] [--tune] [--no-torch] [--share-diffs]

One iteration is cct.SGDSolver.step(1): forward, backward and the SGD update
(momentum 0.9, weight decay 5e-4), on models/bvlc_reference_caffenet/
train_synthetic.prototxt with its DummyData replaced by Input blobs filled once
(gaussian images, random labels), so the random fill is not timed. cct first
steps until its "auto" schedule has chosen (--settle): its first dozen or so
iterations take turns in the sequential, streams and tuned schedules to
measure them, and a training run keeps the one it chose. Each
framework runs in a fresh subprocess, so its peak RSS (VmHWM) is its own.
--share-diffs runs cct with CCT_SHARE_DIFFS=1 (cct.runtime.memory: blobs whose
gradients are never live together share one diff buffer).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def run_cct(args):
    import cct  # noqa: F401
    from cct.runtime import memory
    from cct.runtime import profile
    param, inputs = common.net_param_with_inputs(common.CAFFENET, args.batch)
    solver = common.sgd_solver(param)
    net = solver.net
    common.fill_inputs(net, inputs)
    shared = memory.summary(net)
    plan = None
    if args.tune:
        plan = net.executor.tune()
    flops = sum(f + b for f, b in profile.net_flops(net))
    settled = settle(solver, args.settle)
    median, times = common.time_loop(lambda: solver.step(1), args.iterations, args.warmup)
    layers = []
    if args.layers:
        forward, backward = common.layer_breakdown(net, args.layers)
        layers = [[layer.name, layer.type, f, b, fl, bl, net.executor.partitions(i)]
                  for i, (layer, f, b, (fl, bl)) in enumerate(zip(net.layers, forward, backward,
                                                                  profile.net_flops(net)))]
    return {"framework": "cct", "batch": args.batch, "seconds": median, "times": times, "layers": layers,
            "images_per_s": args.batch / median, "gflops": flops / median / 1e9, "settled": settled,
            "gflop_per_image": flops / args.batch / 1e9, "plan": plan,
            "peak_rss_mb": common.peak_rss_mb(),
            "share_diffs": None if shared is None else [str(shared), len(shared.arenas)]}


def settle(solver, limit):
    """Steps until the "auto" schedule has chosen (at most `limit`): before
    that, its iterations take turns in each schedule, so the timed ones would
    time its measuring, not what a training run keeps. A line that says which
    schedule the timed steps run in."""
    steps, schedule = 0, solver.net.executor.schedule
    if schedule != "auto":
        return f"{schedule} (set)"
    while steps < limit and solver.auto_choice() is None:
        solver.step(1)
        steps += 1
    chosen = solver.auto_choice()
    return f"{chosen}, auto's choice after {steps} steps" if chosen else f"auto, still measuring after {steps} steps"


def torch_caffenet(torch, classes=1000):
    """CaffeNet as torch modules: the layers, groups, pads and LRN settings of
    train_val.prototxt (torch's LocalResponseNorm divides alpha by size, as Caffe)."""
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, 96, 11, stride=4), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, ceil_mode=True),
        nn.LocalResponseNorm(5, alpha=1e-4, beta=0.75, k=1.0),
        nn.Conv2d(96, 256, 5, padding=2, groups=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, ceil_mode=True),
        nn.LocalResponseNorm(5, alpha=1e-4, beta=0.75, k=1.0),
        nn.Conv2d(256, 384, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(384, 384, 3, padding=1, groups=2), nn.ReLU(inplace=True),
        nn.Conv2d(384, 256, 3, padding=1, groups=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, ceil_mode=True),
        nn.Flatten(),
        nn.Linear(9216, 4096), nn.ReLU(inplace=True), nn.Dropout(0.5),
        nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(0.5),
        nn.Linear(4096, classes))


def torch_step_function(torch, model, batch, image_shape, classes):
    """A training step (forward, cross-entropy, backward, SGD with momentum and
    weight decay) on fixed random data; returns step()."""
    torch.manual_seed(0)
    data = torch.randn((batch,) + image_shape)
    labels = torch.randint(0, classes, (batch,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9, weight_decay=5e-4)
    loss_function = torch.nn.CrossEntropyLoss()

    def step():
        optimizer.zero_grad(set_to_none=False)
        loss = loss_function(model(data), labels)
        loss.backward()
        optimizer.step()
    return step


def run_torch(args):
    import torch
    torch.set_num_threads(args.threads or os.cpu_count())
    model = torch_caffenet(torch).train()
    step = torch_step_function(torch, model, args.batch, (3, 227, 227), 1000)
    median, times = common.time_loop(step, args.iterations, args.warmup)
    return {"framework": f"torch {torch.__version__}", "batch": args.batch, "seconds": median,
            "times": times, "images_per_s": args.batch / median, "threads": torch.get_num_threads(),
            "peak_rss_mb": common.peak_rss_mb()}


def child(args, framework):
    """Run one framework in a fresh process; its result dict."""
    flags = common.child_flags(args)
    if args.tune:
        flags.append("--tune")
    flags += ["--settle", args.settle]
    if args.layers:
        flags += ["--layers", args.layers]
    if not (framework == "cct" and args.share_diffs):
        return common.run_child(__file__, framework, flags)
    before = os.environ.get("CCT_SHARE_DIFFS")
    os.environ["CCT_SHARE_DIFFS"] = "1"              # the child's solver shares its train net's diffs
    try:
        return common.run_child(__file__, framework, flags)
    finally:
        if before is None:
            del os.environ["CCT_SHARE_DIFFS"]
        else:
            os.environ["CCT_SHARE_DIFFS"] = before


def main(argv=None):
    parser = common.framework_parser(__doc__, batch=256, iterations=5, warmup=1)
    parser.add_argument("--tune", action="store_true", help="run net.executor.tune() first and print its plan")
    parser.add_argument("--layers", type=int, default=0,
                        help="then time each layer over this many passes and print the breakdown")
    parser.add_argument("--settle", type=int, default=16,
                        help="first, at most this many steps until the auto schedule has chosen (0: none)")
    parser.add_argument("--share-diffs", action="store_true",
                        help="cct shares diff buffers between blobs never live together (CCT_SHARE_DIFFS=1)")
    args = parser.parse_args(argv)
    if common.serve_child(args, run_cct, run_torch):
        return 0
    p = common.print_flush
    p(common.machine_line())
    peak = common.gemm_peak()
    p(f"GEMM peak (sgemm 2048, best of 5): {peak:.1f} GFLOP/s")
    cct_result = child(args, "cct")
    torch_result = None
    if not args.no_torch and common.torch_available():
        torch_result = child(args, "torch")
    peak_after = common.gemm_peak()
    p(f"GEMM peak after the runs: {peak_after:.1f} GFLOP/s (load {common.load_average():.2f})")
    peak = max(peak, peak_after)
    r = cct_result
    if r["plan"]:
        p("tuned plan (partitions per layer): " + ", ".join(f"{k}={v}" for k, v in r["plan"].items()))
    p(f"cct schedule timed: {r['settled']}")
    p(f"cct CaffeNet training, batch {r['batch']}: {r['seconds'] * 1e3:.0f} ms/iteration "
      f"(times {', '.join(f'{t:.2f}' for t in r['times'])} s), {r['images_per_s']:.1f} images/s, "
      f"{r['gflop_per_image']:.2f} GFLOP/image, {r['gflops']:.1f} GFLOP/s = "
      f"{100 * r['gflops'] / peak:.0f}% of the GEMM peak; peak RSS {r['peak_rss_mb'] / 1024:.2f} GiB")
    if r["share_diffs"]:
        p(f"shared diffs: {r['share_diffs'][0]}")
    if r["layers"]:
        total = sum(f + b for _, _, f, b, _, _, _ in r["layers"])
        p(f"  {'layer':8s} {'type':16s} {'fwd ms':>9s} {'bwd ms':>9s} {'share':>6s} {'GFLOP/s':>8s} {'p':>2s}")
        for name, kind, forward, backward, f_flops, b_flops, partitions in r["layers"]:
            rate = (f_flops + b_flops) / (forward + backward) / 1e6 if f_flops and forward + backward else None
            p(f"  {name:8s} {kind:16s} {forward:9.1f} {backward:9.1f} {100 * (forward + backward) / total:5.1f}% "
              f"{'-' if rate is None else format(rate, '.1f'):>8s} {partitions:2d}")
        p(f"  layers total {total:.0f} ms; the rest of an iteration (solver update) "
          f"{r['seconds'] * 1e3 - total:.0f} ms")
    if torch_result:
        t = torch_result
        p(f"{t['framework']} ({t['threads']} threads), batch {t['batch']}: {t['seconds'] * 1e3:.0f} ms/iteration, "
          f"{t['images_per_s']:.1f} images/s, {r['gflop_per_image'] * t['images_per_s']:.1f} GFLOP/s = "
          f"{100 * r['gflop_per_image'] * t['images_per_s'] / peak:.0f}% of the GEMM peak; "
          f"peak RSS {t['peak_rss_mb'] / 1024:.2f} GiB")
        p(f"cct / torch: {r['images_per_s'] / t['images_per_s']:.2f}")
    elif not args.no_torch:
        p("torch: not importable, no comparison")
    return 0


if __name__ == "__main__":
    sys.exit(main())
