"""Normalization layers: LRN, MVN and BatchNorm, with Caffe's exact formulas
(where eps goes, which divisor a window uses, how running statistics decay).

Window sums are a loop over the local_size offsets (a handful of whole-array
adds of shifted slices), never over pixels. LRN across channels with beta 0.75
(AlexNet and its kin) runs as one compiled pass per image with the same
operations (CaffeNet's norm1 at batch 128: forward 26 -> 15 ms, backward
41 -> 28 ms); other settings run the numpy passes.
"""
import math

import numpy as np

from cct.core.blob import Blob
from cct.devices.jit import kernel
from cct.core.layer import TEST, Layer, register
from cct.proto import caffe_pb2

# Elements per batch chunk in LRN: about 1 MiB of float32 (see LRN._chunks).
CHUNK_ELEMENTS = 1 << 18
_ACROSS = caffe_pb2.LRNParameter.ACROSS_CHANNELS
_WITHIN = caffe_pb2.LRNParameter.WITHIN_CHANNEL


def window_sum(values, size, axis, out=None):
    """Sum over a centred window of odd `size` along `axis`, zeros beyond the edges.

    out[i] = sum_{j = i - (size-1)/2}^{i + (size-1)/2} values[j]; same shape as
    values, written into `out` when given (it must not be `values`). Each offset d
    adds values shifted by d onto the part of out it reaches: no padded copy.
    """
    half = (size - 1) // 2
    length = values.shape[axis]
    if out is None:
        out = np.empty_like(values)
    np.copyto(out, values)
    moved_in, moved_out = np.moveaxis(values, axis, 0), np.moveaxis(out, axis, 0)
    for offset in range(1, min(half, length - 1) + 1):
        moved_out[offset:] += moved_in[:length - offset]      # from the cells before
        moved_out[:length - offset] += moved_in[offset:]      # from the cells after
    return out


# --- compiled ACROSS_CHANNELS with beta 0.75 (every AlexNet-style net) -------------
# One pass per image instead of ~13 numpy passes per chunk, with the numpy
# path's operations, order and rounding: window terms added centre, c-1, c+1,
# c-2, ... (window_sum), scale = sum * (alpha/n) + k, s^-0.75 = 1 / sqrt(s *
# sqrt(s)) (_negative_power); no multiply-add is fused. Tests compare the two.

@kernel
def _window_of_squares(image, ch, half, out):
    """out (P,) = the window sum of image^2 (C, P) around channel ch, its terms
    added as window_sum adds them: centre, c-1, c+1, c-2, ... Each square is
    computed where it is added (the same product as a squares array would
    hold), so no squares plane is written and read back: with the squares
    and scales kept in planes, the forward took 1.05-1.2x as long (GoogLeNet's
    norm2 at batch 1, CaffeNet's norm1 at 16 and 128)."""
    channels, pixels = image.shape
    for q in range(pixels):
        out[q] = image[ch, q] * image[ch, q]
    for offset in range(1, min(half, channels - 1) + 1):
        if ch - offset >= 0:
            for q in range(pixels):
                v = image[ch - offset, q]
                out[q] += v * v
        if ch + offset < channels:
            for q in range(pixels):
                v = image[ch + offset, q]
                out[q] += v * v


@kernel
def _across_window(values, ch, half, out):
    """out (P,) = the window sum of values (C, P) around channel ch."""
    channels, pixels = values.shape
    for q in range(pixels):
        out[q] = values[ch, q]
    for offset in range(1, min(half, channels - 1) + 1):
        if ch - offset >= 0:
            for q in range(pixels):
                out[q] += values[ch - offset, q]
        if ch + offset < channels:
            for q in range(pixels):
                out[q] += values[ch + offset, q]


# s^-0.75 as _negative_power takes it, 1 / sqrt(s * sqrt(s)), is written out
# in the kernels' loops: called as a kernel of its own it was not inlined, and
# the loops then ran one value at a time (vsqrtss, not vsqrtps).


@kernel
def _lrn_forward_075(x, size, alpha_over_n, k, one, window, y):
    """y = x * (k + alpha/n * window(x^2))^-0.75 for x, y (N, C, P), channel
    by channel: one window row (P,) of work."""
    batch, channels, pixels = x.shape
    half = (size - 1) // 2
    for b in range(batch):
        for ch in range(channels):
            _window_of_squares(x[b], ch, half, window)
            for q in range(pixels):
                scale = window[q] * alpha_over_n + k
                y[b, ch, q] = x[b, ch, q] * (one / np.sqrt(np.sqrt(scale) * scale))     # s^-0.75


