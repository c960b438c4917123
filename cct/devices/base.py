"""The device interface: the short list of primitives a layer's device path
is written against once, and that the numpy CPU device (cct.devices.cpu,
the reference every kernel is tested against) and the OpenCL device
(cct.devices.opencl) implement.

Buffers are flat float32 arrays of a device (numpy arrays on the CPU,
pyopencl arrays on OpenCL), addressed by element offsets: a blob's data and
diff each have one (cct.core.blob mirrors them, Caffe's SyncedMemory).
Shapes are passed as ints; a convolution's as its cct.lowering.ConvGeometry
(read for its fields, nothing imported). Every op is asynchronous on a device
with a queue; download() and finish() wait.

The primitives, by kind:
    memory       empty, upload, download, copy, fill, scratch, finish
    GEMM         gemm (row-major, as numpy's matmul on the flat buffers),
                 gemm_batched (many at once: groups, split-K slices)
    elementwise  axpby, relu_forward, relu_backward, clip_forward, clip_backward
    reductions   sum_axis (over the middle axis of an (outer, axis, inner) view)
    training     solver_step (one parameter's update, the six solver rules),
                 sum_of_squares (clip_gradients' norm, one scalar read)
    lowering     im2col, col2im (lowering type 1 over the whole batch) and the
                 transposes between (N, C, P) and channels-first (C, N*P)
                 that lower a gradient and lift a product; depthwise
                 convolution computed directly, forward and both gradients
    layers       the kernels hot nets need, each documented with its op:
                 max and average pooling, LRN, BatchNorm's channel statistics
                 and normalization, softmax and its loss (reduced there), Eltwise's max and
                 products, Scale/Bias's broadcast, Dropout's mask, strided block copies
                 (Concat, Slice); the forks' strided copies (Permute, Reorg,
                 Upsample), Normalize's division and gradient, Interp's
                 bilinear resize and unpooling, ROI max and position-
                 sensitive average pooling, SSD's box decoding
"""
import threading
from typing import Any, Optional, Protocol, Sequence, Tuple

from cct.core.arrays import Array

# A device's flat float32 buffer: a numpy array on the CPU, a pyopencl array on
# OpenCL (an optional dependency, so no name of it here).
Buffer = Any


class ConvShape(Protocol):
    """What a device reads of a convolution's shape: the fields of a
    cct.lowering.ConvGeometry (which devices, below lowering, do not import)."""
    @property
    def channels(self) -> int: ...
    @property
    def num_output(self) -> int: ...
    @property
    def in_h(self) -> int: ...
    @property
    def in_w(self) -> int: ...
    @property
    def kernel_h(self) -> int: ...
    @property
    def kernel_w(self) -> int: ...
    @property
    def stride_h(self) -> int: ...
    @property
    def stride_w(self) -> int: ...
    @property
    def pad_h(self) -> int: ...
    @property
    def pad_w(self) -> int: ...
    @property
    def dilation_h(self) -> int: ...
    @property
    def dilation_w(self) -> int: ...
    @property
    def group(self) -> int: ...
    @property
    def extent_h(self) -> int: ...
    @property
    def extent_w(self) -> int: ...
    @property
    def out_h(self) -> int: ...
    @property
    def out_w(self) -> int: ...


