"""The companion tools: device_query, digits, the dataset tools, compare, draw, the
upgrades and the training-log tools. The heavier ones import their module only
when they run."""
import logging
import os

import numpy as np

from cct.core import caffe_name
from cct.core.errors import ConfigError
from cct.devices import query
from cct.devices.base import DeviceError
from cct.cli.commands import GPU, arguments, command, flag

log = logging.getLogger("cct.cli")


# --- device_query ---------------------------------------------------------------------------
@command("device_query", "show the CPU, its BLAS, any OpenCL devices, and what `import caffe` gives; "
         "--gpu ID: that device's name, compute units, memory and measured GFLOP/s")
@arguments(GPU)
def device_query(args):
    """Caffe's device_query: with --gpu, the named OpenCL devices in detail
    (with a measured SGEMM rate); without, the host and every device."""
    if args.gpu not in (None, ""):
        from cct.runtime import settings
        for index in settings.parse_device_ids(args.gpu, "--gpu"):
            try:
                lines = query.describe_opencl_device(index)
            except DeviceError as error:
                raise ConfigError(f"--gpu: {error}") from None
            for line in lines:
                log.info("%s", line)
        return 0
    import platform
    log.info("CPU: %s", query.cpu_name() or platform.processor() or platform.machine())
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
    for line in query.opencl_devices():
        log.info("%s", line)
    log.info("import caffe: %s", caffe_name.caffe_import())
    return 0


# --- datasets -------------------------------------------------------------------------------
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


@command("draw", "draw a net as a graph of layers and blobs (Caffe's python/draw_net.py)")
@arguments(
    flag("input_net_proto_file", help="the net prototxt"),
    flag("output_image_file", help="the drawing, in the format its extension names (png, svg, pdf, ...); "
                                   ".raw writes graphviz's source"),
    flag("--rankdir", default="LR", choices=("LR", "TB", "BT", "RL"), help="the direction the graph runs"),
    flag("--phase", default="ALL", choices=("ALL", "TRAIN", "TEST"), help="draw only this phase's layers"),
    flag("--display_lrm", action="store_true", help="show each learning layer's lr_mult"),
)
def draw(args):
    from cct import draw as drawing          # pycaffe's caffe.draw, what draw_net.py calls
    from cct.core.layer import TEST, TRAIN
    log.info("Drawing net to %s", args.output_image_file)
    drawing.draw_net_to_file(args.input_net_proto_file, args.output_image_file, args.rankdir,
                             {"TRAIN": TRAIN, "TEST": TEST}.get(args.phase), args.display_lrm)
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
