"""RNN, LSTM and LSTMUnit (layers/recurrent.py): forward and backward against
the plain per-step version (layers/recurrent_reference.py) with sequences
restarting mid-batch, x_static and expose_hidden; the shared gradient checker
on the same cases; the state carried from one forward to the next; Caffe's
parameter blobs; lr_mult, decay_mult and sharing in a net; errors. BVLC
Caffe's own outputs are the reference cases rnn_basic, lstm_basic and lstm_unit
(tests/reference)."""
import numpy as np
import pytest
from google.protobuf import text_format

import cct
from cct.core.errors import ConfigError, ShapeError
import cct.layers.recurrent_reference as reference
from cct.proto import caffe_pb2
from cct.testing.gradient_check import check_layer_gradient, make_layer, setup_layer
from cct.training import solver as solver_module
from helpers.nets import run_net_text

RNG = np.random.default_rng(19)
FILLERS = 'weight_filler { type: "uniform" min: -0.6 max: 0.6 } bias_filler { type: "uniform" min: -0.3 max: 0.3 }'
STEPS, STREAMS, HIDDEN = 5, 3, 4
X_SHAPE = (STEPS, STREAMS, 2, 3)            # D = 6 values per step, folded from axis 2
STATIC_SHAPE = (STREAMS, 5)
STATES = {"RNN": ("h",), "LSTM": ("h", "c")}


def layer_text(type_name, expose=False, hidden=HIDDEN):
    expose_field = "expose_hidden: true" if expose else ""
    return f'type: "{type_name}" recurrent_param {{ num_output: {hidden} {expose_field} {FILLERS} }}'


def restarting_cont(first=0.0):
    """(T, N) indicators: stream 1 starts a new sequence at step 2, stream 2 at
    steps 2 and 4; step 0 is `first` for every stream."""
    cont = np.ones((STEPS, STREAMS))
    cont[0] = first
    cont[2, 1] = cont[2, 2] = cont[4, 2] = 0
    return cont


def inputs(type_name, static, expose):
    """Bottom arrays: x, cont, [x_static], [initial states]. With exposed
    states, step 0 continues from them (cont 1), so they matter."""
    arrays = [RNG.standard_normal(X_SHAPE), restarting_cont(first=1.0 if expose else 0.0)]
    if static:
        arrays.append(RNG.standard_normal(STATIC_SHAPE))
    if expose:
        arrays += [RNG.standard_normal((1, STREAMS, HIDDEN)) for _ in STATES[type_name]]
    return arrays


def reference_run(type_name, layer, arrays, static, top_diff):
    """(outputs, final states, dx, dx_static, weight gradients) of the plain version."""
    x = arrays[0].reshape(STEPS, STREAMS, -1)
    x_static = arrays[2].reshape(STREAMS, -1) if static else None
    states = [a[0] for a in arrays[3 if static else 2:]] or [np.zeros((STREAMS, HIDDEN))] * len(STATES[type_name])
    weights = [blob.data for blob in layer.blobs]
    if type_name == "RNN":
        out, h, cache = reference.rnn_forward(x, arrays[1], weights, states[0], x_static)
        return (out, [h]) + reference.rnn_backward(top_diff, cache)
    out, h, c, cache = reference.lstm_forward(x, arrays[1], weights, *states, x_static=x_static)
    return (out, [h, c]) + reference.lstm_backward(top_diff, cache)


CASES = [(t, static, expose) for t in ("RNN", "LSTM") for static in (False, True) for expose in (False, True)]


