"""The `cct` command line: Caffe's `caffe` tool and its companions as a table
of subcommands.

    cct train --solver=solver.prototxt [--weights=a.caffemodel,b.caffemodel | --snapshot=x.solverstate]
    cct test --model=net.prototxt --weights=net.caffemodel [--iterations=50]
    cct time --model=net.prototxt [--iterations=50]
    cct device_query
    cct convert_imageset ... | compute_image_mean ... | compare ...
    cct upgrade_net_proto_text IN OUT | upgrade_net_proto_binary IN OUT | upgrade_solver_proto_text IN OUT
    cct parse_log LOG OUTDIR | plot_training_log LOG OUT.png

Flags are taken in gflags' spellings too (`-solver x`, `-solver=x`,
`--solver x`, `--solver=x`). Every error cct raises on purpose ends the run
with one line, `cct: error: ...`, and exit status 1. Log lines look like
glog's, `I1122 13:56:01.123456 solver] Iteration 100, loss = 0.3`, which is
what `cct parse_log` reads.
"""
import argparse
import logging
import os
import re
import signal
import sys
import time
from datetime import datetime

import numpy as np

from cct.core.errors import CctError, ConfigError

log = logging.getLogger("cct.cli")

COMMANDS = {}          # name -> (function, help, argparse specs, or None for a pass-through tool)


def command(name, help_text, passthrough=False):
    """Register `function(args)` (or `function(argv)` for a pass-through tool)."""
    def add(function):
        COMMANDS[name] = (function, help_text, None if passthrough else getattr(function, "arguments", ()))
        return function
    return add


def arguments(*specs):
    """Attach argparse specs: each spec is (flags tuple, kwargs)."""
    def attach(function):
        function.arguments = specs
        return function
    return attach


def flag(*names, **kwargs):
    return names, kwargs


LEVEL = flag("--level", type=int, default=0, help="net state level: layers' min_level/max_level rules")
STAGE = flag("--stage", default="", help="net state stages, comma separated: layers' stage/not_stage rules")
GPU = flag("--gpu", default=None, help="accepted for Caffe scripts; cct runs on the CPU")
PHASE = flag("--phase", default="", choices=("", "TRAIN", "TEST"),
             help="the phase to build the net in (default: TEST for test, TRAIN for time)")
EFFECTS = ("stop", "snapshot", "none")


# --- logging ---------------------------------------------------------------------------
class GlogFormatter(logging.Formatter):
    """`I1122 13:56:01.123456 solver] message`: level letter, month-day, time, module."""

    def format(self, record):
        stamp = datetime.fromtimestamp(record.created)
        module = record.name.rsplit(".", 1)[-1]
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        return f"{record.levelname[0]}{stamp:%m%d %H:%M:%S.%f} {module}] {message}"


def _install_log_handler(stream):
    logger = logging.getLogger("cct")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(GlogFormatter())
    logger.addHandler(handler)
    previous_level = logger.level
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    return logger, handler, previous_level


# --- flags ---------------------------------------------------------------------------------
def normalize_flags(argv):
    """gflags' single-dash long flags (`-solver x`, `-solver=x`) -> `--solver ...`.
    Single letters (`-h`) and negative numbers (`-1`) are left alone."""
    normalized = []
    for index, arg in enumerate(argv):
        if arg == "--":
            normalized.extend(argv[index:])
            break
        if re.match(r"^-[A-Za-z_][A-Za-z0-9_-]+(=.*)?$", arg, re.DOTALL):
            arg = "-" + arg
        normalized.append(arg)
    return normalized


def _stages(text):
    return [stage for stage in (text or "").split(",") if stage]


def _note_gpu(args):
    if getattr(args, "gpu", None) not in (None, "", "cpu"):
        log.info("--gpu=%s: cct runs on the CPU; the flag is ignored", args.gpu)


def _phase(args, default):
    from cct.core.layer import TEST, TRAIN
    return {"TRAIN": TRAIN, "TEST": TEST}.get(args.phase, default)


def _require(value, flag_name, message):
    if not value:
        raise ConfigError(f"{flag_name}: {message}")


