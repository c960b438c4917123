"""Recurrent layers: RNN and LSTM (Caffe's RecurrentLayer family), and LSTMUnit,
the LSTM's cell as a layer of its own.

Caffe builds RNN and LSTM as an unrolled net of InnerProduct, Scale, Eltwise,
TanH and LSTMUnit layers, one set per time step, sharing weights. Here the
same arithmetic runs directly: the input-to-hidden product of all T steps is
one GEMM, then a loop over time does one hidden-to-hidden GEMM and a few
whole-array element-wise passes per step, and backward runs that loop in
reverse, leaving every weight gradient to one GEMM over all steps. The
parameter blobs are the unrolled net's, in its order and shapes, so Caffe's
.caffemodel files load unchanged and cct's load in Caffe.

Axis 0 is time, not the batch: these layers never let the runtime split it
(batch_independent stays False). The plain per-step version the tests and
bench/bench_recurrent.py check this one against is layers/recurrent_reference.py.
"""
import numpy as np

from cct.core.layer import Layer, register
from cct.devices.jit import kernel


# --- the LSTM cell, shared by LSTM (one step at a time) and LSTMUnit -------------------------
def sigmoid(x, out):
    """out = 1 / (1 + exp(-x)), computed as 0.5 tanh(x / 2) + 0.5: the same
    function, without exp's overflow for very negative x."""
    np.multiply(x, 0.5, out=out)
    np.tanh(out, out=out)
    out *= 0.5
    out += 0.5
    return out


def lstm_cell_forward(gates, c_prev, cont, c, tanh_c, h, work):
    """Caffe's LSTMUnit forward on (..., N) streams, in place on `gates`
    (..., N, 4H): the pre-activations [i', f', o', g'] become the activations
    [i, f, o, g] with i, o = sigmoid, g = tanh and f = cont * sigmoid(f') (a new
    sequence, cont 0, forgets c_prev). Then c = f c_prev + i g, h = o tanh(c).
    c_prev, c, tanh_c, h, work: (..., N, H); cont: (..., N)."""
    hidden = c.shape[-1]
    sigmoid(gates[..., :3 * hidden], gates[..., :3 * hidden])
    np.tanh(gates[..., 3 * hidden:], out=gates[..., 3 * hidden:])
    i, f, o, g = (gates[..., k * hidden:(k + 1) * hidden] for k in range(4))
    f *= cont[..., None]
    np.multiply(f, c_prev, out=c)
    c += np.multiply(i, g, out=work)
    np.tanh(c, out=tanh_c)
    np.multiply(o, tanh_c, out=h)


@kernel
def lstm_cell_backward(gates, c_prev, tanh_c, dh, dc, dgates):
    """Caffe's LSTMUnit backward for N streams, one pass: from the activations
    `gates` (N, 4H) that lstm_cell_forward left, c_prev and tanh(c) (N, H), and
    the gradients dh of h and dc of c (N, H), set dgates (N, 4H) to the gate
    pre-activations' gradients and dc to c_prev's (c's whole gradient times f).
    As Caffe, the forget gate's derivative is f (1 - f) with f including cont
    (binary cont: sigmoid's derivative, or 0 at a sequence start). A compiled
    loop: numpy took about 20 passes over the arrays, 2-2.7x the time (the
    forward's exp and tanh stay numpy's, which vectorizes them; BENCHMARKS.md,
    "Recurrent layers: cost per time step (issue 19)")."""
    streams, hidden = dc.shape
    one = np.ones(1, dc.dtype)[0]           # float32 arithmetic for float32 blobs
    for n in range(streams):
        for j in range(hidden):
            i, f = gates[n, j], gates[n, hidden + j]
            o, g = gates[n, 2 * hidden + j], gates[n, 3 * hidden + j]
            t = tanh_c[n, j]
            d = dc[n, j] + dh[n, j] * o * (one - t * t)
            dgates[n, j] = d * g * i * (one - i)
            dgates[n, hidden + j] = d * c_prev[n, j] * f * (one - f)
            dgates[n, 2 * hidden + j] = dh[n, j] * t * o * (one - o)
            dgates[n, 3 * hidden + j] = d * i * (one - g * g)
            dc[n, j] = d * f


