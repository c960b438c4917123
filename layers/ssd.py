"""SSD's layers (weiliu89/caffe, branch ssd): Normalize, Permute, PriorBox and
DetectionOutput, each as that fork's CPU code computes it (its
normalize_layer.cpp, permute_layer.cpp, prior_box_layer.cpp,
detection_output_layer.cpp and util/bbox_util.cpp). A DetectionOutput with the
YOLOv2 port's fields is that port's layer (layers/yolo.py).

Boxes are (xmin, ymin, xmax, ymax), normalized to the image, in float32 as the
fork's NormalizedBBox keeps them; every arithmetic step on them is a float32
step in the fork's order, so decoded boxes and overlaps round as its do.
"""
import math

import numpy as np

from cct.core.layer import TRAIN, Layer, NoBackward, register
from cct.devices.jit import kernel
from cct.layers.boxes import box_sizes, overlaps
from cct.layers.elementwise import sum_outer_inner
from cct.layers.shape import copy_view_on, fits_copy_view
from cct.proto import caffe_pb2

_F32 = np.float32
_CORNER = caffe_pb2.PriorBoxParameter.CORNER
_CENTER_SIZE = caffe_pb2.PriorBoxParameter.CENTER_SIZE
_CORNER_SIZE = caffe_pb2.PriorBoxParameter.CORNER_SIZE
_FLT_MAX = float(np.finfo(np.float32).max)


def _legacy_axes(layer, blob, what):
    """Caffe's num/channels/height/width need at most 4 axes."""
    if len(blob.shape) > 4:
        raise layer.shape_error(f"{what} must have at most 4 axes (num, channels, height, width), "
                                f"got {blob.shape}")


