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
    GEMM         gemm (row-major, as numpy's matmul on the flat buffers)
    elementwise  axpby, relu_forward, relu_backward
    reductions   sum_axis (over the middle axis of an (outer, axis, inner) view)
    lowering     im2col, col2im (lowering type 1 over the whole batch) and the
                 transposes between (N, C, P) and channels-first (C, N*P)
                 that lower a gradient and lift a product
    layers       the kernels hot nets need (pooling, LRN, softmax), each
                 documented with its op
"""


class DeviceError(RuntimeError):
    """A device that cannot be used, a kernel that does not build (its log
    attached), or an op asked for what the device cannot do."""


class Device:
    kind = None               # "cpu", "opencl"
    name = None               # what device_query and cct time print
    # True: the device's buffers are host memory (a blob needs no copy)
    shares_host = False

    # --- memory ------------------------------------------------------------------
    def empty(self, count):
        """A flat buffer of `count` float32 elements (contents undefined)."""
        raise NotImplementedError

    def upload(self, buffer, host, offset=0):
        """buffer[offset:offset + host.size] = host (a contiguous numpy array)."""
        raise NotImplementedError

    def download(self, buffer, host, offset=0):
        """host[...] = buffer[offset:offset + host.size]; waits for it."""
        raise NotImplementedError

    def copy(self, dst, src, count, dst_offset=0, src_offset=0):
        raise NotImplementedError

    def fill(self, buffer, value, count, offset=0):
        raise NotImplementedError

    def scratch(self, slot, count):
        """A work buffer of at least `count` elements kept per slot name and
        reused by every call (grown when too small): a layer's temporaries
        live only inside one op sequence on the device's one queue."""
        buffers = self.__dict__.setdefault("_scratch", {})
        buffer = buffers.get(slot)
        if buffer is None or buffer.size < count:
            buffer = buffers[slot] = self.empty(max(int(count), 1))
        return buffer

    def ones(self, count):
        """A buffer of at least `count` ones (a GEMM with it sums or broadcasts,
        as Caffe's bias_multiplier); kept, never to be written."""
        kept = self.__dict__.get("_ones")
        if kept is None or kept.size < count:
            kept = self.empty(max(int(count), 1))
            self.fill(kept, 1.0, kept.size)
            self._ones = kept
        return kept

    def finish(self):
        """Wait for every queued op."""

    # --- math ----------------------------------------------------------------------
    def gemm(self, trans_a, trans_b, m, n, k, alpha, a, b, beta, c, a_offset=0, b_offset=0, c_offset=0):
        """C (m, n) = alpha * op(A) @ op(B) + beta * C, row-major, op(A) (m, k),
        op(B) (k, n); A is stored (m, k) or, transposed, (k, m); B alike."""
        raise NotImplementedError

    def axpby(self, count, alpha, x, beta, y, x_offset=0, y_offset=0):
        """y = alpha * x + beta * y over `count` elements."""
        raise NotImplementedError

    def sum_axis(self, x, outer, axis, inner, out, beta=0.0):
        """out (outer, inner) = sum of x (outer, axis, inner) over its middle
        axis, plus beta * out (beta 1 accumulates a gradient)."""
        raise NotImplementedError

    def relu_forward(self, x, y, count, slope=0.0):
        """y = x > 0 ? x : slope * x (y may be x: in place)."""
        raise NotImplementedError

    def relu_backward(self, x, dy, dx, count, slope=0.0):
        """dx = dy * (x > 0 ? 1 : slope), x the forward's input (or output:
        the same sign, as Caffe's in-place ReLU relies on)."""
        raise NotImplementedError

    # --- lowering type 1 ---------------------------------------------------------
    def im2col(self, x, geom, batch, cols, group=0, first=0):
        """Group `group` of images first, ..., first + N - 1 of x (., C, H, W)
        lowered to cols (C/g*KH*KW, N*OH*OW):
        cols[(c, i, j), (n, oh, ow)] = x padded at (n, c, oh*sh + i*dh - ph,
        ow*sw + j*dw - pw), 0 outside the image."""
        raise NotImplementedError

    def col2im(self, cols, geom, batch, x, group=0, first=0):
        """The adjoint of im2col: group `group` of images first, ... of x set
        to the sum, for each pixel, of the cols entries that read it."""
        raise NotImplementedError

    def to_channels_first(self, y, batch, channels, pixels, out, first=0):
        """out (C, N*P) = images first, ..., first + N - 1 of y (., C, P)
        transposed: a gradient lowered for GEMM."""
        raise NotImplementedError

    def from_channels_first(self, product, batch, channels, pixels, y, bias=None, first=0):
        """Images first, ..., first + N - 1 of y (., C, P) = product (C, N*P)
        transposed, plus bias (C,) when given: a GEMM's product lifted."""
        raise NotImplementedError

    # --- pooling, LRN, BatchNorm (layers/pooling.py, layers/normalization.py) ---

    # --- softmax, losses, Eltwise, Concat, Scale, Dropout (layers/loss.py, elementwise.py, shape.py) ---

    def __repr__(self):
        return f"{type(self).__name__}({self.name!r})"
