"""Net: a directed acyclic graph of layers built from a NetParameter, with the
pycaffe interface (blobs, params, layers, forward, backward, ...).

Construction is Caffe's Net::Init: upgrade -> filter by NetState -> insert
splits -> instantiate layers in order, wiring blobs by name (in-place when a
top names its bottom), sharing named params, then deciding which layers and
bottoms need backward (Caffe's rules, force_backward and propagate_down).
"""
import logging
import os
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union, cast

import numpy as np
import numpy.typing as npt

from cct.core.arrays import Array
from cct.core.blob import Blob, Layout, NetLayout
from cct.core.allocation import charging, format_bytes
from cct.core.errors import ConfigError, MemoryLimitError, ShapeError, WeightsError
from cct.core.layer import TEST, TRAIN, Layer, check_layer_type, create_layer
from cct.core.passes import filter_net, insert_splits, legacy_crop_offsets
from cct.formats import pages
from cct.formats import weights as weights_io
from cct.formats.prototxt import net_source, read_net
from cct.formats.upgrade import upgrade_net
from cct.proto import caffe_pb2

if TYPE_CHECKING:                 # for annotations only: Net.executor imports it lazily
    from cct.runtime.executor import Executor

log = logging.getLogger("cct")

# Threads that derive values from loaded parameters at once (Net._loaded)
LOAD_THREADS = 4
AUTOMATIC_TOP = "(automatic)"   # Caffe's name for the tops a loss layer adds itself

Path = Union[str, bytes, "os.PathLike[Any]"]
# A net as Net() takes it: a prototxt path, prototxt text, or a caffe_pb2.NetParameter
NetSource = Union[str, "os.PathLike[Any]", caffe_pb2.NetParameter]


