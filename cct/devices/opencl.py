"""The OpenCL device: cct.devices.base's primitives on one OpenCL device,
with pyopencl (context, one in-order queue for the compute and the
transfers, a second for the prefetch threads' uploads, buffers) and
CLBlast's SGEMM (pyclblast). Kernels are the `.cl` files in
cct/devices/kernels/, built once per device and kept; a kernel that does
not build raises DeviceError with the compiler's log.

Buffers are flat pyopencl arrays of float32; ops address them by element
offsets (pyclblast ignores an array view's own offset, so views are never
handed to it). Scalars are passed to kernels as int32 and float32.

OpenCL is optional: `available()` says whether pyopencl and a platform with
a device exist, and `devices()` lists them in a fixed order (platform, then
device), which is what a device id (`cct.set_device(i)`, `--gpu i`) counts.
"""
import collections
import ctypes
import ctypes.util
import functools
import threading
from pathlib import Path

import numpy as np

from cct.devices.base import Device, DeviceError, Traffic

KERNELS = Path(__file__).with_name("kernels")
WORK_GROUP = 256              # items per work group, rounded up to: one size fits every kernel here
# The update's sqrt and division rounded as numpy's are: its numbers are the host's bit for bit
# (and the loss gradient's scale, a quotient of two floats)
BUILD_OPTIONS = {"update.cl": ["-cl-fp32-correctly-rounded-divide-sqrt"],
                 "loss.cl": ["-cl-fp32-correctly-rounded-divide-sqrt"]}
# An upload up to this size is queued from a copy (the queue runs on); a larger
# one, an input batch, waits for the queue instead of being copied on the host
# first: it comes where the queue has little left to do (a forward's start)
STAGED_BYTES = 4 << 20
SQUARE_PARTS = 4096           # partial sums of clip_gradients' squares: work items enough to fill a GPU


def _pyopencl():
    try:
        import pyopencl
    except ImportError:
        raise DeviceError("OpenCL needs pyopencl (pip install 'cct[opencl]')") from None
    return pyopencl


def platform_devices():
    """Every OpenCL device of every platform, in device-id order; [] where
    pyopencl or an OpenCL platform is missing."""
    try:
        pyopencl = _pyopencl()
        platforms = pyopencl.get_platforms()
    except Exception:
        return []
    found = []
    for platform in platforms:
        try:
            found.extend(platform.get_devices())
        except Exception:                      # a platform with no devices raises
            continue
    return found


def why_unavailable():
    """None when an OpenCL device exists, else the reason in a few words."""
    try:
        _pyopencl()
    except DeviceError as error:
        return str(error)
    if not platform_devices():
        return "no OpenCL platform with a device (install an ICD, e.g. pocl-opencl-icd)"
    return None


def available():
    return why_unavailable() is None


_opened = {}
_open_lock = threading.Lock()


def device(index=0):
    """The OpenCLDevice for device id `index`, made once per process."""
    with _open_lock:
        if index not in _opened:
            found = platform_devices()
            if not found:
                raise DeviceError(f"OpenCL device {index}: {why_unavailable()}")
            if not 0 <= index < len(found):
                raise DeviceError(f"OpenCL device {index}: there are {len(found)} device(s), ids 0 to "
                                  f"{len(found) - 1}")
            _opened[index] = OpenCLDevice(found[index], index)
        return _opened[index]


