"""Layers that route or reshape blobs without arithmetic on values beyond sums:
Split, Concat, Slice, Flatten, Reshape, Crop, Tile, Silence, BatchReindex, Filter;
the forks' ShuffleChannel (ShuffleNet) and Reorg (the YOLOv2 port)."""
import math

import numpy as np

from cct.core.errors import ShapeError
from cct.core.layer import Layer, register


def canonical_axis(layer, blob, axis, field):
    """Caffe's CanonicalAxisIndex with an error that names the layer and field."""
    try:
        return blob.canonical_axis(axis)
    except ShapeError:
        raise layer.config_error(field, f"axis {axis} is out of range for a {len(blob.shape)}-d "
                                 f"bottom of shape {blob.shape}") from None


def legacy_or_axis(layer, blob, param, legacy_name, section):
    """The axis from `axis`, or from its deprecated non-negative alias (concat_dim,
    slice_dim); Caffe refuses both at once."""
    if param.HasField("axis") and param.HasField(legacy_name):
        raise layer.config_error(f"{section}.{legacy_name}", f"give either axis or {legacy_name}, not both")
    if param.HasField(legacy_name):
        value = getattr(param, legacy_name)
        if value >= len(blob.shape):
            raise layer.config_error(f"{section}.{legacy_name}", f"{value} is out of range for a "
                                     f"{len(blob.shape)}-d bottom of shape {blob.shape}")
        return value
    return canonical_axis(layer, blob, param.axis, f"{section}.axis")


def gather_rows(source, indices, out):
    """out[i] = source[indices[i]] along the first axis; indices already checked."""
    if source.dtype == out.dtype:
        np.take(source, indices, axis=0, out=out, mode="clip")   # clip: no buffered copy
    else:
        out[...] = source[indices]


def axis_slices(axis, bounds):
    """Index tuples selecting [start, end) along `axis` for each pair in `bounds`."""
    lead = (slice(None),) * axis
    return [lead + (slice(start, end),) for start, end in bounds]


