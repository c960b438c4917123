"""The layer contract and the registry of layer types.

A layer follows pycaffe's contract:
    setup(bottom, top)                    once, after construction (Caffe's LayerSetUp)
    reshape(bottom, top)                  before every forward; sizes the tops
    forward(bottom, top)                  top.data from bottom.data
    backward(top, propagate_down, bottom) bottom.diff from top.diff; parameter
                                          diffs ACCUMULATE (+=), bottom diffs are set
Blob counts are declared as class attributes, so the check and its message live
here once. Types register under Caffe's exact type string (V1 enum names are
mapped to these by cct.upgrade).
"""
from .errors import ConfigError, ShapeError, layer_where

TRAIN, TEST = 0, 1            # caffe.Phase values

LAYER_TYPES = {}              # Caffe type name -> Layer subclass


def register(type_name):
    """Class decorator: make a Layer subclass the implementation of `type_name`."""
    def add(cls):
        if type_name in LAYER_TYPES:
            raise RuntimeError(f"layer type {type_name!r} registered twice")
        cls.type = type_name
        LAYER_TYPES[type_name] = cls
        return cls
    return add


def layer_type_list():
    """Registered type names, sorted (pycaffe's caffe.layer_type_list())."""
    _load_builtin_layers()
    return sorted(LAYER_TYPES)


def create_layer(layer_param, phase=TRAIN, source=None):
    _load_builtin_layers()
    cls = LAYER_TYPES.get(layer_param.type)
    if cls is None:
        raise ConfigError(f"{layer_where(layer_param, source)}: unknown layer type "
                          f"{layer_param.type!r}; known types: {', '.join(sorted(LAYER_TYPES))}")
    return cls(layer_param, phase, source)


def _load_builtin_layers():
    from . import layers  # noqa: F401  (importing registers every family)


class Layer:
    type = None
    # Declared blob counts (Caffe's ExactNum*/MinNum*/MaxNum*); None: unconstrained.
    exact_bottoms = min_bottoms = max_bottoms = None
    exact_tops = min_tops = max_tops = None
    # Loss layers: top 0 gets loss_weight 1 unless the prototxt says otherwise,
    # and a missing top blob is created (Caffe's AutoTopBlobs).
    is_loss = False

    def __init__(self, layer_param, phase=TRAIN, source=None):
        self.layer_param = layer_param
        self.name = layer_param.name
        self.phase = phase
        self.source = source          # file the layer came from, for messages
        self.blobs = []               # learnable parameter Blobs
        self.param_propagate_down = []

    # --- the contract ----------------------------------------------------------
    def setup(self, bottom, top):
        pass

    def reshape(self, bottom, top):
        raise NotImplementedError(f"{self.where()}: reshape not implemented")

    def forward(self, bottom, top):
        raise NotImplementedError(f"{self.where()}: forward not implemented")

    def backward(self, top, propagate_down, bottom):
        if any(propagate_down):
            raise NotImplementedError(f"{self.where()}: backward not implemented")

    def allow_force_backward(self, bottom_index):
        # Loss layers' labels (bottom 1) never get a gradient, even with force_backward.
        return not (self.is_loss and bottom_index == 1)

    # --- helpers shared by all layers --------------------------------------------
    def where(self):
        return layer_where(self.layer_param, self.source)

    def config_error(self, field, message):
        return ConfigError(f"{self.where()}: {field}: {message}")

    def shape_error(self, message):
        return ShapeError(f"{self.where()}: {message}")

    def check_blob_counts(self, bottom, top):
        self._check_count("bottom", len(bottom), self.exact_bottoms, self.min_bottoms, self.max_bottoms)
        self._check_count("top", len(top), self.exact_tops, self.min_tops, self.max_tops)

    def _check_count(self, kind, got, exact, least, most):
        if exact is not None and got != exact:
            raise self.config_error(kind, f"takes exactly {exact} {kind} blob(s), got {got}")
        if least is not None and got < least:
            raise self.config_error(kind, f"takes at least {least} {kind} blob(s), got {got}")
        if most is not None and got > most:
            raise self.config_error(kind, f"takes at most {most} {kind} blob(s), got {got}")

    def num_auto_tops(self, num_tops_given):
        """How many anonymous tops the net must add (Caffe's AutoTopBlobs)."""
        if not self.is_loss:
            return 0
        wanted = self.exact_tops if self.exact_tops is not None else (self.min_tops or 0)
        return max(0, wanted - num_tops_given)

    def __repr__(self):
        return f"<{type(self).__name__} {self.name!r}>"