# --- train -----------------------------------------------------------------------------------
@command("train", "train or fine-tune a model")
@arguments(
    flag("--solver", default="", help="the solver definition (prototxt)"),
    flag("--weights", default="", help="weights to fine-tune from, comma separated .caffemodel/.h5 files; "
                                       "not with --snapshot"),
    flag("--snapshot", default="", help="a .solverstate(.h5) to resume training from; not with --weights"),
    LEVEL, STAGE, GPU,
    flag("--sigint_effect", default="stop", choices=EFFECTS,
         help="what Ctrl-C (SIGINT) does: stop (and snapshot, if snapshot_after_train), snapshot, none"),
    flag("--sighup_effect", default="snapshot", choices=EFFECTS,
         help="what SIGHUP does: stop, snapshot (and go on), none"),
)
def train(args):
    from cct.training.solver import get_solver, load_solver_param
    from cct.proto import caffe_pb2
    _require(args.solver, "--solver", "need a solver definition to train")
    if args.snapshot and args.weights:
        raise ConfigError("--snapshot, --weights: give a snapshot to resume training or weights to "
                          "fine-tune, not both")
    _note_gpu(args)
    param = load_solver_param(args.solver)
    param.train_state.level = args.level
    param.train_state.stage.extend(_stages(args.stage))
    # As caffe.cpp: --snapshot or --weights replace the solver's own `weights:`.
    if args.snapshot or args.weights:
        param.ClearField("weights")
    if args.weights:
        param.weights.append(args.weights)
    if param.solver_mode == caffe_pb2.SolverParameter.GPU:
        log.info("solver_mode: GPU: cct runs on the CPU")
    # Nothing outside the run reads an activation's diff: share them (cct.runtime.memory).
    solver = get_solver(param, source=args.solver, share_diffs=True)
    with _signal_effects(solver, args.sigint_effect, args.sighup_effect):
        solver.solve(args.snapshot or None)
    return 0


class _signal_effects:
    """While training: SIGINT / SIGHUP ask the solver for their configured action."""

    def __init__(self, solver, sigint_effect, sighup_effect):
        self.effects = {signal.SIGINT: sigint_effect}
        if hasattr(signal, "SIGHUP"):
            self.effects[signal.SIGHUP] = sighup_effect
        self.solver = solver
        self.previous = {}

    def __enter__(self):
        for number, effect in self.effects.items():
            try:
                self.previous[number] = signal.signal(number, self._handler(effect))
            except ValueError:          # not the main thread: leave signals alone
                pass
        return self

    def _handler(self, effect):
        def handle(number, frame):
            log.info("%s received: %s", signal.Signals(number).name, effect)
            self.solver.request_action(effect)
        return handle

    def __exit__(self, *exc):
        for number, previous in self.previous.items():
            signal.signal(number, previous)
        return False


# --- test --------------------------------------------------------------------------------------
@command("test", "score a model: mean of every output over --iterations batches")
@arguments(
    flag("--model", default="", help="the net definition (prototxt)"),
    flag("--weights", default="", help="trained weights, comma separated .caffemodel/.h5 files"),
    flag("--iterations", type=int, default=50, help="number of batches to run"),
    PHASE, LEVEL, STAGE, GPU,
)
def test(args):
    from cct.core.layer import TEST
    from cct.core.net import Net
    from cct.core.progress import Progress
    _require(args.model, "--model", "need a model definition to score")
    _require(args.weights, "--weights", "need model weights to score")
    _check_iterations(args.iterations)
    _note_gpu(args)
    net = Net(args.model, _phase(args, TEST), level=args.level, stages=_stages(args.stage))
    for path in _stages(args.weights):
        net.copy_from(path)
    log.info("Running for %d iterations.", args.iterations)
    scores, names, loss = None, [], 0.0
    with Progress("test", args.iterations, "batches") as shown:
        for batch in shown.track(range(args.iterations)):
            loss += net._forward()
            values, names = [], []
            for name in net.outputs:
                for value in net.blobs[name].data.ravel():
                    log.info("Batch %d, %s = %s", batch, name, _fmt(value))
                    values.append(float(value))
                    names.append(name)
            scores = np.array(values) if scores is None else scores + values
    log.info("Loss: %s", _fmt(loss / args.iterations))
    for name, score in zip(names, scores / args.iterations):
        weight = net.blob_loss_weights.get(name, 0.0)
        suffix = f" (* {_fmt(weight)} = {_fmt(weight * score)} loss)" if weight else ""
        log.info("%s = %s%s", name, _fmt(score), suffix)
    return 0


def _fmt(value):
    return f"{value:.6g}"


def _check_iterations(iterations):
    if iterations <= 0:
        raise ConfigError(f"--iterations: must be > 0, got {iterations}")


# --- time --------------------------------------------------------------------------------------
def layer_report(layer, forward_ms=None, backward_ms=None):
    """Extra columns for a layer's Caffe-format line in `cct time`; "" adds none
    (the profile table after those lines carries cct's own columns)."""
    return ""


