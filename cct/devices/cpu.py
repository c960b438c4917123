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
    def gemm(self, trans_a, trans_b, m, n, k, alpha, a, b, beta, c, a_offset=0, b_offset=0, c_offset=0,
             a_ld=None, b_ld=None):
        op_a = _stored(a, a_offset, (k, m) if trans_a else (m, k), a_ld)
        op_b = _stored(b, b_offset, (n, k) if trans_b else (k, n), b_ld)
        out = c[c_offset:c_offset + m * n].reshape(m, n)
        product = (op_a.T if trans_a else op_a) @ (op_b.T if trans_b else op_b)
        out[...] = alpha * product + (beta * out if beta else 0)

    # --- the solver's update: kernels/update.cl's operations in its order, float32 ---
    def solver_step(self, rule, count, data, diff, first, second, clip, normalize, regularization, decay, rate,
                    coefficients):
        f = np.float32
        c = [f(value) for value in coefficients] + [f(0.0)] * (5 - len(coefficients))
        g = diff[:count] * f(clip) * f(normalize)
        if regularization == 1:
            g = g + data[:count] * f(decay)
        elif regularization == 2:
            g = g + np.sign(data[:count]) * f(decay)
        step = _RULES[rule](g, first[:count], None if second is None else second[:count], f(rate), c)
        diff[:count] = step
        data[:count] -= step

    def sum_of_squares(self, buffers):
        return float(sum(float(np.dot(buffer[:count], buffer[:count])) for buffer, count in buffers))

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

    def clip_forward(self, x, y, count, low, high):
        y[:count] = np.minimum(np.maximum(x[:count], np.float32(low)), np.float32(high))

    def clip_backward(self, x, dy, dx, count, low, high):
        inside = (x[:count] > np.float32(low)) & (x[:count] < np.float32(high))
        dx[:count] = np.where(inside, dy[:count], np.float32(0))

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


    # --- depthwise convolution ---------------------------------------------------
    def _depthwise_cells(self, geom, i, j):
        """Index arrays of window cell (i, j) of every output into the padded planes: (OH, 1), (1, OW)."""
        rows, cols = self._window_cells(geom, i, j)
        return rows[:, None], cols[None, :]

    def _padded_planes(self, x, geom, batch):
        images = x[:batch * geom.channels * geom.in_h * geom.in_w].reshape(batch, geom.channels, geom.in_h,
                                                                           geom.in_w)
        padded = np.zeros((batch, geom.channels) + self._padded_shape(geom, batch), np.float32)
        padded[:, :, geom.pad_h:geom.pad_h + geom.in_h, geom.pad_w:geom.pad_w + geom.in_w] = images
        return padded

    def depthwise_forward(self, x, w, geom, batch, y, bias=None):
        padded = self._padded_planes(x, geom, batch)
        kernel = w[:geom.channels * geom.kernel_h * geom.kernel_w].reshape(1, geom.channels, geom.kernel_h,
                                                                           geom.kernel_w, 1, 1)
        total = np.zeros((batch, geom.channels, geom.out_h, geom.out_w), np.float32)
        for i in range(geom.kernel_h):
            for j in range(geom.kernel_w):
                total += kernel[:, :, i, j] * padded[:, :, self._depthwise_cells(geom, i, j)[0],
                                                     self._depthwise_cells(geom, i, j)[1]]
        if bias is not None:
            total += bias[:geom.channels].reshape(1, -1, 1, 1)
        y[:total.size] = total.reshape(-1)

    def depthwise_backward_data(self, dy, w, geom, batch, dx):
        padded = np.zeros((batch, geom.channels) + self._padded_shape(geom, batch), np.float32)
        grad = dy[:batch * geom.channels * geom.out_h * geom.out_w].reshape(batch, geom.channels, geom.out_h,
                                                                            geom.out_w)
        kernel = w[:geom.channels * geom.kernel_h * geom.kernel_w].reshape(1, geom.channels, geom.kernel_h,
                                                                           geom.kernel_w, 1, 1)
        for i in range(geom.kernel_h):                 # each pixel's terms in window order
            for j in range(geom.kernel_w):
                rows, cols = self._depthwise_cells(geom, i, j)
                padded[:, :, rows, cols] += kernel[:, :, i, j] * grad
        interior = padded[:, :, geom.pad_h:geom.pad_h + geom.in_h, geom.pad_w:geom.pad_w + geom.in_w]
        dx[:interior.size] = interior.reshape(-1)

    def depthwise_backward_weights(self, x, dy, geom, batch, dw):
        padded = self._padded_planes(x, geom, batch)
        grad = dy[:batch * geom.channels * geom.out_h * geom.out_w].reshape(batch, geom.channels, geom.out_h,
                                                                            geom.out_w)
        total = np.empty((geom.channels, geom.kernel_h, geom.kernel_w), np.float32)
        for i in range(geom.kernel_h):
            for j in range(geom.kernel_w):
                rows, cols = self._depthwise_cells(geom, i, j)
                # per output row, then over the rows, then over the images: the kernels' stages
                total[:, i, j] = (padded[:, :, rows, cols] * grad).sum(axis=3).sum(axis=2).sum(axis=0)
        dw[:total.size] += total.reshape(-1)

    # --- pooling, LRN, BatchNorm (layers/pooling.py, layers/normalization.py) ---
    @staticmethod
    def _pool_layout(shape, pooled, kernel, stride, pad):
        """(planes (N*C, H, W) count, padded (rows, cols) holding every window
        cell with the image at (pad_h, pad_w), first image row and column of
        each window (PH,), (PW,): may be negative or past the image)."""
        n, c, h, w = shape
        rows = max(h + 2 * pad[0], (pooled[0] - 1) * stride[0] + kernel[0])
        cols = max(w + 2 * pad[1], (pooled[1] - 1) * stride[1] + kernel[1])
        starts_h = np.arange(pooled[0]) * stride[0] - pad[0]
        starts_w = np.arange(pooled[1]) * stride[1] - pad[1]
        return n * c, (rows, cols), starts_h, starts_w

    @staticmethod
    def _pool_cells(padded, i, j, pooled, stride):
        """Window cell (i, j) of every output: a (planes, PH, PW) view of padded."""
        return padded[:, i:i + stride[0] * (pooled[0] - 1) + 1:stride[0],
                      j:j + stride[1] * (pooled[1] - 1) + 1:stride[1]]

    def _pool_padded(self, x, shape, pooled, kernel, stride, pad, fill):
        planes, (rows, cols), _, _ = self._pool_layout(shape, pooled, kernel, stride, pad)
        h, w = shape[2:]
        padded = np.full((planes, rows, cols), fill, np.float32)
        padded[:, pad[0]:pad[0] + h, pad[1]:pad[1] + w] = x[:planes * h * w].reshape(planes, h, w)
        return padded

    def max_pool_forward(self, x, y, mask, shape, pooled, kernel, stride, pad):
        planes, _, starts_h, starts_w = self._pool_layout(shape, pooled, kernel, stride, pad)
        count = planes * pooled[0] * pooled[1]
        if not count:
            return
        # padding and overhang hold -inf, below the -FLT_MAX start: they never win
        padded = self._pool_padded(x, shape, pooled, kernel, stride, pad, -np.inf)
        best = np.full((planes,) + tuple(pooled), -np.finfo(np.float32).max, np.float32)
        where = np.full(best.shape, -1.0, np.float32)
        width = shape[3]
        for i in range(kernel[0]):
            for j in range(kernel[1]):
                cell = self._pool_cells(padded, i, j, pooled, stride)
                better = cell > best                                    # strict: the first maximum stays
                best = np.where(better, cell, best)
                index = (starts_h[:, None] + i) * width + (starts_w[None, :] + j)
                where = np.where(better, index.astype(np.float32), where)
        y[:count] = best.reshape(-1)
        mask[:count] = where.reshape(-1)

    def max_pool_backward(self, dy, mask, dx, shape, pooled, kernel, stride, pad):
        planes = shape[0] * shape[1]
        pixels, outputs = shape[2] * shape[3], pooled[0] * pooled[1]
        total = np.zeros(planes * pixels, np.float32)
        winner = mask[:planes * outputs].reshape(planes, outputs).astype(np.int64)
        target = np.arange(planes)[:, None] * pixels + winner
        valid = winner >= 0
        # unbuffered adds in output order: each pixel sums its terms as the kernel does
        np.add.at(total, target[valid], dy[:planes * outputs].reshape(planes, outputs)[valid])
        dx[:planes * pixels] = total

    def _ave_divisor(self, shape, pooled, kernel, stride, pad):
        """Caffe's divisor (PH, PW): the window clipped to the padded image, padding counted."""
        _, _, starts_h, starts_w = self._pool_layout(shape, pooled, kernel, stride, pad)
        size_h = np.minimum(starts_h + kernel[0], shape[2] + pad[0]) - starts_h
        size_w = np.minimum(starts_w + kernel[1], shape[3] + pad[1]) - starts_w
        return np.outer(size_h, size_w).astype(np.float32)

    def ave_pool_forward(self, x, y, shape, pooled, kernel, stride, pad):
        planes = shape[0] * shape[1]
        count = planes * pooled[0] * pooled[1]
        if not count:
            return
        padded = self._pool_padded(x, shape, pooled, kernel, stride, pad, 0.0)
        total = np.zeros((planes,) + tuple(pooled), np.float32)
        for i in range(kernel[0]):
            for j in range(kernel[1]):
                total += self._pool_cells(padded, i, j, pooled, stride)
        with np.errstate(divide="ignore", invalid="ignore"):   # a window past the padded image: Caffe's 0/0
            y[:count] = (total / self._ave_divisor(shape, pooled, kernel, stride, pad)).reshape(-1)

    def ave_pool_backward(self, dy, dx, shape, pooled, kernel, stride, pad):
        planes, (rows, cols), _, _ = self._pool_layout(shape, pooled, kernel, stride, pad)
        h, w = shape[2:]
        padded = np.zeros((planes, rows, cols), np.float32)
        if planes * pooled[0] * pooled[1]:
            with np.errstate(divide="ignore", invalid="ignore"):
                share = dy[:planes * pooled[0] * pooled[1]].reshape((planes,) + tuple(pooled)) \
                    / self._ave_divisor(shape, pooled, kernel, stride, pad)
            # cells in reverse: a pixel's windows then come in output order (the kernel's sum order)
            for i in reversed(range(kernel[0])):
                for j in reversed(range(kernel[1])):
                    self._pool_cells(padded, i, j, pooled, stride)[...] += share
        dx[:planes * h * w] = padded[:, pad[0]:pad[0] + h, pad[1]:pad[1] + w].reshape(-1)

    @staticmethod
    def _lrn_window(values, size, across):
        """The window sum of values (N, C, H, W), zeros beyond the edges: over
        channels, or over columns and then rows (the box); each sum centre
        first, then offsets 1, 2, ... before and after (the kernels' order)."""
        def along(source, axis):
            out = source.copy()
            head, tail = np.moveaxis(source, axis, 0), np.moveaxis(out, axis, 0)
            for offset in range(1, min((size - 1) // 2, source.shape[axis] - 1) + 1):
                tail[offset:] += head[:-offset]
                tail[:-offset] += head[offset:]
            return out
        return along(values, 1) if across else along(along(values, 3), 2)

    def lrn_scale(self, x, scale, shape, size, alpha_over_size, k, across=True):
        count = int(np.prod(shape))
        values = x[:count].reshape(shape)
        window = self._lrn_window(values * values, size, across)
        scale[:count] = (window * np.float32(alpha_over_size) + np.float32(k)).reshape(-1)

    @staticmethod
    def _lrn_power(scale, beta):
        """scale^-beta; for beta 0.75 by square roots, 1 / sqrt(sqrt(s) * s), as the kernel."""
        if beta == 0.75:
            return np.float32(1) / np.sqrt(np.sqrt(scale) * scale)
        return np.power(scale, np.float32(-beta))

    def lrn_forward(self, x, scale, y, count, beta):
        y[:count] = x[:count] * self._lrn_power(scale[:count], beta)

    def lrn_backward(self, x, y, scale, dy, dx, shape, size, beta, factor, across=True):
        count = int(np.prod(shape))
        s = scale[:count].reshape(shape)
        g = dy[:count].reshape(shape)
        window = self._lrn_window(g * y[:count].reshape(shape) / s, size, across)
        spread = window * x[:count].reshape(shape) * np.float32(factor)
        dx[:count] = (g * self._lrn_power(s, beta) - spread).reshape(-1)

    def channel_sum(self, x, batch, channels, spatial, out, alpha=1.0, times=None):
        count = batch * channels * spatial
        values = x[:count].reshape(batch, channels, spatial)
        if times is not None:
            values = values * times[:count].reshape(batch, channels, spatial)
        # over s, then over n: the kernels' two stages
        out[:channels] = values.sum(axis=2).sum(axis=0) * np.float32(alpha)

    def channel_normalize(self, x, y, batch, channels, spatial, mean=None, std=None):
        count = batch * channels * spatial
        values = x[:count].reshape(batch, channels, spatial)
        if mean is not None:
            values = values - mean[:channels].reshape(1, channels, 1)
        if std is not None:
            values = values / std[:channels].reshape(1, channels, 1)
        y[:count] = values.reshape(-1)

    def batch_norm_stats(self, mean, variance, std, channels, eps, factor=None):
        if factor is not None:
            inverse = np.float32(0) if factor[0] == 0 else np.float32(1) / factor[0]
            mean[:channels] *= inverse
            variance[:channels] *= inverse
        std[:channels] = np.sqrt(variance[:channels] + np.float32(eps))

    def batch_norm_backward(self, dy, y, std, mean_dy, mean_dy_y, dx, batch, channels, spatial):
        count = batch * channels * spatial
        shape = (batch, channels, spatial)
        per_channel = (1, channels, 1)
        g = dy[:count].reshape(shape)
        values = (g - mean_dy[:channels].reshape(per_channel)
                  - y[:count].reshape(shape) * mean_dy_y[:channels].reshape(per_channel))
        dx[:count] = (values / std[:channels].reshape(per_channel)).reshape(-1)

    # --- softmax, losses, Eltwise, Concat, Scale, Dropout (layers/loss.py, elementwise.py, shape.py) ---
    def copy_blocks(self, src, dst, blocks, size, src_stride, dst_stride, src_offset=0, dst_offset=0):
        if blocks and size:
            self._blocks(dst, dst_offset, blocks, size, dst_stride)[...] = self._blocks(
                src, src_offset, blocks, size, src_stride)

    def multiply(self, a, b, out, count):
        np.multiply(a[:count], b[:count], out=out[:count])

    def dropout_mask(self, mask, count, seed, keep, scale):
        with np.errstate(over="ignore"):                 # the hash's products wrap, as uint arithmetic
            bits = _mix(_mix(np.array([seed], np.uint32)) + np.arange(count, dtype=np.uint32))
        uniform = (bits >> np.uint32(8)).astype(np.float32) * np.float32(1.0 / 16777216.0)
        mask[:count] = np.where(uniform < np.float32(keep), np.float32(scale), np.float32(0.0))

    def divide(self, a, b, out, count):
        with np.errstate(divide="ignore", invalid="ignore"):      # x / 0 as the kernel's IEEE result
            np.divide(a[:count], b[:count], out=out[:count])

    def broadcast_affine(self, x, outer, dim, inner, y, scale=None, bias=None):
        count = outer * dim * inner
        source, target = x[:count].reshape(outer, dim, inner), y[:count].reshape(outer, dim, inner)
        values = source * scale[:dim].reshape(1, dim, 1) if scale is not None else source.copy()
        if bias is not None:
            values += bias[:dim].reshape(1, dim, 1)
        target[...] = values

    def eltwise_max(self, a, b, out, argmax, count, index):
        first, second = a[:count], b[:count]
        if index == 1:
            argmax[:count] = np.where(first > second, 0, 1)
        else:
            argmax[:count] = np.where(second > first, index, argmax[:count])
        out[:count] = np.maximum(first, second)

    def keep_where_index(self, dy, argmax, index, dx, count):
        dx[:count] = dy[:count] * (argmax[:count] == index).astype(np.float32)

    def softmax_forward(self, x, y, outer, channels, inner):
        count = outer * channels * inner
        if count:
            values = x[:count].reshape(outer, channels, inner)
            exp = np.exp(values - values.max(axis=1, keepdims=True))
            y[:count] = (exp / exp.sum(axis=1, keepdims=True)).reshape(-1)

    def softmax_backward(self, y, dy, dx, outer, channels, inner):
        count = outer * channels * inner
        out, grad = y[:count].reshape(outer, channels, inner), dy[:count].reshape(outer, channels, inner)
        dot = (grad * out).sum(axis=1, keepdims=True)
        dx[:count] = ((grad - dot) * out).reshape(-1)

    def softmax_loss_forward(self, prob, labels, out, outer, channels, inner, ignore_label=None):
        positions = outer * inner
        whole, ignored, valid = self._labels(labels, positions, channels, ignore_label)
        safe = np.where(valid, whole, 0).astype(np.int64).reshape(outer, inner)
        picked = np.take_along_axis(prob[:outer * channels * inner].reshape(outer, channels, inner),
                                    safe[:, None, :], axis=1).reshape(-1)
        log_p = np.log(np.maximum(picked, np.float32(np.finfo(np.float32).tiny)))
        out[:positions] = np.where(valid, log_p, np.where(ignored, 0, whole))
        out[positions:2 * positions] = np.where(valid, 1, np.where(ignored, 0, -1))

    def softmax_loss_reduce(self, values, positions, loss, stats, normalizer=None):
        log_p, flags = values[:positions], values[positions:2 * positions]
        valid, bad = flags > 0, np.flatnonzero(flags < 0)
        scale = float(max(1, np.count_nonzero(valid) if normalizer is None else normalizer))
        stats[:3] = scale, bad[0] if bad.size else -1, log_p[bad[0]] if bad.size else 0
        loss[0] = np.nan if bad.size else (0.0 - float(log_p[valid].sum(dtype=np.float64))) / scale

    def softmax_loss_backward(self, prob, labels, dx, outer, channels, inner, weight, stats, ignore_label=None):
        whole, ignored, _ = self._labels(labels, outer * inner, channels, ignore_label)
        whole = whole.reshape(outer, 1, inner)
        hot = (np.arange(channels).reshape(1, channels, 1) == whole).astype(np.float32)
        scale = np.float32(weight[0]) / np.float32(stats[0])
        grad = (prob[:outer * channels * inner].reshape(outer, channels, inner) - hot) * scale
        grad = np.where(ignored.reshape(outer, 1, inner), np.float32(0), grad)
        dx[:outer * channels * inner] = grad.reshape(-1)

    # --- the forks' layers (layers/ssd.py, segmentation.py, shape.py) ---------------
    @staticmethod
    def _strided(buffer, offset, shape, strides):
        """The view of buffer at offset with shape and element strides, checked to lie inside it."""
        last = offset + sum((n - 1) * stride for n, stride in zip(shape, strides))
        if min(shape, default=1) > 0 and not 0 <= offset <= last < buffer.size:
            from cct.devices.base import DeviceError
            raise DeviceError(f"copy_strided: shape {tuple(shape)} at strides {tuple(strides)} from {offset} "
                              f"overruns a buffer of {buffer.size}")
        return np.lib.stride_tricks.as_strided(buffer[offset:], tuple(shape), tuple(4 * s for s in strides),
                                               writeable=True)

    def copy_strided(self, src, dst, shape, src_strides, dst_strides=None, src_offset=0, dst_offset=0,
                     accumulate=False):
        if dst_strides is None:
            dst_strides = [int(np.prod(shape[k + 1:], dtype=np.int64)) for k in range(len(shape))]
        source = self._strided(src, src_offset, shape, src_strides)
        target = self._strided(dst, dst_offset, shape, dst_strides)
        if accumulate:
            target += source
        else:
            target[...] = source

    def divide_across(self, x, divisor, y, outer, axis, inner):
        count = outer * axis * inner
        with np.errstate(divide="ignore", invalid="ignore"):
            y[:count] = (x[:count].reshape(outer, axis, inner)
                         / divisor[:outer * inner].reshape(outer, 1, inner)).reshape(-1)

    def l2_normalize_backward(self, x, dy, norm, dot, dx, outer, axis, inner):
        count = outer * axis * inner
        n = norm[:outer * inner].reshape(outer, 1, inner)
        d = dot[:outer * inner].reshape(outer, 1, inner)
        shape = (outer, axis, inner)
        with np.errstate(divide="ignore", invalid="ignore"):
            dx[:count] = ((dy[:count].reshape(shape) - x[:count].reshape(shape) * d / (n * n)) / n).reshape(-1)

    @staticmethod
    def _interp_table(table, size, out):
        """(index, step, lambda0, lambda1) of an Interp table (base.py's layout)."""
        index = table[:out].astype(np.int64)
        return index, table[out:2 * out].astype(np.int64), table[2 * out:3 * out], table[3 * out:4 * out]

    def interp_forward(self, x, y, table_h, table_w, planes, in_h, in_w, out_h, out_w):
        hi, hs, h0, h1 = self._interp_table(table_h, in_h, out_h)
        wi, ws, w0, w1 = self._interp_table(table_w, in_w, out_w)
        source = x[:planes * in_h * in_w].reshape(planes, in_h, in_w)
        upper, lower = source[:, hi], source[:, hi + hs]                    # (P, out_h, in_w)
        h0, h1 = h0[:, None], h1[:, None]
        y[:planes * out_h * out_w] = (h0 * (w0 * upper[..., wi] + w1 * upper[..., wi + ws])
                                      + h1 * (w0 * lower[..., wi] + w1 * lower[..., wi + ws])).reshape(-1)

    def interp_backward(self, dy, dx, table_h, table_w, planes, in_h, in_w, out_h, out_w):
        hi, hs, h0, h1 = self._interp_table(table_h, in_h, out_h)
        wi, ws, w0, w1 = self._interp_table(table_w, in_w, out_w)
        rows = np.stack([hi, hi, hi + hs, hi + hs], axis=1)[:, None, :]     # (out_h, 1, 4)
        cols = np.stack([wi, wi + ws, wi, wi + ws], axis=1)[None, :, :]     # (1, out_w, 4)
        weights = (np.stack([h0, h0, h1, h1], axis=1)[:, None, :]
                   * np.stack([w0, w1, w0, w1], axis=1)[None, :, :])        # (out_h, out_w, 4)
        grad = dy[:planes * out_h * out_w].reshape(planes, out_h, out_w, 1)
        targets = (np.arange(planes)[:, None, None, None] * (in_h * in_w) + rows * in_w + cols)
        total = np.zeros(planes * in_h * in_w, np.float32)
        # unbuffered adds in output order, an output's four terms in turn: the forks' serial loop
        np.add.at(total, np.broadcast_to(targets, (planes, out_h, out_w, 4)).reshape(-1),
                  (weights * grad).reshape(-1))
        dx[:total.size] = total

    @staticmethod
    def _unpool_cells(mask, planes, pixels, out_pixels):
        cells = np.trunc(mask[:planes * pixels].reshape(planes, pixels))
        valid = (cells >= 0) & (cells < out_pixels)
        flat = np.where(valid, cells, 0).astype(np.int64) + np.arange(planes)[:, None] * out_pixels
        return flat.reshape(-1), valid.reshape(-1)

    def unpool_forward(self, x, mask, y, planes, pixels, out_pixels):
        flat, valid = self._unpool_cells(mask, planes, pixels, out_pixels)
        total = np.zeros(planes * out_pixels, np.float32)
        order = np.flatnonzero(valid)
        # the last value written to a cell wins: keep each cell's last index
        cells = flat[order]
        last = order[cells.size - 1 - np.unique(cells[::-1], return_index=True)[1]]
        total[flat[last]] = x[last]
        y[:total.size] = total

    def unpool_backward(self, dy, mask, dx, planes, pixels, out_pixels):
        flat, valid = self._unpool_cells(mask, planes, pixels, out_pixels)
        dx[:planes * pixels] = np.where(valid, dy[flat], np.float32(0))

    def decode_boxes(self, loc, priors, boxes, batch, num_priors, loc_classes, code_type, variance_in_target):
        count = batch * num_priors * loc_classes * 4
        offsets = loc[:count].reshape(batch, num_priors, loc_classes, 4)
        prior = priors[:num_priors * 4].reshape(1, num_priors, 1, 4)
        var = priors[num_priors * 4:num_priors * 8].reshape(1, num_priors, 1, 4)
        scaled = offsets if variance_in_target else var * offsets
        width, height = prior[..., 2] - prior[..., 0], prior[..., 3] - prior[..., 1]
        if code_type == 1:                                          # CORNER
            out = prior + scaled
        elif code_type == 3:                                        # CORNER_SIZE
            out = prior + scaled * np.stack([width, height, width, height], axis=-1)
        else:                                                       # CENTER_SIZE
            two = np.float32(2)
            cx = scaled[..., 0] * width + (prior[..., 0] + prior[..., 2]) / two
            cy = scaled[..., 1] * height + (prior[..., 1] + prior[..., 3]) / two
            # exp rounded to the nearest float (numpy's float32 exp is not, in places)
            w = np.exp(scaled[..., 2].astype(np.float64)).astype(np.float32) * width
            h = np.exp(scaled[..., 3].astype(np.float64)).astype(np.float32) * height
            out = np.stack([cx - w / two, cy - h / two, cx + w / two, cy + h / two], axis=-1)
        boxes[:count] = out.reshape(-1)

    @staticmethod
    def _roi_bins(bins, rois, pooled):
        """(image (R,), first rows, row ends (R, PH), first columns, column ends (R, PW)) of a bins table."""
        ph, pw = pooled
        bounds = np.split(bins[:rois * (1 + 2 * ph + 2 * pw)].astype(np.int64),
                          np.cumsum([rois, rois * ph, rois * ph, rois * pw]))
        return (bounds[0], bounds[1].reshape(rois, ph), bounds[2].reshape(rois, ph),
                bounds[3].reshape(rois, pw), bounds[4].reshape(rois, pw))

    def roi_max_pool_forward(self, x, bins, y, argmax, shape, rois, pooled):
        n, c, h, w = shape
        images = x[:n * c * h * w].reshape(n, c, h, w)
        image, h0, h1, w0, w1 = self._roi_bins(bins, rois, pooled)
        top = np.zeros((rois, c) + tuple(pooled), np.float32)
        where = np.full(top.shape, -1.0, np.float32)
        for r in range(rois):
            for ph in range(pooled[0]):
                for pw in range(pooled[1]):
                    if h1[r, ph] <= h0[r, ph] or w1[r, pw] <= w0[r, pw]:
                        continue                                         # empty: 0 and -1
                    cells = images[image[r], :, h0[r, ph]:h1[r, ph], w0[r, pw]:w1[r, pw]]
                    flat = cells.reshape(c, -1)                          # (C, cells) in scan order
                    above = flat > -np.finfo(np.float32).max             # NaN and -FLT_MAX never win
                    first = np.argmax(np.where(above, flat, -np.inf), axis=1)    # the first maximum
                    found = above.any(axis=1)
                    span = w1[r, pw] - w0[r, pw]
                    cell = (h0[r, ph] + first // span) * w + w0[r, pw] + first % span
                    top[r, :, ph, pw] = np.where(found, flat[np.arange(c), first], -np.finfo(np.float32).max)
                    where[r, :, ph, pw] = np.where(found, cell, -1)
        y[:top.size] = top.reshape(-1)
        argmax[:top.size] = where.reshape(-1)

    def roi_max_pool_backward(self, dy, argmax, bins, feasible, dx, shape, rois, pooled):
        n, c, h, w = shape
        image = self._roi_bins(bins, rois, pooled)[0]
        tables = feasible[:3 * rois * (h + w)].astype(np.int64)
        inside_h, ph_lo, ph_hi = tables[:3 * rois * h].reshape(3, rois, h)
        inside_w, pw_lo, pw_hi = tables[3 * rois * h:].reshape(3, rois, w)
        size = rois * c * pooled[0] * pooled[1]
        grad = dy[:size].reshape(rois, c, *pooled)
        winner = argmax[:size].reshape(rois, c, *pooled).astype(np.int64)
        total = np.zeros((n, c, h * w), np.float32)
        channels = np.arange(c)
        for r in range(rois):                   # each pixel's terms in ROI, then bin order
            for ph in range(pooled[0]):
                for pw in range(pooled[1]):
                    cell = winner[r, :, ph, pw]
                    row, col = cell // w, cell % w
                    taken = ((cell >= 0) & (inside_h[r, row] > 0) & (inside_w[r, col] > 0)
                             & (ph_lo[r, row] <= ph) & (ph < ph_hi[r, row])
                             & (pw_lo[r, col] <= pw) & (pw < pw_hi[r, col]))
                    total[image[r], channels[taken], cell[taken]] += grad[r, taken, ph, pw]
        dx[:total.size] = total.reshape(-1)

    def psroi_pool_forward(self, x, bins, y, shape, rois, group):
        n, c, h, w = shape
        dims = c // (group * group)
        images = x[:n * c * h * w].reshape(n, dims, group, group, h, w)
        image, h0, h1, w0, w1 = self._roi_bins(bins, rois, (group, group))
        top = np.zeros((rois, dims, group, group), np.float32)
        for r in range(rois):
            for ph in range(group):
                for pw in range(group):
                    total = np.zeros(dims, np.float32)
                    for row in range(h0[r, ph], h1[r, ph]):            # from 0 in scan order
                        for col in range(w0[r, pw], w1[r, pw]):
                            total += images[image[r], :, ph, pw, row, col]
                    area = (h1[r, ph] - h0[r, ph]) * (w1[r, pw] - w0[r, pw])
                    if area > 0:
                        top[r, :, ph, pw] = total / np.float32(area)
        y[:top.size] = top.reshape(-1)

    def psroi_pool_backward(self, dy, bins, dx, shape, rois, group):
        n, c, h, w = shape
        dims = c // (group * group)
        image, h0, h1, w0, w1 = self._roi_bins(bins, rois, (group, group))
        grad = dy[:rois * c].reshape(rois, dims, group, group)
        total = np.zeros((n, dims, group, group, h, w), np.float32)
        for r in range(rois):                   # a pixel's terms in ROI order (one bin per channel)
            for ph in range(group):
                for pw in range(group):
                    area = (h1[r, ph] - h0[r, ph]) * (w1[r, pw] - w0[r, pw])
                    if area > 0:
                        share = grad[r, :, ph, pw] / np.float32(area)
                        total[image[r], :, ph, pw, h0[r, ph]:h1[r, ph], w0[r, pw]:w1[r, pw]] += \
                            share[:, None, None]
        dx[:total.size] = total.reshape(-1)

    @staticmethod
    def _blocks(buffer, offset, blocks, size, stride):
        """The (blocks, size) view of buffer whose rows start at offset + b * stride."""
        if offset + (blocks - 1) * stride + size > buffer.size:
            from cct.devices.base import DeviceError
            raise DeviceError(f"copy_blocks: {blocks} blocks of {size} at stride {stride} from {offset} "
                              f"overrun a buffer of {buffer.size}")
        return np.lib.stride_tricks.as_strided(buffer[offset:], (blocks, size), (4 * stride, 4),
                                               writeable=True)

    @staticmethod
    def _labels(labels, positions, channels, ignore_label):
        """(truncated labels, ignored mask, valid mask) of the first `positions`
        labels, as Caffe's int cast reads them (float: NaN and huge values stay invalid)."""
        whole = np.trunc(labels[:positions])
        ignored = (whole == np.float32(ignore_label) if ignore_label is not None
                   else np.zeros(positions, bool))
        valid = ~ignored & (whole >= 0) & (whole < channels)
        return whole, ignored, valid

CPU = CPUDevice()


def _mix(x):
    """kernels/layers.cl's mix (lowbias32) on uint32 arrays."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7feb352d)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846ca68b)
    return x ^ (x >> np.uint32(16))


# Each rule's step from the gradient g, updating its histories in place (c: the coefficients of kernels/update.cl)
def _sgd(g, first, second, rate, c):
    first[...] = first * c[0] + g * rate
    return first.copy()


def _nesterov(g, first, second, rate, c):
    previous = first.copy()
    first[...] = previous * c[0] + rate * g
    return first * c[1] - previous * c[0]


def _adagrad(g, first, second, rate, c):
    first[...] = first + g * g
    return g / (np.sqrt(first) + c[0]) * rate


def _rmsprop(g, first, second, rate, c):
    first[...] = first * c[0] + g * g * c[1]
    return g / (np.sqrt(first) + c[2]) * rate


def _adadelta(g, first, second, rate, c):
    first[...] = first * c[0] + c[1] * (g * g)
    step = g * np.sqrt((second + c[2]) / (first + c[2]))
    second[...] = second * c[0] + c[1] * (step * step)
    return step * rate


def _adam(g, first, second, rate, c):
    first[...] = first * c[0] + c[1] * g
    second[...] = second * c[2] + c[3] * (g * g)
    return first / (np.sqrt(second) + c[4]) * rate


_RULES = {"SGD": _sgd, "Nesterov": _nesterov, "AdaGrad": _adagrad, "RMSProp": _rmsprop, "AdaDelta": _adadelta,
          "Adam": _adam}


def _stored(buffer, offset, shape, ld=None):
    """The (rows, columns) matrix stored at `offset` in rows `ld` elements
    apart (default: packed), as a view."""
    rows, columns = shape
    ld = columns if ld is None else ld
    if not (rows and columns):
        return np.zeros(shape, np.float32)
    block = buffer[offset:offset + (rows - 1) * ld + columns]
    return np.lib.stride_tricks.as_strided(block, shape, (ld * block.itemsize, block.itemsize), writeable=False)
