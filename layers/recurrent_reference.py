"""Plain RNN and LSTM, for tests and bench/bench_recurrent.py only: the
obviously-correct version layers/recurrent.py is checked against (llm.c's
"reference kernel beside the fast one").

Written as Caffe's unrolled net computes, one time step at a time: every
step does its own input GEMM and, in backward, its own weight-gradient GEMMs;
sigmoid is 1 / (1 + exp(-x)). Nothing is shared with layers/recurrent.py.

Weights are given as the layers' parameter blobs, in Caffe's order:
    RNN:  W_xh (H, D), b_h (H,), [W_xh_static (H, S)], W_hh (H, H), W_ho (H, H), b_o (H,)
    LSTM: W_xc (4H, D), b_c (4H,), [W_xc_static (4H, S)], W_hc (4H, H)
x is (T, N, D) (flattened from axis 2), cont (T, N), x_static (N, S) or None,
initial states (N, H). Backward returns (dx, dx_static or None, [weight
gradients in the same order]); no gradient reaches cont or the initial states.
"""
import numpy as np


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _unpack(weights, static):
    """(W_x, b, W_static or None, W_h, the rest)."""
    if static:
        return weights[0], weights[1], weights[2], weights[3], weights[4:]
    return weights[0], weights[1], None, weights[2], weights[3:]


def _gate_input(x_t, h_conted, w_x, b, w_static, w_h, x_static):
    z = x_t @ w_x.T + b + h_conted @ w_h.T
    return z if w_static is None else z + x_static @ w_static.T


def _input_gradients(dz, x_t, h_conted, x_static, w_x, w_static, grads):
    """Step t's share of the W_x, b, W_static, W_h gradients (in grads' order); returns dx_t."""
    grads[0] += dz.T @ x_t
    grads[1] += dz.sum(axis=0)
    if w_static is not None:
        grads[2] += dz.T @ x_static
    grads[3 if w_static is not None else 2] += dz.T @ h_conted
    return dz @ w_x


def rnn_forward(x, cont, weights, h0, x_static=None):
    """(o (T, N, H), final h (N, H), cache for rnn_backward)."""
    w_x, b, w_static, w_h, (w_o, b_o) = _unpack(weights, x_static is not None)
    h, hs, conted, outputs = h0, [], [], []
    for t in range(x.shape[0]):
        conted.append(cont[t][:, None] * h)
        h = np.tanh(_gate_input(x[t], conted[t], w_x, b, w_static, w_h, x_static))
        hs.append(h)
        outputs.append(np.tanh(h @ w_o.T + b_o))
    return np.stack(outputs), h, (x, cont, weights, x_static, hs, conted, outputs)


def rnn_backward(d_out, cache):
    x, cont, weights, x_static, hs, conted, outputs = cache
    w_x, b, w_static, w_h, (w_o, b_o) = _unpack(weights, x_static is not None)
    grads = [np.zeros_like(w) for w in weights]
    dx, dx_static = np.zeros_like(x), None if x_static is None else np.zeros_like(x_static)
    dh_next = np.zeros_like(hs[0])
    for t in reversed(range(x.shape[0])):
        do = d_out[t] * (1 - outputs[t] ** 2)
        grads[-2] += do.T @ hs[t]
        grads[-1] += do.sum(axis=0)
        dz = (do @ w_o + dh_next) * (1 - hs[t] ** 2)
        dx[t] = _input_gradients(dz, x[t], conted[t], x_static, w_x, w_static, grads)
        if dx_static is not None:
            dx_static += dz @ w_static
        dh_next = (dz @ w_h) * cont[t][:, None]
    return dx, dx_static, grads


def lstm_forward(x, cont, weights, h0, c0, x_static=None):
    """(h (T, N, H), final h, final c, cache for lstm_backward)."""
    w_x, b, w_static, w_h, _ = _unpack(weights, x_static is not None)
    hidden = w_h.shape[1]
    h, c, steps = h0, c0, []
    for t in range(x.shape[0]):
        h_conted = cont[t][:, None] * h
        z = _gate_input(x[t], h_conted, w_x, b, w_static, w_h, x_static)
        i, f, o = (_sigmoid(z[:, k * hidden:(k + 1) * hidden]) for k in range(3))
        g = np.tanh(z[:, 3 * hidden:])
        f = cont[t][:, None] * f
        c_prev, c = c, f * c + i * g
        h = o * np.tanh(c)
        steps.append((h_conted, i, f, o, g, c_prev, c, h))
    return np.stack([s[-1] for s in steps]), h, c, (x, cont, weights, x_static, steps)


def lstm_backward(dh_top, cache):
    x, cont, weights, x_static, steps = cache
    w_x, b, w_static, w_h, _ = _unpack(weights, x_static is not None)
    grads = [np.zeros_like(w) for w in weights]
    dx, dx_static = np.zeros_like(x), None if x_static is None else np.zeros_like(x_static)
    dh_next = dc_next = np.zeros_like(steps[0][-1])
    for t in reversed(range(x.shape[0])):
        h_conted, i, f, o, g, c_prev, c, h = steps[t]
        dh = dh_top[t] + dh_next
        tanh_c = np.tanh(c)
        dc = dc_next + dh * o * (1 - tanh_c ** 2)
        dz = np.concatenate([dc * g * i * (1 - i), dc * c_prev * f * (1 - f),
                             dh * tanh_c * o * (1 - o), dc * i * (1 - g ** 2)], axis=1)
        dx[t] = _input_gradients(dz, x[t], h_conted, x_static, w_x, w_static, grads)
        if dx_static is not None:
            dx_static += dz @ w_static
        dh_next = (dz @ w_h) * cont[t][:, None]
        dc_next = dc * f
    return dx, dx_static, grads
