"""The segmentation forks' layers: Interp (DeepLab v2, PSPNet), BN (PSPNet's
and SegNet's) and Upsample (SegNet's max-unpooling, the YOLOv3 ports'
nearest-neighbour), each as its fork's CPU code computes it: DeepLab v2's and
PSPNet's interp_layer.cpp and util/interp.cpp, PSPNet's bn_layer.cpp,
caffe-segnet's bn_layer.cpp and upsample_layer.cpp, and the YOLOv3 ports'
upsample_layer.cpp.

Values are computed in the blobs' dtype step by step in the forks' order (a
float32 net rounds as the forks' Caffe<float>); sums over many values are
numpy's, where the forks' BLAS order is not knowable anyway.
"""
import math

import numpy as np

from cct.core.layer import TEST, Layer, register
from cct.devices.jit import kernel
from cct.layers.shape import copy_into_view_on, copy_view_on
from cct.proto import caffe_pb2

_F32 = np.float32


def _four_axes(layer, blob, what):
    if len(blob.shape) != 4:
        raise layer.shape_error(f"{what} must have 4 axes (num, channels, height, width), got {blob.shape}")


def _planes(array):
    """(N, C, H, W) -> (N*C, H, W), a view."""
    return array.reshape(-1, *array.shape[2:])


# --- Interp -----------------------------------------------------------------------
def interp_table(size_in, size_out, dtype):
    """The fork's per-axis terms of caffe_cpu_interp2 for an axis of size_in
    values resized to size_out: (index (size_out,), step to the next value
    (0 at the last), lambda0, lambda1). The ratio and each position are
    float whatever the blob's type (`const float h1r = rheight * h2`); the
    lambdas are the blob's type, lambda0 = 1 - lambda1 in it."""
    ratio = _F32(size_in - 1) / _F32(size_out - 1) if size_out > 1 else _F32(0)
    position = ratio * np.arange(size_out, dtype=_F32)
    index = position.astype(np.int64)                          # the fork's int cast: truncation
    step = (index < size_in - 1).astype(np.int64)
    lambda1 = (position - index.astype(_F32)).astype(dtype)
    lambda0 = dtype.type(1) - lambda1
    return index, step, lambda0, lambda1


def interp_device_table(size, start, size_in, size_out):
    """The device's Interp table (cct.devices.base) of an axis of `size`
    positions whose [start, start + size_in) is resized to size_out, float32:
    index + start, step, lambda0, lambda1 per output, then per input position
    the first output reading it and one past the last."""
    index, step, lambda0, lambda1 = interp_table(size_in, size_out, np.dtype(_F32))
    index = index + start
    positions = np.arange(size)
    first = np.searchsorted(index + step, positions, side="left")      # both nondecreasing in the output
    last = np.maximum(np.searchsorted(index, positions, side="right"), first)
    return np.concatenate([index, step, lambda0, lambda1, first, last]).astype(_F32)


@kernel
def interp_backward(dy, h_index, h_step, h_lambda0, h_lambda1, w_index, w_step, w_lambda0, w_lambda1, dx):
    """dx (P, H1, W1) += the adjoint of the bilinear resize of dy (P, H2, W2):
    the fork's caffe_cpu_interp2_backward, its terms added in its order (each
    output's four, output by output; h0 * w0 * dy and so on, left to right)."""
    planes, height2, width2 = dy.shape
    for p in range(planes):
        for h2 in range(height2):
            h1, hp, h0l, h1l = h_index[h2], h_step[h2], h_lambda0[h2], h_lambda1[h2]
            for w2 in range(width2):
                w1, wp, w0l, w1l = w_index[w2], w_step[w2], w_lambda0[w2], w_lambda1[w2]
                g = dy[p, h2, w2]
                dx[p, h1, w1] += h0l * w0l * g
                dx[p, h1, w1 + wp] += h0l * w1l * g
                dx[p, h1 + hp, w1] += h1l * w0l * g
                dx[p, h1 + hp, w1 + wp] += h1l * w1l * g


