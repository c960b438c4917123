"""The hybrid CPU+device split (Caffe con Troll, Sec. 3.3): a layer's batch
divided between the host and an OpenCL device, "each device takes a fraction
p_i of the input, p_i the fraction of the total FLOPS that device
contributes", the model shared.

A HybridLayer runs rows [0, c) of the batch on the host (a twin of the layer
on views of those rows, its own forward and backward, accumulating into the
layer's parameter diffs) and rows [c, N) on the device (a twin on Rows blobs
whose device buffers are shards of the net's blobs: Blob mirrors keep one
range of elements on a device, cct.core.blob.Mirror.rows_on). The device's
kernels are queued first and run while the host computes its rows. A top's
device rows stay on the device after the layer (the mirror's SPLIT head), so
the next layer on the same split reads them there: activations cross between
host and device only where the split changes, or where the host reads a
whole blob (a loss, pycaffe).

Parameters: the master weights stay on the host (the solver has one code
path); the device twin reads their device copy, refreshed after each update
(the mirror's head), and accumulates into a private device diff that is
added into the host diff after its backward. Layers that mix the batch
(losses, BatchNorm in training) are never split: can_partition says so.

Splits: `plan(...)` gives the splittable layers their device share by the
FLOPS rule, T_host / (T_host + T_device), each layer's forward and backward
timed whole on each side; a chain of splittable layers each feeding the
next gets one cut from their summed times, so that no rows cross between
host and device inside it; and of the whole row counts around the rule's
share and the whole batch, each split timed as it runs, and none, the
fastest (best_rows): what a split costs beyond FLOPs (the device's fixed
cost per call, the host's time to queue its work, either side's loss of
efficiency on few rows, the sides slowing each other) is measured, not
assumed away.
Measured once per net shape and machine, cached. The run configuration's
"hybrid" entry may set any layer's share.
"""
import hashlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union, cast

from cct.core.arrays import Array
from cct.core.blob import Blob, Buffer, DeviceMemory, Mirror
from cct.core.errors import ConfigError
from cct.core.layer import Layer
from cct.devices.base import Device
from cct.formats.prototxt import atomic_write
from cct.runtime import settings
from cct.runtime.partition import BlobSlice, as_mirror

Net = Any                             # cct.core.net.Net, whose executor imports this module: not imported back
# One side's (bottoms, tops) of a split layer: HostRows on the host, Rows on the device.
Part = Tuple[Sequence[Blob], Sequence[Blob]]


class HostRows(BlobSlice):
    """Rows [start, stop) of a blob's batch on the host, made without marking
    the blob written (its device rows stay where they are): the host part of
    a split reads and writes only its own rows."""

    def __init__(self, blob: Blob, start: int, stop: int) -> None:
        self.dtype = blob.dtype
        self._shape = (stop - start,) + blob.shape[1:]
        self._data = blob._data[start:stop]
        self._diff = None
        self._rows = (blob, start, stop)

    def _allocate_diff(self) -> Array:
        blob, start, stop = self._rows
        if blob._diff is None:
            blob._allocate_diff()
        assert blob._diff is not None             # made just above
        self._diff = blob._diff[start:stop]
        return self._diff


class _RowsMirror:
    """The mirror of a Rows blob: its parent's mirror, asked for one range."""
    head = "rows"                 # never HOST: a host read goes through to_host

    def __init__(self, parent: Blob, which: str, start: int, stop: int, upload: bool) -> None:
        self.parent, self.which, self.start, self.stop, self.upload = parent, which, start, stop, upload

    def _mirror(self) -> Mirror:
        if self.which == "diff" and self.parent._diff is None:
            self.parent._allocate_diff()
        mirror = self.parent._data_mirror if self.which == "data" else self.parent._diff_mirror
        assert mirror is not None             # the diff's, made with its store just above
        return mirror

    def on(self, device: DeviceMemory) -> Buffer:
        return self._mirror().rows_on(device, self.start, self.stop)

    def written_on(self, device: DeviceMemory, upload: bool = True) -> Buffer:
        return self._mirror().rows_on(device, self.start, self.stop, upload=self.upload and upload)

    def to_host(self) -> None:
        mirror = self._mirror()        # a host read of a device part (labels): the whole blob, host-writable
        mirror.to_host()
        mirror.head = "host"


