"""The layer contract and the registry of layer types.

A layer follows pycaffe's contract:
    setup(bottom, top)                    once, after construction (Caffe's LayerSetUp)
    reshape(bottom, top)                  before every forward; sizes the tops
    forward(bottom, top)                  top.data from bottom.data
    backward(top, propagate_down, bottom) bottom.diff from top.diff; parameter
                                          diffs ACCUMULATE (+=), bottom diffs are set
Blob counts are declared as class attributes, so the check and its message live
here once. Types register under Caffe's exact type string (V1 enum names are
mapped to these by cct.formats.upgrade).

Work arrays: big temporaries are mmapped and page-faulted afresh on every
allocation (tens of ms for CaffeNet's blobs), so hot paths reuse arrays:
`self.scratch(...)` for state a layer keeps from forward to backward (its own,
per layer and per batch-partition clone), `self.work(...)` for temporaries that
live only inside one forward or backward call (the running thread's, shared by
every layer that thread runs, so they cost threads x the largest request, not
layers x partitions).
"""
import threading

import numpy as np

from cct.core import fillers
from cct.core.blob import Blob
from cct.core.errors import ConfigError, ShapeError, layer_where

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
    check_layer_type(layer_param, source)
    return LAYER_TYPES[layer_param.type](layer_param, phase, source)


def check_layer_type(layer_param, source=None):
    """An unknown type is an error that lists the known ones."""
    _load_builtin_layers()
    if layer_param.type not in LAYER_TYPES:
        raise ConfigError(f"{layer_where(layer_param, source)}: type: unknown layer type "
                          f"{layer_param.type!r}; known types: {', '.join(sorted(LAYER_TYPES))}")


def _load_builtin_layers():
    from cct import layers  # noqa: F401  (importing registers every family)


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

    def filled_blob(self, shape, filler_param, field):
        """A parameter blob of `shape` filled by `filler_param`; a bad filler's
        error names this layer and `field` (e.g. "convolution_param.weight_filler")."""
        return fillers.fill(Blob(shape), filler_param, where=f"{self.where()}: {field}")

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

    def scratch(self, name, shape, dtype):
        """A work array of this layer's, kept between calls (contents included).
        A batch-partition clone (a shallow copy, cct.runtime.executor) that finds its
        original's array allocates its own instead of sharing it across threads."""
        key = "_scratch_" + name
        held = self.__dict__.get(key)
        shape, dtype = tuple(shape), np.dtype(dtype)
        if held is not None and held[0] == id(self) and held[1].shape == shape and held[1].dtype == dtype:
            return held[1]
        self.__dict__[key] = None                   # drop the old array before making the new one
        array = np.empty(shape, dtype)
        self.__dict__[key] = (id(self), array)
        return array

    @staticmethod
    def work(name, shape, dtype):
        """An uninitialised array from the calling thread's store for `name`, valid
        until the next request for `name` on this thread: only for temporaries
        used inside one forward or backward call, never kept across calls (the
        next layer reuses the memory). Layers running one after another on a
        thread share the store; partitions running at once are on other threads."""
        dtype = np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        stores = _thread_stores()
        store = stores.get(name)
        if store is None or store.size < nbytes:
            stores[name] = None                     # free the old store first
            # rounded up to whole 4 KiB pages, the store holds any dtype aligned
            store = stores[name] = np.empty(-(-max(nbytes, 1) // 4096) * 4096, np.uint8)
        return store[:nbytes].view(dtype).reshape(shape)

    def num_auto_tops(self, num_tops_given):
        """How many anonymous tops the net must add (Caffe's AutoTopBlobs)."""
        if not self.is_loss:
            return 0
        wanted = self.exact_tops if self.exact_tops is not None else (self.min_tops or 0)
        return max(0, wanted - num_tops_given)

    def __repr__(self):
        return f"<{type(self).__name__} {self.name!r}>"


_local = threading.local()


def _thread_stores():
    """{name: flat uint8 store} of the calling thread (Layer.work)."""
    stores = getattr(_local, "stores", None)
    if stores is None:
        stores = _local.stores = {}
    return stores


def thread_work_bytes():
    """Bytes held by the calling thread's work stores (for tests and reports)."""
    return sum(store.size for store in _thread_stores().values() if store is not None)