# --- RNN and LSTM ------------------------------------------------------------------------------
class _Recurrent(Layer):
    """What RNN and LSTM share (Caffe's RecurrentLayer).

    recurrent_param: num_output (H, > 0), weight_filler, bias_filler,
    debug_info (accepted; Caffe's unrolled net's debug log, nothing to show
    here), expose_hidden.
    Bottoms: x (T, N, ...), cont (T, N), optional x_static (N, ...), then with
    expose_hidden the initial states (1, N, H) (RNN: h_0; LSTM: h_0, c_0).
    Tops: the output (T, N, H), then with expose_hidden the final states (1, N, H)
    (RNN: h_T; LSTM: h_T, c_T).

    h_{t-1} enters step t as cont_t * h_{t-1}: cont 0 starts a new sequence.
    Without expose_hidden the final states of one forward are the next
    forward's initial states (a sequence continues across batches while cont
    is 1; zero at first, and again after reset() or a change of N). As in Caffe:
    no gradient reaches cont (an error if asked for), nor the exposed initial
    states (their diffs are set to zero), nor comes from the exposed final
    states' diffs; x and x_static get theirs whatever propagate_down says, as
    Caffe's unrolled net backprops to them unconditionally (recurrent_layer.cpp
    Backward_cpu; its x_transform layers set propagate_down: true). T may
    change between forwards (Caffe fixes it at set-up because it unrolls).
    """
    exact_tops = 1                  # set per layer from expose_hidden in __init__
    batch_independent = False       # axis 0 is time: step t needs step t-1, so it never splits
    states = ()                     # recurrent state names, in Caffe's bottom/top order
    gates = 1                       # rows of W_x per hidden unit (LSTM: i, f, o, g)

    def __init__(self, layer_param, phase=0, source=None):
        super().__init__(layer_param, phase, source)
        self.exposed = len(self.states) if layer_param.recurrent_param.expose_hidden else 0
        # Caffe's MinBottomBlobs/MaxBottomBlobs/ExactNumTopBlobs: x_static is optional.
        self.min_bottoms = 2 + self.exposed
        self.max_bottoms = 3 + self.exposed
        self.exact_tops = 1 + self.exposed

    def allow_force_backward(self, bottom_index):
        return bottom_index != 1        # cont

    def setup(self, bottom, top):
        p = self.layer_param.recurrent_param
        self.hidden = p.num_output
        if self.hidden <= 0:
            raise self.config_error("recurrent_param.num_output", f"must be > 0, got {self.hidden}")
        if any(t is b for t in top for b in bottom):
            raise self.config_error("top", f"{self.type} does not allow in-place computation")
        self.static = len(bottom) > 2 + self.exposed
        self._check_axes(bottom)
        self.input_size = bottom[0].count_range(2)
        self.static_size = bottom[2].count_range(1) if self.static else 0
        self.blobs, self.index = [], {}
        for role, shape, filler in self.param_layout():
            self.index[role] = len(self.blobs)
            self.blobs.append(self.filled_blob(shape, getattr(p, filler), f"recurrent_param.{filler}"))
        self.param_propagate_down = [True] * len(self.blobs)
        self._carried = None

    def param_layout(self):
        """[(role, shape, filler field)] in Caffe's blob order: the unrolled
        net's parameters in the order its layers own them. Roles: W_x (input
        to gates), b, W_static (x_static to gates), W_h (hidden to gates)."""
        rows = self.gates * self.hidden
        layout = [("W_x", (rows, self.input_size), "weight_filler"), ("b", (rows,), "bias_filler")]
        if self.static:
            layout.append(("W_static", (rows, self.static_size), "weight_filler"))
        return layout + [("W_h", (rows, self.hidden), "weight_filler")]

    def _check_axes(self, bottom):
        if len(bottom[0].shape) < 2:
            raise self.shape_error(f"bottom[0] (x) must have at least 2 axes (T, N, ...), got {bottom[0].shape}")
        if bottom[1].shape != bottom[0].shape[:2]:
            raise self.shape_error(f"bottom[1] (cont) must be (T, N) = {bottom[0].shape[:2]}, got {bottom[1].shape}")
        if self.static and (not bottom[2].shape or bottom[2].shape[0] != bottom[0].shape[1]):
            raise self.shape_error(f"bottom[2] (x_static) must be (N, ...) with N = {bottom[0].shape[1]}, "
                                   f"got {bottom[2].shape}")

    def reshape(self, bottom, top):
        self._check_axes(bottom)
        self.steps, self.streams = bottom[0].shape[:2]
        self._check_size(bottom[0].count_range(2), self.input_size, "bottom[0] (x)", "from axis 2")
        if self.static:
            self._check_size(bottom[2].count_range(1), self.static_size, "bottom[2] (x_static)", "from axis 1")
        state_shape = (1, self.streams, self.hidden)
        for k, name in enumerate(self.states):
            if self.exposed and bottom[self._first_state + k].shape != state_shape:
                raise self.shape_error(f"bottom[{self._first_state + k}] ({name}_0) must be {state_shape}, "
                                       f"got {bottom[self._first_state + k].shape}")
        top[0].reshape(self.steps, self.streams, self.hidden)
        for blob in top[1:]:
            blob.reshape(state_shape)

    def _check_size(self, got, expected, what, where):
        if got != expected:
            raise self.shape_error(f"{what} has {got} values per step {where}; the weights take {expected}")

    @property
    def _first_state(self):
        return 3 if self.static else 2

    @property
    def _samples(self):
        """T x N: the rows of x as a matrix, spelled out (not -1: x may have 0 values per step)."""
        return self.steps * self.streams

    def reset(self):
        """Forget the carried state (Caffe's RecurrentLayer::Reset): the next
        forward starts from zeros."""
        self._carried = None

    def flops(self, bottom, top):
        """forward: the input, static and hidden-to-gates GEMMs (RNN: and the
        output's); backward_data: the x and x_static gradients; backward_params:
        the weight gradients and the gradient through time (W_h, RNN: W_o),
        which the parameters need even when no bottom does."""
        tn, rows = self.steps * self.streams, self.gates * self.hidden
        inputs = 2 * rows * (tn * self.input_size + self.streams * self.static_size)
        recurrent = 2 * tn * self.hidden * rows + self._output_flops()
        return inputs + recurrent, inputs, inputs + 2 * recurrent

    def _output_flops(self):
        return 0

    # --- forward ----------------------------------------------------------------------------------
    def forward(self, bottom, top):
        dtype = bottom[0].data.dtype
        cont = bottom[1].data.astype(dtype, copy=False)
        pre = self._pre = self._input_transform(bottom, dtype)      # the loop leaves its activations here
        initial = self._initial_states(bottom, dtype)
        final = self.run_forward(pre, cont, initial, top[0].data)
        for blob, state in zip(top[1:], final):
            blob.data[0] = state
        if not self.exposed:
            self._carried = [state.copy() for state in final]

    def _weight(self, role, dtype):
        w = self.blobs[self.index[role]].data
        return w if w.dtype == dtype else w.astype(dtype)

    def _transposed(self, role, dtype):
        """W^T as a contiguous work array: BLAS multiplies by it 15-20% faster
        than by the transposed view at these sizes (N x H by H x 4H)."""
        w = self.blobs[self.index[role]].data
        out = self.work("recurrent_" + role, w.shape[::-1], dtype)
        np.copyto(out, w.T)
        return out

    def _input_transform(self, bottom, dtype):
        """The gates' input part for every step at once: x W_x^T + b (+ x_static
        W_static^T, the same for every step): (T, N, gates * H)."""
        rows = self.gates * self.hidden
        pre = self.scratch("pre", (self.steps, self.streams, rows), dtype)
        x = bottom[0].data.reshape(self._samples, self.input_size)
        np.matmul(x, self._transposed("W_x", dtype), out=pre.reshape(-1, rows))
        pre += self._weight("b", dtype)
        if self.static:
            pre += bottom[2].data.reshape(self.streams, self.static_size) @ self._weight("W_static", dtype).T
        return pre

    def _initial_states(self, bottom, dtype):
        if self.exposed:
            return [bottom[self._first_state + k].data[0].astype(dtype) for k in range(self.exposed)]
        shape = (self.streams, self.hidden)
        carried = self._carried
        if carried is None or carried[0].shape != shape:
            return [np.zeros(shape, dtype) for _ in self.states]
        return [state.astype(dtype, copy=False) for state in carried]

    def _conted(self, h, cont_t, out):
        """Caffe's h_conted_{t-1} = cont_t * h_{t-1}: (N, H)."""
        return np.multiply(h, cont_t[:, None], out=out)

    # --- backward ---------------------------------------------------------------------------------
    def backward(self, top, propagate_down, bottom):
        if propagate_down[1]:
            raise self.config_error("propagate_down", "cannot backpropagate to the sequence "
                                    "indicators (bottom[1], cont)")
        dtype = bottom[0].data.dtype
        cont = bottom[1].data.astype(dtype, copy=False)
        dpre = self.run_backward(top[0].diff, cont, dtype)
        self._backward_inputs(dpre, bottom, dtype)
        for k in range(self.exposed):
            if propagate_down[self._first_state + k]:
                bottom[self._first_state + k].diff[...] = 0     # Caffe shares only their data

    def _backward_inputs(self, dpre, bottom, dtype):
        """From the gates' pre-activation gradients dpre (T, N, gates * H):
        the W_x, b, W_static and W_h gradients (one GEMM each over all steps)
        and the x (T, N, ...) and x_static (N, ...) gradients, always: Caffe's
        Backward_cpu runs its unrolled net's whole backward "unconditionally"
        (BVLC 1.0 src/caffe/layers/recurrent_layer.cpp:283-286), whose
        x_transform layers propagate down to x and x_static (lstm_layer.cpp:116, 129)."""
        rows = self.gates * self.hidden
        flat = dpre.reshape(-1, rows)
        x = bottom[0].data.reshape(self._samples, self.input_size)
        self._accumulate("W_x", lambda: flat.T @ x)
        self._accumulate("b", lambda: flat.sum(axis=0))
        self._accumulate("W_h", lambda: flat.T @ self._conted_all.reshape(-1, self.hidden))
        np.matmul(flat, self._weight("W_x", dtype), out=bottom[0].diff.reshape(self._samples, self.input_size))
        if self.static:
            per_stream = dpre.sum(axis=0)                                       # (N, rows)
            x_static = bottom[2].data.reshape(self.streams, self.static_size)
            self._accumulate("W_static", lambda: per_stream.T @ x_static)
            np.matmul(per_stream, self._weight("W_static", dtype),
                      out=bottom[2].diff.reshape(self.streams, self.static_size))

    def _accumulate(self, role, gradient):
        """blobs[role].diff += gradient(), unless that parameter learns nothing."""
        index = self.index[role]
        if self.param_wanted(index):
            self.blobs[index].diff[...] += gradient()

    def run_forward(self, pre, cont, initial, out):
        """The time loop from the input part `pre` (T, N, gates * H), which it
        may overwrite; writes the output into `out` (T, N, H), keeps what
        backward needs (self._conted_all: every step's h_conted, (T, N, H))
        and returns the final states [(N, H)]."""
        raise NotImplementedError

    def run_backward(self, top_diff, cont, dtype):
        """The time loop in reverse from the output's diff (T, N, H) and the
        kept state: the gates' pre-activation gradients (T, N, gates * H), and
        the gradients of the layer's own other parameters (RNN: W_o, b_o)."""
        raise NotImplementedError