# --- Normalize ----------------------------------------------------------------------
@register("Normalize")
class Normalize(Layer):
    """L2 normalization, then a learned scale: y = s * x / sqrt(sum x^2 + eps).

    Fields: norm_param.across_spatial (true: one norm per image over C*H*W;
    false: one per pixel over the channels), channel_shared (true: one scale,
    blob shape (); false: one per channel, blob shape (C,)), scale_filler
    (constant 1), eps (1e-10, added inside the square root).
    Bottom: (N, C[, H[, W]]), 2 to 4 axes. Top: the same shape.

    Backward is the fork's: dx = s_c * (dy - x * sum(x * dy) / n^2) / n, the
    sums over what the norm sums. With per-channel scales that differ, the
    fork multiplies by s_c after the sum where the exact gradient takes
    sum(s * x * dy): cct follows the fork, so fine-tuning moves as in it.
    """
    exact_bottoms = 1
    exact_tops = 1
    batch_independent = True

    def setup(self, bottom, top):
        p = self.layer_param.norm_param
        self._check_axes(bottom[0])
        self.across_spatial = bool(p.across_spatial)
        self.channel_shared = bool(p.channel_shared)
        self.eps = float(p.eps)
        channels = bottom[0].shape[1]
        if not self.blobs:
            filler = p.scale_filler if p.HasField("scale_filler") else \
                caffe_pb2.FillerParameter(type="constant", value=1.0)
            shape = () if self.channel_shared else (channels,)
            self.blobs.append(self.filled_blob(shape, filler, "norm_param.scale_filler"))
        want = 1 if self.channel_shared else channels
        if self.blobs[0].count != want:
            raise self.config_error("norm_param.channel_shared", f"the scale blob has {self.blobs[0].count} "
                                    f"values, expected {want} (channel_shared: {str(self.channel_shared).lower()})")
        self.param_propagate_down = [True]
        self._device_x = None                # forward_on's saved input when in place

    def _check_axes(self, blob):
        if not 2 <= len(blob.shape) <= 4:
            raise self.shape_error(f"bottom must have 2 to 4 axes (num, channels[, height[, width]]), "
                                   f"got {blob.shape}")

    def reshape(self, bottom, top):
        self._check_axes(bottom[0])
        if not self.channel_shared and bottom[0].shape[1] != self.blobs[0].count:
            raise self.shape_error(f"bottom has {bottom[0].shape[1]} channels but the scale blob "
                                   f"has {self.blobs[0].count}")
        if top[0] is not bottom[0]:
            top[0].reshape(bottom[0].shape)

    def _as3(self, array):
        """(N, C, S) view, S the pixels."""
        n, c = array.shape[:2]
        return array.reshape(n, c, math.prod(array.shape[2:]))

    def _scale(self, dtype):
        """The scale broadcastable against (N, C, S)."""
        s = self.blobs[0].data.astype(dtype, copy=False)
        return s.reshape(1, 1, 1) if self.channel_shared else s.reshape(1, s.size, 1)

    def _norm(self, x3):
        """sqrt(sum x^2 + eps): (N, 1, 1) across space, (N, 1, S) per pixel."""
        axes = (1, 2) if self.across_spatial else (1,)
        total = np.sum(x3 * x3, axis=axes, keepdims=True)
        return np.sqrt(total + x3.dtype.type(self.eps))

    def forward(self, bottom, top):
        x3 = self._as3(bottom[0].data)
        if top[0] is bottom[0]:
            # backward needs x, forward overwrites it
            saved = self.scratch("saved_input", x3.shape, x3.dtype)
            np.copyto(saved, x3)
            x3 = saved
        self._x3 = x3 if top[0] is bottom[0] else None
        self._norms = self._norm(x3)
        self._as3(top[0].data)[...] = x3 / self._norms * self._scale(x3.dtype)

    def backward(self, top, propagate_down, bottom):
        x3 = self._x3 if self._x3 is not None else self._as3(bottom[0].data)
        dy3 = self._as3(top[0].diff)
        scale = self._scale(x3.dtype)
        if self.param_wanted(0):
            # d/ds = sum dy * x / n = sum dy * y / s (the fork divides y by s)
            y3 = x3 / self._norms
            grad = np.einsum("ncs,ncs->c", dy3, y3)
            self.blobs[0].diff[...] += grad.sum() if self.channel_shared else grad
        if propagate_down[0]:
            axes = (1, 2) if self.across_spatial else (1,)
            dot = np.sum(x3 * dy3, axis=axes, keepdims=True)
            n = self._norms
            dx = (dy3 - x3 * dot / (n * n)) / n * scale
            self._as3(bottom[0].diff)[...] = dx

    # --- on a device: the sums by sum_axis, the rest element-wise in the host's order
    def _blocks(self, bottom):
        """(N, C, S) and the (outer, axis, inner) the norm sums over the middle of."""
        n, c = bottom[0].shape[:2]
        s = math.prod(bottom[0].shape[2:])
        return (n, c, s), ((n, c * s, 1) if self.across_spatial else (n, c, s))

    def _scale_on(self, device, values, dims):
        """values (N, C, S) *= the scale, in place."""
        scale = self.blobs[0].device_data(device)
        if self.channel_shared:
            device.broadcast_affine(values, 1, 1, math.prod(dims), values, scale)
        else:
            device.broadcast_affine(values, *dims, values, scale)

    def runs_on(self, device, bottom, top):
        return self.all_float32(bottom, top, self.blobs)

    def forward_on(self, device, bottom, top):
        dims, blocks = self._blocks(bottom)
        count = math.prod(dims)
        x = bottom[0].device_data(device)
        self._device_x = None
        if top[0] is bottom[0]:              # backward needs x, forward overwrites it
            self._device_x = self.device_scratch(device, "input", count)
            device.copy(self._device_x, x, count)
            x = self._device_x
        squares = device.scratch("normalize", count)
        device.multiply(x, x, squares, count)
        norms = self.device_scratch(device, "norms", blocks[0] * blocks[2])
        device.sum_axis(squares, *blocks, norms)
        # sqrt(sum + eps): batch_norm_stats without its factor
        device.batch_norm_stats(norms, norms, norms, blocks[0] * blocks[2], self.eps)
        out = top[0].mutable_device_data(device)
        device.divide_across(x, norms, out, *blocks)
        self._scale_on(device, out, dims)

    def backward_on(self, device, top, propagate_down, bottom):
        dims, blocks = self._blocks(bottom)
        count = math.prod(dims)
        x = self._device_x if self._device_x is not None else bottom[0].device_data(device)
        dy = top[0].device_diff(device)
        norms = self.device_scratch(device, "norms", blocks[0] * blocks[2])
        work = device.scratch("normalize", count)
        if self.param_wanted(0):             # sum of dy * x / n (before dx overwrites dy in place)
            device.divide_across(x, norms, work, *blocks)
            device.multiply(work, dy, work, count)
            scale_diff = self.blobs[0].mutable_device_diff(device)
            if self.channel_shared:
                device.sum_axis(work, 1, count, 1, scale_diff, 1.0)
            else:
                sum_outer_inner(device, work, *dims, scale_diff, 1.0)
        if propagate_down[0]:
            device.multiply(x, dy, work, count)
            dots = device.scratch("normalize_dots", blocks[0] * blocks[2])
            device.sum_axis(work, *blocks, dots)
            dx = bottom[0].mutable_device_diff(device)
            device.l2_normalize_backward(x, dy, norms, dots, dx, *blocks)
            self._scale_on(device, dx, dims)


