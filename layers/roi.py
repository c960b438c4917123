"""Pooling over regions of interest: ROIPooling (Fast/Faster R-CNN,
rbgirshick/caffe-fast-rcnn's roi_pooling_layer.cpp and .cu) and PSROIPooling
(R-FCN, daijifeng001/caffe-rfcn's psroi_pooling_layer.cu).

Each ROI is a row [batch index, x1, y1, x2, y2] in image pixels; its bins'
bounds are computed in numpy as the forks compute them (the blob's type, C's
round, floor and ceil), and compiled loops (cct.devices.jit) pool and spread
in the forks' order, so a float32 net's sums round as theirs.

On a device (cct.devices) the same bounds, computed on the host from the
ROIs (a few numbers each), go up as a table (roi_device_bins) and the
device's kernels pool and gather the gradients per pixel, in the same order.
"""
import numpy as np

from cct.core.layer import Layer, register
from cct.devices.jit import kernel

_FLT_MAX = float(np.finfo(np.float32).max)     # the forks start a max at -FLT_MAX


def round_half_away(values):
    """C's round(): halves away from zero (numpy's np.round takes them to even).
    In float64, where adding 0.5 to a float32 value is exact."""
    wide = np.asarray(values, np.float64)
    return np.trunc(wide + np.copysign(0.5, wide))


def _rois(layer, blob):
    """The ROIs blob as (R, 5): each row's first 5 values (the forks step by
    the row's length and read 5)."""
    shape = blob.shape
    if len(shape) < 2 or blob.count_range(1) < 5:
        raise layer.shape_error(f"the ROIs (bottom[1]) {shape} must be (R, 5[, ...]): one [batch index, x1, y1, "
                                "x2, y2] row per ROI")
    return blob.data.reshape(shape[0], blob.count_range(1))[:, :5]     # (not -1: R may be 0)


def _batch_indices(layer, rois, batch):
    """Each ROI's image: its first value cast to int (truncated), as the forks, checked."""
    index = rois[:, 0].astype(np.int64)
    bad = (index < 0) | (index >= batch)
    if bad.any():
        raise layer.shape_error(f"ROI {int(np.flatnonzero(bad)[0])} names image {int(index[bad][0])}; the "
                                f"features (bottom[0]) hold {batch}")
    return index


def _check_features(layer, blob):
    if len(blob.shape) != 4:
        raise layer.shape_error(f"the features (bottom[0]) must have 4 axes (num, channels, height, width), "
                                f"got {blob.shape}")


def roi_device_bins(batch, h_lo, h_hi, w_lo, w_hi):
    """The device's bins table (cct.devices.base) of R ROIs: their images
    (R,), then their bins' row bounds (R, PH) twice and column bounds (R, PW)
    twice, float32 (map sizes and batch indices are exact in it)."""
    return np.concatenate([np.asarray(part).reshape(-1) for part in (batch, h_lo, h_hi, w_lo, w_hi)]) \
        .astype(np.float32)


def upload_table(layer, device, name, table):
    """`table` (a flat numpy array) in the layer's device buffer `name`."""
    buffer = layer.device_scratch(device, name, table.size)
    device.upload(buffer, table)
    return buffer


# --- ROIPooling ---------------------------------------------------------------------
def roi_axis(rois, first, scale, pooled, size, dtype):
    """One axis of each ROI (columns first, first + 2 of rois: x or y) as the
    fork sizes its bins: (start (R,), end (R,) rounded, unclipped; bin size
    (R,); bin bounds lo, hi (R, pooled) clipped to [0, size])."""
    start = round_half_away(rois[:, first].astype(dtype) * dtype.type(scale)).astype(np.int64)
    end = round_half_away(rois[:, first + 2].astype(dtype) * dtype.type(scale)).astype(np.int64)
    length = np.maximum(end - start + 1, 1)              # a malformed ROI is 1 x 1
    bin_size = length.astype(dtype) / dtype.type(pooled)
    steps = np.arange(pooled + 1, dtype=dtype)
    lo = np.floor(steps[None, :-1] * bin_size[:, None]).astype(np.int64)
    hi = np.ceil(steps[None, 1:] * bin_size[:, None]).astype(np.int64)
    return (start, end, bin_size, np.clip(lo + start[:, None], 0, size), np.clip(hi + start[:, None], 0, size))