class Net:
    """A Caffe net. `Net(prototxt, phase, weights=None, level=0, stages=())`, or
    pycaffe's legacy `Net(prototxt, weights, phase)`; the prototxt may also be a
    caffe_pb2.NetParameter."""
    # What __init__ and _build set (the public names are pycaffe's)
    source: str
    phase: int
    net_param: caffe_pb2.NetParameter
    memory_baseline: int
    name: str
    layers: List[Layer]
    _layer_names: List[str]
    layer_dict: "OrderedDict[str, Layer]"
    blobs: "OrderedDict[str, Blob]"
    bottom_vecs: List[List[Blob]]
    top_vecs: List[List[Blob]]
    _bottom_names: List[List[str]]
    _top_names: List[List[str]]
    bottom_need_backward: List[List[bool]]
    layer_need_backward: List[bool]
    blob_loss_weights: "OrderedDict[str, float]"
    inputs: List[str]
    outputs: List[str]
    _executor: Optional["Executor"]
    pages: pages.FaultIn
    layout: NetLayout
    _blob_needs_backward: Dict[str, bool]           # while building
    _available: "OrderedDict[str, bool]"            # while building
    _named_first: Dict[str, int]                    # while building
    _beside: Optional[weights_io.CopyBeside]        # while building with weights
    # the parameter tables (_init_param_tables)
    _params: List[Blob]
    _param_owners: List[int]
    _param_layer_indices: List[Tuple[int, int]]
    _param_names_index: Dict[str, int]
    learnable_params: List[Blob]
    params_lr: List[float]
    params_weight_decay: List[float]
    _learnable_has_lr: List[bool]
    _learnable_has_decay: List[bool]
    _learnable_index_of_param: List[int]

    def __init__(self, network: NetSource, phase: Union[int, Path, None] = None,
                 weights: Union[Path, int, None] = None, level: int = 0, stages: Sequence[str] = (),
                 **kwargs: Any) -> None:
        if isinstance(phase, (str, bytes)) or hasattr(phase, "__fspath__"):
            phase, weights = weights, phase          # legacy form (prototxt, weights, phase)
        if "weights" in kwargs:
            weights = kwargs.pop("weights")
        if kwargs:
            raise TypeError(f"Net() got unexpected arguments {sorted(kwargs)}")
        if phase not in (TRAIN, TEST):
            raise ConfigError(f"Net(): phase must be cct.TRAIN or cct.TEST, got {phase!r}")
        self.source = net_source(network)
        param = upgrade_net(read_net(network), source=str(self.source))
        for layer_param in param.layer:       # named before the passes, which see only blobs
            check_layer_type(layer_param, str(self.source))
        state = caffe_pb2.NetState()
        state.CopyFrom(param.state)
        state.phase, state.level = phase, level
        state.stage.extend(stages)          # added to the prototxt's own stages
        param.state.CopyFrom(state)
        self.phase = cast(int, phase)      # TRAIN or TEST, checked above
        source = str(self.source)
        self.net_param = insert_splits(legacy_crop_offsets(filter_net(param, state, source), source), source)
        # a path (the legacy form's, swapped above), copied as the layers are built
        beside = self._beside = weights_io.CopyBeside(cast(Path, weights)) if weights else None
        try:
            with charging(f"net '{param.name}' ({self.source})") as charge, Layout.building():
                self.memory_baseline = charge.in_use     # the process before the net: the plan's first term
                self._build()
        except MemoryLimitError as refused:
            raise refused.noted(f". Largest so far: {self._largest_stores()}") from None
        finally:
            self._beside = None
            if beside is not None:
                beside.wait()               # built or not: no thread left copying
        if beside is not None:
            self._loaded(beside.path, beside.finish(self))

    def _largest_stores(self, count: int = 3) -> str:
        """The largest blob and parameter stores the build has made, for the
        message of a net refused as too large: "blob 'x' 1 GiB; ..."."""
        stores: Dict[int, Tuple[int, str]] = {}
        for name, blob in self.blobs.items():
            stores.setdefault(id(blob._data_store), (blob._data_store.nbytes, f"blob '{name}'"))
        for layer in self.layers:
            for index, blob in enumerate(layer.blobs):
                stores.setdefault(id(blob._data_store), (blob._data_store.nbytes, f"{layer.where()}: parameter {index}"))
        largest = sorted(stores.values(), key=lambda store: -store[0])[:count]
        largest = [store for store in largest if store[0] * 100 >= largest[0][0]]    # not the 4-byte ones
        return "; ".join(f"{owner} {format_bytes(nbytes)}" for nbytes, owner in largest) or "none"

    # --- construction ------------------------------------------------------------
    def _build(self) -> None:
        self.name = self.net_param.name
        self.layers, self._layer_names = [], []
        self.blobs = OrderedDict()
        self.bottom_vecs, self.top_vecs = [], []
        self._bottom_names, self._top_names = [], []
        self.bottom_need_backward, self.layer_need_backward = [], []
        self.blob_loss_weights = OrderedDict()
        self.inputs = []
        self._executor = None
        self.layout = NetLayout()             # what the net's plan is bound to beside the global Layout
        self.pages = pages.FaultIn()          # the pages the first forward writes, faulted in meanwhile
        self._init_param_tables()
        self._blob_needs_backward = {}
        self._available = OrderedDict()               # blobs no later layer has read yet
        # a .caffemodel's layer goes to the first layer of its name (Caffe's CopyTrainedLayersFrom)
        self._named_first = {}
        for index, layer_param in enumerate(self.net_param.layer):
            self._named_first.setdefault(layer_param.name, index)
        for layer_index, layer_param in enumerate(self.net_param.layer):
            self._add_layer(layer_index, layer_param)
        for name in self.blobs:
            self.blob_loss_weights.setdefault(name, 0.0)
        self._prune_backward()
        if self.net_param.force_backward:
            self._force_backward()
        for layer, need in zip(self.layers, self.layer_need_backward):
            layer.runs_backward = need
        self.outputs = sorted(self._available)        # Caffe keeps them in a std::set
        del self._blob_needs_backward, self._available, self._named_first
        self.layer_dict = OrderedDict(zip(self._layer_names, self.layers))
        self.executor                                 # the run settings, checked and applied now

    def _add_layer(self, layer_index: int, layer_param: caffe_pb2.LayerParameter) -> None:
        source = str(self.source)
        if not layer_param.name:
            raise ConfigError(f"{source}: layer #{layer_index} ({layer_param.type}): name: missing")
        if len(layer_param.propagate_down) not in (0, len(layer_param.bottom)):
            raise ConfigError(f"{source}: layer '{layer_param.name}' ({layer_param.type}): propagate_down: "
                              f"give none or one per bottom ({len(layer_param.bottom)}), "
                              f"got {len(layer_param.propagate_down)}")
        # The layer gets its own copy: setup may add to it (BatchNorm adds
        # ParamSpecs) while backward needs are decided on the net's, as in Caffe.
        own_param = _copy(layer_param)
        if not own_param.HasField("phase"):       # a layer's own `phase:` wins over the net's
            own_param.phase = self.phase
        layer = create_layer(own_param, own_param.phase, source)
        layer.layout = self.layout
        bottoms, bottom_names, bottom_backward, need_backward = self._wire_bottoms(layer, layer_param)
        tops, top_names = self._wire_tops(layer, layer_param, bottom_names)
        layer.set_up(bottoms, tops)
        self.pages.add(top._data_store for top in tops)
        layer.loss_weights = self._loss_weights(layer, len(tops))
        for name, weight in zip(top_names, layer.loss_weights):
            self.blob_loss_weights[name] = weight
        need_backward |= self._append_params(layer_index, layer)
        if self._beside is not None and self._named_first[layer.name] == layer_index:
            self._beside.add(layer)               # set up, its shared parameters its owners'
        self.layers.append(layer)
        self._layer_names.append(layer.name)
        self.bottom_vecs.append(bottoms)
        self.top_vecs.append(tops)
        self._bottom_names.append(bottom_names)
        self._top_names.append(top_names)
        self.bottom_need_backward.append(bottom_backward)
        self.layer_need_backward.append(need_backward)
        if need_backward:
            for name in top_names:
                self._blob_needs_backward[name] = True
        log.debug("%s: tops %s", layer.where(), [blob.shape for blob in tops])

    def _wire_bottoms(self, layer: Layer, layer_param: caffe_pb2.LayerParameter
                      ) -> Tuple[List[Blob], List[str], List[bool], bool]:
        """(blobs, names, per-bottom need-backward, whether any input needs backward)."""
        bottoms: List[Blob] = []
        names: List[str] = []
        bottom_backward: List[bool] = []
        need_backward = False
        for index, name in enumerate(layer_param.bottom):
            if name not in self.blobs:
                raise ConfigError(f"{layer.where()}: bottom[{index}]: unknown blob '{name}'")
            self._available.pop(name, None)
            bottoms.append(self.blobs[name])
            names.append(name)
            need_backward |= self._blob_needs_backward[name]
            # A given propagate_down decides alone, forcing a gradient or skipping it.
            bottom_backward.append(layer_param.propagate_down[index] if len(layer_param.propagate_down)
                                   else self._blob_needs_backward[name])
        return bottoms, names, bottom_backward, need_backward

    def _wire_tops(self, layer: Layer, layer_param: caffe_pb2.LayerParameter,
                   bottom_names: List[str]) -> Tuple[List[Blob], List[str]]:
        """(blobs, names): new blobs, or the bottom's own for an in-place top."""
        names = list(layer_param.top)
        num_named = len(names)
        names += [AUTOMATIC_TOP] * layer.num_auto_tops(num_named)
        tops = []
        for index, name in enumerate(names):
            in_place = index < len(bottom_names) and bottom_names[index] == name
            automatic = index >= num_named
            if name in self.blobs and not in_place and not automatic:
                raise ConfigError(f"{layer.where()}: top[{index}]: blob '{name}' is produced by an "
                                  "earlier layer; a top may only reuse the bottom at its own index (in-place)")
            if not in_place:
                self.blobs[name] = Blob()
                self.blobs[name].layout = self.layout
                self._blob_needs_backward[name] = False
            tops.append(self.blobs[name])
            if not automatic:                         # Caffe leaves automatic tops out of the outputs
                self._available[name] = True
            if layer_param.type == "Input":
                self.inputs.append(name)
        return tops, names

    def _loss_weights(self, layer: Layer, num_tops: int) -> List[float]:
        given = list(layer.layer_param.loss_weight)
        if given and len(given) != num_tops:
            raise layer.config_error("loss_weight", f"give none or one per top ({num_tops}), got {len(given)}")
        if given:
            return given
        return [1.0 if (layer.is_loss and k == 0) else 0.0 for k in range(num_tops)]

    def _init_param_tables(self) -> None:
        self._params = []                   # every param blob, shared ones included
        self._param_owners = []             # index into _params of the owner, or -1
        self._param_layer_indices = []      # (layer index, param index)
        self._param_names_index = {}
        self.learnable_params = []          # unique (owner) blobs the solver updates
        self.params_lr, self.params_weight_decay = [], []
        self._learnable_has_lr, self._learnable_has_decay = [], []
        self._learnable_index_of_param = []

    def _append_params(self, layer_index: int, layer: Layer) -> bool:
        """Register the layer's param blobs; True if any of them learns (lr_mult != 0)."""
        specs = self.net_param.layer[layer_index].param
        if len(specs) > len(layer.blobs):
            raise layer.config_error("param", f"{len(specs)} param specs given but the layer has "
                                     f"{len(layer.blobs)} parameter blobs")
        layer.param_propagate_down = [True] * len(layer.blobs)
        any_learns = False
        for param_index in range(len(layer.blobs)):
            net_spec = specs[param_index] if param_index < len(specs) else caffe_pb2.ParamSpec()
            learns = net_spec.lr_mult != 0
            any_learns |= learns
            layer.param_propagate_down[param_index] = learns
            # The layer may have added specs of its own in setup (BatchNorm does).
            own_specs = layer.layer_param.param
            spec = own_specs[param_index] if param_index < len(own_specs) else caffe_pb2.ParamSpec()
            self._append_param(layer, layer_index, param_index, spec)
        return any_learns

    def _append_param(self, layer: Layer, layer_index: int, param_index: int,
                      spec: caffe_pb2.ParamSpec) -> None:
        net_index = len(self._params)
        blob = layer.blobs[param_index]
        self._param_layer_indices.append((layer_index, param_index))
        name = spec.name
        if not name or name not in self._param_names_index:
            if name:
                self._param_names_index[name] = net_index
            self._param_owners.append(-1)
            self._params.append(blob)
            self._learnable_index_of_param.append(len(self.learnable_params))
            self.learnable_params.append(blob)
            self.params_lr.append(spec.lr_mult)
            self.params_weight_decay.append(spec.decay_mult)
            self._learnable_has_lr.append(spec.HasField("lr_mult"))
            self._learnable_has_decay.append(spec.HasField("decay_mult"))
            return
        owner_index = self._param_names_index[name]
        owner = self._params[owner_index]
        permissive = spec.share_mode == caffe_pb2.ParamSpec.PERMISSIVE
        if (owner.count != blob.count) if permissive else (owner.shape != blob.shape):
            raise layer.config_error(f"param[{param_index}] '{name}'",
                                     f"shared parameter has shape {blob.shape}, its owner {owner.shape}")
        learnable = self._learnable_index_of_param[owner_index]
        for has, values, field in ((self._learnable_has_lr, self.params_lr, "lr_mult"),
                                   (self._learnable_has_decay, self.params_weight_decay, "decay_mult")):
            if not spec.HasField(field):
                continue
            if has[learnable] and values[learnable] != getattr(spec, field):
                raise layer.config_error(f"param[{param_index}].{field}",
                                         f"shared parameter '{name}' has mismatched {field}")
            has[learnable], values[learnable] = True, getattr(spec, field)
        if owner.shape == blob.shape:
            shared = owner
        else:
            shared = Blob(blob.shape)
            shared.share_data(owner)
            shared.share_diff(owner)
        layer.blobs[param_index] = shared
        self._param_owners.append(owner_index)
        self._params.append(shared)
        self._learnable_index_of_param.append(learnable)

    def _prune_backward(self) -> None:
        """Walk back from the losses: layers that feed no loss need no backward."""
        under_loss, skip_backprop = set(), set()
        for i in reversed(range(len(self.layers))):
            layer = self.layers[i]
            contributes = any(w != 0 or name in under_loss
                              for name, w in zip(self._top_names[i], layer.loss_weights))
            skip = all(name in skip_backprop for name in self._top_names[i])
            if self.layer_need_backward[i] and skip:
                self.layer_need_backward[i] = False
                self.bottom_need_backward[i] = [False] * len(self.bottom_vecs[i])
            if not contributes:
                self.layer_need_backward[i] = False
            for j, name in enumerate(self._bottom_names[i]):
                if contributes:
                    under_loss.add(name)
                else:
                    self.bottom_need_backward[i][j] = False
                if not self.bottom_need_backward[i][j]:
                    skip_backprop.add(name)

    def _force_backward(self) -> None:
        for i, layer in enumerate(self.layers):
            self.layer_need_backward[i] = True
            self.bottom_need_backward[i] = [need or layer.allow_force_backward(j)
                                            for j, need in enumerate(self.bottom_need_backward[i])]
            layer.param_propagate_down = [True] * len(layer.blobs)

    # --- running -----------------------------------------------------------------
    def _layer_index(self, name: Optional[str], default: int) -> int:
        if name is None:
            return default
        try:
            return self._layer_names.index(name)
        except ValueError:
            raise ConfigError(f"no layer named {name!r} in net '{self.name}'") from None

    def _forward(self, start: int = 0, end: Optional[int] = None) -> float:
        """Run layers start..end inclusive (by index); return the summed loss."""
        end = len(self.layers) - 1 if end is None else end
        self.pages.stop()               # a core of its own for OpenBLAS's threads from now
        return self.executor.forward_range(start, end)

    @property
    def executor(self) -> "Executor":
        """Runs each layer, batch-partitioned as its plan says, and tells
        subscribers about it (cct.runtime.executor). The one place the core
        reaches up into the runtime: imported here, so that the core imports
        nothing above itself and Net.forward() still works out of the box."""
        if self._executor is None:
            from cct.runtime.executor import Executor
            self._executor = Executor(self)
        return self._executor

    def _backward(self, start: Optional[int] = None, end: int = 0) -> None:
        start = len(self.layers) - 1 if start is None else start
        self.executor.backward_range(start, end)

    def forward(self, blobs: Optional[Iterable[str]] = None, start: Optional[str] = None, end: Optional[str] = None,
                **kwargs: npt.ArrayLike) -> Dict[str, Array]:
        """Forward from layer `start` to `end` (layer names, inclusive). Keyword
        arrays set input blobs. Returns {blob name: data} for the net's outputs
        (or, given `end`, that layer's tops) + `blobs`, as pycaffe."""
        blobs = list(blobs or [])
        start_index = self._layer_index(start, 0)
        end_index = self._layer_index(end, len(self.layers) - 1)
        outputs = set(self._top_names[end_index] + blobs) if end is not None else set(self.outputs + blobs)
        if kwargs:
            if set(kwargs) != set(self.inputs):
                raise ConfigError(f"forward(): input arguments {sorted(kwargs)} do not match "
                                  f"the net's inputs {self.inputs}")
            for name, values in kwargs.items():
                self._set_batch(name, values, "data")
        self._forward(start_index, end_index)
        return {name: self.blobs[name].data for name in outputs}

    def backward(self, diffs: Optional[Iterable[str]] = None, start: Optional[str] = None, end: Optional[str] = None,
                 **kwargs: npt.ArrayLike) -> Dict[str, Array]:
        """Backward from layer `start` down to `end` (layer names, inclusive).
        Keyword arrays set output diffs. Returns {blob name: diff} for the net's
        inputs (or, given `end`, that layer's bottoms) + `diffs`, as pycaffe."""
        diffs = list(diffs or [])
        start_index = self._layer_index(start, len(self.layers) - 1)
        end_index = self._layer_index(end, 0)
        outputs = set(self._bottom_names[end_index] + diffs) if end is not None else set(self.inputs + diffs)
        unknown = set(kwargs) - set(self.outputs)
        if unknown:
            raise ConfigError(f"backward(): {sorted(unknown)} are not outputs of the net "
                              f"(outputs: {self.outputs})")
        for name, values in kwargs.items():
            self._set_batch(name, values, "diff")
        self._backward(start_index, end_index)
        return {name: self.blobs[name].diff for name in outputs}

    def _set_batch(self, name: str, values: npt.ArrayLike, field: str) -> None:
        blob = self.blobs[name]
        values = np.asarray(values)
        if values.shape[:1] != blob.shape[:1]:
            raise ShapeError(f"blob '{name}': {'input' if field == 'data' else 'diff'} is not batch "
                             f"sized: got {values.shape}, the blob is {blob.shape}")
        getattr(blob, field)[...] = values

    def forward_backward(self) -> float:
        loss = self._forward()
        self._backward()
        return loss

    def reshape(self) -> None:
        for layer, bottoms, tops in zip(self.layers, self.bottom_vecs, self.top_vecs):
            layer.reshape(bottoms, tops)

    def close(self) -> None:
        """Release what the layers hold outside the process's memory: data
        layers stop their prefetch threads and close their databases. Dropping
        the net does the same; a closed net's data layers refuse to forward."""
        for layer in self.layers:
            close = getattr(layer, "close", None)
            if close is not None:
                close()

    def __enter__(self) -> "Net":
        return self

    def __exit__(self, *exception: Any) -> None:
        self.close()

    def clear_param_diffs(self) -> None:
        """Zero the parameter gradients: in a device run by a fill on the
        device, where the backward accumulates them (no host zeros uploaded)."""
        device = self.executor.device()
        for blob in self.learnable_params:
            if device is None:
                blob.diff[...] = 0
            else:
                blob.fill_device_diff(device, 0.0)

    # --- pycaffe's views ---------------------------------------------------------
    @property
    def params(self) -> "OrderedDict[str, List[Blob]]":
        return OrderedDict((layer.name, layer.blobs) for layer in self.layers if layer.blobs)

    @property
    def top_names(self) -> "OrderedDict[str, List[str]]":
        return OrderedDict(zip(self._layer_names, self._top_names))

    @property
    def bottom_names(self) -> "OrderedDict[str, List[str]]":
        return OrderedDict(zip(self._layer_names, self._bottom_names))

    @property
    def layer_names(self) -> List[str]:
        return list(self._layer_names)

    def owns_param(self, layer_index: int, param_index: int) -> bool:
        """Whether that parameter blob holds its own storage: false for a
        parameter shared by name with an earlier layer (Caffe's param_owners_)."""
        net_index = self._param_layer_indices.index((layer_index, param_index))
        return self._param_owners[net_index] < 0

    def learnable_param_layers(self) -> List[List[int]]:
        """For each of learnable_params, the indexes of the layers holding it,
        in forward order (several where layers share it by name)."""
        layers: List[List[int]] = [[] for _ in self.learnable_params]
        for (layer_index, _), learnable in zip(self._param_layer_indices, self._learnable_index_of_param):
            layers[learnable].append(layer_index)
        return layers

    # --- weights -----------------------------------------------------------------
    def copy_from(self, path: Path) -> None:
        """Load weights by layer name from a .caffemodel or Caffe HDF5 file."""
        path = str(path)
        try:
            hdf5 = weights_io.is_hdf5(path)
        except FileNotFoundError:
            raise WeightsError(f"{path}: weight file not found") from None
        if hdf5:
            skipped = weights_io.copy_layers_from_hdf5(self, path)
        else:
            skipped = weights_io.copy_layers_from_caffemodel(self, path)
        self._loaded(path, skipped)

    def _loaded(self, path: str, skipped: List[str]) -> None:
        # each layer's derived values (Winograd's transformed weights: numpy's GEMMs
        # and copies, which let go of the GIL) on the threads the net runs on, at most
        # LOAD_THREADS, the build done (BENCHMARKS.md, "Winograd's transforms on the pool, in the model")
        pending = list(reversed(self.layers))
        failed: List[BaseException] = []
        lock = threading.Lock()

        def derive() -> None:
            while True:
                with lock:
                    if not pending or failed:
                        return
                    layer = pending.pop()
                try:
                    layer.params_loaded()
                except BaseException as error:          # raised on the caller's thread below
                    with lock:
                        failed.append(error)
        helpers = [threading.Thread(target=derive, name="cct-params-loaded", daemon=True)
                   for _ in range(min(LOAD_THREADS, self.executor.threads) - 1)]
        for helper in helpers:
            helper.start()
        derive()
        for helper in helpers:
            helper.join()
        if failed:
            raise failed[0]
        for name in skipped:
            log.info("%s: ignoring source layer '%s' (not in net '%s')", path, name, self.name)

    def copy_trained_layers_from(self, net_param: caffe_pb2.NetParameter, source: str = "<NetParameter>") -> List[str]:
        return weights_io.copy_layers_from_proto(self, upgrade_net(net_param, source), source)

    def share_with(self, other: "Net") -> None:
        """Use `other`'s parameter storage (Caffe's ShareTrainedLayersWith)."""
        for layer in self.layers:
            source_layer = other.layer_dict.get(layer.name)
            if source_layer is None:
                continue
            if len(source_layer.blobs) != len(layer.blobs):
                raise WeightsError(f"{layer.where()}: share_with: {len(source_layer.blobs)} blobs in the "
                                   f"source layer, {len(layer.blobs)} here")
            for blob, source_blob in zip(layer.blobs, source_layer.blobs):
                if blob.shape != source_blob.shape:
                    raise WeightsError(f"{layer.where()}: share_with: shape {source_blob.shape} in the "
                                       f"source layer, {blob.shape} here")
                blob.share_data(source_blob)

    def save(self, path: Path, write_diff: bool = False) -> None:
        weights_io.save_caffemodel(self, path, write_diff)

    def save_hdf5(self, path: Path, write_diff: bool = False) -> None:
        weights_io.save_hdf5(self, path, write_diff)

    def load_hdf5(self, path: Path) -> None:
        weights_io.copy_layers_from_hdf5(self, path)

    def to_proto(self, write_diff: bool = False) -> caffe_pb2.NetParameter:
        return weights_io.net_to_proto(self, write_diff)

    def __repr__(self) -> str:
        return f"<cct.Net '{self.name}' with {len(self.layers)} layers>"


def _copy(message: caffe_pb2.LayerParameter) -> caffe_pb2.LayerParameter:
    duplicate = type(message)()
    duplicate.CopyFrom(message)
    return duplicate
