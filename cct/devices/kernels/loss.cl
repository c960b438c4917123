// SoftmaxWithLoss on the device (layers/loss.py): each position's
// log-probability, their sum reduced here into the loss (the host reads that
// one scalar), and the gradient scaled by the loss weight and the normalizer
// read here too. Built with -cl-fp32-correctly-rounded-divide-sqrt: the
// gradient's scale, weight / normalizer, is then the host's float32 bit for bit.
// The numpy reference of each is the same-named method of cct.devices.cpu.
#pragma OPENCL FP_CONTRACT OFF

#ifdef cl_khr_fp64
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
typedef double total_t;        // the host sums the loss in float64
#else
typedef float total_t;
#endif

#define GROUP 256              // opencl.py's WORK_GROUP: softmax_loss_reduce runs as one group of it
#define NO_POSITION 2147483647

// Per position k = o * inner + s: out[k] = log(max(p, FLT_MIN)) of the label's
// probability and out[positions + k] = 1; an ignored label 0 and 0; a label
// outside [0, channels) its truncated value and -1 (softmax_loss_reduce flags it)
__kernel void softmax_loss_forward(const int positions, const int channels, const int inner,
                                   __global const float* prob, __global const float* labels, __global float* out,
                                   const int has_ignore, const int ignore_label) {
    const int index = get_global_id(0);
    if (index >= positions) return;
    const float label = trunc(labels[index]);           // Caffe's int cast
    if (has_ignore && label == (float)ignore_label) {
        out[index] = 0.0f;
        out[positions + index] = 0.0f;
    } else if (!(label >= 0.0f && label < (float)channels)) {
        out[index] = label;
        out[positions + index] = -1.0f;
    } else {
        const int o = index / inner, s = index % inner;
        const float p = prob[(o * channels + (int)label) * inner + s];
        out[index] = log(fmax(p, FLT_MIN));
        out[positions + index] = 1.0f;
    }
}

// One work group of GROUP items, in a fixed order (deterministic): item i sums
// positions i, i + GROUP, ... of softmax_loss_forward's `values`, then the
// items' sums are added pairwise in a tree. loss[0] = -(the valid positions'
// sum) / normalizer, NaN where a label is bad; stats = {normalizer, the first
// bad position or -1, its label}; normalizer = max(1, the valid count when
// by_count (VALID), else fixed).
__kernel void softmax_loss_reduce(const int positions, __global const float* values, __global float* loss,
                                  __global float* stats, const int by_count, const float fixed) {
    __local total_t sums[GROUP];
    __local int counts[GROUP];
    __local int bad[GROUP];
    const int item = get_local_id(0);
    total_t sum = 0;
    int count = 0, first_bad = NO_POSITION;
    for (int k = item; k < positions; k += GROUP) {
        const float flag = values[positions + k];
        if (flag > 0.0f) {
            sum += values[k];
            count += 1;
        } else if (flag < 0.0f && first_bad == NO_POSITION) {
            first_bad = k;
        }
    }
    sums[item] = sum;
    counts[item] = count;
    bad[item] = first_bad;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int width = GROUP / 2; width > 0; width /= 2) {
        if (item < width) {
            sums[item] += sums[item + width];
            counts[item] += counts[item + width];
            bad[item] = min(bad[item], bad[item + width]);
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (item == 0) {
        const float normalizer = fmax(1.0f, by_count ? (float)counts[0] : fixed);
        const int first = bad[0];
        stats[0] = normalizer;
        stats[1] = first == NO_POSITION ? -1.0f : (float)first;
        stats[2] = first == NO_POSITION ? 0.0f : values[first];
        loss[0] = first == NO_POSITION ? (float)((0 - sums[0]) / normalizer) : NAN;
    }
}

// dx (outer, channels, inner) = (prob - [c == label]) * (weight[0] / stats[0]),
// 0 at an ignored label: the loss weight (the loss top's diff) over the
// normalizer softmax_loss_reduce left in stats[0]
__kernel void softmax_loss_backward(const int count, const int channels, const int inner,
                                    __global const float* prob, __global const float* labels, __global float* dx,
                                    __global const float* weight, __global const float* stats,
                                    const int has_ignore, const int ignore_label) {
    const int index = get_global_id(0);
    if (index >= count) return;
    const int s = index % inner, c = (index / inner) % channels, o = index / (inner * channels);
    const float label = trunc(labels[o * inner + s]);
    if (has_ignore && label == (float)ignore_label) {
        dx[index] = 0.0f;
        return;
    }
    const float scale = weight[0] / stats[0];
    dx[index] = (prob[index] - (label == (float)c ? 1.0f : 0.0f)) * scale;
}
