"""The command table: `@command` registers a subcommand, `@arguments` its
flags (argparse specs made by `flag`); the flags and helpers several commands
share live here too."""
import logging

from cct.core.errors import ConfigError

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
GPU = flag("--gpu", default=None, help="run on OpenCL device(s): an id (0), several (0,1) or all; `cct "
                                      "device_query` lists them (default: the host, or CCT_GPU)")
HYBRID = flag("--hybrid", action="store_true",
              help="with --gpu: split each layer's batch between the host and the device in proportion to "
                   "their measured speed on it (Caffe con Troll's FLOPS rule; shares cached, or set by the run "
                   "configuration's \"hybrid\" entry)")
PHASE = flag("--phase", default="", choices=("", "TRAIN", "TEST"),
             help="the phase to build the net in (default: TEST for test, TRAIN for time)")
EFFECTS = ("stop", "snapshot", "none")
SCHEDULE = flag("--schedule", default="", choices=("", "sequential", "streams", "tuned", "auto"),
                help="how training runs: layer after layer, as sub-tasks on concurrent streams (the "
                     "same numbers), as streams with each sub-task's thread count profiled and co-running "
                     "(tuned: not bit-repeatable), or the fastest as measured (default: CCT_SCHEDULE, "
                     "the run configuration, auto)")


def apply_schedule(args):
    """--schedule, when given, for every net made from now on."""
    if args.schedule:
        from cct.runtime import settings
        settings.set_schedule(args.schedule)


MEMORY_LIMIT = flag("--memory_limit", default="",
                    help="refuse a net whose planned peak memory exceeds this (bytes, or with a unit: "
                         "512M, 4G, 2.5GiB; default: the machine's memory or its cgroup limit)")

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def apply_memory_limit(args):
    """--memory_limit, when given, for every net and array made from now on."""
    if not args.memory_limit:
        return
    text = args.memory_limit.strip().upper().replace("IB", "").rstrip("B")
    number, unit = (text[:-1], text[-1]) if text[-1:] in _UNITS else (text, "")
    try:
        nbytes = int(float(number) * _UNITS[unit])
    except ValueError:
        nbytes = 0
    if nbytes <= 0:
        raise ConfigError(f"--memory_limit: must be a positive size such as 4G or 512M, got {args.memory_limit!r}")
    from cct.core.allocation import set_memory_limit
    set_memory_limit(nbytes)


def stages(text):
    return [stage for stage in (text or "").split(",") if stage]


def apply_gpu(args):
    """--gpu, when given: layers run on that OpenCL device (set_mode_gpu and
    set_device); with several ids, or all, the first runs the layers and the
    list is what a hybrid split shares the batch among."""
    given = getattr(args, "gpu", None)
    from cct.runtime import settings
    if getattr(args, "hybrid", False):
        if given in (None, "", "cpu"):
            raise ConfigError("--hybrid: needs an OpenCL device to split with (--gpu ID)")
        settings.set_hybrid(True)
    if given in (None, ""):
        return
    if given == "cpu":
        settings.set_mode("cpu")
        return
    ids = settings.parse_device_ids(given, "--gpu")
    settings.set_device_ids(ids)                # gpu mode on the first, as set_mode_gpu
    device = settings.device()
    log.info("Using OpenCL device %d: %s%s", ids[0], device.name,
             f" (devices {','.join(map(str, ids))} for a hybrid split)" if len(ids) > 1 else "")


def phase(args, default):
    from cct.core.layer import TEST, TRAIN
    return {"TRAIN": TRAIN, "TEST": TEST}.get(args.phase, default)


def require(value, flag_name, message):
    if not value:
        raise ConfigError(f"{flag_name}: {message}")


def fmt(value):
    return f"{value:.6g}"


def check_iterations(iterations):
    if iterations <= 0:
        raise ConfigError(f"--iterations: must be > 0, got {iterations}")
