"""Blob: an N-d array of data and the same-shaped array of its gradient (diff).

As in Caffe, a blob keeps its storage when reshaped to a smaller or equal count,
so views handed out before a reshape stay valid and iterations reuse memory.
`data` and `diff` are writable numpy views, as pycaffe exposes them.

The diff's storage is allocated on first use of `diff` (Caffe's SyncedMemory is
lazy too): in training, the input images' gradient (158 MB for CaffeNet at batch
256) and the labels' are never asked for.

On a device (cct.devices), each store has a Mirror: its copy in a device
buffer and a head that says which side is current, as Caffe's SyncedMemory.
`device_data(device)` hands a layer's device path the buffer, copied up when
the host was written since; `mutable_device_data(device)` also marks the
device as the only current side. `data` and `diff` copy back when the device
is ahead and, since numpy views are writable, make the host the current side
(pycaffe's `blob.data` is Caffe's mutable_cpu_data too); `read_data()` and
`read_diff()` are Caffe's cpu_data: read-only views, the device's copy kept
current. A layer that overwrites a whole buffer asks for it with
upload=False (nothing stale copied up first). A copy down happens once
however many threads ask at the same time. A device that shares host memory
(the numpy CPU device) gets the host store itself.
"""
import contextlib
import math
import threading
from typing import Any, Iterator, NoReturn, Optional, Protocol, Sequence, Tuple, Union

import numpy as np
import numpy.typing as npt

from cct.core.arrays import Array, Shape
from cct.core.errors import ShapeError
from cct.core.allocation import charge_store, check_allocation

# Batch partitions (cct.runtime.executor) may ask for one blob's diff from several
# threads at once: it must be made once, not once per thread.
_ALLOCATION_LOCK = threading.Lock()
# Threads (a striped update, batch partitions) may ask for one store a device
# is ahead with at once: one copies it down, the others wait and see the host
# current (two downloads would overwrite what the first had begun to update).
_SYNC_LOCK = threading.Lock()

# Which side of a Mirror is current: the host, the device's buffer, both, or
# (SPLIT) the host except one range of elements, current only in a shard on a
# device (a hybrid split's device part, cct.runtime.hybrid).
HOST, DEVICE, SYNCED, SPLIT = "host", "device", "synced", "split"

# A device's flat buffer (cct.devices.base.Buffer: a numpy array or a pyopencl one).
Buffer = Any


class DeviceMemory(Protocol):
    """What a Mirror uses of a device: cct.devices.base.Device's memory
    primitives (devices sit above the core, which does not import them)."""
    shares_host: bool

    def empty(self, count: int) -> Buffer: ...
    def upload(self, buffer: Buffer, host: Array) -> None: ...
    def download(self, buffer: Buffer, host: Array) -> None: ...
    def fill(self, buffer: Buffer, value: float, count: int) -> None: ...


# A hybrid split's shard: (device, start, stop, buffer), elements [start, stop) of the store.
Shard = Tuple[DeviceMemory, int, int, Buffer]


class Layout:
    """What an execution plan (cct.runtime.plan) was bound to, beside its
    net's NetLayout: `epoch` grows whenever a blob outside every net's tops
    (a parameter, a standalone blob) gets new views (a reshape to another
    shape, storage shared or replaced) or a layer outside a net changes a
    choice its bound steps hold (changed()). A plan built at one epoch runs
    while the epoch is the same; reading it is one attribute lookup per step."""
    epoch = 0
    _building = threading.local()     # .nets: how many nets this thread is building

    @classmethod
    def changed(cls) -> None:
        if not getattr(cls._building, "nets", 0):
            cls.epoch += 1

    @classmethod
    @contextlib.contextmanager
    def building(cls) -> Iterator[None]:
        """A net built on this thread inside the block: its blobs' new views
        and its layers' choices are in no plan yet, so they leave the epoch,
        and other nets' plans, alone."""
        cls._building.nets = getattr(cls._building, "nets", 0) + 1
        try:
            yield
        finally:
            cls._building.nets -= 1


class NetLayout:
    """One net's part of the layout: its tops' views and its layers' choices
    (Blob.layout, Layer.layout). Its plan checks this epoch beside the
    global one (Layout: parameters, and blobs and layers outside a net), so
    that another net's reshape leaves the plan in use: a detector's plan
    while a classifier after it is reshaped to each frame's face count."""
    __slots__ = ("epoch",)

    def __init__(self) -> None:
        self.epoch = 0

    def changed(self) -> None:
        self.epoch += 1


