"""Run settings: how to execute a net, kept out of the prototxt (and out of
caffe.proto). This module is the only reader of cct's environment variables
and of the run-configuration file, and the one place their precedence is
decided; the runtime pushes the results onto the layers (Layer.configure) and
the executor, so layers never read a global.

Environment variables:

    CCT_CONFIG              a run-configuration file (below)
    CCT_THREADS             threads for a net's layers (default: the BLAS count;
                            in one of several MPI ranks on a host, the host's
                            cores shared among them)
    CCT_PARTITIONS          p: every layer that allows it runs in p batch
                            partitions; 1: every layer whole
    CCT_LOWERING            1, 2 or 3: every convolution's lowering type
    CCT_LOWERING_BUDGET_MB  largest lowering workspace, MB (default 64)
    CCT_WINOGRAD            0, 2, 4 or auto: Winograd for convolutions whose net
                            never runs their backward (cct.lowering.winograd)
    CCT_SHARE_DIFFS         1 or 0: whether a solver's train net shares diffs
    CCT_CACHE_DIR           where the lowering chooser caches its measurements
    CCT_SCHEDULE            sequential, streams, tuned or auto: how a net runs its
                            backward (cct.runtime.scheduler)
    CCT_FUSION              1 or 0: whether TEST-phase nets run with
                            inference fusion (cct.runtime.fusion)
    CCT_GPU                 an OpenCL device id (or ids, 0,1): layers run on it
                            unless set_mode_cpu/set_mode_gpu said otherwise
    CCT_HYBRID              1 or 0: on a device, split each layer's batch between
                            the host and the device (cct.runtime.hybrid)
    CCT_MPI_OVERLAP         1 or 0: in data-parallel training over MPI, sum each
                            parameter's gradient while the layers below run
                            their backward, in the sequential schedule (default:
                            when the ranks span several hosts; the streams
                            schedules always do; cct.training.distributed)

The run configuration, a JSON file named by CCT_CONFIG or loaded with
`cct.runtime.settings.load(path)`:

    {"layers":  {"conv1": {"lowering": 3, "partitions": 2}},
     "default": {"lowering": "auto", "measure": false},
     "share_diffs": false, "schedule": "sequential", "fusion": false}

Keys, per layer (under "layers", by layer name) or for every layer ("default"):

    lowering            1, 2, 3 or "auto" (the chooser, cct.lowering.chooser)
    measure             true: "auto" times each type on the layer's shape
                        instead of trusting the cost model (cached per shape)
    lowering_budget_mb  largest lowering workspace matrix, MB; bigger batches
                        are lowered in chunks (cct.lowering.chunking)
    winograd            "auto" (the default), false, 2 or 4: how a 3 x 3 or
                        5 x 5 convolution at stride 1 whose net never runs its
                        backward (a deploy net, `cct test`) computes its
                        forward: "auto" times the lowering against Winograd
                        F(2x2, 3x3) and F(4x4, 3x3), or F(2x2, 5x5), on the
                        layer's shape at its partitions' BLAS threads, and
                        keeps Winograd where clearly faster (cached per shape,
                        beside the lowering choices; a forced lowering type
                        keeps it off); 2 or 4 that output tile size wherever
                        the kernel has it; false never (cct.lowering.winograd)
    partitions          batch partitions (cct.runtime.partition); as a default
                        it applies only to the layers that can be partitioned.
                        A layer runs at most one partition per sample of the
                        batch it has at each forward: a smaller test net, or a
                        net reshaped to one image, runs fewer than asked
    threads             in the "tuned" schedule, the thread count of each of
                        the layer's sub-tasks run whole, fixed instead of
                        profiled (cct.runtime.tuner); at most the cores

A layer takes the keys its class declares in `run_settings` (Convolution and
Deconvolution: lowering, measure, lowering_budget_mb, winograd), and every layer takes
partitions and threads.

Top-level "share_diffs": true lets the solver's train net keep the diffs of
blobs whose gradients are never live together in shared buffers (cct.runtime.memory);
the environment variable CCT_SHARE_DIFFS (1 or 0), when set, decides instead.
Activation diffs then do not keep their values after backward. Left unset, it
is on for `cct train` (which never shows an activation's diff) and off for a
solver made from Python (pycaffe scripts read any blob's diff).

Top-level "schedule": "sequential" (layer after layer), "streams" (sub-tasks
on concurrent streams, cct.runtime.scheduler; a solver runs windows of whole
iterations that way), "tuned" (the streams with each sub-task's thread count
profiled on the first iterations and sub-tasks co-running, cct.runtime.tuner)
or "auto" (each solver times windows of iterations in all three and keeps
the fastest; a net's backward from Python chooses between the first two). Precedence:
set_schedule() (the CLI's --schedule), then CCT_SCHEDULE, then the
configuration, then "auto". Every schedule gives the same numbers bit for
bit, at any thread count: a streamed sub-task runs at the width the
sequential schedule gives its layer (cct.runtime.scheduler's core budget).
"tuned" does not: a GEMM's thread count there may differ, and depends on
timing, so "auto" repeats bit for bit only where it keeps another schedule.
Top-level "priorities": {"alpha": a,
"beta": b} sets how far a weight gradient (alpha) and any other parameter
gradient (beta) rank below their layer's data gradient in the streams
schedule (cct.runtime.critical_path; defaults in cct.runtime.scheduler).

Top-level "fusion": false turns inference fusion off (cct.runtime.fusion:
chains of BatchNorm, Scale, Bias, ReLU, Dropout and Eltwise sums run as one
pass over a blob, Split tops alias their bottom). It is on by default for
every TEST-phase net (`cct test`, deploy nets, a solver's test nets, pycaffe
nets built with cct.TEST); TRAIN-phase nets never fuse, whatever the
setting. Precedence: set_fusion(), then CCT_FUSION, then the configuration,
then on. The switch is read when a net's executor is made (as the net is
built); a net keeps what it was built with.

Top-level "hybrid": on an OpenCL device (set_mode_gpu, --gpu, CCT_GPU),
true splits every layer that can be split between the host and the
device by the FLOPS rule (cct.runtime.hybrid); an object {"conv1": 0.85,
"default": 0.5} sets the device's share of those layers' batch instead of
measuring it (0: all on the host, 1: all on the device); false: no split.
Precedence: set_hybrid() (the CLI's --hybrid), then CCT_HYBRID, then the
configuration, then off.

Unknown keys and bad values are errors naming the file and the key. Layers a
net does not have are ignored (a train and a test net share one file).
Precedence for a convolution's lowering type: the layer's entry, then the
CCT_LOWERING environment variable, then "default", then the chooser; the
budget likewise with CCT_LOWERING_BUDGET_MB, and winograd with CCT_WINOGRAD.
"""
import json
import os
from pathlib import Path