def roi_feasible(start, end, bin_size, pooled, size):
    """The fork's GPU backward's test per ROI and pixel row (or column) p:
    (inside: start <= p <= end; lo, hi: the bins [lo, hi) that may have pooled
    it, floor((p - start) / bin) and ceil((p - start + 1) / bin) clipped to
    [0, pooled]), each (R, size)."""
    dtype = bin_size.dtype
    offset = np.arange(size)[None, :] - start[:, None]
    inside = (offset >= 0) & (np.arange(size)[None, :] <= end[:, None])
    lo = np.floor(offset.astype(dtype) / bin_size[:, None]).astype(np.int64)
    hi = np.ceil((offset + 1).astype(dtype) / bin_size[:, None]).astype(np.int64)
    return inside, np.clip(lo, 0, pooled), np.clip(hi, 0, pooled)


@kernel
def roi_max_pool(data, batch, h_lo, h_hi, w_lo, w_hi, top, argmax):
    """top (R, C, PH, PW) = the max of each bin of data (N, C, H, W), argmax its
    flat index h * W + w: the fork's scan (rows, then columns, from -FLT_MAX,
    strictly greater wins); an empty bin 0 and -1, one with no such value
    -FLT_MAX and -1."""
    rois, channels, pooled_h, pooled_w = top.shape
    width = data.shape[3]
    for r in range(rois):
        b = batch[r]
        for c in range(channels):
            for ph in range(pooled_h):
                for pw in range(pooled_w):
                    top[r, c, ph, pw] = -_FLT_MAX
                    argmax[r, c, ph, pw] = -1
                    if h_hi[r, ph] <= h_lo[r, ph] or w_hi[r, pw] <= w_lo[r, pw]:
                        top[r, c, ph, pw] = 0
                        continue
                    for h in range(h_lo[r, ph], h_hi[r, ph]):
                        for w in range(w_lo[r, pw], w_hi[r, pw]):
                            if data[b, c, h, w] > top[r, c, ph, pw]:
                                top[r, c, ph, pw] = data[b, c, h, w]
                                argmax[r, c, ph, pw] = h * width + w


@kernel
def roi_max_pool_backward(dy, argmax, batch, in_h, ph_lo, ph_hi, in_w, pw_lo, pw_hi, dx):
    """dx (N, C, H, W) = for each pixel, the sum of dy (R, C, PH, PW) over the
    bins whose argmax it is, among those the fork's GPU backward looks at (the
    ROI holds the pixel, the bin is feasible for it: roi_feasible); the
    terms in its order (ROIs, then rows, then columns of bins)."""
    rois, channels, pooled_h, pooled_w = dy.shape
    width = dx.shape[3]
    dx[...] = 0
    for r in range(rois):
        b = batch[r]
        for c in range(channels):
            for ph in range(pooled_h):
                for pw in range(pooled_w):
                    index = argmax[r, c, ph, pw]
                    if index < 0:
                        continue
                    h, w = index // width, index % width
                    if (in_h[r, h] and in_w[r, w] and ph_lo[r, h] <= ph < ph_hi[r, h]
                            and pw_lo[r, w] <= pw < pw_hi[r, w]):
                        dx[b, c, h, w] += dy[r, c, ph, pw]


