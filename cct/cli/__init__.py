"""The `cct` command line: Caffe's `caffe` tool and its companions as a table
of subcommands.

    cct train --solver=solver.prototxt [--weights=a.caffemodel,b.caffemodel | --snapshot=x.solverstate]
    cct test --model=net.prototxt --weights=net.caffemodel [--iterations=50]
    cct time --model=net.prototxt [--iterations=50]
    cct device_query
    cct convert_imageset ... | compute_image_mean ... | compare ...
    cct upgrade_net_proto_text IN OUT | upgrade_net_proto_binary IN OUT | upgrade_solver_proto_text IN OUT
    cct parse_log LOG OUTDIR | plot_training_log LOG OUT.png
    cct draw NET.prototxt OUT.png [--rankdir=LR] [--phase=ALL|TRAIN|TEST] [--display_lrm]

Flags are taken in gflags' spellings too (`-solver x`, `-solver=x`,
`--solver x`, `--solver=x`). Every error cct raises on purpose ends the run
with one line, `cct: error: ...`, and exit status 1. Log lines look like
glog's, `I1122 13:56:01.123456 solver] Iteration 100, loss = 0.3`, which is
what `cct parse_log` reads.
"""
import argparse
import logging
import re
import sys
import traceback
from datetime import datetime

from cct.core.errors import CctError
from cct.cli import train, time, tools  # noqa: F401  (each registers its commands; --help lists them in this order)
from cct.cli.commands import COMMANDS
from cct.training import distributed

log = logging.getLogger("cct.cli")


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
    try:
        status = _main(argv)
    except BaseException:
        if distributed.running() is not None:
            traceback.print_exc()
            _end_every_rank(1)
        raise
    if status and distributed.running() is not None:
        _end_every_rank(status)
    return status


def _end_every_rank(status):
    """A rank of an MPI run failed: end them all, or the others would wait
    for it in their next collective forever."""
    sys.stderr.flush()
    distributed.running().abort(status)


def _main(argv):
    logger, handler, previous_level = _install_log_handler(sys.stderr)
    try:
        if argv and argv[0] in COMMANDS and COMMANDS[argv[0]][2] is None:
            return COMMANDS[argv[0]][0](argv[1:]) or 0
        args = build_parser().parse_args(normalize_flags(argv))
        return args.function(args) or 0
    except (CctError, OSError) as error:
        world = distributed.running()
        where = f"MPI rank {world.rank} of {world.size}: " if world is not None else ""
        print(f"cct: error: {where}{_one_line(error)}", file=sys.stderr)
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

