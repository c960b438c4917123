"""Batch partitions (Caffe con Troll, Sec. 3.2): a layer's batch split into p
slices that run at once, each on a twin of the layer (`Layer.clone`).

A twin works on BlobSlice views of the batch, so per-forward state (pooling
argmax, saved inputs) stays per partition. Its parameters are ParamViews of
the layer's: the data is shared; the first twin accumulates into the layer's
own diffs, the others into diffs of their own, which are summed into the
layer's after backward (no race on `+=`).
"""
from typing import Callable, Iterator, List, NoReturn, Optional, Protocol, Sequence, Tuple, Union, cast

import numpy as np

from cct.core.arrays import Array
from cct.core.blob import HOST_ONLY, Blob, Buffer, DeviceMemory, Mirror
from cct.core.errors import ShapeError
from cct.core.layer import Layer
from cct.runtime.threads import Worker, run_all

# A twin's bound forward and backward (None unless asked for): PartitionedLayer.bind.
Bound = Tuple[Callable[[], None], Optional[Callable[[], None]]]


class MirrorPart(Protocol):
    """What the blob code calls on the mirror of a blob that views another's
    rows (cct.core.blob.HostOnly here, cct.runtime.hybrid's _RowsMirror):
    Blob declares a Mirror, which these play the part of without being one.
    (keep_device_copy's `buffer`, rest_on_host and rows_on are asked only of
    a net's own blobs, never of these views.)"""
    head: str

    def to_host(self) -> None: ...
    def on(self, device: DeviceMemory) -> Buffer: ...
    def written_on(self, device: DeviceMemory, upload: bool = True) -> Buffer: ...


def as_mirror(stand_in: MirrorPart) -> Mirror:
    """`stand_in` where a Blob keeps its Mirror: checked against MirrorPart, then cast."""
    return cast(Mirror, stand_in)


_HOST_ONLY = as_mirror(HOST_ONLY)


class BlobSlice(Blob):
    """Rows [start, stop) of a blob's batch axis, as a Blob of fixed shape (on the host)."""
    _data_mirror = _diff_mirror = _HOST_ONLY

    def __init__(self, blob: Blob, start: int, stop: int) -> None:
        self.dtype = blob.dtype
        self._shape = (stop - start,) + blob.shape[1:]
        self._data = blob.data[start:stop]
        self._diff = None                 # the blob's diff is made only if a layer asks
        self._rows = (blob, start, stop)

    def _allocate_diff(self) -> Array:
        blob, start, stop = self._rows
        self._diff = blob.diff[start:stop]
        return self._diff

    def reshape(self, *shape: Union[int, Sequence[int], Array]) -> None:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        if tuple(int(d) for d in cast(Sequence[int], shape)) != self._shape:     # ints, a tuple given unpacked
            raise ShapeError(f"a batch partition of shape {self._shape} cannot be reshaped to {shape}")

    def share_data(self, other: Blob) -> NoReturn:
        raise ShapeError("a batch partition cannot share storage")

    share_diff = share_data


class ParamView(Blob):
    """A clone's parameter: the layer's data; the layer's diff (`shares_diff`) or
    a private one, made on first use (on the host)."""
    _data_mirror = _diff_mirror = _HOST_ONLY
    _blob: Blob                           # the layer's parameter, while `shares_diff`

    def __init__(self, blob: Blob, shares_diff: bool) -> None:
        self.dtype = blob.dtype
        self._shape = blob.shape
        self.shares_diff = shares_diff
        self._diff = None
        self.follow(blob)

    def follow(self, blob: Blob) -> None:
        """Track the layer's current storage (share_with and copy_from may replace it)."""
        self._data = blob.data
        if self.shares_diff:
            self._diff = None
            self._blob = blob

    def _allocate_diff(self) -> Array:
        self._diff = self._blob.diff if self.shares_diff else np.zeros(self._shape, self.dtype)
        return self._diff

    def reshape(self, *shape: Union[int, Sequence[int], Array]) -> NoReturn:
        raise ShapeError("a partition clone cannot reshape a parameter")