@register("RNN")
class RNN(_Recurrent):
    """Caffe's RNN: h_t = tanh(W_hh (cont_t h_{t-1}) + W_xh x_t + b_h [+ W_xh_static x_static]),
    o_t = tanh(W_ho h_t + b_o); the top is o (T, N, H), the carried state h.
    Params (Caffe's order): W_xh (H, D), b_h (H,), [W_xh_static (H, S)], W_hh (H, H),
    W_ho (H, H), b_o (H,); D: x's values per step (axes 2...), S: x_static's per stream.
    Fields, bottoms and tops: see _Recurrent."""
    states = ("h",)

    def param_layout(self):
        square = (self.hidden, self.hidden)
        return super().param_layout() + [("W_o", square, "weight_filler"), ("b_o", (self.hidden,), "bias_filler")]

    def _output_flops(self):
        return 2 * self.steps * self.streams * self.hidden * self.hidden

    def run_forward(self, pre, cont, initial, out):
        dtype = pre.dtype
        hidden = pre                                     # (T, N, H): becomes h_1..h_T in place
        conted = self._conted_all = self.scratch("conted", pre.shape, dtype)
        w_h = self._transposed("W_h", dtype)
        work = self.work("rnn_step", pre.shape[1:], dtype)
        h = initial[0]
        for t in range(self.steps):
            hidden[t] += np.matmul(self._conted(h, cont[t], conted[t]), w_h, out=work)
            h = np.tanh(hidden[t], out=hidden[t])
        flat = hidden.reshape(-1, self.hidden)
        outputs = self._outputs = self.scratch("outputs", pre.shape, dtype)    # kept: a later layer may write the top
        np.matmul(flat, self._transposed("W_o", dtype), out=outputs.reshape(flat.shape))
        outputs += self._weight("b_o", dtype)
        np.tanh(outputs, out=outputs)
        out[...] = outputs
        return [h.copy()]

    def run_backward(self, top_diff, cont, dtype):
        hidden, outputs = self._pre, self._outputs                     # h_1..h_T, o_1..o_T
        flat_h = hidden.reshape(-1, self.hidden)
        d_out = self.work("rnn_output_grad", outputs.shape, dtype)
        np.multiply(outputs, outputs, out=d_out)
        np.subtract(1, d_out, out=d_out)
        d_out *= top_diff                                                # through o's tanh
        flat_out = d_out.reshape(flat_h.shape)
        self._accumulate("W_o", lambda: flat_out.T @ flat_h)
        self._accumulate("b_o", lambda: flat_out.sum(axis=0))
        dpre = self.work("rnn_hidden_grad", outputs.shape, dtype)
        np.matmul(flat_out, self._weight("W_o", dtype), out=dpre.reshape(flat_h.shape))   # into h_t
        derivative = self.work("rnn_tanh_derivative", outputs.shape, dtype)
        np.multiply(hidden, hidden, out=derivative)
        np.subtract(1, derivative, out=derivative)
        self._through_time(dpre, derivative, cont, dtype)
        return dpre

    def _through_time(self, dpre, derivative, cont, dtype):
        """dpre (T, N, H) holds each h_t's gradient from the output; add what
        reaches h_t from step t+1 and turn it, step by step from the last,
        into the gradient of h_t's pre-activation."""
        w_h = self._weight("W_h", dtype)
        carried = self.work("rnn_carried", dpre.shape[1:], dtype)
        for t in reversed(range(self.steps)):
            if t + 1 < self.steps:
                dpre[t] += carried
            dpre[t] *= derivative[t]
            if t > 0:                           # h_0's gradient goes nowhere (Caffe's neither)
                np.matmul(dpre[t], w_h, out=carried)
                carried *= cont[t][:, None]