def view_layout(shape, make):
    """(shape, element strides, element offset) of make(a C-contiguous
    float32 array of `shape`), make a function of numpy views (reshape,
    transpose, slice, broadcast), found on a stand-in that holds no data:
    what a device's copy_strided needs to copy that view of a blob's buffer."""
    strides = [4 * math.prod(shape[k + 1:]) for k in range(len(shape))]
    stand_in = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), tuple(shape), tuple(strides),
                                               writeable=False)
    view = make(stand_in)
    offset = view.__array_interface__["data"][0] - stand_in.__array_interface__["data"][0]
    return view.shape, [stride // 4 for stride in view.strides], offset // 4


def copy_view_on(device, src, dst, shape, make, accumulate=False):
    """dst (contiguous) = make(src seen as `shape`), or += it, on a device (view_layout)."""
    view_shape, strides, offset = view_layout(shape, make)
    device.copy_strided(src, dst, view_shape, strides, src_offset=offset, accumulate=accumulate)


def copy_into_view_on(device, src, dst, shape, make):
    """make(dst seen as `shape`) = src (contiguous) on a device (view_layout)."""
    view_shape, strides, offset = view_layout(shape, make)
    contiguous = [math.prod(view_shape[k + 1:]) for k in range(len(view_shape))]
    device.copy_strided(src, dst, view_shape, contiguous, strides, dst_offset=offset)


def fits_copy_view(device, shape, make):
    """Whether copy_view_on can copy make's view of a blob of `shape` (its axis count)."""
    return len(view_layout(shape, make)[0]) <= device.max_axes


def copy_pieces(device, whole, pieces, shape, axis, bounds, into_whole, wanted=None):
    """Device buffers: the blob of `shape` (`whole`) and its pieces along
    `axis`, piece i the [start, end) of `bounds[i]`, in flat buffers of their
    own; copy each piece into its place in the whole (into_whole) or out of
    it. Each is one block per leading index: (outer, width * inner) of the
    whole's (outer, size * inner). `wanted[i]` false skips piece i."""
    outer = int(np.prod(shape[:axis], dtype=np.int64))
    inner = int(np.prod(shape[axis + 1:], dtype=np.int64))
    stride = shape[axis] * inner
    for i, (piece, (start, end)) in enumerate(zip(pieces, bounds)):
        if wanted is not None and not wanted[i]:
            continue
        size = (end - start) * inner
        if into_whole:
            device.copy_blocks(piece, whole, outer, size, size, stride, 0, start * inner)
        else:
            device.copy_blocks(whole, piece, outer, size, stride, size, start * inner, 0)


@register("Split")
class Split(Layer):
    """Copies its bottom to every top; backward sums the tops' diffs.
    Inserted by the net for blobs read by several layers.

    `aliases = True` (set by inference fusion, cct.runtime.fusion, where no
    layer writes the bottom or a top afterwards): the tops share the bottom's
    data (Caffe's ShareData), shared again at every reshape, and forward
    copies nothing. Diffs stay the tops' own."""
    exact_bottoms = 1
    min_tops = 1
    aliases = False
    reshape_reads_layout = True       # (fusion sets aliases, then reshapes it itself)

    def reshape(self, bottom, top):
        for blob in top:
            blob.reshape(bottom[0].shape)
            if self.aliases and blob is not bottom[0]:
                blob.share_data(bottom[0])

    def forward(self, bottom, top):
        if self.aliases:
            return
        for blob in top:
            if blob is not bottom[0]:
                blob.data[...] = bottom[0].data

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            # summed in place, in the tops' order (no whole-blob temporary): a
            # bottom never shares a diff store with its own tops (cct.runtime.memory)
            total = bottom[0].diff
            np.copyto(total, top[0].diff)
            for blob in top[1:]:
                total += blob.diff

    def runs_on(self, device, bottom, top):
        return self.all_float32(bottom, top)

    def forward_on(self, device, bottom, top):
        if self.aliases:
            return            # the tops share the bottom's data, its device buffer included
        count = bottom[0].count
        x = bottom[0].device_data(device)
        for blob in top:
            if blob is not bottom[0]:
                device.copy(blob.mutable_device_data(device), x, count)

    def backward_on(self, device, top, propagate_down, bottom):
        if propagate_down[0]:
            count = bottom[0].count
            total = bottom[0].mutable_device_diff(device)
            first = top[0].device_diff(device)
            if first is not total:                # a top that is the bottom holds its diff already
                device.copy(total, first, count)
            for blob in top[1:]:
                device.axpby(count, 1.0, blob.device_diff(device), 1.0, total)


@register("Concat")
class Concat(Layer):
    """Joins its bottoms along one axis.

    concat_param: axis (default 1, negative counts from the end) or the
    deprecated concat_dim (not both). Bottoms agree in every other dimension;
    top shape = bottom[0] shape with shape[axis] = sum of the bottoms' shape[axis].
    Backward hands each bottom its slice of the top diff.

    `views = True` (set by inference fusion, cct.runtime.fusion, where no
    later layer writes a bottom or the top and no other blob shares a
    bottom's data): where the bottoms' pieces of the top are contiguous (one
    row before the axis: batch 1 along the channels), each bottom's data is
    placed in its piece of the top's store, so its producer writes the top
    and forward copies nothing (BENCHMARKS.md, "Session 11: Concat as views,
    conv1 in bands, LRN in Caffe's order, 2 x 2 pooling backward, col2im by rows").
    Placed at each reshape that changed the shapes or stores; the diffs stay
    the bottoms' own.
    """
    min_bottoms = 1
    exact_tops = 1
    views = False
    reshape_reads_layout = True       # and _on_device: a host forward after a device one reshapes again
    _placed = None                    # (the top's store, (its shape, the bounds), each bottom's piece) while placed
    _on_device = False                # the last forward ran on a device: not placed before a host one

    def reshape(self, bottom, top):
        self.axis = axis = legacy_or_axis(self, bottom[0], self.layer_param.concat_param,
                                          "concat_dim", "concat_param")
        first = bottom[0].shape
        bounds, start = [], 0
        for index, blob in enumerate(bottom):
            shape = blob.shape
            if len(shape) != len(first) or shape[:axis] + shape[axis + 1:] != first[:axis] + first[axis + 1:]:
                raise self.shape_error(f"bottom[{index}] has shape {shape}, which does not match "
                                       f"bottom[0] {first} outside the concat axis {axis}")
            bounds.append((start, start + shape[axis]))
            start += shape[axis]
        self._slices = axis_slices(axis, bounds)
        self._bounds = bounds
        top[0].reshape(first[:axis] + (start,) + first[axis + 1:])
        if self._placed is not None and not self._still_placed(bottom, top[0]):
            self._unplace(bottom)
        if self.views and not self._on_device and self._placed is None:
            self._place(bottom, top[0])

    def _still_placed(self, bottom, top):
        placed = self._placed
        return (placed is not None and placed[0] is top.data_store and placed[1] == (top.shape, self._bounds)
                and all(blob.data_store is piece for blob, piece in zip(bottom, placed[2])))

    def _place(self, bottom, top):
        """Each bottom's data into its piece of the top's store, values kept,
        where the pieces are contiguous and the bottoms distinct blobs."""
        distinct = len({id(blob) for blob in bottom + [top]}) == len(bottom) + 1
        if top.count_range(0, self.axis) != 1 or not distinct:
            return
        store, inner = top.data_store, top.count_range(self.axis + 1)
        pieces = [store[start * inner:stop * inner] for start, stop in self._bounds]
        for blob, piece in zip(bottom, pieces):
            piece[...] = blob.data.reshape(-1)
            blob.use_data_storage(piece)
        self._placed = (store, (top.shape, self._bounds), pieces)

    def _unplace(self, bottom):
        """The bottoms still in their pieces of the top's store move to stores
        of their own: a copy into the top (strided pieces, or a device's
        forward) must not write over them."""
        for blob, piece in zip(bottom, self._placed[2]):
            if blob.data_store is piece:
                blob.own_data_storage()
        self._placed = None

    def forward(self, bottom, top):
        if self._on_device:
            self.reshape_again()          # its next reshape places the bottoms again
        self._on_device = False
        if self._still_placed(bottom, top[0]):
            for blob in bottom:
                blob.sync_data_to_host()      # a bottom written on a device: copied down into its piece
            top[0].written_on_host()
            return
        if len(bottom) == 1:
            top[0].data[...] = bottom[0].data
        else:
            np.concatenate([blob.data for blob in bottom], axis=self.axis, out=top[0].data)

    def backward(self, top, propagate_down, bottom):
        for blob, where, wanted in zip(bottom, self._slices, propagate_down):
            if wanted:
                blob.diff[...] = top[0].diff[where]

    def runs_on(self, device, bottom, top):
        return self.all_float32(bottom, top)

    def forward_on(self, device, bottom, top):
        if self._placed is not None:      # the top's host copy goes stale now
            self._unplace(bottom)
        self._on_device = True
        copy_pieces(device, top[0].mutable_device_data(device), [blob.device_data(device) for blob in bottom],
                    top[0].shape, self.axis, self._bounds, into_whole=True)

    def backward_on(self, device, top, propagate_down, bottom):
        pieces = [blob.mutable_device_diff(device) if wanted else None for blob, wanted in zip(bottom, propagate_down)]
        copy_pieces(device, top[0].device_diff(device), pieces, top[0].shape, self.axis, self._bounds,
                    into_whole=False, wanted=propagate_down)


@register("Slice")
class Slice(Layer):
    """Cuts its bottom along one axis into the tops.

    slice_param: axis (default 1) or the deprecated slice_dim (not both);
    slice_point: one increasing cut index per boundary (len(top) - 1 of them),
    or none for equal pieces (the axis must divide by the number of tops).
    top[i] shape = bottom shape with shape[axis] = the width of piece i.
    """
    exact_bottoms = 1
    min_tops = 1

    def reshape(self, bottom, top):
        param = self.layer_param.slice_param
        shape = bottom[0].shape
        axis = legacy_or_axis(self, bottom[0], param, "slice_dim", "slice_param")
        size = shape[axis]
        points = list(param.slice_point)
        if points:
            if len(points) != len(top) - 1:
                raise self.config_error("slice_param.slice_point", f"give one point per boundary "
                                        f"({len(top) - 1} for {len(top)} tops), got {len(points)}")
            if any(b <= a for a, b in zip([0] + points, points)) or points[-1] >= size:
                raise self.config_error("slice_param.slice_point", f"{points} must increase strictly "
                                        f"within (0, {size}), the size of axis {axis}")
        else:
            if size % len(top):
                raise self.config_error("slice_param", f"{len(top)} tops do not evenly divide axis "
                                        f"{axis} of size {size}; give slice_point")
            step = size // len(top)
            points = [step * k for k in range(1, len(top))]
        bounds = list(zip([0] + points, points + [size]))
        self._slices = axis_slices(axis, bounds)
        self._axis, self._bounds = axis, bounds
        for blob, (start, end) in zip(top, bounds):
            blob.reshape(shape[:axis] + (end - start,) + shape[axis + 1:])

    def forward(self, bottom, top):
        for blob, where in zip(top, self._slices):
            blob.data[...] = bottom[0].data[where]

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            diff = bottom[0].diff
            for blob, where in zip(top, self._slices):
                diff[where] = blob.diff

    def runs_on(self, device, bottom, top):
        return self.all_float32(bottom, top)

    def forward_on(self, device, bottom, top):
        copy_pieces(device, bottom[0].device_data(device), [blob.mutable_device_data(device) for blob in top],
                    bottom[0].shape, self._axis, self._bounds, into_whole=False)

    def backward_on(self, device, top, propagate_down, bottom):
        if propagate_down[0]:
            copy_pieces(device, bottom[0].mutable_device_diff(device), [blob.device_diff(device) for blob in top],
                        bottom[0].shape, self._axis, self._bounds, into_whole=True)


class _SharedView(Layer):
    """Base of layers whose top is the bottom's memory under another shape (Caffe's
    ShareData/ShareDiff): no copy forward or backward. Not allowed in place."""
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        if top[0] is bottom[0]:
            raise self.config_error("top", f"{self.type} cannot run in place; give the top its own name")

    def top_shape(self, bottom):
        raise NotImplementedError

    def reshape(self, bottom, top):
        top[0].reshape(self.top_shape(bottom[0]))
        if top[0].count != bottom[0].count:
            raise self.shape_error(f"top shape {top[0].shape} has {top[0].count} elements, the bottom "
                                   f"{bottom[0].shape} has {bottom[0].count}")
        top[0].share_data(bottom[0])
        top[0].share_diff(bottom[0])

    def forward(self, bottom, top):
        pass

    def backward(self, top, propagate_down, bottom):
        pass                  # the top's diff is the bottom's diff

    # On a device too: the shared stores carry their device mirrors (Blob.share_data),
    # so the top's device buffers are the bottom's
    def runs_on(self, device, bottom, top):
        return self.all_float32(bottom, top)

    def forward_on(self, device, bottom, top):
        pass

    def backward_on(self, device, top, propagate_down, bottom):
        pass


@register("Flatten")
class Flatten(_SharedView):
    """Merges axes [axis, end_axis] into one.

    flatten_param: axis (default 1), end_axis (default -1, inclusive).
    top shape = shape[:axis] + (prod(shape[axis:end_axis+1]),) + shape[end_axis+1:].
    """

    def top_shape(self, bottom):
        param = self.layer_param.flatten_param
        start = canonical_axis(self, bottom, param.axis, "flatten_param.axis")
        end = canonical_axis(self, bottom, param.end_axis, "flatten_param.end_axis")
        shape = bottom.shape
        return shape[:start] + (bottom.count_range(start, end + 1),) + shape[end + 1:]


@register("Reshape")
class Reshape(_SharedView):
    """Gives the bottom's data a new shape without copying.

    reshape_param: shape { dim } where 0 copies the bottom dimension at that
    position and one -1 is inferred from the count; axis (default 0, negative:
    -1 is the end) and num_axes (default -1: to the end) pick the bottom axes
    [axis, axis + num_axes) that `shape` replaces.
    """

    def setup(self, bottom, top):
        super().setup(bottom, top)
        dims = list(self.layer_param.reshape_param.shape.dim)
        self._copy_axes = [i for i, d in enumerate(dims) if d == 0]
        inferred = [i for i, d in enumerate(dims) if d == -1]
        if len(inferred) > 1:
            raise self.config_error("reshape_param.shape", f"{dims} has {len(inferred)} dims of -1; "
                                    "at most one may be inferred")
        if any(d < -1 for d in dims):
            raise self.config_error("reshape_param.shape", f"{dims}: dims must be > 0, 0 (copy) or -1 (infer)")
        self._inferred = inferred[0] if inferred else None
        self._dims = dims
        self._constant = int(np.prod([d for d in dims if d > 0], dtype=np.int64))
        if self.layer_param.reshape_param.num_axes < -1:
            raise self.config_error("reshape_param.num_axes", "must be >= 0, or -1 for all axes, "
                                    f"got {self.layer_param.reshape_param.num_axes}")

    def top_shape(self, bottom):
        param = self.layer_param.reshape_param
        shape, count = bottom.shape, bottom.count
        start = param.axis if param.axis >= 0 else len(shape) + param.axis + 1
        if not 0 <= start <= len(shape):
            raise self.config_error("reshape_param.axis", f"{param.axis} is out of range for a "
                                    f"{len(shape)}-d bottom of shape {shape}")
        end = len(shape) if param.num_axes == -1 else start + param.num_axes
        if end > len(shape):
            raise self.config_error("reshape_param.num_axes", f"axis + num_axes = {end} is past the "
                                    f"last axis of the {len(shape)}-d bottom {shape}")
        new = list(self._dims)
        for i in self._copy_axes:
            if start + i >= len(shape):
                raise self.config_error("reshape_param.shape", f"dim {i} is 0 (copy) but the bottom "
                                        f"{shape} has no axis {start + i} to copy")
            new[i] = shape[start + i]
        if self._inferred is not None:
            known = self._constant * bottom.count_range(0, start) * bottom.count_range(end)
            known *= int(np.prod([new[i] for i in self._copy_axes], dtype=np.int64))
            if known == 0 or count % known:
                raise self.shape_error(f"cannot infer the -1 dim of {self._dims}: bottom count {count} "
                                       f"is not divisible by the product of the other dims ({known})")
            new[self._inferred] = count // known
        return shape[:start] + tuple(new) + shape[end:]


@register("Crop")
class Crop(Layer):
    """Crops bottom[0] to bottom[1]'s shape from axis `axis` on.

    crop_param: axis (default 2): first cropped axis; offset: none (0), one for
    every cropped axis, or one per cropped axis. top shape = bottom[0] shape[:axis]
    + bottom[1] shape[axis:]; top = bottom[0][..., o_a:o_a+n_a, ...].
    bottom[1] only gives a shape and gets a zero gradient. A Crop without
    crop_param in the forks' nets (HED, CRF-RNN) gets the offsets their
    Crop computes from the net's geometry (cct.core.passes.legacy_crop_offsets,
    which logs each).
    """
    exact_bottoms = 2
    exact_tops = 1

    def setup(self, bottom, top):
        param = self.layer_param.crop_param
        axis = canonical_axis(self, bottom[0], param.axis, "crop_param.axis")
        cropped = len(bottom[0].shape) - axis
        if len(param.offset) > 1 and len(param.offset) != cropped:
            raise self.config_error("crop_param.offset", f"give one offset or one per cropped axis "
                                    f"({cropped} from axis {axis}), got {len(param.offset)}")

    def reshape(self, bottom, top):
        param = self.layer_param.crop_param
        shape, reference = bottom[0].shape, bottom[1].shape
        axis = canonical_axis(self, bottom[0], param.axis, "crop_param.axis")
        if len(reference) != len(shape):
            raise self.shape_error(f"bottom[1] {reference} must have as many axes as bottom[0] {shape}")
        offsets = list(param.offset)
        if len(offsets) <= 1:
            offsets = [offsets[0] if offsets else 0] * (len(shape) - axis)
        window, new_shape = [slice(None)] * axis, list(shape[:axis])
        for i, offset in zip(range(axis, len(shape)), offsets):
            if shape[i] - offset < reference[i]:
                raise self.shape_error(f"crop of axis {i} is out of bounds: size {reference[i]} at "
                                       f"offset {offset} does not fit in bottom[0]'s {shape[i]}")
            window.append(slice(offset, offset + reference[i]))
            new_shape.append(reference[i])
        self._window = tuple(window)
        top[0].reshape(new_shape)

    def forward(self, bottom, top):
        top[0].data[...] = bottom[0].data[self._window]

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            bottom[0].diff[...] = 0
            bottom[0].diff[self._window] = top[0].diff
        if propagate_down[1]:
            bottom[1].diff[...] = 0

    # --- on a device: the window copied strided, both ways (the old Crop's too)
    def runs_on(self, device, bottom, top):
        return self.all_float32(bottom, top) and fits_copy_view(device, bottom[0].shape, self._cropped)

    def _cropped(self, x):
        return x[self._window]

    def forward_on(self, device, bottom, top):
        copy_view_on(device, bottom[0].device_data(device), top[0].mutable_device_data(device, upload=False),
                     bottom[0].shape, self._cropped)

    def backward_on(self, device, top, propagate_down, bottom):
        if propagate_down[0]:
            bottom[0].fill_device_diff(device, 0.0)
            copy_into_view_on(device, top[0].device_diff(device), bottom[0].mutable_device_diff(device),
                              bottom[0].shape, self._cropped)
        if propagate_down[1]:
            bottom[1].fill_device_diff(device, 0.0)


@register("Tile")
class Tile(Layer):
    """Repeats the bottom `tiles` times along an axis, whole blocks at a time.

    tile_param: axis (default 1), tiles (required, > 0).
    top shape = bottom shape with shape[axis] *= tiles; viewed as
    (outer, tiles, inner) with outer = prod(shape[:axis]), inner = prod(shape[axis:]),
    every tile holds the bottom's (outer, inner) block.
    """
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        param = self.layer_param.tile_param
        if not param.HasField("tiles"):
            raise self.config_error("tile_param.tiles", "missing: give the number of tiles")
        if param.tiles <= 0:
            raise self.config_error("tile_param.tiles", f"must be > 0, got {param.tiles}")

    def reshape(self, bottom, top):
        param = self.layer_param.tile_param
        axis = canonical_axis(self, bottom[0], param.axis, "tile_param.axis")
        shape = bottom[0].shape
        self._blocks = (bottom[0].count_range(0, axis), param.tiles, bottom[0].count_range(axis))
        top[0].reshape(shape[:axis] + (shape[axis] * param.tiles,) + shape[axis + 1:])

    def forward(self, bottom, top):
        outer, tiles, inner = self._blocks
        top[0].data.reshape(outer, tiles, inner)[...] = bottom[0].data.reshape(outer, 1, inner)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            outer, tiles, inner = self._blocks
            np.sum(top[0].diff.reshape(outer, tiles, inner), axis=1,
                   out=bottom[0].diff.reshape(outer, inner))


@register("Silence")
class Silence(Layer):
    """Consumes blobs nobody else reads, so they are not net outputs. No tops;
    backward gives every bottom a zero diff."""
    min_bottoms = 1
    exact_tops = 0

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        pass

    def backward(self, top, propagate_down, bottom):
        for blob, wanted in zip(bottom, propagate_down):
            if wanted:
                blob.diff[...] = 0


def _selector_error(layer, index):
    return layer.config_error(f"bottom[{index}]", f"{layer.type} cannot backpropagate to its index "
                              "input; set propagate_down: false for it")


@register("BatchReindex")
class BatchReindex(Layer):
    """Gathers items of bottom[0] along the first axis: top[i] = bottom[0][index[i]].

    bottom[1]: 1-d, integer indices (stored as floats) in [0, bottom[0].shape[0]).
    top shape = (len(index),) + bottom[0] shape[1:]. Backward adds each top
    item's diff into the item it came from; the indices get no gradient.
    """
    exact_bottoms = 2
    exact_tops = 1

    def allow_force_backward(self, bottom_index):
        return bottom_index != 1

    def reshape(self, bottom, top):
        if len(bottom[1].shape) != 1:
            raise self.shape_error(f"bottom[1] (indices) must be 1-d, got shape {bottom[1].shape}")
        top[0].reshape(bottom[1].shape[:1] + bottom[0].shape[1:])

    def _indices(self, bottom):
        values = bottom[1].data
        num = bottom[0].shape[0]
        if values.size and (values.min() < 0 or values.max() >= num):
            raise self.shape_error(f"indices must lie in [0, {num}) (bottom[0]'s batch size), "
                                   f"got values in [{values.min()}, {values.max()}]")
        return values.astype(np.intp)        # truncation, as Caffe's int cast

    def forward(self, bottom, top):
        gather_rows(bottom[0].data, self._indices(bottom), top[0].data)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[1]:
            raise _selector_error(self, 1)
        if propagate_down[0]:
            diff = bottom[0].diff
            diff[...] = 0
            np.add.at(diff, self._indices(bottom), top[0].diff)


@register("Filter")
class Filter(Layer):
    """Keeps the items whose selector is nonzero.

    bottoms: the blobs to filter, then the selector (shape (N,) or (N, 1, ...)).
    Every filtered bottom has first dimension N; top[i] = bottom[i][selector != 0],
    so len(top) = len(bottom) - 1. Before the first forward (selector unknown)
    the tops are sized for all N items, as in Caffe. Backward scatters the top
    diffs back and zeroes the dropped items; the selector gets no gradient.
    """
    min_bottoms = 2
    min_tops = 1

    def allow_force_backward(self, bottom_index):
        return bottom_index != len(self.layer_param.bottom) - 1

    def setup(self, bottom, top):
        if len(top) != len(bottom) - 1:
            raise self.config_error("top", f"give one top per filtered bottom ({len(bottom) - 1}), got {len(top)}")
        self._first_reshape = True

    def reshape(self, bottom, top):
        selector = bottom[-1]
        if any(d != 1 for d in selector.shape[1:]):
            raise self.shape_error(f"the selector (bottom[{len(bottom) - 1}]) must have shape (N,) or "
                                   f"(N, 1, ...), got {selector.shape}")
        for index, blob in enumerate(bottom[:-1]):
            if blob.shape[:1] != selector.shape[:1]:
                raise self.shape_error(f"bottom[{index}] {blob.shape} must have the selector's first "
                                       f"dimension {selector.shape[0]}")
        self._keep = np.flatnonzero(selector.data.reshape(-1))
        kept = selector.shape[0] if self._first_reshape else self._keep.size
        self._first_reshape = False
        for blob, source in zip(top, bottom):
            blob.reshape((kept,) + source.shape[1:])

    def forward(self, bottom, top):
        for blob, source in zip(top, bottom):
            gather_rows(source.data, self._keep, blob.data)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[-1]:
            raise _selector_error(self, len(bottom) - 1)
        for blob, source, wanted in zip(top, bottom, propagate_down):
            if wanted:
                source.diff[...] = 0
                source.diff[self._keep] = blob.diff


def _refuse_in_place(layer, bottom, top):
    if top[0] is bottom[0]:
        raise layer.config_error("top", f"{layer.type} cannot run in place; give the top its own name")


def _channels_and_pixels(layer, blob):
    """(N, C, pixels) of a bottom of at least 2 axes."""
    if len(blob.shape) < 2:
        raise layer.shape_error(f"bottom must have at least 2 axes (num, channels, ...), got {blob.shape}")
    return blob.shape[0], blob.shape[1], math.prod(blob.shape[2:])


def _transpose_blocks_on(device, src, dst, num, rows, cols, size):
    """dst (num, cols, rows, size) = src (num, rows, cols, size) swapped in
    its middle axes (the fork's Resize_cpu), as strided block copies: one per
    source channel, or one per image and row where that is fewer."""
    channels = rows * cols
    if channels <= num * rows:
        for i in range(rows):
            for j in range(cols):
                device.copy_blocks(src, dst, num, size, channels * size, channels * size,
                                   (i * cols + j) * size, (j * rows + i) * size)
        return
    for n in range(num):
        for i in range(rows):
            device.copy_blocks(src, dst, cols, size, size, rows * size, (n * channels + i * cols) * size,
                               (n * channels + i) * size)


@register("ShuffleChannel")
class ShuffleChannel(Layer):
    """ShuffleNet's channel shuffle (farmingyard/ShuffleNet's
    shuffle_channel_layer.cpp): the channels seen as (group, C / group) are
    transposed to (C / group, group), so channel i * (C / group) + j moves to
    j * group + i.

    Fields: shuffle_channel_param.group (1, > 0, must divide the channels).
    Bottom: (N, C, ...). Top: the same shape. Backward moves the diff back.
    Not in place.
    """
    exact_bottoms = 1
    exact_tops = 1
    batch_independent = True

    def setup(self, bottom, top):
        _refuse_in_place(self, bottom, top)
        self.group = int(self.layer_param.shuffle_channel_param.group)
        if self.group <= 0:
            raise self.config_error("shuffle_channel_param.group", f"must be > 0, got {self.group}")

    def reshape(self, bottom, top):
        self._dims = _channels_and_pixels(self, bottom[0])
        if self._dims[1] % self.group:
            raise self.config_error("shuffle_channel_param.group", f"must divide the bottom's {self._dims[1]} "
                                    f"channels, got {self.group}")
        top[0].reshape(bottom[0].shape)

    def _shuffled(self, source, rows):
        """source (N, rows, C / rows, pixels) with its middle axes swapped."""
        num, channels, pixels = self._dims
        return source.reshape(num, rows, channels // rows, pixels).transpose(0, 2, 1, 3)

    def forward(self, bottom, top):
        top[0].data.reshape(self._dims[0], -1, self.group, self._dims[2])[...] = \
            self._shuffled(bottom[0].data, self.group)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            rows = self._dims[1] // self.group
            bottom[0].diff.reshape(self._dims[0], -1, rows, self._dims[2])[...] = self._shuffled(top[0].diff, rows)

    def runs_on(self, device, bottom, top):
        return self.all_float32(bottom, top)

    def forward_on(self, device, bottom, top):
        num, channels, pixels = self._dims
        _transpose_blocks_on(device, bottom[0].device_data(device), top[0].mutable_device_data(device), num,
                             self.group, channels // self.group, pixels)

    def backward_on(self, device, top, propagate_down, bottom):
        if propagate_down[0]:
            num, channels, pixels = self._dims
            _transpose_blocks_on(device, top[0].device_diff(device), bottom[0].mutable_device_diff(device), num,
                                 channels // self.group, self.group, pixels)


def darknet_reorg(x, channels, height, width, stride, forward):
    """darknet's reorg_cpu (which the YOLOv2 port copies) on x, a batch of
    (channels, height, width) images in any shape of that count; returns a
    view to be copied in the order it iterates. With T = channels / stride^2,
    input channel c = (dy * stride + dx) * T + t at (h, w) pairs with element
    (t, h * stride + dy, w * stride + dx) of the batch seen as (T, height *
    stride, width * stride); forward writes the former to the latter, else
    the latter to the former."""
    num, s, t = x.shape[0], stride, channels // (stride * stride)
    if forward:
        return x.reshape(num, s, s, t, height, width).transpose(0, 3, 4, 1, 5, 2)    # (N, T, H, s, W, s)
    return x.reshape(num, t, height, s, width, s).transpose(0, 3, 5, 1, 2, 4)        # (N, s, s, T, H, W)


@register("Reorg")
class Reorg(Layer):
    """The YOLOv2 port's space-to-depth (gklz1982/caffe-yolov2's reorg_layer.cpp,
    darknet's reorg): darknet's channel order, which is darknet's reorg_cpu
    run backwards (forward = reverse) on the bottom's own sizes.

    Fields: reorg_param.stride (required, > 0), reverse (false).
    Bottom: (N, C, H, W); stride^2 must divide C, and (not reverse) stride H and W.
    Top: (N, C * stride^2, H / stride, W / stride); reverse: (N, C / stride^2,
    H * stride, W * stride). The values are darknet_reorg's (forward =
    reverse) in the top's memory order. Not in place.
    Backward moves the diff back (darknet_reorg with forward = not reverse).
    The fork's backward reorganises a member blob it never writes instead of
    the top's diff, so its bottom gradient is zero; cct gives the gradient.
    """
    exact_bottoms = 1
    exact_tops = 1
    batch_independent = True

    def setup(self, bottom, top):
        _refuse_in_place(self, bottom, top)
        p = self.layer_param.reorg_param
        if not p.HasField("stride"):
            raise self.config_error("reorg_param.stride", "must be given")
        if p.stride <= 0:
            raise self.config_error("reorg_param.stride", f"must be > 0, got {p.stride}")
        self.stride, self.reverse = int(p.stride), bool(p.reverse)

    def reshape(self, bottom, top):
        shape, s = bottom[0].shape, self.stride
        if len(shape) != 4:
            raise self.shape_error(f"bottom must be 4-d (N, C, H, W), got {shape}")
        num, channels, height, width = shape
        if channels % (s * s):
            raise self.config_error("reorg_param.stride", f"{s}: its square must divide the channels of the "
                                    f"bottom {shape}")
        if not self.reverse and (height % s or width % s):
            raise self.config_error("reorg_param.stride", f"{s}: must divide the height and width of the "
                                    f"bottom {shape}")
        self._dims = (channels, height, width)
        if self.reverse:
            top[0].reshape((num, channels // (s * s), height * s, width * s))
        else:
            top[0].reshape((num, channels * s * s, height // s, width // s))

    def forward(self, bottom, top):
        moved = darknet_reorg(bottom[0].data, *self._dims, self.stride, self.reverse)
        top[0].data.reshape(moved.shape)[...] = moved

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            moved = darknet_reorg(top[0].diff, *self._dims, self.stride, not self.reverse)
            bottom[0].diff.reshape(moved.shape)[...] = moved

    # --- on a device: darknet_reorg's view, copied strided
    def _moves(self, forward):
        return lambda x: darknet_reorg(x, *self._dims, self.stride, forward)

    def runs_on(self, device, bottom, top):
        return self.all_float32(bottom, top)

    def forward_on(self, device, bottom, top):
        copy_view_on(device, bottom[0].device_data(device), top[0].mutable_device_data(device), bottom[0].shape,
                     self._moves(self.reverse))

    def backward_on(self, device, top, propagate_down, bottom):
        if propagate_down[0]:
            copy_view_on(device, top[0].device_diff(device), bottom[0].mutable_device_diff(device),
                         top[0].shape, self._moves(not self.reverse))