@kernel
def _lrn_backward_075(x, y, g, size, alpha_over_n, k, one, factor, scales, ratio, window, dx):
    """dx = g * s^-0.75 - factor * x * window(g * y / s) for (N, C, P) arrays,
    s recomputed (not kept from forward); dx may be g itself (each channel's g
    is read before its dx is written)."""
    batch, channels, pixels = x.shape
    half = (size - 1) // 2
    for b in range(batch):
        for ch in range(channels):
            _window_of_squares(x[b], ch, half, window)
            for q in range(pixels):
                scale = window[q] * alpha_over_n + k
                scales[ch, q] = scale
                ratio[ch, q] = g[b, ch, q] * y[b, ch, q] / scale
        for ch in range(channels):
            _across_window(ratio, ch, half, window)
            for q in range(pixels):
                scale = scales[ch, q]
                dx[b, ch, q] = (g[b, ch, q] * (one / np.sqrt(np.sqrt(scale) * scale))   # s^-0.75
                                - window[q] * x[b, ch, q] * factor)


@register("LRN")
class LRN(Layer):
    """Local response normalization of a 4-d blob (N, C, H, W); top is the same shape.

    Fields: lrn_param.local_size (5, odd), alpha (1), beta (0.75), k (1),
    norm_region (ACROSS_CHANNELS | WITHIN_CHANNEL).
      ACROSS_CHANNELS: y = x * (k + alpha/n * sum_{c' in window(c)} x[c']^2)^-beta,
                       the window n = local_size channels centred on c, zero-padded.
      WITHIN_CHANNEL:  y = x * (1 + alpha * avg_{n x n window} x^2)^-beta, as Caffe
                       builds it from Power/Pooling(AVE, pad (n-1)/2)/Power/Eltwise:
                       k is not used, and the average divides by n^2 everywhere
                       (padding zeros included) because with stride 1 and that pad
                       no window reaches past the pooling's padded border.
    """
    batch_independent = True

    def flops(self, bottom, top):
        # per element: square, window sum, scale, power, product (+2 more backward)
        size = self.size if self.across else self.size * self.size
        count = bottom[0].count
        return count * (size + 5), count * (size + 7), 0
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        p = self.layer_param.lrn_param
        if p.local_size % 2 != 1:
            raise self.config_error("lrn_param.local_size", f"must be odd, got {p.local_size}")
        if p.norm_region not in (_ACROSS, _WITHIN):
            raise self.config_error("lrn_param.norm_region", f"unknown region {p.norm_region}")
        self.size = int(p.local_size)
        self.alpha, self.beta, self.k = float(p.alpha), float(p.beta), float(p.k)
        self.across = p.norm_region == _ACROSS

    def reshape(self, bottom, top):
        if len(bottom[0].shape) != 4:
            raise self.shape_error(f"bottom must have 4 axes (num, channels, height, width), "
                                   f"got {bottom[0].shape}")
        if top[0] is not bottom[0]:
            top[0].reshape(bottom[0].shape)

    def forward(self, bottom, top):
        x = bottom[0].data
        if not x.size:
            return                    # an empty top (Caffe's loops run no iteration)
        if top[0] is bottom[0]:
            # backward needs x, forward overwrites it
            saved = self.scratch("saved_input", x.shape, x.dtype)
            np.copyto(saved, x)
            x = self._saved_input = saved
        y = top[0].data
        if self._compiled(x):
            n, c = x.shape[:2]
            cast = x.dtype.type
            _lrn_forward_075(x.reshape(n, c, -1), self.size, cast(self.alpha / self.size), cast(self.k), cast(1),
                             self._row("window", x), y.reshape(n, c, -1))
            return
        for rows in self._chunks(x.shape):
            scale = self._scale(x[rows])
            power = _negative_power(scale, self.beta, self._work("power", scale))
            np.multiply(x[rows], power, out=y[rows])

    def _chunks(self, shape):
        """Slices of a few images: the ~10 element-wise passes run on work arrays
        that stay in the CPU cache (CaffeNet's norm1 is 256x96x27x27)."""
        per_image = int(np.prod(shape[1:]))
        chunk = max(1, min(shape[0], CHUNK_ELEMENTS // max(per_image, 1)))
        return [slice(start, start + chunk) for start in range(0, shape[0], chunk)]

    def _compiled(self, x):
        """Whether the compiled pass applies: ACROSS_CHANNELS, beta 0.75, float
        data (other settings run the numpy passes)."""
        return self.across and self.beta == 0.75 and x.dtype.kind == "f" and x.flags.c_contiguous

    def _plane(self, name, x):
        """A (C, H*W) work array of x's dtype."""
        return self.work("lrn_" + name, (x.shape[1], x.shape[2] * x.shape[3]), x.dtype)

    def _row(self, name, x):
        return self.work("lrn_" + name, (x.shape[2] * x.shape[3],), x.dtype)

    def _work(self, name, like):
        """A work array shaped like `like` for use inside this call (Layer.work)."""
        return self.work("lrn_" + name, like.shape, like.dtype)

    def _scale(self, x):
        """s = k + alpha/n * window(x^2) (ACROSS_CHANNELS) or 1 + alpha * box
        average of x^2 (WITHIN_CHANNEL) of a chunk, in a work array. Backward
        computes it again rather than keep a blob-sized copy from forward (72 MB
        for CaffeNet's norm1): the same operations give the same numbers."""
        cast = x.dtype.type
        squares = np.multiply(x, x, out=self._work("squares", x))
        scale = self._work("scale", x)
        if self.across:
            window_sum(squares, self.size, axis=1, out=scale)
            scale *= cast(self.alpha / self.size)
            scale += cast(self.k)
        else:
            self._box_average(squares, out=scale)
            scale *= cast(self.alpha)
            scale += cast(1.0)
        return scale

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0] or not bottom[0].count:
            return
        x = self._saved_input if top[0] is bottom[0] else bottom[0].data
        y, g, dx = top[0].data, top[0].diff, bottom[0].diff
        if self._compiled(x) and y.flags.c_contiguous and g.flags.c_contiguous and dx.flags.c_contiguous:
            n, c = x.shape[:2]
            cast = x.dtype.type
            _lrn_backward_075(x.reshape(n, c, -1), y.reshape(n, c, -1), g.reshape(n, c, -1), self.size,
                              cast(self.alpha / self.size), cast(self.k), cast(1),
                              cast(2 * self.beta * self.alpha / self.size), self._plane("scales", x),
                              self._plane("ratio", x), self._row("window", x),
                              dx.reshape(n, c, -1))
            return
        for rows in self._chunks(x.shape):
            self._backward_chunk(x[rows], top[0].data[rows], top[0].diff[rows], bottom[0].diff[rows])

    def _backward_chunk(self, x, y, g, dx):
        # y = x * s^-beta with s = shift + c * window(x^2):
        # dL/dx = g * s^-beta - 2 * beta * c * x * window^T(g * y / s)   (y / s = x * s^(-beta-1))
        scale = self._scale(x)
        ratio = np.multiply(g, y, out=self._work("ratio", x))
        ratio /= scale
        spread = self._work("squares", x)
        if self.across:
            window_sum(ratio, self.size, axis=1, out=spread)
            factor = 2 * self.beta * self.alpha / self.size
        else:
            self._box_average(ratio, out=spread)
            factor = 2 * self.beta * self.alpha
        spread *= x
        spread *= x.dtype.type(factor)
        power = _negative_power(scale, self.beta, self._work("power", x))
        # g may be bottom's diff (in place): it is read here for the last time.
        np.multiply(g, power, out=dx)
        dx -= spread

    def _box_average(self, values, out):
        """Caffe's AVE pooling with kernel n, stride 1, pad (n-1)/2 over H and W;
        its divisor is n^2 at every position. Symmetric, so it is its own transpose."""
        rows = window_sum(values, self.size, axis=2, out=self._work("rows", values))
        window_sum(rows, self.size, axis=3, out=out)
        out *= values.dtype.type(1.0 / (self.size * self.size))
        return out

    # --- on a device: Caffe's LRNFillScale, LRNComputeOutput, LRNComputeDiff -------------
    def runs_on(self, device, bottom, top):
        return self.all_float32(bottom, top)

    def _device_window(self):
        """(alpha over the window's size, k, factor of backward's window term): the
        window is `size` channels across, size x size pixels within (where Caffe's
        pooling average gives 1 + alpha * mean, so k is 1)."""
        area = self.size if self.across else self.size * self.size
        k = self.k if self.across else 1.0
        return self.alpha / area, k, 2 * self.beta * self.alpha / area

    def forward_on(self, device, bottom, top):
        count = bottom[0].count
        if not count:
            return
        x = bottom[0].device_data(device)
        if top[0] is bottom[0]:                 # backward needs x, forward overwrites it
            saved = self.device_scratch(device, "lrn_input", count)
            device.copy(saved, x, count)
            x = saved
        # the scale is kept for backward, as Caffe's scale_ blob
        scale = self.device_scratch(device, "lrn_scale", count)
        alpha_over_size, k, _ = self._device_window()
        device.lrn_scale(x, scale, bottom[0].shape, self.size, alpha_over_size, k, self.across)
        device.lrn_forward(x, scale, top[0].mutable_device_data(device), count, self.beta)

    def backward_on(self, device, top, propagate_down, bottom):
        count = bottom[0].count
        if not propagate_down[0] or not count:
            return
        in_place = top[0] is bottom[0]
        x = self.device_scratch(device, "lrn_input", count) if in_place else bottom[0].device_data(device)
        y, dy = top[0].device_data(device), top[0].device_diff(device)
        if in_place:                            # dx is dy: the windows read dy's neighbours, so from a copy
            copied = device.scratch("lrn_top_diff", count)
            device.copy(copied, dy, count)
            dy = copied
        _, _, factor = self._device_window()
        device.lrn_backward(x, y, self.device_scratch(device, "lrn_scale", count), dy,
                            bottom[0].mutable_device_diff(device), bottom[0].shape, self.size, self.beta,
                            factor, self.across)


def _negative_power(scale, beta, out):
    """scale ** -beta into out; beta 0.75 (every AlexNet-style LRN) by square roots,
    several times faster than a general power: s^-0.75 = 1 / sqrt(s * sqrt(s))."""
    if beta == 0.75:
        np.sqrt(scale, out=out)
        out *= scale
        np.sqrt(out, out=out)
        np.reciprocal(out, out=out)
    else:
        np.power(scale, scale.dtype.type(-beta), out=out)
    return out


@register("MVN")
class MVN(Layer):
    """Mean-variance normalization per (image, channel), or per image with across_channels.

    Fields: mvn_param.normalize_variance (true), across_channels (false), eps (1e-9).
    y = x - mean; with normalize_variance y = (x - mean) / (std + eps), std the
    biased standard deviation (eps is added to the std, outside the sqrt, as in Caffe).
    Top: (num, channels, height, width) of the bottom (Caffe reshapes to 4-d).
    """
    batch_independent = True
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        p = self.layer_param.mvn_param
        self.normalize_variance = bool(p.normalize_variance)
        self.across_channels = bool(p.across_channels)
        self.eps = float(p.eps)

    def reshape(self, bottom, top):
        b = bottom[0]
        legacy = (b.num, b.channels, b.height, b.width)
        if top[0] is not bottom[0] or b.shape != legacy:
            top[0].reshape(legacy)

    def _rows(self, array):
        """(groups, values per group): per image, or per image and channel, of
        the legacy 4-d shape; spelled out, not -1: the blob may be empty."""
        n, c, h, w = (tuple(array.shape) + (1, 1, 1, 1))[:4]
        return array.reshape((n, c * h * w) if self.across_channels else (n * c, h * w))

    def forward(self, bottom, top):
        x = self._rows(bottom[0].data)
        if not x.size:
            return                    # an empty top: no means to take (Caffe's divide by 0 items)
        centred = x - x.mean(axis=1, keepdims=True)
        if self.normalize_variance:
            variance = np.mean(centred * centred, axis=1, keepdims=True)
            self.std = np.sqrt(variance) + x.dtype.type(self.eps)   # (groups, 1)
            centred /= self.std
        self._rows(top[0].data)[...] = centred

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0] or not bottom[0].count:
            return
        g = self._rows(top[0].diff)
        if self.normalize_variance:
            # Caffe's expression: (g - mean(g) - y * mean(g * y)) / (std + eps)
            y = self._rows(top[0].data)
            dx = (g - g.mean(axis=1, keepdims=True)
                  - y * np.mean(g * y, axis=1, keepdims=True)) / self.std
        else:
            dx = g - g.mean(axis=1, keepdims=True)
        self._rows(bottom[0].diff)[...] = dx


