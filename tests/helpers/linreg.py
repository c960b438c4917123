"""The solver tests' net: linear regression on test-only layers whose
gradients are known in closed form, so solver tests do not depend on the layer
zoo, and a float64 textbook version of every update rule to check them by.
    TestLinReg     bottoms x (N, D), t (N, M); params W (M, D), b (M,)
                   loss = sum((x W^T + b - t)^2) / (2 N)
    TestCycleData  tops x, t: the next batch of BATCHES[layer name] per forward
Used by the training, CLI, progress and atomic-write tests."""
import numpy as np
from google.protobuf import text_format

import cct
from cct.core.fillers import fill
from cct.core.layer import Layer
from cct.proto import caffe_pb2
from cct.training import solver as solver_module
from helpers.registry import register_test_layer


@register_test_layer("TestLinReg")
class LinRegLayer(Layer):
    exact_bottoms = 2
    exact_tops = 1
    is_loss = True

    def setup(self, bottom, top):
        param = self.layer_param.inner_product_param
        outputs, inputs = param.num_output, bottom[0].shape[1]
        self.blobs = [cct.Blob((outputs, inputs)), cct.Blob((outputs,))]
        fill(self.blobs[0], param.weight_filler, self.where())
        fill(self.blobs[1], param.bias_filler, self.where())

    def reshape(self, bottom, top):
        top[0].reshape(())

    def forward(self, bottom, top):
        x, t = bottom[0].data, bottom[1].data
        self.residual = x @ self.blobs[0].data.T + self.blobs[1].data - t
        top[0].data[...] = np.sum(self.residual ** 2) / (2 * x.shape[0])

    def backward(self, top, propagate_down, bottom):
        scaled = self.residual * (top[0].diff / bottom[0].shape[0])
        if self.param_propagate_down[0]:
            self.blobs[0].diff[...] += scaled.T @ bottom[0].data
        if self.param_propagate_down[1]:
            self.blobs[1].diff[...] += scaled.sum(axis=0)
        if propagate_down[0]:
            bottom[0].diff[...] = scaled @ self.blobs[0].data


@register_test_layer("TestCycleData")
class CycleDataLayer(Layer):
    exact_bottoms = 0
    exact_tops = 2
    BATCHES = {}          # layer name -> [(x, t), ...]

    def setup(self, bottom, top):
        self.position = 0
        self.reshape(bottom, top)

    def reshape(self, bottom, top):
        batches = self.BATCHES[self.name]
        x, t = batches[self.position % len(batches)]
        top[0].reshape(x.shape)
        top[1].reshape(t.shape)

    def forward(self, bottom, top):
        batches = self.BATCHES[self.name]
        x, t = batches[self.position % len(batches)]
        top[0].data[...] = x
        top[1].data[...] = t
        self.position += 1


BATCHES = CycleDataLayer.BATCHES

N, D, M = 4, 3, 2
RNG = np.random.default_rng(7)
X = RNG.normal(size=(N, D)).astype(np.float32)
T = RNG.normal(size=(N, M)).astype(np.float32)
W0 = RNG.normal(size=(M, D)).astype(np.float32)
B0 = RNG.normal(size=(M,)).astype(np.float32)

NET = f"""
name: "linreg"
layer {{ name: "data" type: "Input" top: "x" top: "t"
        input_param {{ shape {{ dim: {N} dim: {D} }} shape {{ dim: {N} dim: {M} }} }} }}
layer {{ name: "fc" type: "TestLinReg" bottom: "x" bottom: "t" top: "loss"
        param {{ lr_mult: LR0 decay_mult: DECAY0 }} param {{ lr_mult: LR1 decay_mult: DECAY1 }}
        inner_product_param {{ num_output: {M} weight_filler {{ type: "gaussian" std: 0.1 }} }} }}
"""


def net_text(mults=((1, 1), (2, 0))):
    text = NET
    for index, (lr, decay) in enumerate(mults):
        text = text.replace(f"LR{index}", str(lr)).replace(f"DECAY{index}", str(decay))
    return text


def solver_param(text, net=None):
    param = text_format.Parse(text, caffe_pb2.SolverParameter())
    if not param.HasField("net") and not param.HasField("train_net_param"):
        param.net_param.CopyFrom(text_format.Parse(net or net_text(), caffe_pb2.NetParameter()))
    return param


def make_solver(text, net=None, x=X, t=T):
    solver = solver_module.get_solver(solver_param(text, net))
    set_weights(solver.net, x, t)
    return solver


