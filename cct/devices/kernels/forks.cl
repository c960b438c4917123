// Kernels of the forks' layers (layers/ssd.py, segmentation.py, shape.py, roi.py):
// strided copies, Normalize's division and gradient, Interp's bilinear resize
// and its adjoint, unpooling, SSD's box decoding, ROI max and position-sensitive
// average pooling and their gradients. One work item per output element (per plane for
// unpooling, whose later values win), so results do not depend on scheduling.
// The numpy reference of each is the same-named method of cct.devices.cpu.

// Round every product before a sum, as numpy does: no fused multiply-add.
#pragma OPENCL FP_CONTRACT OFF

// Results rounded once to float: in double where the device has it (a double
// quotient of floats rounds to float as the float quotient does; a double exp
// to the nearest float), else in float (a division correctly
// rounded where the device's is, as pocl's; OpenCL's float exp within 3 ulps)
#ifdef cl_khr_fp64
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
inline float quotient(const float sum, const int area) { return (float)((double)sum / (double)area); }
inline float rounded_exp(const float x) { return (float)exp((double)x); }
#else
inline float quotient(const float sum, const int area) { return sum / (float)area; }
inline float rounded_exp(const float x) { return exp(x); }
#endif

// For every index of shape (axes 0 .. axes-1, at most 8, row-major):
// dst[dst_offset + sum i_k dst_strides_k] (+)= src[src_offset + sum i_k src_strides_k]
__kernel void copy_strided(const int total, const int axes, const int8 shape, __global const float* src,
                           const int src_offset, const int8 src_strides, __global float* dst,
                           const int dst_offset, const int8 dst_strides, const int accumulate) {
    const int index = get_global_id(0);
    if (index >= total) return;
    const int sizes[8] = {shape.s0, shape.s1, shape.s2, shape.s3, shape.s4, shape.s5, shape.s6, shape.s7};
    const int from[8] = {src_strides.s0, src_strides.s1, src_strides.s2, src_strides.s3,
                         src_strides.s4, src_strides.s5, src_strides.s6, src_strides.s7};
    const int to[8] = {dst_strides.s0, dst_strides.s1, dst_strides.s2, dst_strides.s3,
                       dst_strides.s4, dst_strides.s5, dst_strides.s6, dst_strides.s7};
    int rest = index, source = src_offset, target = dst_offset;
    for (int k = axes - 1; k >= 0; --k) {
        const int i = rest % sizes[k];
        rest /= sizes[k];
        source += i * from[k];
        target += i * to[k];
    }
    dst[target] = accumulate ? dst[target] + src[source] : src[source];
}

// y (outer, axis, inner) = x / divisor[o, i]
__kernel void divide_across(const int total, const int axis, const int inner, __global const float* x,
                            __global const float* divisor, __global float* y) {
    const int index = get_global_id(0);
    if (index >= total) return;
    const int o = index / (axis * inner), i = index % inner;
    y[index] = x[index] / divisor[o * inner + i];
}

// dx = (dy - x * dot[o, i] / (n * n)) / n, n = norm[o, i]
__kernel void l2_normalize_backward(const int total, const int axis, const int inner, __global const float* x,
                                    __global const float* dy, __global const float* norm,
                                    __global const float* dot, __global float* dx) {
    const int index = get_global_id(0);
    if (index >= total) return;
    const int at = index / (axis * inner) * inner + index % inner;
    const float n = norm[at];
    dx[index] = (dy[index] - x[index] * dot[at] / (n * n)) / n;
}

// An Interp table's entries (cct.devices.base): out outputs, size inputs
#define INDEX(t, out, k) ((int)(t)[k])
#define STEP(t, out, k) ((int)(t)[(out) + (k)])
#define LAMBDA0(t, out, k) ((t)[2 * (out) + (k)])
#define LAMBDA1(t, out, k) ((t)[3 * (out) + (k)])
#define FIRST(t, out, r) ((int)(t)[4 * (out) + (r)])
#define LAST(t, out, size, r) ((int)(t)[4 * (out) + (size) + (r)])