@command("time", "benchmark a model's forward and backward, layer by layer")
@arguments(
    flag("--model", default="", help="the net definition (prototxt)"),
    flag("--weights", default="", help="optional weights, comma separated"),
    flag("--iterations", type=int, default=50, help="number of forward-backward passes to time"),
    flag("--tune", action="store_true",
         help="first choose each layer's batch partitions by measurement (net.executor.tune())"),
    flag("--peak_size", type=int, default=2048,
         help="square sgemm size for the GEMM peak measured at the start (0: skip it)"),
    PHASE, LEVEL, STAGE, GPU,
)
def time_command(args):
    from cct.runtime import profile
    from cct.core.layer import TRAIN
    from cct.core.net import Net
    _require(args.model, "--model", "need a model definition to time")
    _check_iterations(args.iterations)
    if args.peak_size < 0:
        raise ConfigError(f"--peak_size: must be >= 0, got {args.peak_size}")
    _note_gpu(args)
    net = Net(args.model, _phase(args, TRAIN), level=args.level, stages=_stages(args.stage))
    for path in _stages(args.weights):
        net.copy_from(path)
    peak = None
    if args.peak_size:
        net.executor.finish()                   # all BLAS threads, as the layers get them
        peak = profile.gemm_peak(args.peak_size, repeats=3)
        log.info("GEMM peak: %.1f GFLOP/s (sgemm %d, %d BLAS threads)", peak, args.peak_size,
                 net.executor.threads)
    if args.tune:
        log.info("Tuning batch partitions")
        plan = net.executor.tune()
        log.info("Partitions: %s", ", ".join(f"{name}={p}" for name, p in plan.items()) or "no layer")
    log.info("Performing Forward")
    log.info("Initial loss: %s", _fmt(net._forward()))
    log.info("Performing Backward")
    net._backward()
    count = len(net.layers)
    forward_ms, backward_ms = np.zeros(count), np.zeros(count)
    log.info("*** Benchmark begins ***")
    log.info("Testing for %d iterations.", args.iterations)
    clock = time.perf_counter
    total_start = clock()
    for iteration in range(args.iterations):
        iteration_start = clock()
        for i in range(count):
            start = clock()
            net.executor.forward(i)
            forward_ms[i] += (clock() - start) * 1e3
        for i in reversed(range(count)):
            start = clock()
            # Caffe times every layer's Backward, needed or not (weight gradients of a
            # deploy net still count); bottoms that need no gradient still get none.
            net.executor.backward(i, force=True)
            backward_ms[i] += (clock() - start) * 1e3
        log.info("Iteration: %d forward-backward time: %s ms.", iteration + 1,
                 _fmt((clock() - iteration_start) * 1e3))
    total_ms = (clock() - total_start) * 1e3
    net.executor.finish()
    forward_ms /= args.iterations
    backward_ms /= args.iterations
    log.info("Average time per layer: ")
    for layer, fwd, bwd in zip(net.layers, forward_ms, backward_ms):
        for label, value in (("forward", fwd), ("backward", bwd)):
            extra = layer_report(layer, fwd, bwd) if label == "forward" else ""
            log.info("%10s\t%s: %s ms.%s", layer.name, label, _fmt(value), f"\t{extra}" if extra else "")
    log.info("Average Forward pass: %s ms.", _fmt(forward_ms.sum()))
    log.info("Average Backward pass: %s ms.", _fmt(backward_ms.sum()))
    log.info("Average Forward-Backward: %s ms.", _fmt(total_ms / args.iterations))
    log.info("Total Time: %s ms.", _fmt(total_ms))
    for line in profile_table(net, forward_ms, backward_ms, peak):
        log.info("%s", line)
    log.info("*** Benchmark ends ***")
    return 0


PROFILE_HEADER = ("layer", "type", "fwd ms", "bwd ms", "fwd GFLOP/s", "bwd GFLOP/s", "% peak",
                  "lowering", "partitions")