@register("ROIPooling")
class ROIPooling(Layer):
    """Max pooling of each region of interest into pooled_h x pooled_w bins.

    Fields: roi_pooling_param.pooled_h, pooled_w (> 0), spatial_scale (1:
    the features' size over the image's).
    Bottoms: the features (N, C, H, W); the ROIs (R, 5), rows [batch index,
    x1, y1, x2, y2] in image pixels. Top: (R, C, pooled_h, pooled_w).
    An ROI spans round(x1 * scale) .. round(x2 * scale) (C's round; at least
    1 wide), its width cut in pooled_w bins of width / pooled_w: bin j covers
    floor(j * bin) .. ceil((j + 1) * bin) - 1 past the start, clipped to the
    map (rows alike). Each bin's maximum, its first in scan order; an empty
    bin gives 0. The fork has no CPU backward; cct's is its GPU one: each
    pixel gets the top gradients of the bins whose maximum it was, among the
    bins its ROI's geometry says may hold it. The maxima's places are kept
    inside the layer (the fork's max_idx_), not as a top.
    """
    exact_bottoms = 2
    exact_tops = 1

    def setup(self, bottom, top):
        p = self.layer_param.roi_pooling_param
        for name in ("pooled_h", "pooled_w"):
            if getattr(p, name) <= 0:
                raise self.config_error(f"roi_pooling_param.{name}", f"must be > 0, got {getattr(p, name)}")
        self.pooled = (int(p.pooled_h), int(p.pooled_w))
        self.scale = float(p.spatial_scale)

    def reshape(self, bottom, top):
        _check_features(self, bottom[0])
        _rois(self, bottom[1])
        top[0].reshape((bottom[1].shape[0], bottom[0].shape[1]) + self.pooled)

    def _geometry(self, bottom):
        """(batch indices (R,), the y axis's roi_axis, the x axis's)."""
        rois = _rois(self, bottom[1])
        _, _, height, width = bottom[0].shape
        dtype = bottom[0].dtype
        return (_batch_indices(self, rois, bottom[0].shape[0]),
                roi_axis(rois, 2, self.scale, self.pooled[0], height, dtype),
                roi_axis(rois, 1, self.scale, self.pooled[1], width, dtype))

    def forward(self, bottom, top):
        batch, rows, cols = self._geometry(bottom)
        self.argmax = self.scratch("argmax", top[0].shape, np.int32)
        roi_max_pool(np.ascontiguousarray(bottom[0].data), batch, rows[3], rows[4], cols[3], cols[4],
                     top[0].data, self.argmax)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[1]:
            bottom[1].diff[...] = 0                  # the ROIs get no gradient
        if not propagate_down[0]:
            return
        batch, rows, cols = self._geometry(bottom)
        _, _, height, width = bottom[0].shape
        in_h, ph_lo, ph_hi = roi_feasible(*rows[:3], self.pooled[0], height)
        in_w, pw_lo, pw_hi = roi_feasible(*cols[:3], self.pooled[1], width)
        roi_max_pool_backward(np.ascontiguousarray(top[0].diff), self.argmax, batch, in_h, ph_lo, ph_hi,
                              in_w, pw_lo, pw_hi, bottom[0].diff)

    # --- on a device: the bins and the backward's feasible bins from the host's
    # numpy (the ROIs read there); the maxima's places kept on the device
    def runs_on(self, device, bottom, top):
        return self.all_float32(bottom, top)

    def _device_bins(self, device, bottom):
        batch, rows, cols = self._geometry(bottom)
        return upload_table(self, device, "bins", roi_device_bins(batch, rows[3], rows[4], cols[3], cols[4])), \
            rows, cols

    def forward_on(self, device, bottom, top):
        bins = self._device_bins(device, bottom)[0]
        argmax = self.device_scratch(device, "argmax", top[0].count)
        device.roi_max_pool_forward(bottom[0].device_data(device), bins, top[0].mutable_device_data(device), argmax,
                                    bottom[0].shape, top[0].shape[0], self.pooled)

    def backward_on(self, device, top, propagate_down, bottom):
        if propagate_down[1]:
            device.fill(bottom[1].mutable_device_diff(device), 0.0, bottom[1].count)
        if not propagate_down[0]:
            return
        bins, rows, cols = self._device_bins(device, bottom)
        _, _, height, width = bottom[0].shape
        feasible = np.concatenate([np.asarray(table).reshape(-1) for table in
                                   roi_feasible(*rows[:3], self.pooled[0], height)
                                   + roi_feasible(*cols[:3], self.pooled[1], width)]).astype(np.float32)
        device.roi_max_pool_backward(top[0].device_diff(device), self.device_scratch(device, "argmax", top[0].count),
                                     bins, upload_table(self, device, "feasible", feasible),
                                     bottom[0].mutable_device_diff(device), bottom[0].shape, top[0].shape[0],
                                     self.pooled)


