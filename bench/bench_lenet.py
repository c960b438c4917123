"""LeNet training iteration time at batch 64 (forward, backward, SGD update),
with a per-layer breakdown, the framework's per-layer overhead (a net of 20
tiny layers), and PyTorch on the same net when it is importable.

    python bench/bench_lenet.py [--batch 64] [--iterations 200] [--no-torch] [--pairs 1]

The net is models/lenet/lenet_train_test.prototxt (TRAIN phase) with its Data
layer replaced by Input blobs filled once (gaussian 1x28x28 images, labels 0..9).
Each framework runs in a fresh subprocess (no BLAS or OpenMP thread pools
competing with each other). --pairs K runs K (cct, torch) pairs of them one
after the other and prints each pair's ratio and the median ratio: on a
shared host one pair's two runs may meet different loads (PyTorch alone gave
14.4 to 19.7 ms in three runs of one hour here).
"""
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

LENET = os.path.join(common.REPO, "models", "lenet", "lenet_train_test.prototxt")


def lenet_solver(batch):
    param, inputs = common.net_param_with_inputs(LENET, batch, data_shapes=[(batch, 1, 28, 28), (batch,)])
    solver = common.sgd_solver(param, base_lr=0.01)
    common.fill_inputs(solver.net, inputs, classes=10)
    return solver


def overhead_net(layers=20):
    """`layers` in-place ReLUs on a 1x1 blob after an Input, then a Power loss
    so backward runs through all: what an iteration costs beyond the arithmetic."""
    import cct
    from cct.core.net import Net
    from cct.proto import caffe_pb2
    param = caffe_pb2.NetParameter(name="overhead")
    data = param.layer.add(name="data", type="Input", top=["x"])
    data.input_param.shape.add().dim.extend([1, 1])
    param.force_backward = True
    for k in range(layers - 2):
        param.layer.add(name=f"relu{k}", type="ReLU", bottom=["x"], top=["x"])
    param.layer.add(name="loss", type="EuclideanLoss", bottom=["x", "x"], top=["loss"])
    return Net(param, cct.TRAIN)


def run_cct(args):
    solver = lenet_solver(args.batch)
    median, times = common.time_loop(lambda: solver.step(1), args.iterations, args.warmup)
    forward, backward = common.layer_breakdown(solver.net, min(args.iterations, 50))
    net = overhead_net(20)
    net.forward_backward()
    overhead, _ = common.time_loop(net.forward_backward, 200, 10)
    return {"framework": "cct", "batch": args.batch, "ms": median * 1e3,
            "layers": [[layer.name, layer.type, f, b] for layer, f, b in zip(solver.net.layers, forward, backward)],
            "update_ms": median * 1e3 - forward.sum() - backward.sum(),
            "overhead_ms_per_layer": overhead * 1e3 / len(net.layers),
            "overhead_layers": len(net.layers)}


def run_torch(args):
    import torch
    torch.set_num_threads(args.threads or os.cpu_count())
    nn = torch.nn
    model = nn.Sequential(nn.Conv2d(1, 20, 5), nn.MaxPool2d(2, 2), nn.Conv2d(20, 50, 5), nn.MaxPool2d(2, 2),
                          nn.Flatten(), nn.Linear(800, 500), nn.ReLU(inplace=True), nn.Linear(500, 10)).train()
    torch.manual_seed(0)
    data, labels = torch.randn(args.batch, 1, 28, 28), torch.randint(0, 10, (args.batch,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    loss_function = nn.CrossEntropyLoss()

    def step():
        optimizer.zero_grad(set_to_none=False)
        loss_function(model(data), labels).backward()
        optimizer.step()
    median, _ = common.time_loop(step, args.iterations, args.warmup)
    return {"framework": f"torch {torch.__version__}", "batch": args.batch, "ms": median * 1e3,
            "threads": torch.get_num_threads()}


def child(args, framework):
    return common.run_child(__file__, framework, common.child_flags(args))


def main(argv=None):
    parser = common.framework_parser(__doc__, batch=64, iterations=200, warmup=10)
    parser.add_argument("--pairs", type=int, default=1, help="(cct, torch) runs one after the other (default 1)")
    args = parser.parse_args(argv)
    if common.serve_child(args, run_cct, run_torch):
        return 0
    p = common.print_flush
    p(common.machine_line())
    r = child(args, "cct")
    p(f"cct LeNet training iteration, batch {r['batch']}: {r['ms']:.2f} ms (median of {args.iterations})")
    p(f"  {'layer':8s} {'type':16s} {'fwd ms':>8s} {'bwd ms':>8s}")
    for name, kind, forward, backward in r["layers"]:
        p(f"  {name:8s} {kind:16s} {forward:8.3f} {backward:8.3f}")
    p(f"  update and solver bookkeeping (rest of the iteration): {r['update_ms']:.2f} ms")
    p(f"per-layer overhead (a {r['overhead_layers']}-layer net of 1x1 blobs, forward+backward): "
      f"{r['overhead_ms_per_layer'] * 1e3:.1f} us per layer")
    if not args.no_torch and common.torch_available():
        t = child(args, "torch")
        p(f"{t['framework']} ({t['threads']} threads): {t['ms']:.2f} ms; cct / torch time: {r['ms'] / t['ms']:.2f}")
        ratios = [r["ms"] / t["ms"]]
        for pair in range(2, args.pairs + 1):
            cct_ms, torch_ms = child(args, "cct")["ms"], child(args, "torch")["ms"]
            ratios.append(cct_ms / torch_ms)
            p(f"pair {pair}: cct {cct_ms:.2f} ms, torch {torch_ms:.2f} ms, cct / torch time {ratios[-1]:.2f}")
        if args.pairs > 1:
            p(f"cct / torch time over {args.pairs} pairs: median {statistics.median(ratios):.2f} "
              f"(range {min(ratios):.2f}-{max(ratios):.2f})")
    elif not args.no_torch:
        p("torch: not importable, no comparison")
    p(f"load after the runs: {common.load_average():.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
