"""The numpy CPU device: every primitive of cct.devices.base in plain numpy,
written for clarity, not speed. It is the reference each OpenCL kernel is
tested against, and it lets a layer's device path run (and be tested) with
no OpenCL at all. cct's CPU mode does not use it: layers run their own
forward and backward there (the fast numpy/numba code of cct.layers and
cct.lowering), which the layer tests compare with the device path.

Buffers are flat float32 numpy arrays, so a blob's host store is its buffer
(shares_host): a blob on this device never copies.
"""
import numpy as np

from cct.devices.base import Device


class CPUDevice(Device):
    kind = "cpu"
    name = "CPU (numpy)"
    shares_host = True

    # --- memory ------------------------------------------------------------------
    def empty(self, count):
        return np.empty(int(count), np.float32)

    def upload(self, buffer, host, offset=0):
        buffer[offset:offset + host.size] = host.reshape(-1)

    def download(self, buffer, host, offset=0):
        host.reshape(-1)[...] = buffer[offset:offset + host.size]

    def copy(self, dst, src, count, dst_offset=0, src_offset=0):
        dst[dst_offset:dst_offset + count] = src[src_offset:src_offset + count]

    def fill(self, buffer, value, count, offset=0):
        buffer[offset:offset + count] = value

    # --- math ----------------------------------------------------------------------
    def gemm(self, trans_a, trans_b, m, n, k, alpha, a, b, beta, c, a_offset=0, b_offset=0, c_offset=0):
        op_a = a[a_offset:a_offset + m * k].reshape((k, m) if trans_a else (m, k))
        op_b = b[b_offset:b_offset + k * n].reshape((n, k) if trans_b else (k, n))
        out = c[c_offset:c_offset + m * n].reshape(m, n)
        product = (op_a.T if trans_a else op_a) @ (op_b.T if trans_b else op_b)
        out[...] = alpha * product + (beta * out if beta else 0)

    def axpby(self, count, alpha, x, beta, y, x_offset=0, y_offset=0):
        out = y[y_offset:y_offset + count]
        out[...] = alpha * x[x_offset:x_offset + count] + (beta * out if beta else 0)

    def sum_axis(self, x, outer, axis, inner, out, beta=0.0):
        total = x[:outer * axis * inner].reshape(outer, axis, inner).sum(axis=1)
        target = out[:outer * inner].reshape(outer, inner)
        target[...] = total + (beta * target if beta else 0)

    def relu_forward(self, x, y, count, slope=0.0):
        values = x[:count]
        y[:count] = np.where(values > 0, values, slope * values)

    def relu_backward(self, x, dy, dx, count, slope=0.0):
        dx[:count] = dy[:count] * np.where(x[:count] > 0, 1.0, slope).astype(np.float32)

    # --- lowering type 1 ---------------------------------------------------------
    def _group_view(self, x, geom, batch, group, first):
        cg = geom.channels // geom.group
        size = geom.channels * geom.in_h * geom.in_w
        images = x[first * size:(first + batch) * size].reshape(batch, geom.channels, geom.in_h, geom.in_w)
        return images[:, group * cg:(group + 1) * cg]                  # (N, Cg, H, W)

    def _window_cells(self, geom, i, j):
        """Rows and columns of the padded image the kernel cell (i, j) reads, per output pixel."""
        rows = np.arange(geom.out_h) * geom.stride_h + i * geom.dilation_h
        cols = np.arange(geom.out_w) * geom.stride_w + j * geom.dilation_w
        return rows, cols

    def _padded_shape(self, geom, batch):
        # wide enough for every window, overrun included (cct.lowering.geometry)
        height = max(geom.in_h + 2 * geom.pad_h, (geom.out_h - 1) * geom.stride_h + geom.extent_h)
        width = max(geom.in_w + 2 * geom.pad_w, (geom.out_w - 1) * geom.stride_w + geom.extent_w)
        return height, width

    def im2col(self, x, geom, batch, cols, group=0, first=0):
        images = self._group_view(x, geom, batch, group, first)
        height, width = self._padded_shape(geom, batch)
        padded = np.zeros(images.shape[:2] + (height, width), np.float32)
        padded[:, :, geom.pad_h:geom.pad_h + geom.in_h, geom.pad_w:geom.pad_w + geom.in_w] = images
        out = cols[:images.shape[1] * geom.kernel_h * geom.kernel_w * batch * geom.out_h * geom.out_w]
        out = out.reshape(images.shape[1], geom.kernel_h, geom.kernel_w, batch, geom.out_h, geom.out_w)
        for i in range(geom.kernel_h):
            for j in range(geom.kernel_w):
                rows, columns = self._window_cells(geom, i, j)
                out[:, i, j] = padded[:, :, rows][:, :, :, columns].transpose(1, 0, 2, 3)

    def col2im(self, cols, geom, batch, x, group=0, first=0):
        images = self._group_view(x, geom, batch, group, first)
        height, width = self._padded_shape(geom, batch)
        padded = np.zeros(images.shape[:2] + (height, width), np.float32)
        lowered = cols[:images.shape[1] * geom.kernel_h * geom.kernel_w * batch * geom.out_h * geom.out_w]
        lowered = lowered.reshape(images.shape[1], geom.kernel_h, geom.kernel_w, batch, geom.out_h, geom.out_w)
        for i in range(geom.kernel_h):
            for j in range(geom.kernel_w):
                rows, columns = self._window_cells(geom, i, j)
                padded[:, :, rows[:, None], columns[None, :]] += lowered[:, i, j].transpose(1, 0, 2, 3)
        images[...] = padded[:, :, geom.pad_h:geom.pad_h + geom.in_h, geom.pad_w:geom.pad_w + geom.in_w]

    def to_channels_first(self, y, batch, channels, pixels, out, first=0):
        size = channels * pixels
        source = y[first * size:(first + batch) * size].reshape(batch, channels, pixels)
        out[:batch * channels * pixels].reshape(channels, batch, pixels)[...] = source.transpose(1, 0, 2)

    def from_channels_first(self, product, batch, channels, pixels, y, bias=None, first=0):
        source = product[:batch * channels * pixels].reshape(channels, batch, pixels).transpose(1, 0, 2)
        size = channels * pixels
        target = y[first * size:(first + batch) * size].reshape(batch, channels, pixels)
        target[...] = source if bias is None else source + bias[:channels].reshape(1, channels, 1)


    # --- pooling, LRN, BatchNorm (layers/pooling.py, layers/normalization.py) ---

    # --- softmax, losses, Eltwise, Concat, Scale, Dropout (layers/loss.py, elementwise.py, shape.py) ---

CPU = CPUDevice()