from cct.core.errors import ConfigError
from cct.core.layer import TEST
from cct.lowering import chooser
from cct.runtime import threads as threads_module
from cct.lowering.chunking import DEFAULT_BUDGET_MB

CONFIG_ENV = "CCT_CONFIG"
SHARE_DIFFS_ENV = "CCT_SHARE_DIFFS"
THREADS_ENV = "CCT_THREADS"
MPI_OVERLAP_ENV = "CCT_MPI_OVERLAP"
# What MPI launchers (OpenMPI, MPICH) set to the number of ranks on this host.
LOCAL_RANKS_ENVS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
PARTITIONS_ENV = "CCT_PARTITIONS"
LOWERING_ENV = "CCT_LOWERING"
BUDGET_ENV = "CCT_LOWERING_BUDGET_MB"
WINOGRAD_ENV = "CCT_WINOGRAD"
CACHE_ENV = "CCT_CACHE_DIR"
TOP_KEYS = ("layers", "default", "share_diffs", "schedule", "priorities", "fusion", "hybrid")
PRIORITY_KEYS = ("alpha", "beta")
SCHEDULE_ENV = "CCT_SCHEDULE"
SCHEDULES = ("sequential", "streams", "tuned", "auto")
FUSION_ENV = "CCT_FUSION"
KEYS = ("lowering", "measure", "lowering_budget_mb", "winograd", "partitions", "threads")
EVERY_LAYER_KEYS = ("partitions", "threads")       # the keys every layer takes


def _env(name):
    """The variable's value, stripped; "" when unset."""
    return os.environ.get(name, "").strip()


# The chooser (below the runtime) is told how to find its cache folder, and how
# to time a forward at the BLAS thread count a batch partition runs with; set on
# import, since a convolution may choose before any executor exists.
chooser.cache_folder = lambda: _env(CACHE_ENV) or None
chooser.blas_threads = threads_module.blas_limited


def cache_dir():
    """The folder of cct's measurement caches: CCT_CACHE_DIR, else ~/.cache/cct."""
    return Path(_env(CACHE_ENV) or Path.home() / ".cache" / "cct")