class Rows(Blob):
    """Rows [start, stop) of a blob's batch, for a device twin: its device
    buffers are the parent's shard of those rows (elements start*inner to
    stop*inner); `fresh`: a written top need not be copied up first."""
    _diff_mirror: Mirror                  # a _RowsMirror, made with the Rows

    def __init__(self, blob: Blob, start: int, stop: int, fresh: bool = False) -> None:
        self.dtype = blob.dtype
        self._shape = (stop - start,) + blob.shape[1:]
        inner = blob.count_range(1)
        self._data_store = blob._data_store
        self._data = blob._data[start:stop]
        self._diff_store = None
        self._diff = None
        self._rows = (blob, start, stop)
        self._data_mirror = as_mirror(_RowsMirror(blob, "data", start * inner, stop * inner, upload=not fresh))
        self._diff_mirror = as_mirror(_RowsMirror(blob, "diff", start * inner, stop * inner, upload=not fresh))

    def _allocate_diff(self) -> Array:
        blob, start, stop = self._rows
        if blob._diff is None:
            blob._allocate_diff()
        assert blob._diff is not None             # made just above
        self._diff = blob._diff[start:stop]
        return self._diff

    def device_diff(self, device: DeviceMemory) -> Buffer:
        return self._diff_mirror.on(device)

    def mutable_device_diff(self, device: DeviceMemory, upload: bool = True) -> Buffer:
        return self._diff_mirror.written_on(device, upload)

    def reshape(self, *shape: Union[int, Sequence[int], Array]) -> None:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        if tuple(int(d) for d in cast(Sequence[int], shape)) != self._shape:     # ints, a tuple given unpacked
            raise ValueError(f"rows {self._shape} of a split blob cannot be reshaped to {shape}")


def _param_on_device(blob: Blob) -> Blob:
    """A device twin's parameter: the layer's data (its mirror: the device copy
    is refreshed only after the host wrote it) and a private diff."""
    twin = Blob(blob.shape, blob.dtype)
    twin.share_data(blob)
    twin._allocate_diff()
    return twin


class HybridLayer:
    """Runs `layer` with rows [0, cut) of its batch on the host and the rest
    on `device`, cut = round(batch * (1 - share))."""

    def __init__(self, layer: Layer, device: Device, share: float) -> None:
        self.layer, self.device, self.share = layer, device, float(share)
        self.host_twin = layer.clone(2)
        self.host_twin.blobs = layer.blobs
        self.device_twin = layer.clone(2)
        self.device_twin.blobs = [_param_on_device(blob) for blob in layer.blobs]

    def cut(self, batch: int) -> int:
        """The first row the device runs: the host gets the rest of the share, rounded."""
        return batch - int(round(batch * self.share))

    def _parts(self, bottoms: Sequence[Blob], tops: Sequence[Blob],
               writing_tops: bool) -> Tuple[Optional[Part], Optional[Part], int]:
        """(host bottoms, host tops, device bottoms, device tops, cut); either side empty when it has no rows."""
        batch = bottoms[0].shape[0]
        cut = self.cut(batch)
        host: Optional[Part] = \
            ([HostRows(b, 0, cut) for b in bottoms], [HostRows(t, 0, cut) for t in tops]) if cut else None
        device: Optional[Part] = None
        if cut < batch:
            device_bottoms = [Rows(b, cut, batch) for b in bottoms]
            device_tops = [next((v for b, v in zip(bottoms, device_bottoms) if b is t), None)
                           or Rows(t, cut, batch, fresh=writing_tops) for t in tops]
            device = (device_bottoms, device_tops)
        return host, device, cut

    def _rest_on_host(self, blobs: Sequence[Blob], which: str, written: bool, cut: int) -> None:
        """The host current in every blob's `which` outside the device's rows."""
        for blob in blobs:
            if which == "diff" and blob._diff is None:
                blob._allocate_diff()
            inner, batch = blob.count_range(1), blob.shape[0]
            mirror = blob._data_mirror if which == "data" else blob._diff_mirror
            assert mirror is not None             # the diff's, made with its store just above
            mirror.rest_on_host(written, cut * inner, batch * inner)

    def forward(self, bottoms: List[Blob], tops: List[Blob]) -> None:
        host, device, cut = self._parts(bottoms, tops, writing_tops=True)
        self._rest_on_host(bottoms, "data", False, cut)
        self._rest_on_host(tops, "data", True, cut)
        if device is not None:                   # queued first: the device runs while the host computes
            self.device_twin.reshape(*device)
            self.device_twin.forward_on(self.device, *device)
        if host is not None:
            self.host_twin.reshape(*host)
            self.host_twin.forward(*host)

    def backward(self, tops: List[Blob], propagate_down: Sequence[bool], bottoms: List[Blob]) -> None:
        host, device, cut = self._parts(bottoms, tops, writing_tops=False)
        self._rest_on_host(tops + bottoms, "data", False, cut)
        self._rest_on_host(tops, "diff", False, cut)
        self._rest_on_host([b for b, down in zip(bottoms, propagate_down) if down], "diff", True, cut)
        private: List[Tuple[int, Blob]] = []
        if device is not None:
            self.device_twin.param_propagate_down = self.layer.param_propagate_down
            for index, param in enumerate(self.device_twin.blobs):
                if self.layer.param_wanted(index):
                    assert param._diff_mirror is not None      # _param_on_device made the diff
                    self.device.fill(param._diff_mirror.written_on(self.device, upload=False), 0.0, param.count)
                    private.append((index, param))
            self.device_twin.backward_on(self.device, device[1], propagate_down, device[0])
        if host is not None:
            self.host_twin.param_propagate_down = self.layer.param_propagate_down
            self.host_twin.backward(host[1], propagate_down, host[0])
        for index, param in private:             # the device's parameter gradients into the host's
            self.layer.blobs[index].diff += param.diff


