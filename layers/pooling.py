"""Pooling family: Pooling (MAX, AVE, STOCHASTIC) and SPP.

MAX and AVE run as compiled kernels, one call per layer pass
(layers/pooling_kernels.py, whose docstring says which runs where); the
numpy passes they replaced are the reference the tests check them against
(layers/pooling_reference.py). Where the net never runs a MAX layer's
backward and it has no mask top, the forward finds the maxima alone. A
kernel call of a batch partition's twin runs on its thread; a layer run
whole on several threads splits a large call's planes over them
(Layer.run_partitions' spread). The measurements behind each choice:
BENCHMARKS.md, "Pooling kernels (issue 20)".
"""
import numpy as np

from cct.core.blob import Blob
from cct.core.layer import TRAIN, Layer, register
from cct.proto import caffe_pb2
from cct.core.rng import get_rng
from cct.devices import pool
import cct.layers.pooling_kernels as kernels

MAX, AVE, STOCHASTIC = (caffe_pb2.PoolingParameter.MAX, caffe_pb2.PoolingParameter.AVE,
                        caffe_pb2.PoolingParameter.STOCHASTIC)
_POOL_NAMES = {MAX: "MAX", AVE: "AVE", STOCHASTIC: "STOCHASTIC"}
_FLT_MAX = float(np.finfo(np.float32).max)    # Caffe starts every max at -FLT_MAX


