// Depthwise convolution computed directly (cct.lowering.depthwise's device
// side): group == channels == outputs, each channel convolved with its own
// KH x KW kernel, in the blobs' own layouts:
//     x (N, C, H, W), w (C, 1, KH, KW), y (N, C, OH, OW).
// Window cell (i, j) of output (oh, ow) reads input (oh*SH - PH + i*DH,
// ow*SW - PW + j*DW), 0 outside the image, as Caffe's im2col. One work item
// per output (per input pixel for the data gradient, per output row for the
// weight gradient's partial sums): every value written once, in a fixed order.
// The numpy reference of each is the same-named method of cct.devices.cpu.

#pragma OPENCL FP_CONTRACT OFF

#define DEPTHWISE_GEOMETRY const int channels, const int height, const int width, const int kernel_h, \
                           const int kernel_w, const int stride_h, const int stride_w, const int pad_h, \
                           const int pad_w, const int dilation_h, const int dilation_w, const int out_h, \
                           const int out_w

// y = the sum over the window's cells, in row-major order from 0, of w * x (a
// cell outside the image multiplied as 0, as the host's padded planes), + bias
__kernel void depthwise_forward(const int total, __global const float* x, __global const float* w,
                                __global float* y, __global const float* bias, const int has_bias,
                                DEPTHWISE_GEOMETRY) {
    const int index = get_global_id(0);
    if (index >= total) return;
    const int ow = index % out_w, oh = (index / out_w) % out_h;
    const int c = (index / (out_w * out_h)) % channels, plane = index / (out_w * out_h);
    __global const float* image = x + plane * height * width;
    __global const float* taps = w + c * kernel_h * kernel_w;
    float sum = 0.0f;
    for (int i = 0; i < kernel_h; ++i) {
        const int h = oh * stride_h - pad_h + i * dilation_h;
        for (int j = 0; j < kernel_w; ++j) {
            const int col = ow * stride_w - pad_w + j * dilation_w;
            const float cell = (h >= 0 && h < height && col >= 0 && col < width) ? image[h * width + col] : 0.0f;
            sum += taps[i * kernel_w + j] * cell;
        }
    }
    y[index] = has_bias ? sum + bias[c] : sum;
}

// dx (N, C, H, W), set: per pixel, the sum over the window cells (i, j) in
// row-major order from 0 of w[c, i, j] * dy at the output whose cell (i, j) it is
__kernel void depthwise_backward_data(const int total, __global const float* dy, __global const float* w,
                                      __global float* dx, DEPTHWISE_GEOMETRY) {
    const int index = get_global_id(0);
    if (index >= total) return;
    const int col = index % width, h = (index / width) % height;
    const int c = (index / (width * height)) % channels, plane = index / (width * height);
    __global const float* grad = dy + plane * out_h * out_w;
    __global const float* taps = w + c * kernel_h * kernel_w;
    float sum = 0.0f;
    for (int i = 0; i < kernel_h; ++i) {
        const int rows = h + pad_h - i * dilation_h;              // oh * stride_h
        if (rows < 0 || rows % stride_h) continue;
        const int oh = rows / stride_h;
        if (oh >= out_h) continue;
        for (int j = 0; j < kernel_w; ++j) {
            const int cols = col + pad_w - j * dilation_w;
            if (cols < 0 || cols % stride_w) continue;
            const int ow = cols / stride_w;
            if (ow >= out_w) continue;
            sum += taps[i * kernel_w + j] * grad[oh * out_w + ow];
        }
    }
    dx[index] = sum;
}

// partial (N, C, KH, KW, OH): per output row, the sum over its columns from 0
// of the window cell (i, j) of x times dy (a cell outside the image as 0)
__kernel void depthwise_weight_rows(const int total, __global const float* x, __global const float* dy,
                                    __global float* partial, DEPTHWISE_GEOMETRY) {
    const int index = get_global_id(0);
    if (index >= total) return;
    const int oh = index % out_h, j = (index / out_h) % kernel_w, i = (index / (out_h * kernel_w)) % kernel_h;
    const int plane = index / (out_h * kernel_w * kernel_h);
    const int h = oh * stride_h - pad_h + i * dilation_h;
    float sum = 0.0f;
    if (h >= 0 && h < height) {
        __global const float* row = x + (plane * height + h) * width;
        __global const float* grad = dy + (plane * out_h + oh) * out_w;
        for (int ow = 0; ow < out_w; ++ow) {
            const int col = ow * stride_w - pad_w + j * dilation_w;
            if (col >= 0 && col < width) sum += row[col] * grad[ow];
        }
    }
    partial[index] = sum;
}
