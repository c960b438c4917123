"""InnerProduct (fully connected): one GEMM over the whole batch."""
import numpy as np

from cct.core.layer import Layer, register


# Elements of the weight-gradient work array (16 MiB of float32): blocks of rows
# big enough for an efficient GEMM, small next to fc6's weights.
WEIGHT_GRADIENT_BLOCK = 1 << 22

# Weights (N*K) from which a forward of more than one row computes its product
# transposed, y^T (N, M) = W x^T, into a work array and copies it out: OpenBLAS
# gives the same bits either way, but writes the (N, M) product faster; below it
# (LeNet's ip2) the copy costs more than it saves
# (BENCHMARKS.md, "Session 10: per-layer costs, kept fused passes, Winograd channels innermost").
TRANSPOSED_PRODUCT_WEIGHTS = 1 << 18


@register("InnerProduct")
class InnerProduct(Layer):
    """y = x W^T + b, with x the bottom folded to (M, K) at `axis`.

    inner_product_param: num_output (N), bias_term, weight_filler, bias_filler,
    axis (default 1: M = product of dims before it, K = product from it on),
    transpose (weight stored (K, N) instead of (N, K)). N and K must be > 0
    (Caffe's fillers refuse an empty weight blob); M may be 0 (an empty top).
    Params: weight (N, K) or (K, N) if transpose, bias (N,).
    bottom (d0, ..., d_axis-1, d_axis, ...) -> top (d0, ..., d_axis-1, N).
    """
    exact_bottoms = 1
    exact_tops = 1
    batch_independent = True
    splits_backward = True
    reshape_reads_layout = True
    # one GEMM splits as well across BLAS threads, and twins would copy the weights' diffs
    split_by_default = False

    def can_partition(self, bottom, top):
        # folded at axis 0, every row of the GEMM mixes the whole batch
        return bottom[0].canonical_axis(self.layer_param.inner_product_param.axis) != 0

    def flops(self, bottom, top):
        gemm = 2 * self.m * self.blobs[0].count
        return gemm, gemm, gemm

    def planned_bytes(self, bottom, top, partitions):
        if not self.blobs:
            return {}
        rows, cols = self.blobs[0].shape
        itemsize = self.blobs[0].dtype.itemsize
        block = max(64, min(rows, WEIGHT_GRADIENT_BLOCK // max(1, cols)))
        needs = {"work.ip_weight_gradient": block * cols * itemsize}
        m = -(-bottom[0].count_range(0, self._axis(bottom[0])) // max(1, partitions)) if bottom else 0
        if self._transposed_product(m):
            needs["work.ip_product"] = m * self.num_output * itemsize
        return needs

    def setup(self, bottom, top):
        p = self.layer_param.inner_product_param
        self.num_output = p.num_output
        if self.num_output <= 0:
            raise self.config_error("inner_product_param.num_output", f"must be > 0, got {self.num_output}")
        self.bias_term = p.bias_term
        self.transpose = p.transpose
        self.axis = self._axis(bottom[0])
        self.k = bottom[0].count_range(self.axis)
        if not self.k:
            # Caffe takes K = 0, but every filler refuses the empty weight blob it then
            # fills (CHECK(count), filler.hpp; bilinear wants a 4-d one).
            shape = (self.k, self.num_output) if self.transpose else (self.num_output, self.k)
            raise self.shape_error(f"bottom '{self.layer_param.bottom[0] if self.layer_param.bottom else '#0'}' "
                                   f"{bottom[0].shape} has no values from inner_product_param.axis "
                                   f"{p.axis} on, so the weights {shape} are empty; "
                                   f"inner_product_param.weight_filler ({p.weight_filler.type}) cannot fill "
                                   "an empty blob (Caffe's fillers refuse one)")
        self.blobs = [self.filled_blob((self.k, self.num_output) if self.transpose else (self.num_output, self.k),
                                       p.weight_filler, "inner_product_param.weight_filler")]
        if self.bias_term:
            self.blobs.append(self.filled_blob((self.num_output,), p.bias_filler, "inner_product_param.bias_filler"))
        self.param_propagate_down = [True] * len(self.blobs)

    def _axis(self, bottom):
        try:
            return bottom.canonical_axis(self.layer_param.inner_product_param.axis)
        except ValueError as error:
            raise self.config_error("inner_product_param.axis", str(error)) from None

    def reshape(self, bottom, top):
        axis = self._axis(bottom[0])
        k = bottom[0].count_range(axis)
        if k != self.k:
            raise self.shape_error(f"bottom {bottom[0].shape} folds to {k} inputs at axis {axis}; "
                                   f"the weights take {self.k}")
        self.axis = axis
        self.m = bottom[0].count_range(0, axis)
        top[0].reshape(bottom[0].shape[:axis] + (self.num_output,))

    def _weight_nk(self, dtype):
        """The weight as an (N, K) matrix view in `dtype`."""
        w = self.blobs[0].data
        w = w if w.dtype == dtype else w.astype(dtype)
        return w.T if self.transpose else w

    def forward(self, bottom, top):
        x = bottom[0].data.reshape(self.m, self.k)
        y = top[0].data.reshape(self.m, self.num_output)
        if self._transposed_product(self.m):
            product = self.work("ip_product", (self.num_output, self.m), x.dtype)
            np.matmul(self._weight_nk(x.dtype), x.T, out=product)
            np.copyto(y, product.T)
        else:
            np.matmul(x, self._weight_nk(x.dtype).T, out=y)
        if self.bias_term:
            y += self.blobs[1].data

    def _transposed_product(self, m):
        """Whether a forward of m rows computes y^T (TRANSPOSED_PRODUCT_WEIGHTS);
        weights stored (K, N) (transpose: true) keep the one product."""
        return m > 1 and not self.transpose and self.num_output * self.k >= TRANSPOSED_PRODUCT_WEIGHTS

    # backward (Layer.backward): the weight gradient, the bias gradient, the data gradient
    def backward_param(self, index, top, bottom):
        dy = top[0].diff.reshape(self.m, self.num_output)
        if index == 0:
            self._accumulate_weight_gradient(bottom[0].data.reshape(self.m, self.k), dy)
        else:
            self.blobs[1].diff[...] += dy.sum(axis=0)

    def backward_data(self, top, propagate_down, bottom):
        if propagate_down[0]:
            dy = top[0].diff.reshape(self.m, self.num_output)
            np.matmul(dy, self._weight_nk(dy.dtype), out=bottom[0].diff.reshape(self.m, self.k))

    # --- on a device: the same GEMMs on device buffers ----------------------------------
    def runs_on(self, device, bottom, top):
        return self.all_float32(bottom, top, self.blobs)

    def forward_on(self, device, bottom, top):
        m, n, k = self.m, self.num_output, self.k
        y = top[0].mutable_device_data(device, upload=False)        # written whole: nothing stale copied up
        # y (M, N) = x (M, K) @ W^T, W stored (N, K), or (K, N) when transposed
        device.gemm(False, not self.transpose, m, n, k, 1.0, bottom[0].device_data(device),
                    self.blobs[0].device_data(device), 0.0, y)
        if self.bias_term:             # y += ones (M, 1) @ bias (1, N)
            device.gemm(False, False, m, n, 1, 1.0, device.ones(m), self.blobs[1].device_data(device), 1.0, y)

    def backward_on(self, device, top, propagate_down, bottom):
        m, n, k = self.m, self.num_output, self.k
        dy = top[0].device_diff(device)
        if self.param_wanted(0):
            x, weight_diff = bottom[0].device_data(device), self.blobs[0].mutable_device_diff(device)
            if self.transpose:         # dW (K, N) += x^T @ dy
                device.gemm(True, False, k, n, m, 1.0, x, dy, 1.0, weight_diff)
            else:                      # dW (N, K) += dy^T @ x
                device.gemm(True, False, n, k, m, 1.0, dy, x, 1.0, weight_diff)
        if self.bias_term and self.param_wanted(1):
            device.sum_axis(dy, 1, m, n, self.blobs[1].mutable_device_diff(device), beta=1.0)
        if propagate_down[0]:          # dx (M, K) = dy @ W (N, K), or dy @ W^T when stored (K, N)
            device.gemm(False, self.transpose, m, k, n, 1.0, dy, self.blobs[0].device_data(device), 0.0,
                        bottom[0].mutable_device_diff(device, upload=False))

    def _accumulate_weight_gradient(self, x, dy):
        """weight.diff += dy^T x ((N, K); x^T dy (K, N) when transposed), a block of
        weight rows at a time through a small work array: a whole-matrix temporary
        (fc6's is 4096 x 9216, 151 MB) would cost page faults on every backward
        and add its size to the peak memory."""
        weight_diff = self.blobs[0].diff
        rows, cols = weight_diff.shape
        block = max(64, min(rows, WEIGHT_GRADIENT_BLOCK // cols))
        work = self.work("ip_weight_gradient", (block, cols), dy.dtype)
        left = x.T if self.transpose else dy.T                                # (rows, M)
        right = dy if self.transpose else x                                   # (M, cols)
        for start in range(0, rows, block):
            stop = min(start + block, rows)
            part = work[:stop - start]
            np.matmul(left[start:stop], right, out=part)
            weight_diff[start:stop] += part
