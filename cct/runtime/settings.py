"""Run settings as the runtime applies them: each knob of cct.core.settings
(the table, the one precedence, the run-configuration file) looked up for a
net or a layer, the pycaffe and command-line setters, and apply(), which
pushes a built net's settings onto its layers (Layer.configure) and its
executor, so layers never read a global.
"""
import dataclasses
import os
from pathlib import Path
from typing import Dict, List, Optional

from cct.core import settings as table
from cct.core.errors import ConfigError
from cct.core.layer import TEST
from cct.runtime.cores import affinity_cores
from cct.core.settings import RunConfig, override  # noqa: F401  (the runtime's names for them)

# The variables, by knob (tests and messages name them), as the table declares them.
_ENV = {knob.name: knob.env for knob in table.KNOBS}
CONFIG_ENV, SHARE_DIFFS_ENV, THREADS_ENV = _ENV["config"], _ENV["share_diffs"], _ENV["workers"]
PARTITIONS_ENV, LOWERING_ENV, BUDGET_ENV = _ENV["partitions"], _ENV["lowering"], _ENV["lowering_budget_mb"]
WINOGRAD_ENV, CACHE_ENV, SCHEDULE_ENV = _ENV["winograd"], _ENV["cache_dir"], _ENV["schedule"]
FUSION_ENV, GPU_ENV, HYBRID_ENV, MPI_OVERLAP_ENV = _ENV["fusion"], _ENV["gpu"], _ENV["hybrid"], _ENV["mpi_overlap"]
# What MPI launchers (OpenMPI, MPICH) set to the number of ranks on this host.
LOCAL_RANKS_ENVS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
SCHEDULES = table.SCHEDULES
EVERY_LAYER_KEYS = ("partitions", "threads")       # the keys every layer takes
parse, read = table.parse_config, table.read_config


def load(path):
    """Read `path` (or take a RunConfig) and make it the configuration for
    nets built from now on; load(None) goes back to CCT_CONFIG (or none)."""
    config = None if path is None else (path if isinstance(path, RunConfig) else read(path))
    table.set_explicit("config", config, "settings.load")
    return config


def active():
    """The configuration in force (cct.core.settings.run_config)."""
    return table.run_config()


def cache_dir():
    """The folder of cct's measurement caches: CCT_CACHE_DIR, else ~/.cache/cct."""
    return Path(table.value("cache_dir"))


def set_schedule(mode):
    """Make `mode` (sequential, streams, tuned, auto; None: back to the other
    sources) the schedule of nets whose executor is made from now on."""
    table.set_explicit("schedule", mode, "schedule")


def schedule(config="active"):
    return table.value("schedule", config=config)


def priorities():
    """The configuration's {"alpha": ..., "beta": ...} overrides (possibly none)."""
    return dict(table.value("priorities"))


def set_mode(mode):
    """pycaffe's set_mode_cpu/set_mode_gpu: "cpu" or "gpu" (the device of
    set_device_id, an OpenCL device); None: back to CCT_GPU. Read by every
    layer run from then on (cct.runtime.executor), as Caffe reads its mode."""
    if mode not in (None, "cpu", "gpu"):
        raise ConfigError(f"mode: must be 'cpu' or 'gpu', got {mode!r}")
    ids = None if mode is None else [] if mode == "cpu" else [table.value("device_id")]
    table.set_explicit("gpu", ids, f"set_mode_{mode}")


def set_device_id(index):
    """pycaffe's set_device: the OpenCL device id "gpu" mode runs on
    (`cct device_query` lists them); in gpu mode, from now on."""
    index = int(index)
    if index < 0:
        raise ConfigError(f"device id: must be >= 0, got {index}")
    table.set_explicit("device_id", index, "set_device")
    if table.source_value("gpu")[0] == "call" and table.value("gpu"):
        table.set_explicit("gpu", [index], "set_device")


def set_device_ids(ids):
    """`--gpu 0,1`: the first runs the layers; all of them are the devices a
    hybrid split may use."""
    ids = [int(i) for i in ids]
    table.set_explicit("device_id", ids[0], "--gpu")
    table.set_explicit("gpu", ids, "--gpu")


def device_ids():
    """The devices a hybrid split may use: those given, else device_id's."""
    ids = _device_list()
    return ids or [table.value("device_id")]


def _device_list():
    ids = table.value("gpu")
    return parse_device_ids("all", GPU_ENV) if ids == "all" else (ids or [])


def parse_device_ids(text, source):
    """"0", "0,1" or "all" (every OpenCL device) as a list of ids, read as the
    gpu knob reads its variable ("cpu", the host, is no id here); a bad value
    is an error naming `source` (the flag or variable)."""
    kind, text = table.BY_NAME["gpu"].kind, str(text).strip()
    try:
        ids = kind.text(text)
        if not ids:
            raise kind.bad(text, text=True)
    except ValueError as error:
        raise ConfigError(f"{source}: {error}") from None
    if ids != "all":
        return ids
    from cct.devices import opencl
    count = len(opencl.platform_devices())
    if not count:
        raise ConfigError(f"{source}: all: {opencl.why_unavailable()}")
    return list(range(count))


def device():
    """The OpenCL device layers run on (cct.devices.opencl), or None for the
    host: the first of the gpu knob's ids (set_mode_gpu's, --gpu's, CCT_GPU's)."""
    ids = _device_list()
    return opencl_device(ids[0]) if ids else None


def opencl_device(index):
    from cct.devices import opencl
    from cct.devices.base import DeviceError
    try:
        return opencl.device(index)
    except DeviceError as error:
        raise ConfigError(str(error)) from None