@register("BatchNorm")
class BatchNorm(Layer):
    """Batch normalization over axis 1 (statistics over every other axis); no scale
    or shift (follow it with a Scale layer). Top shape = bottom shape; may run in place.

    Fields: batch_norm_param.use_global_stats (default: phase == TEST),
    moving_average_fraction (0.999), eps (1e-5).
    Blobs (never learned; their ParamSpecs get lr_mult 0): running mean sum (C),
    running variance sum (C), scale factor (1).
    Batch mode:  y = (x - mean) / sqrt(var + eps), var biased; and then
      factor = factor * maf + 1, mean_sum = maf * mean_sum + mean,
      var_sum = maf * var_sum + m/(m-1) * var   (m = count / C).
    Global mode: mean = mean_sum / factor, var = var_sum / factor (0 when factor is 0).
    """
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        p = self.layer_param.batch_norm_param
        self.maf = float(p.moving_average_fraction)
        self.use_global_stats = p.use_global_stats if p.HasField("use_global_stats") else self.phase == TEST
        self.eps = float(p.eps)
        if not bottom[0].shape:
            raise self.shape_error(f"bottom '{self.layer_param.bottom[0]}' has no axes (shape ()); "
                                   "BatchNorm needs (N,) or (N, C, ...)")
        self.channels = 1 if len(bottom[0].shape) == 1 else bottom[0].shape[1]
        if not self.blobs:
            self.blobs = [Blob((self.channels,)), Blob((self.channels,)), Blob((1,))]
        # The statistics must not be touched by the solver: lr_mult 0, as Caffe enforces.
        specs = self.layer_param.param
        for index in range(len(self.blobs)):
            if len(specs) == index:
                specs.add().lr_mult = 0.0
            elif specs[index].lr_mult != 0:
                raise self.config_error(f"param[{index}].lr_mult", "batch normalization statistics "
                                        f"cannot be learned; must be 0, got {specs[index].lr_mult:g}")

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) > 1 and shape[1] != self.channels:
            raise self.shape_error(f"bottom has {shape[1]} channels (axis 1), the layer was set up "
                                   f"with {self.channels}")
        if top[0] is not bottom[0]:
            top[0].reshape(shape)

    def _grouped(self, array):
        """View as (N, C, spatial); spatial spelled out, not -1: N may be 0."""
        return array.reshape(array.shape[0], self.channels, math.prod(array.shape[2:]))

    def forward(self, bottom, top):
        x = self._grouped(bottom[0].data)
        dtype = x.dtype
        if not x.size:
            # An empty batch (or no channels): an empty top, and no samples to update the
            # running statistics with (Caffe divides by N*C here, an integer division by 0).
            return
        if self.use_global_stats:
            factor = self.blobs[2].data[0]
            factor = 0.0 if factor == 0 else 1.0 / factor
            mean = (self.blobs[0].data * factor).astype(dtype)
            variance = (self.blobs[1].data * factor).astype(dtype)
            centred = x - mean[:, None]
        else:
            mean = x.mean(axis=(0, 2))
            centred = x - mean[:, None]
            variance = np.mean(centred * centred, axis=(0, 2))
            self._update_running_stats(mean, variance, x.size // self.channels)
        self.std = np.sqrt(variance + dtype.type(self.eps))[:, None]   # (C, 1)
        self.x_norm = centred / self.std                                # kept: top may be overwritten
        self._grouped(top[0].data)[...] = self.x_norm

    def epilogue(self, bottom, top):
        """With global statistics, forward as a per-channel affine map for
        inference fusion (cct.runtime.fusion): ("affine", (shift, scale, None),
        False), y = (x + shift) * scale with shift = -mean and scale =
        1 / sqrt(var + eps). Sets what backward reads (std), as forward
        does; None in batch mode."""
        if not self.use_global_stats:
            return None
        dtype = bottom[0].dtype
        factor = self.blobs[2].data[0]
        factor = 0.0 if factor == 0 else 1.0 / factor
        mean = (self.blobs[0].data * factor).astype(dtype)
        variance = (self.blobs[1].data * factor).astype(dtype)
        self.std = np.sqrt(variance + dtype.type(self.eps))[:, None]   # (C, 1)
        return "affine", (-mean, dtype.type(1) / self.std[:, 0], None), False

    def _update_running_stats(self, mean, variance, m):
        maf = self.maf
        self.blobs[2].data[...] = self.blobs[2].data * maf + 1
        self.blobs[0].data[...] = mean + maf * self.blobs[0].data
        correction = m / (m - 1) if m > 1 else 1.0
        self.blobs[1].data[...] = correction * variance + maf * self.blobs[1].data

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0] or not bottom[0].count:
            return
        g = self._grouped(top[0].diff)
        if self.use_global_stats:
            dx = g / self.std
        else:
            # (g - mean(g) - y * mean(g * y)) / sqrt(var + eps), means over all but C
            y = self.x_norm
            dx = (g - g.mean(axis=(0, 2), keepdims=True)
                  - y * np.mean(g * y, axis=(0, 2), keepdims=True)) / self.std
        self._grouped(bottom[0].diff)[...] = dx

    # --- on a device: channel sums and per-channel maps (cct.devices) -------------------
    def runs_on(self, device, bottom, top):
        return self.all_float32(bottom, top, self.blobs)

    def _device_dims(self, bottom):
        """(N, C, S, m): bottom as (N, C, S), m = N * S values per channel."""
        count = bottom[0].count
        batch = bottom[0].shape[0]
        spatial = count // (batch * self.channels) if count else 0
        return batch, self.channels, spatial, batch * spatial

    def forward_on(self, device, bottom, top):
        if not bottom[0].count:                # no samples: an empty top, statistics untouched
            return
        batch, channels, spatial, m = self._device_dims(bottom)
        x = bottom[0].device_data(device)
        # kept for backward: std (C,), and in batch mode the normalized output
        mean = self.device_scratch(device, "bn_mean", channels)
        variance = self.device_scratch(device, "bn_variance", channels)
        std = self.device_scratch(device, "bn_std", channels)
        if self.use_global_stats:
            device.copy(mean, self.blobs[0].device_data(device), channels)
            device.copy(variance, self.blobs[1].device_data(device), channels)
            device.batch_norm_stats(mean, variance, std, channels, self.eps, factor=self.blobs[2].device_data(device))
            device.channel_normalize(x, top[0].mutable_device_data(device), batch, channels, spatial, mean, std)
            return
        device.channel_sum(x, batch, channels, spatial, mean, alpha=1.0 / m)
        y = top[0].mutable_device_data(device)         # (x itself in place: x is not read again)
        device.channel_normalize(x, y, batch, channels, spatial, mean=mean)             # y = x - mean
        device.channel_sum(y, batch, channels, spatial, variance, alpha=1.0 / m, times=y)
        self._update_running_stats_on(device, mean, variance, m)
        device.batch_norm_stats(mean, variance, std, channels, self.eps)
        device.channel_normalize(y, y, batch, channels, spatial, std=std)
        # kept: a later in-place layer may overwrite the top
        device.copy(self.device_scratch(device, "bn_x_norm", bottom[0].count), y, bottom[0].count)

    def _update_running_stats_on(self, device, mean, variance, m):
        """_update_running_stats with axpby: factor = maf * factor + 1, the sums
        = maf * sums + this batch's mean and (unbiased) variance."""
        maf, channels = self.maf, self.channels
        device.axpby(1, 1.0, device.ones(1), maf, self.blobs[2].mutable_device_data(device))
        device.axpby(channels, 1.0, mean, maf, self.blobs[0].mutable_device_data(device))
        correction = m / (m - 1) if m > 1 else 1.0
        device.axpby(channels, correction, variance, maf, self.blobs[1].mutable_device_data(device))

    def backward_on(self, device, top, propagate_down, bottom):
        if not propagate_down[0] or not bottom[0].count:
            return
        batch, channels, spatial, m = self._device_dims(bottom)
        dy, dx = top[0].device_diff(device), bottom[0].mutable_device_diff(device)
        std = self.device_scratch(device, "bn_std", channels)
        if self.use_global_stats:                       # dx = dy / std
            device.channel_normalize(dy, dx, batch, channels, spatial, std=std)
            return
        y = self.device_scratch(device, "bn_x_norm", bottom[0].count)
        mean_dy, mean_dy_y = device.scratch("bn_mean_dy", channels), device.scratch("bn_mean_dy_y", channels)
        device.channel_sum(dy, batch, channels, spatial, mean_dy, alpha=1.0 / m)
        device.channel_sum(dy, batch, channels, spatial, mean_dy_y, alpha=1.0 / m, times=y)
        device.batch_norm_backward(dy, y, std, mean_dy, mean_dy_y, dx, batch, channels, spatial)