class OpenCLDevice(Device):
    kind = "opencl"

    def __init__(self, cl_device, index=0):
        pyopencl = _pyopencl()
        self._cl = pyopencl
        import pyopencl.array
        self._arrays = pyopencl.array
        self.cl_device = cl_device
        self.index = index
        self.name = cl_device.name.strip()
        self.context = pyopencl.Context([cl_device])
        self.queue = pyopencl.CommandQueue(self.context)
        self._programs = {}
        self._kernels = {}            # (file, kernel name) -> cl.Kernel, made once: each retrieval builds one
        self._lock = threading.RLock()
        self.moved = Traffic()
        self._pending = collections.deque()   # events of queued uploads, oldest first, until done (_hold)
        self._aside = None            # the prefetch threads' queue (upload_aside), made on first use
        self.compute_units = int(cl_device.max_compute_units)
        # A CPU device's global memory is the host's, shared with the net's
        # numpy arrays: it sizes its lowering as the host does (memory_bytes None)
        if not cl_device.type & pyopencl.device_type.CPU:
            self.memory_bytes = int(cl_device.global_mem_size)
            self.max_alloc_bytes = int(cl_device.max_mem_alloc_size)
        self._gemm_temp = None        # CLBlast's temporary buffer, kept and grown (_GemmWithTemp)

    # --- programs ----------------------------------------------------------------
    def program(self, filename):
        """The built program of kernels/`filename`, built on first use."""
        with self._lock:
            built = self._programs.get(filename)
            if built is None:
                source = (KERNELS / filename).read_text()
                built = self._programs[filename] = self.build(source, filename, BUILD_OPTIONS.get(filename, []))
            return built

    def build(self, source, name="<source>", options=()):
        try:
            return self._cl.Program(self.context, source).build(options=list(options))
        except self._cl.RuntimeError as error:             # its text carries the build log
            raise DeviceError(f"OpenCL kernel {name} does not build on {self.name}:\n{error}") from None

    def launch(self, filename, kernel, items, *args):
        """Run kernels/filename's `kernel` over `items` work items (rounded up
        to whole work groups; each kernel checks its index). Python ints go as
        int32, floats as float32, buffers as their cl.Buffer."""
        if items <= 0:
            return
        size = -(-int(items) // WORK_GROUP) * WORK_GROUP
        with self._lock:                        # a kernel's arguments are set, then it is queued
            function = self._kernels.get((filename, kernel))
            if function is None:
                function = self._kernels[filename, kernel] = self._cl.Kernel(self.program(filename), kernel)
            function(self.queue, (size,), (WORK_GROUP,), *[_argument(value) for value in args])

    # --- memory ------------------------------------------------------------------
    def empty(self, count):
        return self._arrays.empty(self.queue, (max(int(count), 1),), np.float32)

    def upload(self, buffer, host, offset=0):
        if not host.size:
            return
        self.moved.count("up", 4 * host.size)
        dst_offset = 4 * (buffer.offset // 4 + offset)
        if 4 * host.size > STAGED_BYTES:
            self._cl.enqueue_copy(self.queue, buffer.base_data, np.ascontiguousarray(host, np.float32),
                                  dst_offset=dst_offset, is_blocking=True)
            self._queue_drained()
            return
        # queued from a copy of its own, so the caller may write `host` at once
        # and the queue does not drain here (a blocking copy waits for it all)
        staged = np.array(host, np.float32, order="C", copy=True)
        self._hold(self._cl.enqueue_copy(self.queue, buffer.base_data, staged, dst_offset=dst_offset,
                                         is_blocking=False))

    def _hold(self, event):
        """Keep a queued upload's event (it holds the staged copy; dropped, it
        would wait for the copy) until the copy is done."""
        done = self._cl.command_execution_status.COMPLETE
        with self._lock:
            pending = self._pending
            while pending and pending[0].command_execution_status == done:
                pending.popleft()           # in order: the first not done, those after it are not either
            pending.append(event)

    def upload_aside(self, buffer, host):
        host = np.ascontiguousarray(host, np.float32)
        if host.size:
            self.moved.count("up", host.nbytes)
            self._cl.enqueue_copy(self._aside_queue(), buffer.base_data, host, dst_offset=4 * (buffer.offset // 4),
                                  is_blocking=True)

    def _aside_queue(self):
        with self._lock:
            if self._aside is None:
                self._aside = self._cl.CommandQueue(self.context)
            return self._aside

    def download(self, buffer, host, offset=0):
        if host.size:
            if not host.flags.c_contiguous or host.dtype != np.float32:
                raise DeviceError("download needs a contiguous float32 host array")
            self.moved.count("down", host.nbytes)
            self._cl.enqueue_copy(self.queue, host, buffer.base_data, src_offset=4 * (buffer.offset // 4 + offset),
                                  is_blocking=True)
            self._queue_drained()

    def _queue_drained(self):
        with self._lock:
            self._pending.clear()       # the queue is in order: every upload before is done

    def copy(self, dst, src, count, dst_offset=0, src_offset=0):
        if count:
            self._cl.enqueue_copy(self.queue, dst.base_data, src.base_data, byte_count=4 * count,
                                  dst_offset=dst.offset + 4 * dst_offset, src_offset=src.offset + 4 * src_offset)

    def fill(self, buffer, value, count, offset=0):
        if count:
            self._cl.enqueue_fill_buffer(self.queue, buffer.base_data, np.float32(value),
                                         buffer.offset + 4 * offset, 4 * count)

    def finish(self):
        self.queue.finish()
        self._queue_drained()

    # --- math ----------------------------------------------------------------------
    def gemm(self, trans_a, trans_b, m, n, k, alpha, a, b, beta, c, a_offset=0, b_offset=0, c_offset=0,
             a_ld=None, b_ld=None):
        if not (m and n):
            return
        if not k:                               # nothing summed: C = beta * C
            self.axpby(m * n, 0.0, c, beta, c, c_offset, c_offset)
            return
        a_ld, b_ld = _ld(a_ld, trans_a, m, k), _ld(b_ld, trans_b, k, n)
        with_temp = _gemm_with_temp()
        if with_temp is not None:
            with_temp(self, trans_a, trans_b, m, n, k, alpha, a, a_offset, a_ld, b, b_offset, b_ld, beta, c, c_offset)
            return
        _pyclblast().gemm(self.queue, m, n, k, _matrix(a), _matrix(b), _matrix(c), a_ld=a_ld, b_ld=b_ld, c_ld=n,
                          alpha=float(alpha), beta=float(beta), a_transp=bool(trans_a), b_transp=bool(trans_b),
                          a_offset=a_offset, b_offset=b_offset, c_offset=c_offset)

    def gemm_batched(self, trans_a, trans_b, m, n, k, alpha, a, b, beta, c, a_offsets, b_offsets, c_offsets,
                     a_ld=None, b_ld=None):
        """CLBlast's strided-batched GEMM where the offsets step evenly (a
        group's matrices, split-K's slices), its batched GEMM (offsets listed)
        where not; one GEMM alone as gemm."""
        count = len(c_offsets)
        if count == 1 or not (m and n and k):
            super().gemm_batched(trans_a, trans_b, m, n, k, alpha, a, b, beta, c, a_offsets, b_offsets, c_offsets,
                                 a_ld, b_ld)
            return
        a_ld, b_ld = _ld(a_ld, trans_a, m, k), _ld(b_ld, trans_b, k, n)
        shape = dict(a_ld=a_ld, b_ld=b_ld, c_ld=n, a_transp=bool(trans_a), b_transp=bool(trans_b))
        strides = [_stride(offsets) for offsets in (a_offsets, b_offsets, c_offsets)]
        pyclblast = _pyclblast()
        if None not in strides:
            pyclblast.gemmStridedBatched(self.queue, m, n, k, count, _matrix(a), _matrix(b), _matrix(c),
                                         a_stride=strides[0], b_stride=strides[1], c_stride=strides[2],
                                         alpha=float(alpha), beta=float(beta), a_offset=a_offsets[0],
                                         b_offset=b_offsets[0], c_offset=c_offsets[0], **shape)
        else:
            pyclblast.gemmBatched(self.queue, m, n, k, _matrix(a), _matrix(b), _matrix(c), [float(alpha)] * count,
                                  [float(beta)] * count, a_offsets=list(a_offsets), b_offsets=list(b_offsets),
                                  c_offsets=list(c_offsets), **shape)

    def axpby(self, count, alpha, x, beta, y, x_offset=0, y_offset=0):
        self.launch("core.cl", "axpby", count, count, float(alpha), x, x_offset, float(beta), y, y_offset)

    def sum_axis(self, x, outer, axis, inner, out, beta=0.0):
        self.launch("core.cl", "sum_axis", outer * inner, outer, axis, inner, x, out, float(beta))

    def relu_forward(self, x, y, count, slope=0.0):
        self.launch("core.cl", "relu_forward", count, count, x, y, float(slope))

    def relu_backward(self, x, dy, dx, count, slope=0.0):
        self.launch("core.cl", "relu_backward", count, count, x, dy, dx, float(slope))

    def clip_forward(self, x, y, count, low, high):
        self.launch("core.cl", "clip_forward", count, count, x, y, float(low), float(high))

    def clip_backward(self, x, dy, dx, count, low, high):
        self.launch("core.cl", "clip_backward", count, count, x, dy, dx, float(low), float(high))

    # --- the solver's update (cct.training.updates; kernels/update.cl) ---------------
    def solver_step(self, rule, count, data, diff, first, second, clip, normalize, regularization, decay, rate,
                    coefficients):
        coefficients = [float(c) for c in coefficients] + [0.0] * (5 - len(coefficients))
        self.launch("update.cl", f"update_{rule.lower()}", count, count, data, diff, first,
                    first if second is None else second, float(clip), float(normalize), int(regularization),
                    float(decay), float(rate), *coefficients)

    def sum_of_squares(self, buffers):
        partial = self.scratch("squares", SQUARE_PARTS)
        for index, (buffer, count) in enumerate(buffers):
            self.launch("update.cl", "sum_squares", SQUARE_PARTS, count, buffer, SQUARE_PARTS, partial, int(index > 0))
        if not buffers:
            return 0.0
        total = self.scratch("squares_total", 1)
        self.sum_axis(partial, 1, SQUARE_PARTS, 1, total)
        value = np.empty(1, np.float32)
        self.download(total, value)
        return float(value[0])

    # --- lowering type 1 ---------------------------------------------------------
    def _geometry_args(self, geom, batch, group):
        return (batch, geom.channels, geom.in_h, geom.in_w, geom.channels // geom.group, group,
                geom.kernel_h, geom.kernel_w, geom.pad_h, geom.pad_w, geom.stride_h, geom.stride_w,
                geom.dilation_h, geom.dilation_w, geom.out_h, geom.out_w)

    def im2col(self, x, geom, batch, cols, group=0, first=0):
        total = geom.channels // geom.group * geom.kernel_h * geom.kernel_w * batch * geom.out_h * geom.out_w
        self.launch("core.cl", "im2col", total, total, x, cols, first, *self._geometry_args(geom, batch, group))

    def col2im(self, cols, geom, batch, x, group=0, first=0):
        total = batch * geom.channels // geom.group * geom.in_h * geom.in_w
        self.launch("core.cl", "col2im", total, total, cols, x, first, *self._geometry_args(geom, batch, group))

    def to_channels_first(self, y, batch, channels, pixels, out, first=0):
        self.launch("core.cl", "to_channels_first", batch * channels * pixels, first, batch, channels, pixels,
                    y, out)

    def from_channels_first(self, product, batch, channels, pixels, y, bias=None, first=0):
        self.launch("core.cl", "from_channels_first", batch * channels * pixels, first, batch, channels, pixels,
                    product, y, product if bias is None else bias, int(bias is not None))

    # --- depthwise convolution ---------------------------------------------------
    @staticmethod
    def _depthwise_args(geom):
        """The kernels' DEPTHWISE_GEOMETRY (kernels/depthwise.cl)."""
        return (geom.channels, geom.in_h, geom.in_w, geom.kernel_h, geom.kernel_w, geom.stride_h, geom.stride_w,
                geom.pad_h, geom.pad_w, geom.dilation_h, geom.dilation_w, geom.out_h, geom.out_w)

    def depthwise_forward(self, x, w, geom, batch, y, bias=None):
        total = batch * geom.channels * geom.out_h * geom.out_w
        self.launch("depthwise.cl", "depthwise_forward", total, total, x, w, y, w if bias is None else bias,
                    int(bias is not None), *self._depthwise_args(geom))

    def depthwise_backward_data(self, dy, w, geom, batch, dx):
        total = batch * geom.channels * geom.in_h * geom.in_w
        self.launch("depthwise.cl", "depthwise_backward_data", total, total, dy, w, dx, *self._depthwise_args(geom))

    def depthwise_backward_weights(self, x, dy, geom, batch, dw):
        taps = geom.channels * geom.kernel_h * geom.kernel_w
        if not batch:
            return
        # per output row, then over the rows, then over the images
        rows = self.scratch("depthwise_rows", batch * taps * geom.out_h)       # (N, C*KH*KW, OH)
        per_image = self.scratch("depthwise_images", batch * taps)             # (N, C*KH*KW)
        items = batch * taps * geom.out_h
        self.launch("depthwise.cl", "depthwise_weight_rows", items, items, x, dy, rows, *self._depthwise_args(geom))
        self.sum_axis(rows, batch * taps, geom.out_h, 1, per_image)
        self.sum_axis(per_image, 1, batch, taps, dw, beta=1.0)


    # --- pooling, LRN, BatchNorm (layers/pooling.py, layers/normalization.py) ---
    @staticmethod
    def _pool_args(shape, pooled, kernel, stride, pad):
        """The kernels' POOL_GEOMETRY (kernels/pooling.cl)."""
        return (*shape, *pooled, *kernel, *stride, *pad)

    def max_pool_forward(self, x, y, mask, shape, pooled, kernel, stride, pad):
        outputs = shape[0] * shape[1] * pooled[0] * pooled[1]
        self.launch("pooling.cl", "max_pool_forward", outputs, x, y, mask,
                    *self._pool_args(shape, pooled, kernel, stride, pad))

    def max_pool_backward(self, dy, mask, dx, shape, pooled, kernel, stride, pad):
        inputs = shape[0] * shape[1] * shape[2] * shape[3]
        self.launch("pooling.cl", "max_pool_backward", inputs, dy, mask, dx,
                    *self._pool_args(shape, pooled, kernel, stride, pad))

    def ave_pool_forward(self, x, y, shape, pooled, kernel, stride, pad):
        outputs = shape[0] * shape[1] * pooled[0] * pooled[1]
        self.launch("pooling.cl", "ave_pool_forward", outputs, x, y,
                    *self._pool_args(shape, pooled, kernel, stride, pad))

    def ave_pool_backward(self, dy, dx, shape, pooled, kernel, stride, pad):
        inputs = shape[0] * shape[1] * shape[2] * shape[3]
        self.launch("pooling.cl", "ave_pool_backward", inputs, dy, dx,
                    *self._pool_args(shape, pooled, kernel, stride, pad))

    def lrn_scale(self, x, scale, shape, size, alpha_over_size, k, across=True):
        count = shape[0] * shape[1] * shape[2] * shape[3]
        self.launch("normalization.cl", "lrn_scale", count, count, x, scale, *shape[1:], size,
                    float(alpha_over_size), float(k), int(bool(across)))

    def lrn_forward(self, x, scale, y, count, beta):
        self.launch("normalization.cl", "lrn_forward", count, count, x, scale, y, float(beta))

    def lrn_backward(self, x, y, scale, dy, dx, shape, size, beta, factor, across=True):
        count = shape[0] * shape[1] * shape[2] * shape[3]
        self.launch("normalization.cl", "lrn_backward", count, count, x, y, scale, dy, dx, *shape[1:], size,
                    float(beta), float(factor), int(bool(across)))

    def channel_sum(self, x, batch, channels, spatial, out, alpha=1.0, times=None):
        # two stages: per (n, c) over s, then per c over n (a work item per sum)
        partial = self.scratch("channel_sum", batch * channels)
        self.launch("normalization.cl", "channel_sum_partial", batch * channels, batch * channels, spatial, x,
                    x if times is None else times, int(times is not None), partial)
        self.launch("normalization.cl", "channel_sum_total", channels, batch, channels, partial, out, float(alpha))

    def channel_normalize(self, x, y, batch, channels, spatial, mean=None, std=None):
        count = batch * channels * spatial
        self.launch("normalization.cl", "channel_normalize", count, count, channels, spatial, x, y,
                    x if mean is None else mean, int(mean is not None), x if std is None else std,
                    int(std is not None))

    def batch_norm_stats(self, mean, variance, std, channels, eps, factor=None):
        self.launch("normalization.cl", "batch_norm_stats", channels, channels, mean, variance, std, float(eps),
                    std if factor is None else factor, int(factor is not None))

    def batch_norm_backward(self, dy, y, std, mean_dy, mean_dy_y, dx, batch, channels, spatial):
        count = batch * channels * spatial
        self.launch("normalization.cl", "batch_norm_backward", count, count, channels, spatial, dy, y, std,
                    mean_dy, mean_dy_y, dx)

    # --- softmax, losses, Eltwise, Concat, Scale, Dropout (layers/loss.py, elementwise.py, shape.py) ---
    def copy_blocks(self, src, dst, blocks, size, src_stride, dst_stride, src_offset=0, dst_offset=0):
        if blocks == 1 or (size == src_stride and size == dst_stride):      # one contiguous run
            self.copy(dst, src, blocks * size, dst_offset, src_offset)
        else:
            self.launch("layers.cl", "copy_blocks", blocks * size, blocks * size, size, src, src_offset,
                        src_stride, dst, dst_offset, dst_stride)

    def multiply(self, a, b, out, count):
        self.launch("layers.cl", "multiply", count, count, a, b, out)

    def dropout_mask(self, mask, count, seed, keep, scale):
        self.launch("layers.cl", "dropout_mask", count, count, mask, int(seed), float(keep), float(scale))

    def divide(self, a, b, out, count):
        self.launch("layers.cl", "divide", count, count, a, b, out)

    def broadcast_affine(self, x, outer, dim, inner, y, scale=None, bias=None):
        count = outer * dim * inner
        self.launch("layers.cl", "broadcast_affine", count, count, dim, inner, x, y,
                    x if scale is None else scale, int(scale is not None),
                    x if bias is None else bias, int(bias is not None))

    def eltwise_max(self, a, b, out, argmax, count, index):
        self.launch("layers.cl", "eltwise_max", count, count, a, b, out, argmax, index)

    def keep_where_index(self, dy, argmax, index, dx, count):
        self.launch("layers.cl", "keep_where_index", count, count, dy, argmax, index, dx)

    def softmax_forward(self, x, y, outer, channels, inner):
        if channels:                            # no channels: nothing to normalize (and no max to read)
            self.launch("layers.cl", "softmax_forward", outer * inner, outer * inner, channels, inner, x, y)

    def softmax_backward(self, y, dy, dx, outer, channels, inner):
        self.launch("layers.cl", "softmax_backward", outer * inner, outer * inner, channels, inner, y, dy, dx)

    def softmax_loss_forward(self, prob, labels, out, outer, channels, inner, ignore_label=None):
        self.launch("loss.cl", "softmax_loss_forward", outer * inner, outer * inner, channels, inner,
                    prob, labels, out, int(ignore_label is not None), int(ignore_label or 0))

    def softmax_loss_reduce(self, values, positions, loss, stats, normalizer=None):
        self.launch("loss.cl", "softmax_loss_reduce", WORK_GROUP, positions, values, loss, stats,
                    int(normalizer is None), float(normalizer or 0))

    def softmax_loss_backward(self, prob, labels, dx, outer, channels, inner, weight, stats, ignore_label=None):
        count = outer * channels * inner
        self.launch("loss.cl", "softmax_loss_backward", count, count, channels, inner, prob, labels, dx,
                    weight, stats, int(ignore_label is not None), int(ignore_label or 0))

    # --- the forks' layers (layers/ssd.py, segmentation.py, shape.py) ---------------
    def copy_strided(self, src, dst, shape, src_strides, dst_strides=None, src_offset=0, dst_offset=0,
                     accumulate=False):
        axes = len(shape)
        if axes > self.max_axes:
            raise DeviceError(f"copy_strided takes at most {self.max_axes} axes, got shape {tuple(shape)}")
        if dst_strides is None:
            dst_strides = [int(np.prod(shape[k + 1:], dtype=np.int64)) for k in range(axes)]
        total = int(np.prod(shape, dtype=np.int64))
        self.launch("forks.cl", "copy_strided", total, total, axes, _int8(shape, 1), src, src_offset,
                    _int8(src_strides, 0), dst, dst_offset, _int8(dst_strides, 0), int(bool(accumulate)))

    def divide_across(self, x, divisor, y, outer, axis, inner):
        total = outer * axis * inner
        self.launch("forks.cl", "divide_across", total, total, axis, inner, x, divisor, y)

    def l2_normalize_backward(self, x, dy, norm, dot, dx, outer, axis, inner):
        total = outer * axis * inner
        self.launch("forks.cl", "l2_normalize_backward", total, total, axis, inner, x, dy, norm, dot, dx)

    def interp_forward(self, x, y, table_h, table_w, planes, in_h, in_w, out_h, out_w):
        total = planes * out_h * out_w
        self.launch("forks.cl", "interp_forward", total, total, x, y, in_h, in_w, out_h, out_w, table_h, table_w)

    def interp_backward(self, dy, dx, table_h, table_w, planes, in_h, in_w, out_h, out_w):
        total = planes * in_h * in_w
        self.launch("forks.cl", "interp_backward", total, total, dy, dx, in_h, in_w, out_h, out_w, table_h,
                    table_w)

    def unpool_forward(self, x, mask, y, planes, pixels, out_pixels):
        self.fill(y, 0.0, planes * out_pixels)
        self.launch("forks.cl", "unpool_forward", planes, planes, x, mask, y, pixels, out_pixels)

    def unpool_backward(self, dy, mask, dx, planes, pixels, out_pixels):
        total = planes * pixels
        self.launch("forks.cl", "unpool_backward", total, total, dy, mask, dx, pixels, out_pixels)

    def decode_boxes(self, loc, priors, boxes, batch, num_priors, loc_classes, code_type, variance_in_target):
        total = batch * num_priors * loc_classes
        self.launch("forks.cl", "decode_boxes", total, total, loc, priors, boxes, num_priors, loc_classes,
                    int(code_type), int(bool(variance_in_target)))

    def roi_max_pool_forward(self, x, bins, y, argmax, shape, rois, pooled):
        total = rois * shape[1] * pooled[0] * pooled[1]
        self.launch("forks.cl", "roi_max_pool_forward", total, total, x, bins, y, argmax, *shape[1:], rois, *pooled)

    def roi_max_pool_backward(self, dy, argmax, bins, feasible, dx, shape, rois, pooled):
        total = shape[0] * shape[1] * shape[2] * shape[3]
        self.launch("forks.cl", "roi_max_pool_backward", total, total, dy, argmax, bins, feasible, dx, *shape[1:],
                    rois, *pooled)

    def psroi_pool_forward(self, x, bins, y, shape, rois, group):
        total = rois * shape[1]
        self.launch("forks.cl", "psroi_pool_forward", total, total, x, bins, y, *shape[1:], rois, group)

    def psroi_pool_backward(self, dy, bins, dx, shape, rois, group):
        total = shape[0] * shape[1] * shape[2] * shape[3]
        self.launch("forks.cl", "psroi_pool_backward", total, total, dy, bins, dx, *shape[1:], rois, group)


def _int8(values, pad):
    """An OpenCL int8 of up to 8 ints, the rest `pad`."""
    from pyopencl import cltypes
    values = [int(v) for v in values]
    return cltypes.make_int8(*(values + [pad] * (8 - len(values))))


def _argument(value):
    if isinstance(value, (bool, int, np.integer)):
        return np.int32(value)
    if isinstance(value, (float, np.floating)):
        return np.float32(value)
    return value.base_data if hasattr(value, "base_data") else value


def _ld(ld, transposed, rows, columns):
    """A stored operand's row length: given, or packed ((rows, columns) as
    op() reads it, stored transposed when `transposed`)."""
    return ld if ld is not None else (rows if transposed else columns)


def _stride(offsets):
    """The step between consecutive offsets when it is one step (>= 0), else None."""
    steps = {second - first for first, second in zip(offsets, offsets[1:])}
    return steps.pop() if len(steps) == 1 and min(steps) >= 0 else None


def _matrix(buffer):
    """The flat buffer as the 2-d array pyclblast checks for (offsets are passed apart)."""
    return buffer.reshape(1, buffer.size)


@functools.lru_cache(maxsize=None)
def _pyclblast():
    try:
        import pyclblast
    except ImportError:
        raise DeviceError("the OpenCL device's GEMM needs pyclblast (pip install pyclblast; it builds "
                          "against CLBlast: apt-get install libclblast-dev)") from None
    return pyclblast


class _GemmWithTemp:
    """CLBlast's SGEMM handed a temporary buffer of the device's own, through
    its C API (CLBlastSgemmWithTempBuffer, by ctypes): pyclblast 1.4's gemm
    takes none, so CLBlast's indirect GEMM, which pads and transposes its
    operands into a temporary buffer, made and freed one on every call. The
    buffer is kept on the device and grown to the largest a GEMM has asked
    for (CLBlastSGemmTempBufferSize, asked once per shape)."""
    ROW_MAJOR, NOT_TRANSPOSED, TRANSPOSED = 101, 111, 112

    def __init__(self, library):
        size_t, handle = ctypes.c_size_t, ctypes.c_void_p
        self.gemm = library.CLBlastSgemmWithTempBuffer
        self.gemm.argtypes = ([ctypes.c_int] * 3 + [size_t] * 3 + [ctypes.c_float, handle, size_t, size_t,
                              handle, size_t, size_t, ctypes.c_float, handle, size_t, size_t,
                              ctypes.POINTER(handle), ctypes.POINTER(handle), handle])
        self.size = library.CLBlastSGemmTempBufferSize
        self.size.argtypes = [ctypes.c_int] * 3 + [size_t] * 9 + [ctypes.POINTER(handle), ctypes.POINTER(size_t)]
        self.gemm.restype = self.size.restype = ctypes.c_int
        self.sizes = {}               # (device, operands' shapes and offsets) -> bytes

    def __call__(self, device, trans_a, trans_b, m, n, k, alpha, a, a_offset, a_ld, b, b_offset, b_ld, beta, c,
                 c_offset):
        flags = (self.ROW_MAJOR, self.TRANSPOSED if trans_a else self.NOT_TRANSPOSED,
                 self.TRANSPOSED if trans_b else self.NOT_TRANSPOSED)
        shape = (m, n, k)
        placement = (a_offset, a_ld, b_offset, b_ld, c_offset, n)
        with device._lock:
            queue = ctypes.c_void_p(device.queue.int_ptr)
            key = (device.index, flags, shape, placement)
            needed = self.sizes.get(key)
            if needed is None:
                size = ctypes.c_size_t(0)
                self._check(self.size(*flags, *shape, *placement, ctypes.byref(queue), ctypes.byref(size)))
                needed = self.sizes[key] = size.value
            temp = device._gemm_temp
            if needed and (temp is None or temp.size < needed):
                temp = device._gemm_temp = device._cl.Buffer(device.context, device._cl.mem_flags.READ_WRITE,
                                                             needed)
            self._check(self.gemm(*flags, *shape, float(alpha), a.base_data.int_ptr, a_offset, a_ld,
                                  b.base_data.int_ptr, b_offset, b_ld, float(beta), c.base_data.int_ptr, c_offset, n,
                                  ctypes.byref(queue), None, temp.int_ptr if needed else None))

    @staticmethod
    def _check(status):
        if status:
            raise DeviceError(f"CLBlast's SGEMM failed: status {status} (clblast_c.h's CLBlastStatusCode)")


@functools.lru_cache(maxsize=None)
def _gemm_with_temp():
    """_GemmWithTemp on the CLBlast library pyclblast loaded (read from the
    process's mappings: a wheel bundles its own copy), or None where that
    library or its temporary-buffer GEMM cannot be found: pyclblast's gemm then."""
    _pyclblast()
    path = None
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "libclblast" in line.split()[-1]), None)
    except OSError:
        pass
    try:
        return _GemmWithTemp(ctypes.CDLL(path or ctypes.util.find_library("clblast") or "libclblast.so.1"))
    except (OSError, AttributeError):
        return None