# --- PSROIPooling -------------------------------------------------------------------
def _fused(step, bin_size, start):
    """step * bin + start as the fork's GPU computes it, one fused multiply-add
    (nvcc's default contraction): exact in float64, then rounded once to
    float32; a float64 blob's plain double arithmetic."""
    if bin_size.dtype != np.float32:
        return step * bin_size + start
    return (step.astype(np.float64) * bin_size.astype(np.float64) + start.astype(np.float64)).astype(np.float32)


def psroi_axis(rois, first, scale, group, size, dtype):
    """One axis of each ROI (columns first, first + 2) as R-FCN bins it: bounds
    lo, hi (R, group), clipped to [0, size]. Its start round(x1) * scale, its
    end (round(x2) + 1) * scale, in the blob's type; its length at least 0.1."""
    scale = dtype.type(scale)
    start = round_half_away(rois[:, first]).astype(dtype) * scale
    end = (round_half_away(rois[:, first + 2]) + 1.0).astype(dtype) * scale
    length = end - start
    length = np.where(length.astype(np.float64) < 0.1, dtype.type(0.1), length)   # CUDA's max(float, 0.1)
    bin_size = length / dtype.type(group)
    steps = np.arange(group + 1, dtype=dtype)[None, :]
    lo = np.floor(_fused(steps[:, :-1], bin_size[:, None], start[:, None])).astype(np.int64)
    hi = np.ceil(_fused(steps[:, 1:], bin_size[:, None], start[:, None])).astype(np.int64)
    return np.clip(lo, 0, size), np.clip(hi, 0, size)


@kernel
def psroi_pool(data, batch, h_lo, h_hi, w_lo, w_hi, group, top):
    """top (R, D, G, G): bin (ph, pw) of output channel d is the mean of
    channel (d * G + ph) * G + pw of data (N, D*G*G, H, W) over the bin,
    summed from 0 in scan order in the data's type; an empty bin 0."""
    rois, dims, pooled_h, pooled_w = top.shape
    for r in range(rois):
        b = batch[r]
        for d in range(dims):
            for ph in range(pooled_h):
                for pw in range(pooled_w):
                    c = (d * group + ph) * group + pw
                    top[r, d, ph, pw] = 0
                    for h in range(h_lo[r, ph], h_hi[r, ph]):
                        for w in range(w_lo[r, pw], w_hi[r, pw]):
                            top[r, d, ph, pw] += data[b, c, h, w]
                    area = (h_hi[r, ph] - h_lo[r, ph]) * (w_hi[r, pw] - w_lo[r, pw])
                    if area > 0:
                        top[r, d, ph, pw] = top[r, d, ph, pw] / area


@kernel
def psroi_pool_backward(dy, batch, h_lo, h_hi, w_lo, w_hi, group, share, dx):
    """dx (N, D*G*G, H, W) = the sum, over the bins holding each pixel of its
    channel, of that bin's dy (R, D, G, G) / its area (rounded to dx's type
    first: `share`, one value of it); bins in order, their pixels in scan order."""
    rois, dims, pooled_h, pooled_w = dy.shape
    dx[...] = 0
    for r in range(rois):
        b = batch[r]
        for d in range(dims):
            for ph in range(pooled_h):
                for pw in range(pooled_w):
                    area = (h_hi[r, ph] - h_lo[r, ph]) * (w_hi[r, pw] - w_lo[r, pw])
                    if area == 0:
                        continue
                    share[0] = dy[r, d, ph, pw] / area
                    c = (d * group + ph) * group + pw
                    for h in range(h_lo[r, ph], h_hi[r, ph]):
                        for w in range(w_lo[r, pw], w_hi[r, pw]):
                            dx[b, c, h, w] += share[0]


