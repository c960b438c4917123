"""Pooling family: Pooling (MAX, AVE, STOCHASTIC) and SPP.

Windows are visited as KH*KW strided slices of a padded copy of the input
(one numpy operation per kernel offset over a few images), never per pixel;
MAX's backward, a scatter to each window's winner, is a compiled loop (cct.devices.jit).
"""
import numpy as np

from cct.core.blob import Blob
from cct.devices.jit import kernel
from cct.core.layer import TRAIN, Layer, register
from cct.proto import caffe_pb2
from cct.core.rng import get_rng

MAX, AVE, STOCHASTIC = (caffe_pb2.PoolingParameter.MAX, caffe_pb2.PoolingParameter.AVE,
                        caffe_pb2.PoolingParameter.STOCHASTIC)
_POOL_NAMES = {MAX: "MAX", AVE: "AVE", STOCHASTIC: "STOCHASTIC"}
_FLT_MAX = float(np.finfo(np.float32).max)    # Caffe starts every max at -FLT_MAX
# Output elements per batch chunk in MAX/AVE pooling: about 1 MiB of float32,
# where the chunk's work arrays stay in the CPU cache (measured: 2-4 images of
# CaffeNet's pool1 run 2x faster than the whole batch at once).
CHUNK_ELEMENTS = 1 << 18