class Mirror:
    """A host store's copy on one device (Caffe's SyncedMemory): `head` says
    which side is current; the buffer is made on the first device use. A
    hybrid split keeps a range of the store's elements on a device as a
    shard of its own, (device, start, stop, buffer)."""
    __slots__ = ("store", "device", "buffer", "head", "shard")

    def __init__(self, store: Array) -> None:
        self.store = store            # the flat host array this mirrors
        self.device: Optional[DeviceMemory] = None
        self.buffer: Buffer = None
        self.head = HOST
        self.shard: Optional[Shard] = None

    def to_host(self) -> None:
        """Make the host current (copying down what a device is ahead with)."""
        if self.head == DEVICE:
            assert self.device is not None            # on() set it before the device went ahead
            self.device.download(self.buffer, self.store)
            self.head = SYNCED
        elif self.head == SPLIT:
            assert self.shard is not None             # rows_on() set it with the head
            device, start, stop, buffer = self.shard
            device.download(buffer, self.store[start:stop])
            self.head = HOST          # the whole-store buffer missed the shard's writes

    def on(self, device: DeviceMemory, upload: bool = True) -> Buffer:
        """The current contents in `device`'s buffer (copied up when stale,
        unless `upload` is False: the caller overwrites them all)."""
        if device.shares_host:
            self.to_host()
            return self.store
        if self.device is not device:
            self.to_host()                # leave the other device: the host holds the values
            self.device, self.buffer, self.head = device, device.empty(self.store.size), HOST
        if self.head == SPLIT:
            self.to_host()
        if self.head == HOST:
            if upload:
                device.upload(self.buffer, self.store)
            self.head = SYNCED
        return self.buffer

    def written_on(self, device: DeviceMemory, upload: bool = True) -> Buffer:
        """The device buffer, to be written: from now on only the device is current."""
        buffer = self.on(device, upload)
        self.head = HOST if device.shares_host else DEVICE
        return buffer

    def adopt(self, device: DeviceMemory, buffer: Buffer) -> None:
        """`buffer` on `device`, holding the store's current values already
        (a prefetch thread uploaded them), becomes the device copy: both sides
        current, nothing copied."""
        self.device, self.buffer, self.head, self.shard = device, buffer, SYNCED, None

    # --- a hybrid split: one range on a device, the rest on the host --------------------
    def rest_on_host(self, written: bool, start: int = 0, stop: int = 0) -> None:
        """Make the host current outside elements [start, stop) (a split's
        host part reads its rows there, the device part has those); `written`:
        it writes them, so a whole-store device copy goes stale."""
        if self.head == DEVICE or (self.head == SPLIT and self.shard is not None and self.shard[1:3] != (start, stop)):
            self.to_host()
        if written and self.head == SYNCED:
            self.head = HOST

    def rows_on(self, device: DeviceMemory, start: int, stop: int, upload: bool = True) -> Buffer:
        """Elements [start, stop) in a buffer on `device`, current (copied up
        unless the shard there already holds them, or `upload` is False: the
        caller overwrites them all); from now on they are current only there."""
        shard = self.shard
        if self.head == SPLIT and shard is not None and shard[0] is device and shard[1] == start and shard[2] == stop:
            return shard[3]
        self.to_host()
        buffer = shard[3] if shard is not None and shard[0] is device and shard[3].size >= stop - start \
            else device.empty(stop - start)
        if upload:
            device.upload(buffer, self.store[start:stop])
        self.shard = (device, start, stop, buffer)
        self.head = SPLIT
        return buffer


class HostOnly:
    """The mirror of a store that never leaves the host (a batch partition's
    view of a blob, cct.runtime.partition): always current, refuses devices."""
    head = HOST
    buffer = None

    def to_host(self) -> None:
        pass

    def on(self, device: DeviceMemory) -> NoReturn:
        raise RuntimeError("a view of a blob's rows lives on the host; run its layer whole on a device")

    def written_on(self, device: DeviceMemory, upload: bool = True) -> NoReturn:
        self.on(device)


HOST_ONLY = HostOnly()