# --- the split: each layer's FLOPS share -------------------------------------------------------
def flops_share(host_seconds: float, device_seconds: float) -> float:
    """The device's fraction of the batch by the FLOPS rule: its rate over
    the sum of both rates, 1/T_device / (1/T_host + 1/T_device)."""
    if device_seconds <= 0:
        return 1.0
    if host_seconds <= 0:
        return 0.0
    return host_seconds / (host_seconds + device_seconds)


def candidate_rows(batch: int, host_seconds: float, device_seconds: float) -> List[int]:
    """The device's row counts worth timing: the whole numbers around the
    FLOPS rule's share of the batch (flops_share), one below, and the whole
    batch (a device so much faster that the host's few rows cost more than
    they save: BENCHMARKS.md, "On a lent NVIDIA H100 (2026-11-26)")."""
    balanced = batch * flops_share(host_seconds, device_seconds)
    low = int(balanced)
    return sorted({rows for rows in (low - 1, low, low + 1, batch) if 1 <= rows <= batch})


def best_rows(host_seconds: float, split_seconds: Dict[int, float]) -> int:
    """Of 0 (the host alone: `host_seconds`) and the device row counts timed
    ({rows: seconds of the split as it runs}), the fastest. The FLOPS rule
    proposes the rows; the split is timed as it runs, both sides at once,
    because what a split costs beyond FLOPs (the device's fixed cost per
    call, the host's time to queue it, either side's loss of efficiency on
    few rows, the two sides slowing each other on shared cores and memory)
    is not the sum of the sides timed alone:
    BENCHMARKS.md, "The FLOPS rule on this machine (pocl)"."""
    return min([0] + sorted(split_seconds), key=lambda rows: split_seconds[rows] if rows else host_seconds)


def _time(run: Callable[[], None], device: Device, repeats: int) -> float:
    """Best of `repeats` runs of `run` (after one warm-up), the device drained after each."""
    best = float("inf")
    for attempt in range(repeats + 1):
        start = time.perf_counter()
        run()
        device.finish()
        if attempt:
            best = min(best, time.perf_counter() - start)
    return best


def layer_times(net: Net, index: int, device: Device, repeats: int = 2) -> Tuple[float, float]:
    """(host seconds, device seconds) of layer `index`'s forward and backward
    on its whole batch, at the net's current blobs."""
    layer, bottoms, tops = net.layers[index], net.bottom_vecs[index], net.top_vecs[index]
    down = net.bottom_need_backward[index]

    def on_host() -> None:
        layer.forward(bottoms, tops)
        if net.layer_need_backward[index]:
            layer.backward(tops, down, bottoms)

    def on_device() -> None:
        layer.forward_on(device, bottoms, tops)
        if net.layer_need_backward[index]:
            layer.backward_on(device, tops, down, bottoms)
    return _time(on_host, device, repeats), _time(on_device, device, repeats)


def split_seconds(net: Net, index: int, device: Device, rows: int, repeats: int = 2) -> float:
    """Seconds of layer `index`'s forward and backward split as a
    HybridLayer runs it, the last `rows` rows of the batch on the device."""
    layer, bottoms, tops = net.layers[index], net.bottom_vecs[index], net.top_vecs[index]
    down = net.bottom_need_backward[index]
    runner = HybridLayer(layer, device, rows / bottoms[0].shape[0])

    def run() -> None:
        runner.forward(bottoms, tops)
        if net.layer_need_backward[index]:
            runner.backward(tops, down, bottoms)
    return _time(run, device, repeats)


