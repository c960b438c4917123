"""Every knob cct reads, declared once (KNOBS), and the one precedence that
decides each of them. Nothing else in cct reads a `CCT_*` variable or the
run-configuration file.

A knob's value comes from the first of these sources that sets it:

    1. an explicit call: a pycaffe or cct call (cct.set_mode_gpu,
       cct.set_schedule, net.executor.set_partitions, ...), the `cct`
       command-line flag that makes it (--gpu, --schedule, --hybrid), or
       override(...) around the code (tests);
    2. the run configuration's entry for the layer ("layers": {"conv1": {...}});
    3. the run configuration's entry for every layer ("default": {...}), or
       its top-level key for a knob of the whole net;
    4. the environment variable;
    5. the built-in default.

The more explicit and the more specific a source, the earlier it comes: a
call is made for this process, a run-configuration file is named for this
run (by CCT_CONFIG or settings.load) and may name single layers, while an
environment variable may linger in a shell. Sources a knob does not have
are skipped (KNOBS says which it has). A value from any source is checked
by the knob's kind; a bad one, or an unknown key in the run configuration,
is an error naming the source: the call, the file and key, or the variable.

The run configuration is a JSON file:

    {"layers":  {"conv1": {"lowering": 3, "partitions": 2}},
     "default": {"lowering": "auto", "measure": false},
     "share_diffs": false, "schedule": "sequential", "fusion": false}

Layers a net does not have are ignored (a train and a test net share one
file). What each knob means: KNOBS; `python -m cct.core.settings` prints the
table.
"""
import contextlib
import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple

from cct.core.errors import ConfigError

LAYER, NET, PROCESS = "layer", "net", "process"       # where a knob applies: its scope


# --- kinds: how a value is read from text (a variable) and checked -------------------
class Kind:
    """What values a knob takes: `check` returns the value or raises
    ValueError saying what it must be; `text` reads an environment variable's
    (`spelled`: what it must be there). A value inside the value (a share, a
    priority) is named in the message as ".key: must be ..."."""
    expected = ""
    spelled = ""

    def check(self, value: Any) -> Any:
        return value

    def text(self, given: str) -> Any:
        return self.check(given)

    def bad(self, value: Any, text: bool = False) -> ValueError:
        shown = repr(value) if text or not _jsonable(value) else json.dumps(value)
        return ValueError(f"must be {(self.spelled if text else '') or self.expected}, got {shown}")


def _joined(error: ValueError) -> str:
    """A kind's message after the place it names: ": must be ..." or ".key: must be ..."."""
    text = str(error)
    return text if text.startswith(".") else f": {text}"


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


class Choice(Kind):
    """One of `values`; in text, one of `words`, each read as its value."""

    def __init__(self, values: Tuple[Any, ...], expected: str, words: Optional[Mapping[str, Any]] = None):
        self.values, self.expected = values, expected
        self.words = dict(words or {str(v): v for v in values})
        spellings = list(self.words)
        self.spelled = f"{', '.join(spellings[:-1])} or {spellings[-1]}" if len(spellings) > 1 else spellings[0]

    def check(self, value: Any) -> Any:
        # True == 1 in Python: a bool is only ever the bool it is
        if any(value is v or (type(value) is type(v) and value == v) for v in self.values):
            return value
        raise self.bad(value)

    def text(self, given: str) -> Any:
        if given not in self.words:
            raise self.bad(given, text=True)
        return self.words[given]


class Switch(Kind):
    expected, spelled = "true or false", "1 or 0"
    ON, OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

    def check(self, value: Any) -> Any:
        if isinstance(value, bool):
            return value
        raise self.bad(value)

    def text(self, given: str) -> Any:
        if given.lower() in self.ON:
            return True
        if given.lower() in self.OFF:
            return False
        raise self.bad(given, text=True)


class Count(Kind):
    def __init__(self, least: int = 1):
        self.least, self.expected = least, f"an integer >= {least}"

    def check(self, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int) or value < self.least:
            raise self.bad(value)
        return value

    def text(self, given: str) -> Any:
        try:
            return self.check(int(given))
        except ValueError:
            raise self.bad(given, text=True) from None


