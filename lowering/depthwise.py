"""Depthwise convolution computed directly. Where a geometry's groups are its
input channels and its outputs (group == C == O > 1: MobileNets' 3 x 3
layers), each channel is convolved with its own KH x KW kernel, and the
lowerings' one GEMM per group would multiply a 1 x (KH*KW) row by that
group's lowered matrix: C products too thin to pay for the lowering. These
kernels loop over the windows instead, an output row at a time, in the
blobs' own layouts:

    x   (N, C, H, W)       input batch
    w   (C, 1, KH, KW)     kernel
    y   (N, C, OH, OW)     output
    dw  (C, 1, KH, KW)     weight gradient over the batch

Row i, column j of the window of output (oh, ow) reads input (oh*sh - ph +
i*dh, ow*sw - pw + j*dw); a cell outside the input reads as zero, as in
Caffe's im2col. conv_forward and conv_backward (cct.lowering) run these for
such a geometry whatever the lowering type; the tests hold them against the
grouped lowerings and against the fork's loops (caffe-mobilenet's
conv_dw_layer.cpp). Each kernel's innermost loop runs over a row's outputs
by its own counter, so it vectorises at stride 1.
"""
import numpy as np

from cct.devices.jit import PLANE_GROUPS, kernel, parallel_kernel, prange

from .geometry import finish, weights_as


def applies(geom):
    """Whether these kernels run this geometry: one input channel and one
    output per group, more than one group."""
    return geom.group > 1 and geom.group == geom.channels == geom.num_output


# --- the layout: each plane padded and split into stride phases ---------------------
# Phase (a, b) of a plane holds its padded cells (q*SH + a, e*SW + b) at
# q*WQ + e, for q < HQ = OH + (KH-1)*dh // SH and e < WQ = OW + (KW-1)*dw // SW.
# Window cell (i, j) of output (oh, ow) is then in phase (i*dh % SH, j*dw % SW)
# at t + (i*dh // SH)*WQ + j*dw // SW, t = oh*WQ + ow: every tap is one
# unit-stride pass over t < SPAN = (OH-1)*WQ + OW, which vectorises (the
# t past each row's OW outputs are computed and dropped).
@kernel
def _layout(kernel_h, kernel_w, stride_h, stride_w, dilation_h, dilation_w, out_h, out_w):
    """(HQ, WQ, SPAN) of the layout above."""
    rows = out_h + (kernel_h - 1) * dilation_h // stride_h
    cols = out_w + (kernel_w - 1) * dilation_w // stride_w
    return rows, cols, (out_h - 1) * cols + out_w


@kernel
def _buffers(kernel_h, kernel_w, stride_h, stride_w, dilation_h, dilation_w, out_h, out_w, like):
    """(HQ, WQ, SPAN, the phases (SH*SW, HQ*WQ), an extended row (SPAN)), in like's dtype."""
    rows, cols, span = _layout(kernel_h, kernel_w, stride_h, stride_w, dilation_h, dilation_w, out_h, out_w)
    return (rows, cols, span, np.empty((stride_h * stride_w, rows * cols), like.dtype),
            np.empty(span, like.dtype))