@kernel
def _max_backward(dy, winner, kernel_w, stride_h, stride_w, pad_h, pad_w, dx):
    """dx (zeroed here) += each output's gradient at its window's winner.
    The offset's row and column come from tables (an integer division per
    output would cost more than the rest); indices are unsigned, which spares
    numba's negative-index checks."""
    n, c, out_h, out_w = dy.shape
    area = kernel_w * ((winner.max() if winner.size else 0) // kernel_w + 1)
    row_of = np.arange(area) // kernel_w
    col_of = np.arange(area) % kernel_w
    dx[...] = 0
    for b in range(n):
        for ch in range(c):
            for oh in range(out_h):
                top = oh * stride_h - pad_h
                for ow in range(out_w):
                    k = winner[b, ch, oh, ow]
                    if k >= 0:
                        dx[b, ch, np.uint64(top + row_of[k]), np.uint64(ow * stride_w - pad_w + col_of[k])] += \
                            dy[b, ch, oh, ow]


def pooled_size(size, kernel, stride, pad, ceil, padded):
    """Caffe's pooled output size along one axis (CEIL or FLOOR rounding, then the
    last window must start inside the image when the layer has any padding:
    Caffe applies that clip to both axes if either one is padded)."""
    span = size + 2 * pad - kernel
    pooled = (-(-span // stride) if ceil else span // stride) + 1
    if padded and (pooled - 1) * stride >= size + pad:
        pooled -= 1
    return pooled


@register("Pooling")
class Pooling(Layer):
    """Max, average or stochastic pooling over KH x KW windows, per channel.

    pooling_param: pool (MAX | AVE | STOCHASTIC), kernel_size | kernel_h+kernel_w,
    stride | stride_h+stride_w (default 1), pad | pad_h+pad_w (MAX and AVE only,
    pad < kernel), global_pooling (kernel = the whole image), round_mode (CEIL | FLOOR).
    bottom (N, C, H, W) -> top[0] (N, C, PH, PW),
    PH = ceil((H + 2*pad_h - KH) / stride_h) + 1, less 1 if padded and the last
    window would start at or past H + pad_h (PW alike).
    MAX may have top[1]: the mask, the flat index h*W + w of each window's first maximum.
    AVE divides by the window clipped to the padded image (H + pad_h), padding counted.
    STOCHASTIC (Caffe's GPU semantics, inputs assumed >= 0): TRAIN samples one
    element per window with probability value / window sum; TEST outputs
    sum(v^2) / sum(v).
    """
    batch_independent = True

    def can_partition(self, bottom, top):
        # stochastic pooling draws from one random stream in batch order
        return self.layer_param.pooling_param.pool != caffe_pb2.PoolingParameter.STOCHASTIC

    def flops(self, bottom, top):
        # a compare (MAX) or an add (AVE) per window cell; backward routes or spreads as many
        if getattr(self, "kernel", None) is None:
            return 0, 0, 0
        cells = top[0].count * self.kernel[0] * self.kernel[1]
        return cells, cells, 0
    exact_bottoms = 1
    min_tops = 1
    max_tops = 2

    def setup(self, bottom, top):
        p = self.layer_param.pooling_param
        self.pool = p.pool
        self.draws_random = self.pool == STOCHASTIC and self.phase == TRAIN
        if self.pool not in _POOL_NAMES:
            raise self.config_error("pooling_param.pool", f"unknown method {self.pool}")
        if len(top) > 1 and self.pool != MAX:
            raise self.config_error("top", f"only MAX pooling has a second (mask) top; "
                                    f"{_POOL_NAMES[self.pool]} takes 1")
        self.global_pooling = p.global_pooling
        has_size, has_h, has_w = p.HasField("kernel_size"), p.HasField("kernel_h"), p.HasField("kernel_w")
        if self.global_pooling:
            if has_size or has_h or has_w:
                raise self.config_error("pooling_param.kernel_size", "no kernel size with global_pooling: true")
        else:
            if has_size == (has_h and has_w):
                raise self.config_error("pooling_param.kernel_size", "give kernel_size or kernel_h and kernel_w, "
                                        "not both")
            if not has_size and not (has_h and has_w):
                raise self.config_error("pooling_param.kernel_h", "non-square kernels need both kernel_h and kernel_w")
        self.pad = self._hw(p, "pad")
        self.stride = self._hw(p, "stride")
        if not self.global_pooling:
            self.kernel = (p.kernel_size, p.kernel_size) if has_size else (p.kernel_h, p.kernel_w)
            if min(self.kernel) <= 0:
                raise self.config_error("pooling_param.kernel_size", f"must be > 0, got {self.kernel[0]} x {self.kernel[1]}")
        if min(self.stride) <= 0:
            raise self.config_error("pooling_param.stride", f"must be > 0, got {self.stride[0]} x {self.stride[1]}")
        if self.global_pooling and (self.pad != (0, 0) or self.stride != (1, 1)):
            raise self.config_error("pooling_param.global_pooling", "takes only pad 0 and stride 1")
        if self.pad != (0, 0):
            if self.pool not in (MAX, AVE):
                raise self.config_error("pooling_param.pad", "padding is implemented only for MAX and AVE pooling")
            if not self.global_pooling and (self.pad[0] >= self.kernel[0] or self.pad[1] >= self.kernel[1]):
                raise self.config_error("pooling_param.pad", f"must be < kernel ({self.kernel[0]} x "
                                        f"{self.kernel[1]}), got {self.pad[0]} x {self.pad[1]}")
        self.ceil = p.round_mode == caffe_pb2.PoolingParameter.CEIL

    def _hw(self, p, name):
        h_name, w_name = f"{name}_h", f"{name}_w"
        has_h, has_w = p.HasField(h_name), p.HasField(w_name)
        if has_h or has_w:
            if p.HasField(name) or not (has_h and has_w):
                raise self.config_error(f"pooling_param.{name}", f"give {name}, or both {h_name} and {w_name}")
            return (getattr(p, h_name), getattr(p, w_name))
        return (getattr(p, name), getattr(p, name))

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) != 4:
            raise self.shape_error(f"bottom must be 4-d (N, C, H, W), got {shape}")
        n, c, h, w = shape
        if self.global_pooling:
            self.kernel = (h, w)
        self.in_hw = (h, w)
        padded = any(self.pad)
        self.out_hw = tuple(pooled_size(size, k, s, p, self.ceil, padded) for size, k, s, p
                            in zip((h, w), self.kernel, self.stride, self.pad))
        if min(self.out_hw) < 1:
            raise self.shape_error(f"input {h} x {w} gives an empty output {self.out_hw}")
        for blob in top:
            blob.reshape(n, c, *self.out_hw)
        # The whole image is one window: reductions over (H, W) instead of slices.
        self.whole_image = self.out_hw == (1, 1) and self.pad == (0, 0) and self.kernel[0] >= h and self.kernel[1] >= w
        self._setup_windows()

    def _setup_windows(self):
        """Per output cell: where its window starts and its AVE divisor (Caffe's formulas)."""
        (h, w), (ph, pw), (kh, kw), (sh, sw), (pad_h, pad_w) = (self.in_hw, self.out_hw, self.kernel,
                                                                  self.stride, self.pad)
        starts_h = np.arange(ph) * sh - pad_h
        starts_w = np.arange(pw) * sw - pad_w
        size_h = np.minimum(starts_h + kh, h + pad_h) - starts_h
        size_w = np.minimum(starts_w + kw, w + pad_w) - starts_w
        self.pool_size = np.outer(size_h, size_w)                       # (PH, PW)
        # Flat image index of each window's top-left cell (may lie in the padding).
        self.window_origin = starts_h[:, None] * w + starts_w[None, :]  # (PH, PW)
        # The padded buffer holds every window cell, including ceil-mode overhang.
        self.padded_hw = ((ph - 1) * sh + kh, (pw - 1) * sw + kw)

    def _padded_shape(self, n, c):
        (h, w), (pad_h, pad_w) = self.in_hw, self.pad
        return (n, c, max(self.padded_hw[0], h + pad_h), max(self.padded_hw[1], w + pad_w))

    def _padded(self, x, fill, name="padded"):
        """x in a buffer with room for every window cell beyond the image, the
        extra cells `fill`; x itself when every window lies inside it."""
        n, c = x.shape[:2]
        (h, w), (pad_h, pad_w) = self.in_hw, self.pad
        shape = self._padded_shape(n, c)
        if shape[2:] == (h, w):
            return x
        xp = self._work(name, shape, x.dtype)
        xp.fill(fill)
        xp[:, :, pad_h:pad_h + h, pad_w:pad_w + w] = x
        return xp

    def _zeroed_gradient(self, bottom_diff):
        """(the array to accumulate window gradients into, a function that moves
        it into bottom_diff): the bottom diff itself when no window reaches past
        the image, else a padded work array."""
        n, c, h, w = bottom_diff.shape
        pad_h, pad_w = self.pad
        shape = self._padded_shape(n, c)
        if shape[2:] == (h, w):
            bottom_diff.fill(0)
            return bottom_diff, lambda: None
        dxp = self._work("padded_diff", shape, bottom_diff.dtype)
        dxp.fill(0)

        def crop():
            bottom_diff[...] = dxp[:, :, pad_h:pad_h + h, pad_w:pad_w + w]
        return dxp, crop

    def _chunks(self, n, c):
        """Slices of the batch, a few images each: the dozen whole-array passes
        per window offset run on arrays that stay in the CPU cache (about 2x
        faster than passes over the whole batch)."""
        per_image = c * self.out_hw[0] * self.out_hw[1]
        chunk = max(1, min(n, CHUNK_ELEMENTS // max(per_image, 1)))
        return [slice(start, min(start + chunk, n)) for start in range(0, n, chunk)]

    def _work(self, name, shape, dtype):
        """A work array for use inside this call (the thread's, Layer.work)."""
        return self.work("pooling_" + name, shape, dtype)

    def _offsets(self):
        (ph, pw), (sh, sw) = self.out_hw, self.stride
        for i in range(self.kernel[0]):
            for j in range(self.kernel[1]):
                yield i, j, (slice(None), slice(None), slice(i, i + sh * (ph - 1) + 1, sh),
                             slice(j, j + sw * (pw - 1) + 1, sw))

    # --- forward -------------------------------------------------------------------
    def forward(self, bottom, top):
        x = bottom[0].data
        if self.pool == MAX:
            self.winner = self._max(x, top[0].data)
            if len(top) > 1:
                top[1].data[...] = self._mask(self.winner)
        elif self.pool == AVE:
            self._average(x, top[0].data)
        elif self.phase == TRAIN:
            top[0].data[...] = self._stochastic_sample(x)
        else:
            top[0].data[...] = self._stochastic_weighted(x)

    def _max(self, x, value):
        """Fill `value` (N, C, PH, PW) with the window maxima; return where each
        is, as the kernel offset i*KW + j of the first maximum in scan order (for
        a whole-image window that is the flat index h*W + w), -1 for a window
        with nothing above -FLT_MAX: such a window keeps Caffe's initial -FLT_MAX
        and gets no gradient. Kept for backward in the smallest integer that
        holds KH*KW: a byte for kernels up to 11 x 11."""
        n, c, h, w = x.shape
        area = self.kernel[0] * self.kernel[1]
        offset_type = np.int8 if area <= 127 else np.int16 if area <= 32767 else np.int32
        winner = self.scratch("winner", value.shape, offset_type)
        if self.whole_image:
            flat = x.reshape(n, c, h * w)
            first = flat.argmax(axis=2)[..., None]                      # the first maximum, as Caffe scans
            value[...] = np.take_along_axis(flat, first, axis=2).reshape(value.shape)
            winner[...] = first.reshape(value.shape)
        else:
            for rows in self._chunks(n, c):
                self._max_chunk(x[rows], value[rows], winner[rows])
        # (min first: no blob-sized mask in the usual case of no empty window)
        if value.size and not value.min() > -_FLT_MAX:
            empty = ~(value > -_FLT_MAX)
            value[empty] = -_FLT_MAX
            winner[empty] = -1
        return winner

    def _max_chunk(self, x, value, winner):
        # Padding holds -inf, below Caffe's -FLT_MAX start, so it never wins.
        xp = self._padded(x, -np.inf)
        better = self._work("better", value.shape, np.bool_)
        step = self._work("step", value.shape, winner.dtype)
        offsets = self._offsets()
        value[...] = xp[next(offsets)[2]]
        winner.fill(0)
        for k, (_, _, window) in enumerate(offsets, 1):
            cell = xp[window]
            np.greater(cell, value, out=better)                         # strict: an equal later cell loses
            np.fmax(value, cell, out=value)
            # winner = k where better (arithmetic: several times faster than a masked copy)
            np.subtract(k, winner, out=step)
            step *= better
            winner += step

    def _mask(self, winner):
        """The flat input index h*W + w of each maximum, -1 for an empty window."""
        offset = winner.astype(np.int64)
        if self.whole_image:
            return offset
        w, kw = self.in_hw[1], self.kernel[1]
        index = self.window_origin + (offset // kw) * w + offset % kw
        index[offset < 0] = -1
        return index

    def _average(self, x, out):
        if self.whole_image:
            np.sum(x, axis=(2, 3), keepdims=True, out=out)
        else:
            for rows in self._chunks(*x.shape[:2]):
                xp, total = self._padded(x[rows], 0), out[rows]
                for k, (_, _, window) in enumerate(self._offsets()):
                    if k == 0:
                        total[...] = xp[window]
                    else:
                        total += xp[window]
        out /= self.pool_size.astype(x.dtype)
        return out

    def _windows(self, x):
        """x (N, C, H, W) -> (N, C, PH, PW, KH*KW), the unpadded windows (stochastic pooling)."""
        xp = self._padded(x, 0, name="padded_windows")
        return np.stack([xp[window] for _, _, window in self._offsets()], axis=-1)

    def _stochastic_sample(self, x):
        windows = self._windows(x)
        cumulative = np.cumsum(windows, axis=-1)
        threshold = get_rng().random(cumulative.shape[:-1]).astype(x.dtype) * cumulative[..., -1]
        chosen = np.argmax(cumulative >= threshold[..., None], axis=-1)    # first cell past the threshold
        self.sample_offset = chosen
        return np.take_along_axis(windows, chosen[..., None], axis=-1)[..., 0]

    def _stochastic_weighted(self, x):
        windows = self._windows(x)
        tiny = np.finfo(np.float32).tiny                                    # Caffe starts the sum at FLT_MIN
        return (windows * windows).sum(axis=-1) / (windows.sum(axis=-1) + tiny)

    # --- backward ------------------------------------------------------------------
    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy = top[0].diff
        if self.pool == MAX and len(top) > 1:
            # Caffe routes by the mask top when there is one.
            bottom[0].diff[...] = self._route(dy, top[1].data.astype(np.int64), bottom[0].shape)
        elif self.pool == MAX:
            if self.winner.shape != dy.shape:
                raise self.shape_error(f"backward needs a forward at the current shape: the kept maxima "
                                       f"are for {self.winner.shape}, the top is {dy.shape}")
            # a whole-image window's winner is the flat index h*W + w: decode it by the image width
            width = self.in_hw[1] if self.whole_image else self.kernel[1]
            _max_backward(dy, self.winner, width, *self.stride, *self.pad, bottom[0].diff)
        elif self.pool == AVE:
            self._spread(dy / self.pool_size.astype(dy.dtype), bottom[0].diff)
        else:
            bottom[0].diff[...] = self._spread_to_sample(dy, bottom[0].shape)

    @staticmethod
    def _route(dy, mask, shape):
        """Sum each output's gradient into the input cell its mask names (-1: nowhere)."""
        n, c, h, w = shape
        planes = np.arange(n * c).reshape(n, c, 1, 1) * (h * w)
        valid = mask >= 0
        target = (planes + mask)[valid]
        summed = np.bincount(target, weights=dy[valid], minlength=n * c * h * w)
        return summed.reshape(shape)

    def _spread(self, dy_scaled, dx):
        """Adjoint of the window sum: every output's value added over its window, into dx."""
        if self.whole_image:
            dx[...] = dy_scaled
            return
        for rows in self._chunks(*dx.shape[:2]):
            target, finish = self._zeroed_gradient(dx[rows])
            for _, _, window in self._offsets():
                target[window] += dy_scaled[rows]
            finish()

    def _spread_to_sample(self, dy, shape):
        n, c, h, w = shape
        dxp = np.zeros((n, c, max(self.padded_hw[0], h), max(self.padded_hw[1], w)), dy.dtype)
        for k, (_, _, window) in enumerate(self._offsets()):
            dxp[window] += np.where(self.sample_offset == k, dy, 0)
        return dxp[:, :, :h, :w]


@register("SPP")
class SPP(Layer):
    """Spatial pyramid pooling (Caffe's SPPLayer): level l pools the image into
    2^l x 2^l bins, KH = ceil(H / 2^l), stride KH, pad_h = (KH*2^l - H + 1) // 2
    (W alike); each level is flattened and the levels concatenated.

    spp_param: pyramid_height, pool (MAX | AVE | STOCHASTIC).
    bottom (N, C, H, W) -> top (N, C * sum_l 4^l) for pyramid_height > 1, and
    the single level's (N, C, 1, 1) pooling output for pyramid_height 1.
    """
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        self.pyramid_height = self.layer_param.spp_param.pyramid_height
        if self.pyramid_height < 1:
            raise self.config_error("spp_param.pyramid_height", f"must be >= 1, got {self.pyramid_height}")
        self.levels_for = None

    def _level_param(self, level, h, w):
        bins = 2 ** level
        kernel_h, kernel_w = -(-h // bins), -(-w // bins)
        param = caffe_pb2.LayerParameter(name=f"{self.name}/pool{level}", type="Pooling")
        pp = param.pooling_param
        pp.pool = self.layer_param.spp_param.pool      # SPP's enum has Pooling's values
        pp.kernel_h, pp.kernel_w = kernel_h, kernel_w
        pp.stride_h, pp.stride_w = kernel_h, kernel_w
        pp.pad_h, pp.pad_w = (kernel_h * bins - h + 1) // 2, (kernel_w * bins - w + 1) // 2
        return param

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) != 4:
            raise self.shape_error(f"bottom must be 4-d (N, C, H, W), got {shape}")
        if shape[2] <= 0 or shape[3] <= 0:
            raise self.shape_error(f"input height and width must be > 0, got {shape}")
        key = (shape[2:], bottom[0].dtype)
        if self.levels_for != key:
            # Caffe rebuilds the pooling layers whenever the image size changes.
            # (They keep this layer's phase; Caffe's would always be TRAIN.)
            self.levels = []
            for level in range(self.pyramid_height):
                pooling = Pooling(self._level_param(level, *shape[2:]), self.phase, self.source)
                outputs = [Blob(dtype=bottom[0].dtype)]
                pooling.set_up(bottom, outputs)
                self.levels.append((pooling, outputs))
            self.levels_for = key
        else:
            for pooling, outputs in self.levels:
                pooling.reshape(bottom, outputs)
        if self.pyramid_height == 1:
            top[0].reshape(self.levels[0][1][0].shape)
        else:
            top[0].reshape(shape[0], sum(outputs[0].count_range(1) for _, outputs in self.levels))

    def forward(self, bottom, top):
        n = bottom[0].shape[0]
        start = 0
        for pooling, outputs in self.levels:
            pooling.forward(bottom, outputs)
            width = outputs[0].count_range(1)
            top[0].data.reshape(n, -1)[:, start:start + width] = outputs[0].data.reshape(n, width)
            start += width

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        n = bottom[0].shape[0]
        total = None
        start = 0
        for pooling, outputs in self.levels:
            width = outputs[0].count_range(1)
            outputs[0].diff.reshape(n, width)[...] = top[0].diff.reshape(n, -1)[:, start:start + width]
            start += width
            pooling.backward(outputs, [True], bottom)
            total = bottom[0].diff.copy() if total is None else total + bottom[0].diff
        bottom[0].diff[...] = total