@register("LSTM")
class LSTM(_Recurrent):
    """Caffe's LSTM: the gates [i, f, o, g]_t = W_hc (cont_t h_{t-1}) + W_xc x_t + b_c
    [+ W_xc_static x_static], then the cell as LSTMUnit computes it (with cont_t):
    c_t = cont_t sigmoid(f) c_{t-1} + sigmoid(i) tanh(g), h_t = sigmoid(o) tanh(c_t).
    The top is h (T, N, H); the carried states are h and c.
    Params (Caffe's order): W_xc (4H, D), b_c (4H,), [W_xc_static (4H, S)], W_hc (4H, H).
    Fields, bottoms and tops: see _Recurrent."""
    states = ("h", "c")
    gates = 4

    def run_forward(self, pre, cont, initial, out):
        dtype = pre.dtype
        h, c0 = initial
        shape = (self.steps, self.streams, self.hidden)
        conted = self._conted_all = self.scratch("conted", shape, dtype)
        cells = self._cells = self.scratch("cells", (self.steps + 1,) + shape[1:], dtype)    # c_0 .. c_T
        tanh_cells = self._tanh_cells = self.scratch("tanh_cells", shape, dtype)
        cells[0] = c0
        w_h = self._transposed("W_h", dtype)
        step = self.work("lstm_step", pre.shape[1:], dtype)
        work = self.work("lstm_cell", shape[1:], dtype)
        for t in range(self.steps):
            pre[t] += np.matmul(self._conted(h, cont[t], conted[t]), w_h, out=step)
            lstm_cell_forward(pre[t], cells[t], cont[t], cells[t + 1], tanh_cells[t], out[t], work)
            h = out[t]
        return [h.copy(), cells[-1].copy()]

    def run_backward(self, top_diff, cont, dtype):
        gates, cells, tanh_cells = self._pre, self._cells, self._tanh_cells   # forward's activations
        dpre = self.work("lstm_gate_grad", gates.shape, dtype)
        w_h = self._weight("W_h", dtype)
        dh, dc = (self.work(name, top_diff.shape[1:], dtype) for name in ("lstm_dh", "lstm_dc"))
        dc[...] = 0                                         # c_T's diff: Caffe passes none back
        for t in reversed(range(self.steps)):
            if t + 1 < self.steps:
                np.matmul(dpre[t + 1], w_h, out=dh)         # into h_conted_t, then through cont
                dh *= cont[t + 1][:, None]
                dh += top_diff[t]
            else:
                dh[...] = top_diff[t]
            lstm_cell_backward(gates[t], cells[t], tanh_cells[t], dh, dc, dpre[t])
        return dpre


