// Kernels of the layers in layers/loss.py, elementwise.py and shape.py:
// block copies (Concat, Slice), element-wise maps (Eltwise, Dropout, Scale,
// Bias), softmax (its loss: loss.cl). As in core.cl, each work item writes its own
// outputs (one element, or one (outer, inner) column whose channels it loops
// over), so results do not depend on scheduling.
// The numpy reference of each is the same-named method of cct.devices.cpu.

// Round every product before a sum, as numpy does: no fused multiply-add.
#pragma OPENCL FP_CONTRACT OFF

// dst[dst_offset + b * dst_stride + e] = src[src_offset + b * src_stride + e], b < blocks, e < size
__kernel void copy_blocks(const int total, const int size, __global const float* src, const int src_offset,
                          const int src_stride, __global float* dst, const int dst_offset, const int dst_stride) {
    const int index = get_global_id(0);
    if (index >= total) return;
    const int block = index / size, element = index % size;
    dst[dst_offset + block * dst_stride + element] = src[src_offset + block * src_stride + element];
}

__kernel void multiply(const int count, __global const float* a, __global const float* b, __global float* out) {
    const int index = get_global_id(0);
    if (index >= count) return;
    out[index] = a[index] * b[index];
}

// A 32-bit integer hash (Wellons' lowbias32): one draw per element from the
// seed, so the mask does not depend on scheduling
uint mix(uint x) {
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    x ^= x >> 16;
    return x;
}

// mask[i] = scale where a uniform draw in [0, 1) (24 bits of mix(mix(seed) + i)) is < keep, else 0
__kernel void dropout_mask(const int count, __global float* mask, const int seed, const float keep,
                           const float scale) {
    const int index = get_global_id(0);
    if (index >= count) return;
    const uint bits = mix(mix((uint)seed) + (uint)index);
    const float uniform = (float)(bits >> 8) * (1.0f / 16777216.0f);
    mask[index] = uniform < keep ? scale : 0.0f;
}

__kernel void divide(const int count, __global const float* a, __global const float* b, __global float* out) {
    const int index = get_global_id(0);
    if (index >= count) return;
    out[index] = a[index] / b[index];
}

// y (outer, dim, inner) = x * scale[d] + bias[d]; has_scale / has_bias 0: that term left out
__kernel void broadcast_affine(const int count, const int dim, const int inner, __global const float* x,
                               __global float* y, __global const float* scale, const int has_scale,
                               __global const float* bias, const int has_bias) {
    const int index = get_global_id(0);
    if (index >= count) return;
    const int d = (index / inner) % dim;
    float value = x[index];
    if (has_scale) value = value * scale[d];
    if (has_bias) value = value + bias[d];
    y[index] = value;
}

// Eltwise MAX's step to bottom `which`: a the running max, b the bottom
__kernel void eltwise_max(const int count, __global const float* a, __global const float* b,
                          __global float* out, __global float* argmax, const int which) {
    const int index = get_global_id(0);
    if (index >= count) return;
    const float kept = a[index], next = b[index];
    if (which == 1) {                                   // ties go to bottom 1
        argmax[index] = kept > next ? 0.0f : 1.0f;
    } else if (next > kept) {
        argmax[index] = (float)which;
    }
    out[index] = next > kept ? next : kept;
}

__kernel void keep_where_index(const int count, __global const float* dy, __global const float* argmax,
                               const int which, __global float* dx) {
    const int index = get_global_id(0);
    if (index >= count) return;
    dx[index] = dy[index] * (argmax[index] == (float)which ? 1.0f : 0.0f);
}

// One item per (o, s) column of x (outer, channels, inner): its max, then its
// exponentials (kept in y) and their sum, then the quotients
__kernel void softmax_forward(const int columns, const int channels, const int inner,
                              __global const float* x, __global float* y) {
    const int index = get_global_id(0);
    if (index >= columns) return;
    const int start = (index / inner) * channels * inner + index % inner;
    float top = x[start];
    for (int c = 1; c < channels; ++c) top = fmax(top, x[start + c * inner]);
    float total = 0.0f;
    for (int c = 0; c < channels; ++c) {
        const float value = exp(x[start + c * inner] - top);
        y[start + c * inner] = value;
        total += value;
    }
    for (int c = 0; c < channels; ++c) y[start + c * inner] /= total;
}

// dx = (dy - sum over the column of dy * y) * y, one item per column; dx may be dy
__kernel void softmax_backward(const int columns, const int channels, const int inner,
                               __global const float* y, __global const float* dy, __global float* dx) {
    const int index = get_global_id(0);
    if (index >= columns) return;
    const int start = (index / inner) * channels * inner + index % inner;
    float dot = 0.0f;
    for (int c = 0; c < channels; ++c) dot += dy[start + c * inner] * y[start + c * inner];
    for (int c = 0; c < channels; ++c) {
        const int at = start + c * inner;
        dx[at] = (dy[at] - dot) * y[at];
    }
}