@register("Interp")
class Interp(Layer):
    """Bilinear resize with the corners aligned (DeepLab v2, PSPNet).

    Fields: interp_param.pad_beg, pad_end (<= 0: crop -pad_beg rows and
    columns at the start, -pad_end at the end; the input is then
    H_in = H + pad_beg + pad_end high, W_in alike); the output size, in the
    fork's order of precedence: shrink_factor s alone, (H_in - 1) / s + 1;
    zoom_factor z alone, H_in + (H_in - 1)(z - 1); height and width; both
    factors, shrink then zoom. Or a second bottom (DeepLab's variant): its
    height and width, no size field then.
    Bottoms: (N, C, H, W)[, the reference (., ., H_out, W_out)]. Top: (N, C, H_out, W_out).
    Output (h, w) reads the input at (h r_h, w r_w), r = (in - 1) / (out - 1)
    in float (0 for an output of 1), weighting its 4 neighbours; an output of
    the input's size is a copy. Backward scatters the same weights (the fork's).
    """
    min_bottoms = 1
    max_bottoms = 2
    exact_tops = 1
    batch_independent = True

    def setup(self, bottom, top):
        p = self.layer_param.interp_param
        for name in ("pad_beg", "pad_end"):
            if getattr(p, name) > 0:
                raise self.config_error(f"interp_param.{name}", f"must be <= 0 (the fork crops only), got "
                                        f"{getattr(p, name)}")
        self.pad_beg, self.pad_end = int(p.pad_beg), int(p.pad_end)
        self._device_key = None              # the shapes and buffers of the device's tables
        if len(bottom) > 1:
            given = [name for name in ("shrink_factor", "zoom_factor", "height", "width") if p.HasField(name)]
            if given:
                raise self.config_error(f"interp_param.{given[0]}", "the output size comes from the second "
                                        "bottom; give no size field with it (the fork refuses it as ambiguous)")

    def _factor(self, name):
        value = getattr(self.layer_param.interp_param, name)
        if value < 1:
            raise self.config_error(f"interp_param.{name}", f"must be >= 1, got {value}")
        return value

    def output_size(self, bottom):
        """(H_out, W_out) for the bottoms' current shapes."""
        p = self.layer_param.interp_param
        height, width = self.in_size
        if len(bottom) > 1:
            _four_axes(self, bottom[1], "the size reference (bottom[1])")
            return bottom[1].shape[2], bottom[1].shape[3]
        shrink, zoom = p.HasField("shrink_factor"), p.HasField("zoom_factor")
        if shrink and not zoom:
            s = self._factor("shrink_factor")
            return (height - 1) // s + 1, (width - 1) // s + 1
        if zoom and not shrink:
            z = self._factor("zoom_factor")
            return height + (height - 1) * (z - 1), width + (width - 1) * (z - 1)
        if p.HasField("height") and p.HasField("width"):
            return p.height, p.width
        if shrink and zoom:
            s, z = self._factor("shrink_factor"), self._factor("zoom_factor")
            height, width = (height - 1) // s + 1, (width - 1) // s + 1
            return height + (height - 1) * (z - 1), width + (width - 1) * (z - 1)
        raise self.config_error("interp_param", "give the output size: height and width, zoom_factor, "
                                "shrink_factor, or a second bottom")

    def reshape(self, bottom, top):
        _four_axes(self, bottom[0], "bottom[0]")
        n, c, h, w = bottom[0].shape
        self.in_size = (h + self.pad_beg + self.pad_end, w + self.pad_beg + self.pad_end)
        if min(self.in_size) <= 0:
            raise self.shape_error(f"cropping {-self.pad_beg} and {-self.pad_end} (pad_beg, pad_end) leaves "
                                   f"nothing of the {h} x {w} input")
        self.out_size = tuple(int(v) for v in self.output_size(bottom))
        if min(self.out_size) <= 0:
            raise self.shape_error(f"the output size {self.out_size[0]} x {self.out_size[1]} must be positive")
        top[0].reshape((n, c) + self.out_size)

    def _cropped(self, array):
        """The input the resize reads: rows and columns from -pad_beg, H_in x W_in (a view)."""
        start = -self.pad_beg
        return array[:, :, start:start + self.in_size[0], start:start + self.in_size[1]]

    def _tables(self, dtype):
        return (interp_table(self.in_size[0], self.out_size[0], dtype),
                interp_table(self.in_size[1], self.out_size[1], dtype))

    def forward(self, bottom, top):
        x = self._cropped(bottom[0].data)
        if self.in_size == self.out_size:
            top[0].data[...] = x
            return
        (hi, hs, h0, h1), (wi, ws, w0, w1) = self._tables(x.dtype)
        upper, lower = x[:, :, hi], x[:, :, hi + hs]                      # (N, C, H_out, W_in)
        h0, h1 = h0[:, None], h1[:, None]
        # the fork's h0 * (w0 * p00 + w1 * p01) + h1 * (w0 * p10 + w1 * p11), step by step
        top[0].data[...] = (h0 * (w0 * upper[..., wi] + w1 * upper[..., wi + ws])
                            + h1 * (w0 * lower[..., wi] + w1 * lower[..., wi + ws]))

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        diff = bottom[0].diff
        diff[...] = 0
        dx = self._cropped(diff)
        if self.in_size == self.out_size:
            dx += top[0].diff
            return
        tables = self._tables(diff.dtype)
        interp_backward(_planes(np.ascontiguousarray(top[0].diff)), *tables[0], *tables[1], _plane_view(dx))

    # --- on a device: the resize from per-axis tables made on the host once per
    # shape (interp_device_table); an output of the input's size is a strided copy
    def runs_on(self, device, bottom, top):
        return self.all_float32(bottom[:1], top)

    def _device_tables(self, device, bottom):
        """(height table, width table) on the device, remade when the shapes change."""
        axes = list(zip(bottom[0].shape[2:], self.in_size, self.out_size))     # (size, size_in, size_out)
        kept = tuple(self.device_scratch(device, name, 4 * size_out + 2 * size)
                     for name, (size, _, size_out) in zip(("th", "tw"), axes))
        key = (bottom[0].shape, self.out_size) + kept
        if self._device_key != key:
            for buffer, (size, size_in, size_out) in zip(kept, axes):
                device.upload(buffer, interp_device_table(size, -self.pad_beg, size_in, size_out))
            self._device_key = key
        return kept

    def _planes_and_sizes(self, bottom):
        n, c, h, w = bottom[0].shape
        return (n * c, h, w) + self.out_size

    def forward_on(self, device, bottom, top):
        x, y = bottom[0].device_data(device), top[0].mutable_device_data(device)
        if self.in_size == self.out_size:
            copy_view_on(device, x, y, bottom[0].shape, self._cropped)
            return
        device.interp_forward(x, y, *self._device_tables(device, bottom), *self._planes_and_sizes(bottom))

    def backward_on(self, device, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy, dx = top[0].device_diff(device), bottom[0].mutable_device_diff(device)
        if self.in_size == self.out_size:
            device.fill(dx, 0.0, bottom[0].count)
            copy_into_view_on(device, dy, dx, bottom[0].shape, self._cropped)
            return
        device.interp_backward(dy, dx, *self._device_tables(device, bottom), *self._planes_and_sizes(bottom))


def _plane_view(array):
    """A (N, C, h, w) view of a C-contiguous (N, C, H, W) array as (N*C, h, w),
    no copy: its batch and channel axes merge."""
    n, c, h, w = array.shape
    strides = array.strides
    return np.lib.stride_tricks.as_strided(array, (n * c, h, w), strides[1:])


# --- BN -----------------------------------------------------------------------------
_LEARN, _INFERENCE = caffe_pb2.BNParameter.LEARN, caffe_pb2.BNParameter.INFERENCE
_SEGNET_FIELDS = ("bn_mode", "scale_filler", "shift_filler")
_PSPNET_FIELDS = ("slope_filler", "bias_filler", "momentum", "eps", "frozen", "engine")
_SEGNET_EPS = 1e-9                          # caffe-segnet's var_eps_, fixed in its code


def _channel_sum(values, alpha_spatial=None, alpha_batch=None):
    """The forks' two gemv over (N, C, S) values: per (n, c) the sum over space
    (times alpha_spatial), then over n (times alpha_batch): (C,)."""
    spatial = values.sum(axis=2)
    if alpha_spatial is not None:
        spatial = spatial * alpha_spatial
    total = spatial.sum(axis=0)
    return total if alpha_batch is None else total * alpha_batch


def _batch_gradient(x_norm, dxhat, beta):
    """Both forks' bottom gradient with batch statistics, before the division by
    the std: dxhat + beta * (sum(dxhat) + x_norm * sum(x_norm * dxhat)), the
    sums per channel, beta = -1 / (N * S); x_norm and dxhat (N, C, S)."""
    s1 = _channel_sum(x_norm * dxhat)[:, None]
    s2 = _channel_sum(dxhat)[:, None]
    return dxhat + beta * (s2 + x_norm * s1)


@register("BN")
class BN(Layer):
    """Batch normalization with its own scale and shift, in either fork's flavour.

    PSPNet's (its fields, or no field of either): bn_param.slope_filler,
    bias_filler (Caffe's default filler: constant 0), momentum (0.9), eps
    (1e-5), frozen (false). 4 blobs (1, C, 1, 1): slope, bias, running mean,
    running variance (filled 0, and 1 when frozen). In TRAIN and not frozen
    the batch's mean and biased variance (over N and space) normalize, and
    each running value becomes (1 - momentum) * batch + momentum * running;
    else the running ones do. y = slope * (x - mean) * (var + eps)^-0.5 + bias.
    Setup sets the running blobs' lr_mult and decay_mult to 0, and the slope's
    and bias's too when frozen, as the fork does. Backward with batch
    statistics is the batch-norm gradient (slope and bias diffs accumulate);
    frozen, dx = dy * slope / sqrt(var + eps) and no parameter gradient.

    SegNet's (bn_param.bn_mode, scale_filler, shift_filler; or no field and 2
    blobs or 2 param specs): 2 blobs (1, C, 1, 1), scale and shift. LEARN
    (the default) normalizes with the batch's statistics in every phase, var
    = E[x^2] - E[x]^2, eps 1e-9: y = scale * (x - mean) / sqrt(var + eps) +
    shift; optional tops 1 and 2 get the batch mean and variance (1, C, 1, 1).
    INFERENCE: y = scale * x + shift (after SegNet's compute_bn_statistics.py
    folded the statistics in). Backward as the fork's; the fork overwrites the
    scale and shift diffs, cct accumulates them as every layer does (the
    same when the solver zeroes them first, as it does every iteration).

    Bottom: (N, C[, H[, W]]). Top: the same shape (may run in place).
    """
    exact_bottoms = 1
    min_tops = 1
    max_tops = 3

    def setup(self, bottom, top):
        if not 2 <= len(bottom[0].shape) <= 4:
            raise self.shape_error(f"bottom must have 2 to 4 axes (num, channels[, height[, width]]), "
                                   f"got {bottom[0].shape}")
        self.channels = bottom[0].shape[1]
        self.segnet = self._is_segnet()
        if self.segnet:
            self._setup_segnet()
        else:
            self._setup_pspnet(top)
        want = 2 if self.segnet else 4
        if len(self.blobs) != want:
            raise self.config_error("blobs", f"{'SegNet' if self.segnet else 'PSPNet'}'s BN has {want} blobs, "
                                    f"got {len(self.blobs)}")
        self.param_propagate_down = [True] * len(self.blobs)
        self._device_x = None                # forward_on's input, kept for SegNet INFERENCE's backward

    def _is_segnet(self):
        p = self.layer_param.bn_param
        segnet = [name for name in _SEGNET_FIELDS if p.HasField(name)]
        pspnet = [name for name in _PSPNET_FIELDS if p.HasField(name)]
        if segnet and pspnet:
            raise self.config_error(f"bn_param.{segnet[0]}", f"SegNet's field beside PSPNet's "
                                    f"bn_param.{pspnet[0]}: give one fork's fields")
        if segnet or pspnet:
            return bool(segnet)
        return len(self.layer_param.blobs) == 2 or len(self.layer_param.param) == 2

    def _blob(self, filler, field):
        return self.filled_blob((1, self.channels, 1, 1), filler, field)

    def _setup_pspnet(self, top):
        p = self.layer_param.bn_param
        if len(top) != 1:
            raise self.config_error("top", f"PSPNet's BN takes exactly 1 top, got {len(top)}")
        self.frozen, self.momentum, self.eps = bool(p.frozen), float(p.momentum), float(p.eps)
        if not self.blobs:
            constant = caffe_pb2.FillerParameter(type="constant")
            self.blobs = [self._blob(p.slope_filler, "bn_param.slope_filler"),
                          self._blob(p.bias_filler, "bn_param.bias_filler"),
                          self._blob(constant, "bn_param"),
                          self._blob(caffe_pb2.FillerParameter(type="constant", value=float(self.frozen)),
                                     "bn_param")]
        # the fork keeps the solver off the running statistics, and off everything when frozen
        specs = self.layer_param.param
        while len(specs) < 4:
            specs.add()
        for index in (0, 1, 2, 3) if self.frozen else (2, 3):
            specs[index].lr_mult = 0.0
            specs[index].decay_mult = 0.0

    def _setup_segnet(self):
        p = self.layer_param.bn_param
        self.mode = p.bn_mode
        if not self.blobs:
            self.blobs = [self._blob(p.scale_filler, "bn_param.scale_filler"),
                          self._blob(p.shift_filler, "bn_param.shift_filler")]

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if not 2 <= len(shape) <= 4 or shape[1] != self.channels:
            raise self.shape_error(f"bottom {shape} must have 2 to 4 axes and {self.channels} channels "
                                   "(axis 1), as at setup")
        if top[0] is not bottom[0]:
            top[0].reshape(shape)
        for blob in top[1:]:
            blob.reshape((1, self.channels, 1, 1))

    def _as3(self, array):
        """(N, C, S) view, S the pixels."""
        return array.reshape(array.shape[0], self.channels, math.prod(array.shape[2:]))

    def _param(self, index, dtype):
        """Blob `index` as (C, 1), in dtype."""
        return self.blobs[index].data.reshape(self.channels, 1).astype(dtype, copy=False)

    def _accumulate(self, index, grad):
        if self.param_wanted(index):
            self.blobs[index].diff[...] += grad.reshape(self.blobs[index].shape)

    def forward(self, bottom, top):
        x = self._as3(bottom[0].data)
        if self.segnet:
            y = self._segnet_forward(x, bottom, top)
        else:
            y = self._pspnet_forward(x)
        self._as3(top[0].data)[...] = y

    def backward(self, top, propagate_down, bottom):
        dy = self._as3(top[0].diff)
        if self.segnet:
            dx = self._segnet_backward(dy)
        else:
            dx = self._pspnet_backward(dy)
        if propagate_down[0] and dx is not None:
            self._as3(bottom[0].diff)[...] = dx

    # PSPNet's flavour
    def _running(self, index, dtype):
        return self.blobs[index].data.reshape(self.channels).astype(dtype, copy=False)

    def _update_running(self, index, batch):
        """running = (1 - momentum) * batch + momentum * running (the fork's axpby)."""
        running = self.blobs[index].data.reshape(self.channels)
        m = running.dtype.type(self.momentum)
        running[...] = (running.dtype.type(1) - m) * batch.astype(running.dtype) + m * running

    def _pspnet_forward(self, x):
        dtype = x.dtype
        n, _, s = x.shape
        batch_stats = not (self.frozen or self.phase == TEST)
        alpha_s, alpha_n = dtype.type(1) / dtype.type(s), dtype.type(1) / dtype.type(n)
        if batch_stats:
            mean = _channel_sum(x, alpha_s, alpha_n)
            self._update_running(2, mean)
        else:
            mean = self._running(2, dtype)
        centred = x - mean[:, None]
        if batch_stats:
            variance = _channel_sum(centred * centred, alpha_s, alpha_n)
            self._update_running(3, variance)
        else:
            variance = self._running(3, dtype)
        inv_std = np.power(variance + dtype.type(self.eps), dtype.type(-0.5))[:, None]     # (C, 1)
        x_norm = centred * inv_std
        if not self.frozen:                  # what backward reads (the fork's x_norm_, x_inv_std_)
            self.x_norm, self.inv_std = x_norm, inv_std
        return x_norm * self._param(0, dtype) + self._param(1, dtype)

    def _pspnet_backward(self, dy):
        dtype = dy.dtype
        slope = self._param(0, dtype)
        if self.frozen:
            inv_std = np.power(self._running(3, dtype) + dtype.type(self.eps), dtype.type(-0.5))[:, None]
            return dy * (slope * inv_std)
        self._accumulate(0, _channel_sum(self.x_norm * dy))
        self._accumulate(1, _channel_sum(dy))
        n, _, s = dy.shape
        beta = dtype.type(-1) / dtype.type(n * s)
        return _batch_gradient(self.x_norm, dy * slope, beta) * self.inv_std

    # SegNet's flavour
    def _segnet_forward(self, x, bottom, top):
        dtype = x.dtype
        if self.mode == _INFERENCE:
            # backward's scale gradient reads x, which an in-place top overwrites
            self.x = x.copy() if top[0] is bottom[0] else x
            return x * self._param(0, dtype) + self._param(1, dtype)
        n, _, s = x.shape
        alpha_s, alpha_n = dtype.type(1.0 / s), dtype.type(1.0 / n)
        mean = _channel_sum(x, alpha_s, alpha_n)
        variance = _channel_sum(x * x, alpha_s, alpha_n) - mean * mean
        for blob, value in zip(top[1:], (mean, variance)):
            blob.data.reshape(self.channels)[...] = value
        self.std = np.sqrt(variance + dtype.type(_SEGNET_EPS))[:, None]            # (C, 1)
        self.x_norm = (x - mean[:, None]) / self.std
        return self.x_norm * self._param(0, dtype) + self._param(1, dtype)

    def _segnet_backward(self, dy):
        dtype = dy.dtype
        scale = self._param(0, dtype)
        if self.mode == _INFERENCE:
            self._accumulate(0, _channel_sum(self.x * dy))
            self._accumulate(1, _channel_sum(dy))
            return dy * scale
        self._accumulate(0, _channel_sum(self.x_norm * dy))
        self._accumulate(1, _channel_sum(dy))
        n, _, s = dy.shape
        return _batch_gradient(self.x_norm, dy * scale, dtype.type(-1.0 / (n * s))) / self.std

    # --- on a device: normalization by channel_normalize (x - mean) / std, the
    # affine maps by broadcast_affine, the statistics and parameter gradients by
    # channel_sum, the batch gradient by batch_norm_backward. Where the host
    # multiplies by (var + eps)^-0.5 the device divides by sqrt(var + eps), and
    # its sums run in another order: equal within float32 rounding.
    def runs_on(self, device, bottom, top):
        return self.all_float32(bottom, top, self.blobs)

    def _dims(self, bottom):
        shape = bottom[0].shape
        return shape[0], self.channels, math.prod(shape[2:])

    def _kept(self, device, name, dims=None):
        """A buffer this layer keeps from forward_on to backward_on: (C,), or (N, C, S) given dims."""
        return self.device_scratch(device, name, math.prod(dims) if dims else self.channels)

    def forward_on(self, device, bottom, top):
        dims = self._dims(bottom)
        x, out = bottom[0].device_data(device), None
        if self.segnet and self.mode == _INFERENCE:
            self._device_x = x
            if top[0] is bottom[0]:          # backward's scale gradient reads x
                self._device_x = self._kept(device, "input", dims)
                device.copy(self._device_x, x, math.prod(dims))
        elif self.segnet:
            self._segnet_statistics_on(device, x, dims, top)
        elif self.frozen or self.phase == TEST:
            std = self._kept(device, "std")
            device.batch_norm_stats(self.blobs[2].device_data(device), self.blobs[3].device_data(device), std,
                                    self.channels, self.eps)
            # not frozen in TEST, backward reads x_norm as after batch statistics
            out = top[0].mutable_device_data(device) if self.frozen else self._kept(device, "x_norm", dims)
            device.channel_normalize(x, out, *dims, self.blobs[2].device_data(device), std)
        else:
            self._pspnet_statistics_on(device, x, dims)
        source = out if out is not None else (self._device_x if self.segnet and self.mode == _INFERENCE
                                              else self._kept(device, "x_norm", dims))
        device.broadcast_affine(source, *dims, top[0].mutable_device_data(device), self.blobs[0].device_data(device),
                                self.blobs[1].device_data(device))

    def _pspnet_statistics_on(self, device, x, dims):
        """The batch's mean and variance (into the running ones), std and x_norm (kept)."""
        alpha = 1.0 / (dims[0] * dims[2])
        mean, variance, std = self._kept(device, "mean"), self._kept(device, "variance"), self._kept(device, "std")
        x_norm = self._kept(device, "x_norm", dims)
        m = _F32(self.momentum)
        keep = float(_F32(1) - m)
        device.channel_sum(x, *dims, mean, alpha)
        device.axpby(self.channels, keep, mean, float(m), self.blobs[2].mutable_device_data(device))
        device.channel_normalize(x, x_norm, *dims, mean)                 # centred
        device.channel_sum(x_norm, *dims, variance, alpha, times=x_norm)
        device.axpby(self.channels, keep, variance, float(m), self.blobs[3].mutable_device_data(device))
        device.batch_norm_stats(mean, variance, std, self.channels, self.eps)
        device.channel_normalize(x_norm, x_norm, *dims, std=std)

    def _segnet_statistics_on(self, device, x, dims, top):
        """The batch's mean and E[x^2] - mean^2 (to tops 1 and 2), std and x_norm (kept)."""
        alpha = 1.0 / (dims[0] * dims[2])
        mean, variance, std = self._kept(device, "mean"), self._kept(device, "variance"), self._kept(device, "std")
        square = device.scratch("bn_channels", self.channels)
        device.channel_sum(x, *dims, mean, alpha)
        device.channel_sum(x, *dims, variance, alpha, times=x)
        device.multiply(mean, mean, square, self.channels)
        device.axpby(self.channels, -1.0, square, 1.0, variance)
        for blob, value in zip(top[1:], (mean, variance)):
            device.copy(blob.mutable_device_data(device), value, self.channels)
        device.batch_norm_stats(mean, variance, std, self.channels, _SEGNET_EPS)
        device.channel_normalize(x, self._kept(device, "x_norm", dims), *dims, mean, std)

    def backward_on(self, device, top, propagate_down, bottom):
        dims = self._dims(bottom)
        count = math.prod(dims)
        dy = top[0].device_diff(device)
        dx = bottom[0].mutable_device_diff(device) if propagate_down[0] else None
        scale = self.blobs[0].device_data(device)
        if not self.segnet and self.frozen:
            factor = device.scratch("bn_channels", self.channels)       # slope / std
            device.divide(scale, self._kept(device, "std"), factor, self.channels)
            if dx is not None:
                device.broadcast_affine(dy, *dims, dx, factor)
            return
        inference = self.segnet and self.mode == _INFERENCE
        # parameter gradients first: in place, dx overwrites dy
        self._accumulate_on(device, 0, self._device_x if inference else self._kept(device, "x_norm", dims), dy,
                            dims)
        self._accumulate_on(device, 1, dy, None, dims)
        if dx is None:
            return
        if inference:
            device.broadcast_affine(dy, *dims, dx, scale)
            return
        dxhat = device.scratch("bn_dxhat", count)
        device.broadcast_affine(dy, *dims, dxhat, scale)
        x_norm, alpha = self._kept(device, "x_norm", dims), 1.0 / (dims[0] * dims[2])
        mean_dxhat, mean_dxhat_y = self._kept(device, "mean_dy"), self._kept(device, "mean_dy_y")
        device.channel_sum(dxhat, *dims, mean_dxhat, alpha)
        device.channel_sum(dxhat, *dims, mean_dxhat_y, alpha, times=x_norm)
        device.batch_norm_backward(dxhat, x_norm, self._kept(device, "std"), mean_dxhat, mean_dxhat_y, dx, *dims)

    def _accumulate_on(self, device, index, values, times, dims):
        """blobs[index].diff (C,) += the channel sums of values (* times)."""
        if self.param_wanted(index):
            total = device.scratch("bn_channels", self.channels)
            device.channel_sum(values, *dims, total, times=times)
            device.axpby(self.channels, 1.0, total, 1.0, self.blobs[index].mutable_device_diff(device))


# --- Upsample -----------------------------------------------------------------------
_SEGNET_ONLY = ("scale_h", "scale_w", "pad_out_h", "pad_out_w", "upsample_h", "upsample_w")


@register("Upsample")
class Upsample(Layer):
    """Upsampling in either fork's flavour, told apart by the bottoms.

    Two bottoms, SegNet's max-unpooling: bottom[0] (N, C, H, W) values,
    bottom[1] (N, C, H, W) a MAX Pooling layer's mask top (each value's flat
    index h * W_out + w in its output plane). Output size: upsample_h and
    upsample_w (both, > 1); else H * scale_h - pad_out_h, W * scale_w -
    pad_out_w, scale_h and scale_w from upsample_param.scale (2) or given
    both (> 1; pad_out_* needs its scale 2). Forward writes zeros, then each
    value at its index, in order (a later value at the same index wins);
    backward gathers: dx[i] = dy[mask[i]] (the fork's, also where indices repeat).

    One bottom, the YOLOv3 ports' nearest-neighbour: upsample_param.scale s
    (>= 1; no other field); top (N, C, H s, W s), top[h, w] = bottom[h // s,
    w // s]; backward sums each s x s block (the port's loop order).
    """
    min_bottoms = 1
    max_bottoms = 2
    exact_tops = 1
    batch_independent = True

    def setup(self, bottom, top):
        p = self.layer_param.upsample_param
        self.unpool = len(bottom) == 2
        if not self.unpool:
            given = [name for name in _SEGNET_ONLY if p.HasField(name)]
            if given:
                raise self.config_error(f"upsample_param.{given[0]}", "the one-bottom (nearest-neighbour) "
                                        "Upsample takes only scale; SegNet's unpooling takes the mask as bottom[1]")
            if p.scale < 1:
                raise self.config_error("upsample_param.scale", f"must be >= 1, got {p.scale}")
            self.scale = int(p.scale)
            return
        self._setup_unpool(p)

    def _setup_unpool(self, p):
        if p.HasField("upsample_h") != p.HasField("upsample_w"):
            raise self.config_error("upsample_param.upsample_h", "give upsample_h and upsample_w together")
        if p.HasField("upsample_h"):
            self.size = (int(p.upsample_h), int(p.upsample_w))
            for name, value in zip(("upsample_h", "upsample_w"), self.size):
                if value <= 1:
                    raise self.config_error(f"upsample_param.{name}", f"must be > 1, got {value}")
            return
        self.size = None
        if p.HasField("scale_h") != p.HasField("scale_w") or (p.HasField("scale_h") and p.HasField("scale")):
            raise self.config_error("upsample_param.scale_h", "give upsample_h and upsample_w, or scale, or "
                                    "scale_h and scale_w")
        self.scales = (p.scale_h, p.scale_w) if p.HasField("scale_h") else (p.scale, p.scale)
        for name, value in zip(("scale_h", "scale_w") if p.HasField("scale_h") else ("scale",) * 2, self.scales):
            if value <= 1:
                raise self.config_error(f"upsample_param.{name}", f"must be > 1, got {value}")
        self.pad_out = (int(p.pad_out_h), int(p.pad_out_w))
        for name, pad, value in zip(("pad_out_h", "pad_out_w"), self.pad_out, self.scales):
            if pad and value != 2:
                raise self.config_error(f"upsample_param.{name}", f"needs its scale to be 2, got {value}")

    def reshape(self, bottom, top):
        _four_axes(self, bottom[0], "bottom[0]")
        n, c, h, w = bottom[0].shape
        if not self.unpool:
            top[0].reshape((n, c, h * self.scale, w * self.scale))
            return
        if bottom[1].shape != bottom[0].shape:
            raise self.shape_error(f"the mask (bottom[1]) {bottom[1].shape} must have bottom[0]'s shape "
                                   f"{bottom[0].shape}")
        if self.size is not None:
            size = self.size
        else:
            size = (h * self.scales[0] - self.pad_out[0], w * self.scales[1] - self.pad_out[1])
        top[0].reshape((n, c) + size)

    def _targets(self, bottom, top):
        """(N*C*H*W,) flat top indices of the bottom's values, checked."""
        n, c, h, w = bottom[0].shape
        area = top[0].shape[2] * top[0].shape[3]
        index = _planes(bottom[1].data).reshape(n * c, h * w).astype(np.int64)      # the fork's int cast
        bad = (index < 0) | (index >= area)
        if bad.any():
            value = int(index[bad][0])
            raise self.shape_error(f"the mask (bottom[1]) holds index {value}, outside the {top[0].shape[2]} x "
                                   f"{top[0].shape[3]} top: scale or upsample_h/upsample_w must match the "
                                   "Pooling layer that made the mask")
        return (index + np.arange(n * c)[:, None] * area).reshape(-1)

    def forward(self, bottom, top):
        if not self.unpool:
            s = self.scale
            top[0].data[...] = bottom[0].data.repeat(s, axis=2).repeat(s, axis=3)
            return
        targets = self._targets(bottom, top)
        # the last value written to an index wins, as in the fork's loop
        last = targets.size - 1 - np.unique(targets[::-1], return_index=True)[1]
        out = top[0].data.reshape(-1)
        out[...] = 0
        out[targets[last]] = bottom[0].data.reshape(-1)[last]

    def backward(self, top, propagate_down, bottom):
        if self.unpool and len(propagate_down) > 1 and propagate_down[1]:
            bottom[1].diff[...] = 0             # the mask gets no gradient
        if not propagate_down[0]:
            return
        if self.unpool:
            bottom[0].diff.reshape(-1)[...] = top[0].diff.reshape(-1)[self._targets(bottom, top)]
            return
        n, c, h, w = bottom[0].shape
        s = self.scale
        blocks = top[0].diff.reshape(n, c, h, s, w, s)
        total = np.zeros(bottom[0].shape, bottom[0].diff.dtype)
        for i in range(s):                  # the port's order: column offset outer, row offset inner
            for j in range(s):
                total += blocks[:, :, :, j, :, i]
        bottom[0].diff[...] = total

    # --- on a device: nearest-neighbour as strided copies of broadcast views and
    # sums of them; unpooling by unpool_forward/unpool_backward (a mask cell
    # outside the top is skipped there, where the host refuses it)
    def runs_on(self, device, bottom, top):
        return self.all_float32(bottom, top)

    def _nearest(self, n, c, h, w):
        s = self.scale
        return lambda x: np.broadcast_to(x[:, :, :, None, :, None], (n, c, h, s, w, s))

    def _unpool_sizes(self, bottom, top):
        n, c, h, w = bottom[0].shape
        return n * c, h * w, top[0].shape[2] * top[0].shape[3]

    def forward_on(self, device, bottom, top):
        x, y = bottom[0].device_data(device), top[0].mutable_device_data(device)
        if self.unpool:
            device.unpool_forward(x, bottom[1].device_data(device), y, *self._unpool_sizes(bottom, top))
        else:
            copy_view_on(device, x, y, bottom[0].shape, self._nearest(*bottom[0].shape))

    def backward_on(self, device, top, propagate_down, bottom):
        if self.unpool and len(propagate_down) > 1 and propagate_down[1]:
            device.fill(bottom[1].mutable_device_diff(device), 0.0, bottom[1].count)
        if not propagate_down[0]:
            return
        dy, dx = top[0].device_diff(device), bottom[0].mutable_device_diff(device)
        if self.unpool:
            device.unpool_backward(dy, bottom[1].device_data(device), dx, *self._unpool_sizes(bottom, top))
            return
        n, c, h, w = bottom[0].shape
        s = self.scale
        device.fill(dx, 0.0, bottom[0].count)
        for i in range(s):                  # the host's order
            for j in range(s):
                copy_view_on(device, dy, dx, top[0].shape,
                             lambda x, i=i, j=j: x.reshape(n, c, h, s, w, s)[:, :, :, j, :, i], accumulate=True)
