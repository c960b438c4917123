"""The layer contract and the registry of layer types.

A layer follows pycaffe's contract:
    setup(bottom, top)                    once, after construction (Caffe's LayerSetUp)
    reshape(bottom, top)                  before every forward; sizes the tops
    forward(bottom, top)                  top.data from bottom.data
    backward(top, propagate_down, bottom) bottom.diff from top.diff; parameter
                                          diffs ACCUMULATE (+=), bottom diffs are set
`set_up(bottom, top)` is Caffe's SetUp, the one sequence everything that
builds a layer calls: check the blob counts, setup, reshape. Blob counts are
declared as class attributes, so the check and its message live here once.
Types register under Caffe's exact type string (V1 enum names are mapped to
these by cct.formats.upgrade).

What the runtime reads (declarations, never type names):
    batch_independent      the batch axis may be split (can_partition decides per blob shapes)
    flops(bottom, top)     (forward, backward_data, backward_params) FLOPs
    run_settings           the run-setting keys the layer takes; configure(settings) gets them
    clone(share)           a twin for one of `share` batch partitions run at once
    run_partitions(count, threads, spread)
                           told after every reshape how many partitions the next
                           forward and backward run as, and for a layer run whole
                           on several threads, how to spread its own passes on them
    draws_random           forward draws from the process's random stream
    splits_backward        backward is also offered as sub-tasks a scheduler may run apart:
        backward_param(i, top, bottom)         parameter i's gradient, ACCUMULATED into
                                               blobs[i].diff (reads top diffs, bottom data)
        backward_data(top, propagate_down, bottom)
                                               the bottom diffs propagate_down asks for, SET
                                               (reads top diffs, parameter data)
      backward() is then those sub-tasks in turn, parameters first: in place, the
      bottom's diff is the top's, which the data gradient overwrites. A layer may
      keep a backward of its own that shares work between them (a convolution's
      lifted gradient), as long as the numbers are bitwise the sub-tasks' (tested).
    epilogue(bottom, top)  the forward as one element-wise step inference fusion may
                           chain into one pass (cct.runtime.fusion), or None
    aliases                (Split) set by fusion: the tops share the bottom's data
    views                  (Concat) set by fusion: the bottoms' data in the top's store
    planned_bytes(...)     work memory the memory plan counts (cct.runtime.memory_plan)
    tops_follow_values     forward reshapes its tops to the values' count (detections)
    ahead()                arrays the first forward will fill, allocated now so that
                           their pages can be faulted in before it (cct.runtime.executor)
    params_loaded()        the parameters were just read from a file (Net.copy_from):
                           derive now what the forward derives from them

On a device (cct.devices; Caffe's Forward_gpu, with its fallback):
    runs_on(device, bottom, top)            whether the layer's device path covers
                                            its settings at these blobs; else the
                                            runtime runs forward/backward on the host,
                                            the blobs synced (cct.runtime.executor)
    forward_on(device, bottom, top)         forward with the device's primitives, on
                                            the blobs' device buffers (Blob.device_data)
    backward_on(device, top, propagate_down, bottom)
                                            the same contract as backward
  Written once against cct.devices.base: the numpy CPU device runs it too, and
  the layer tests check it against the layer's own forward and backward.

Work arrays: big temporaries are mmapped and page-faulted afresh on every
allocation (tens of ms for CaffeNet's blobs), so hot paths reuse arrays:
`self.scratch(...)` for state a layer keeps from forward to backward (its own,
per layer and per partition twin), `self.work(...)` for temporaries that live
only inside one forward or backward call (the running thread's arena,
cct.core.workspace, shared by every layer that thread runs, so they cost
threads x the largest request, not layers x partitions).
"""
import copy
from types import TracebackType
from typing import Any, Callable, Dict, List, Literal, Mapping, Optional, Protocol, Sequence, Tuple, Type, TypeVar

import numpy as np
import numpy.typing as npt

from cct.core import fillers
from cct.core.arrays import Array, Shape
from cct.core.blob import Blob, Buffer, Layout, NetLayout
from cct.core.allocation import check_allocation
from cct.core.errors import ConfigError, MemoryLimitError, ShapeError, layer_where
from cct.core.workspace import thread_arena
from cct.proto import caffe_pb2

TRAIN, TEST = 0, 1            # caffe.Phase values