def set_weights(net, x=X, t=T):
    net.params["fc"][0].data[...] = W0
    net.params["fc"][1].data[...] = B0
    if "x" in net.inputs:
        net.blobs["x"].data[...] = x
        net.blobs["t"].data[...] = t


# --- the textbook version ------------------------------------------------------------
def gradients(w, b, x, t):
    residual = x @ w.T + b - t
    return [residual.T @ x / len(x), residual.sum(axis=0) / len(x)]


def reference_run(kind, steps, lr=0.01, momentum=0.0, momentum2=0.999, delta=1e-8, rms_decay=0.99,
                  weight_decay=0.0, regularization="L2", mults=((1, 1), (2, 0)), clip=-1.0,
                  batches=None, iter_size=1, rate_at=None):
    """Float64 parameters after `steps` updates, from the formulas of each method."""
    f = lambda v: float(np.float32(v))             # proto fields are float32
    lr, momentum, momentum2, delta, rms_decay, weight_decay, clip = map(
        f, (lr, momentum, momentum2, delta, rms_decay, weight_decay, clip))
    params = [W0.astype(np.float64), B0.astype(np.float64)]
    first = [np.zeros_like(p) for p in params]
    second = [np.zeros_like(p) for p in params]
    batches = batches or [(X, T)]
    position = 0
    for iteration in range(steps):
        grads = [np.zeros_like(p) for p in params]
        for _ in range(iter_size):
            x, t = (a.astype(np.float64) for a in batches[position % len(batches)])
            position += 1
            grads = [g + h for g, h in zip(grads, gradients(*params, x, t))]
        if clip >= 0:
            norm = np.sqrt(sum(np.sum(g ** 2) for g in grads))
            if norm > clip:
                grads = [g * clip / norm for g in grads]
        rate = rate_at(iteration) if rate_at else lr
        for i, (p, g) in enumerate(zip(params, grads)):
            g = g / iter_size
            decay = weight_decay * mults[i][1]
            g = g + decay * (p if regularization == "L2" else np.sign(p))
            local = rate * mults[i][0]
            if kind == "SGD":
                first[i] = momentum * first[i] + local * g
                step = first[i]
            elif kind == "Nesterov":
                previous = first[i]
                first[i] = momentum * first[i] + local * g
                step = (1 + momentum) * first[i] - momentum * previous
            elif kind == "AdaGrad":
                first[i] = first[i] + g ** 2
                step = local * g / (np.sqrt(first[i]) + delta)
            elif kind == "RMSProp":
                first[i] = rms_decay * first[i] + (1 - rms_decay) * g ** 2
                step = local * g / (np.sqrt(first[i]) + delta)
            elif kind == "AdaDelta":
                first[i] = momentum * first[i] + (1 - momentum) * g ** 2
                unscaled = g * np.sqrt((second[i] + delta) / (first[i] + delta))
                second[i] = momentum * second[i] + (1 - momentum) * unscaled ** 2
                step = local * unscaled
            elif kind == "Adam":
                first[i] = momentum * first[i] + (1 - momentum) * g
                second[i] = momentum2 * second[i] + (1 - momentum2) * g ** 2
                k = iteration + 1
                correction = np.sqrt(1 - momentum2 ** k) / (1 - momentum ** k)
                step = local * correction * first[i] / (np.sqrt(second[i]) + delta)
            params[i] = p - step
    return params


def assert_params(net, expected, rtol=2e-5, atol=1e-6):
    for blob, want in zip(net.params["fc"], expected):
        np.testing.assert_allclose(blob.data, want, rtol=rtol, atol=atol)


SOLVER_CASES = {
    "SGD": ('type: "SGD" momentum: 0.9', dict(momentum=0.9)),
    "Nesterov": ('type: "Nesterov" momentum: 0.9', dict(momentum=0.9)),
    "AdaGrad": ('type: "AdaGrad" delta: 1e-6', dict(delta=1e-6)),
    "RMSProp": ('type: "RMSProp" rms_decay: 0.95 delta: 1e-6', dict(rms_decay=0.95, delta=1e-6)),
    "AdaDelta": ('type: "AdaDelta" momentum: 0.95 delta: 1e-6', dict(momentum=0.95, delta=1e-6)),
    "Adam": ('type: "Adam" momentum: 0.9 momentum2: 0.999 delta: 1e-8', dict(momentum=0.9)),
}