# --- Permute ------------------------------------------------------------------------
@register("Permute")
class Permute(Layer):
    """The bottom's axes in a new order: top = bottom.transpose(order).

    Fields: permute_param.order (repeated; distinct axes below the bottom's
    axis count; the axes it does not name follow in their order).
    Bottom: any shape with the axis count set up. Top: shape[i] = bottom
    shape[order[i]]. Backward scatters the top diff back.
    """
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        axes = len(bottom[0].shape)
        order = []
        for value in self.layer_param.permute_param.order:
            if value >= axes:
                raise self.config_error("permute_param.order", f"axis {value} is out of range for a "
                                        f"{axes}-d bottom of shape {bottom[0].shape}")
            if value in order:
                raise self.config_error("permute_param.order", f"axis {value} is given twice")
            order.append(int(value))
        self.order = tuple(order + [axis for axis in range(axes) if axis not in order])
        self.inverse = tuple(np.argsort(self.order))

    def can_partition(self, bottom, top):
        return self.order[0] == 0             # the batch stays the first axis

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) != len(self.order):
            raise self.shape_error(f"bottom has {len(shape)} axes, the layer was set up for {len(self.order)}")
        if top[0] is bottom[0] and self.order != tuple(range(len(shape))):
            raise self.config_error("top", "a Permute that moves axes cannot run in place; give the top its "
                                    "own name")
        top[0].reshape(tuple(shape[axis] for axis in self.order))

    def forward(self, bottom, top):
        if top[0] is not bottom[0]:
            np.copyto(top[0].data, bottom[0].data.transpose(self.order))

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0] and top[0] is not bottom[0]:
            np.copyto(bottom[0].diff, top[0].diff.transpose(self.inverse))

    # --- on a device: the transposed view copied strided
    def runs_on(self, device, bottom, top):
        return self.all_float32(bottom, top) and fits_copy_view(device, bottom[0].shape,
                                                                lambda x: x.transpose(self.order))

    def forward_on(self, device, bottom, top):
        if top[0] is not bottom[0]:
            copy_view_on(device, bottom[0].device_data(device), top[0].mutable_device_data(device),
                         bottom[0].shape, lambda x: x.transpose(self.order))

    def backward_on(self, device, top, propagate_down, bottom):
        if propagate_down[0] and top[0] is not bottom[0]:
            copy_view_on(device, top[0].device_diff(device), bottom[0].mutable_device_diff(device),
                         top[0].shape, lambda x: x.transpose(self.inverse))


# --- PriorBox -----------------------------------------------------------------------
def _prior_list(min_sizes, max_sizes, aspect_ratios):
    """(width, height) of each prior at one cell, in the fork's order: per
    min_size, the square min_size box, the square sqrt(min * max) box, then
    min * sqrt(r) by min / sqrt(r) for each ratio r other than 1. The fork
    takes min_size and max_size as ints (`int min_size_ = min_sizes_[s]`)."""
    sizes = []
    for index, min_float in enumerate(min_sizes):
        low = int(min_float)
        sizes.append((_F32(low), _F32(low)))
        if max_sizes:
            side = _F32(math.sqrt(low * int(max_sizes[index])))
            sizes.append((side, side))
        for ratio in aspect_ratios:
            if abs(ratio - 1.0) < 1e-6:
                continue
            root = np.sqrt(_F32(ratio))
            sizes.append((_F32(low) * root, _F32(low) / root))
    return sizes


