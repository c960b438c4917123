"""Pooling's compiled kernels (cct.devices.jit), one call per layer pass:
MAX's forward finds a block of planes' window maxima (and their winners) in
one sweep, AVE's forward sums and divides by Caffe's divisor in one sweep,
AVE's backward spreads in one, MAX's backward scatters each output's
gradient to its winner. Windows of 2 x 2 that tile the planes, 3 x 3 ones at
stride 1 pad 1 or at stride 2, and whole-image windows have kernels of their
own. Each takes (N*C, H, W) planes; the layer (layers/pooling.py) chooses
which runs, and layers/pooling_reference.py holds the numpy passes the tests
check every kernel against. Why they are shaped so: BENCHMARKS.md, "Pooling
kernels (issue 20)".
"""
import numpy as np

from cct.devices.jit import PLANE_GROUPS, kernel, parallel_kernel, prange

_FLT_MAX = float(np.finfo(np.float32).max)    # Caffe starts every max at -FLT_MAX
# Padded input cells per block of planes in the kernels: the block's copies
# (padded, column phases, running maxima or sums) stay within the L2 cache.
BLOCK_CELLS = 1 << 15


@kernel
def max_backward(dy, winner, kernel_w, stride_h, stride_w, pad_h, pad_w, dx):
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
def _take(better, label, where):
    """`label` where `better`, else `where`, as arithmetic: the select of a
    byte-wide winner on a float comparison did not vectorise on AVX2 (LLVM
    left a branch per cell: BENCHMARKS.md, "Pooling kernels (issue 20)");
    exact in any integer type (a wrapped difference wraps back)."""
    return where + (label - where) * better


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
        where[t] = _take(better, label, where[t])


@kernel
def max_forward(x, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, block_cells, track, value, winner):
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
                    where_t[t] = _take(better, k + column[t], where_t[t])
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
def ave_forward(x, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, block_cells, divisor, value):
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
def ave_backward(dy, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, block_cells, divisor, dx):
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
# four cells read straight from their two rows, no padded copy or phases, which
# beat the general kernel (BENCHMARKS.md, "Behind layers/pooling_kernels.py").