class Traffic:
    """Bytes and calls of a device's transfers each way since reset()
    (`cct time --gpu` prints them per iteration)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()     # a prefetch thread uploads beside the main one
        self.reset()

    def reset(self) -> None:
        self.bytes = {"up": 0, "down": 0}
        self.calls = {"up": 0, "down": 0}

    def count(self, way: str, nbytes: int) -> None:
        with self._lock:
            self.bytes[way] += nbytes
            self.calls[way] += 1


class DeviceError(RuntimeError):
    """A device that cannot be used, a kernel that does not build (its log
    attached), or an op asked for what the device cannot do."""


class Device:
    kind: Optional[str] = None    # "cpu", "opencl"
    name: Optional[str] = None    # what device_query and cct time print
    # True: the device's buffers are host memory (a blob needs no copy)
    shares_host: bool = False
    moved: Optional[Traffic] = None     # what upload and download moved (a device with a host side)
    # What sizes the work (cct.lowering.device): processors running work-groups
    # at once (OpenCL's max compute units), global memory and the largest one
    # buffer in bytes (None: the host's memory, no device of its own)
    compute_units: int = 1
    memory_bytes: Optional[int] = None
    max_alloc_bytes: Optional[int] = None

    # --- memory ------------------------------------------------------------------
    def empty(self, count: int) -> Buffer:
        """A flat buffer of `count` float32 elements (contents undefined)."""
        raise NotImplementedError

    def upload(self, buffer: Buffer, host: Array, offset: int = 0) -> None:
        """buffer[offset:offset + host.size] = host (a contiguous numpy array),
        queued: `host` may change as soon as this returns."""
        raise NotImplementedError

    def upload_aside(self, buffer: Buffer, host: Array) -> None:
        """buffer[:host.size] = host on a queue of its own, waited for here: a
        prefetch thread copies the next batch up while the compute queue runs
        (Caffe's async_gpu_push). `buffer` must be one no queued op uses."""
        self.upload(buffer, host)

    def download(self, buffer: Buffer, host: Array, offset: int = 0) -> None:
        """host[...] = buffer[offset:offset + host.size]; waits for it."""
        raise NotImplementedError

    def copy(self, dst: Buffer, src: Buffer, count: int, dst_offset: int = 0, src_offset: int = 0) -> None:
        raise NotImplementedError

    def fill(self, buffer: Buffer, value: float, count: int, offset: int = 0) -> None:
        raise NotImplementedError

    def scratch(self, slot: str, count: int) -> Buffer:
        """A work buffer of at least `count` elements kept per slot name and
        reused by every call (grown when too small): a layer's temporaries
        live only inside one op sequence on the device's one queue."""
        buffers = self.__dict__.setdefault("_scratch", {})
        buffer = buffers.get(slot)
        if buffer is None or buffer.size < count:
            buffer = buffers[slot] = self.empty(max(int(count), 1))
        return buffer

    def ones(self, count: int) -> Buffer:
        """A buffer of at least `count` ones (a GEMM with it sums or broadcasts,
        as Caffe's bias_multiplier); kept, never to be written."""
        kept = self.__dict__.get("_ones")
        if kept is None or kept.size < count:
            kept = self.empty(max(int(count), 1))
            self.fill(kept, 1.0, kept.size)
            self._ones = kept
        return kept

    def finish(self) -> None:
        """Wait for every queued op."""

    # --- math ----------------------------------------------------------------------
    def gemm(self, trans_a: bool, trans_b: bool, m: int, n: int, k: int, alpha: float, a: Buffer, b: Buffer,
             beta: float, c: Buffer, a_offset: int = 0, b_offset: int = 0, c_offset: int = 0,
             a_ld: Optional[int] = None, b_ld: Optional[int] = None) -> None:
        """C (m, n) = alpha * op(A) @ op(B) + beta * C, row-major, op(A) (m, k),
        op(B) (k, n); A is stored (m, k) or, transposed, (k, m); B alike. a_ld
        and b_ld: the stored rows' lengths, when A or B is a block of columns
        of a wider matrix (default: packed, the stored matrix's own width)."""
        raise NotImplementedError

    def gemm_batched(self, trans_a: bool, trans_b: bool, m: int, n: int, k: int, alpha: float, a: Buffer,
                     b: Buffer, beta: float, c: Buffer, a_offsets: Sequence[int], b_offsets: Sequence[int],
                     c_offsets: Sequence[int], a_ld: Optional[int] = None, b_ld: Optional[int] = None) -> None:
        """gemm at every (a_offsets[i], b_offsets[i], c_offsets[i]), one call:
        the GEMMs of a convolution's groups, or of the slices of a split K.
        The products must not overlap in C. This one runs them one by one; a
        device with batched GEMMs runs them at once."""
        for a_offset, b_offset, c_offset in zip(a_offsets, b_offsets, c_offsets):
            self.gemm(trans_a, trans_b, m, n, k, alpha, a, b, beta, c, a_offset, b_offset, c_offset, a_ld, b_ld)

    def axpby(self, count: int, alpha: float, x: Buffer, beta: float, y: Buffer, x_offset: int = 0,
              y_offset: int = 0) -> None:
        """y = alpha * x + beta * y over `count` elements."""
        raise NotImplementedError

    def sum_axis(self, x: Buffer, outer: int, axis: int, inner: int, out: Buffer, beta: float = 0.0) -> None:
        """out (outer, inner) = sum of x (outer, axis, inner) over its middle
        axis, plus beta * out (beta 1 accumulates a gradient)."""
        raise NotImplementedError

    def relu_forward(self, x: Buffer, y: Buffer, count: int, slope: float = 0.0) -> None:
        """y = x > 0 ? x : slope * x (y may be x: in place)."""
        raise NotImplementedError

    def relu_backward(self, x: Buffer, dy: Buffer, dx: Buffer, count: int, slope: float = 0.0) -> None:
        """dx = dy * (x > 0 ? 1 : slope), x the forward's input (or output:
        the same sign, as Caffe's in-place ReLU relies on)."""
        raise NotImplementedError

    def clip_forward(self, x, y, count, low, high):
        """y = min(max(x, low), high) (y may be x: in place)."""
        raise NotImplementedError

    def clip_backward(self, x, dy, dx, count, low, high):
        """dx = dy where low < x < high, else 0: x the forward's input, or its
        output (strictly inside the bounds exactly where the input is)."""
        raise NotImplementedError

    # --- the solver's update (cct.training.updates; OpenCL kernels in kernels/update.cl) ---
    def solver_step(self, rule: str, count: int, data: Buffer, diff: Buffer, first: Buffer, second: Optional[Buffer],
                    clip: float, normalize: float, regularization: int, decay: float, rate: float,
                    coefficients: Sequence[float]) -> None:
        """One update of a parameter in place, the host solver's passes in
        their order and precision (each scalar its float32 cast): g = diff *
        clip * normalize, plus decay * data (regularization 1, L2) or decay *
        sign(data) (2, L1); the `rule`'s step (SGD, Nesterov, AdaGrad,
        RMSProp, AdaDelta, Adam) from g, `rate` and `coefficients` (per rule:
        kernels/update.cl), updating the histories `first` and `second`
        (AdaDelta's and Adam's); then diff = step and data -= step."""
        raise NotImplementedError

    def sum_of_squares(self, buffers: Sequence[Tuple[Buffer, int]]) -> float:
        """The sum of the squares of the first `count` elements of every
        (buffer, count), summed on the device and read as one scalar."""
        raise NotImplementedError

    # --- lowering type 1 ---------------------------------------------------------
    def im2col(self, x: Buffer, geom: ConvShape, batch: int, cols: Buffer, group: int = 0, first: int = 0) -> None:
        """Group `group` of images first, ..., first + N - 1 of x (., C, H, W)
        lowered to cols (C/g*KH*KW, N*OH*OW):
        cols[(c, i, j), (n, oh, ow)] = x padded at (n, c, oh*sh + i*dh - ph,
        ow*sw + j*dw - pw), 0 outside the image."""
        raise NotImplementedError

    def col2im(self, cols: Buffer, geom: ConvShape, batch: int, x: Buffer, group: int = 0, first: int = 0) -> None:
        """The adjoint of im2col: group `group` of images first, ... of x set
        to the sum, for each pixel, of the cols entries that read it."""
        raise NotImplementedError

    def to_channels_first(self, y: Buffer, batch: int, channels: int, pixels: int, out: Buffer, first: int = 0) -> None:
        """out (C, N*P) = images first, ..., first + N - 1 of y (., C, P)
        transposed: a gradient lowered for GEMM."""
        raise NotImplementedError

    def from_channels_first(self, product: Buffer, batch: int, channels: int, pixels: int, y: Buffer,
                            bias: Optional[Buffer] = None, first: int = 0) -> None:
        """Images first, ..., first + N - 1 of y (., C, P) = product (C, N*P)
        transposed, plus bias (C,) when given: a GEMM's product lifted."""
        raise NotImplementedError

    # --- depthwise convolution (cct.lowering.depthwise; kernels/depthwise.cl) ---
    # A geometry with group == channels == num_output: x (N, C, H, W), w (C, 1,
    # KH, KW), y (N, C, OH, OW); window cell (i, j) of output (oh, ow) reads
    # input (oh*SH - PH + i*DH, ow*SW - PW + j*DW), 0 outside the image.
    def depthwise_forward(self, x: Buffer, w: Buffer, geom: ConvShape, batch: int, y: Buffer,
                          bias: Optional[Buffer] = None) -> None:
        """y = the sum over each window's cells, in row-major order from 0, of
        w[c, i, j] * the cell (one outside the image multiplied as 0), plus
        bias[c] when given: cct.lowering.depthwise's order, bit for bit."""
        raise NotImplementedError

    def depthwise_backward_data(self, dy: Buffer, w: Buffer, geom: ConvShape, batch: int, dx: Buffer) -> None:
        """dx (N, C, H, W), set: for each pixel, the sum over the window cells
        (i, j) in row-major order from 0 of w[c, i, j] * dy at the output
        whose cell (i, j) the pixel is (0 where none is)."""
        raise NotImplementedError

    def depthwise_backward_weights(self, x: Buffer, dy: Buffer, geom: ConvShape, batch: int, dw: Buffer) -> None:
        """dw (C, 1, KH, KW) += the sum over the images and outputs of the
        window cell (i, j) of x times dy: per output row, then over the rows,
        then over the images (a sum in another order than the host's)."""
        raise NotImplementedError

    # --- pooling, LRN, BatchNorm (layers/pooling.py, layers/normalization.py) ---
    # (OpenCL kernels in kernels/pooling.cl and kernels/normalization.cl)
    # Pooling's geometry: shape (N, C, H, W) of the input, pooled (PH, PW) the
    # output's size (the layer's, Caffe's rounding and clipping applied),
    # kernel (KH, KW), stride (SH, SW), pad (pad_h, pad_w). Output (ph, pw) reads the
    # window of rows ph*SH - pad_h, ..., ph*SH - pad_h + KH - 1 (columns alike)
    # clipped to the image.
    def max_pool_forward(self, x: Buffer, y: Buffer, mask: Buffer, shape: Sequence[int], pooled: Sequence[int],
                         kernel: Sequence[int], stride: Sequence[int], pad: Sequence[int]) -> None:
        """y (N, C, PH, PW) = each window's maximum of x (N, C, H, W), mask
        (N, C, PH, PW) = its flat index h*W + w in its plane, as a float (exact
        below 2^24 pixels). Caffe's scan: start at -FLT_MAX, rows then columns,
        take a cell strictly greater (the first maximum wins; NaN and -inf
        never do); a window with no such cell keeps -FLT_MAX and mask -1."""
        raise NotImplementedError

    def max_pool_backward(self, dy: Buffer, mask: Buffer, dx: Buffer, shape: Sequence[int], pooled: Sequence[int],
                          kernel: Sequence[int], stride: Sequence[int], pad: Sequence[int]) -> None:
        """dx (N, C, H, W) = the sum of the dy (N, C, PH, PW) of the windows
        whose mask names the pixel (0 where none does), each pixel's terms
        added in output order. mask as max_pool_forward writes it (or a mask
        top: -1 routes nowhere)."""
        raise NotImplementedError

    def ave_pool_forward(self, x: Buffer, y: Buffer, shape: Sequence[int], pooled: Sequence[int], kernel: Sequence[int],
                         stride: Sequence[int], pad: Sequence[int]) -> None:
        """y (N, C, PH, PW) = each window's sum of x (N, C, H, W), from 0 in
        scan order, / Caffe's divisor: the window clipped to the padded image
        (rows ph*SH - pad_h to min(ph*SH - pad_h + KH, H + pad_h)), padding
        counted; columns alike."""
        raise NotImplementedError

    def ave_pool_backward(self, dy: Buffer, dx: Buffer, shape: Sequence[int], pooled: Sequence[int],
                          kernel: Sequence[int], stride: Sequence[int], pad: Sequence[int]) -> None:
        """dx (N, C, H, W) = for each pixel, the sum over the windows holding
        it of dy (N, C, PH, PW) / that window's divisor, in output order."""
        raise NotImplementedError

    # LRN: shape (N, C, H, W); the window of an element is `size` (odd)
    # channels centred on its channel (across) or the size x size box centred
    # on its pixel (within), zero beyond the edges.
    def lrn_scale(self, x: Buffer, scale: Buffer, shape: Sequence[int], size: int, alpha_over_size: float, k: float,
                  across: bool = True) -> None:
        """scale (N, C, H, W) = k + alpha_over_size * (window sum of x^2):
        Caffe's LRNFillScale (across: alpha/size, k; Caffe's WITHIN_CHANNEL
        is alpha/size^2 and k = 1). The terms of the sum are added centre
        first, then the nearer neighbours before the farther."""
        raise NotImplementedError

    def lrn_forward(self, x: Buffer, scale: Buffer, y: Buffer, count: int, beta: float) -> None:
        """y = x * scale^-beta over `count` elements (Caffe's
        LRNComputeOutput; y may be x). Beta 0.75 is taken as 1 / sqrt(s *
        sqrt(s)), as the host layer does (pow is most of the time otherwise)."""
        raise NotImplementedError

    def lrn_backward(self, x: Buffer, y: Buffer, scale: Buffer, dy: Buffer, dx: Buffer, shape: Sequence[int], size: int,
                     beta: float, factor: float, across: bool = True) -> None:
        """dx (N, C, H, W) = dy * scale^-beta - factor * x * (window sum of
        dy * y / scale), Caffe's LRNComputeDiff: factor = 2*alpha*beta/size
        (across), 2*alpha*beta/size^2 (within). x the forward's input, y its
        output, scale lrn_scale's. dx must not be dy (windows read neighbours)."""
        raise NotImplementedError

    # BatchNorm: x (N, C, S) viewed as batch, channels, spatial.
    def channel_sum(self, x: Buffer, batch: int, channels: int, spatial: int, out: Buffer, alpha: float = 1.0,
                    times: Optional[Buffer] = None) -> None:
        """out (C,) = alpha * the sum over n and s of x (N, C, S), of
        x * times (N, C, S) when given: a per-channel mean (alpha 1/(N*S)),
        or a mean of products or squares."""
        raise NotImplementedError

    def channel_normalize(self, x: Buffer, y: Buffer, batch: int, channels: int, spatial: int,
                          mean: Optional[Buffer] = None, std: Optional[Buffer] = None) -> None:
        """y (N, C, S) = (x - mean[c]) / std[c], mean and std (C,); either may
        be None (nothing subtracted, nothing divided). y may be x."""
        raise NotImplementedError

    def batch_norm_stats(self, mean: Buffer, variance: Buffer, std: Buffer, channels: int, eps: float,
                         factor: Optional[Buffer] = None) -> None:
        """std (C,) = sqrt(variance + eps). With factor (BatchNorm's third
        blob, (1,)), mean and variance hold its running sums and are first
        scaled in place by 1 / factor[0], or 0 when factor[0] is 0 (Caffe's
        global statistics)."""
        raise NotImplementedError

    def batch_norm_backward(self, dy: Buffer, y: Buffer, std: Buffer, mean_dy: Buffer, mean_dy_y: Buffer, dx: Buffer,
                            batch: int, channels: int, spatial: int) -> None:
        """dx (N, C, S) = (dy - mean_dy[c] - y * mean_dy_y[c]) / std[c], y the
        normalized forward output, mean_dy and mean_dy_y (C,) the channel
        means of dy and dy * y (BatchNorm's batch-statistics gradient). dx
        may be dy."""
        raise NotImplementedError

    # --- softmax, losses, Eltwise, Concat, Scale, Dropout (layers/loss.py, elementwise.py, shape.py) ---
    # (OpenCL kernels in kernels/layers.cl)
    def copy_blocks(self, src: Buffer, dst: Buffer, blocks: int, size: int, src_stride: int, dst_stride: int,
                    src_offset: int = 0, dst_offset: int = 0) -> None:
        """Copy `blocks` blocks of `size` elements: for b < blocks, e < size,
        dst[dst_offset + b * dst_stride + e] = src[src_offset + b * src_stride + e]
        (Concat and Slice move one bottom's (outer, width * inner) block of the
        top this way). src and dst must not overlap."""
        raise NotImplementedError

    def multiply(self, a: Buffer, b: Buffer, out: Buffer, count: int) -> None:
        """out = a * b over `count` elements (out may be a or b)."""
        raise NotImplementedError

    def dropout_mask(self, mask: Buffer, count: int, seed: int, keep: float, scale: float) -> None:
        """mask[i] = scale where u_i < keep, else 0, for i < count: u_i in [0, 1)
        the top 24 bits of lowbias32(lowbias32(seed) + i) / 2^24 (uint32
        arithmetic), a draw per element that depends on nothing but the seed
        (Dropout's TRAIN mask drawn on the device; not the host's draws)."""
        raise NotImplementedError

    def divide(self, a: Buffer, b: Buffer, out: Buffer, count: int) -> None:
        """out = a / b over `count` elements (out may be a or b)."""
        raise NotImplementedError

    def broadcast_affine(self, x: Buffer, outer: int, dim: int, inner: int, y: Buffer, scale: Optional[Buffer] = None,
                         bias: Optional[Buffer] = None) -> None:
        """y (outer, dim, inner) = x * scale[d] + bias[d], scale and bias (dim,)
        broadcast along the middle axis; either may be None (then 1 or 0). The
        product is rounded before the sum (no fused multiply-add). y may be x."""
        raise NotImplementedError

    def eltwise_max(self, a: Buffer, b: Buffer, out: Buffer, argmax: Buffer, count: int, index: int) -> None:
        """One step of Eltwise MAX over bottoms 0, ..., index: out = max(a, b)
        where a is the running max (bottom 0 when index is 1) and b bottom
        `index`; argmax (float) = index where b wins: b >= a when index is 1
        (bottom 1 beats bottom 0 on ties, as Caffe; argmax 0 elsewhere), b > a
        after (argmax kept elsewhere). out may be a."""
        raise NotImplementedError

    def keep_where_index(self, dy: Buffer, argmax: Buffer, index: int, dx: Buffer, count: int) -> None:
        """dx = dy * (argmax == index ? 1 : 0) over `count` elements: Eltwise
        MAX's gradient to bottom `index`. dx may be dy."""
        raise NotImplementedError

    def softmax_forward(self, x: Buffer, y: Buffer, outer: int, channels: int, inner: int) -> None:
        """y (outer, channels, inner) = softmax of x over its middle axis:
        exp(x - max) / sum of exp(x - max). y may be x."""
        raise NotImplementedError

    def softmax_backward(self, y: Buffer, dy: Buffer, dx: Buffer, outer: int, channels: int, inner: int) -> None:
        """dx (outer, channels, inner) = (dy - sum over the middle axis of
        dy * y) * y, y the softmax's output. dx may be dy."""
        raise NotImplementedError

    def softmax_loss_forward(self, prob: Buffer, labels: Buffer, out: Buffer, outer: int, channels: int, inner: int,
                             ignore_label: Optional[int] = None) -> None:
        """Per position of SoftmaxWithLoss: prob (outer, channels, inner), labels
        (outer * inner) integer-valued floats (truncated as Caffe's int cast);
        out holds 2 * outer * inner: out[k] = log(max(prob[o, label, s], FLT_MIN))
        and out[P + k] = 1 (P = outer * inner, k = o * inner + s); where the
        label is ignore_label out[k] = out[P + k] = 0; where it lies outside
        [0, channels) out[k] = the truncated label and out[P + k] = -1."""
        raise NotImplementedError

    def softmax_loss_reduce(self, values: Buffer, positions: int, loss: Buffer, stats: Buffer,
                            normalizer: Optional[float] = None) -> None:
        """SoftmaxWithLoss's loss from softmax_loss_forward's `values` (2 *
        positions), summed on the device in a fixed order (float64 where the
        device has it, as the host sums it): loss[0] = -(the sum over the
        positions flagged 1) / n, n = max(1, `normalizer`, or the count of those
        positions where it is None: VALID); stats[:3] = (n, the first position
        flagged -1 or -1, its label). A flagged label makes loss[0] NaN."""
        raise NotImplementedError

    def softmax_loss_backward(self, prob: Buffer, labels: Buffer, dx: Buffer, outer: int, channels: int, inner: int,
                              weight: Buffer, stats: Buffer, ignore_label: Optional[int] = None) -> None:
        """dx (outer, channels, inner) = (prob - [c == label]) * scale, 0 where
        the label is ignore_label; labels as in softmax_loss_forward, all valid;
        scale = weight[0] / stats[0] in float32 (the loss weight, the loss top's
        diff, over the normalizer softmax_loss_reduce left), read on the device."""
        raise NotImplementedError

    # --- the forks' layers (layers/ssd.py, segmentation.py, shape.py) ---------------
    # (OpenCL kernels in kernels/forks.cl)
    max_axes = 8                  # the most axes copy_strided takes

    def copy_strided(self, src: Buffer, dst: Buffer, shape: Sequence[int], src_strides: Sequence[int],
                     dst_strides: Optional[Sequence[int]] = None, src_offset: int = 0, dst_offset: int = 0,
                     accumulate: bool = False) -> None:
        """For every index (i_0, ..., i_k) of `shape` (at most max_axes axes):
        dst[dst_offset + sum i_j * dst_strides[j]] = src[src_offset + sum
        i_j * src_strides[j]], or += with accumulate. Strides count elements;
        dst_strides default to shape's contiguous ones. A source stride may be
        0 (a broadcast); the destination positions must be distinct, and
        must not overlap the source. Permute, Reorg and the nearest-neighbour
        Upsample are such copies of a numpy view's shape and strides."""
        raise NotImplementedError

    def divide_across(self, x: Buffer, divisor: Buffer, y: Buffer, outer: int, axis: int, inner: int) -> None:
        """y (outer, axis, inner) = x / divisor[o, i], divisor (outer, inner)
        broadcast along the middle axis (Normalize's division by the norm).
        y may be x."""
        raise NotImplementedError

    def l2_normalize_backward(self, x: Buffer, dy: Buffer, norm: Buffer, dot: Buffer, dx: Buffer, outer: int,
                              axis: int, inner: int) -> None:
        """dx (outer, axis, inner) = (dy - x * dot[o, i] / (n * n)) / n, n =
        norm[o, i], in that order (SSD's Normalize backward before its scale):
        norm and dot (outer, inner) the norms and the sums of x * dy over the
        middle axis. dx may be dy."""
        raise NotImplementedError

    # Interp: x (planes, in_h, in_w) resized to y (planes, out_h, out_w) from
    # a table per axis (float32, integers exact): for an axis of `size` input
    # positions and `out` outputs, entries [0, out) the input index each output
    # reads (a crop's start included), [out, 2 out) its step to the next (0 or
    # 1), [2 out, 3 out) lambda0, [3 out, 4 out) lambda1, then per input
    # position r, [4 out, 4 out + size) the first output reading r and
    # [4 out + size, 4 out + 2 size) one past the last (layers/segmentation.py
    # builds it: interp_device_table).
    def interp_forward(self, x: Buffer, y: Buffer, table_h: Buffer, table_w: Buffer, planes: int, in_h: int,
                       in_w: int, out_h: int, out_w: int) -> None:
        """y[p, h, w] = h0 * (w0 * x[p, i, j] + w1 * x[p, i, j + sj]) + h1 * (w0
        * x[p, i + si, j] + w1 * x[p, i + si, j + sj]), left to right, i, si,
        h0, h1 the height table's entries for h, j, sj, w0, w1 the width's for
        w (the forks' caffe_cpu_interp2)."""
        raise NotImplementedError

    def interp_backward(self, dy: Buffer, dx: Buffer, table_h: Buffer, table_w: Buffer, planes: int, in_h: int,
                        in_w: int, out_h: int, out_w: int) -> None:
        """dx (planes, in_h, in_w) = the adjoint of interp_forward applied to dy
        (planes, out_h, out_w): each input's terms added from 0 in output order,
        an output's four in the order (i, j), (i, j + sj), (i + si, j),
        (i + si, j + sj), each term (h weight * w weight) * dy (the forks'
        caffe_cpu_interp2_backward, serial); 0 where no output reads."""
        raise NotImplementedError

    # Unpooling: x and mask (planes, pixels), y (planes, out_pixels); each mask
    # value truncated to an int names a cell of its plane of y.
    def unpool_forward(self, x: Buffer, mask: Buffer, y: Buffer, planes: int, pixels: int, out_pixels: int) -> None:
        """y = 0, then y[p, mask[p, i]] = x[p, i] for i in order (a later value
        at the same cell wins: SegNet's Upsample). A cell outside [0,
        out_pixels) is skipped (the host layer refuses it)."""
        raise NotImplementedError

    def unpool_backward(self, dy: Buffer, mask: Buffer, dx: Buffer, planes: int, pixels: int,
                        out_pixels: int) -> None:
        """dx[p, i] = dy[p, mask[p, i]], 0 where the cell is outside [0, out_pixels)."""
        raise NotImplementedError

    # SSD's DetectionOutput (layers/ssd.py): its boxes decoded as the fork's
    # DecodeBBoxesGPU, its NMS on the host. code_type is PriorBoxParameter's:
    # 1 CORNER, 2 CENTER_SIZE, 3 CORNER_SIZE.
    def decode_boxes(self, loc: Buffer, priors: Buffer, boxes: Buffer, batch: int, num_priors: int,
                     loc_classes: int, code_type: int, variance_in_target: bool) -> None:
        """boxes (N, P, L, 4) = the predicted offsets loc (N, P, L, 4) decoded
        against the priors (2, P * 4: the boxes (xmin, ymin, xmax, ymax), then
        their variances), float32 in SSD's DecodeBBox order, no fused
        multiply-add: CORNER prior + var * loc; CORNER_SIZE prior + var * loc
        * (prior width or height); CENTER_SIZE centre var * loc * prior size
        + prior centre, size exp(var * loc) * prior size, corners centre -+
        size / 2. With variance_in_target var is left out (not taken as 1).
        exp rounded to the nearest float where the device has doubles
        (numpy's float32 exp, which the host layer calls, is 1 ulp off for
        about 4 arguments in 10)."""
        raise NotImplementedError

    # Pooling over regions of interest (layers/roi.py): features x (N, C, H, W),
    # shape (N, C, H, W); R ROIs, each cut in (PH, PW) bins whose bounds the
    # layer computes on the host as its fork does and hands over as `bins`
    # (float32, integers exact; layers/roi.py builds it: roi_device_bins):
    # entries [0, R) each ROI's image, then (R, PH) each bin's first row and
    # (R, PH) one past its last, then (R, PW) its first column and (R, PW) one
    # past its last, clipped to the map. A bin whose end is not past its start
    # is empty.
    def roi_max_pool_forward(self, x: Buffer, bins: Buffer, y: Buffer, argmax: Buffer, shape: Sequence[int],
                             rois: int, pooled: Sequence[int]) -> None:
        """y (R, C, PH, PW) = each bin's maximum over its ROI's image of x,
        argmax (R, C, PH, PW) its flat index h*W + w as a float: rows, then
        columns, from -FLT_MAX, a strictly greater value wins (the first
        maximum stays; NaN never wins). An empty bin gives 0 and -1; one with
        no value above -FLT_MAX, -FLT_MAX and -1 (Fast R-CNN's ROIPoolForward)."""
        raise NotImplementedError

    def roi_max_pool_backward(self, dy: Buffer, argmax: Buffer, bins: Buffer, feasible: Buffer, dx: Buffer,
                              shape: Sequence[int], rois: int, pooled: Sequence[int]) -> None:
        """dx (N, C, H, W) = for each pixel, the sum of dy (R, C, PH, PW) over
        the bins whose argmax is that pixel, among the bins `feasible` names
        for it: (R, H) whether the ROI's rows hold row h (0 or 1), (R, H) the
        first bin row that may hold it and (R, H) one past the last, then the
        same three (R, W) for columns (layers/roi.py: roi_feasible). Terms
        added from 0 in ROI order, then bin rows, then bin columns (Fast
        R-CNN's ROIPoolBackward)."""
        raise NotImplementedError

    def psroi_pool_forward(self, x: Buffer, bins: Buffer, y: Buffer, shape: Sequence[int], rois: int,
                           group: int) -> None:
        """y (R, D, G, G), D = C / G^2, bins (PH, PW) = (G, G): bin (ph, pw)
        of output channel d is the sum of channel (d*G + ph)*G + pw of its
        ROI's image of x over the bin, from 0 in scan order, divided by the
        bin's area (a float32 quotient rounded once); 0 for an empty bin
        (R-FCN's PSROIPoolingForward)."""
        raise NotImplementedError

    def psroi_pool_backward(self, dy: Buffer, bins: Buffer, dx: Buffer, shape: Sequence[int], rois: int,
                            group: int) -> None:
        """dx (N, C, H, W) = for each pixel of channel c = (d*G + ph)*G + pw,
        the sum over the ROIs of its image whose bin (ph, pw) holds it, in ROI
        order from 0, of dy[r, d, ph, pw] / the bin's area (each quotient a
        float32 rounded once: R-FCN's PSROIPoolingBackward, gathered)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
