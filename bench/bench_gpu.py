"""Issue 13's figures on a machine with a real OpenCL GPU (the lent NVIDIA
one; bench/run_on_device.sh sets up its OpenCL driver and the wheels first),
in one run:

- the device: name, compute units, memory, and CLBlast's SGEMM GFLOP/s at
  512^3 to 4096^3, beside the host's BLAS peak measured in the same run;
- CaffeNet training (models/bvlc_reference_caffenet/train_synthetic.prototxt,
  its DummyData replaced by Input blobs filled once, SGD with momentum):
  images/s on the host alone (all its cores), on the device alone, and
  hybrid (the FLOPS rule's split, cct.runtime.hybrid, measured afresh), and
  which layers ran where;
- Caffe con Troll's conv1 sweep: CaffeNet's conv1 forward and backward at
  device shares 0, 0.05, ..., 1, where the FLOPS rule lands, the best swept
  share and the ideal 1/(1/T_host + 1/T_device) (bench_hybrid.sweep);
- PyTorch CUDA on the same CaffeNet in the same run (a subprocess), for
  scale, when torch sees a CUDA device.

    python bench/bench_gpu.py [--batch 256] [--iterations 4] [--conv1_batch 256]
                              [--repeats 3] [--device 0] [--json out.json] [--no-torch]

Runs on pocl too (small batches), which is how it is checked without a GPU.
"""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

CONV1 = """name: "conv1" force_backward: true
layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ dim: {batch} dim: 3 dim: 227 dim: 227 }} }} }}
layer {{ name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param {{ num_output: 96 kernel_size: 11 stride: 4
                             weight_filler {{ type: "gaussian" std: 0.01 }} bias_filler {{ type: "constant" value: 0 }} }} }}
"""
p = common.print_flush


def describe(device):
    from cct.devices.query import describe_opencl_device, measured_gflops
    lines = describe_opencl_device(device.index)
    rates = {size: measured_gflops(device, size) for size in (512, 1024, 2048, 4096)}
    for line in lines:
        p("  " + line)
    p("  CLBlast SGEMM GFLOP/s: " + ", ".join(f"{size}^3 {rate:.0f}" for size, rate in rates.items()))
    host_peak = common.gemm_peak()
    p(f"  host BLAS SGEMM peak (2048^3): {host_peak:.0f} GFLOP/s")
    return {"device": lines, "clblast_gflops": rates, "host_gflops": host_peak}


def caffenet_modes(device, batch, iterations):
    """CaffeNet training steps on the host, on the device and hybrid, one solver."""
    from cct.runtime import profile, settings
    param, inputs = common.net_param_with_inputs(common.CAFFENET, batch)
    solver = common.sgd_solver(param)
    net = solver.net
    common.fill_inputs(net, inputs)
    flops = sum(f + b for f, b in profile.net_flops(net))

    def step():
        solver.step(1)
        device.finish()
    results = {}
    for mode, device_mode, hybrid in (("host", "cpu", False), ("device", "gpu", False), ("hybrid", "gpu", True)):
        settings.set_mode(device_mode)
        settings.set_hybrid(hybrid)
        net.executor.hybrid = {}
        start = time.perf_counter()
        step()                                   # a whole forward at these shapes: the hybrid plan follows it
        step()
        warmup = time.perf_counter() - start
        median, times = common.time_loop(step, iterations, warmup=0)
        placed = dict(net.executor.placed) if device_mode == "gpu" else {}
        results[mode] = {"seconds": median, "times": times, "images_per_s": batch / median,
                         "gflops": flops / median / 1e9, "warmup_seconds": warmup,
                         "plan": {net.layers[i].name: s for i, s in net.executor.hybrid.items()},
                         "placed": {net.layers[i].name: where for i, where in placed.items()}}
        p(f"  {mode:7s} {1e3 * median:8.1f} ms/iteration, {batch / median:8.1f} images/s, "
          f"{flops / median / 1e9:8.0f} GFLOP/s (times {', '.join(f'{t:.3f}' for t in times)} s; "
          f"first two steps {warmup:.1f} s)")
    settings.set_hybrid(None)
    for mode in ("device", "hybrid"):
        placed = results[mode]["placed"]
        on_host = [name for name, where in placed.items() if where == "host"]
        p(f"  {mode}: layers on the host: {', '.join(on_host) or 'none'}")
    plan = results["hybrid"]["plan"]
    p("  hybrid plan (device share per layer): " + (", ".join(f"{k} {v:.3f}" for k, v in plan.items()) or "none"))
    host, on_device = results["host"]["seconds"], results["device"]["seconds"]
    ideal = 1 / (1 / host + 1 / on_device)
    p(f"  ideal 1/(1/T_host + 1/T_device) = {1e3 * ideal:.1f} ms; hybrid / ideal "
      f"{results['hybrid']['seconds'] / ideal:.3f}, hybrid / device alone "
      f"{results['hybrid']['seconds'] / on_device:.3f}")
    results["ideal_seconds"] = ideal
    return results