def case_id(case):
    type_name, static, expose = case
    return type_name + ("-static" if static else "") + ("-expose" if expose else "")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_forward_and_backward_match_the_plain_version(case):
    type_name, static, expose = case
    arrays = inputs(*case)
    layer = make_layer(layer_text(type_name, expose))
    bottoms, tops = setup_layer(layer, arrays, num_tops=1 + expose * len(STATES[type_name]))
    layer.forward(bottoms, tops)
    top_diff = RNG.standard_normal(tops[0].shape)
    out, final, dx, dx_static, grads = reference_run(type_name, layer, arrays, static, top_diff)
    np.testing.assert_allclose(tops[0].data, out, rtol=1e-10, atol=1e-12)
    for top, state in zip(tops[1:], final):
        np.testing.assert_allclose(top.data[0], state, rtol=1e-10, atol=1e-12)

    tops[0].diff[...] = top_diff
    for top in tops[1:]:
        top.diff[...] = 1.0                    # ignored: Caffe passes no gradient back through them
    for bottom in bottoms:
        bottom.diff[...] = np.nan
    propagate = [i != 1 for i in range(len(bottoms))]
    layer.backward(tops, propagate, bottoms)
    np.testing.assert_allclose(bottoms[0].diff.reshape(dx.shape), dx, rtol=1e-10, atol=1e-12)
    if static:
        np.testing.assert_allclose(bottoms[2].diff.reshape(dx_static.shape), dx_static, rtol=1e-10, atol=1e-12)
    for state in bottoms[(3 if static else 2):]:
        assert not state.diff.any()            # no gradient to the initial states, as in Caffe
    assert np.isnan(bottoms[1].diff).all()     # nor to cont
    for blob, expected in zip(layer.blobs, grads):
        np.testing.assert_allclose(blob.diff, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_gradient(case):
    """The shared checker with sequences restarting mid-batch; the exposed
    states' tops stay out of the objective (their diffs are ignored)."""
    type_name, static, expose = case
    arrays = inputs(*case)
    data_bottoms = [0, 2] if static else [0]
    check_layer_gradient(make_layer(layer_text(type_name, expose)), arrays,
                         num_tops=1 + expose * len(STATES[type_name]), check_bottoms=data_bottoms, check_tops=[0])


@pytest.mark.parametrize("cont", [[0, 0, 0], [1, 0, 1]], ids=["starts", "continues"])
def test_lstm_unit_gradient(cont):
    arrays = [RNG.standard_normal((1, 3, HIDDEN)), RNG.standard_normal((1, 3, 4 * HIDDEN)), np.array([cont], float)]
    check_layer_gradient(make_layer('type: "LSTMUnit"'), arrays, num_tops=2, check_bottoms=[0, 1])


def test_lstm_unit_is_one_lstm_step():
    """The unit's c and h are the plain LSTM's after one step whose gate input is x."""
    c_prev, gates = RNG.standard_normal((1, 3, HIDDEN)), RNG.standard_normal((1, 3, 4 * HIDDEN))
    cont = np.array([[1.0, 0.0, 1.0]])
    layer = make_layer('type: "LSTMUnit"')
    bottoms, tops = setup_layer(layer, [c_prev, gates, cont], num_tops=2)
    layer.forward(bottoms, tops)
    identity = [np.eye(4 * HIDDEN), np.zeros(4 * HIDDEN), np.zeros((4 * HIDDEN, HIDDEN))]    # gates = x
    h, _, c, _ = reference.lstm_forward(gates, cont, identity, np.zeros((3, HIDDEN)), c_prev[0])
    np.testing.assert_allclose(tops[0].data[0], c, rtol=1e-12)
    np.testing.assert_allclose(tops[1].data, h, rtol=1e-12)


# --- the state carried from forward to forward ------------------------------------------------
def forward_parts(layer, parts):
    """The layer's output for each (x, cont) in `parts`, one forward each, in turn."""
    outputs = []
    for x, cont in parts:
        bottoms = [cct.Blob(a.shape, dtype=np.float64) for a in (x, cont)]
        bottoms[0].data[...], bottoms[1].data[...] = x, cont
        tops = [cct.Blob(dtype=np.float64)]
        layer.reshape(bottoms, tops)
        layer.forward(bottoms, tops)
        outputs.append(tops[0].data.copy())
    return outputs


def from_zeros(type_name, layer, x, cont):
    """The plain version's output for a forward that starts from zero states."""
    weights = [blob.data for blob in layer.blobs]
    zeros = np.zeros((x.shape[1], HIDDEN))
    if type_name == "RNN":
        return reference.rnn_forward(x, cont, weights, zeros)[0]
    return reference.lstm_forward(x, cont, weights, zeros, zeros)[0]


@pytest.mark.parametrize("type_name", ["RNN", "LSTM"])
def test_state_carries_over_while_cont_is_one(type_name):
    """A sequence split across two forwards (cont 1 at the second's first step)
    gives the outputs of one forward over it all; reset() forgets the state."""
    x, cont = RNG.standard_normal((6, 2, 3)), np.ones((6, 2))
    cont[0] = 0
    layer = make_layer(layer_text(type_name))
    setup_layer(layer, [x, cont])
    whole, = forward_parts(layer, [(x, cont)])
    halves = forward_parts(layer, [(x[:3], cont[:3]), (x[3:], cont[3:])])
    np.testing.assert_allclose(np.concatenate(halves), whole, rtol=1e-12)
    layer.reset()
    restarted, = forward_parts(layer, [(x[3:], cont[3:])])
    np.testing.assert_allclose(restarted, from_zeros(type_name, layer, x[3:], cont[3:]), rtol=1e-12)
    assert not np.allclose(restarted, halves[1])


def test_a_new_stream_count_starts_from_zeros():
    x, cont = RNG.standard_normal((2, 3, 4)), np.ones((2, 3))
    layer = make_layer(layer_text("LSTM"))
    setup_layer(layer, [x, cont])
    fewer, = forward_parts(layer, [(x, cont), (x[:, :2], cont[:, :2])])[1:]
    np.testing.assert_allclose(fewer, from_zeros("LSTM", layer, x[:, :2], cont[:, :2]), rtol=1e-12)


@pytest.mark.parametrize("type_name", ["RNN", "LSTM"])
def test_exposed_final_states_continue_the_sequence(type_name):
    """expose_hidden: the final states of one half fed as the next half's
    initial states give the whole sequence's outputs."""
    x, cont = RNG.standard_normal((6, 2, 3)), np.ones((6, 2))
    cont[0] = 0
    count = len(STATES[type_name])
    layer = make_layer(layer_text(type_name, expose=True))
    zeros = [np.zeros((1, 2, HIDDEN))] * count
    bottoms, tops = setup_layer(layer, [x, cont] + zeros, num_tops=1 + count)
    layer.forward(bottoms, tops)
    whole = tops[0].data.copy()
    halves, states = [], zeros
    for part in (slice(0, 3), slice(3, 6)):
        for blob, values in zip(bottoms, [x[part], cont[part]] + states):
            blob.reshape(values.shape)
            blob.data[...] = values
        layer.reshape(bottoms, tops)
        layer.forward(bottoms, tops)
        halves.append(tops[0].data.copy())
        states = [top.data.copy() for top in tops[1:]]
    np.testing.assert_allclose(np.concatenate(halves), whole, rtol=1e-12)


# --- parameters: Caffe's blobs, lr_mult, decay_mult, sharing -------------------------------------
@pytest.mark.parametrize("type_name,static,shapes", [
    ("RNN", False, [(4, 6), (4,), (4, 4), (4, 4), (4,)]),
    ("RNN", True, [(4, 6), (4,), (4, 5), (4, 4), (4, 4), (4,)]),
    ("LSTM", False, [(16, 6), (16,), (16, 4)]),
    ("LSTM", True, [(16, 6), (16,), (16, 5), (16, 4)]),
])
def test_parameter_blobs_in_caffes_order(type_name, static, shapes):
    """The unrolled net's parameters in Caffe's order: RNN W_xh, b_h, [W_xh_static],
    W_hh, W_ho, b_o; LSTM W_xc, b_c, [W_xc_static], W_hc."""
    layer = make_layer(layer_text(type_name))
    setup_layer(layer, inputs(type_name, static, False))
    assert [blob.shape for blob in layer.blobs] == shapes


SEQUENCE_NET = '''name: "sequence"
force_backward: true
layer { name: "input" type: "Input" top: "x" top: "cont" top: "target"
        input_param { shape { dim: 4 dim: 2 dim: 3 } shape { dim: 4 dim: 2 } shape { dim: 4 dim: 2 dim: 3 } } }
layer { name: "a" type: "LSTM" bottom: "x" bottom: "cont" top: "a" PARAMS_A
        recurrent_param { num_output: 3 FILLERS } }
layer { name: "b" type: "LSTM" bottom: "x" bottom: "cont" top: "b" PARAMS_B
        recurrent_param { num_output: 3 FILLERS } }
layer { name: "sum" type: "Eltwise" bottom: "a" bottom: "b" top: "sum" }
layer { name: "loss" type: "EuclideanLoss" bottom: "sum" bottom: "target" top: "loss" }
'''.replace("FILLERS", FILLERS)


def sequence_net(params_a="", params_b=""):
    cct.set_random_seed(3)
    net = cct.Net(SEQUENCE_NET.replace("PARAMS_A", params_a).replace("PARAMS_B", params_b), cct.TRAIN)
    rng = np.random.default_rng(4)
    for name in ("x", "target"):
        net.blobs[name].data[...] = rng.standard_normal(net.blobs[name].shape)
    net.blobs["cont"].data[...] = 1
    net.blobs["cont"].data[0] = 0              # every stream starts at step 0, stream 1 again at step 2
    net.blobs["cont"].data[2, 1] = 0
    return net



@pytest.mark.parametrize("type_name", ["RNN", "LSTM"])
def test_an_input_of_no_values_per_step_is_refused_by_its_filler(type_name):
    """Found by the fuzzer (issue 15): x of shape (T, N, 0) failed in numpy's
    reshape(-1, 0). Caffe's unrolled net would fill an empty input-to-gates
    weight, which its fillers refuse (CHECK(count), filler.hpp): so does cct."""
    net_text = f"""force_backward: true
    layer {{ name: "x" type: "Input" top: "x" input_param {{ shape {{ dim: 4 dim: 3 dim: 0 }} }} }}
    layer {{ name: "cont" type: "Input" top: "cont" input_param {{ shape {{ dim: 4 dim: 3 }} }} }}
    layer {{ name: "l" type: "{type_name}" bottom: "x" bottom: "cont" top: "out"
            recurrent_param {{ num_output: 5 {FILLERS} }} }}"""
    with pytest.raises(cct.ConfigError, match=rf"layer 'l' \({type_name}\): recurrent_param.weight_filler: the "
                                              r"\w+ filler cannot fill a blob of shape \(\d+, 0\)"):
        run_net_text(net_text, cct.TRAIN)


def test_shared_parameters_get_both_layers_gradients():
    names = 'param { name: "w_x" } param { name: "b" } param { name: "w_h" }'
    shared = sequence_net(names, names)
    for own, owner in zip(shared.params["b"], shared.params["a"]):
        assert np.shares_memory(own.data, owner.data)
    separate = sequence_net()
    for k, blob in enumerate(separate.params["a"]):
        separate.params["b"][k].data[...] = blob.data
        shared.params["a"][k].data[...] = blob.data
    for net in (shared, separate):
        net.clear_param_diffs()
        net.forward()
        net.backward()
    np.testing.assert_allclose(shared.blobs["loss"].data, separate.blobs["loss"].data, rtol=1e-6)
    for k in range(3):
        expected = separate.params["a"][k].diff + separate.params["b"][k].diff
        np.testing.assert_allclose(shared.params["a"][k].diff, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(shared.blobs["x"].diff, separate.blobs["x"].diff, rtol=1e-5, atol=1e-6)
    assert not shared.blobs["cont"].diff.any()


def test_lr_mult_and_decay_mult_apply_per_blob():
    """SGD without momentum, weight decay 0.1: W_xc frozen (lr_mult 0); b_c
    with lr_mult 2 and no decay; W_hc decayed as usual."""
    params = "param { lr_mult: 0 } param { lr_mult: 2 decay_mult: 0 } param { lr_mult: 1 decay_mult: 1 }"
    net_param = text_format.Parse(SEQUENCE_NET.replace("PARAMS_A", params).replace("PARAMS_B", ""),
                                  caffe_pb2.NetParameter())
    solver_param = text_format.Parse('base_lr: 0.1 lr_policy: "fixed" weight_decay: 0.1 max_iter: 1',
                                     caffe_pb2.SolverParameter())
    solver_param.net_param.CopyFrom(net_param)
    solver = solver_module.get_solver(solver_param)
    net = solver.net
    reference_net = sequence_net()
    for name in ("x", "cont", "target"):
        net.blobs[name].data[...] = reference_net.blobs[name].data
    before = [blob.data.copy() for blob in net.params["a"]]
    net.clear_param_diffs()
    net.forward()
    net.backward()
    gradient = [blob.diff.copy() for blob in net.params["a"]]
    solver.step(1)
    after = [blob.data for blob in net.params["a"]]
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_allclose(after[1], before[1] - 0.2 * gradient[1], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(after[2], before[2] - 0.1 * (gradient[2] + 0.1 * before[2]), rtol=1e-5, atol=1e-7)


# --- errors ------------------------------------------------------------------------------------
def test_errors_name_the_layer_and_field():
    with pytest.raises(ConfigError, match=r"layer 'lstm' \(LSTM\): recurrent_param.num_output: must be > 0, got 0"):
        setup_layer(make_layer('type: "LSTM" recurrent_param { num_output: 0 }'), [np.zeros((2, 1, 3)), np.ones((2, 1))])
    with pytest.raises(ShapeError, match=r"cont\) must be \(T, N\)"):
        setup_layer(make_layer(layer_text("RNN")), [np.zeros((2, 1, 3)), np.ones((2, 2))])
    with pytest.raises(ConfigError, match="takes at least 4 bottom"):
        setup_layer(make_layer(layer_text("LSTM", expose=True)), [np.zeros((2, 1, 3)), np.ones((2, 1))], num_tops=3)
    with pytest.raises(ConfigError, match="takes exactly 2 top"):
        setup_layer(make_layer(layer_text("RNN", expose=True)), [np.zeros((2, 1, 3)), np.ones((2, 1)),
                                                                 np.zeros((1, 1, HIDDEN))])
    layer = make_layer(layer_text("RNN"))
    bottoms, tops = setup_layer(layer, [np.zeros((2, 1, 3)), np.ones((2, 1))])
    bottoms[0].reshape(2, 1, 4)
    with pytest.raises(ShapeError, match="the weights take 3"):
        layer.reshape(bottoms, tops)
    bottoms[0].reshape(2, 1, 3)
    layer.forward(bottoms, tops)
    with pytest.raises(ConfigError, match="cannot backpropagate to the sequence indicators"):
        layer.backward(tops, [True, True], bottoms)


def test_force_backward_skips_cont():
    net = sequence_net()
    assert net.bottom_need_backward[net.layer_names.index("a")] == [True, False]


# --- Caffe's input diff: written whatever propagate_down says ------------------------------------
UNFORCED_NET = '''name: "unforced"
layer { name: "input" type: "Input" top: "x" top: "cont" top: "target" STATIC_TOP
        input_param { shape { dim: 4 dim: 2 dim: 3 } shape { dim: 4 dim: 2 } shape { dim: 4 dim: 2 dim: 5 }
                      STATIC_SHAPE } }
layer { name: "rec" type: "TYPE" bottom: "x" bottom: "cont" STATIC_BOTTOM top: "h"
        recurrent_param { num_output: 5 FILLERS } }
layer { name: "loss" type: "EuclideanLoss" bottom: "h" bottom: "target" top: "loss" }
'''.replace("FILLERS", FILLERS)


def unforced_net(type_name, static, force=False):
    """Input -> RNN/LSTM -> EuclideanLoss, no force_backward (unless `force`):
    only the layer's parameters need backward, so propagate_down is False for
    every bottom."""
    text = ("force_backward: true\n" if force else "") + UNFORCED_NET.replace("TYPE", type_name)
    text = text.replace("STATIC_TOP", 'top: "x_static"' if static else "")
    text = text.replace("STATIC_SHAPE", "shape { dim: 2 dim: 4 }" if static else "")
    text = text.replace("STATIC_BOTTOM", 'bottom: "x_static"' if static else "")
    cct.set_random_seed(5)
    net = cct.Net(text, cct.TRAIN)
    rng = np.random.default_rng(6)
    for name in ("x", "target") + (("x_static",) if static else ()):
        net.blobs[name].data[...] = rng.standard_normal(net.blobs[name].shape)
    net.blobs["cont"].data[...] = 1
    net.blobs["cont"].data[0] = 0                   # every stream starts at step 0, stream 1 again at 2
    net.blobs["cont"].data[2, 1] = 0
    return net


@pytest.mark.parametrize("static", [False, True], ids=["plain", "static"])
@pytest.mark.parametrize("type_name", ["LSTM", "RNN"])
def test_input_diff_written_without_propagate_down_as_caffe(type_name, static):
    """Caffe's RecurrentLayer::Backward_cpu runs its unrolled net's whole backward
    "unconditionally" (BVLC 1.0 src/caffe/layers/recurrent_layer.cpp:283-286:
    `unrolled_net_->BackwardFrom(last_layer_index_)`), and the unrolled net's
    x_transform and W_xc_x_static layers set propagate_down: true
    (lstm_layer.cpp:116, 129; rnn_layer.cpp:107, 120), sharing x's and
    x_static's diffs with the bottoms (recurrent_layer.cpp ShareDiff). So an
    LSTM after an Input blob in a net without force_backward leaves x's full
    gradient in x.diff; cont's diff is never shared, so never written.
    Reference: the plain unrolled computation (layers/recurrent_reference.py)
    from h's diff, and the same net with force_backward."""
    net = unforced_net(type_name, static)
    index = net.layer_names.index("rec")
    assert net.layer_need_backward[index] and not any(net.bottom_need_backward[index])
    net.forward()
    net.backward()
    x, cont = net.blobs["x"].data, net.blobs["cont"].data
    x_static = net.blobs["x_static"].data if static else None
    weights = [blob.data.astype(np.float64) for blob in net.layers[index].blobs]
    zeros = np.zeros((2, 5))
    if type_name == "LSTM":
        *_, cache = reference.lstm_forward(x.astype(np.float64), cont, weights, zeros, zeros, x_static=x_static)
        dx, dx_static, _ = reference.lstm_backward(net.blobs["h"].diff.astype(np.float64), cache)
    else:
        *_, cache = reference.rnn_forward(x.astype(np.float64), cont, weights, zeros, x_static)
        dx, dx_static, _ = reference.rnn_backward(net.blobs["h"].diff.astype(np.float64), cache)
    assert np.abs(dx).max() > 1e-3
    np.testing.assert_allclose(net.blobs["x"].diff, dx, rtol=1e-4, atol=1e-6)
    if static:
        np.testing.assert_allclose(net.blobs["x_static"].diff, dx_static, rtol=1e-4, atol=1e-6)
    assert not net.blobs["cont"].diff.any()
    forced = unforced_net(type_name, static, force=True)
    assert forced.bottom_need_backward[index] == [True, False] + [True] * static
    forced.forward()
    forced.backward()
    for name in ("x", "x_static", "cont") if static else ("x", "cont"):
        np.testing.assert_array_equal(net.blobs[name].diff, forced.blobs[name].diff)


@pytest.mark.parametrize("partitions", [2], indirect=True)
def test_never_split_along_time(partitions):
    """Asked for 2 batch partitions everywhere, the runtime still runs the
    recurrent layers whole: their axis 0 is time."""
    net = sequence_net()
    net.forward()
    for name in ("a", "b"):
        index = net.layer_names.index(name)
        assert not net.executor.partitionable(index) and net.executor.partitions(index) == 1
