"""Pooling family: Pooling (MAX, AVE, STOCHASTIC) and SPP.

MAX and AVE run as compiled kernels (cct.devices.jit), one call per layer
pass; the numpy passes they replaced stay as the reference the tests check
them against (COMPILED = False runs them). Where the net never runs a MAX
layer's backward and it has no mask top, the forward finds the maxima alone,
and 3 x 3 windows at stride 1 pad 1 or at stride 2 run kernels of their own
(_max_3x3_same, _max_3x3_stride2). The kernels' layout, a block of planes in
column phases so that each window cell is one unit-stride run, is described
above _block_geometry. A kernel call runs on the calling thread: the
executor's batch partitions run them at once, and nothing splits a whole
layer's planes by default (set_parallel_runner). The measurements behind
each choice: BENCHMARKS.md, "Pooling kernels (issue 20)".
"""
import numpy as np

from cct.core.blob import Blob
from cct.devices.jit import kernel
from cct.core.layer import TRAIN, Layer, register
from cct.proto import caffe_pb2
from cct.core.rng import get_rng

MAX, AVE, STOCHASTIC = (caffe_pb2.PoolingParameter.MAX, caffe_pb2.PoolingParameter.AVE,
                        caffe_pb2.PoolingParameter.STOCHASTIC)
_POOL_NAMES = {MAX: "MAX", AVE: "AVE", STOCHASTIC: "STOCHASTIC"}
_FLT_MAX = float(np.finfo(np.float32).max)    # Caffe starts every max at -FLT_MAX
# MAX and AVE through the compiled kernels; False: the numpy passes (the reference).
COMPILED = True
# Output elements per batch chunk of the numpy passes: about 1 MiB of float32,
# where the chunk's work arrays stay in the CPU cache (measured: 2-4 images of
# CaffeNet's pool1 run 2x faster than the whole batch at once).
CHUNK_ELEMENTS = 1 << 18
# Padded input cells per block of planes in the kernels: the block's copies
# (padded, column phases, running maxima or sums) stay within the L2 cache.
BLOCK_CELLS = 1 << 15