def conv1_sweep(device, batch, repeats):
    from bench_hybrid import layer_case
    from cct.runtime import settings
    settings.set_mode("gpu")
    result = layer_case(device, CONV1, "conv1", batch, repeats)
    result["times"] = {str(share): seconds for share, seconds in result["times"].items()}
    return result


TORCH_CHILD = """
import json, sys, time, statistics
sys.path.insert(0, {bench!r})
import torch
from bench_caffenet import torch_caffenet
batch, iterations = {batch}, {iterations}
if not torch.cuda.is_available():
    print(json.dumps(None)); sys.exit(0)
cuda = torch.device("cuda")
torch.manual_seed(0)
model = torch_caffenet(torch).train().to(cuda)
data = torch.randn((batch, 3, 227, 227), device=cuda)
labels = torch.randint(0, 1000, (batch,), device=cuda)
optimizer = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9, weight_decay=5e-4)
loss_function = torch.nn.CrossEntropyLoss()
def step():
    optimizer.zero_grad(set_to_none=False)
    loss_function(model(data), labels).backward()
    optimizer.step()
    torch.cuda.synchronize()
for _ in range(3):
    step()
times = []
for _ in range(max(iterations, 10)):
    start = time.perf_counter(); step(); times.append(time.perf_counter() - start)
median = statistics.median(times)
print(json.dumps({{"framework": f"torch {{torch.__version__}} CUDA ({{torch.cuda.get_device_name()}})",
                  "seconds": median, "images_per_s": batch / median,
                  "tf32": torch.backends.cuda.matmul.allow_tf32, "cudnn_tf32": torch.backends.cudnn.allow_tf32}}))
"""


def torch_cuda(batch, iterations):
    code = TORCH_CHILD.format(bench=os.path.dirname(os.path.abspath(__file__)), batch=batch, iterations=iterations)
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        p("  torch: timed out")
        return None
    if done.returncode != 0:
        last_line = (done.stderr.strip().splitlines() or ["no message"])[-1]
        p(f"  torch: failed: {last_line}")
        return None
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result is None:
        p("  torch: no CUDA device")
    else:
        p(f"  {result['framework']}: {1e3 * result['seconds']:.1f} ms/iteration, "
          f"{result['images_per_s']:.0f} images/s (TF32: matmul {result['tf32']}, cuDNN {result['cudnn_tf32']})")
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256, help="CaffeNet's training batch")
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--conv1_batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per swept share")
    parser.add_argument("--device", type=int, default=0, help="the OpenCL device id")
    parser.add_argument("--json", help="write every figure here too")
    parser.add_argument("--no-torch", action="store_true")
    args = parser.parse_args()
    from cct.devices import opencl
    from cct.devices.base import DeviceError
    from cct.runtime import settings
    p(common.machine_line())
    settings.set_device_ids([args.device])
    report = {"machine": common.machine_line()}
    try:
        device = opencl.device(args.device)
    except DeviceError as error:                # say what is missing; PyTorch's figure still helps
        p(f"no OpenCL device {args.device}: {error}")
        if not args.no_torch:
            torch_cuda(args.batch, args.iterations)
        return 1

    def save(section, value):                    # after each section: a run cut short keeps what it measured
        report[section] = value
        if args.json:
            with open(args.json, "w") as out:
                json.dump(report, out, indent=1, default=str)
    p(f"\nOpenCL device {args.device}:")
    save("describe", describe(device))
    p(f"\nCaffeNet training, batch {args.batch}:")
    save("caffenet", caffenet_modes(device, args.batch, args.iterations))
    if not args.no_torch:
        save("torch", torch_cuda(args.batch, args.iterations))
        if report["torch"]:
            p(f"  cct device alone / torch CUDA images/s: "
              f"{report['caffenet']['device']['images_per_s'] / report['torch']['images_per_s']:.3f}")
    save("conv1", conv1_sweep(device, args.conv1_batch, args.repeats))


if __name__ == "__main__":
    sys.exit(main())
