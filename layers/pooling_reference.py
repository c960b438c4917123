"""Caffe's MAX and AVE pooling as plain numpy passes, one strided slice per
window cell: the reference the compiled kernels (layers/pooling_kernels.py)
are checked against, bit for bit where both add in the same order.

x (N, C, H, W); windows of `kernel` (KH, KW) at `stride` (SH, SW), starting
at -`pad`; `out_hw` (PH, PW) as the layer computes it (ceil or floor rounding,
Caffe's clip when padded). A window cell is i*KW + j, scanned row by row.
"""
import numpy as np

_FLT_MAX = float(np.finfo(np.float32).max)    # Caffe starts every max at -FLT_MAX


def _cells(kernel, stride, out_hw):
    """(i*KW + j, the slice of a padded (N, C, ...) array that holds cell (i, j)
    of every window), in scan order."""
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, out_hw
    for i in range(kh):
        for j in range(kw):
            yield i * kw + j, (slice(None), slice(None), slice(i, i + sh * (ph - 1) + 1, sh),
                               slice(j, j + sw * (pw - 1) + 1, sw))


def _padded(x, kernel, stride, pad, out_hw, fill):
    """x inside a buffer that holds every window cell (the padding and the
    ceil-mode overhang), the cells outside x `fill`."""
    n, c, h, w = x.shape
    rows = max((out_hw[0] - 1) * stride[0] + kernel[0], h + pad[0])
    cols = max((out_hw[1] - 1) * stride[1] + kernel[1], w + pad[1])
    xp = np.full((n, c, rows, cols), fill, x.dtype)
    xp[:, :, pad[0]:pad[0] + h, pad[1]:pad[1] + w] = x
    return xp


def divisor(in_hw, kernel, stride, pad, out_hw):
    """(PH, PW): each AVE window's size clipped to the padded image, Caffe's
    pool_size (padding counted, the overhang past H + pad not)."""
    sizes = []
    for size, k, s, p, out in zip(in_hw, kernel, stride, pad, out_hw):
        starts = np.arange(out) * s - p
        sizes.append(np.minimum(starts + k, size + p) - starts)
    return np.outer(*sizes)


def max_pool(x, kernel, stride, pad, out_hw):
    """(value, winner, mask), each (N, C, PH, PW): the window maxima, the
    cell of each first maximum in scan order, and its flat input index
    h*W + w; a window with nothing above -FLT_MAX (padding, NaN, -inf only)
    keeps -FLT_MAX, winner and mask -1."""
    xp = _padded(x, kernel, stride, pad, out_hw, -np.inf)      # below -FLT_MAX: padding never wins
    cells = _cells(kernel, stride, out_hw)
    _, first = next(cells)
    value, winner = xp[first].copy(), np.zeros(xp[first].shape, np.int64)
    for k, window in cells:
        better = xp[window] > value                             # strict: an equal later cell loses
        np.fmax(value, xp[window], out=value)
        winner[better] = k
    empty = ~(value > -_FLT_MAX)
    value[empty], winner[empty] = -_FLT_MAX, -1
    rows = np.arange(out_hw[0])[:, None] * stride[0] - pad[0] + winner // kernel[1]
    cols = np.arange(out_hw[1])[None, :] * stride[1] - pad[1] + winner % kernel[1]
    mask = np.where(winner < 0, -1, rows * x.shape[3] + cols)
    return value, winner, mask


def max_backward(dy, mask, shape):
    """dx (`shape`): each output's gradient added into the input cell its mask
    names (-1: nowhere), output after output in scan order, as Caffe's loop adds
    them (one output of every plane at a time: no cell twice in one add)."""
    n, c, h, w = shape
    dx = np.zeros((n * c, h * w + 1), dy.dtype)               # the last column takes the -1s
    planes = np.arange(n * c)
    flat_dy, flat_mask = dy.reshape(n * c, -1), mask.reshape(n * c, -1)
    for k in range(flat_dy.shape[1]):
        dx[planes, np.where(flat_mask[:, k] < 0, h * w, flat_mask[:, k])] += flat_dy[:, k]
    return dx[:, :h * w].reshape(shape)


def ave_pool(x, kernel, stride, pad, out_hw):
    """(N, C, PH, PW): each window's sum, its cells added in scan order from
    the first, divided by its Caffe divisor."""
    xp = _padded(x, kernel, stride, pad, out_hw, 0)
    cells = _cells(kernel, stride, out_hw)
    total = xp[next(cells)[1]].copy()
    for _, window in cells:
        total += xp[window]
    return total / divisor(x.shape[2:], kernel, stride, pad, out_hw).astype(x.dtype)


def ave_backward(dy, shape, kernel, stride, pad):
    """dx (`shape`): each output's gradient over its divisor, added over its
    window (the adjoint of ave_pool), cell after cell."""
    n, c, h, w = shape
    out_hw = dy.shape[2:]
    share = dy / divisor((h, w), kernel, stride, pad, out_hw).astype(dy.dtype)
    dxp = _padded(np.zeros(shape, dy.dtype), kernel, stride, pad, out_hw, 0)
    for _, window in _cells(kernel, stride, out_hw):
        dxp[window] += share
    return dxp[:, :, pad[0]:pad[0] + h, pad[1]:pad[1] + w]
