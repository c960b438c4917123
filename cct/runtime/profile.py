"""FLOP counts per layer, for `cct time` and the benchmarks (bench/).

Conventions (as the Caffe con Troll paper and the usual CNN FLOP tables count):
a multiply-add is 2 FLOPs; only the arithmetic a layer needs is counted, not
what an implementation happens to do (lowering copies, buffer fills are free).

Each layer class counts its own (Layer.flops); the conventions they follow:

    Convolution     forward   2 * N * OH*OW * weight.count    (a GEMM per group)
                    backward  the same for the weight gradient, and again for the
                              bottom gradient when the bottom needs one
    Deconvolution   as the convolution it transposes: the spatial size is the
                    bottom's (a deconvolution's forward is a convolution's backward)
    InnerProduct    forward 2 * M * weight.count; backward as Convolution
    Pooling         forward one compare (MAX) or add (AVE) per window cell,
                    N*C*PH*PW*KH*KW; backward the same (routing / spreading)
    LRN             ACROSS_CHANNELS: forward N*C*H*W * (local_size + 5): square,
                    window sum, scale, power, product; backward N*C*H*W * (local_size + 7)
                    WITHIN_CHANNEL: local_size^2 in place of local_size
Biases are left out (N*out adds, under 0.1% for the nets we time). Other layer
types count 0: they are memory bound and GFLOP/s says nothing about them.

CaffeNet at batch 1 counts 1.45 GFLOP forward and 4.14 GFLOP for training
(conv1's bottom needs no gradient), the figures the issue quotes.
"""


def layer_flops(layer, bottoms, tops, bottom_needs_backward=None):
    """(forward FLOPs, backward FLOPs) of one layer at its blobs' current shapes,
    from the layer's own count (Layer.flops).

    `bottom_needs_backward`: per bottom, whether backward computes its gradient
    (the net's bottom_need_backward[i]); None counts every bottom. The
    parameter gradients count when the layer learns (param_propagate_down)."""
    if not bottoms or not tops:
        return 0, 0
    forward, backward_data, backward_params = layer.flops(bottoms, tops)
    need_data_grad = any(bottom_needs_backward) if bottom_needs_backward is not None else True
    learns = bool(layer.param_propagate_down and layer.param_propagate_down[0])
    return forward, backward_data * int(need_data_grad) + backward_params * int(learns)


def net_flops(net, every_backward=False):
    """[(forward, backward)] per layer of a built net, at its current shapes;
    backward counts 0 for a layer the net runs no backward for, unless
    `every_backward` (`cct time` runs every layer's backward, as Caffe's does)."""
    counts = []
    for i, layer in enumerate(net.layers):
        forward, backward = layer_flops(layer, net.bottom_vecs[i], net.top_vecs[i],
                                        net.bottom_need_backward[i])
        counts.append((forward, backward if every_backward or net.layer_need_backward[i] else 0))
    return counts


def gemm_peak(size=2048, repeats=5):
    """Best single-precision GEMM rate (GFLOP/s) of numpy's BLAS with its current
    thread count: C = A @ B with square float32 matrices of `size`, best of
    `repeats` after one warm-up call."""
    import time
    import numpy as np
    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size), dtype=np.float32)
    b = rng.standard_normal((size, size), dtype=np.float32)
    c = np.empty((size, size), np.float32)
    np.matmul(a, b, out=c)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.matmul(a, b, out=c)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size ** 3 / best / 1e9