__kernel void interp_forward(const int total, __global const float* x, __global float* y, const int in_h,
                             const int in_w, const int out_h, const int out_w, __global const float* th,
                             __global const float* tw) {
    const int index = get_global_id(0);
    if (index >= total) return;
    const int w = index % out_w, h = (index / out_w) % out_h, p = index / (out_w * out_h);
    const int i = INDEX(th, out_h, h), si = STEP(th, out_h, h);
    const int j = INDEX(tw, out_w, w), sj = STEP(tw, out_w, w);
    const float h0 = LAMBDA0(th, out_h, h), h1 = LAMBDA1(th, out_h, h);
    const float w0 = LAMBDA0(tw, out_w, w), w1 = LAMBDA1(tw, out_w, w);
    __global const float* upper = x + (p * in_h + i) * in_w;
    __global const float* lower = upper + si * in_w;
    y[index] = h0 * (w0 * upper[j] + w1 * upper[j + sj]) + h1 * (w0 * lower[j] + w1 * lower[j + sj]);
}

// dx[p, r, c]: the terms of the outputs that read (r, c), in output order
__kernel void interp_backward(const int total, __global const float* dy, __global float* dx, const int in_h,
                              const int in_w, const int out_h, const int out_w, __global const float* th,
                              __global const float* tw) {
    const int index = get_global_id(0);
    if (index >= total) return;
    const int c = index % in_w, r = (index / in_w) % in_h, p = index / (in_w * in_h);
    float sum = 0.0f;
    for (int h = FIRST(th, out_h, r); h < LAST(th, out_h, in_h, r); ++h) {
        const int i = INDEX(th, out_h, h), si = STEP(th, out_h, h);
        const float h0 = LAMBDA0(th, out_h, h), h1 = LAMBDA1(th, out_h, h);
        for (int w = FIRST(tw, out_w, c); w < LAST(tw, out_w, in_w, c); ++w) {
            const int j = INDEX(tw, out_w, w), sj = STEP(tw, out_w, w);
            const float w0 = LAMBDA0(tw, out_w, w), w1 = LAMBDA1(tw, out_w, w);
            const float g = dy[(p * out_h + h) * out_w + w];
            if (i == r && j == c) sum += h0 * w0 * g;
            if (i == r && j + sj == c) sum += h0 * w1 * g;
            if (i + si == r && j == c) sum += h1 * w0 * g;
            if (i + si == r && j + sj == c) sum += h1 * w1 * g;
        }
    }
    dx[index] = sum;
}

// One plane p: y[p, mask[p, i]] = x[p, i] in order (y zeroed before)
__kernel void unpool_forward(const int planes, __global const float* x, __global const float* mask,
                             __global float* y, const int pixels, const int out_pixels) {
    const int p = get_global_id(0);
    if (p >= planes) return;
    for (int i = p * pixels; i < (p + 1) * pixels; ++i) {
        const float cell = mask[i];           // truncated below: (-1, out_pixels) are the cells
        if (cell > -1.0f && cell < (float)out_pixels) y[p * out_pixels + (int)cell] = x[i];
    }
}

__kernel void unpool_backward(const int total, __global const float* dy, __global const float* mask,
                              __global float* dx, const int pixels, const int out_pixels) {
    const int index = get_global_id(0);
    if (index >= total) return;
    const float cell = mask[index];
    const bool inside = cell > -1.0f && cell < (float)out_pixels;
    dx[index] = inside ? dy[index / pixels * out_pixels + (int)cell] : 0.0f;
}