@register("PriorBox")
class PriorBox(Layer):
    """The default boxes of one feature map, with their variances.

    Fields: prior_box_param.min_size (repeated, > 0, required), max_size
    (repeated, as many as min_size, each > its min_size), aspect_ratio
    (repeated; 1 always comes first, duplicates dropped), flip (true: also
    1/r), clip (false: true clips to [0, 1]), variance (none: 0.1; one; or
    4), img_size or img_h/img_w (default bottom[1]'s height and width),
    step or step_h/step_w (default image size / feature map size), offset (0.5).
    Bottoms: the feature map (N, C, H, W) and the image (N, C', IH, IW).
    Top: (1, 2, H * W * P * 4), P = len(min_size) * (ratios + (1 if
    max_size)): row 0 the boxes (xmin, ymin, xmax, ymax) of each cell (row
    by row) and prior, as fractions of the image; row 1 their variances.
    Cell (h, w)'s centre is ((w + offset) * step_w, (h + offset) * step_h).
    No backward (the fork's does nothing): the bottoms get zero gradients.
    """
    exact_bottoms = 2
    exact_tops = 1

    def setup(self, bottom, top):
        p = self.layer_param.prior_box_param
        self._setup_sizes(p)
        self.clip = bool(p.clip)
        self.variance = self._variance(p)
        self.img_h, self.img_w = self._pair(p, "img_size", "img_h", "img_w")
        self.step_h, self.step_w = self._pair(p, "step", "step_h", "step_w")
        self.offset = _F32(p.offset)
        self._priors_key = self._priors = None                     # the priors of the last shapes seen
        self._device_priors_key = self._device_priors = None       # what forward_on last uploaded

    def _setup_sizes(self, p):
        if not p.min_size:
            raise self.config_error("prior_box_param.min_size", "give at least one min_size")
        if any(size <= 0 for size in p.min_size):
            raise self.config_error("prior_box_param.min_size", f"must be > 0, got {list(p.min_size)}")
        if p.max_size and len(p.max_size) != len(p.min_size):
            raise self.config_error("prior_box_param.max_size", f"give one per min_size ({len(p.min_size)}), "
                                    f"got {len(p.max_size)}")
        for low, high in zip(p.min_size, p.max_size):
            if not high > low:
                raise self.config_error("prior_box_param.max_size", f"must be > its min_size, got {high} "
                                        f"for min_size {low}")
        ratios = [1.0]
        for ratio in p.aspect_ratio:
            if any(abs(ratio - known) < 1e-6 for known in ratios):
                continue
            ratios.append(ratio)
            if p.flip:
                ratios.append(float(_F32(1.0 / ratio)))     # the fork's 1./ar in double, kept as float
        self.sizes = _prior_list(list(p.min_size), list(p.max_size), ratios)

    def _variance(self, p):
        values = list(p.variance)
        if len(values) not in (0, 1, 4):
            raise self.config_error("prior_box_param.variance", f"give none, one or 4 values, got {len(values)}")
        if any(v <= 0 for v in values):
            raise self.config_error("prior_box_param.variance", f"must be > 0, got {values}")
        return np.array(values or [0.1], _F32)

    def _pair(self, p, both, first, second):
        """(h, w) from `both` or from `first`/`second` (not both ways); (0, 0) when none is given."""
        if p.HasField(first) or p.HasField(second):
            if p.HasField(both):
                raise self.config_error(f"prior_box_param.{both}", f"give either {both} or {first}/{second}, "
                                        "not both")
            pair = (getattr(p, first), getattr(p, second))
            for name, value in zip((first, second), pair):
                if not value > 0:
                    raise self.config_error(f"prior_box_param.{name}", f"must be > 0, got {value}")
            return pair
        if p.HasField(both):
            value = getattr(p, both)
            if not value > 0:
                raise self.config_error(f"prior_box_param.{both}", f"must be > 0, got {value}")
            return value, value
        return 0, 0

    def reshape(self, bottom, top):
        for index, blob in enumerate(bottom):
            _legacy_axes(self, blob, f"bottom[{index}]")
        count = bottom[0].height * bottom[0].width * len(self.sizes) * 4
        if count <= 0:
            raise self.shape_error(f"the feature map (bottom[0]) {bottom[0].shape} has no cell")
        top[0].reshape((1, 2, count))

    def _image_and_steps(self, bottom):
        """(image height, image width, step_h, step_w), the steps float32."""
        height, width = bottom[0].height, bottom[0].width
        if self.img_h == 0 or self.img_w == 0:
            img_h, img_w = bottom[1].height, bottom[1].width
        else:
            img_h, img_w = self.img_h, self.img_w
        if self.step_h == 0 or self.step_w == 0:
            return img_h, img_w, _F32(img_h) / _F32(height), _F32(img_w) / _F32(width)
        return img_h, img_w, _F32(self.step_h), _F32(self.step_w)

    def boxes(self, bottom):
        """(H * W * P, 4) float32 boxes, unclipped."""
        height, width = bottom[0].height, bottom[0].width
        img_h, img_w, step_h, step_w = self._image_and_steps(bottom)
        cy = (np.arange(height, dtype=_F32) + self.offset) * step_h         # (H,)
        cx = (np.arange(width, dtype=_F32) + self.offset) * step_w          # (W,)
        half = np.array(self.sizes, np.float64) / 2                         # (P, 2) as the fork's `/ 2.`
        cy = cy.astype(np.float64)[:, None, None]
        cx = cx.astype(np.float64)[None, :, None]
        shape = (height, width, len(self.sizes))
        boxes = np.empty(shape + (4,), np.float64)
        # double arithmetic, each stored as float (the fork's top_data[idx++] = ...)
        boxes[..., 0] = np.broadcast_to((cx - half[:, 0]) / img_w, shape)
        boxes[..., 1] = np.broadcast_to((cy - half[:, 1]) / img_h, shape)
        boxes[..., 2] = np.broadcast_to((cx + half[:, 0]) / img_w, shape)
        boxes[..., 3] = np.broadcast_to((cy + half[:, 1]) / img_h, shape)
        return boxes.astype(_F32).reshape(-1, 4)

    def priors(self, bottom):
        """(2, H * W * P * 4) float32: the boxes (clipped if asked), then their variances."""
        boxes = self.boxes(bottom)
        if self.clip:
            np.clip(boxes, 0, 1, out=boxes)
        return np.stack([boxes.reshape(-1), np.resize(self.variance, boxes.size)])

    def kept_priors(self, bottom):
        """priors(bottom), made once per pair of bottom shapes: they depend
        on the shapes alone, and making them costs far more than a copy
        (BENCHMARKS.md, "The forks' models against OpenCV 4 (issue 38)")."""
        key = (bottom[0].height, bottom[0].width, bottom[1].height, bottom[1].width)
        if self._priors_key != key:
            self._priors, self._priors_key = self.priors(bottom), key
        return self._priors

    def forward(self, bottom, top):
        top[0].data[0] = self.kept_priors(bottom)

    def backward(self, top, propagate_down, bottom):
        # the fork's Backward_cpu writes nothing: its bottoms' diffs stay at Caffe's zeros
        for blob, wanted in zip(bottom, propagate_down):
            if wanted:
                blob.diff[...] = 0

    # --- on a device: the priors depend on the shapes alone: made on the host once
    # per shape, kept on the device and copied to the top at each forward
    def runs_on(self, device, bottom, top):
        return self.all_float32(top)

    def forward_on(self, device, bottom, top):
        key = (device, bottom[0].shape, bottom[1].shape)
        count = top[0].count
        kept = self.device_scratch(device, "priors", count)
        if self._device_priors_key != key or self._device_priors is not kept:
            device.upload(kept, self.kept_priors(bottom))
            self._device_priors_key, self._device_priors = key, kept
        device.copy(top[0].mutable_device_data(device), kept, count)

    def backward_on(self, device, top, propagate_down, bottom):
        for blob, wanted in zip(bottom, propagate_down):
            if wanted:
                device.fill(blob.mutable_device_diff(device), 0.0, blob.count)