class Blob:
    # False: no execution plan holds this blob's views, so new ones leave
    # the layout alone (a detection layer's top no layer reads; the
    # executor sets it, Layer.tops_follow_values)
    in_layout = True
    layout: Optional[NetLayout] = None     # the net's whose top this is (Net sets it); else the global Layout
    _data_store: Array
    _diff_store: Optional[Array]
    _data_mirror: Mirror
    _diff_mirror: Optional[Mirror]
    _shape: Shape
    _data: Array
    _diff: Optional[Array]

    def __init__(self, shape: Sequence[int] = (), dtype: npt.DTypeLike = np.float32) -> None:
        self.dtype = np.dtype(dtype)
        self._data_store = np.zeros(0, self.dtype)   # flat storage, may exceed count
        self._diff_store = None                      # same capacity as the data's, once used
        self._data_mirror = Mirror(self._data_store)
        self._diff_mirror = None                     # made with the diff store
        self._shape = ()
        # views of the stores, made by reshape below (None until then marks them unmade)
        self._data = None                            # type: ignore[assignment]  # an Array from reshape on
        self._diff = None
        self.reshape(shape)

    # --- shape -------------------------------------------------------------------
    def reshape(self, *shape: Union[int, Sequence[int], Array]) -> None:
        """Reshape to `shape` (ints, or one tuple/list). Storage grows, never shrinks."""
        given: Sequence[Any] = shape
        if len(shape) == 1 and isinstance(shape[0], (tuple, list, np.ndarray)):
            given = tuple(shape[0])
        dims = tuple(int(d) for d in given)
        if dims == self._shape and self._data is not None:
            return      # every layer reshapes its tops at every forward: mostly to the shape they have
        if any(d < 0 for d in dims):
            raise ShapeError(f"blob shape must be non-negative, got {dims}")
        check_allocation(dims, self.dtype, blob=self)
        count = math.prod(dims)
        if count > self._data_store.size:
            charge_store((count - self._data_store.size) * self.dtype.itemsize, dims, self)
            self._data_mirror.to_host()                  # the values move to the grown store
            self._data_store = _grown(self._data_store, count)
            self._data_mirror = Mirror(self._data_store)
            # (a data store placed in another blob's, use_data_storage, may be the smaller)
            if self._diff_store is not None and count > self._diff_store.size:
                assert self._diff_mirror is not None      # made with the diff store
                self._diff_mirror.to_host()
                self._diff_store = _grown(self._diff_store, count)
                self._diff_mirror = Mirror(self._diff_store)
        self._shape = dims
        self._make_views()

    def reshape_like(self, other: "Blob") -> None:
        self.reshape(other.shape)

    def _make_views(self) -> None:
        if self.in_layout:
            (self.layout or Layout).changed()
        count = self.count
        self._data = self._data_store[:count].reshape(self._shape)
        self._diff = None if self._diff_store is None else self._diff_store[:count].reshape(self._shape)

    @property
    def shape(self) -> Shape:
        return self._shape

    # math.prod on the shape's Python ints: exact at any size, and a tenth of
    # np.prod's cost, which every layer's reshape pays several times (ResNet-50
    # at batch 1: 410 calls a forward)
    @property
    def count(self) -> int:
        return math.prod(self._shape)

    def count_range(self, start: int, end: Optional[int] = None) -> int:
        """Product of dims [start, end), Caffe's count(start, end)."""
        return math.prod(self._shape[start:end])

    def canonical_axis(self, axis: int) -> int:
        """Caffe's CanonicalAxisIndex: negative axes count from the end."""
        n = len(self._shape)
        if not -n <= axis < max(n, 1):
            raise ShapeError(f"axis {axis} out of range for a {n}-d blob {self._shape}")
        return axis + n if axis < 0 else axis

    # Caffe's legacy 4-d accessors (LegacyShape): axis i, or 1 past the last axis.
    def _legacy(self, index: int) -> int:
        if len(self._shape) > 4:
            raise ShapeError(f"num/channels/height/width need a blob of at most 4 axes, got {self._shape}")
        return self._shape[index] if index < len(self._shape) else 1

    num = property(lambda self: self._legacy(0))
    channels = property(lambda self: self._legacy(1))
    height = property(lambda self: self._legacy(2))
    width = property(lambda self: self._legacy(3))

    # --- data and diff -----------------------------------------------------------
    @property
    def data(self) -> Array:
        if self._data_mirror.head != HOST:
            _host_current(self._data_mirror)
        return self._data

    @data.setter
    def data(self, value: npt.ArrayLike) -> None:
        self.data[...] = value

    @property
    def diff(self) -> Array:
        diff = self._diff
        if diff is None:
            return self._allocate_diff()
        assert self._diff_mirror is not None             # made with the diff store
        if self._diff_mirror.head != HOST:
            _host_current(self._diff_mirror)
        return diff

    @diff.setter
    def diff(self, value: npt.ArrayLike) -> None:
        self.diff[...] = value

    def host_current(self) -> None:
        """Make the host the only current side of the data and of a diff made
        (a host writer is about to start): copied down here, once, where a
        device is ahead, not lazily by whichever of its threads reads first."""
        for mirror in (self._data_mirror, self._diff_mirror):
            if mirror is not None and mirror.head != HOST:
                _host_current(mirror)

    def read_data(self) -> Array:
        """The data as a read-only host view (Caffe's cpu_data): copied down
        when a device is ahead, whose copy stays current (the loss, the
        display, a snapshot read it; nothing is uploaded again after)."""
        return _read_only(self._data_mirror, self._data)

    def read_diff(self) -> Array:
        """The diff as a read-only host view (see read_data)."""
        diff = self._diff if self._diff is not None else self._allocate_diff()
        assert self._diff_mirror is not None             # made with the diff store
        return _read_only(self._diff_mirror, diff)

    # --- on a device (cct.devices) -----------------------------------------------------
    def device_data(self, device: DeviceMemory) -> Buffer:
        """The data in `device`'s flat buffer (of the store's capacity), to read."""
        return self._data_mirror.on(device)

    def mutable_device_data(self, device: DeviceMemory, upload: bool = True) -> Buffer:
        """The data's device buffer, to write: the host copy is stale from now
        on. upload=False: the caller overwrites it all (nothing stale copied up)."""
        return self._data_mirror.written_on(device, upload)

    def device_diff(self, device: DeviceMemory) -> Buffer:
        if self._diff is None:
            self._allocate_diff()
        assert self._diff_mirror is not None             # made with the diff store
        return self._diff_mirror.on(device)

    def mutable_device_diff(self, device: DeviceMemory, upload: bool = True) -> Buffer:
        if self._diff is None:
            self._allocate_diff()
        assert self._diff_mirror is not None             # made with the diff store
        return self._diff_mirror.written_on(device, upload)

    def adopt_device_data(self, device: DeviceMemory, buffer: Buffer) -> bool:
        """Take `buffer` on `device`, which holds the values the host data holds
        now, as the data's device copy (Mirror.adopt); False, and nothing
        changed, where it is smaller than the store or the device shares the
        host's memory."""
        if device.shares_host or buffer.size < self._data_store.size:
            return False
        self._data_mirror.adopt(device, buffer)
        return True

    def fill_device_diff(self, device: DeviceMemory, value: float) -> None:
        """Set the whole diff to `value` by a fill on `device`: nothing is
        copied up, and the device holds the only current copy."""
        buffer = self.mutable_device_diff(device, upload=False)
        device.fill(buffer, value, buffer.size)

    def sync_to_host(self) -> None:
        """Copy down what a device wrote, leaving both sides current (a host
        reader that writes nothing, e.g. a layer run on the CPU reading its bottoms)."""
        self._data_mirror.to_host()
        if self._diff_mirror is not None:
            self._diff_mirror.to_host()

    def keep_device_copy(self, diff: bool = False) -> None:
        """After a host reader that wrote nothing since sync_to_host: the
        device copy is current again (the data's, and with `diff` the diff's)."""
        for mirror in (self._data_mirror, self._diff_mirror if diff else None):
            if mirror is not None and mirror.buffer is not None and mirror.head == HOST:
                mirror.head = SYNCED

    def heads(self) -> Tuple[str, Optional[str]]:
        """(data head, diff head or None): which side is current."""
        return self._data_mirror.head, None if self._diff_mirror is None else self._diff_mirror.head

    def _allocate_diff(self) -> Array:
        """The diff view, its zeroed storage made now (capacity as the data's)."""
        with _ALLOCATION_LOCK:
            if self._diff_store is None:
                self._diff_store = np.zeros(self._data_store.size, self.dtype)
                self._diff_mirror = Mirror(self._diff_store)
                self._make_views()
        assert self._diff is not None                    # the views of a diff store are made with it
        return self._diff

    def share_data(self, other: "Blob") -> None:
        """Use `other`'s data storage (Caffe's ShareData); counts must agree."""
        self._check_same_count(other)
        if self._data_store is other._data_store and self._data_mirror is other._data_mirror:
            return      # shared already, views and all: an aliased Split shares again at every reshape
        self._data_store, self._data_mirror = other._data_store, other._data_mirror
        self._make_views()

    def share_diff(self, other: "Blob") -> None:
        """Use `other`'s diff storage (Caffe's ShareDiff); counts must agree."""
        self._check_same_count(other)
        if other._diff_store is None:
            other._allocate_diff()
        elif self._diff_store is other._diff_store and self._diff_mirror is other._diff_mirror:
            return      # shared already: a Flatten or Reshape shares again at every reshape
        self._diff_store, self._diff_mirror = other._diff_store, other._diff_mirror
        self._make_views()

    @property
    def data_view(self) -> Array:
        """The host data view as it stands, not synced from a device: a new
        array at every reshape to another shape and every change of store,
        which is what Layer.reshape_if_changed compares."""
        return self._data

    @property
    def data_store(self) -> Array:
        """The flat host array the data is a view of (capacity >= count): a
        Concat places its bottoms in pieces of its top's (use_data_storage)."""
        return self._data_store

    def shares_data_with(self, other: "Blob") -> bool:
        """Whether the two blobs' data stores overlap (ShareData, a Flatten's
        top and bottom, a Concat's placed bottoms and top)."""
        return np.may_share_memory(self._data_store, other._data_store)

    def use_data_storage(self, store: Array) -> None:
        """Keep the data in `store`, a flat array of at least the count (a
        Concat places its bottoms in slices of its top's store, cct.runtime.
        fusion), holding the values: the caller copied them there. A reshape
        that outgrows it moves the values to a store of the blob's own."""
        if store.size < self.count:
            raise ShapeError(f"a store of {store.size} elements cannot hold a blob of count {self.count}")
        self._data_mirror.to_host()
        self._data_store, self._data_mirror = store, Mirror(store)
        self._make_views()

    def sync_data_to_host(self) -> None:
        """Copy down the data a device wrote; both sides current."""
        self._data_mirror.to_host()

    def own_data_storage(self) -> None:
        """Move the data to a store of its own (a copy of the host values),
        its device copy and which side is current kept: a placed Concat
        bottom leaves its top's store."""
        store = self._data_store[:self.count].copy()
        self._data_store = self._data_mirror.store = store
        self._make_views()

    def written_on_host(self) -> None:
        """The host data was written in full through views of the store (a
        Concat's bottoms placed in it): a device copy is stale now, and is
        not copied down over it."""
        self._data_mirror.head = HOST

    def use_diff_storage(self, store: Optional[Array]) -> None:
        """Keep the diff in `store`, a flat array of the data's capacity (diff
        sharing hands out slices of shared arenas, cct.runtime.memory); None: in
        a store of its own, made on first use."""
        with _ALLOCATION_LOCK:                     # no lazy allocation racing the swap
            if self._diff_mirror is not None:
                self._diff_mirror.to_host()
            self._diff_store = store
            self._diff_mirror = None if store is None else Mirror(store)
            self._make_views()

    def _check_same_count(self, other: "Blob") -> None:
        if other.count != self.count:
            raise ShapeError(f"cannot share a blob of count {other.count} into one of count {self.count}")

    def __repr__(self) -> str:
        return f"Blob(shape={self._shape})"


def _host_current(mirror: Mirror) -> None:
    """Make the host the only current side of `mirror`, copying down at most
    once however many threads ask at the same time."""
    with _SYNC_LOCK:
        if mirror.head != HOST:
            mirror.to_host()
            mirror.head = HOST


def _read_only(mirror: Mirror, view: Array) -> Array:
    """`view` made current on the host, the device's copy kept current too, as a view no one can write."""
    if mirror.head not in (HOST, SYNCED):
        with _SYNC_LOCK:
            mirror.to_host()
    readable = view.view()
    readable.flags.writeable = False
    return readable


def _grown(store: Array, count: int) -> Array:
    grown = np.zeros(count, store.dtype)
    grown[:store.size] = store
    return grown