class PartitionedLayer:
    """Runs `layer` over `partitions` slices of the batch in parallel, each on
    a twin from `layer.clone(partitions)` whose parameters are ParamViews."""

    def __init__(self, layer: Layer, partitions: int) -> None:
        self.layer = layer
        self.partitions = partitions
        self.clones: List[Layer] = []
        for index in range(partitions):
            clone = layer.clone(partitions)
            clone.blobs = [ParamView(blob, shares_diff=index == 0) for blob in layer.blobs]
            self.clones.append(clone)

    def _bounds(self, batch: int) -> List[Tuple[int, int]]:
        """[(start, stop)] of each partition: sizes differ by one sample at most,
        and none is empty while the batch has at least as many samples."""
        edges = np.linspace(0, batch, self.partitions + 1).astype(int)
        return list(zip(edges[:-1], edges[1:]))

    def _views(self, bottoms: Sequence[Blob],
               tops: Sequence[Blob]) -> Iterator[Tuple[Layer, Sequence[Blob], Sequence[Blob]]]:
        batch = bottoms[0].shape[0]
        self.follow()
        for (start, stop), clone in zip(self._bounds(batch), self.clones):
            if start == stop:
                continue                  # an empty partition (more partitions than samples): nothing to run
            bottom_views = [BlobSlice(b, start, stop) for b in bottoms]
            # An in-place top gets the very view of its bottom, so the clone sees in-place.
            top_views = [next((v for b, v in zip(bottoms, bottom_views) if b is t), None)
                         or BlobSlice(t, start, stop) for t in tops]
            yield clone, bottom_views, top_views

    def forward(self, workers: Sequence[Worker], bottoms: Sequence[Blob], tops: Sequence[Blob]) -> None:
        def run(clone: Layer, bottom_views: Sequence[Blob], top_views: Sequence[Blob]) -> None:
            clone.reshape(bottom_views, top_views)
            clone.forward(bottom_views, top_views)
        run_all(workers, run, self._views(bottoms, tops))

    def backward(self, workers: Sequence[Worker], tops: Sequence[Blob], propagate_down: Sequence[bool],
                 bottoms: Sequence[Blob]) -> None:
        def run(clone: Layer, bottom_views: Sequence[Blob], top_views: Sequence[Blob]) -> None:
            clone.param_propagate_down = self.layer.param_propagate_down
            clone.backward(top_views, propagate_down, bottom_views)
        run_all(workers, run, self._views(bottoms, tops))
        self.sum_private_diffs()

    def backward_param(self, workers: Sequence[Worker], index: int, tops: Sequence[Blob],
                       bottoms: Sequence[Blob]) -> None:
        """Parameter `index`'s gradient (Layer.backward_param) in the partitions,
        the twins' private parts then summed in: bitwise the whole backward's
        (each parameter's parts are added in the same order)."""
        def run(clone: Layer, bottom_views: Sequence[Blob], top_views: Sequence[Blob]) -> None:
            clone.backward_param(index, top_views, bottom_views)
        run_all(workers, run, self._views(bottoms, tops))
        self._sum_private_diffs(index)

    def backward_data(self, workers: Sequence[Worker], tops: Sequence[Blob], propagate_down: Sequence[bool],
                      bottoms: Sequence[Blob]) -> None:
        """The bottoms' gradients (Layer.backward_data), each partition its rows."""
        def run(clone: Layer, bottom_views: Sequence[Blob], top_views: Sequence[Blob]) -> None:
            clone.backward_data(top_views, propagate_down, bottom_views)
        run_all(workers, run, self._views(bottoms, tops))

    def bind(self, bottoms: Sequence[Blob], tops: Sequence[Blob], propagate_down: Sequence[bool],
             backward: bool) -> List[Bound]:
        """Per partition, its twin's forward and backward (None unless
        `backward`) bound on views made now (Layer.bind_forward): for an
        execution plan, which holds them while the layout holds (the views
        slice the blobs' arrays of now). follow() before running them, and
        sum_private_diffs() after the backwards."""
        bound: List[Bound] = []
        for clone, bottom_views, top_views in self._views(bottoms, tops):
            clone.reshape(bottom_views, top_views)
            clone.param_propagate_down = self.layer.param_propagate_down
            forward = clone.bind_forward(bottom_views, top_views)
            back = clone.bind_backward(top_views, propagate_down, bottom_views) if backward else None
            bound.append((forward, back))
        return bound

    def follow(self) -> None:
        """Every twin's parameter views onto the layer's storage of now."""
        for clone in self.clones:
            for view, blob in zip(clone.blobs, self.layer.blobs):
                cast(ParamView, view).follow(blob)       # a twin's blobs are ParamViews (__init__)

    def sum_private_diffs(self) -> None:
        """After the bound backwards: the twins' private parameter diffs
        added into the layer's, in the order backward adds them."""
        for index in range(len(self.layer.blobs)):
            if self.layer.param_propagate_down[index]:
                self._sum_private_diffs(index)

    def _sum_private_diffs(self, index: int) -> None:
        blob = self.layer.blobs[index]
        for clone in self.clones[1:]:        # clone 0 wrote into blob.diff itself
            private = clone.blobs[index]._diff
            if private is not None:
                blob.diff += private
                private[...] = 0