def profile_table(net, forward_ms, backward_ms, peak):
    """`cct time`'s profile: per layer its times, achieved GFLOP/s (cct.runtime.profile's
    counts), the share of the GEMM peak (forward and backward together), the
    lowering type of convolutions and the batch partitions; then the net's total."""
    from cct.runtime import profile
    flops = profile.net_flops(net, every_backward=True)

    def rate(count, ms):
        return count / ms / 1e6 if count and ms > 0 else None

    def cell(value, spec):
        return "-" if value is None else format(value, spec)

    rows = [PROFILE_HEADER]
    for i, layer in enumerate(net.layers):
        (fwd_flops, bwd_flops), fwd, bwd = flops[i], forward_ms[i], backward_ms[i]
        both = rate(fwd_flops + bwd_flops, fwd + bwd)
        rows.append((layer.name, layer.type, f"{fwd:.3f}", f"{bwd:.3f}", cell(rate(fwd_flops, fwd), ".1f"),
                     cell(rate(bwd_flops, bwd), ".1f"),
                     cell(100 * both / peak if both is not None and peak else None, ".0f"),
                     str(getattr(layer, "lowering_type", "-")), str(net.executor.partitions(i))))
    total_flops = sum(f + b for f, b in flops)
    total_ms = float(np.sum(forward_ms) + np.sum(backward_ms))
    total = rate(total_flops, total_ms)
    widths = [max(len(row[k]) for row in rows) for k in range(len(PROFILE_HEADER))]
    lines = ["Profile per layer" + (f" (GEMM peak {peak:.1f} GFLOP/s):" if peak else ":")]
    lines += ["  ".join(text.rjust(width) if k > 1 else text.ljust(width)
                        for k, (text, width) in enumerate(zip(row, widths))).rstrip() for row in rows]
    lines.append(f"Net: {total_flops / 1e9:.4g} GFLOP per forward-backward, "
                 + (f"{total:.1f} GFLOP/s" if total is not None else "- GFLOP/s")
                 + (f" = {100 * total / peak:.0f}% of the GEMM peak" if total is not None and peak else ""))
    return lines


# --- device_query ---------------------------------------------------------------------------
@command("device_query", "show the CPU, its BLAS and any OpenCL devices")
@arguments(GPU)
def device_query(args):
    import platform
    log.info("CPU: %s", _cpu_name() or platform.processor() or platform.machine())
    log.info("Cores: %s", os.cpu_count())
    if hasattr(os, "sched_getaffinity"):
        log.info("Usable cores: %d", len(os.sched_getaffinity(0)))
    log.info("numpy: %s", np.__version__)
    try:
        from threadpoolctl import threadpool_info
        pools = threadpool_info()
    except ImportError:
        pools = []
    for pool in pools:
        log.info("BLAS: %s %s (%s), %s threads, %s", pool.get("internal_api"), pool.get("version"),
                 pool.get("threading_layer", "?"), pool.get("num_threads"), pool.get("filepath"))
    if not pools:
        log.info("BLAS: none found by threadpoolctl")
    for line in _opencl_devices():
        log.info("%s", line)
    return 0


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _opencl_devices():
    try:
        import pyopencl
    except ImportError:
        return ["OpenCL: pyopencl not installed"]
    try:
        platforms = pyopencl.get_platforms()
    except Exception as error:        # no ICD loader / platform: a normal CPU-only machine
        return [f"OpenCL: no platform ({str(error).splitlines()[0] if str(error) else type(error).__name__})"]
    lines = []
    for platform_index, platform in enumerate(platforms):
        try:
            devices = platform.get_devices()
        except Exception:
            devices = []
        for device_index, device in enumerate(devices):
            lines.append(f"OpenCL device {platform_index}:{device_index}: {device.name.strip()} "
                         f"({platform.name.strip()}), {device.max_compute_units} compute units, "
                         f"{device.global_mem_size // 2**20} MiB")
    return lines or ["OpenCL: no devices"]


@command("digits", "write the embedded handwritten digits as LMDBs for models/lenet")
@arguments(flag("--out_dir", default="examples_out", help="folder for digits_{train,test}_lmdb"),
           flag("--train_count", type=int, default=10000, help="training images"),
           flag("--test_count", type=int, default=2000, help="test images"),
           flag("--seed", type=int, default=0, help="rendering seed"),
           flag("--overwrite", action="store_true", help="rewrite existing databases"))
def digits(args):
    from cct.data.digits import make_digits_lmdb
    for path in make_digits_lmdb(args.out_dir, args.train_count, args.test_count, args.seed, args.overwrite):
        log.info("wrote %s", path)
    return 0


# --- pass-through tools --------------------------------------------------------------------
@command("convert_imageset", "convert a list of images into an LMDB/LevelDB of Datums", passthrough=True)
def convert_imageset(argv):
    return _tool("cct.cli.datasets", "convert_imageset")(argv)


@command("compute_image_mean", "compute the mean image of a database into a .binaryproto",
         passthrough=True)
def compute_image_mean(argv):
    return _tool("cct.cli.datasets", "compute_image_mean")(argv)


@command("compare", "compare cct with reference outputs", passthrough=True)
def compare(argv):
    return _tool("cct.cli.compare", "main")(argv)