# --- DetectionOutput ----------------------------------------------------------------
def decode_boxes(priors, variances, loc, code_type, variance_in_target):
    """Boxes (P, 4) from the priors (P, 4), their variances (P, 4) and the
    predicted offsets loc (P, 4), float32 in the fork's order (DecodeBBox)."""
    var = np.ones_like(variances) if variance_in_target else variances
    if code_type == _CORNER:
        return priors + var * loc if not variance_in_target else priors + loc
    prior_w = priors[:, 2] - priors[:, 0]
    prior_h = priors[:, 3] - priors[:, 1]
    if code_type == _CORNER_SIZE:
        sides = np.stack([prior_w, prior_h, prior_w, prior_h], axis=1)
        scaled = var * loc * sides if not variance_in_target else loc * sides
        return priors + scaled
    two = _F32(2)
    center_x = (priors[:, 0] + priors[:, 2]) / two
    center_y = (priors[:, 1] + priors[:, 3]) / two
    if variance_in_target:
        cx = loc[:, 0] * prior_w + center_x
        cy = loc[:, 1] * prior_h + center_y
        w, h = np.exp(loc[:, 2]) * prior_w, np.exp(loc[:, 3]) * prior_h
    else:
        cx = var[:, 0] * loc[:, 0] * prior_w + center_x
        cy = var[:, 1] * loc[:, 1] * prior_h + center_y
        w = np.exp(var[:, 2] * loc[:, 2]) * prior_w
        h = np.exp(var[:, 3] * loc[:, 3]) * prior_h
    return np.stack([cx - w / two, cy - h / two, cx + w / two, cy + h / two], axis=1)


def _candidates(scores, score_threshold, top_k):
    """The boxes scoring above score_threshold, stably sorted by descending
    score, the first top_k (-1: all)."""
    candidates = np.flatnonzero(scores > score_threshold)
    candidates = candidates[np.argsort(-scores[candidates], kind="stable")]
    return candidates[:top_k] if top_k > -1 else candidates


