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

Memory traffic (layer_bytes), for each op's limit: the least a layer must
move, each array touched once. Forward reads its bottoms and parameters and
writes its tops; backward reads its tops' diffs, its bottoms (and, for an
in-place or element-wise layer, its tops), its parameters, and writes the
bottoms' diffs it computes and its parameter diffs (read and written: they
accumulate). An op's limit is the larger of its FLOPs at the GEMM peak and
its bytes at the memory bandwidth (the roofline), both measured by `cct time`
on this machine (gemm_peak, memory_bandwidth); `x limit` is its time over it.
"""
from typing import TYPE_CHECKING, Iterable, List, Optional, Sequence, Tuple

if TYPE_CHECKING:                 # for annotations only: no import of the core at run time
    from cct.core.blob import Blob
    from cct.core.layer import Layer
    from cct.core.net import Net

Counts = Tuple[int, int]          # (forward, backward)


def layer_flops(layer: "Layer", bottoms: Sequence["Blob"], tops: Sequence["Blob"],
                bottom_needs_backward: Optional[Sequence[bool]] = None) -> Counts:
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


def net_flops(net: "Net", every_backward: bool = False) -> List[Counts]:
    """[(forward, backward)] per layer of a built net, at its current shapes;
    backward counts 0 for a layer the net runs no backward for, unless
    `every_backward` (`cct time` runs every layer's backward, as Caffe's does)."""
    counts = []
    for i, layer in enumerate(net.layers):
        forward, backward = layer_flops(layer, net.bottom_vecs[i], net.top_vecs[i],
                                        net.bottom_need_backward[i])
        counts.append((forward, backward if every_backward or net.layer_need_backward[i] else 0))
    return counts


def layer_bytes(layer: "Layer", bottoms: Sequence["Blob"], tops: Sequence["Blob"],
                bottom_needs_backward: Optional[Sequence[bool]] = None) -> Counts:
    """(forward bytes, backward bytes) a layer must move at least (module docstring)."""
    def size(blobs: Iterable["Blob"]) -> int:
        return sum(blob.count * blob.dtype.itemsize for blob in blobs)
    needs = bottom_needs_backward if bottom_needs_backward is not None else [True] * len(bottoms)
    distinct_tops = [top for top in tops if not any(top is bottom for bottom in bottoms)]
    params = size(layer.blobs)
    forward = size(bottoms) + size(tops) + params
    backward = (size(tops) + size(bottoms) + size(distinct_tops) + params
                + size(b for b, need in zip(bottoms, needs) if need))
    if layer.param_propagate_down and layer.param_propagate_down[0]:
        backward += 2 * params
    return forward, backward


def net_bytes(net: "Net") -> List[Counts]:
    """[(forward, backward)] bytes per layer of a built net (every backward, as `cct time` runs it)."""
    return [layer_bytes(layer, net.bottom_vecs[i], net.top_vecs[i], net.bottom_need_backward[i])
            for i, layer in enumerate(net.layers)]


def memory_bandwidth(threads: int = 1, megabytes: int = 64, repeats: int = 5) -> float:
    """Best copy rate (GB/s, bytes read plus bytes written) of `threads`
    threads at once, each copying its own `megabytes` array: the rate an
    element-wise op can reach. Best of `repeats` after a warm-up copy."""
    import time
    import numpy as np
    from cct.runtime.threads import run_all, workers
    count = max(1, threads)
    sources = [np.ones(megabytes << 18, np.float32) for _ in range(count)]
    targets = [np.empty_like(source) for source in sources]
    pool = workers(count)

    def copy_all() -> None:
        run_all(pool, np.copyto, zip(targets, sources))
    copy_all()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        copy_all()
        best = min(best, time.perf_counter() - start)
    return 2.0 * count * sources[0].nbytes / best / 1e9


def limit_ms(flops: float, nbytes: float, peak: float, bandwidth: float) -> float:
    """An op's least time on this machine (ms): its FLOPs at the GEMM peak
    (GFLOP/s) or its bytes at the bandwidth (GB/s), whichever takes longer."""
    return max(flops / peak if peak else 0.0, nbytes / bandwidth if bandwidth else 0.0) / 1e6


def gemm_peak(size: int = 2048, repeats: int = 5) -> float:
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