@register("PSROIPooling")
class PSROIPooling(Layer):
    """Position-sensitive average pooling of each region of interest (R-FCN).

    Fields: psroi_pooling_param.spatial_scale (required), output_dim D and
    group_size G (> 0; the features must have D * G * G channels).
    Bottoms: the features (N, D*G*G, H, W); the ROIs (R, 5), rows [batch
    index, x1, y1, x2, y2] in image pixels. Top: (R, D, G, G).
    An ROI spans round(x1) * scale .. (round(x2) + 1) * scale (at least 0.1),
    cut in G bins; bin j covers floor(j * bin + start) .. ceil((j + 1) * bin
    + start) - 1, clipped to the map (rows alike). Output (d, i, j) is the
    mean of channel (d * G + i) * G + j over bin (i, j); an empty bin gives 0.
    Forward and backward are the fork's GPU code (it has no CPU code), its
    bounds' multiply-adds fused as nvcc compiles them; backward spreads each
    bin's gradient / its area over its pixels.
    """
    exact_bottoms = 2
    exact_tops = 1

    def setup(self, bottom, top):
        p = self.layer_param.psroi_pooling_param
        if not p.HasField("spatial_scale"):
            raise self.config_error("psroi_pooling_param.spatial_scale", "must be given (the fork requires it)")
        for name in ("output_dim", "group_size"):
            if getattr(p, name) <= 0:
                raise self.config_error(f"psroi_pooling_param.{name}", f"must be > 0, got {getattr(p, name)}")
        self.scale, self.dims, self.group = float(p.spatial_scale), int(p.output_dim), int(p.group_size)

    def reshape(self, bottom, top):
        _check_features(self, bottom[0])
        want = self.dims * self.group * self.group
        if bottom[0].shape[1] != want:
            raise self.shape_error(f"the features (bottom[0]) {bottom[0].shape} must have output_dim x group_size^2 "
                                   f"= {self.dims} x {self.group}^2 = {want} channels")
        _rois(self, bottom[1])
        top[0].reshape((bottom[1].shape[0], self.dims, self.group, self.group))

    def _geometry(self, bottom):
        rois = _rois(self, bottom[1])
        _, _, height, width = bottom[0].shape
        dtype = bottom[0].dtype
        return (_batch_indices(self, rois, bottom[0].shape[0]),
                *psroi_axis(rois, 2, self.scale, self.group, height, dtype),
                *psroi_axis(rois, 1, self.scale, self.group, width, dtype))

    def forward(self, bottom, top):
        psroi_pool(np.ascontiguousarray(bottom[0].data), *self._geometry(bottom), self.group, top[0].data)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[1]:
            bottom[1].diff[...] = 0                  # the fork zeroes the ROIs' diff
        if propagate_down[0]:
            share = np.zeros(1, bottom[0].diff.dtype)
            psroi_pool_backward(np.ascontiguousarray(top[0].diff), *self._geometry(bottom), self.group, share,
                                bottom[0].diff)

    # --- on a device: the bins from the host's numpy (the ROIs read there)
    def runs_on(self, device, bottom, top):
        return self.all_float32(bottom, top)

    def _device_bins(self, device, bottom):
        return upload_table(self, device, "bins", roi_device_bins(*self._geometry(bottom)))

    def forward_on(self, device, bottom, top):
        device.psroi_pool_forward(bottom[0].device_data(device), self._device_bins(device, bottom),
                                  top[0].mutable_device_data(device), bottom[0].shape, top[0].shape[0], self.group)

    def backward_on(self, device, top, propagate_down, bottom):
        if propagate_down[1]:
            device.fill(bottom[1].mutable_device_diff(device), 0.0, bottom[1].count)
        if propagate_down[0]:
            device.psroi_pool_backward(top[0].device_diff(device), self._device_bins(device, bottom),
                                       bottom[0].mutable_device_diff(device), bottom[0].shape, top[0].shape[0],
                                       self.group)
