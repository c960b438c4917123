// LRN's and BatchNorm's kernels (layers/normalization.py), one work item per
// output element; a window or channel sum is a loop in a fixed order (no
// atomics). The numpy reference of each is the same-named method of
// cct.devices.cpu, which adds in the same order.

#pragma OPENCL FP_CONTRACT OFF

// --- LRN: a window of `size` channels (across) or a size x size box (within) ---

// One term of a window sum: x^2 (the scale's), or dy * y / scale (the gradient's).
inline float lrn_term(__global const float* a, __global const float* b, __global const float* c, const int ratio,
                      const int i) {
    return ratio ? a[i] * b[i] / c[i] : a[i] * a[i];
}

// The terms at i, i - step, i + step, i - 2 step, ... within `reach` steps, `position`
// of `length` along the axis: centre first, nearer before farther, zeros beyond the edges.
inline float lrn_line(__global const float* a, __global const float* b, __global const float* c, const int ratio,
                      const int i, const int step, const int position, const int length, const int reach) {
    float total = lrn_term(a, b, c, ratio, i);
    for (int d = 1; d <= reach; ++d) {
        if (position - d >= 0) total += lrn_term(a, b, c, ratio, i - d * step);
        if (position + d < length) total += lrn_term(a, b, c, ratio, i + d * step);
    }
    return total;
}

// The window sum of element `index` of (N, C, H, W): across channels, or the
// box as the line sums (over columns) of its rows, the rows added as a line.
inline float lrn_window(__global const float* a, __global const float* b, __global const float* c,
                        const int ratio, const int index, const int channels, const int height,
                        const int width, const int size, const int across) {
    const int reach = (size - 1) / 2;
    const int pixels = height * width;
    if (across) return lrn_line(a, b, c, ratio, index, pixels, (index / pixels) % channels, channels, reach);
    const int w = index % width, h = (index / width) % height;
    float total = lrn_line(a, b, c, ratio, index, 1, w, width, reach);
    for (int d = 1; d <= reach; ++d) {
        if (h - d >= 0) total += lrn_line(a, b, c, ratio, index - d * width, 1, w, width, reach);
        if (h + d < height) total += lrn_line(a, b, c, ratio, index + d * width, 1, w, width, reach);
    }
    return total;
}

// scale^-beta; for beta 0.75 (AlexNet's and its kin's) 1 / sqrt(s * sqrt(s)), as the host
// computes it: several times faster than pow, which is most of LRN's time.
inline float lrn_power(const float scale, const float beta) {
    return beta == 0.75f ? 1.0f / sqrt(sqrt(scale) * scale) : pow(scale, -beta);
}

// scale = k + alpha_over_size * window sum of x^2 (Caffe's LRNFillScale)
__kernel void lrn_scale(const int count, __global const float* x, __global float* scale,
                        const int channels, const int height, const int width, const int size,
                        const float alpha_over_size, const float k, const int across) {
    const int index = get_global_id(0);
    if (index >= count) return;
    const float total = lrn_window(x, x, x, 0, index, channels, height, width, size, across);
    scale[index] = total * alpha_over_size + k;
}

// y = x * scale^-beta (Caffe's LRNComputeOutput)
__kernel void lrn_forward(const int count, __global const float* x, __global const float* scale,
                          __global float* y, const float beta) {
    const int index = get_global_id(0);
    if (index >= count) return;
    y[index] = x[index] * lrn_power(scale[index], beta);
}

// dx = dy * scale^-beta - factor * x * window sum of dy * y / scale (Caffe's LRNComputeDiff)
__kernel void lrn_backward(const int count, __global const float* x, __global const float* y,
                           __global const float* scale, __global const float* dy, __global float* dx,
                           const int channels, const int height, const int width, const int size,
                           const float beta, const float factor, const int across) {
    const int index = get_global_id(0);
    if (index >= count) return;
    const float window = lrn_window(dy, y, scale, 1, index, channels, height, width, size, across);
    const float spread = window * x[index] * factor;
    dx[index] = dy[index] * lrn_power(scale[index], beta) - spread;
}

// --- BatchNorm: x (N, C, S) ---

// partial (N*C) = the sum over s of x (times `times` when has_times)
__kernel void channel_sum_partial(const int rows, const int spatial, __global const float* x,
                                  __global const float* times, const int has_times, __global float* partial) {
    const int index = get_global_id(0);
    if (index >= rows) return;
    const int start = index * spatial;
    float total = 0.0f;
    if (has_times)
        for (int s = 0; s < spatial; ++s) total += x[start + s] * times[start + s];
    else
        for (int s = 0; s < spatial; ++s) total += x[start + s];
    partial[index] = total;
}

// out (C) = alpha * the sum over n of partial (N, C)
__kernel void channel_sum_total(const int batch, const int channels, __global const float* partial,
                                __global float* out, const float alpha) {
    const int index = get_global_id(0);
    if (index >= channels) return;
    float total = 0.0f;
    for (int n = 0; n < batch; ++n) total += partial[n * channels + index];
    out[index] = total * alpha;
}

// y = (x - mean[c]) / std[c], each step only when its flag is set
__kernel void channel_normalize(const int count, const int channels, const int spatial, __global const float* x,
                                __global float* y, __global const float* mean, const int has_mean,
                                __global const float* std, const int has_std) {
    const int index = get_global_id(0);
    if (index >= count) return;
    const int c = (index / spatial) % channels;
    float value = x[index];
    if (has_mean) value = value - mean[c];
    if (has_std) value = value / std[c];
    y[index] = value;
}

// std = sqrt(variance + eps); with has_factor, mean and variance (running sums)
// scaled in place by 1 / factor[0] first (0 when factor[0] is 0)
__kernel void batch_norm_stats(const int channels, __global float* mean, __global float* variance,
                               __global float* std, const float eps, __global const float* factor,
                               const int has_factor) {
    const int index = get_global_id(0);
    if (index >= channels) return;
    float value = variance[index];
    if (has_factor) {
        const float inverse = factor[0] == 0.0f ? 0.0f : 1.0f / factor[0];
        mean[index] = mean[index] * inverse;
        value = value * inverse;
        variance[index] = value;
    }
    std[index] = sqrt(value + eps);
}

// dx = (dy - mean_dy[c] - y * mean_dy_y[c]) / std[c]
__kernel void batch_norm_backward(const int count, const int channels, const int spatial,
                                  __global const float* dy, __global const float* y, __global const float* std,
                                  __global const float* mean_dy, __global const float* mean_dy_y,
                                  __global float* dx) {
    const int index = get_global_id(0);
    if (index >= count) return;
    const int c = (index / spatial) % channels;
    dx[index] = (dy[index] - mean_dy[c] - y[index] * mean_dy_y[c]) / std[c];
}