# A cct.devices.base.Device: devices sit above the core, which does not import them.
Device = Any
# A layer's pass for inference fusion (Layer.epilogue): (op, its arguments,
# whether backward reads the input the fused pass drops), e.g. ("relu", 0.0, False).
Epilogue = Tuple[str, Any, bool]
FLOPs = Tuple[int, int, int]  # (forward, backward_data, backward_params)


class Spread(Protocol):
    """What run_partitions is given to spread a layer's own passes on threads
    (cct.runtime.threads.Spread, above the core)."""
    @property
    def parts(self) -> int: ...
    def __call__(self, function: Callable[..., Any], pieces: Sequence[Sequence[Any]]) -> None: ...


# Caffe type name -> Layer subclass. Filled by importing cct.layers, which
# importing any part of cct does (cct/__init__.py imports it).
LAYER_TYPES: Dict[str, Type["Layer"]] = {}
LayerT = TypeVar("LayerT", bound="Layer")   # a Layer subclass, kept by register and clone


def register(type_name: str) -> Callable[[Type[LayerT]], Type[LayerT]]:
    """Class decorator: make a Layer subclass the implementation of `type_name`."""
    def add(cls: Type[LayerT]) -> Type[LayerT]:
        if type_name in LAYER_TYPES:
            raise RuntimeError(f"layer type {type_name!r} registered twice")
        cls.type = type_name
        LAYER_TYPES[type_name] = cls
        return cls
    return add


def layer_type_list() -> List[str]:
    """Registered type names, sorted (pycaffe's caffe.layer_type_list())."""
    return sorted(LAYER_TYPES)


def create_layer(layer_param: caffe_pb2.LayerParameter, phase: int = TRAIN, source: Optional[str] = None) -> "Layer":
    check_layer_type(layer_param, source)
    return LAYER_TYPES[layer_param.type](layer_param, phase, source)


def check_layer_type(layer_param: caffe_pb2.LayerParameter, source: Optional[str] = None) -> None:
    """An unknown type is an error that lists the known ones."""
    if layer_param.type not in LAYER_TYPES:
        raise ConfigError(f"{layer_where(layer_param, source)}: type: unknown layer type "
                          f"{layer_param.type!r}; known types: {', '.join(sorted(LAYER_TYPES))}")


LayoutKey = List[Tuple[Shape, int]]     # per blob: (shape, id of its data view)


def _layout_key(blobs: Sequence[Blob]) -> LayoutKey:
    """Each blob's shape and the id of its data view (unique while the
    caller holds the views)."""
    return [(blob.shape, id(blob.data_view)) for blob in blobs]