@kernel
def _max_backward(dy, winner, kernel_w, stride_h, stride_w, pad_h, pad_w, dx):
    """dx (P, H, W), zeroed here, += each output's gradient of dy (P, PH, PW)
    at its window's winner (the offset i*KW + j; -1: none). The offset's row
    and column come from tables (an integer division per output would cost
    more than the rest); indices are unsigned, which spares numba's
    negative-index checks."""
    planes, out_h, out_w = dy.shape
    area = kernel_w * ((winner.max() if winner.size else 0) // kernel_w + 1)
    row_of = np.arange(area) // kernel_w
    col_of = np.arange(area) % kernel_w
    dx[...] = 0
    for p in range(planes):
        for oh in range(out_h):
            top = oh * stride_h - pad_h
            for ow in range(out_w):
                k = winner[p, oh, ow]
                if k >= 0:
                    dx[p, np.uint64(top + row_of[k]), np.uint64(ow * stride_w - pad_w + col_of[k])] += dy[p, oh, ow]


# --- the kernels' layout: a block of planes, padded, in column phases -----------------
# For kernel (KH, KW), stride (SH, SW) and output (PH, PW): phase rows WQ = PW +
# (KW-1)//SW wide, HP = SH * (PH + (KH-1)//SH) padded rows per plane, so window
# cell (i, j) of output (oh, ow) of plane p is entry t + i*WQ + j//SW of column
# phase j % SW, t = (p*HP + oh*SH)*WQ + ow. Indices are unsigned (np.uint64):
# numba's negative-index check on a signed index keeps LLVM from vectorising.
_U = np.uint64


@kernel
def _block_geometry(kernel_h, kernel_w, stride_h, stride_w, out_h, out_w, block_cells):
    """(HP, WQ, planes per block) of the layout above."""
    rows = stride_h * (out_h + (kernel_h - 1) // stride_h)
    phase_w = out_w + (kernel_w - 1) // stride_w
    return rows, phase_w, max(1, block_cells // (rows * phase_w * stride_w))


@kernel
def _pad_planes(x, pad_h, pad_w, fill, rows, cols, out):
    """out[:P*rows*cols]: the planes of x (P, H, W) at (pad_h, pad_w) in planes
    of rows x cols, the other cells `fill` (x's cells past them are left out)."""
    planes, h, w = x.shape
    flat = x.reshape(planes * h * w)
    kept_h, kept_w = min(h, rows - pad_h), min(w, cols - pad_w)
    for p in range(planes):
        start = _U(p * rows * cols)
        for e in range(_U(pad_h * cols)):
            out[start + e] = fill
        for r in range(kept_h):
            to = _U((p * rows + pad_h + r) * cols)
            source = _U((p * h + r) * w)
            for c in range(_U(pad_w)):
                out[to + c] = fill
            for c in range(_U(kept_w)):
                out[to + _U(pad_w) + c] = flat[source + c]
            for c in range(_U(pad_w + kept_w), _U(cols)):
                out[to + c] = fill
        for e in range(_U((pad_h + kept_h) * cols), _U(rows * cols)):
            out[start + e] = fill


@kernel
def _split_columns(flat, stride_w, count, phases):
    """phases[b, e] = flat[e*stride_w + b] for e < count (the constant strides
    spelled out: LLVM vectorises those)."""
    if stride_w == 1:
        first = phases[0]
        for e in range(_U(count)):
            first[e] = flat[e]
    elif stride_w == 2:
        even, odd = phases[0], phases[1]
        for e in range(_U(count)):
            even[e] = flat[_U(2) * e]
            odd[e] = flat[_U(2) * e + _U(1)]
    else:
        for b in range(stride_w):
            phase = phases[b]
            for e in range(_U(count)):
                phase[e] = flat[_U(stride_w) * e + _U(b)]


@kernel
def _block_phases(x, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, out_h, out_w, fill, padded, phases):
    """x's planes (P, H, W), a block, in column phases (the layout above),
    padding and the cells past the image `fill`. Returns the cells per phase."""
    planes, h, w = x.shape
    rows, phase_w, _ = _block_geometry(kernel_h, kernel_w, stride_h, stride_w, out_h, out_w, 1)
    count = planes * rows * phase_w
    if pad_h == 0 and pad_w == 0 and rows == h and phase_w * stride_w == w:
        _split_columns(x.reshape(planes * h * w), stride_w, count, phases)    # the planes as they are
    elif stride_w == 1:
        _pad_planes(x, pad_h, pad_w, fill, rows, phase_w, phases[0])          # one phase: the padded planes
    else:
        _pad_planes(x, pad_h, pad_w, fill, rows, phase_w * stride_w, padded)
        _split_columns(padded, stride_w, count, phases)
    return count


@kernel
def _keep_larger(candidate, label, best, where, track):
    """Where candidate[t] > best[t]: take it, and with `track` `label` as its
    winner (the running max over a window's cells, in window order: the first
    of equal values stays, as in Caffe)."""
    if not track:
        for t in range(best.shape[0]):
            v, b = candidate[t], best[t]
            best[t] = v if v > b else b
        return
    for t in range(best.shape[0]):
        v, b = candidate[t], best[t]
        better = v > b
        best[t] = v if better else b
        where[t] = label if better else where[t]


@kernel
def _max_forward(x, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, block_cells, track, value, winner):
    """value (P, PH, PW) = the window maxima of x (P, H, W), winner the offset
    i*KW + j of each window's first maximum in scan order (Caffe's loop: start
    at -FLT_MAX, take a cell strictly greater), -1 where no cell is above
    -FLT_MAX (padding, NaN and -inf never win). Without `track` (a forward no
    backward follows) the winners are not found and `winner` is not written."""
    planes, h, w = x.shape
    _, out_h, out_w = value.shape
    rows, phase_w, block = _block_geometry(kernel_h, kernel_w, stride_h, stride_w, out_h, out_w, block_cells)
    block = max(1, min(block, planes))        # (an empty batch: no block runs)
    reach = (kernel_h - 1) * phase_w + (kernel_w - 1) // stride_w      # the furthest cell past t
    fill = x.dtype.type(-np.inf)
    padded = np.empty(block * rows * phase_w * stride_w, x.dtype)
    phases = np.full((stride_w, block * rows * phase_w + reach), fill, x.dtype)
    best = np.empty(block * rows * phase_w, x.dtype)
    where = np.empty(block * rows * phase_w, winner.dtype)
    # Separable from 3 x 3 up: each row's first maximum (KW runs), then the
    # first row whose maximum is strictly greater (KH runs), which is the
    # first maximum in scan order: KH + KW runs instead of KH * KW.
    separable = kernel_h * kernel_w > kernel_h + kernel_w + 1
    row_best = np.empty(block * rows * phase_w if separable else 0, x.dtype)
    row_where = np.empty(block * rows * phase_w if separable else 0, winner.dtype)
    pitch = stride_h * phase_w
    for first in range(0, planes, block):
        last = min(planes, first + block)
        count = _block_phases(x[first:last], kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, out_h, out_w,
                              fill, padded, phases)
        span = count - (rows - (out_h - 1) * stride_h - 1) * phase_w        # through the last output row
        best_t, where_t = best[:span], where[:span]
        best_t[:] = -_FLT_MAX
        where_t[:] = -1
        if separable:
            row_best_t, row_where_t = row_best[:count], row_where[:count]
            row_best_t[:] = -_FLT_MAX
            row_where_t[:] = -1
            for j in range(kernel_w):
                start = j // stride_w
                _keep_larger(phases[j % stride_w, start:start + count], winner.dtype.type(j), row_best_t, row_where_t,
                             track)
            for i in range(kernel_h):
                k = winner.dtype.type(i * kernel_w)
                row = row_best[i * phase_w:i * phase_w + span]
                column = row_where[i * phase_w:i * phase_w + span]
                if not track:
                    for t in range(span):
                        v, b = row[t], best_t[t]
                        best_t[t] = v if v > b else b
                    continue
                for t in range(span):
                    v, b = row[t], best_t[t]
                    better = v > b
                    best_t[t] = v if better else b
                    where_t[t] = k + column[t] if better else where_t[t]
        else:
            for i in range(kernel_h):
                for j in range(kernel_w):
                    start = i * phase_w + j // stride_w
                    _keep_larger(phases[j % stride_w, start:start + span], winner.dtype.type(i * kernel_w + j),
                                 best_t, where_t, track)
        out_value = value[first:last].reshape((last - first) * out_h * out_w)
        out_winner = winner[first:last].reshape((last - first) * out_h * out_w)
        for p in range(last - first):
            for oh in range(out_h):
                t = _U((p * rows // stride_h + oh) * pitch)
                o = _U((p * out_h + oh) * out_w)
                for ow in range(_U(out_w)):
                    out_value[o + ow] = best_t[t + ow]
                if track:
                    for ow in range(_U(out_w)):
                        out_winner[o + ow] = where_t[t + ow]


@kernel
def _ave_forward(x, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, block_cells, divisor, value):
    """value (P, PH, PW) = the window sums of x (P, H, W) / divisor (PH, PW):
    each sum from 0, its cells in Caffe's scan order (the padding's zeros
    change no sum), so the numbers are Caffe's bit for bit."""
    planes, h, w = x.shape
    _, out_h, out_w = value.shape
    rows, phase_w, block = _block_geometry(kernel_h, kernel_w, stride_h, stride_w, out_h, out_w, block_cells)
    block = max(1, min(block, planes))        # (an empty batch: no block runs)
    reach = (kernel_h - 1) * phase_w + (kernel_w - 1) // stride_w
    zero = x.dtype.type(0)
    padded = np.empty(block * rows * phase_w * stride_w, x.dtype)
    phases = np.full((stride_w, block * rows * phase_w + reach), zero, x.dtype)
    total = np.empty(block * rows * phase_w, x.dtype)
    pitch = stride_h * phase_w
    for first in range(0, planes, block):
        last = min(planes, first + block)
        count = _block_phases(x[first:last], kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, out_h, out_w,
                              zero, padded, phases)
        span = count - (rows - (out_h - 1) * stride_h - 1) * phase_w
        total_t = total[:span]
        total_t[:] = zero
        for i in range(kernel_h):
            for j in range(kernel_w):
                start = i * phase_w + j // stride_w
                cell = phases[j % stride_w, start:start + span]
                for t in range(span):
                    total_t[t] += cell[t]
        _divided(total_t, value[first:last].reshape((last - first) * out_h * out_w), divisor, last - first,
                 rows, stride_h, pitch, True)


@kernel
def _spread_block(share, kernel_h, kernel_w, stride_w, phase_w, span, length, phases):
    """phases[j % SW, t + i*WQ + j//SW] += share[t] for every window cell (i, j),
    from 0. The offsets run backwards, which adds each cell's shares in the
    order of their outputs (oh, ow), as Caffe's backward loop does. (Only the
    first `length` cells of each phase are the block's: phases stays a whole,
    C-contiguous array, which the compiled loops need to vectorise.)"""
    for b in range(stride_w):
        phases[b, :length] = 0
    for i in range(kernel_h - 1, -1, -1):
        for j in range(kernel_w - 1, -1, -1):
            start = i * phase_w + j // stride_w
            cell = phases[j % stride_w, start:start + span]
            for t in range(span):
                cell[t] += share[t]


@kernel
def _block_to_image(phases, count, stride_w, pad_h, pad_w, rows, padded, dx):
    """dx (P, H, W), a block of planes, = the column phases of its padded
    planes merged back and cut out (0 where no window reaches)."""
    planes, h, w = dx.shape
    cols = padded.shape[0] // max(1, planes * rows) if planes else 0
    for b in range(stride_w):
        phase = phases[b]
        for e in range(_U(count)):
            padded[_U(stride_w) * e + _U(b)] = phase[e]
    out = dx.reshape(planes * h * w)
    kept_h, kept_w = min(h, rows - pad_h), min(w, cols - pad_w)
    for p in range(planes):
        for r in range(h):
            o = _U((p * h + r) * w)
            if r >= kept_h:
                for c in range(_U(w)):
                    out[o + c] = 0
                continue
            source = _U((p * rows + pad_h + r) * cols + pad_w)
            for c in range(_U(kept_w)):
                out[o + c] = padded[source + c]
            for c in range(_U(kept_w), _U(w)):
                out[o + c] = 0


@kernel
def _divided(rowed, compact, divisor, planes, rows, stride_h, pitch, to_compact):
    """Each output cell over its divisor (PH, PW), between the block's rowed
    layout (output row oh of plane p at (p * rows // SH + oh) * pitch) and the
    compact (P * PH * PW) one: into `compact` (forward's sums), or into
    `rowed` (backward's shares)."""
    out_h, out_w = divisor.shape
    for p in range(planes):
        for oh in range(out_h):
            t = _U((p * rows // stride_h + oh) * pitch)
            o = _U((p * out_h + oh) * out_w)
            size = divisor[oh]
            if to_compact:
                for ow in range(_U(out_w)):
                    compact[o + ow] = rowed[t + ow] / size[ow]
            else:
                for ow in range(_U(out_w)):
                    rowed[t + ow] = compact[o + ow] / size[ow]


@kernel
def _ave_backward(dy, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, block_cells, divisor, dx):
    """dx (P, H, W) = the gradient of x from dy (P, PH, PW): each output's
    gradient / its divisor (PH, PW) spread over its window, each cell's shares
    summed from 0 in the order of their outputs (Caffe's)."""
    planes, h, w = dx.shape
    _, out_h, out_w = dy.shape
    rows, phase_w, block = _block_geometry(kernel_h, kernel_w, stride_h, stride_w, out_h, out_w, block_cells)
    block = max(1, min(block, planes))        # (an empty batch: no block runs)
    reach = (kernel_h - 1) * phase_w + (kernel_w - 1) // stride_w
    share = np.zeros(block * rows * phase_w, dy.dtype)   # 0 between output rows: spreads nothing
    phases = np.empty((stride_w, block * rows * phase_w + reach), dy.dtype)
    padded = np.empty(block * rows * phase_w * stride_w, dy.dtype)
    pitch = stride_h * phase_w
    for first in range(0, planes, block):
        last = min(planes, first + block)
        count = (last - first) * rows * phase_w
        span = count - (rows - (out_h - 1) * stride_h - 1) * phase_w
        _divided(share, dy[first:last].reshape((last - first) * out_h * out_w), divisor, last - first,
                 rows, stride_h, pitch, False)
        _spread_block(share[:span], kernel_h, kernel_w, stride_w, phase_w, span, count + reach, phases)
        _block_to_image(phases, count, stride_w, pad_h, pad_w, rows, padded[:count * stride_w], dx[first:last])


# --- 2 x 2 windows at stride 2 that tile the plane (LeNet, VGG): each window's
# four cells read straight from their two rows, no padded copy or phases.
# Alone on LeNet's pool1 at batch 64, forward 0.276 -> 0.175 ms; on 64
# planes of 112 x 112 at batch 16, 8.65 -> 3.67 ms; in LeNet's training
# iteration, pool1 0.428 -> 0.161 ms and pool2 0.181 -> 0.102 ms (another
# run: 0.531 -> 0.236, 0.274 -> 0.187). The backward stays _max_backward's
# zero fill and scatter: a 2 x 2 kernel writing each cell once took 2.5 times as long.

@kernel
def _max_forward_2x2(x, value, winner):
    """_max_forward for a 2 x 2 kernel at stride 2, no padding, on planes of
    even height and width (P, 2*PH, 2*PW): the same values and winners (cells
    in scan order, strictly greater wins, from -FLT_MAX)."""
    planes, out_h, out_w = value.shape
    start = x.dtype.type(-_FLT_MAX)
    for p in range(planes):
        for oh in range(out_h):
            upper, lower = x[p, 2 * oh], x[p, 2 * oh + 1]
            best_row, where_row = value[p, oh], winner[p, oh]
            for ow in range(out_w):
                best, where = start, -1
                for k, cell in enumerate((upper[2 * ow], upper[2 * ow + 1], lower[2 * ow], lower[2 * ow + 1])):
                    if cell > best:
                        best, where = cell, k
                best_row[ow] = best
                where_row[ow] = where


@kernel
def _max_backward_2x2(dy, winner, dx):
    """_max_backward for _max_forward_2x2's windows, which tile dx exactly:
    every cell written once, its window's gradient where it won and 0
    elsewhere, row by row, so no zeroing pass comes first (LeNet's pool1 at
    batch 64: 0.30 against 0.50 ms; its pool2 0.10 against 0.17). The
    gradient is added to 0, as Caffe's (a -0.0 lands as 0.0)."""
    planes, out_h, out_w = dy.shape
    zero = dx.dtype.type(0)
    for p in range(planes):
        for oh in range(out_h):
            for i in range(2):
                row = dx[p, 2 * oh + i]
                for ow in range(out_w):
                    k, gradient = winner[p, oh, ow], zero + dy[p, oh, ow]
                    row[2 * ow] = gradient if k == 2 * i else zero
                    row[2 * ow + 1] = gradient if k == 2 * i + 1 else zero


# The deploy nets' 3 x 3 max poolings, for a forward no backward follows (no
# winners to find): each cell's maximum over three columns, then over three
# such rows, as unit-stride loops over whole planes with the edges fixed up
# after; the general kernel's padded copy, phases and output copy are not
# needed. The same values: maxima are exact, and both start at -FLT_MAX and
# take a cell only when strictly greater (NaN and -inf never win; of equal
# cells, 0.0 and -0.0, the first in scan order stays).
@kernel
def _keep_greater3(a, b, c, target, count):
    """target = the first strictly greatest of a, b, c, from -FLT_MAX."""
    floor = target.dtype.type(-_FLT_MAX)
    for t in range(count):
        best = floor
        u, v, w = a[t], b[t], c[t]
        best = u if u > best else best
        best = v if v > best else best
        target[t] = w if w > best else best


@kernel
def _keep_greater1(a, target, count):
    """target = a where strictly greater than -FLT_MAX, else -FLT_MAX (a
    window of one cell)."""
    floor = target.dtype.type(-_FLT_MAX)
    for t in range(count):
        u = a[t]
        target[t] = u if u > floor else floor


@kernel
def _keep_greater2(a, b, target, count):
    """target = the first strictly greatest of a, b, from -FLT_MAX."""
    floor = target.dtype.type(-_FLT_MAX)
    for t in range(count):
        best = floor
        u, v = a[t], b[t]
        best = u if u > best else best
        target[t] = v if v > best else best


@kernel
def _max_3x3_same(x, value):
    """value (P, H, W) = the maxima of the 3 x 3 windows of x (P, H, W) at
    stride 1, padding 1 (the window clipped to the plane), without winners."""
    planes, h, w = x.shape
    cells = h * w
    rows = np.empty(cells, x.dtype)
    for p in range(planes):
        source = x[p].reshape(cells)
        target = value[p].reshape(cells)
        if w == 1:     # one column: each row's window is its one cell
            _keep_greater1(source, rows, cells)
        else:          # rows[i] = max over columns i-1..i+1 of the same row
            _keep_greater3(source[:cells - 2], source[1:cells - 1], source[2:], rows[1:cells - 1], cells - 2)
            for y in range(h):
                first, last = y * w, y * w + w - 1
                _keep_greater2(source[first:first + 1], source[first + 1:first + 2], rows[first:first + 1], 1)
                _keep_greater2(source[last - 1:last], source[last:last + 1], rows[last:last + 1], 1)
        if h == 1:
            target[:] = rows
        else:          # value[i] = max over rows y-1..y+1 of rows[]
            if h > 2:
                _keep_greater3(rows[:cells - 2 * w], rows[w:cells - w], rows[2 * w:], target[w:cells - w],
                               cells - 2 * w)
            _keep_greater2(rows[:w], rows[w:2 * w], target[:w], w)
            _keep_greater2(rows[cells - 2 * w:cells - w], rows[cells - w:], target[cells - w:], w)


@kernel
def _max_3x3_stride2(x, value):
    """value (P, PH, PW) = the maxima of the 3 x 3 windows of x (P, H, W) at
    stride 2 without padding, windows past the edge clipped (ceil rounding),
    without winners: GoogLeNet's, CaffeNet's and ResNet-50's pooling between
    stages. Each row's 3-cell maxima at the even columns only (the window
    starts), then the maxima of three such rows: rows first keeps Caffe's
    scan order. The row loop indexes by an unsigned counter: a signed 2*o
    gets numba's check for negative indices, which keeps the loop scalar.
    1.2-1.8x faster than maxima at every column with the even ones picked
    after."""
    planes, h, w = x.shape
    out_h, out_w = value.shape[1], value.shape[2]
    floor = x.dtype.type(-_FLT_MAX)
    kept = np.empty((h, out_w), x.dtype)
    inside = min(out_w, (w - 1) // 2)          # windows whose three columns are all in the row
    one, two = np.uint64(1), np.uint64(2)
    for p in range(planes):
        plane = x[p]
        for y in range(h):
            row, target = plane[y], kept[y]
            for o in range(np.uint64(inside)):
                c = o + o
                u, v, t = row[c], row[c + one], row[c + two]
                best = u if u > floor else floor
                best = v if v > best else best
                target[o] = t if t > best else best
            for o in range(inside, out_w):         # the windows the row's end clips
                best = floor
                for c in range(2 * o, min(2 * o + 3, w)):
                    u = row[c]
                    best = u if u > best else best
                target[o] = best
        for oy in range(out_h):
            first = 2 * oy
            target = value[p, oy]
            if first + 2 < h:
                _keep_greater3(kept[first], kept[first + 1], kept[first + 2], target, out_w)
            elif first + 1 < h:
                _keep_greater2(kept[first], kept[first + 1], target, out_w)
            else:
                _keep_greater1(kept[first], target, out_w)


@kernel
def _max_whole(x, value, winner):
    """value (P,) = each plane's maximum, winner (P,) its flat index h*W + w
    (the first in scan order; -1 and -FLT_MAX where nothing is above -FLT_MAX)."""
    planes = x.shape[0]
    flat = x.reshape(planes, x.shape[1] * x.shape[2])
    for p in range(planes):
        best = x.dtype.type(-_FLT_MAX)
        where = -1
        for e in range(flat.shape[1]):
            if flat[p, e] > best:
                best = flat[p, e]
                where = e
        value[p] = best
        winner[p] = where


@kernel
def _ave_whole(x, divisor, value):
    """value (P,) = each plane's sum, from 0 in scan order (Caffe's), / divisor."""
    planes = x.shape[0]
    flat = x.reshape(planes, x.shape[1] * x.shape[2])
    for p in range(planes):
        total = x.dtype.type(0)
        for e in range(flat.shape[1]):
            total += flat[p, e]
        value[p] = total / divisor


def pooled_size(size, kernel, stride, pad, ceil, padded):
    """Caffe's pooled output size along one axis (CEIL or FLOOR rounding, then the
    last window must start inside the image when the layer has any padding:
    Caffe applies that clip to both axes if either one is padded)."""
    span = size + 2 * pad - kernel
    pooled = (-(-span // stride) if ceil else span // stride) + 1
    if padded and (pooled - 1) * stride >= size + pad:
        pooled -= 1
    return pooled


# Kernels over ranges of planes at once: (runner, parts) where runner(function,
# [arguments of each part]) runs function(*arguments) for every part and returns
# when all are done. None (the default): one call on the calling thread.
_parallel = None
# Elements of a kernel's largest array below which it runs in one call: a
# hand-off to a worker costs tens of microseconds. Measured with 2 threads on
# a shared 2-core host: calls below 1M elements (every GoogLeNet pooling layer
# at batch 1) ran 0.6-0.9x as fast split, pool1 once 1.26x; above 1.5M (batch
# 16, run whole) 1.5-1.8x faster in one run, 0.85-0.95x in the next.
PARALLEL_ELEMENTS = 1 << 20


def set_parallel_runner(runner, parts):
    """Run each kernel call of a layer that runs whole (not in batch
    partitions) as `parts` ranges of planes through runner(function,
    [arguments per part]); runner None: one call, on the calling thread."""
    global _parallel
    _parallel = None if runner is None or parts <= 1 else (runner, int(parts))


def _planes(array, written=False):
    """(N, C, H, W) -> (N*C, H, W): a view, or for an array only read a
    C-contiguous copy when it is not C-contiguous (blobs and their batch
    slices are)."""
    if not array.flags.c_contiguous:
        if written:
            raise ValueError(f"pooling's kernels write C-contiguous arrays only, got strides {array.strides}")
        array = np.ascontiguousarray(array)
    return array.reshape(-1, *array.shape[2:])


@register("Pooling")
class Pooling(Layer):
    """Max, average or stochastic pooling over KH x KW windows, per channel.

    pooling_param: pool (MAX | AVE | STOCHASTIC), kernel_size | kernel_h+kernel_w,
    stride | stride_h+stride_w (default 1), pad | pad_h+pad_w (MAX and AVE only,
    pad < kernel), global_pooling (kernel = the whole image), round_mode (CEIL | FLOOR).
    bottom (N, C, H, W) -> top[0] (N, C, PH, PW),
    PH = ceil((H + 2*pad_h - KH) / stride_h) + 1, less 1 if padded and the last
    window would start at or past H + pad_h (PW alike).
    MAX may have top[1]: the mask, the flat index h*W + w of each window's first maximum.
    AVE divides by the window clipped to the padded image (H + pad_h), padding counted.
    STOCHASTIC (Caffe's GPU semantics, inputs assumed >= 0): TRAIN samples one
    element per window with probability value / window sum; TEST outputs
    sum(v^2) / sum(v).
    """
    batch_independent = True
    shares_threads = False          # a batch partition's twin (clone) runs beside the others
    reshape_reads_layout = True

    def can_partition(self, bottom, top):
        # stochastic pooling draws from one random stream in batch order
        return self.layer_param.pooling_param.pool != caffe_pb2.PoolingParameter.STOCHASTIC

    def flops(self, bottom, top):
        # a compare (MAX) or an add (AVE) per window cell; backward routes or spreads as many
        if getattr(self, "kernel", None) is None:
            return 0, 0, 0
        cells = top[0].count * self.kernel[0] * self.kernel[1]
        return cells, cells, 0
    exact_bottoms = 1
    min_tops = 1
    max_tops = 2

    def setup(self, bottom, top):
        p = self.layer_param.pooling_param
        self.pool = p.pool
        self.draws_random = self.pool == STOCHASTIC and self.phase == TRAIN
        if self.pool not in _POOL_NAMES:
            raise self.config_error("pooling_param.pool", f"unknown method {self.pool}")
        if len(top) > 1 and self.pool != MAX:
            raise self.config_error("top", f"only MAX pooling has a second (mask) top; "
                                    f"{_POOL_NAMES[self.pool]} takes 1")
        self.global_pooling = p.global_pooling
        has_size, has_h, has_w = p.HasField("kernel_size"), p.HasField("kernel_h"), p.HasField("kernel_w")
        if self.global_pooling:
            if has_size or has_h or has_w:
                raise self.config_error("pooling_param.kernel_size", "no kernel size with global_pooling: true")
        else:
            if has_size == (has_h and has_w):
                raise self.config_error("pooling_param.kernel_size", "give kernel_size or kernel_h and kernel_w, "
                                        "not both")
            if not has_size and not (has_h and has_w):
                raise self.config_error("pooling_param.kernel_h", "non-square kernels need both kernel_h and kernel_w")
        self.pad = self._hw(p, "pad")
        self.stride = self._hw(p, "stride")
        if not self.global_pooling:
            self.kernel = (p.kernel_size, p.kernel_size) if has_size else (p.kernel_h, p.kernel_w)
            if min(self.kernel) <= 0:
                raise self.config_error("pooling_param.kernel_size", f"must be > 0, got {self.kernel[0]} x {self.kernel[1]}")
        if min(self.stride) <= 0:
            raise self.config_error("pooling_param.stride", f"must be > 0, got {self.stride[0]} x {self.stride[1]}")
        if self.global_pooling and (self.pad != (0, 0) or self.stride != (1, 1)):
            raise self.config_error("pooling_param.global_pooling", "takes only pad 0 and stride 1")
        if self.pad != (0, 0):
            if self.pool not in (MAX, AVE):
                raise self.config_error("pooling_param.pad", "padding is implemented only for MAX and AVE pooling")
            if not self.global_pooling and (self.pad[0] >= self.kernel[0] or self.pad[1] >= self.kernel[1]):
                raise self.config_error("pooling_param.pad", f"must be < kernel ({self.kernel[0]} x "
                                        f"{self.kernel[1]}), got {self.pad[0]} x {self.pad[1]}")
        self.ceil = p.round_mode == caffe_pb2.PoolingParameter.CEIL

    def _hw(self, p, name):
        h_name, w_name = f"{name}_h", f"{name}_w"
        has_h, has_w = p.HasField(h_name), p.HasField(w_name)
        if has_h or has_w:
            if p.HasField(name) or not (has_h and has_w):
                raise self.config_error(f"pooling_param.{name}", f"give {name}, or both {h_name} and {w_name}")
            return (getattr(p, h_name), getattr(p, w_name))
        return (getattr(p, name), getattr(p, name))

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) != 4:
            raise self.shape_error(f"bottom must be 4-d (N, C, H, W), got {shape}")
        n, c, h, w = shape
        if self.global_pooling:
            if not h or not w:                  # Caffe: CHECK_GT(kernel_h_, 0), "Filter dimensions cannot be zero"
                raise self.shape_error(f"pooling_param.global_pooling: the kernel is the bottom's {h} x {w}, "
                                       "and a kernel dimension cannot be zero")
            self.kernel = (h, w)
        self.in_hw = (h, w)
        padded = any(self.pad)
        self.out_hw = tuple(pooled_size(size, k, s, p, self.ceil, padded) for size, k, s, p
                            in zip((h, w), self.kernel, self.stride, self.pad))
        if min(self.out_hw) < 0:               # 0 runs, with an empty top (Blob::Reshape takes it)
            raise self.shape_error(
                f"input {h} x {w} does not fit pooling_param.kernel_size {self.kernel[0]} x {self.kernel[1]}, "
                f"pad {self.pad[0]} x {self.pad[1]}, stride {self.stride[0]} x {self.stride[1]}: the output "
                f"would be {self.out_hw[0]} x {self.out_hw[1]}")
        for blob in top:
            blob.reshape(n, c, *self.out_hw)
        # The whole image is one window: reductions over (H, W) instead of slices.
        self.whole_image = self.out_hw == (1, 1) and self.pad == (0, 0) and self.kernel[0] >= h and self.kernel[1] >= w
        key = (self.in_hw, self.kernel)                 # (stride, pad: fixed at setup)
        if getattr(self, "_windows_for", None) != key:    # a dozen small numpy calls: 10-25 us a reshape
            self._setup_windows()
            self._windows_for = key

    def _setup_windows(self):
        """Per output cell: where its window starts and its AVE divisor (Caffe's formulas)."""
        (h, w), (ph, pw), (kh, kw), (sh, sw), (pad_h, pad_w) = (self.in_hw, self.out_hw, self.kernel,
                                                                  self.stride, self.pad)
        starts_h = np.arange(ph) * sh - pad_h
        starts_w = np.arange(pw) * sw - pad_w
        size_h = np.minimum(starts_h + kh, h + pad_h) - starts_h
        size_w = np.minimum(starts_w + kw, w + pad_w) - starts_w
        self.pool_size = np.outer(size_h, size_w)                       # (PH, PW)
        # Flat image index of each window's top-left cell (may lie in the padding).
        self.window_origin = starts_h[:, None] * w + starts_w[None, :]  # (PH, PW)
        # The padded buffer holds every window cell, including ceil-mode overhang.
        self.padded_hw = ((ph - 1) * sh + kh, (pw - 1) * sw + kw)

    def _padded_shape(self, n, c):
        (h, w), (pad_h, pad_w) = self.in_hw, self.pad
        return (n, c, max(self.padded_hw[0], h + pad_h), max(self.padded_hw[1], w + pad_w))

    def _padded(self, x, fill, name="padded"):
        """x in a buffer with room for every window cell beyond the image, the
        extra cells `fill`; x itself when every window lies inside it."""
        n, c = x.shape[:2]
        (h, w), (pad_h, pad_w) = self.in_hw, self.pad
        shape = self._padded_shape(n, c)
        if shape[2:] == (h, w):
            return x
        xp = self._work(name, shape, x.dtype)
        xp.fill(fill)
        xp[:, :, pad_h:pad_h + h, pad_w:pad_w + w] = x
        return xp

    def _zeroed_gradient(self, bottom_diff):
        """(the array to accumulate window gradients into, a function that moves
        it into bottom_diff): the bottom diff itself when no window reaches past
        the image, else a padded work array."""
        n, c, h, w = bottom_diff.shape
        pad_h, pad_w = self.pad
        shape = self._padded_shape(n, c)
        if shape[2:] == (h, w):
            bottom_diff.fill(0)
            return bottom_diff, lambda: None
        dxp = self._work("padded_diff", shape, bottom_diff.dtype)
        dxp.fill(0)

        def crop():
            bottom_diff[...] = dxp[:, :, pad_h:pad_h + h, pad_w:pad_w + w]
        return dxp, crop

    def _chunks(self, n, c):
        """Slices of the batch, a few images each: the dozen whole-array passes
        per window offset run on arrays that stay in the CPU cache (about 2x
        faster than passes over the whole batch)."""
        per_image = c * self.out_hw[0] * self.out_hw[1]
        chunk = max(1, min(n, CHUNK_ELEMENTS // max(per_image, 1)))
        return [slice(start, min(start + chunk, n)) for start in range(0, n, chunk)]

    def _work(self, name, shape, dtype):
        """A work array for use inside this call (the thread's, Layer.work)."""
        return self.work("pooling_" + name, shape, dtype)

    def _offsets(self):
        (ph, pw), (sh, sw) = self.out_hw, self.stride
        for i in range(self.kernel[0]):
            for j in range(self.kernel[1]):
                yield i, j, (slice(None), slice(None), slice(i, i + sh * (ph - 1) + 1, sh),
                             slice(j, j + sw * (pw - 1) + 1, sw))

    def _run(self, function, planes, settings, outputs):
        """function(*planes, *settings, *outputs): a kernel whose array
        arguments `planes` and `outputs` all have the (N*C) planes first; with
        a parallel runner (set_parallel_runner) and a layer run whole, over
        ranges of planes at once."""
        count = outputs[0].shape[0]
        if (_parallel is None or self.shares_threads
                or max(array.size for array in planes + outputs) < PARALLEL_ELEMENTS):
            function(*planes, *settings, *outputs)
            return
        runner, parts = _parallel
        edges = np.linspace(0, count, min(parts, count) + 1).astype(int)
        runner(function, [[a[start:stop] for a in planes] + list(settings) + [a[start:stop] for a in outputs]
                          for start, stop in zip(edges[:-1], edges[1:])])

    def clone(self, share=1):
        twin = super().clone(share)
        twin.shares_threads = share > 1        # the batch partitions already run on every thread
        return twin

    # --- forward -------------------------------------------------------------------
    def forward(self, bottom, top):
        x = bottom[0].data
        if not top[0].count:                   # an empty batch or output: Caffe's loops do nothing
            self.winner = None
            return
        if self.pool == MAX:
            # The winners are for a backward and the mask top: a forward the net
            # never follows with this layer's backward finds the maxima alone.
            self.winner = self._max(x, top[0].data, self.runs_backward or len(top) > 1)
            if len(top) > 1:
                top[1].data[...] = self._mask(self.winner)
        elif self.pool == AVE:
            self._average(x, top[0].data)
        elif self.phase == TRAIN:
            top[0].data[...] = self._stochastic_sample(x)
        else:
            top[0].data[...] = self._stochastic_weighted(x)

    def _max(self, x, value, track=True):
        """Fill `value` (N, C, PH, PW) with the window maxima; return where each
        is, as the kernel offset i*KW + j of the first maximum in scan order (for
        a whole-image window that is the flat index h*W + w), -1 for a window
        with nothing above -FLT_MAX: such a window keeps Caffe's initial -FLT_MAX
        and gets no gradient. Kept for backward in the smallest integer that
        holds KH*KW: a byte for kernels up to 11 x 11. Without `track` (no
        backward and no mask top to come) the general kernel and the 3 x 3
        kernels find the maxima alone and return None; the whole-image and
        2 x 2 kernels find both, at little cost."""
        n, c, h, w = x.shape
        area = self.kernel[0] * self.kernel[1]
        offset_type = np.int8 if area <= 127 else np.int16 if area <= 32767 else np.int32
        winner = self.scratch("winner", value.shape, offset_type)
        if COMPILED:
            if self.whole_image:
                self._run(_max_whole, [_planes(x)], [],
                          [_planes(value, True).reshape(n * c), _planes(winner, True).reshape(n * c)])
            elif self._tiles_2x2(x):
                self._run(_max_forward_2x2, [_planes(x)], [], [_planes(value, True), _planes(winner, True)])
            elif not track and self._same_3x3(x):
                self._run(_max_3x3_same, [_planes(x)], [], [_planes(value, True)])
                return None
            elif not track and self._stride2_3x3(x):
                self._run(_max_3x3_stride2, [_planes(x)], [], [_planes(value, True)])
                return None
            else:
                self._run(_max_forward, [_planes(x)], [*self.kernel, *self.stride, *self.pad, BLOCK_CELLS, track],
                          [_planes(value, True), _planes(winner, True)])
                return winner if track else None
            return winner
        if self.whole_image:
            flat = x.reshape(n, c, h * w)
            first = flat.argmax(axis=2)[..., None]                      # the first maximum, as Caffe scans
            value[...] = np.take_along_axis(flat, first, axis=2).reshape(value.shape)
            winner[...] = first.reshape(value.shape)
        else:
            for rows in self._chunks(n, c):
                self._max_chunk(x[rows], value[rows], winner[rows])
        # (min first: no blob-sized mask in the usual case of no empty window)
        if value.size and not value.min() > -_FLT_MAX:
            empty = ~(value > -_FLT_MAX)
            value[empty] = -_FLT_MAX
            winner[empty] = -1
        return winner

    def _max_chunk(self, x, value, winner):
        # Padding holds -inf, below Caffe's -FLT_MAX start, so it never wins.
        xp = self._padded(x, -np.inf)
        better = self._work("better", value.shape, np.bool_)
        step = self._work("step", value.shape, winner.dtype)
        offsets = self._offsets()
        value[...] = xp[next(offsets)[2]]
        winner.fill(0)
        for k, (_, _, window) in enumerate(offsets, 1):
            cell = xp[window]
            np.greater(cell, value, out=better)                         # strict: an equal later cell loses
            np.fmax(value, cell, out=value)
            # winner = k where better (arithmetic: several times faster than a masked copy)
            np.subtract(k, winner, out=step)
            step *= better
            winner += step

    def _same_3x3(self, x):
        """Whether the windows are 3 x 3 at stride 1 with padding 1, each output
        cell on its input cell (_max_3x3_same): the inception units' pooling."""
        return (self.kernel == (3, 3) and self.stride == (1, 1) and self.pad == (1, 1)
                and self.out_hw == x.shape[2:] and x.dtype.kind == "f")

    def _stride2_3x3(self, x):
        """Whether the windows are 3 x 3 at stride 2 without padding
        (_max_3x3_stride2): every window starts inside the plane, the last ones
        clipped (ceil rounding)."""
        return (self.kernel == (3, 3) and self.stride == (2, 2) and self.pad == (0, 0)
                and all(0 < 2 * out - 1 <= size for out, size in zip(self.out_hw, x.shape[2:])) and x.dtype.kind == "f")

    def _tiles_2x2(self, x):
        """Whether the windows are 2 x 2 at stride 2 without padding on planes
        of even height and width: they tile x exactly (_max_forward_2x2)."""
        return (self.kernel == (2, 2) and self.stride == (2, 2) and self.pad == (0, 0)
                and x.shape[2] % 2 == 0 and x.shape[3] % 2 == 0 and x.dtype.kind == "f")

    def _mask(self, winner):
        """The flat input index h*W + w of each maximum, -1 for an empty window."""
        offset = winner.astype(np.int64)
        if self.whole_image:
            return offset
        w, kw = self.in_hw[1], self.kernel[1]
        index = self.window_origin + (offset // kw) * w + offset % kw
        index[offset < 0] = -1
        return index

    def _average(self, x, out):
        if COMPILED:
            n, c = x.shape[:2]
            if self.whole_image:
                self._run(_ave_whole, [_planes(x)], [x.dtype.type(self.pool_size[0, 0])],
                          [_planes(out, True).reshape(n * c)])
            else:
                self._run(_ave_forward, [_planes(x)], [*self.kernel, *self.stride, *self.pad, BLOCK_CELLS,
                                                       self.pool_size.astype(x.dtype)], [_planes(out, True)])
            return out
        if self.whole_image:
            np.sum(x, axis=(2, 3), keepdims=True, out=out)
        else:
            for rows in self._chunks(*x.shape[:2]):
                xp, total = self._padded(x[rows], 0), out[rows]
                for k, (_, _, window) in enumerate(self._offsets()):
                    if k == 0:
                        total[...] = xp[window]
                    else:
                        total += xp[window]
        out /= self.pool_size.astype(x.dtype)
        return out

    def _windows(self, x):
        """x (N, C, H, W) -> (N, C, PH, PW, KH*KW), the unpadded windows (stochastic pooling)."""
        xp = self._padded(x, 0, name="padded_windows")
        return np.stack([xp[window] for _, _, window in self._offsets()], axis=-1)

    def _stochastic_sample(self, x):
        windows = self._windows(x)
        cumulative = np.cumsum(windows, axis=-1)
        threshold = get_rng().random(cumulative.shape[:-1]).astype(x.dtype) * cumulative[..., -1]
        chosen = np.argmax(cumulative >= threshold[..., None], axis=-1)    # first cell past the threshold
        self.sample_offset = chosen
        return np.take_along_axis(windows, chosen[..., None], axis=-1)[..., 0]

    def _stochastic_weighted(self, x):
        windows = self._windows(x)
        tiny = np.finfo(np.float32).tiny                                    # Caffe starts the sum at FLT_MIN
        return (windows * windows).sum(axis=-1) / (windows.sum(axis=-1) + tiny)

    # --- backward ------------------------------------------------------------------
    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        if not top[0].count:                   # nothing pooled: no input gets a gradient
            bottom[0].diff[...] = 0
            return
        dy = top[0].diff
        if self.pool == MAX and len(top) > 1:
            # Caffe routes by the mask top when there is one.
            bottom[0].diff[...] = self._route(dy, top[1].data.astype(np.int64), bottom[0].shape)
        elif self.pool == MAX:
            if self.winner.shape != dy.shape:
                raise self.shape_error(f"backward needs a forward at the current shape: the kept maxima "
                                       f"are for {self.winner.shape}, the top is {dy.shape}")
            if self._tiles_2x2(bottom[0].data):
                self._run(_max_backward_2x2, [_planes(dy), _planes(self.winner)], [],
                          [_planes(bottom[0].diff, True)])
                return
            # a whole-image window's winner is the flat index h*W + w: decode it by the image width
            width = self.in_hw[1] if self.whole_image else self.kernel[1]
            self._run(_max_backward, [_planes(dy), _planes(self.winner)], [width, *self.stride, *self.pad],
                      [_planes(bottom[0].diff, True)])
        elif self.pool == AVE and COMPILED and not self.whole_image:
            self._run(_ave_backward, [_planes(dy)], [*self.kernel, *self.stride, *self.pad, BLOCK_CELLS,
                                                    self.pool_size.astype(dy.dtype)],
                      [_planes(bottom[0].diff, True)])
        elif self.pool == AVE:
            self._spread(dy / self.pool_size.astype(dy.dtype), bottom[0].diff)
        else:
            bottom[0].diff[...] = self._spread_to_sample(dy, bottom[0].shape)

    @staticmethod
    def _route(dy, mask, shape):
        """Sum each output's gradient into the input cell its mask names (-1: nowhere)."""
        n, c, h, w = shape
        planes = np.arange(n * c).reshape(n, c, 1, 1) * (h * w)
        valid = mask >= 0
        target = (planes + mask)[valid]
        summed = np.bincount(target, weights=dy[valid], minlength=n * c * h * w)
        return summed.reshape(shape)

    def _spread(self, dy_scaled, dx):
        """Adjoint of the window sum: every output's value added over its window, into dx."""
        if self.whole_image:
            dx[...] = dy_scaled
            return
        for rows in self._chunks(*dx.shape[:2]):
            target, finish = self._zeroed_gradient(dx[rows])
            for _, _, window in self._offsets():
                target[window] += dy_scaled[rows]
            finish()

    def _spread_to_sample(self, dy, shape):
        n, c, h, w = shape
        dxp = np.zeros((n, c, max(self.padded_hw[0], h), max(self.padded_hw[1], w)), dy.dtype)
        for k, (_, _, window) in enumerate(self._offsets()):
            dxp[window] += np.where(self.sample_offset == k, dy, 0)
        return dxp[:, :, :h, :w]

    # --- on a device: Caffe's MaxPool/AvePool kernels (cct.devices) --------------------
    def runs_on(self, device, bottom, top):
        """MAX (with or without the mask top) and AVE, global pooling included;
        STOCHASTIC runs on the host (it draws from the host's random stream).
        The mask is a float: exact for planes below 2^24 pixels."""
        h, w = bottom[0].shape[2:]
        return self.all_float32(bottom, top) and self.pool in (MAX, AVE) and h * w < (1 << 24)

    def _device_geometry(self, bottom):
        """(shape, pooled, kernel, stride, pad) as the device's pooling ops take them."""
        return bottom[0].shape, self.out_hw, self.kernel, self.stride, self.pad

    def forward_on(self, device, bottom, top):
        if not top[0].count:                   # an empty batch or output: nothing to pool
            return
        x, y = bottom[0].device_data(device), top[0].mutable_device_data(device)
        if self.pool == AVE:
            device.ave_pool_forward(x, y, *self._device_geometry(bottom))
            return
        # the mask goes to the mask top when there is one (backward reads it there, as
        # Caffe's), else to a buffer this layer keeps for backward
        mask = (top[1].mutable_device_data(device) if len(top) > 1
                else self.device_scratch(device, "max_mask", top[0].count))
        device.max_pool_forward(x, y, mask, *self._device_geometry(bottom))
        self._device_mask_shape = top[0].shape

    def backward_on(self, device, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dx = bottom[0].mutable_device_diff(device)
        if not top[0].count:                   # nothing pooled: no input gets a gradient
            device.fill(dx, 0.0, bottom[0].count)
            return
        dy = top[0].device_diff(device)
        if self.pool == AVE:
            device.ave_pool_backward(dy, dx, *self._device_geometry(bottom))
            return
        if len(top) > 1:
            mask = top[1].device_data(device)
        else:
            if getattr(self, "_device_mask_shape", None) != top[0].shape:
                raise self.shape_error(f"backward needs a forward on the device at the current shape: the "
                                       f"kept maxima are for {getattr(self, '_device_mask_shape', None)}, "
                                       f"the top is {top[0].shape}")
            mask = self.device_scratch(device, "max_mask", top[0].count)
        device.max_pool_backward(dy, mask, dx, *self._device_geometry(bottom))


@register("SPP")
class SPP(Layer):
    """Spatial pyramid pooling (Caffe's SPPLayer): level l pools the image into
    2^l x 2^l bins, KH = ceil(H / 2^l), stride KH, pad_h = (KH*2^l - H + 1) // 2
    (W alike); each level is flattened and the levels concatenated.

    spp_param: pyramid_height, pool (MAX | AVE | STOCHASTIC).
    bottom (N, C, H, W) -> top (N, C * sum_l 4^l) for pyramid_height > 1, and
    the single level's (N, C, 1, 1) pooling output for pyramid_height 1.
    """
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        self.pyramid_height = self.layer_param.spp_param.pyramid_height
        if self.pyramid_height < 1:
            raise self.config_error("spp_param.pyramid_height", f"must be >= 1, got {self.pyramid_height}")
        self.levels_for = None

    def _level_param(self, level, h, w):
        bins = 2 ** level
        kernel_h, kernel_w = -(-h // bins), -(-w // bins)
        param = caffe_pb2.LayerParameter(name=f"{self.name}/pool{level}", type="Pooling")
        pp = param.pooling_param
        pp.pool = self.layer_param.spp_param.pool      # SPP's enum has Pooling's values
        pp.kernel_h, pp.kernel_w = kernel_h, kernel_w
        pp.stride_h, pp.stride_w = kernel_h, kernel_w
        pp.pad_h, pp.pad_w = (kernel_h * bins - h + 1) // 2, (kernel_w * bins - w + 1) // 2
        return param

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) != 4:
            raise self.shape_error(f"bottom must be 4-d (N, C, H, W), got {shape}")
        if shape[2] <= 0 or shape[3] <= 0:
            raise self.shape_error(f"input height and width must be > 0, got {shape}")
        key = (shape[2:], bottom[0].dtype)
        if self.levels_for != key:
            # Caffe rebuilds the pooling layers whenever the image size changes.
            # (They keep this layer's phase; Caffe's would always be TRAIN.)
            self.levels = []
            for level in range(self.pyramid_height):
                pooling = Pooling(self._level_param(level, *shape[2:]), self.phase, self.source)
                outputs = [Blob(dtype=bottom[0].dtype)]
                pooling.set_up(bottom, outputs)
                self.levels.append((pooling, outputs))
            self.levels_for = key
        else:
            for pooling, outputs in self.levels:
                pooling.reshape(bottom, outputs)
        if self.pyramid_height == 1:
            top[0].reshape(self.levels[0][1][0].shape)
        else:
            top[0].reshape(shape[0], sum(outputs[0].count_range(1) for _, outputs in self.levels))

    def forward(self, bottom, top):
        n = bottom[0].shape[0]
        start = 0
        for pooling, outputs in self.levels:
            pooling.forward(bottom, outputs)
            width = outputs[0].count_range(1)
            top[0].data.reshape(n, top[0].count_range(1))[:, start:start + width] = outputs[0].data.reshape(n, width)
            start += width

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        n = bottom[0].shape[0]
        total = None
        start = 0
        for pooling, outputs in self.levels:
            width = outputs[0].count_range(1)
            outputs[0].diff.reshape(n, width)[...] = top[0].diff.reshape(n, top[0].count_range(1))[:, start:start + width]
            start += width
            pooling.backward(outputs, [True], bottom)
            total = bottom[0].diff.copy() if total is None else total + bottom[0].diff
        bottom[0].diff[...] = total
