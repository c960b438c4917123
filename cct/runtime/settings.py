"""cct run configuration: how to execute a net, kept out of the prototxt (and
out of caffe.proto). A JSON file, named by the environment variable CCT_CONFIG
or loaded with `cct.runtime.settings.load(path)`:

    {"layers":  {"conv1": {"lowering": 3, "partitions": 2}},
     "default": {"lowering": "auto", "measure": false},
     "share_diffs": false}

Keys, per layer (under "layers", by layer name) or for every layer ("default"):

    lowering            1, 2, 3 or "auto" (the chooser, cct.lowering.chooser)
    measure             true: "auto" times each type on the layer's shape
                        instead of trusting the cost model (cached per shape)
    lowering_budget_mb  largest lowering workspace matrix, MB; bigger batches
                        are lowered in chunks (cct.lowering.workspace)
    partitions          batch partitions (cct.runtime.executor); as a default it
                        applies only to the layers that can be partitioned

Top-level "share_diffs": true lets the solver's train net keep the diffs of
blobs whose gradients are never live together in shared buffers (cct.runtime.memory);
the environment variable CCT_SHARE_DIFFS (1 or 0), when set, decides instead.
Activation diffs then do not keep their values after backward. Left unset, it
is on for `cct train` (which never shows an activation's diff) and off for a
solver made from Python (pycaffe scripts read any blob's diff).

Unknown keys and bad values are errors naming the file and the key. Layers a
net does not have are ignored (a train and a test net share one file).
Precedence for a convolution's lowering type: the layer's entry, then the
CCT_LOWERING environment variable, then "default", then the chooser; the
budget likewise with CCT_LOWERING_BUDGET_MB.
"""
import json
import os

from cct.core.errors import ConfigError

CONFIG_ENV = "CCT_CONFIG"
SHARE_DIFFS_ENV = "CCT_SHARE_DIFFS"
TOP_KEYS = ("layers", "default", "share_diffs")
LOWERING_TYPES = ("Convolution", "Deconvolution")
KEYS = ("lowering", "measure", "lowering_budget_mb", "partitions")


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
    elif key == "partitions":
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
        self.share_diffs = contents.get("share_diffs")           # None: the caller's default
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
    path = os.environ.get(CONFIG_ENV, "").strip()
    if not path:
        return None
    if _from_env[0] != path:
        _from_env = (path, read(path))
    return _from_env[1]


def share_diffs_enabled(config=None, default=False):
    """Whether the solver shares its train net's diffs (cct.runtime.memory):
    CCT_SHARE_DIFFS when set (1/true/yes/on or 0/false/no/off), else the
    configuration's "share_diffs" when it has one, else `default`."""
    given = os.environ.get(SHARE_DIFFS_ENV, "").strip()
    if given:
        if given.lower() in ("1", "true", "yes", "on"):
            return True
        if given.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{SHARE_DIFFS_ENV}: must be 1 or 0, got {given!r}")
    config = config or active()
    if config is None or config.share_diffs is None:
        return default
    return config.share_diffs


def apply(net, config=None):
    """Apply the configuration to a built Net: check that every setting fits
    its layer's type and set the configured batch partitions on the net's
    executor. Returns {layer name: partitions} set."""
    config = config or active()
    if config is None:
        return {}
    applied = {}
    for index, layer in enumerate(net.layers):
        own = config.layers.get(layer.name, {})
        for key in own:
            if key != "partitions" and layer.type not in LOWERING_TYPES:
                raise ConfigError(f"{config.source}: layers.{layer.name}.{key}: applies to Convolution and "
                                  f"Deconvolution layers; '{layer.name}' is a {layer.type} layer")
        partitions = own.get("partitions")
        if partitions is None:
            partitions = config.default_value("partitions")
            if partitions is None or not net.executor.partitionable(index):
                continue
        elif partitions > 1 and not net.executor.partitionable(index):
            raise ConfigError(f"{config.source}: layers.{layer.name}.partitions: layer '{layer.name}' "
                              f"({layer.type}) cannot be batch-partitioned")
        bottoms = net.bottom_vecs[index]
        batch = bottoms[0].shape[0] if bottoms and bottoms[0].shape else 1
        partitions = min(partitions, max(1, batch))
        net.executor.set_partitions(index, partitions)
        applied[layer.name] = partitions
    return applied