@kernel
def _nms_every_class(boxes, sizes, scores, labels, score_threshold, nms_threshold, eta, top_k, kept_class, kept_row):
    """nms() of each class c whose labels[c] >= 0, on the boxes (L, P, 4) and
    areas (L, P) of location label labels[c] and the scores[:, c] (P, C), in
    one call: the kept (class, prior) pairs, class by class and best first
    within a class, into kept_class and kept_row; returns their count. The
    candidates' order is _candidates' (a stable sort of the negated scores);
    each pair's overlap is boxes.overlaps()'s in float32, computed only where
    the loop asks (the whole (K, K) matrix and a numpy call per box were most
    of res10's DetectionOutput: BENCHMARKS.md, "The forks' models against
    OpenCV 4 (issue 38)")."""
    count = 0
    priors = scores.shape[0]
    above = np.empty(priors, np.int64)
    zero, half = np.float32(0), np.float32(0.5)
    for c in range(scores.shape[1]):
        label = labels[c]
        if label < 0:
            continue
        found = 0
        for p in range(priors):
            if scores[p, c] > score_threshold:
                above[found] = p
                found += 1
        keys = np.empty(found, np.float32)
        for k in range(found):
            keys[k] = -scores[above[k], c]
        order = np.argsort(keys, kind="mergesort")
        if -1 < top_k < found:
            found = top_k
        threshold, first = nms_threshold, count
        for k in range(found):
            row = above[order[k]]
            a0, a1, a2, a3 = boxes[label, row, 0], boxes[label, row, 1], boxes[label, row, 2], boxes[label, row, 3]
            keep = True
            for j in range(first, count):
                other = kept_row[j]
                b0, b1 = boxes[label, other, 0], boxes[label, other, 1]
                b2, b3 = boxes[label, other, 2], boxes[label, other, 3]
                if b0 > a2 or b2 < a0 or b1 > a3 or b3 < a1:
                    continue
                width = np.minimum(a2, b2) - np.maximum(a0, b0)
                height = np.minimum(a3, b3) - np.maximum(a1, b1)
                if not (width > zero and height > zero):
                    continue
                inter = width * height
                if inter / (sizes[label, row] + sizes[label, other] - inter) > threshold:
                    keep = False
                    break
            if keep:
                kept_class[count] = c
                kept_row[count] = row
                count += 1
                if eta < 1 and threshold > half:
                    threshold = np.float32(threshold * eta)
    return count


def nms_every_class(boxes, sizes, scores, labels, score_threshold, nms_threshold, eta, top_k):
    """{class: nms()'s kept indices} of every class c with labels[c] >= 0 (its
    location label's index in boxes (L, P, 4) and sizes (L, P)), in one
    compiled call rather than numpy calls per class (MobileNet-SSD's 20
    classes: BENCHMARKS.md, "The forks' models against OpenCV 4 (issue 38)")."""
    classes = scores.shape[1]
    room = int((labels >= 0).sum()) * scores.shape[0]
    kept_class, kept_row = np.empty(room, np.int64), np.empty(room, np.int64)
    count = _nms_every_class(np.ascontiguousarray(boxes, _F32), np.ascontiguousarray(sizes, _F32),
                             np.ascontiguousarray(scores, _F32), np.ascontiguousarray(labels, np.int64),
                             _F32(score_threshold), _F32(nms_threshold), _F32(eta), int(top_k), kept_class, kept_row)
    kept_class, kept_row = kept_class[:count], kept_row[:count]
    return {c: kept_row[kept_class == c] for c in range(classes) if labels[c] >= 0}


def nms(boxes, sizes, scores, score_threshold, nms_threshold, eta, top_k):
    """Indices kept by the fork's ApplyNMSFast, best first: of _candidates,
    each kept unless it overlaps a kept one by more than the threshold, which
    shrinks by eta after each kept box while above 0.5 (boxes (P, 4), their
    areas (P,), scores (P,))."""
    return nms_every_class(boxes[None], sizes[None], scores[:, None], np.zeros(1, np.int64), score_threshold,
                           nms_threshold, eta, top_k)[0]


def nms_reference(boxes, sizes, scores, score_threshold, nms_threshold, eta, top_k):
    """nms() on the whole overlap matrix, a numpy call per box: the plain
    version the tests check the kernel against."""
    candidates = _candidates(scores, score_threshold, top_k)
    iou = overlaps(boxes[candidates], sizes[candidates])
    kept, threshold = [], _F32(nms_threshold)
    for row in range(candidates.size):
        if kept and np.any(iou[row, kept] > threshold):
            continue
        kept.append(row)
        if eta < 1 and threshold > 0.5:
            threshold = _F32(threshold * _F32(eta))
    return candidates[kept]


