"""Normalization layers: LRN, MVN and BatchNorm, with Caffe's exact formulas
(where eps goes, which divisor a window uses, how running statistics decay).

LRN across channels sums each channel's window as Caffe's CPU layer does, a
running sum (the entering term added, the leaving one subtracted: two terms
a channel, in Caffe's rounding order); within a channel, window sums are a
loop over the local_size offsets (a handful of whole-array adds of shifted
slices), never over pixels. Across channels with beta 0.75 (AlexNet and its
kin) runs as one compiled pass per image with the numpy passes' operations,
faster than those passes and than compiled n-term window sums (BENCHMARKS.md,
"Behind layers/normalization.py"); other settings run the numpy passes.
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


# --- ACROSS_CHANNELS in Caffe's order (LRNLayer::CrossChannelForward_cpu) ---------
# The scale of channel c is the previous channel's plus the square entering
# the window and minus the one leaving it, each term (alpha/n) * x^2 rounded
# and added in turn from s = k at channel 0 (Caffe's caffe_axpy steps), so
# each scale costs two terms, not n, and more of the top is Caffe's bit for bit
# than with n-term window sums (BENCHMARKS.md, "Session 11: Concat as views, conv1
# in bands, LRN in Caffe's order, 2 x 2 pooling backward, col2im by rows"). As in
# Caffe, a square far larger than its neighbours leaves rounding of its
# size in the running sum once it has left the window. Backward's window of
# g * y / s runs as Caffe's accum_ratio: from 0, the entering term added, the
# leaving one subtracted. The compiled passes (beta 0.75, one per image) and
# the numpy passes (any beta) do the same operations in the same order, so
# they agree bit for bit; s^-0.75 = 1 / sqrt(s * sqrt(s)) (_negative_power).
# No multiply-add is fused (numba does not fuse, numpy's ufuncs cannot).


@kernel
def _caffe_scale_step(x, ch, half, alpha_over_n, scale):
    """scale (P,) from channel ch - 1's scale to channel ch's, x (C, P)."""
    channels, pixels = x.shape
    entering, leaving = ch + half, ch - 1 - half
    if entering < channels:
        for q in range(pixels):
            v = x[entering, q]
            scale[q] = scale[q] + alpha_over_n * (v * v)
    if leaving >= 0:
        for q in range(pixels):
            v = x[leaving, q]
            scale[q] = scale[q] - alpha_over_n * (v * v)


@kernel
def _caffe_first_scale(x, half, alpha_over_n, k, scale):
    """scale (P,) of channel 0: k, then (alpha/n) x^2 of channels 0 .. half in turn."""
    channels, pixels = x.shape
    for q in range(pixels):
        scale[q] = k
    for c in range(min(half, channels - 1) + 1):
        for q in range(pixels):
            v = x[c, q]
            scale[q] = scale[q] + alpha_over_n * (v * v)


# s^-0.75 as _negative_power takes it, 1 / sqrt(s * sqrt(s)), is written out
# in the kernels' loops: called as a kernel of its own it was not inlined, and
# the loops then ran one value at a time (vsqrtss, not vsqrtps).


@kernel
def _lrn_forward_075(x, size, alpha_over_n, k, one, scale, y):
    """y = x * s^-0.75 for x, y (N, C, P), s Caffe's running scale (P,) per
    channel in turn."""
    batch, channels, pixels = x.shape
    half = (size - 1) // 2
    for b in range(batch):
        _caffe_first_scale(x[b], half, alpha_over_n, k, scale)
        for ch in range(channels):
            if ch:
                _caffe_scale_step(x[b], ch, half, alpha_over_n, scale)
            for q in range(pixels):
                s = scale[q]
                y[b, ch, q] = x[b, ch, q] * (one / np.sqrt(np.sqrt(s) * s))     # s^-0.75


@_lrn_forward_075.twin
def _lrn_forward_075_twin(x, size, alpha_over_n, k, one, scale, y):
    """_lrn_forward_075 in numpy steps over every image at once: the same
    running scale per channel (from k the squares of channels 0 .. half
    added in turn, then per channel the entering square added and the
    leaving one subtracted, as Caffe does), one step per channel, each
    square (alpha/n) x^2 made for all channels first; then the same power
    of every scale at once. `scale` is left as the kernel leaves it (the
    last image's last channel)."""
    batch, channels, pixels = x.shape
    if not x.size:
        return
    half = (size - 1) // 2
    squares = x * x
    np.multiply(alpha_over_n, squares, out=squares)                   # (N, C, P)
    scales = np.empty_like(x)                                          # (N, C, P)
    running = scales[:, 0]
    running[...] = k
    for c in range(min(half, channels - 1) + 1):
        np.add(running, squares[:, c], out=running)
    for ch in range(1, channels):
        entering, leaving = ch + half, ch - 1 - half
        if entering < channels:
            np.add(scales[:, ch - 1], squares[:, entering], out=scales[:, ch])
        else:
            scales[:, ch] = scales[:, ch - 1]
        if leaving >= 0:
            np.subtract(scales[:, ch], squares[:, leaving], out=scales[:, ch])
    scale[...] = scales[-1, -1]
    power = np.sqrt(scales)
    np.multiply(power, scales, out=power)
    np.sqrt(power, out=power)
    np.divide(one, power, out=power)                                   # s^-0.75
    np.multiply(x, power, out=y)


@kernel
def _lrn_backward_075(x, y, g, size, alpha_over_n, k, one, factor, scales, ratio, accum, dx):
    """dx = g * s^-0.75 - factor * x * window(g * y / s) for (N, C, P) arrays,
    s recomputed as forward's (not kept), the window summed as Caffe's
    accum_ratio; dx may be g itself (each channel's g is read before its dx
    is written)."""
    batch, channels, pixels = x.shape
    half = (size - 1) // 2
    for b in range(batch):
        _caffe_first_scale(x[b], half, alpha_over_n, k, scales[0])
        for ch in range(channels):
            if ch:
                scales[ch] = scales[ch - 1]
                _caffe_scale_step(x[b], ch, half, alpha_over_n, scales[ch])
            for q in range(pixels):
                ratio[ch, q] = g[b, ch, q] * y[b, ch, q] / scales[ch, q]
        for q in range(pixels):
            accum[q] = 0
        for c in range(min(half, channels)):      # the window of channel -1: channels 0 .. half - 1
            for q in range(pixels):
                accum[q] += ratio[c, q]
        for ch in range(channels):
            if ch + half < channels:
                for q in range(pixels):
                    accum[q] += ratio[ch + half, q]
            for q in range(pixels):
                s = scales[ch, q]
                dx[b, ch, q] = (g[b, ch, q] * (one / np.sqrt(np.sqrt(s) * s))   # s^-0.75
                                - accum[q] * x[b, ch, q] * factor)
            if ch - half >= 0:
                for q in range(pixels):
                    accum[q] -= ratio[ch - half, q]


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
    reshape_reads_layout = True

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
            _caffe_scales(squares, (self.size - 1) // 2, cast(self.alpha / self.size), cast(self.k), scale)
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
            _caffe_window(ratio, (self.size - 1) // 2, spread)
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


def _caffe_scales(squares, half, alpha_over_n, k, out):
    """out (N, C, ...) = each channel's scale from squares = x^2, in Caffe's
    running order (see _caffe_first_scale and _caffe_scale_step)."""
    channels = squares.shape[1]
    term = np.empty_like(out[:, 0])
    out[:, 0] = k
    for c in range(min(half, channels - 1) + 1):
        out[:, 0] += np.multiply(squares[:, c], alpha_over_n, out=term)
    for ch in range(1, channels):
        out[:, ch] = out[:, ch - 1]
        if ch + half < channels:
            out[:, ch] += np.multiply(squares[:, ch + half], alpha_over_n, out=term)
        if ch - 1 - half >= 0:
            out[:, ch] -= np.multiply(squares[:, ch - 1 - half], alpha_over_n, out=term)
    return out


def _caffe_window(values, half, out):
    """out (N, C, ...) = the sum of values over each channel's window, as
    Caffe's accum_ratio runs it: from 0, the entering channel added before
    the channel's use and the leaving one subtracted after."""
    channels = values.shape[1]
    accum = np.zeros_like(values[:, 0])
    for c in range(min(half, channels)):
        accum += values[:, c]
    for ch in range(channels):
        if ch + half < channels:
            accum += values[:, ch + half]
        out[:, ch] = accum
        if ch - half >= 0:
            accum -= values[:, ch - half]
    return out


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