@register("LSTMUnit")
class LSTMUnit(Layer):
    """Caffe's LSTMUnit: one LSTM step for N streams, as LSTM runs it at each step.

    Bottoms: c_prev (1, N, H), x (1, N, 4H) the gate pre-activations [i, f, o, g],
    cont (1, N). Tops: c (1, N, H), h (1, N, H):
        i, o = sigmoid, g = tanh, f = cont * sigmoid(f')
        c = f c_prev + i g,  h = o tanh(c)
    No parameters. No gradient reaches cont (Caffe refuses: an error if asked).
    """
    exact_bottoms = 3
    exact_tops = 2
    batch_independent = False       # axis 0 is the one time step; the streams are axis 1

    def allow_force_backward(self, bottom_index):
        return bottom_index != 2        # cont

    def reshape(self, bottom, top):
        c_prev, x, cont = (b.shape for b in bottom)
        if len(c_prev) != 3 or c_prev[0] != 1:
            raise self.shape_error(f"bottom[0] (c_prev) must be (1, N, H), got {c_prev}")
        streams, hidden = c_prev[1:]
        if x != (1, streams, 4 * hidden):
            raise self.shape_error(f"bottom[1] (x) must be (1, N, 4H) = {(1, streams, 4 * hidden)}, got {x}")
        if cont != (1, streams):
            raise self.shape_error(f"bottom[2] (cont) must be (1, N) = {(1, streams)}, got {cont}")
        for blob in top:
            blob.reshape(c_prev)

    def forward(self, bottom, top):
        c_prev, x, cont = (b.data[0] for b in bottom)
        dtype = x.dtype
        gates = self._gates = self.scratch("gates", x.shape, dtype)
        np.copyto(gates, x)
        tanh_c = self._tanh_c = self.scratch("tanh_c", c_prev.shape, dtype)
        lstm_cell_forward(gates, c_prev, cont.astype(dtype, copy=False), top[0].data[0], tanh_c,
                          top[1].data[0], self.work("lstm_cell", c_prev.shape, dtype))

    def backward(self, top, propagate_down, bottom):
        if propagate_down[2]:
            raise self.config_error("propagate_down", "cannot backpropagate to the sequence "
                                    "indicators (bottom[2], cont)")
        if not (propagate_down[0] or propagate_down[1]):
            return
        c_prev = bottom[0].data[0]
        dtype = c_prev.dtype
        dc = bottom[0].diff[0] if propagate_down[0] else self.work("lstm_dc", c_prev.shape, dtype)
        np.copyto(dc, top[0].diff[0])                       # becomes c_prev's gradient
        dgates = bottom[1].diff[0] if propagate_down[1] else self.work("lstm_gate_grad", self._gates.shape, dtype)
        lstm_cell_backward(self._gates, c_prev, self._tanh_c, top[1].diff[0], dc, dgates)