def set_hybrid(enabled):
    """--hybrid: split layers between the host and the device (True), or not
    (False); None: back to CCT_HYBRID and the configuration."""
    if enabled is not None and not isinstance(enabled, bool):
        raise ConfigError(f"hybrid: must be True, False or None, got {enabled!r}")
    table.set_explicit("hybrid", enabled, "--hybrid")


def hybrid(config="active"):
    """None when layers are not split; else the configured shares {layer
    name or "default": device share}, possibly empty (all measured). The
    shares are the configuration's wherever it gives them, even where a
    call or a variable is what turned the split on."""
    config = table.run_config() if config == "active" else config
    enabled = table.value("hybrid", config=config)
    if not enabled:
        return None
    configured = config.hybrid if config is not None else None
    return dict(configured) if isinstance(configured, dict) else {}


def set_fusion(enabled):
    """Make fusion on (True) or off (False) for TEST-phase nets built from now
    on; None: back to the other sources."""
    table.set_explicit("fusion", enabled, "set_fusion")


def fusion_enabled(phase, config="active"):
    """Whether a net built in `phase` runs with inference fusion
    (cct.runtime.fusion). Never for a TRAIN-phase net: it runs backward, and
    its BatchNorm and Dropout layers compute what fusion cannot."""
    return phase == TEST and table.value("fusion", config=config)


def mpi_overlap():
    """Whether data-parallel training sums gradients while backward runs, or
    None when nothing says (the trainer decides)."""
    return table.value("mpi_overlap")


def share_diffs_enabled(config="active", default=False):
    """Whether the solver shares its train net's diffs (cct.runtime.memory);
    `default` where nothing says."""
    found = table.value("share_diffs", config=config)
    return default if found is None else found


def threads():
    """The workers knob (CCT_THREADS); else, for one of several MPI ranks on
    this host, its share of the host's cores (each rank's BLAS would
    otherwise take them all: 2 ranks on 2 cores trained LeNet 4.5x slower);
    else None (the executor then uses the BLAS default)."""
    given = table.value("workers")
    if given is not None:
        return given
    local_ranks = max([_local_ranks(name) for name in LOCAL_RANKS_ENVS])
    if local_ranks > 1:
        return max(1, affinity_cores() // local_ranks)
    return None


def _local_ranks(name):
    value = os.environ.get(name, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else 1


def forced_partitions():
    """Batch partitions for every layer that allows them, where a call or the
    environment gives them (CCT_PARTITIONS; 0 counts as unset); None
    otherwise (the run configuration's are applied per layer, apply())."""
    source, partitions = table.source_value("partitions", config=None)
    return partitions if source != "built-in" else None


def layer_settings(layer, config="active"):
    """{key: value} for the keys `layer` declares in run_settings, by the
    precedence of cct.core.settings; keys nothing sets are left out (the
    layer takes its default: a convolution on a device then sizes its
    lowering from the device's memory, issue 37)."""
    config = table.run_config() if config == "active" else config
    found = {}
    for key in layer.run_settings:
        source, setting = table.source_value(key, layer.name, config=config)
        if source != "built-in":
            found[key] = setting
    return found


def apply(executor, config="active"):
    """Apply the settings to a built net through its executor: check that
    every configured key fits its layer, set the configured batch partitions
    and push each layer's settings (Layer.configure). Returns {layer name:
    partitions} set by the configuration, as many as each layer runs at the
    net's current batch (Executor.fit)."""
    config = table.run_config() if config == "active" else config
    net = executor.net
    applied = {}
    for index, layer in enumerate(net.layers):
        declared = tuple(layer.run_settings)
        if config is not None:
            _check_layer_keys(config, layer, declared)
            if _apply_partitions(config, executor, index):
                applied[layer.name] = executor.partitions(index)
        if declared:
            # the partitions first: a convolution chooses its lowering for one partition's batch
            partitions = executor.partitions(index)
            layer.run_partitions(partitions, executor.blas_count(partitions), executor.spread(partitions))
            layer.configure(layer_settings(layer, config))
            # the net set the layer up before it had its settings: size it again with them
            layer.reshape(net.bottom_vecs[index], net.top_vecs[index])
    return applied


@dataclasses.dataclass(frozen=True)
class NetSettings:
    """A net's settings, resolved once, when its executor is made; made again
    only after an explicit call changed a knob (pycaffe's set_mode_gpu
    reaches nets built before it, as Caffe's mode does). The runtime reads
    these, never the sources."""
    version: int                      # cct.core.settings.version() when resolved
    config: Optional[RunConfig]
    workers: Optional[int]
    fit_cores: bool
    schedule: str
    fusion: bool
    hybrid: Optional[Dict[str, float]]
    priorities: Dict[str, float]
    device_ids: List[int]             # [] on the host
    forced_partitions: Optional[int]

    def device(self):
        """The OpenCL device layers run on, or None for the host."""
        return opencl_device(self.device_ids[0]) if self.device_ids else None

    def stale(self):
        return self.version != table.version()


def resolve(phase):
    """The settings of a net built in `phase`, now."""
    config = table.run_config()
    return NetSettings(version=table.version(), config=config, workers=threads(),
                       fit_cores=table.value("fit_cores", config=config), schedule=schedule(config), fusion=fusion_enabled(phase, config),
                       hybrid=hybrid(config), priorities=dict(table.value("priorities", config=config)),
                       device_ids=_device_list(), forced_partitions=forced_partitions())


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
    if table.source_value("partitions", config=None)[0] == "call":
        return False                               # a call wins over the file
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