@kernel
def max_forward_2x2(x, value, winner):
    """max_forward for a 2 x 2 kernel at stride 2, no padding, on planes of
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
def max_backward_2x2(dy, winner, dx):
    """max_backward for max_forward_2x2's windows, which tile dx exactly:
    every cell written once, its window's gradient where it won and 0
    elsewhere, row by row, so no zeroing pass comes first (BENCHMARKS.md,
    "Session 11: Concat as views, conv1 in bands, LRN in Caffe's order, 2 x 2
    pooling backward, col2im by rows"). The gradient is added to 0, as
    Caffe's (a -0.0 lands as 0.0)."""
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


@parallel_kernel
def max_3x3_same(x, value):
    """value (P, H, W) = the maxima of the 3 x 3 windows of x (P, H, W) at
    stride 1, padding 1 (the window clipped to the plane), without winners."""
    planes, h, w = x.shape
    cells = h * w
    groups = min(planes, PLANE_GROUPS)
    for group in prange(groups):
        rows = np.empty(cells, x.dtype)
        for p in range(group * planes // groups, (group + 1) * planes // groups):
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


# The twins (cct.devices.jit) of the deploy nets' pooling kernels: the same
# comparisons in the same order, as whole-array numpy steps. `_greater_into`
# is one window cell's turn of a running maximum over every output at once.
def _greater_into(target, cells, scratch):
    """target = cells where cells > target (strictly: NaN never wins, of 0.0
    and -0.0 the one already there stays), in place, `target` never NaN.
    scratch None: x held no -0.0, so two equal values have the same bits and
    fmax (which skips NaNs) gives those values. Else a select of bits
    (target ^= (target ^ cells) & all-ones where taken), for a masked copy
    (np.copyto's where=) goes value by value; scratch is two flat unsigned
    arrays of the values' width, at least target's size."""
    if scratch is None:
        np.fmax(target, cells, out=target)
        return
    word = scratch[0].dtype
    taken, changed = (flat[:target.size].reshape(target.shape) for flat in scratch)
    np.greater(cells, target, out=taken, casting="unsafe")           # 1 where taken
    np.negative(taken, out=taken)                                     # 1 -> all ones
    bits = target.view(word)
    np.bitwise_xor(bits, cells.view(word), out=changed)
    changed &= taken
    bits ^= changed


def _select_scratch(x, size):
    """_greater_into's scratch for maxima of x's values, `size` at most: None
    where x holds no -0.0."""
    word = np.dtype(f"u{x.dtype.itemsize}")
    negative_zero = word.type(1 << (8 * x.dtype.itemsize - 1))
    if not np.any(x.view(word) == negative_zero):
        return None
    return np.empty(size, word), np.empty(size, word)


def _clipped_3(size, axis, x, target, scratch):
    """_greater_into target of x's cells at offsets -1, 0, +1 along `axis`
    (1: rows, 2: columns) of (P, H, W) arrays, in that order, windows
    clipped to the plane."""
    for offset in (-1, 0, 1):
        low, high = max(0, -offset), size - max(0, offset)
        if high > low:
            into = [slice(None)] * 3
            into[axis] = slice(low, high)
            source = list(into)
            source[axis] = slice(low + offset, high + offset)
            _greater_into(target[tuple(into)], x[tuple(source)], scratch)


@max_3x3_same.twin
def max_3x3_same_twin(x, value):
    """max_3x3_same: each row's 3-cell maxima from -FLT_MAX, then the
    maxima of three such rows from -FLT_MAX (a plane of one row: the rows'
    maxima as they are, the same values)."""
    floor = x.dtype.type(-_FLT_MAX)
    rows = np.full(x.shape, floor, x.dtype)
    scratch = _select_scratch(x, x.size)
    _clipped_3(x.shape[2], 2, x, rows, scratch)
    value[...] = floor
    _clipped_3(x.shape[1], 1, rows, value, scratch)


@parallel_kernel
def max_3x3_stride2(x, value):
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
    inside = min(out_w, (w - 1) // 2)          # windows whose three columns are all in the row
    one, two = np.uint64(1), np.uint64(2)
    groups = min(planes, PLANE_GROUPS)
    for group in prange(groups):
        kept = np.empty((h, out_w), x.dtype)
        for p in range(group * planes // groups, (group + 1) * planes // groups):
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


@max_3x3_stride2.twin
def max_3x3_stride2_twin(x, value):
    """max_3x3_stride2: each row's maxima over columns 2o, 2o+1, 2o+2 (those
    in the row) from -FLT_MAX, then over rows 2oy .. 2oy+2 the same way."""
    floor = x.dtype.type(-_FLT_MAX)
    planes, h, w = x.shape
    out_h, out_w = value.shape[1], value.shape[2]
    kept = np.full((planes, h, out_w), floor, x.dtype)
    scratch = _select_scratch(x, kept.size)
    for j in range(3):
        count = min(out_w, (w - j + 1) // 2)              # windows whose column j is in the row
        _greater_into(kept[:, :, :count], x[:, :, j:j + 2 * count:2], scratch)
    value[...] = floor
    for i in range(3):
        count = min(out_h, (h - i + 1) // 2)
        _greater_into(value[:, :count], kept[:, i:i + 2 * count:2], scratch)


@kernel
def max_whole(x, value, winner):
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
def ave_whole(x, divisor, value):
    """value (P,) = each plane's sum, from 0 in scan order (Caffe's), / divisor."""
    planes = x.shape[0]
    flat = x.reshape(planes, x.shape[1] * x.shape[2])
    for p in range(planes):
        total = x.dtype.type(0)
        for e in range(flat.shape[1]):
            total += flat[p, e]
        value[p] = total / divisor


@ave_whole.twin
def ave_whole_twin(x, divisor, value):
    """ave_whole: numpy's running sum (add.accumulate) adds in the kernel's
    order; the kernel starts from +0.0, which only changes a sum of -0.0s
    (to +0.0), and adding +0.0 to the last does the same."""
    planes = x.shape[0]
    flat = x.reshape(planes, x.shape[1] * x.shape[2])
    total = np.zeros(planes, x.dtype)
    if flat.shape[1]:
        total = np.add.accumulate(flat, axis=1)[:, -1] + total
    np.divide(total, divisor, out=value)