def _check_value(source, where, key, value):
    def bad(expected):
        return ConfigError(f"{source}: {where}.{key}: must be {expected}, got {json.dumps(value)}")
    if key == "lowering":
        if value != "auto" and (isinstance(value, bool) or value not in (1, 2, 3)):
            raise bad('1, 2, 3 or "auto"')
    elif key == "measure":
        if not isinstance(value, bool):
            raise bad("true or false")
    elif key == "lowering_budget_mb":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise bad("a number of MB > 0")
    elif key == "winograd":
        if value not in ("auto", False) and (isinstance(value, bool) or value not in (2, 4)):
            raise bad('"auto", false, 2 or 4')
    elif key in ("partitions", "threads"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad("an integer >= 1")


def _check_settings(source, where, settings):
    if not isinstance(settings, dict):
        raise ConfigError(f"{source}: {where}: must be an object of settings, got {json.dumps(settings)}")
    for key, value in settings.items():
        if key not in KEYS:
            raise ConfigError(f"{source}: {where}.{key}: unknown key; known keys: {', '.join(KEYS)}")
        _check_value(source, where, key, value)
    return dict(settings)


def _check_priorities(source, priorities):
    if not isinstance(priorities, dict):
        raise ConfigError(f"{source}: priorities: must be an object with alpha and/or beta, "
                          f"got {json.dumps(priorities)}")
    for key, value in priorities.items():
        if key not in PRIORITY_KEYS:
            raise ConfigError(f"{source}: priorities.{key}: unknown key; known keys: {', '.join(PRIORITY_KEYS)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ConfigError(f"{source}: priorities.{key}: must be a number >= 0, got {json.dumps(value)}")
    return dict(priorities)


class RunConfig:
    """A parsed run configuration; `source` names it in messages."""

    def __init__(self, contents, source="<config>"):
        self.source = str(source)
        if not isinstance(contents, dict):
            raise ConfigError(f"{self.source}: must hold a JSON object, got {type(contents).__name__}")
        for key in contents:
            if key not in TOP_KEYS:
                raise ConfigError(f"{self.source}: {key}: unknown key; known keys: {', '.join(TOP_KEYS)}")
        layers = contents.get("layers", {})
        if not isinstance(layers, dict):
            raise ConfigError(f"{self.source}: layers: must be an object keyed by layer name")
        self.layers = {name: _check_settings(self.source, f"layers.{name}", settings)
                       for name, settings in layers.items()}
        self.default = _check_settings(self.source, "default", contents.get("default", {}))
        self.schedule = contents.get("schedule")                 # None: not set here
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ConfigError(f"{self.source}: schedule: must be one of {', '.join(SCHEDULES)}, "
                              f"got {json.dumps(self.schedule)}")
        self.priorities = _check_priorities(self.source, contents.get("priorities", {}))
        self.share_diffs = contents.get("share_diffs")           # None: the caller's default
        self.fusion = contents.get("fusion")                     # None: not set here
        self.hybrid = _check_hybrid(self.source, contents.get("hybrid"))
        if "fusion" in contents and not isinstance(self.fusion, bool):
            raise ConfigError(f"{self.source}: fusion: must be true or false, got {json.dumps(self.fusion)}")
        if "share_diffs" in contents and not isinstance(self.share_diffs, bool):
            raise ConfigError(f"{self.source}: share_diffs: must be true or false, "
                              f"got {json.dumps(self.share_diffs)}")

    def layer_value(self, layer_name, key):
        """The layer's own setting, or None."""
        return self.layers.get(layer_name, {}).get(key)

    def default_value(self, key):
        return self.default.get(key)

    def value(self, layer_name, key):
        """The layer's setting, else the default's, else None."""
        value = self.layer_value(layer_name, key)
        return self.default_value(key) if value is None else value


def _check_hybrid(source, value):
    """The "hybrid" entry: None (not set), False, True, or {layer or "default": share in [0, 1]}."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: hybrid: must be true, false or {{layer name: device share}}, "
                          f"got {json.dumps(value)}")
    for name, share in value.items():
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise ConfigError(f"{source}: hybrid.{name}: must be a device share from 0 to 1, got {json.dumps(share)}")
    return {name: float(share) for name, share in value.items()}


def parse(text, source="<config>"):
    try:
        contents = json.loads(text)
    except ValueError as error:
        raise ConfigError(f"{source}: not valid JSON: {error}") from None
    return RunConfig(contents, source)


def read(path):
    path = os.fspath(path)
    try:
        with open(path) as file:
            text = file.read()
    except OSError as error:
        raise ConfigError(f"{path}: cannot read the run configuration: {error.strerror}") from None
    return parse(text, path)


_loaded = None              # set by load(); wins over CCT_CONFIG
_from_env = (None, None)    # (path, RunConfig) last read from CCT_CONFIG


def load(path):
    """Read `path` and make it the active configuration for layers set up from
    now on; load(None) goes back to CCT_CONFIG (or none). Returns the config."""
    global _loaded
    _loaded = None if path is None else (path if isinstance(path, RunConfig) else read(path))
    return _loaded


def active():
    """The configuration in force: the one given to load(), else the file named
    by CCT_CONFIG (read once per path), else None."""
    global _from_env
    if _loaded is not None:
        return _loaded
    path = _env(CONFIG_ENV)
    if not path:
        return None
    if _from_env[0] != path:
        _from_env = (path, read(path))
    return _from_env[1]


_schedule = None            # set by set_schedule(); wins over CCT_SCHEDULE


def set_schedule(mode):
    """Make `mode` (sequential, streams, auto; None: back to the environment
    and configuration) the schedule of nets whose executor is made from now on."""
    global _schedule
    if mode is not None and mode not in SCHEDULES:
        raise ConfigError(f"schedule: must be one of {', '.join(SCHEDULES)}, got {mode!r}")
    _schedule = mode


def priorities():
    """The configuration's {"alpha": ..., "beta": ...} overrides (possibly none)."""
    config = active()
    return dict(config.priorities) if config is not None else {}


def schedule(config=None):
    """The schedule for a new executor, by the precedence in the module docstring."""
    if _schedule is not None:
        return _schedule
    given = _env(SCHEDULE_ENV)
    if given:
        if given not in SCHEDULES:
            raise ConfigError(f"{SCHEDULE_ENV}: must be one of {', '.join(SCHEDULES)}, got {given!r}")
        return given
    config = config or active()
    return config.schedule if config is not None and config.schedule else "auto"


_device_mode = None         # set by set_mode(): "cpu" or "gpu"; None: CCT_GPU decides
_device_id = 0              # set by set_device_id()
_device_ids = None          # set by set_device_ids(): every device a hybrid split may use
GPU_ENV = "CCT_GPU"


def set_mode(mode):
    """pycaffe's set_mode_cpu/set_mode_gpu: "cpu" or "gpu" (the device of
    set_device_id, an OpenCL device); None: back to CCT_GPU. Read by every
    layer run from then on (cct.runtime.executor), as Caffe reads its mode."""
    global _device_mode
    if mode not in (None, "cpu", "gpu"):
        raise ConfigError(f"mode: must be 'cpu' or 'gpu', got {mode!r}")
    _device_mode = mode


def set_device_id(index):
    """pycaffe's set_device: the OpenCL device id "gpu" mode runs on
    (`cct device_query` lists them)."""
    global _device_id
    index = int(index)
    if index < 0:
        raise ConfigError(f"device id: must be >= 0, got {index}")
    _device_id = index


def set_device_ids(ids):
    """`--gpu 0,1`: the first runs the layers (set_device_id); all of them
    are the devices a hybrid split may use."""
    global _device_ids
    ids = [int(i) for i in ids]
    set_device_id(ids[0])
    _device_ids = ids


def device_ids():
    """The device ids of set_device_ids, else the one of set_device_id."""
    return list(_device_ids) if _device_ids else [_device_id]


def parse_device_ids(text, source):
    """"0", "0,1" or "all" (every OpenCL device) as a list of ids; a bad
    value is an error naming `source` (the flag or variable)."""
    from cct.devices import opencl
    text = str(text).strip()
    if text == "all":
        count = len(opencl.platform_devices())
        if not count:
            raise ConfigError(f"{source}: all: {opencl.why_unavailable()}")
        return list(range(count))
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(f"{source}: must be a device id (0), ids (0,1), all or cpu, got {text!r}") from None
    if any(i < 0 for i in ids):
        raise ConfigError(f"{source}: device ids must be >= 0, got {text!r}")
    return ids


def device():
    """The OpenCL device layers run on (cct.devices.opencl), or None for the
    host: "gpu" mode's set_device_id device; unless a mode was set, CCT_GPU
    (a device id, as `cct train --gpu`; "" or "cpu": the host)."""
    if _device_mode == "cpu":
        return None
    index = _device_id
    if _device_mode is None:
        given = _env(GPU_ENV)
        if not given or given == "cpu":
            return None
        index = parse_device_ids(given, GPU_ENV)[0]
    return opencl_device(index)


def opencl_device(index):
    from cct.devices import opencl
    from cct.devices.base import DeviceError
    try:
        return opencl.device(index)
    except DeviceError as error:
        raise ConfigError(str(error)) from None


_hybrid = None              # set by set_hybrid(); wins over CCT_HYBRID
HYBRID_ENV = "CCT_HYBRID"


def set_hybrid(enabled):
    """--hybrid: split layers between the host and the device (True), or not
    (False); None: back to CCT_HYBRID and the configuration."""
    global _hybrid
    if enabled is not None and not isinstance(enabled, bool):
        raise ConfigError(f"hybrid: must be True, False or None, got {enabled!r}")
    _hybrid = enabled


def hybrid(config=None):
    """None when layers are not split; else the configured shares
    {layer name or "default": device share}, possibly empty (all measured)."""
    config = config or active()
    configured = config.hybrid if config is not None else None
    enabled = _hybrid
    if enabled is None:
        enabled = _env_bool(HYBRID_ENV)
    if enabled is None:
        enabled = bool(configured)
    if not enabled:
        return None
    return dict(configured) if isinstance(configured, dict) else {}


_fusion = None              # set by set_fusion(); wins over CCT_FUSION


def set_fusion(enabled):
    """Make fusion on (True) or off (False) for TEST-phase nets built from now
    on; None: back to CCT_FUSION and the configuration."""
    global _fusion
    if enabled is not None and not isinstance(enabled, bool):
        raise ConfigError(f"fusion: must be True, False or None, got {enabled!r}")
    _fusion = enabled


def fusion_enabled(phase, config=None):
    """Whether a net built in `phase` runs with inference fusion
    (cct.runtime.fusion), by the precedence in the module docstring. Never
    for a TRAIN-phase net: it runs backward, and its BatchNorm and Dropout
    layers compute what fusion cannot."""
    if phase != TEST:
        return False
    if _fusion is not None:
        return _fusion
    return _switch(FUSION_ENV, "fusion", True, config)


def mpi_overlap():
    """Whether data-parallel training sums gradients while backward runs:
    CCT_MPI_OVERLAP, or None when unset (the trainer decides)."""
    return _env_bool(MPI_OVERLAP_ENV)


def share_diffs_enabled(config=None, default=False):
    """Whether the solver shares its train net's diffs (cct.runtime.memory):
    CCT_SHARE_DIFFS when set (1/true/yes/on or 0/false/no/off), else the
    configuration's "share_diffs" when it has one, else `default`."""
    return _switch(SHARE_DIFFS_ENV, "share_diffs", default, config)


def _switch(env_name, key, default, config=None):
    """An on/off setting: the environment variable when set, else the
    configuration's top-level `key` when it has one, else `default`."""
    given = _env_bool(env_name)
    if given is not None:
        return given
    config = config or active()
    configured = None if config is None else getattr(config, key)
    return default if configured is None else configured


def _env_bool(name):
    """An on/off environment variable (1/true/yes/on or 0/false/no/off), None when unset."""
    given = _env(name)
    if not given:
        return None
    if given.lower() in ("1", "true", "yes", "on"):
        return True
    if given.lower() in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}: must be 1 or 0, got {given!r}")


def _env_int(name, least):
    value = _env(name)
    if not value:
        return None
    try:
        number = int(value)
    except ValueError:
        number = least - 1
    if number < least:
        raise ConfigError(f"{name}: environment variable must be an integer >= {least}, got {value!r}")
    return number


def threads():
    """CCT_THREADS; else, for one of several MPI ranks on this host, its
    share of the host's cores (each rank's BLAS would otherwise take them
    all: 2 ranks on 2 cores trained LeNet 4.5x slower); else None (the
    executor then uses the BLAS default)."""
    given = _env_int(THREADS_ENV, 1)
    if given is not None:
        return given
    local_ranks = max([_env_int(name, 1) or 1 for name in LOCAL_RANKS_ENVS])
    if local_ranks > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return max(1, (cores or 1) // local_ranks)
    return None


def forced_partitions():
    """CCT_PARTITIONS, or None. 0 counts as unset."""
    value = _env(PARTITIONS_ENV)
    return None if value in ("", "0") else _env_int(PARTITIONS_ENV, 1)


def _lowering_from_env(layer):
    value = _env(LOWERING_ENV)
    if not value:
        return None
    if value not in ("1", "2", "3"):
        raise layer.config_error(LOWERING_ENV, f"environment variable must be 1, 2 or 3, got {value!r}")
    return int(value)


def _budget_mb_from_env(layer):
    value = _env(BUDGET_ENV)
    if not value:
        return None
    try:
        megabytes = float(value)
    except ValueError:
        megabytes = -1.0
    if megabytes <= 0:
        raise layer.config_error(BUDGET_ENV, f"environment variable {BUDGET_ENV} must be a positive "
                                 f"number of MB, got {value!r}")
    return megabytes


def _winograd_from_env(layer):
    value = _env(WINOGRAD_ENV)
    if not value:
        return None
    if value not in ("0", "2", "4", "auto"):
        raise layer.config_error(WINOGRAD_ENV, f"environment variable must be 0, 2, 4 or auto, got {value!r}")
    return {"0": False, "auto": "auto"}.get(value) if value in ("0", "auto") else int(value)


def _by_precedence(layer, config, key, from_env):
    """The layer's own entry, then the environment variable, then "default"; None if none."""
    value = config.layer_value(layer.name, key) if config else None
    if value is None:
        value = from_env(layer)
    if value is None and config:
        value = config.default_value(key)
    return value


def layer_settings(layer, config=None):
    """{key: value} for the keys `layer` declares in run_settings, by the
    precedence in the module docstring; keys nothing sets are left out."""
    config = config or active()
    declared = set(getattr(layer, "run_settings", ()))
    found = {}
    if "lowering" in declared:
        lowering = _by_precedence(layer, config, "lowering", _lowering_from_env)
        if lowering is not None:
            found["lowering"] = lowering
    if "measure" in declared and config and config.value(layer.name, "measure") is not None:
        found["measure"] = config.value(layer.name, "measure")
    if "lowering_budget_mb" in declared:
        found["lowering_budget_mb"] = (_by_precedence(layer, config, "lowering_budget_mb", _budget_mb_from_env)
                                       or DEFAULT_BUDGET_MB)
    if "winograd" in declared:
        setting = _by_precedence(layer, config, "winograd", _winograd_from_env)
        if setting is not None:
            found["winograd"] = setting
    return found


def apply(executor, config=None):
    """Apply the settings to a built net through its executor: check that
    every configured key fits its layer, set the configured batch partitions
    and push each layer's settings (Layer.configure). Returns {layer name:
    partitions} set by the configuration, as many as each layer runs at the
    net's current batch (Executor.fit)."""
    config = config or active()
    net = executor.net
    applied = {}
    for index, layer in enumerate(net.layers):
        declared = tuple(getattr(layer, "run_settings", ()))
        if config is not None:
            _check_layer_keys(config, layer, declared)
            if _apply_partitions(config, executor, index):
                applied[layer.name] = executor.partitions(index)
        if declared:
            # the partitions first: a convolution chooses its lowering for one partition's batch
            partitions = executor.partitions(index)
            layer.run_partitions(partitions, executor.blas_count(partitions))
            layer.configure(layer_settings(layer, config))
            # the net set the layer up before it had its settings: size it again with them
            layer.reshape(net.bottom_vecs[index], net.top_vecs[index])
    return applied


def _check_layer_keys(config, layer, declared):
    for key in config.layers.get(layer.name, {}):
        if key not in EVERY_LAYER_KEYS and key not in declared:
            takes = (f"takes {', '.join(declared)}, partitions and threads" if declared
                     else "takes only partitions and threads")
            raise ConfigError(f"{config.source}: layers.{layer.name}.{key}: layer '{layer.name}' "
                              f"({layer.type}) {takes}")


def _apply_partitions(config, executor, index):
    """Put the layer's configured partitions (its own, else the default) in
    the executor's plan; whether there were any. A batch too small for the
    count is no error (a train and a test net share one file): each forward
    runs as many as the batch allows."""
    layer = executor.net.layers[index]
    partitions = config.layer_value(layer.name, "partitions")
    if partitions is None:
        partitions = config.default_value("partitions")
        if partitions is None or executor.batch(index) is None:
            return False
    elif partitions > 1 and executor.batch(index) is None:
        raise ConfigError(f"{config.source}: layers.{layer.name}.partitions: layer '{layer.name}' "
                          f"({layer.type}) cannot be batch-partitioned")
    executor.set_partitions(index, partitions)
    return True