@kernel
def _tap(i, j, stride_h, stride_w, dilation_h, dilation_w, cols):
    """(phase, offset) of window cell (i, j) in the layout above."""
    phase = (i * dilation_h % stride_h) * stride_w + j * dilation_w % stride_w
    return phase, (i * dilation_h // stride_h) * cols + j * dilation_w // stride_w


@kernel
def _split(plane, height, width, stride_h, stride_w, pad_h, pad_w, rows, cols, phases):
    """phases (SH*SW, HQ*WQ) from plane (H*W), the cells outside it 0."""
    phases[:] = 0
    for a in range(stride_h):
        for b in range(stride_w):
            phase = phases[a * stride_w + b]
            for q in range(rows):
                h = q * stride_h + a - pad_h
                if h < 0 or h >= height:
                    continue
                first = max(0, -((b - pad_w) // stride_w))                  # e with 0 <= e*SW + b - pw
                last = min(cols, (width - 1 - b + pad_w) // stride_w + 1)   # ... < W
                if last <= first:
                    continue
                start = h * width + first * stride_w + b - pad_w
                source = plane[start:start + (last - first - 1) * stride_w + 1:stride_w]
                target = phase[q * cols + first:q * cols + last]
                for e in range(last - first):
                    target[e] = source[e]


@kernel
def _gather(phases, height, width, stride_h, stride_w, pad_h, pad_w, rows, cols, plane):
    """plane (H*W) = its cells' values in phases (SH*SW, HQ*WQ) (_split
    backwards; a cell no phase holds is 0)."""
    for h in range(height):
        a, q = (h + pad_h) % stride_h, (h + pad_h) // stride_h
        row = plane[h * width:(h + 1) * width]
        row[:] = 0
        if q >= rows:
            continue
        for b in range(stride_w):
            phase = phases[a * stride_w + b]
            first = max(0, -((b - pad_w) // stride_w))
            last = min(cols, (width - 1 - b + pad_w) // stride_w + 1)
            if last <= first:
                continue
            start = first * stride_w + b - pad_w
            target = row[start:start + (last - first - 1) * stride_w + 1:stride_w]
            source = phase[q * cols + first:q * cols + last]
            for e in range(last - first):
                target[e] = source[e]


# Outputs per pass of every tap: the pass's slices of the output and the
# phases stay in the L1 cache while all KH*KW taps add to them
_CHUNK = 1024


@kernel
def _copy_rows(source, source_pitch, target, target_pitch, rows, width):
    """target's rows (pitch target_pitch) = source's (pitch source_pitch), `width` values each."""
    for r in range(rows):
        taken = source[r * source_pitch:r * source_pitch + width]
        into = target[r * target_pitch:r * target_pitch + width]
        for k in range(width):
            into[k] = taken[k]


@kernel
def _taps(weights, kernel_h, kernel_w, stride_h, stride_w, dilation_h, dilation_w, cols, span, spread, phases,
          extended):
    """Every window cell's pass over the layout, _CHUNK outputs at a time:
    extended (SPAN) = sum of weights[i*KW + j] * the cell's phase slice; or,
    `spread`, each cell's phase slice += its weight * extended."""
    for start in range(0, span, _CHUNK):
        count = min(_CHUNK, span - start)
        values = extended[start:start + count]
        if not spread:
            values[:] = 0
        for i in range(kernel_h):
            for j in range(kernel_w):
                phase, offset = _tap(i, j, stride_h, stride_w, dilation_h, dilation_w, cols)
                weight = weights[i * kernel_w + j]
                cells = phases[phase, offset + start:offset + start + count]
                if spread:
                    for t in range(count):
                        cells[t] += weight * values[t]
                else:
                    for t in range(count):
                        values[t] += weight * cells[t]


@parallel_kernel
def _forward(x, w, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w, out_h, out_w, y):
    """y (N*C, OH*OW) = each plane of x (N*C, H, W) convolved with its channel's
    w (C, KH*KW)."""
    planes, height, width = x.shape
    channels = w.shape[0]
    groups = min(planes, PLANE_GROUPS)
    for group in prange(groups):
        rows, cols, span, phases, extended = _buffers(kernel_h, kernel_w, stride_h, stride_w, dilation_h,
                                                      dilation_w, out_h, out_w, x)
        for p in range(group * planes // groups, (group + 1) * planes // groups):
            _split(x[p].reshape(height * width), height, width, stride_h, stride_w, pad_h, pad_w, rows, cols,
                   phases)
            _taps(w[p % channels], kernel_h, kernel_w, stride_h, stride_w, dilation_h, dilation_w, cols, span,
                  False, phases, extended)
            _copy_rows(extended, cols, y[p], out_w, out_h, out_w)


@kernel
def _extend(dy, out_h, out_w, cols, extended):
    """extended (SPAN) = dy (OH*OW) in rows of WQ, the columns past OW 0."""
    extended[:] = 0
    _copy_rows(dy, out_w, extended, cols, out_h, out_w)


@kernel
def _backward_data(dy, w, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w, dx):
    """dx (N*C, H, W), set here: each window's gradient spread back through
    its channel's w (C, KH*KW), from dy (N*C, OH*OW)."""
    planes, height, width = dx.shape
    channels = w.shape[0]
    out_h, out_w = dy.shape[1], dy.shape[2]
    rows, cols, span, phases, extended = _buffers(kernel_h, kernel_w, stride_h, stride_w, dilation_h, dilation_w,
                                                  out_h, out_w, dy)
    for p in range(planes):
        _extend(dy[p].reshape(out_h * out_w), out_h, out_w, cols, extended)
        phases[:] = 0
        _taps(w[p % channels], kernel_h, kernel_w, stride_h, stride_w, dilation_h, dilation_w, cols, span, True,
              phases, extended)
        _gather(phases, height, width, stride_h, stride_w, pad_h, pad_w, rows, cols, dx[p].reshape(height * width))


# Products per running sum in the weight gradient: a block of sums the
# inner loop adds to element by element (a loop-carried float sum does not vectorise)
_BLOCK = 64


@kernel
def _backward_weights(x, dy, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w, dw):
    """dw (C, KH*KW) float64 += the sum over x (N*C, H, W)'s planes of each
    window cell times dy (N*C, OH, OW). Each plane's products are summed in
    x's dtype in _BLOCK running sums, those in float64."""
    planes, height, width = x.shape
    channels = dw.shape[0]
    out_h, out_w = dy.shape[1], dy.shape[2]
    rows, cols, span, phases, extended = _buffers(kernel_h, kernel_w, stride_h, stride_w, dilation_h, dilation_w,
                                                  out_h, out_w, x)
    sums = np.empty(_BLOCK, x.dtype)
    for p in range(planes):
        c = p % channels
        _split(x[p].reshape(height * width), height, width, stride_h, stride_w, pad_h, pad_w, rows, cols, phases)
        _extend(dy[p].reshape(out_h * out_w), out_h, out_w, cols, extended)
        for i in range(kernel_h):
            for j in range(kernel_w):
                phase, offset = _tap(i, j, stride_h, stride_w, dilation_h, dilation_w, cols)
                source = phases[phase, offset:offset + span]
                sums[:] = 0
                for start in range(0, span, _BLOCK):
                    count = min(_BLOCK, span - start)
                    taken, gradient = source[start:start + count], extended[start:start + count]
                    for t in range(count):
                        sums[t] += taken[t] * gradient[t]
                total = 0.0
                for t in range(_BLOCK):
                    total += sums[t]
                dw[c, i * kernel_w + j] += total


def _steps(geom):
    return (geom.kernel_h, geom.kernel_w, geom.stride_h, geom.stride_w, geom.pad_h, geom.pad_w, geom.dilation_h,
            geom.dilation_w)


def _planes(array):
    """(N*C, H, W): a batch's planes."""
    return array.reshape(array.shape[0] * array.shape[1], array.shape[2], array.shape[3])


def _into(out, shape, dtype):
    """(the array to return, a contiguous one the kernel writes): `out` itself
    where it is contiguous."""
    if out is None:
        out = np.empty(shape, dtype)
    return out, (out if out.flags.c_contiguous else np.empty(shape, dtype))


def forward(x, w, geom, out=None, bias=None, relu=None):
    """y (N, C, OH, OW) from x (N, C, H, W) and w (C, 1, KH, KW), plus bias
    (C,) and a ReLU of negative slope `relu` when given (conv_forward's terms)."""
    y, written = _into(out, geom.output_shape(x.shape[0]), x.dtype)
    _forward(np.ascontiguousarray(_planes(x)), weights_as(w, x.dtype).reshape(geom.channels, -1), *_steps(geom),
             geom.out_h, geom.out_w, written.reshape(-1, geom.out_h * geom.out_w))
    if written is not y:
        y[...] = written
    return finish(y, bias, relu)


def backward(x, dy, w, geom, data=True, weights=True, dx_out=None):
    """(dx or None, dw or None), conv_backward's terms: dx (N, C, H, W) into
    dx_out when given; dw (C, 1, KH, KW) over the batch, set."""
    dx = dw = None
    dy_planes = np.ascontiguousarray(_planes(dy))
    if data:
        dx, written = _into(dx_out, geom.input_shape(dy.shape[0]), dy.dtype)
        _backward_data(dy_planes, weights_as(w, dy.dtype).reshape(geom.channels, -1), *_steps(geom),
                       _planes(written))
        if written is not dx:
            dx[...] = written
    if weights:
        total = np.zeros((geom.channels, geom.kernel_h * geom.kernel_w), np.float64)
        _backward_weights(np.ascontiguousarray(_planes(x)), dy_planes, *_steps(geom), total)
        dw = total.astype(dy.dtype).reshape(geom.weight_shape)
    return dx, dw