class Layer:
    type: Optional[str] = None
    # Declared blob counts (Caffe's ExactNum*/MinNum*/MaxNum*); None: unconstrained.
    exact_bottoms: Optional[int] = None
    min_bottoms: Optional[int] = None
    max_bottoms: Optional[int] = None
    exact_tops: Optional[int] = None
    min_tops: Optional[int] = None
    max_tops: Optional[int] = None
    # Loss layers: top 0 gets loss_weight 1 unless the prototxt says otherwise,
    # and a missing top blob is created (Caffe's AutoTopBlobs).
    is_loss = False
    # True: every sample's outputs and gradients depend on that sample alone,
    # and forward draws no random numbers, so the runtime may split the batch.
    batch_independent = False
    splits_backward = False       # True: backward_param and backward_data are implemented
    # True: forward draws from the process's random stream (cct.core.rng), so the
    # order of such forwards decides the numbers (cct.runtime.graph keeps it)
    draws_random = False
    # False: the runtime's default plan keeps the layer whole even when it is
    # large (it may still be split by a plan or the tuner).
    split_by_default = True
    run_settings: Tuple[str, ...] = ()   # keys of the run configuration this layer takes
    # False: the net never runs this layer's backward (Net.layer_need_backward,
    # which the net sets here), so the layer may plan for its forward alone
    # (Convolution's lowering choice in a deploy net).
    runs_backward = True
    # True: reshape reads nothing but its blobs' shapes and data stores and
    # the layer's own settings, so a forward may skip it while they are as
    # its last reshape left them (reshape_if_changed)
    reshape_reads_layout = False
    # True: forward reshapes the tops to what the values give (a detection
    # layer's row count), so their shape changes from forward to forward; a
    # top of such a layer that no layer reads leaves the layout alone (the
    # executor marks it, Blob.in_layout), so an execution plan survives it
    tops_follow_values = False
    layout: Optional[NetLayout] = None   # the net's (Net sets it): what a changed choice makes stale
    # (the blobs' layout key, their data views, which keep its ids unique)
    _reshaped_layout: Optional[Tuple[LayoutKey, List[Array]]] = None
    # What inference fusion (cct.runtime.fusion) reads, each None or False where
    # the layer has none: `epilogue(bottom, top)`, a method giving the pass the
    # layer is in a fused run; `output_relu`, True where forward can end with a
    # ReLU in its output store (fuse_output_relu); `aliases` and `views`, the
    # switch of a Split whose tops alias its bottom and of a Concat whose bottoms
    # live in its top (False until fusion turns them on).
    epilogue: Optional[Callable[[Sequence[Blob], Sequence[Blob]], Optional[Epilogue]]] = None
    output_relu = False
    aliases: Optional[bool] = None
    views: Optional[bool] = None
    # True: a training forward keeps its lowering for the backward, which the
    # memory plan counts and gives up where the run would not fit (Convolution)
    keep_lowering = False
    # The weight of each top in the loss, set by the net (Caffe's loss_weight)
    loss_weights: List[float]

    def __init__(self, layer_param: caffe_pb2.LayerParameter, phase: int = TRAIN,
                 source: Optional[str] = None) -> None:
        self.layer_param = layer_param
        self.name: str = layer_param.name
        self.phase = phase
        self.source = source          # file the layer came from, for messages
        self.blobs: List[Blob] = []   # learnable parameter Blobs
        self.param_propagate_down: List[bool] = []

    # --- the contract ----------------------------------------------------------
    def set_up(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        """Caffe's SetUp: check the blob counts, setup, reshape. Not to be
        overridden (Python layers override setup and reshape)."""
        self.check_blob_counts(bottom, top)
        in_place = {index: blob.shape for index, blob in enumerate(top) if any(blob is b for b in bottom)}
        with self.naming_allocations(top):
            self.setup(bottom, top)
            self.reshape(bottom, top)
        self._check_in_place(in_place, top)

    def _check_in_place(self, shapes: Dict[int, Shape], top: Sequence[Blob]) -> None:
        """A top that is also a bottom must keep its shape (Caffe's Reshape and
        Flatten refuse to run in place): else the bottom changed under the
        layer, and its forward would read the input as another shape."""
        for index, shape in shapes.items():
            if top[index].shape != shape:
                raise self.shape_error(f"top '{self.layer_param.top[index]}' is also a bottom (in place), but "
                                       f"{self.type} changes its shape from {shape} to {top[index].shape}; "
                                       "give the top its own name")

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        pass

    def reshape_if_changed(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        """Reshape, as Caffe's Layer::Forward does first, unless the layer
        declares reshape_reads_layout and every bottom and top still has the
        shape and the data view its last reshape here left. A net mostly
        forwards the shapes it had, and reshaping to them again was a
        measurable part of a batch-1 forward (BENCHMARKS.md, "Behind cct/core/layer.py")."""
        if not self.reshape_reads_layout:
            self.reshape(bottom, top)
            return
        blobs = [*bottom, *top]
        known = self._reshaped_layout
        if known is not None and known[0] == _layout_key(blobs):
            return
        self.reshape(bottom, top)
        self._reshaped_layout = (_layout_key(blobs), [blob.data_view for blob in blobs])

    def reshape_again(self) -> None:
        """The next reshape_if_changed reshapes: something its reshape reads
        besides the blobs' layout has changed (and plans bound to it are stale)."""
        self._reshaped_layout = None
        self.layout_changed()

    def layout_changed(self) -> None:
        """A choice a plan's bound step holds has changed: its net's plan is stale."""
        (self.layout or Layout).changed()

    def weighted_loss(self, top: Sequence[Blob]) -> float:
        """After forward: set the loss tops' diffs to their loss weights (what
        backward starts from) and return the weighted loss (Caffe's Layer::Forward)."""
        loss = 0.0
        for blob, weight in zip(top, self.loss_weights):
            if weight:
                blob.diff[...] = weight
                loss += weight * float(blob.data.sum(dtype=np.float64))
        return loss

    def weighted_loss_on(self, device: Device, top: Sequence[Blob]) -> float:
        """weighted_loss in a device run: the diffs set by a fill on `device`
        and the loss read through a read-only view, so neither the loss nor
        its diff changes sides (nothing is uploaded again for the backward)."""
        loss = 0.0
        for blob, weight in zip(top, self.loss_weights):
            if weight:
                blob.fill_device_diff(device, weight)
                loss += weight * float(blob.read_data().sum(dtype=np.float64))
        return loss

    # --- bound for an execution plan (cct.runtime.plan) ---------------------------------
    def bind_forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> Callable[[], None]:
        """Forward on these blobs as one call, with whatever the layer decides
        per shape decided now; valid while the layout stays (Layout.epoch and
        its net's NetLayout: a layer that binds a choice it may change calls
        layout_changed() when it does)."""
        return lambda: self.forward(bottom, top)      # looked up at each call, as the executor does

    def bind_backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                      bottom: Sequence[Blob]) -> Callable[[], None]:
        """Backward on these blobs as one call (bind_forward's terms)."""
        return lambda: self.backward(top, propagate_down, bottom)

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        raise NotImplementedError(f"{self.where()}: reshape not implemented")

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        raise NotImplementedError(f"{self.where()}: forward not implemented")

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if self.splits_backward:
            for index in range(len(self.blobs)):
                if self.param_wanted(index):
                    self.backward_param(index, top, bottom)
            if any(propagate_down):
                self.backward_data(top, propagate_down, bottom)
        elif any(propagate_down):
            raise NotImplementedError(f"{self.where()}: backward not implemented")

    def param_wanted(self, index: int) -> bool:
        """Whether parameter `index` gets a gradient: param_propagate_down says,
        and a parameter it does not cover (a layer used outside a net) does."""
        flags = self.param_propagate_down
        return bool(flags[index]) if index < len(flags) else True

    # --- backward as sub-tasks (splits_backward) --------------------------------------
    def backward_param(self, index: int, top: Sequence[Blob], bottom: Sequence[Blob]) -> None:
        """Accumulate parameter `index`'s gradient into blobs[index].diff."""
        raise NotImplementedError(f"{self.where()}: backward_param not implemented")

    def backward_data(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        """Set the diffs of the bottoms propagate_down asks for."""
        raise NotImplementedError(f"{self.where()}: backward_data not implemented")

    # --- on a device ---------------------------------------------------------------
    def runs_on(self, device: Device, bottom: Sequence[Blob], top: Sequence[Blob]) -> bool:
        """Whether forward_on and backward_on cover this layer at these blobs."""
        return False

    def device_scratch(self, device: Device, name: str, count: int) -> Buffer:
        """A buffer of at least `count` elements on `device` that this layer
        keeps from forward_on to backward_on (its own, as scratch(); a saved
        input, a pooling mask); made anew for another device or a larger count."""
        key = f"_scratch_device_{name}"
        kept = self.__dict__.get(key)
        if kept is None or kept[0] is not device or kept[1].size < count:
            kept = (device, device.empty(count))
            self.__dict__[key] = kept
        return kept[1]

    @staticmethod
    def all_float32(*blob_lists: Sequence[Blob]) -> bool:
        """Devices compute in float32 (the gradient checks' float64 blobs stay on the host)."""
        return all(blob.dtype == np.float32 for blobs in blob_lists for blob in blobs)

    def forward_on(self, device: Device, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        raise NotImplementedError(f"{self.where()}: no device path")

    def backward_on(self, device: Device, top: Sequence[Blob], propagate_down: Sequence[bool],
                    bottom: Sequence[Blob]) -> None:
        raise NotImplementedError(f"{self.where()}: no device path")

    # --- data-parallel training (cct.training.distributed) -------------------------
    def set_shard(self, rank: int, size: int, seed: int) -> None:
        """Read only shard `rank` of `size` of the data source from now on
        (the trainer's rank among `size` processes), shuffling with a
        generator seeded by `seed`, the same on every rank, so the shards stay
        disjoint. Layers that read no data source ignore it."""

    # --- what the runtime reads ---------------------------------------------------
    def can_partition(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> bool:
        """Whether the runtime may split this layer's batch axis at these blobs
        (it checks their batch sizes itself)."""
        return self.batch_independent

    def flops(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> FLOPs:
        """(forward, backward_data, backward_params) FLOPs at the blobs' current
        shapes (conventions in cct.runtime.profile): backward_data is the cost of
        the bottom gradients, backward_params of the parameter gradients. 0 for
        memory-bound layers."""
        return 0, 0, 0

    def planned_bytes(self, bottom: Sequence[Blob], top: Sequence[Blob], partitions: int) -> Dict[str, int]:
        """Memory the layer will take beyond its blobs and the arrays it holds,
        for the memory plan (cct.runtime.memory_plan), in bytes by kind:
        "lowering" or "work.NAME", what one of its `partitions` asks that slot
        of its thread's arena for (Layer.work); "kept", what one of its
        partitions keeps from forward to backward to save time (a
        convolution's lowering), given up when the plan does not fit with it
        (its keep_lowering set False); "held", arrays the layer keeps
        beyond its attributes' own, once for all its partitions (Winograd's
        transformed weights); "prefetch", batches a prefetch thread keeps ready.
        Layers with big work arrays say so."""
        return {}

    def ahead(self) -> List[Array]:
        """Arrays the layer's first forward fills, allocated now (unfilled)
        and used by that forward, so that the executor can fault their pages
        in while the weights load: Winograd's transformed weights. Only for
        arrays planned_bytes already counts."""
        return []

    def params_loaded(self) -> None:
        """The parameters were just read from a weights file (Net.copy_from):
        derive now, as part of the load, what the forward would derive from
        them on its first call (Winograd's transformed weights); the forward
        still checks them, so a later write through pycaffe is seen."""

    def configure(self, settings: Mapping[str, Any]) -> None:
        """Take {key: value} for the keys in run_settings (cct.runtime.settings)."""

    def clone(self: LayerT, share: int = 1) -> LayerT:
        """A twin of this layer for one of `share` batch partitions that run at
        once (cct.runtime.partition): its settings and parameter blobs are the
        original's (the runtime gives it parameter views), its scratch arrays
        its own. Layers whose settings the twins must follow override this."""
        twin = copy.copy(self)
        for key in [key for key in vars(twin) if key.startswith("_scratch_")]:
            del twin.__dict__[key]
        return twin

    def run_partitions(self, count: int, threads: Optional[int] = None, spread: Optional[Spread] = None) -> None:
        """The runtime runs the next forward and backward as `count` batch
        partitions (decided after every reshape, cct.runtime.executor), each
        call at `threads` BLAS threads (None: not said). A layer whose own
        choices depend on the batch one call sees overrides this. `spread`,
        for a layer run whole on several threads (else None): its own
        compiled passes may run in pieces on them, spread(function, pieces)
        calling function(*piece) for each at once (up to spread.parts
        pieces; cct.runtime.threads.Spread)."""

    def allow_force_backward(self, bottom_index: int) -> bool:
        # Loss layers' labels (bottom 1) never get a gradient, even with force_backward.
        return not (self.is_loss and bottom_index == 1)

    # --- helpers shared by all layers --------------------------------------------
    def where(self) -> str:
        return layer_where(self.layer_param, self.source)

    def config_error(self, field: str, message: str) -> ConfigError:
        return ConfigError(f"{self.where()}: {field}: {message}")

    def shape_error(self, message: str) -> ShapeError:
        return ShapeError(f"{self.where()}: {message}")

    def filled_blob(self, shape: Sequence[int], filler_param: caffe_pb2.FillerParameter, field: str) -> Blob:
        """A parameter blob of `shape` filled by `filler_param`; a bad filler's
        error, or a blob too large, names this layer and `field` (e.g.
        "convolution_param.weight_filler")."""
        try:
            blob = Blob(shape)
        except MemoryLimitError as error:
            raise error.renamed(f"{self.where()}: parameter blob ({field})") from None
        if blob.count and fillers.fills_zeros(filler_param):
            return blob               # a new blob holds +0.0 already: no pass over its pages (ResNet-50's 100 MB)
        return fillers.fill(blob, filler_param, where=f"{self.where()}: {field}")

    def naming_allocations(self, top: Sequence[Blob]) -> "_NamingAllocations":
        """Name this layer, and the top when it is one, in an array refused as
        too large inside the block (the runtime wraps reshape, forward and
        backward in it): `layer 'ip1' (InnerProduct): top 'ip1' of shape ...`."""
        return _NamingAllocations(self, top)

    def named_allocation_error(self, error: MemoryLimitError, top: Sequence[Blob]) -> MemoryLimitError:
        """A MemoryLimitError raised in this layer's call, under its name and the top's."""
        return error.renamed(f"{self.where()}: {self._array_name(error, top)}")

    def _array_name(self, error: MemoryLimitError, top: Sequence[Blob]) -> str:
        for index, blob in enumerate(top):
            if blob is error.blob:
                names = self.layer_param.top
                return f"top '{names[index]}'" if index < len(names) else f"top #{index}"
        return error.what

    def check_blob_counts(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        self._check_count("bottom", len(bottom), self.exact_bottoms, self.min_bottoms, self.max_bottoms)
        self._check_count("top", len(top), self.exact_tops, self.min_tops, self.max_tops)

    def _check_count(self, kind: str, got: int, exact: Optional[int], least: Optional[int],
                     most: Optional[int]) -> None:
        if exact is not None and got != exact:
            raise self.config_error(kind, f"takes exactly {exact} {kind} blob(s), got {got}")
        if least is not None and got < least:
            raise self.config_error(kind, f"takes at least {least} {kind} blob(s), got {got}")
        if most is not None and got > most:
            raise self.config_error(kind, f"takes at most {most} {kind} blob(s), got {got}")

    def scratch(self, name: str, shape: Sequence[int], dtype: npt.DTypeLike) -> Array:
        """A work array of this layer's, kept between calls (contents included);
        a partition twin has its own (clone drops the original's)."""
        key = "_scratch_" + name
        held = self.__dict__.get(key)
        shape, dtype = tuple(shape), np.dtype(dtype)
        if held is not None and held.shape == shape and held.dtype == dtype:
            return held
        self.__dict__[key] = None                   # drop the old array before making the new one
        check_allocation(shape, dtype, f"work array '{name}'")
        array = self.__dict__[key] = np.empty(shape, dtype)
        return array

    @staticmethod
    def work(name: str, shape: Sequence[int], dtype: npt.DTypeLike) -> Array:
        """An uninitialised array from the calling thread's arena, valid until
        the next request for `name` on this thread: only for temporaries used
        inside one forward or backward call, never kept across calls (the next
        layer reuses the memory). Partitions running at once are on other threads."""
        return thread_arena().empty("work." + name, shape, dtype)

    def num_auto_tops(self, num_tops_given: int) -> int:
        """How many anonymous tops the net must add (Caffe's AutoTopBlobs)."""
        if not self.is_loss:
            return 0
        wanted = self.exact_tops if self.exact_tops is not None else (self.min_tops or 0)
        return max(0, wanted - num_tops_given)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


class _Named(Protocol):
    """What NoBackward reads of the Layer it is mixed into."""
    type: Optional[str]

    def where(self) -> str: ...


class NoBackward:
    """Mixin for layers Caffe gives no backward (NOT_IMPLEMENTED): refuse a
    requested gradient clearly, and keep force_backward from requesting one."""

    def backward(self: _Named, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if any(propagate_down):
            raise NotImplementedError(f"{self.where()}: {self.type} has no backward; "
                                      "its bottoms cannot receive a gradient")

    def allow_force_backward(self, bottom_index: int) -> bool:
        return False


class _NamingAllocations:
    """Layer.naming_allocations's block. A class, not a generator context
    manager: the runtime enters one for every layer of every pass, and
    contextlib's costs 0.95 us a block against 0.27 here (BENCHMARKS.md,
    "Session 10: per-layer costs, kept fused passes, Winograd channels innermost")."""
    __slots__ = ("layer", "top")

    def __init__(self, layer: Layer, top: Sequence[Blob]) -> None:
        self.layer, self.top = layer, top

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Optional[Type[BaseException]], error: Optional[BaseException],
                 traceback: Optional[TracebackType]) -> Literal[False]:
        if kind is None or not isinstance(error, MemoryLimitError) or error.named:
            return False                            # named already: by filled_blob, or an inner layer
        raise self.layer.named_allocation_error(error, self.top) from None