def splittable(net: Net, index: int, device: Device) -> bool:
    """Whether layer `index` may be split: its batch can be divided and it has a device path."""
    executor, layer = net.executor, net.layers[index]
    return (executor.batch(index) is not None and net.layers[index].runs_on(device, net.bottom_vecs[index],
                                                                              net.top_vecs[index])
            and layer.type not in ("Input", "Data"))


def measure_shares(net: Net, device: Device, repeats: int = 2) -> Dict[int, float]:
    """{layer index: device share} for every splittable layer: over each
    chain of splittable layers, each feeding the next (conv, ReLU, pooling,
    LRN, ...), one cut, since a cut that moved between two layers would copy
    the rows between host and device there. The chain's layers with work to
    count (Layer.flops) are timed whole on each side; their split is timed
    as it runs at the device row counts around the FLOPS rule's share of
    their summed times and at the whole batch (candidate_rows), and
    best_rows picks among them and none. Leaves the parameter diffs cleared."""
    chains: List[List[Any]] = []               # chain: [batch, indexes, timed indexes]
    chain_of: Dict[int, List[Any]] = {}        # id of a top -> its chain
    for index in range(len(net.layers)):
        bottoms, tops = net.bottom_vecs[index], net.top_vecs[index]
        if not splittable(net, index, device):
            for top in tops:
                chain_of.pop(id(top), None)
            continue
        batch = bottoms[0].shape[0]
        chain = chain_of.get(id(bottoms[0]))
        if chain is None or chain[0] != batch:
            chain = [batch, [], []]
            chains.append(chain)
        chain[1].append(index)
        if any(net.layers[index].flops(bottoms, tops)):
            chain[2].append(index)
        for top in tops:
            chain_of[id(top)] = chain
    shares: Dict[int, float] = {}
    for batch, indexes, timed in chains:
        share = _chain_rows(net, device, batch, timed, repeats) / batch      # measured once per chain
        shares.update(dict.fromkeys(indexes, share))
    net.clear_param_diffs()
    return shares


def _chain_rows(net: Net, device: Device, batch: int, timed: List[int], repeats: int) -> int:
    """The device's rows for a chain whose layers `timed` have work to count."""
    if not timed:
        return 0
    whole = [layer_times(net, index, device, repeats) for index in timed]
    host_seconds = sum(host for host, _ in whole)
    timed_splits = {rows: sum(split_seconds(net, index, device, rows, repeats) for index in timed)
                    for rows in candidate_rows(batch, host_seconds, sum(on_device for _, on_device in whole))}
    return best_rows(host_seconds, timed_splits)


RULE_VERSION = 3          # in the cache key: shares the rule measured before a change to it are not reused


def cache_path(net: Net, device: Device) -> Path:
    """Where the measured shares of `net` at its current shapes, with this
    device, host and thread count, are kept."""
    executor = net.executor
    identity = json.dumps([RULE_VERSION, net.net_param.SerializeToString(deterministic=True).hex(),
                           [list(blob.shape) for blob in net.blobs.values()], executor.threads,
                           device.name, platform.node(), platform.machine(), os.cpu_count()], default=str)
    return settings.cache_dir() / "hybrid" / (hashlib.sha256(identity.encode()).hexdigest()[:24] + ".json")


def plan(net: Net, device: Device, configured: Optional[Mapping[str, float]] = None) -> Dict[int, float]:
    """{layer index: device share} for the hybrid split: the run
    configuration's shares (`configured`, {layer name or "default": share})
    where it sets them, else the FLOPS rule's, measured on the net's current
    blobs once and cached (nothing is measured when a default covers every layer)."""
    configured = configured or {}
    names = {layer.name: index for index, layer in enumerate(net.layers)}
    unknown = sorted(set(configured) - set(names) - {"default"})
    if unknown:
        raise ConfigError(f"hybrid: no layer named {unknown[0]!r} in net '{net.name}'")
    if "default" in configured:
        shares = {index: configured["default"] for index in range(len(net.layers)) if splittable(net, index, device)}
    else:
        shares = measured_shares(net, device)
    shares.update({names[name]: share for name, share in configured.items() if name != "default"})
    return shares


def measured_shares(net: Net, device: Device) -> Dict[int, float]:
    """measure_shares, read from the cache when this net, shape and machine were measured before."""
    path = cache_path(net, device)
    try:
        return {int(key): float(value) for key, value in json.loads(path.read_text()).items()}
    except (ValueError, OSError):
        pass                                   # none yet, or unreadable: measure
    measured = measure_shares(net, device)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps({str(key): value for key, value in measured.items()}).encode())
    return measured