// --- SSD's DetectionOutput (layers/ssd.py) ---------------------------------------------
// boxes (N, P, L, 4): one box per item, loc (N, P, L, 4) decoded against the
// priors (2, P * 4: boxes, then variances); code_type 1 CORNER, 2 CENTER_SIZE,
// 3 CORNER_SIZE; with variance_in_target the variances are left out
__kernel void decode_boxes(const int total, __global const float* loc, __global const float* priors,
                           __global float* boxes, const int num_priors, const int loc_classes,
                           const int code_type, const int variance_in_target) {
    const int index = get_global_id(0);
    if (index >= total) return;
    const int p = (index / loc_classes) % num_priors;
    __global const float* prior = priors + 4 * p;
    __global const float* var = priors + 4 * (num_priors + p);
    __global const float* offset = loc + 4 * index;
    __global float* box = boxes + 4 * index;
    float s[4];
    for (int k = 0; k < 4; ++k) s[k] = variance_in_target ? offset[k] : var[k] * offset[k];
    const float width = prior[2] - prior[0], height = prior[3] - prior[1];
    if (code_type == 1) {
        for (int k = 0; k < 4; ++k) box[k] = prior[k] + s[k];
    } else if (code_type == 3) {
        box[0] = prior[0] + s[0] * width;
        box[1] = prior[1] + s[1] * height;
        box[2] = prior[2] + s[2] * width;
        box[3] = prior[3] + s[3] * height;
    } else {
        const float cx = s[0] * width + (prior[0] + prior[2]) / 2.0f;
        const float cy = s[1] * height + (prior[1] + prior[3]) / 2.0f;
        const float w = rounded_exp(s[2]) * width, h = rounded_exp(s[3]) * height;
        box[0] = cx - w / 2.0f;
        box[1] = cy - h / 2.0f;
        box[2] = cx + w / 2.0f;
        box[3] = cy + h / 2.0f;
    }
}

// --- pooling over regions of interest (layers/roi.py) ----------------------------------
// A bins table (cct.devices.base): [0, R) each ROI's image, then (R, PH) first
// rows, (R, PH) row ends, (R, PW) first columns, (R, PW) column ends.
#define ROI_IMAGE(t, r) ((int)(t)[r])
#define BIN_TOP(t, rois, ph_n, r, ph) ((int)(t)[(rois) + (r) * (ph_n) + (ph)])
#define BIN_BOTTOM(t, rois, ph_n, r, ph) ((int)(t)[(rois) * (1 + (ph_n)) + (r) * (ph_n) + (ph)])
#define BIN_LEFT(t, rois, ph_n, pw_n, r, pw) ((int)(t)[(rois) * (1 + 2 * (ph_n)) + (r) * (pw_n) + (pw)])
#define BIN_RIGHT(t, rois, ph_n, pw_n, r, pw) ((int)(t)[(rois) * (1 + 2 * (ph_n) + (pw_n)) + (r) * (pw_n) + (pw)])

// y, argmax (R, C, PH, PW): each bin's first maximum and its index h*W + w
__kernel void roi_max_pool_forward(const int total, __global const float* x, __global const float* bins,
                                   __global float* y, __global float* argmax, const int channels, const int height,
                                   const int width, const int rois, const int pooled_h, const int pooled_w) {
    const int index = get_global_id(0);
    if (index >= total) return;
    const int pw = index % pooled_w, ph = (index / pooled_w) % pooled_h;
    const int c = (index / (pooled_w * pooled_h)) % channels, r = index / (pooled_w * pooled_h * channels);
    const int h0 = BIN_TOP(bins, rois, pooled_h, r, ph), h1 = BIN_BOTTOM(bins, rois, pooled_h, r, ph);
    const int w0 = BIN_LEFT(bins, rois, pooled_h, pooled_w, r, pw);
    const int w1 = BIN_RIGHT(bins, rois, pooled_h, pooled_w, r, pw);
    if (h1 <= h0 || w1 <= w0) {             // an empty bin
        y[index] = 0.0f;
        argmax[index] = -1.0f;
        return;
    }
    __global const float* plane = x + (ROI_IMAGE(bins, r) * channels + c) * height * width;
    float best = -FLT_MAX;
    int where = -1;
    for (int h = h0; h < h1; ++h) {
        for (int w = w0; w < w1; ++w) {
            if (plane[h * width + w] > best) {    // strict: the first maximum stays; NaN never wins
                best = plane[h * width + w];
                where = h * width + w;
            }
        }
    }
    y[index] = best;
    argmax[index] = (float)where;
}

