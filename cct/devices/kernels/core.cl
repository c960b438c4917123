// cct's core OpenCL kernels: element-wise maps, a reduction over an axis,
// and the lowering (type 1) of a convolution. Each kernel is one work item
// per output element, so every output is written once, by one item, in a
// fixed order: results do not depend on scheduling (no atomics).
// The numpy reference of each is the same-named method of cct.devices.cpu.

__kernel void axpby(const int count, const float alpha, __global const float* x, const int x_offset,
                    const float beta, __global float* y, const int y_offset) {
    const int index = get_global_id(0);
    if (index >= count) return;
    const float scaled = alpha * x[x_offset + index];
    y[y_offset + index] = beta == 0.0f ? scaled : scaled + beta * y[y_offset + index];
}

// out (outer, inner) = sum over the middle axis of x (outer, axis, inner) (+ beta * out)
__kernel void sum_axis(const int outer, const int axis, const int inner, __global const float* x,
                       __global float* out, const float beta) {
    const int index = get_global_id(0);
    if (index >= outer * inner) return;
    const int o = index / inner, i = index % inner;
    __global const float* column = x + o * axis * inner + i;
    float total = 0.0f;
    for (int a = 0; a < axis; ++a) total += column[a * inner];
    out[index] = beta == 0.0f ? total : total + beta * out[index];
}

__kernel void relu_forward(const int count, __global const float* x, __global float* y, const float slope) {
    const int index = get_global_id(0);
    if (index >= count) return;
    const float value = x[index];
    y[index] = value > 0.0f ? value : value * slope;
}

__kernel void relu_backward(const int count, __global const float* x, __global const float* dy,
                            __global float* dx, const float slope) {
    const int index = get_global_id(0);
    if (index >= count) return;
    dx[index] = dy[index] * (x[index] > 0.0f ? 1.0f : slope);
}

__kernel void clip_forward(const int count, __global const float* x, __global float* y, const float low,
                           const float high) {
    const int index = get_global_id(0);
    if (index >= count) return;
    y[index] = fmin(fmax(x[index], low), high);
}

// the gradient passes strictly inside (low, high)
__kernel void clip_backward(const int count, __global const float* x, __global const float* dy,
                            __global float* dx, const float low, const float high) {
    const int index = get_global_id(0);
    if (index >= count) return;
    const float value = x[index];
    dx[index] = value > low && value < high ? dy[index] : 0.0f;
}

// cols (Cg*KH*KW, N*OH*OW) of group g from x (N, C, H, W); one item per cols element.
__kernel void im2col(const int total, __global const float* x, __global float* cols,
                     const int first, const int batch, const int channels, const int height, const int width,
                     const int group_channels, const int group,
                     const int kernel_h, const int kernel_w, const int pad_h, const int pad_w,
                     const int stride_h, const int stride_w, const int dilation_h, const int dilation_w,
                     const int out_h, const int out_w) {
    const int index = get_global_id(0);
    if (index >= total) return;
    const int ow = index % out_w;
    const int oh = (index / out_w) % out_h;
    const int n = (index / (out_w * out_h)) % batch;
    const int row = index / (out_w * out_h * batch);            // (c, i, j)
    const int j = row % kernel_w;
    const int i = (row / kernel_w) % kernel_h;
    const int c = row / (kernel_w * kernel_h) + group * group_channels;
    const int h = oh * stride_h + i * dilation_h - pad_h;
    const int w = ow * stride_w + j * dilation_w - pad_w;
    cols[index] = (h >= 0 && h < height && w >= 0 && w < width)
                  ? x[(((first + n) * channels + c) * height + h) * width + w] : 0.0f;
}

// x (N, C, H, W), group g's channels, set to the sum of the cols entries that read
// each pixel: one item per pixel, looping over the kernel cells that reach it.
__kernel void col2im(const int total, __global const float* cols, __global float* x,
                     const int first, const int batch, const int channels, const int height, const int width,
                     const int group_channels, const int group,
                     const int kernel_h, const int kernel_w, const int pad_h, const int pad_w,
                     const int stride_h, const int stride_w, const int dilation_h, const int dilation_w,
                     const int out_h, const int out_w) {
    const int index = get_global_id(0);                         // over (n, cg, h, w)
    if (index >= total) return;
    const int w = index % width;
    const int h = (index / width) % height;
    const int cg = (index / (width * height)) % group_channels;
    const int n = index / (width * height * group_channels);
    const int hp = h + pad_h, wp = w + pad_w;
    float total_value = 0.0f;
    for (int i = 0; i < kernel_h; ++i) {
        const int rows = hp - i * dilation_h;
        if (rows < 0 || rows % stride_h) continue;
        const int oh = rows / stride_h;
        if (oh >= out_h) continue;
        for (int j = 0; j < kernel_w; ++j) {
            const int columns = wp - j * dilation_w;
            if (columns < 0 || columns % stride_w) continue;
            const int ow = columns / stride_w;
            if (ow >= out_w) continue;
            const int row = (cg * kernel_h + i) * kernel_w + j;
            total_value += cols[((row * batch + n) * out_h + oh) * out_w + ow];
        }
    }
    x[(((first + n) * channels + group * group_channels + cg) * height + h) * width + w] = total_value;
}

// out (C, N*P) from images first, ..., first + N - 1 of y (., C, P)
__kernel void to_channels_first(const int first, const int batch, const int channels, const int pixels,
                                __global const float* y, __global float* out) {
    const int index = get_global_id(0);                         // over out
    if (index >= batch * channels * pixels) return;
    const int p = index % pixels;
    const int n = (index / pixels) % batch;
    const int c = index / (pixels * batch);
    out[index] = y[((first + n) * channels + c) * pixels + p];
}

// images first, ..., first + N - 1 of y (., C, P) from product (C, N*P), plus bias[c] when has_bias
__kernel void from_channels_first(const int first, const int batch, const int channels, const int pixels,
                                  __global const float* product, __global float* y,
                                  __global const float* bias, const int has_bias) {
    const int index = get_global_id(0);                         // over y
    if (index >= batch * channels * pixels) return;
    const int p = index % pixels;
    const int c = (index / pixels) % channels;
    const int n = index / (pixels * channels);
    const float value = product[(c * batch + n) * pixels + p];
    y[first * channels * pixels + index] = has_bias ? value + bias[c] : value;
}