def _tool(module_name, function_name):
    """Import a companion tool only when its command runs."""
    import importlib
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise
        raise ConfigError(f"this cct install has no {module_name}, which this command "
                          "needs") from None
    return getattr(module, function_name)


# --- upgrades -------------------------------------------------------------------------------
IN_OUT = (flag("input", help="file to read"), flag("output", help="file to write"))


@command("upgrade_net_proto_text", "upgrade a net prototxt (V0/V1 layers, input fields) to the current format")
@arguments(*IN_OUT)
def upgrade_net_proto_text(args):
    from cct.formats.prototxt import read_text, write_text
    from cct.proto import caffe_pb2
    _upgrade_net(args, read_text(args.input, caffe_pb2.NetParameter()), write_text)
    return 0


@command("upgrade_net_proto_binary", "upgrade a binary net (.caffemodel) to the current format")
@arguments(*IN_OUT)
def upgrade_net_proto_binary(args):
    from cct.formats.prototxt import read_binary, write_binary
    from cct.proto import caffe_pb2
    _upgrade_net(args, read_binary(args.input, caffe_pb2.NetParameter()), write_binary)
    return 0


def _upgrade_net(args, net_param, write):
    from cct.formats.upgrade import upgrade_net
    upgraded = upgrade_net(net_param, source=args.input)
    if upgraded == net_param:
        log.info("%s: already in the latest format", args.input)
    write(upgraded, args.output)
    log.info("Wrote upgraded NetParameter to %s", args.output)


@command("upgrade_solver_proto_text", "upgrade a solver prototxt (solver_type enum -> type)")
@arguments(*IN_OUT)
def upgrade_solver_proto_text(args):
    from cct.formats.prototxt import read_solver, write_text
    from cct.formats.upgrade import upgrade_solver
    param = read_solver(args.input)
    upgraded = upgrade_solver(param, source=args.input)
    if upgraded == param:
        log.info("%s: already in the latest format", args.input)
    write_text(upgraded, args.output)
    log.info("Wrote upgraded SolverParameter to %s", args.output)
    return 0


# --- training logs --------------------------------------------------------------------------
@command("parse_log", "training log -> LOG.train and LOG.test tables (Caffe's parse_log.py)")
@arguments(
    flag("logfile", help="a log written by cct train (or caffe train)"),
    flag("output_dir", help="folder for <log name>.train and <log name>.test"),
    flag("--delimiter", default=",", help="column delimiter"),
)
def parse_log(args):
    from cct.cli.train_log import write_tables
    train_path, test_path = write_tables(args.logfile, args.output_dir, args.delimiter)
    log.info("Wrote %s and %s", train_path, test_path)
    return 0


@command("plot_training_log", "plot loss and accuracy against iterations (needs matplotlib)")
@arguments(
    flag("logfile", help="a log written by cct train (or caffe train)"),
    flag("output", help="the PNG to write"),
    flag("--x", default="iters", choices=("iters", "seconds"), help="the horizontal axis"),
)
def plot_training_log(args):
    from cct.cli.train_log import plot_training_log as plot
    plot(args.logfile, args.output, x=args.x)
    log.info("Wrote %s", args.output)
    return 0


# --- main -------------------------------------------------------------------------------------
def build_parser():
    parser = argparse.ArgumentParser(
        prog="cct", allow_abbrev=False,
        description="cct: Caffe con Troll in Python. Commands as Caffe's `caffe` tool and its companions.")
    commands = parser.add_subparsers(dest="command", metavar="command")
    commands.required = True
    for name, (function, help_text, specs) in COMMANDS.items():
        if specs is None:            # pass-through: listed here, parsed by the tool itself
            sub = commands.add_parser(name, help=help_text, add_help=False)
            sub.add_argument("rest", nargs=argparse.REMAINDER)
            continue
        sub = commands.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        for names, kwargs in specs:
            sub.add_argument(*names, **kwargs)
        sub.set_defaults(function=function)
    return parser


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    logger, handler, previous_level = _install_log_handler(sys.stderr)
    try:
        if argv and argv[0] in COMMANDS and COMMANDS[argv[0]][2] is None:
            return COMMANDS[argv[0]][0](argv[1:]) or 0
        args = build_parser().parse_args(normalize_flags(argv))
        return args.function(args) or 0
    except (CctError, OSError) as error:
        print(f"cct: error: {_one_line(error)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("cct: interrupted", file=sys.stderr)
        return 130
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous_level)


def _one_line(error):
    if isinstance(error, OSError) and error.filename and error.strerror:
        text = f"{error.filename}: {error.strerror}"
    else:
        text = str(error) or type(error).__name__
    return " ".join(text.split())