def pooled_size(size, kernel, stride, pad, ceil, padded):
    """Caffe's pooled output size along one axis (CEIL or FLOOR rounding, then the
    last window must start inside the image when the layer has any padding:
    Caffe applies that clip to both axes if either one is padded)."""
    span = size + 2 * pad - kernel
    pooled = (-(-span // stride) if ceil else span // stride) + 1
    if padded and (pooled - 1) * stride >= size + pad:
        pooled -= 1
    return pooled


# Elements of a kernel's largest array below which it runs in one call: a hand-off to a worker costs
# tens of microseconds, more than smaller calls gain split (BENCHMARKS.md, "Pooling kernels (issue 20)").
PARALLEL_ELEMENTS = 1 << 20


def _on_pool(function):
    """Whether `function` is a parallel kernel that runs on the one pool now
    (cct.devices.pool): then one call splits itself on its threads, instead
    of pieces handed to the executor's workers."""
    return hasattr(function, "parallel_form") and pool.kernel_threads() > 1


def _planes(array, written=False):
    """(N, C, H, W) -> (N*C, H, W): a view, or for an array only read a
    C-contiguous copy when it is not C-contiguous (blobs and their batch
    slices are)."""
    if not array.flags.c_contiguous:
        if written:
            raise ValueError(f"pooling's kernels write C-contiguous arrays only, got strides {array.strides}")
        array = np.ascontiguousarray(array)
    return array.reshape(-1, *array.shape[2:])


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
    shares_threads = False          # a batch partition's twin (clone) runs beside the others
    _spread = None                  # Layer.run_partitions' spread, for a layer run whole on several threads
    reshape_reads_layout = True

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
            if not h or not w:                  # Caffe: CHECK_GT(kernel_h_, 0), "Filter dimensions cannot be zero"
                raise self.shape_error(f"pooling_param.global_pooling: the kernel is the bottom's {h} x {w}, "
                                       "and a kernel dimension cannot be zero")
            self.kernel = (h, w)
        self.in_hw = (h, w)
        padded = any(self.pad)
        self.out_hw = tuple(pooled_size(size, k, s, p, self.ceil, padded) for size, k, s, p
                            in zip((h, w), self.kernel, self.stride, self.pad))
        if min(self.out_hw) < 0:               # 0 runs, with an empty top (Blob::Reshape takes it)
            raise self.shape_error(
                f"input {h} x {w} does not fit pooling_param.kernel_size {self.kernel[0]} x {self.kernel[1]}, "
                f"pad {self.pad[0]} x {self.pad[1]}, stride {self.stride[0]} x {self.stride[1]}: the output "
                f"would be {self.out_hw[0]} x {self.out_hw[1]}")
        for blob in top:
            blob.reshape(n, c, *self.out_hw)
        # The whole image is one window: reductions over (H, W) instead of slices.
        self.whole_image = self.out_hw == (1, 1) and self.pad == (0, 0) and self.kernel[0] >= h and self.kernel[1] >= w
        key = (self.in_hw, self.kernel)                 # (stride, pad: fixed at setup)
        if getattr(self, "_windows_for", None) != key:    # a dozen small numpy calls: 10-25 us a reshape
            self._setup_windows()
            self._windows_for = key

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

    def _work(self, name, shape, dtype):
        """A work array for use inside this call (the thread's, Layer.work)."""
        return self.work("pooling_" + name, shape, dtype)

    def _offsets(self):
        (ph, pw), (sh, sw) = self.out_hw, self.stride
        for i in range(self.kernel[0]):
            for j in range(self.kernel[1]):
                yield i, j, (slice(None), slice(None), slice(i, i + sh * (ph - 1) + 1, sh),
                             slice(j, j + sw * (pw - 1) + 1, sw))

    def run_partitions(self, count, threads=None, spread=None):
        self._spread = spread

    def _run(self, function, planes, settings, outputs):
        """function(*planes, *settings, *outputs): a kernel whose array
        arguments `planes` and `outputs` all have the (N*C) planes first; for
        a layer run whole on several threads (its spread), over ranges of
        planes at once."""
        count = outputs[0].shape[0]
        if self._serial(planes + outputs) or _on_pool(function):
            function(*planes, *settings, *outputs)
            return
        edges = np.linspace(0, count, min(self._spread.parts, count) + 1).astype(int)
        self._spread(function, [[a[start:stop] for a in planes] + list(settings) + [a[start:stop] for a in outputs]
                                for start, stop in zip(edges[:-1], edges[1:])])

    def _serial(self, arrays):
        """Whether a kernel on these arrays runs as one call on this thread: no
        spread (a layer on one thread or in batch partitions), a partition
        twin's, or arrays below PARALLEL_ELEMENTS."""
        spread = self._spread
        return (spread is None or spread.parts < 2 or self.shares_threads
                or max(array.size for array in arrays) < PARALLEL_ELEMENTS)

    def clone(self, share=1):
        twin = super().clone(share)
        twin.shares_threads = share > 1        # the batch partitions already run on every thread
        return twin

    # --- forward -------------------------------------------------------------------
    def forward(self, bottom, top):
        x = bottom[0].data
        if not top[0].count:                   # an empty batch or output: Caffe's loops do nothing
            self.winner = None
            return
        if self.pool == MAX:
            # The winners are for a backward and the mask top: a forward the net
            # never follows with this layer's backward finds the maxima alone.
            self.winner = self._max(x, top[0].data, self.runs_backward or len(top) > 1)
            if len(top) > 1:
                top[1].data[...] = self._mask(self.winner)
        elif self.pool == AVE:
            self._average(x, top[0].data)
        elif self.phase == TRAIN:
            top[0].data[...] = self._stochastic_sample(x)
        else:
            top[0].data[...] = self._stochastic_weighted(x)

    def bind_forward(self, bottom, top):
        """A MAX or AVE forward into one top as one kernel call on the arrays
        the plan's layout holds, its kernel chosen now (Layer.bind_forward)."""
        x, value = bottom[0].data, top[0].data
        if (self.pool == STOCHASTIC or len(top) > 1 or not value.size or not x.flags.c_contiguous
                or not self._serial([x, value])):
            return super().bind_forward(bottom, top)
        if self.pool == AVE:
            return lambda: self._average(x, value)
        function, planes, settings, outputs, winner = self._max_call(x, value, self.runs_backward)
        arguments = [*planes, *settings, *outputs]

        def forward():
            function(*arguments)
            self.winner = winner
        return forward

    def _max(self, x, value, track=True):
        """Fill `value` (N, C, PH, PW) with the window maxima; return where each
        is, as the kernel offset i*KW + j of the first maximum in scan order (for
        a whole-image window that is the flat index h*W + w), -1 for a window
        with nothing above -FLT_MAX: such a window keeps Caffe's initial -FLT_MAX
        and gets no gradient. Kept for backward in the smallest integer that
        holds KH*KW: a byte for kernels up to 11 x 11. Without `track` (no
        backward and no mask top to come) the general kernel and the 3 x 3
        kernels find the maxima alone and return None; the whole-image and
        2 x 2 kernels find both, at little cost."""
        function, planes, settings, outputs, winner = self._max_call(x, value, track)
        self._run(function, planes, settings, outputs)
        return winner

    def _max_call(self, x, value, track):
        """_max's kernel for these arrays: (function, planes, settings,
        outputs, the winners or None), as _run takes them."""
        n, c = x.shape[:2]
        area = self.kernel[0] * self.kernel[1]
        offset_type = np.int8 if area <= 127 else np.int16 if area <= 32767 else np.int32
        winner = self.scratch("winner", value.shape, offset_type)
        if self.whole_image:
            return (kernels.max_whole, [_planes(x)], [],
                    [_planes(value, True).reshape(n * c), _planes(winner, True).reshape(n * c)], winner)
        if self._tiles_2x2(x):
            return kernels.max_forward_2x2, [_planes(x)], [], [_planes(value, True), _planes(winner, True)], winner
        if not track and self._same_3x3(x):
            return kernels.max_3x3_same, [_planes(x)], [], [_planes(value, True)], None
        if not track and self._stride2_3x3(x):
            return kernels.max_3x3_stride2, [_planes(x)], [], [_planes(value, True)], None
        return (kernels.max_forward, [_planes(x)], [*self.kernel, *self.stride, *self.pad, kernels.BLOCK_CELLS, track],
                [_planes(value, True), _planes(winner, True)], winner if track else None)

    def _same_3x3(self, x):
        """Whether the windows are 3 x 3 at stride 1 with padding 1, each output
        cell on its input cell (kernels.max_3x3_same): the inception units' pooling."""
        return (self.kernel == (3, 3) and self.stride == (1, 1) and self.pad == (1, 1)
                and self.out_hw == x.shape[2:] and x.dtype.kind == "f")

    def _stride2_3x3(self, x):
        """Whether the windows are 3 x 3 at stride 2 without padding
        (kernels.max_3x3_stride2): every window starts inside the plane, the last ones
        clipped (ceil rounding)."""
        return (self.kernel == (3, 3) and self.stride == (2, 2) and self.pad == (0, 0)
                and all(0 < 2 * out - 1 <= size for out, size in zip(self.out_hw, x.shape[2:])) and x.dtype.kind == "f")

    def _tiles_2x2(self, x):
        """Whether the windows are 2 x 2 at stride 2 without padding on planes
        of even height and width: they tile x exactly (kernels.max_forward_2x2)."""
        return (self.kernel == (2, 2) and self.stride == (2, 2) and self.pad == (0, 0)
                and x.shape[2] % 2 == 0 and x.shape[3] % 2 == 0 and x.dtype.kind == "f")

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
        n, c = x.shape[:2]
        if self.whole_image:
            self._run(kernels.ave_whole, [_planes(x)], [x.dtype.type(self.pool_size[0, 0])],
                      [_planes(out, True).reshape(n * c)])
        else:
            self._run(kernels.ave_forward, [_planes(x)], [*self.kernel, *self.stride, *self.pad, kernels.BLOCK_CELLS,
                                                          self.pool_size.astype(x.dtype)], [_planes(out, True)])
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
        if not top[0].count:                   # nothing pooled: no input gets a gradient
            bottom[0].diff[...] = 0
            return
        dy = top[0].diff
        if self.pool == MAX and len(top) > 1:
            # Caffe routes by the mask top when there is one.
            bottom[0].diff[...] = self._route(dy, top[1].data.astype(np.int64), bottom[0].shape)
        elif self.pool == MAX:
            self._check_winner(dy)
            self._run(*self._backward_call(dy, bottom[0]))
        elif self.pool == AVE and not self.whole_image:
            self._run(*self._backward_call(dy, bottom[0]))
        elif self.pool == AVE:                 # one window, the whole image: each cell gets its share
            bottom[0].diff[...] = dy / self.pool_size.astype(dy.dtype)
        else:
            bottom[0].diff[...] = self._spread_to_sample(dy, bottom[0].shape)

    def _check_winner(self, dy):
        if self.winner.shape != dy.shape:
            raise self.shape_error(f"backward needs a forward at the current shape: the kept maxima "
                                   f"are for {self.winner.shape}, the top is {dy.shape}")

    def _backward_call(self, dy, bottom):
        """The MAX (no mask top) or windowed AVE backward's kernel for these
        arrays: (function, planes, settings, outputs), as _run takes them."""
        dx = [_planes(bottom.diff, True)]
        if self.pool == AVE:
            return (kernels.ave_backward, [_planes(dy)], [*self.kernel, *self.stride, *self.pad, kernels.BLOCK_CELLS,
                                                          self.pool_size.astype(dy.dtype)], dx)
        if self._tiles_2x2(bottom.data):
            return kernels.max_backward_2x2, [_planes(dy), _planes(self.winner)], [], dx
        # a whole-image window's winner is the flat index h*W + w: decode it by the image width
        width = self.in_hw[1] if self.whole_image else self.kernel[1]
        return kernels.max_backward, [_planes(dy), _planes(self.winner)], [width, *self.stride, *self.pad], dx

    def bind_backward(self, top, propagate_down, bottom):
        """A MAX (no mask top) or windowed AVE backward as one kernel call on
        the arrays the plan's layout holds (bind_forward's terms); the maxima
        are the ones the forward keeps (bind_forward's `winner`)."""
        dy = top[0].diff
        if (not propagate_down[0] or len(top) > 1 or not dy.size or self.pool not in (MAX, AVE)
                or (self.pool == AVE and self.whole_image) or not self._serial([dy, bottom[0].diff])
                or (self.pool == MAX and getattr(self, "winner", None) is None)):
            return super().bind_backward(top, propagate_down, bottom)
        if self.pool == MAX:
            self._check_winner(dy)
        function, planes, settings, outputs = self._backward_call(dy, bottom[0])
        arguments = [*planes, *settings, *outputs]
        return lambda: function(*arguments)

    @staticmethod
    def _route(dy, mask, shape):
        """Sum each output's gradient into the input cell its mask names (-1: nowhere)."""
        n, c, h, w = shape
        planes = np.arange(n * c).reshape(n, c, 1, 1) * (h * w)
        valid = mask >= 0
        target = (planes + mask)[valid]
        summed = np.bincount(target, weights=dy[valid], minlength=n * c * h * w)
        return summed.reshape(shape)

    def _spread_to_sample(self, dy, shape):
        n, c, h, w = shape
        dxp = np.zeros((n, c, max(self.padded_hw[0], h), max(self.padded_hw[1], w)), dy.dtype)
        for k, (_, _, window) in enumerate(self._offsets()):
            dxp[window] += np.where(self.sample_offset == k, dy, 0)
        return dxp[:, :, :h, :w]

    # --- on a device: Caffe's MaxPool/AvePool kernels (cct.devices) --------------------
    def runs_on(self, device, bottom, top):
        """MAX (with or without the mask top) and AVE, global pooling included;
        STOCHASTIC runs on the host (it draws from the host's random stream).
        The mask is a float: exact for planes below 2^24 pixels."""
        h, w = bottom[0].shape[2:]
        return self.all_float32(bottom, top) and self.pool in (MAX, AVE) and h * w < (1 << 24)

    def _device_geometry(self, bottom):
        """(shape, pooled, kernel, stride, pad) as the device's pooling ops take them."""
        return bottom[0].shape, self.out_hw, self.kernel, self.stride, self.pad

    def forward_on(self, device, bottom, top):
        if not top[0].count:                   # an empty batch or output: nothing to pool
            return
        # the tops written whole: nothing stale copied up
        x, y = bottom[0].device_data(device), top[0].mutable_device_data(device, upload=False)
        if self.pool == AVE:
            device.ave_pool_forward(x, y, *self._device_geometry(bottom))
            return
        # the mask goes to the mask top when there is one (backward reads it there, as
        # Caffe's), else to a buffer this layer keeps for backward
        mask = (top[1].mutable_device_data(device, upload=False) if len(top) > 1
                else self.device_scratch(device, "max_mask", top[0].count))
        device.max_pool_forward(x, y, mask, *self._device_geometry(bottom))
        self._device_mask_shape = top[0].shape

    def backward_on(self, device, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dx = bottom[0].mutable_device_diff(device, upload=False)          # written whole
        if not top[0].count:                   # nothing pooled: no input gets a gradient
            device.fill(dx, 0.0, bottom[0].count)
            return
        dy = top[0].device_diff(device)
        if self.pool == AVE:
            device.ave_pool_backward(dy, dx, *self._device_geometry(bottom))
            return
        if len(top) > 1:
            mask = top[1].device_data(device)
        else:
            if getattr(self, "_device_mask_shape", None) != top[0].shape:
                raise self.shape_error(f"backward needs a forward on the device at the current shape: the "
                                       f"kept maxima are for {getattr(self, '_device_mask_shape', None)}, "
                                       f"the top is {top[0].shape}")
            mask = self.device_scratch(device, "max_mask", top[0].count)
        device.max_pool_backward(dy, mask, dx, *self._device_geometry(bottom))


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
            top[0].data.reshape(n, top[0].count_range(1))[:, start:start + width] = outputs[0].data.reshape(n, width)
            start += width

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        n = bottom[0].shape[0]
        total = None
        start = 0
        for pooling, outputs in self.levels:
            width = outputs[0].count_range(1)
            outputs[0].diff.reshape(n, width)[...] = top[0].diff.reshape(n, top[0].count_range(1))[:, start:start + width]
            start += width
            pooling.backward(outputs, [True], bottom)
            total = bottom[0].diff.copy() if total is None else total + bottom[0].diff
        bottom[0].diff[...] = total