// dx (N, C, H, W): per pixel, the dy of the bins whose argmax it is, among the
// bins its feasible entries name ((R, H) inside, first, end; then (R, W) alike)
__kernel void roi_max_pool_backward(const int total, __global const float* dy, __global const float* argmax,
                                    __global const float* bins, __global const float* feasible, __global float* dx,
                                    const int channels, const int height, const int width, const int rois,
                                    const int pooled_h, const int pooled_w) {
    const int index = get_global_id(0);
    if (index >= total) return;
    const int w = index % width, h = (index / width) % height;
    const int c = (index / (width * height)) % channels, n = index / (width * height * channels);
    const float cell = (float)(h * width + w);
    __global const float* rows = feasible;                     // inside, first, end: each (R, H)
    __global const float* cols = feasible + 3 * rois * height;  // each (R, W)
    float sum = 0.0f;
    for (int r = 0; r < rois; ++r) {
        const int at_h = r * height + h, at_w = r * width + w;
        if (ROI_IMAGE(bins, r) != n || rows[at_h] == 0.0f || cols[at_w] == 0.0f) continue;
        const int first_ph = (int)rows[rois * height + at_h], end_ph = (int)rows[2 * rois * height + at_h];
        const int first_pw = (int)cols[rois * width + at_w], end_pw = (int)cols[2 * rois * width + at_w];
        const int plane = (r * channels + c) * pooled_h * pooled_w;
        for (int ph = first_ph; ph < end_ph; ++ph) {
            for (int pw = first_pw; pw < end_pw; ++pw) {
                if (argmax[plane + ph * pooled_w + pw] == cell) sum += dy[plane + ph * pooled_w + pw];
            }
        }
    }
    dx[index] = sum;
}

// y (R, D, G, G): bin (ph, pw) of channel d averages channel (d*G + ph)*G + pw
__kernel void psroi_pool_forward(const int total, __global const float* x, __global const float* bins,
                                 __global float* y, const int channels, const int height, const int width,
                                 const int rois, const int group) {
    const int index = get_global_id(0);
    if (index >= total) return;
    const int dims = channels / (group * group);
    const int pw = index % group, ph = (index / group) % group;
    const int d = (index / (group * group)) % dims, r = index / (group * group * dims);
    const int h0 = BIN_TOP(bins, rois, group, r, ph), h1 = BIN_BOTTOM(bins, rois, group, r, ph);
    const int w0 = BIN_LEFT(bins, rois, group, group, r, pw), w1 = BIN_RIGHT(bins, rois, group, group, r, pw);
    __global const float* plane = x + (ROI_IMAGE(bins, r) * channels + (d * group + ph) * group + pw)
                                      * height * width;
    float sum = 0.0f;
    for (int h = h0; h < h1; ++h) {
        for (int w = w0; w < w1; ++w) sum += plane[h * width + w];
    }
    const int area = (h1 - h0) * (w1 - w0);
    y[index] = area > 0 ? quotient(sum, area) : 0.0f;
}

// dx (N, C, H, W): per pixel, its channel's bin's dy / area for every ROI of its image holding it
__kernel void psroi_pool_backward(const int total, __global const float* dy, __global const float* bins,
                                  __global float* dx, const int channels, const int height, const int width,
                                  const int rois, const int group) {
    const int index = get_global_id(0);
    if (index >= total) return;
    const int w = index % width, h = (index / width) % height;
    const int c = (index / (width * height)) % channels, n = index / (width * height * channels);
    const int pw = c % group, ph = (c / group) % group, d = c / (group * group);
    const int dims = channels / (group * group);
    float sum = 0.0f;
    for (int r = 0; r < rois; ++r) {
        if (ROI_IMAGE(bins, r) != n) continue;
        const int h0 = BIN_TOP(bins, rois, group, r, ph), h1 = BIN_BOTTOM(bins, rois, group, r, ph);
        const int w0 = BIN_LEFT(bins, rois, group, group, r, pw), w1 = BIN_RIGHT(bins, rois, group, group, r, pw);
        if (h < h0 || h >= h1 || w < w0 || w >= w1) continue;
        sum += quotient(dy[((r * dims + d) * group + ph) * group + pw], (h1 - h0) * (w1 - w0));
    }
    dx[index] = sum;
}
