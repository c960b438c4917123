// Pooling's kernels (layers/pooling.py): MAX and AVE forward, one work item
// per output; their backwards, one work item per input pixel looping over
// the windows that hold it (no atomics: every sum in a fixed order).
// The numpy reference of each is the same-named method of cct.devices.cpu.
//
// Geometry, in every kernel: batch, channels, height, width of the input;
// pooled_h, pooled_w of the output; kernel, stride and pad per axis. Output
// (ph, pw) reads rows ph*stride_h - pad_h ... + kernel_h - 1 clipped to the image.

#pragma OPENCL FP_CONTRACT OFF

#define POOL_GEOMETRY const int batch, const int channels, const int height, const int width, \
                      const int pooled_h, const int pooled_w, const int kernel_h, const int kernel_w, \
                      const int stride_h, const int stride_w, const int pad_h, const int pad_w

// Caffe's AVE divisor: the window clipped to the padded image (H + pad), padding counted.
inline float ave_divisor(const int ph, const int pw, const int height, const int width, const int kernel_h,
                         const int kernel_w, const int stride_h, const int stride_w, const int pad_h,
                         const int pad_w) {
    const int hstart = ph * stride_h - pad_h, wstart = pw * stride_w - pad_w;
    const int hend = min(hstart + kernel_h, height + pad_h), wend = min(wstart + kernel_w, width + pad_w);
    return (float)((hend - hstart) * (wend - wstart));
}

// y, mask (N, C, PH, PW): the first maximum of each window and its index h*W + w
// (as a float); -FLT_MAX and -1 where no cell is above -FLT_MAX.
__kernel void max_pool_forward(__global const float* x, __global float* y, __global float* mask, POOL_GEOMETRY) {
    const int index = get_global_id(0);
    if (index >= batch * channels * pooled_h * pooled_w) return;
    const int pw = index % pooled_w;
    const int ph = (index / pooled_w) % pooled_h;
    const int plane = index / (pooled_w * pooled_h);
    const int hstart = max(ph * stride_h - pad_h, 0), wstart = max(pw * stride_w - pad_w, 0);
    const int hend = min(ph * stride_h - pad_h + kernel_h, height);
    const int wend = min(pw * stride_w - pad_w + kernel_w, width);
    __global const float* image = x + plane * height * width;
    float best = -FLT_MAX;
    int where = -1;
    for (int h = hstart; h < hend; ++h) {
        for (int w = wstart; w < wend; ++w) {
            const float value = image[h * width + w];
            if (value > best) {                 // strict: the first maximum stays; NaN never wins
                best = value;
                where = h * width + w;
            }
        }
    }
    y[index] = best;
    mask[index] = (float)where;
}

// dx (N, C, H, W): the sum of dy over the windows whose mask names this pixel.
__kernel void max_pool_backward(__global const float* dy, __global const float* mask, __global float* dx,
                                POOL_GEOMETRY) {
    const int index = get_global_id(0);
    if (index >= batch * channels * height * width) return;
    const int w = index % width;
    const int h = (index / width) % height;
    const int plane = index / (width * height);
    // the windows holding (h, w): ph*stride_h <= h + pad_h < ph*stride_h + kernel_h
    const int hp = h + pad_h, wp = w + pad_w;
    const int phstart = hp < kernel_h ? 0 : (hp - kernel_h) / stride_h + 1;
    const int phend = min(hp / stride_h + 1, pooled_h);
    const int pwstart = wp < kernel_w ? 0 : (wp - kernel_w) / stride_w + 1;
    const int pwend = min(wp / stride_w + 1, pooled_w);
    const int offset = plane * pooled_h * pooled_w;
    const float here = (float)(h * width + w);
    float total = 0.0f;
    for (int ph = phstart; ph < phend; ++ph) {
        for (int pw = pwstart; pw < pwend; ++pw) {
            const int out = offset + ph * pooled_w + pw;
            if (mask[out] == here) total += dy[out];
        }
    }
    dx[index] = total;
}

// y (N, C, PH, PW) = each window's sum, from 0 in scan order, / Caffe's divisor.
__kernel void ave_pool_forward(__global const float* x, __global float* y, POOL_GEOMETRY) {
    const int index = get_global_id(0);
    if (index >= batch * channels * pooled_h * pooled_w) return;
    const int pw = index % pooled_w;
    const int ph = (index / pooled_w) % pooled_h;
    const int plane = index / (pooled_w * pooled_h);
    const int hstart = max(ph * stride_h - pad_h, 0), wstart = max(pw * stride_w - pad_w, 0);
    const int hend = min(ph * stride_h - pad_h + kernel_h, height);
    const int wend = min(pw * stride_w - pad_w + kernel_w, width);
    __global const float* image = x + plane * height * width;
    float total = 0.0f;
    for (int h = hstart; h < hend; ++h)
        for (int w = wstart; w < wend; ++w) total += image[h * width + w];
    y[index] = total / ave_divisor(ph, pw, height, width, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w);
}

// dx (N, C, H, W): the sum over the windows holding the pixel of dy / the window's divisor.
__kernel void ave_pool_backward(__global const float* dy, __global float* dx, POOL_GEOMETRY) {
    const int index = get_global_id(0);
    if (index >= batch * channels * height * width) return;
    const int w = index % width;
    const int h = (index / width) % height;
    const int plane = index / (width * height);
    const int hp = h + pad_h, wp = w + pad_w;
    const int phstart = hp < kernel_h ? 0 : (hp - kernel_h) / stride_h + 1;
    const int phend = min(hp / stride_h + 1, pooled_h);
    const int pwstart = wp < kernel_w ? 0 : (wp - kernel_w) / stride_w + 1;
    const int pwend = min(wp / stride_w + 1, pooled_w);
    __global const float* grad = dy + plane * pooled_h * pooled_w;
    float total = 0.0f;
    for (int ph = phstart; ph < phend; ++ph)
        for (int pw = pwstart; pw < pwend; ++pw)
            total += grad[ph * pooled_w + pw]
                     / ave_divisor(ph, pw, height, width, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w);
    dx[index] = total;
}