class Positive(Kind):
    expected = "a number > 0"

    def check(self, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise self.bad(value)
        return value

    def text(self, given: str) -> Any:
        try:
            return self.check(float(given))
        except ValueError:
            raise self.bad(given, text=True) from None


class Bytes(Kind):
    expected = "a size in bytes, or with K or M (KiB, MiB): 4M, 256K, 0"

    def check(self, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.bad(value)
        return value

    def text(self, given: str) -> Any:
        scale = {"K": 2**10, "M": 2**20}.get(given[-1:].upper(), 1)
        try:
            return self.check(int(given[:-1] if scale > 1 else given) * scale)
        except ValueError:
            raise self.bad(given, text=True) from None


class Text(Kind):
    expected = "a non-empty string"

    def check(self, value: Any) -> Any:
        if not isinstance(value, (str, os.PathLike)) or not str(value):
            raise self.bad(value)
        return str(value)


class Shares(Kind):
    """hybrid: true, false, or {layer name or "default": the device's share, 0 to 1}."""
    expected = "true, false or {layer name: device share from 0 to 1}"

    def check(self, value: Any) -> Any:
        if isinstance(value, bool):
            return value
        if not isinstance(value, dict):
            raise self.bad(value)
        for name, share in value.items():
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
                raise ValueError(f".{name}: must be a device share from 0 to 1, got {json.dumps(share)}")
        return {name: float(share) for name, share in value.items()}

    def text(self, given: str) -> Any:
        return Switch().text(given)


class Priorities(Kind):
    expected = "an object with alpha and/or beta, numbers >= 0"

    def check(self, value: Any) -> Any:
        if not isinstance(value, dict):
            raise self.bad(value)
        for key, number in value.items():
            if key not in ("alpha", "beta"):
                raise ValueError(f".{key}: unknown key; known keys: alpha, beta")
            if isinstance(number, bool) or not isinstance(number, (int, float)) or number < 0:
                raise ValueError(f".{key}: must be a number >= 0, got {json.dumps(number)}")
        return dict(value)


class Devices(Kind):
    """The OpenCL devices layers run on: a list of ids, the first running the
    layers and all of them open to a hybrid split; [] (or None) the host;
    "all" every device, counted when one is opened (cct.runtime.settings)."""
    expected = "a device id (0), ids (0,1), all or cpu"

    def check(self, value: Any) -> Any:
        if value is None or value == "all":
            return value
        if isinstance(value, (list, tuple)) and all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
            return list(value)
        raise self.bad(value)

    def text(self, given: str) -> Any:
        if given == "cpu":
            return []
        if given == "all":
            return given
        try:
            return self.check([int(part) for part in given.split(",")])
        except ValueError:
            raise self.bad(given, text=True) from None


# --- the table ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Knob:
    name: str                  # the run configuration's key, and override()'s keyword
    kind: Kind
    default: Any
    meaning: str
    scope: str = NET           # LAYER: per-layer entries and "default"; NET: a top-level key; PROCESS: no file
    env: Optional[str] = None  # the environment variable
    calls: str = ""            # the calls (and command-line flags) that set it explicitly

    @property
    def in_config(self) -> bool:
        return self.scope != PROCESS


_LOWERING = Choice((1, 2, 3, "auto"), '1, 2, 3 or "auto"')
_WINOGRAD = Choice(("auto", False, 2, 4), '"auto", false, 2 or 4', {"0": False, "2": 2, "4": 4, "auto": "auto"})
SCHEDULES = ("sequential", "streams", "tuned", "auto")
_SCHEDULE = Choice(SCHEDULES, "sequential, streams, tuned or auto")

KNOBS = (
    Knob("lowering", _LOWERING, "auto", "a convolution's lowering type; auto: the chooser's "
         "(cct.lowering.chooser)", LAYER, "CCT_LOWERING"),
    Knob("measure", Switch(), False, "auto lowering times each type on the layer's shape instead of "
         "trusting the cost model, and auto Winograd its tile sizes against the lowering (cached per shape)",
         LAYER),
    Knob("lowering_budget_mb", Positive(), 64, "largest lowering workspace matrix, MB; larger batches are "
         "lowered in chunks (cct.lowering.chunking); unset, a GPU's lowering takes 1/16 of its memory "
         "(cct.lowering.device)", LAYER, "CCT_LOWERING_BUDGET_MB"),
    Knob("winograd", _WINOGRAD, "auto", "a 3x3 or 5x5 stride-1 convolution whose net never runs its "
         "backward: auto times Winograd against the lowering and keeps the faster; 2 or 4 that output "
         "tile; false never (cct.lowering.winograd)", LAYER, "CCT_WINOGRAD"),
    Knob("device_masks", Switch(), True, "on an OpenCL device, Dropout draws its TRAIN masks there, as "
         "Caffe's GPU path does (other numbers than the host's draw); false: drawn on the host and "
         "uploaded (a seeded run then gives the host's numbers)", LAYER, "CCT_DEVICE_MASKS"),
    Knob("partitions", Count(), None, "batch partitions of a layer that allows them; as a default, of "
         "every such layer (at most one per sample of the batch a forward has)", LAYER, "CCT_PARTITIONS",
         "net.executor.set_partitions(i, p)"),
    Knob("threads", Count(), None, "in the tuned schedule, the thread count of each of the layer's "
         "sub-tasks run whole, fixed instead of profiled (cct.runtime.tuner)", LAYER),
    Knob("workers", Count(), None, "threads a net's layers run on (default: the BLAS library's count; "
         "for one of several MPI ranks on a host, its share of the cores)", NET, "CCT_THREADS"),
    Knob("fit_cores", Switch(), True, "where workers is not given, a net runs on the cores other "
         "processes leave free, measured as it runs (cct.runtime.cores); the last bits of a result may "
         "differ between counts, so give workers for runs repeatable bit for bit", NET, "CCT_FIT_CORES"),
    Knob("one_pool", Switch(), True, "OpenBLAS's threaded jobs run on the threads of cct's parallel "
         "kernels (numba's OpenMP pool) while a TEST-phase net runs, so neither spins on the other's "
         "cores (cct.devices.pool)", PROCESS, "CCT_ONE_POOL"),
    Knob("schedule", _SCHEDULE, "auto", "how a net runs its backward and a solver its iterations "
         "(cct.runtime.scheduler)", NET, "CCT_SCHEDULE", "cct.set_schedule, cct train --schedule"),
    Knob("priorities", Priorities(), {}, "how far a weight gradient (alpha) and another parameter "
         "gradient (beta) rank below their layer's data gradient on the streams", NET),
    Knob("fusion", Switch(), True, "TEST-phase nets run chains of BatchNorm, Scale, Bias, ReLU, Dropout "
         "and Eltwise sums as one pass (cct.runtime.fusion)", NET, "CCT_FUSION", "cct.set_fusion"),
    Knob("share_diffs", Switch(), None, "a solver's train net keeps diffs never live together in shared "
         "buffers (default: on for cct train, off for a solver made from Python)", NET, "CCT_SHARE_DIFFS"),
    Knob("hybrid", Shares(), False, "on an OpenCL device, split each layer's batch between the host and "
         "the device (cct.runtime.hybrid)", NET, "CCT_HYBRID", "cct train --hybrid"),
    Knob("gpu", Devices(), None, "the OpenCL devices layers run on (cct device_query lists them)",
         PROCESS, "CCT_GPU", "cct.set_mode_gpu, cct.set_mode_cpu, cct.set_device, cct train --gpu"),
    Knob("device_id", Count(0), 0, "the OpenCL device gpu mode runs on", PROCESS, calls="cct.set_device"),
    Knob("mpi_overlap", Switch(), None, "over MPI, sum each gradient while the layers below run their "
         "backward in the sequential schedule (default: when the ranks span hosts)", PROCESS,
         "CCT_MPI_OVERLAP"),
    Knob("mpi_bucket", Bytes(), 2 * 2**20, "over MPI, parameters smaller than this are summed together, "
         "larger ones in pieces of it; 0: each whole (cct.training.distributed)", PROCESS, "CCT_MPI_BUCKET"),
    Knob("cache_dir", Text(), str(Path.home() / ".cache" / "cct"), "where cct caches its measurements "
         "(lowering choices, tuned threads, hybrid shares)", PROCESS, "CCT_CACHE_DIR"),
    Knob("caffe_alias", Switch(), True, "`import caffe` gives cct where no real pycaffe is installed",
         PROCESS, "CCT_CAFFE_ALIAS"),
    Knob("config", Text(), None, "the run-configuration file", PROCESS, "CCT_CONFIG",
         "cct.runtime.settings.load(path)"),
)
BY_NAME = {knob.name: knob for knob in KNOBS}
CONFIG_KEYS = ("layers", "default") + tuple(k.name for k in KNOBS if k.scope == NET)
LAYER_KEYS = tuple(k.name for k in KNOBS if k.scope == LAYER)


# --- the run configuration ------------------------------------------------------------
class RunConfig:
    """A parsed run configuration: every key and value checked, `source` (its
    path) naming it in messages."""

    def __init__(self, contents: Any, source: str = "<config>"):
        self.source = str(source)
        if not isinstance(contents, dict):
            raise ConfigError(f"{self.source}: must hold a JSON object, got {type(contents).__name__}")
        for key in contents:
            if key not in CONFIG_KEYS:
                raise ConfigError(f"{self.source}: {key}: unknown key; known keys: {', '.join(CONFIG_KEYS)}")
        layers = contents.get("layers", {})
        if not isinstance(layers, dict):
            raise ConfigError(f"{self.source}: layers: must be an object keyed by layer name")
        self.layers = {name: self._entries(f"layers.{name}", entries) for name, entries in layers.items()}
        self.default = self._entries("default", contents.get("default", {}))
        self.top = {key: self._checked(BY_NAME[key], key, value)
                    for key, value in contents.items() if key not in ("layers", "default")}

    def _entries(self, where: str, entries: Any) -> Dict[str, Any]:
        if not isinstance(entries, dict):
            raise ConfigError(f"{self.source}: {where}: must be an object of settings, got {json.dumps(entries)}")
        for key in entries:
            if key not in LAYER_KEYS:
                raise ConfigError(f"{self.source}: {where}.{key}: unknown key; known keys: {', '.join(LAYER_KEYS)}")
        return {key: self._checked(BY_NAME[key], f"{where}.{key}", value) for key, value in entries.items()}

    def _checked(self, knob: Knob, where: str, value: Any) -> Any:
        try:
            return knob.kind.check(value)
        except ValueError as error:
            raise ConfigError(f"{self.source}: {where}{_joined(error)}") from None

    def layer_value(self, layer: str, key: str) -> Any:
        """The layer's own entry for `key`, or None."""
        return self.layers.get(layer, {}).get(key)

    def default_value(self, key: str) -> Any:
        return self.default.get(key)

    def value(self, layer: str, key: str) -> Any:
        """The layer's entry, else the default's, else None."""
        found = self.layer_value(layer, key)
        return self.default_value(key) if found is None else found

    def __getattr__(self, key: str) -> Any:
        """A top-level entry (config.schedule, config.hybrid, ...), None where unset."""
        if key in BY_NAME and BY_NAME[key].scope == NET:
            return self.__dict__.get("top", {}).get(key)
        raise AttributeError(key)


def parse_config(text: str, source: str = "<config>") -> RunConfig:
    try:
        contents = json.loads(text)
    except ValueError as error:
        raise ConfigError(f"{source}: not valid JSON: {error}") from None
    return RunConfig(contents, source)


def read_config(path: Any) -> RunConfig:
    path = os.fspath(path)
    try:
        with open(path) as file:
            text = file.read()
    except OSError as error:
        raise ConfigError(f"{path}: cannot read the run configuration: {error.strerror}") from None
    return parse_config(text, path)


# --- explicit values: calls, flags and override() --------------------------------------
_explicit: Dict[str, Any] = {}      # knob name -> value set by a call; the one settings global
_version = [0]                      # bumped at every explicit change: a net's settings are then stale
_read_configs: Dict[str, RunConfig] = {}


def set_explicit(name: str, value: Any, call: str) -> None:
    """Set knob `name` explicitly (`call` names the caller in an error), or
    back to the other sources with None."""
    knob = BY_NAME[name]
    if value is None:
        _explicit.pop(name, None)
    else:
        if not (name == "config" and isinstance(value, RunConfig)):
            try:
                value = knob.kind.check(value)
            except ValueError as error:
                raise ConfigError(f"{call}{_joined(error)}") from None
        _explicit[name] = value
    _version[0] += 1


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Within the block, the knobs named take these values, as an explicit
    call would set them (None: unset); afterwards what was there before."""
    for name in values:
        if name not in BY_NAME:
            raise ConfigError(f"override: {name}: unknown knob; known: {', '.join(BY_NAME)}")
    saved = {name: _explicit.get(name) for name in values}
    try:
        for name, value in values.items():
            set_explicit(name, value, "override")
        yield
    finally:
        for name, value in saved.items():
            set_explicit(name, value, "override")


@contextlib.contextmanager
def restoring() -> Iterator[None]:
    """Whatever calls inside the block set, the explicit values of before
    afterwards (tests: a test's set_mode_gpu or --gpu ends with it)."""
    saved = dict(_explicit)
    try:
        yield
    finally:
        _explicit.clear()
        _explicit.update(saved)
        _version[0] += 1


def version() -> int:
    """Changes whenever an explicit value does."""
    return _version[0]


# --- resolution -------------------------------------------------------------------------
def from_environment(knob: Knob, environ: Optional[Mapping[str, str]] = None) -> Tuple[bool, Any]:
    """(found, value) from the knob's variable; a bad value names the variable."""
    environ = os.environ if environ is None else environ
    given = environ.get(knob.env, "").strip() if knob.env else ""
    if not given or (knob.name == "partitions" and given == "0"):     # CCT_PARTITIONS=0 counts as unset
        return False, None
    try:
        return True, knob.kind.text(given)
    except ValueError as error:
        raise ConfigError(f"environment variable {knob.env}{_joined(error)}") from None


def run_config(environ: Optional[Mapping[str, str]] = None) -> Optional[RunConfig]:
    """The run configuration in force: settings.load's, else the file
    CCT_CONFIG names (read once per path), else None."""
    loaded = _explicit.get("config")
    if isinstance(loaded, RunConfig):
        return loaded
    path = loaded or from_environment(BY_NAME["config"], environ)[1]
    if not path:
        return None
    if path not in _read_configs:
        _read_configs[path] = read_config(path)
    return _read_configs[path]


def value(name: str, layer: Optional[str] = None, config: Any = "active",
          environ: Optional[Mapping[str, str]] = None) -> Any:
    """Knob `name` (for `layer`, a layer-scope knob) by the precedence of the
    module docstring. `config`: the run configuration (default: the one in force)."""
    return source_value(name, layer, config, environ)[1]


def source_value(name: str, layer: Optional[str] = None, config: Any = "active",
                 environ: Optional[Mapping[str, str]] = None) -> Tuple[str, Any]:
    """(the source that decided, the value): "call", "layer", "default", "config",
    "environment" or "built-in"."""
    knob = BY_NAME[name]
    if name in _explicit:
        return "call", _explicit[name]
    if knob.in_config:
        config = run_config(environ) if config == "active" else config
        if config is not None:
            if knob.scope == LAYER and layer is not None and knob.name in config.layers.get(layer, {}):
                return "layer", config.layers[layer][knob.name]
            entries = config.default if knob.scope == LAYER else config.top
            if knob.name in entries:
                return ("default" if knob.scope == LAYER else "config"), entries[knob.name]
    found, result = from_environment(knob, environ)
    if found:
        return "environment", result
    return "built-in", knob.default


def table() -> str:
    """The knobs as a table: name, scope, variable, calls, default, meaning."""
    rows = [f"{k.name:<19} {k.scope:<8} {k.env or '-':<23} {json.dumps(k.default):<8} {k.meaning}"
            + (f" [{k.calls}]" if k.calls else "") for k in KNOBS]
    return "\n".join([f"{'knob':<19} {'scope':<8} {'variable':<23} {'default':<8} meaning", *rows])


if __name__ == "__main__":
    print(table())