@register("DetectionOutput")
class DetectionOutput(NoBackward, Layer):
    """SSD's detections: decode the predicted offsets against the priors, NMS per
    class, keep the best keep_top_k per image.

    Fields: detection_output_param.num_classes (required), share_location
    (true: one box per prior for every class), background_label_id (0; -1:
    none), nms_param { nms_threshold (0.3), top_k (all), eta (1) }, code_type
    (CORNER | CENTER_SIZE | CORNER_SIZE), variance_encoded_in_target (false),
    keep_top_k (-1: all), confidence_threshold (none: every box). visualize,
    visualize_threshold and save_file are read and not drawn (the fork draws
    in an OpenCV window); save_output_param's files are refused.
    Bottoms: loc (N, P * L * 4), L = 1 if share_location else num_classes;
    conf (N, P * num_classes), each prior's class scores; priors (1, 2, P * 4)
    (PriorBox's: boxes, then variances); an optional 4th (the image, for the
    fork's drawing) is not read.
    Top: (1, 1, D, 7), a row [image, label, score, xmin, ymin, xmax, ymax] per
    detection, by image, then label, then score; with no detection at all, one
    row [i, -1, -1, -1, -1, -1, -1] per image. Reshaped by forward (D is known
    only then); (1, 1, 1, 7) before it.
    """
    min_bottoms = 3
    max_bottoms = 4
    exact_tops = 1
    tops_follow_values = True

    def __new__(cls, layer_param=None, phase=TRAIN, source=None):
        """The YOLOv2 port's DetectionOutput (layers/yolo.py) where the fields
        are its own (is_yolo_flavour); copy and pickle pass no layer_param."""
        if cls is DetectionOutput and layer_param is not None:
            from cct.layers import yolo                 # imported after this module (it imports it)
            if yolo.is_yolo_flavour(layer_param, source):
                return yolo.YoloDetectionOutput(layer_param, phase, source)
        return super().__new__(cls)

    def setup(self, bottom, top):
        p = self.layer_param.detection_output_param
        if not p.HasField("num_classes"):
            raise self.config_error("detection_output_param.num_classes", "must be given")
        self.num_classes = int(p.num_classes)
        self.share_location = bool(p.share_location)
        self.loc_classes = 1 if self.share_location else self.num_classes
        self.background = int(p.background_label_id)
        if self.share_location and self.background == -1:
            # the fork skips the shared boxes' label (-1) as background, then fails to find them
            raise self.config_error("detection_output_param.background_label_id", "-1 (no background) needs "
                                    "share_location: false (the fork then finds no shared boxes and fails)")
        # each class's location label's index among _decoded's (sorted) labels, -1 for the background
        names = [-1] if self.share_location else [c for c in range(self.num_classes) if c != self.background]
        self._nms_labels = np.array([-1 if c == self.background else names.index(-1 if self.share_location else c)
                                     for c in range(self.num_classes)], np.int64)
        self.code_type = p.code_type
        self.variance_in_target = bool(p.variance_encoded_in_target)
        self.keep_top_k = int(p.keep_top_k)
        self.confidence_threshold = _F32(p.confidence_threshold if p.HasField("confidence_threshold")
                                         else -_FLT_MAX)
        self._setup_nms(p.nms_param)
        self._refuse_saving(p.save_output_param)

    def _setup_nms(self, nms_param):
        self.nms_threshold = float(nms_param.nms_threshold)
        if self.nms_threshold < 0:
            raise self.config_error("detection_output_param.nms_param.nms_threshold",
                                    f"must be >= 0, got {self.nms_threshold}")
        self.eta = float(nms_param.eta)
        if not 0 < self.eta <= 1:
            raise self.config_error("detection_output_param.nms_param.eta", f"must be in (0, 1], got {self.eta}")
        self.top_k = int(nms_param.top_k) if nms_param.HasField("top_k") else -1

    def _refuse_saving(self, save):
        # the fork saves only when all three are given (need_save_)
        if save.output_directory and save.label_map_file and save.name_size_file:
            raise self.config_error("detection_output_param.save_output_param",
                                    "writing detections to files (VOC, COCO, ILSVRC) is not supported; "
                                    "remove output_directory and read the top")

    def reshape(self, bottom, top):
        loc, conf, priors = bottom[:3]
        if loc.shape[:1] != conf.shape[:1]:
            raise self.shape_error(f"loc (bottom[0]) {loc.shape} and conf (bottom[1]) {conf.shape} must "
                                   "have the same num")
        _legacy_axes(self, priors, "the priors (bottom[2])")
        self.num_priors = priors.height // 4
        want_loc = self.num_priors * self.loc_classes * 4
        if loc.count_range(1) != want_loc or len(loc.shape) < 2:
            raise self.shape_error(f"loc (bottom[0]) {loc.shape} must hold {want_loc} values per image: "
                                   f"{self.num_priors} priors x {self.loc_classes} location classes x 4")
        want_conf = self.num_priors * self.num_classes
        if conf.count_range(1) != want_conf or len(conf.shape) < 2:
            raise self.shape_error(f"conf (bottom[1]) {conf.shape} must hold {want_conf} values per image: "
                                   f"{self.num_priors} priors x {self.num_classes} classes")
        if priors.count < 2 * self.num_priors * 4:
            raise self.shape_error(f"the priors (bottom[2]) {priors.shape} must hold boxes and variances")
        top[0].reshape((1, 1, 1, 7))

    def _decoded(self, loc, priors):
        """{location label: (P, 4) boxes} of one image; label -1 when shared."""
        p = self.num_priors
        boxes, variances = priors[:p * 4].reshape(p, 4), priors[p * 4:p * 8].reshape(p, 4)
        loc = loc.reshape(p, self.loc_classes, 4)
        decoded = {}
        for c in range(self.loc_classes):
            label = -1 if self.share_location else c
            if label != self.background:
                decoded[label] = decode_boxes(boxes, variances, loc[:, c], self.code_type, self.variance_in_target)
        return decoded

    def _detect(self, decoded, conf):
        """{label: kept prior indices, best first} of one image from its decoded boxes."""
        scores = conf.reshape(self.num_priors, self.num_classes)
        boxes = np.stack([decoded[name] for name in sorted(decoded)])    # -1 (shared) or the classes
        found = nms_every_class(boxes, box_sizes(boxes), scores, self._nms_labels, self.confidence_threshold,
                                self.nms_threshold, self.eta, self.top_k)
        if -1 < self.keep_top_k < sum(kept.size for kept in found.values()):
            found = self._keep_best(found, scores)
        return found

    def _keep_best(self, found, scores):
        """The keep_top_k best of every label's kept boxes, regrouped by label."""
        labels = np.concatenate([np.full(kept.size, c) for c, kept in found.items()])
        indices = np.concatenate(list(found.values()))
        best = np.argsort(-scores[indices, labels], kind="stable")[:self.keep_top_k]
        return {c: indices[best[labels[best] == c]] for c in sorted(set(labels[best].tolist()))}

    def _rows(self, image, decoded, conf):
        """[(K, 7) rows of one label], by label, of image `image` from its
        decoded boxes and its conf (P * num_classes)."""
        found = self._detect(decoded, conf)
        scores = conf.reshape(self.num_priors, self.num_classes)
        rows = []
        for c in sorted(found):
            kept = found[c]
            boxes = decoded[-1 if self.share_location else c][kept]
            block = np.empty((kept.size, 7), _F32)
            block[:, 0], block[:, 1], block[:, 2], block[:, 3:] = image, c, scores[kept, c], boxes
            rows.append(block)
        return rows

    def forward(self, bottom, top):
        num = bottom[0].shape[0]
        loc = bottom[0].data.reshape(num, -1).astype(_F32)
        conf = bottom[1].data.reshape(num, -1).astype(_F32)
        priors = bottom[2].data.reshape(-1).astype(_F32)
        rows = []
        for i in range(num):
            rows += self._rows(i, self._decoded(loc[i], priors), conf[i])
        self._write(top[0], rows, num)

    # --- on a device: as the fork's Forward_gpu, the boxes decoded there (all
    # location classes, the background's too), NMS and keep_top_k on the host
    def runs_on(self, device, bottom, top):
        return self.all_float32(bottom[:3], top)

    def forward_on(self, device, bottom, top):
        num, p, classes = bottom[0].shape[0], self.num_priors, self.loc_classes
        count = num * p * classes * 4
        boxes = device.scratch("detection_boxes", count)
        device.decode_boxes(bottom[0].device_data(device), bottom[2].device_data(device), boxes, num, p, classes,
                            int(self.code_type), self.variance_in_target)
        decoded = np.empty((num, p, classes, 4), _F32)
        device.download(boxes, decoded)
        conf = bottom[1].data.reshape(num, -1)
        rows = []
        for i in range(num):
            labels = {-1: decoded[i, :, 0]} if self.share_location else \
                {c: decoded[i, :, c] for c in range(classes) if c != self.background}
            rows += self._rows(i, labels, conf[i])
        self._write(top[0], rows, num)

    def backward_on(self, device, top, propagate_down, bottom):
        self.backward(top, propagate_down, bottom)          # NoBackward's: a requested gradient is refused

    @staticmethod
    def _write(blob, rows, num):
        detections = np.concatenate(rows) if rows else np.empty((0, 7), _F32)
        if not detections.shape[0]:
            # the fork's fake results: a row of -1 per image, its index first
            detections = np.full((num, 7), -1, _F32)
            detections[:, 0] = np.arange(num)
        blob.reshape((1, 1, detections.shape[0], 7))
        blob.data[0, 0] = detections
