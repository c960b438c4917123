"""The six update rules (Caffe's SGD, Nesterov, AdaGrad, RMSProp, AdaDelta and
Adam solvers), each a Solver subclass that overrides compute_update_value and
registers under its SolverParameter.type. Each rule runs over pieces of the
parameter (Solver._pieces): element-wise, so the numbers are those of
whole-array passes, and striped over the worker threads."""
import numpy as np

from cct.core.blob import Blob
from cct.core.errors import ConfigError
from cct.devices.jit import kernel
from cct.training.solver import Solver, register_solver

@kernel
def _sgd_pieces(data, diff, history, regularize, decay, local_rate, momentum):
    """SGD with L2 decay on one piece, in one pass: diff += decay * data;
    history = momentum * history + local_rate * diff; data -= history (and
    diff = history, as Caffe leaves it). Scalars in the arrays' dtype, each
    product rounded before its sum (numba fuses no multiply-add), as numpy does."""
    for i in range(data.shape[0]):
        gradient = diff[i] + data[i] * decay if regularize else diff[i]
        step = history[i] * momentum + gradient * local_rate
        history[i] = step
        diff[i] = step
        data[i] -= step



# Each rule runs over pieces of the parameter (Solver._pieces): element-wise,
# so the numbers are those of whole-array passes.
@register_solver("SGD")
class SGDSolver(Solver):
    """history = momentum * history + local_rate * grad; step = history.

    With L2 decay (or none) and iter_size 1, a parameter's regularize, update
    value and Blob::Update run as one compiled pass per piece (_sgd_pieces):
    the same operations in the same order and precision as the numpy passes,
    so the same numbers, reading and writing each array once instead of ~4
    times (BENCHMARKS.md, "Targets and where we stand")."""

    fused = True                     # False: the numpy passes (tests compare the two)
    device_rule = "SGD"

    def step_scalars(self, index, rate):
        return rate * self.net.params_lr[index], (self.param.momentum,)

    def _update_param(self, index, rate):
        if not self._can_fuse():
            return super()._update_param(index, rate)
        blob = self.net.learnable_params[index]
        decay = self.param.weight_decay * self.net.params_weight_decay[index]
        cast = blob.dtype.type
        for data, diff, history in self._pieces(blob.data, blob.diff, self.history_data(index), temps=0):
            _sgd_pieces(data, diff, history, bool(decay), cast(decay),
                        cast(rate * self.net.params_lr[index]), cast(self.param.momentum))

    def _can_fuse(self):
        """The one-pass update applies: plain SGD steps (no subclass overrides
        them), L2 decay or none, no averaging over iter_size."""
        cls = type(self)
        return (self.fused and self.param.iter_size == 1
                and (self.param.regularization_type == "L2" or not self.param.weight_decay)
                and cls.compute_update_value is SGDSolver.compute_update_value
                and cls.regularize is Solver.regularize and cls.normalize is Solver.normalize
                and cls._apply_step is Solver._apply_step)

    def compute_update_value(self, index, rate):
        local_rate = rate * self.net.params_lr[index]
        momentum = self.param.momentum
        for diff, history, temp in self._pieces(self.net.learnable_params[index].diff, self.history_data(index)):
            history *= momentum
            np.multiply(diff, local_rate, out=temp)
            history += temp
            diff[...] = history


@register_solver("Nesterov")
class NesterovSolver(Solver):
    """history' = momentum * history + local_rate * grad;
    step = (1 + momentum) * history' - momentum * history."""

    device_rule = "Nesterov"

    def step_scalars(self, index, rate):
        return rate * self.net.params_lr[index], (self.param.momentum, 1.0 + self.param.momentum)

    def compute_update_value(self, index, rate):
        momentum = self.param.momentum
        local_rate = rate * self.net.params_lr[index]
        for diff, history, previous in self._pieces(self.net.learnable_params[index].diff, self.history_data(index)):
            previous[...] = history
            history *= momentum
            history += local_rate * diff
            np.multiply(history, 1.0 + momentum, out=diff)
            previous *= momentum
            diff -= previous


def _require_no_momentum(solver):
    if solver.param.momentum != 0:
        raise ConfigError(f"{solver.source}: momentum: cannot be used with {solver.type}, "
                          f"got {solver.param.momentum}")


def _divide_by_root(diff, history, delta, local_rate, temp):
    """diff = local_rate * diff / (sqrt(history) + delta), AdaGrad's and RMSProp's step."""
    np.sqrt(history, out=temp)
    temp += delta
    np.divide(diff, temp, out=diff)
    diff *= local_rate


@register_solver("AdaGrad")
class AdaGradSolver(Solver):
    """history += grad^2; step = local_rate * grad / (sqrt(history) + delta)."""

    device_rule = "AdaGrad"

    def step_scalars(self, index, rate):
        return rate * self.net.params_lr[index], (self.param.delta,)

    def pre_solve(self):
        _require_no_momentum(self)

    def compute_update_value(self, index, rate):
        local_rate = rate * self.net.params_lr[index]
        for diff, history, temp in self._pieces(self.net.learnable_params[index].diff, self.history_data(index)):
            history += np.square(diff, out=temp)
            _divide_by_root(diff, history, self.param.delta, local_rate, temp)


@register_solver("RMSProp")
class RMSPropSolver(Solver):
    """history = rms_decay * history + (1 - rms_decay) * grad^2;
    step = local_rate * grad / (sqrt(history) + delta)."""

    device_rule = "RMSProp"

    def step_scalars(self, index, rate):
        decay = self.param.rms_decay
        return rate * self.net.params_lr[index], (decay, 1.0 - decay, self.param.delta)

    def pre_solve(self):
        _require_no_momentum(self)
        decay = self.param.rms_decay
        if not 0 <= decay < 1:
            raise ConfigError(f"{self.source}: rms_decay: must be in [0, 1), got {decay}")

    def compute_update_value(self, index, rate):
        decay = self.param.rms_decay
        local_rate = rate * self.net.params_lr[index]
        for diff, history, temp in self._pieces(self.net.learnable_params[index].diff, self.history_data(index)):
            np.square(diff, out=temp)
            temp *= 1.0 - decay
            history *= decay
            history += temp
            _divide_by_root(diff, history, self.param.delta, local_rate, temp)


@register_solver("AdaDelta")
class AdaDeltaSolver(Solver):
    """Two running averages (momentum as the decay): g2 of squared gradients and
    u2 of squared steps (history[n + i]).
        g2 = momentum * g2 + (1 - momentum) * grad^2
        step = grad * sqrt((u2 + delta) / (g2 + delta))
        u2 = momentum * u2 + (1 - momentum) * step^2
    and then, unlike the paper (which has no learning rate), Caffe scales the
    step by local_rate = lr(iter) * lr_mult AFTER u2 is updated: u2 tracks the
    unscaled step, so the schedule changes the update but not the history.
    Caffe's examples use base_lr: 1 with lr_policy: "fixed"."""

    device_rule = "AdaDelta"

    def step_scalars(self, index, rate):
        momentum = self.param.momentum
        return rate * self.net.params_lr[index], (momentum, 1.0 - momentum, self.param.delta)

    def pre_solve(self):
        self.history_blobs += [Blob(p.shape, p.dtype) for p in self.net.learnable_params]

    def compute_update_value(self, index, rate):
        momentum, delta = self.param.momentum, self.param.delta
        local_rate = rate * self.net.params_lr[index]
        pieces = self._pieces(self.net.learnable_params[index].diff, self.history_data(index),
                              self.history_data(len(self.net.learnable_params) + index), temps=2)
        for diff, gradients_sq, updates_sq, temp, ratio in pieces:
            gradients_sq *= momentum
            gradients_sq += (1.0 - momentum) * np.square(diff, out=temp)
            np.add(updates_sq, delta, out=ratio)
            np.add(gradients_sq, delta, out=temp)
            ratio /= temp
            np.sqrt(ratio, out=ratio)
            diff *= ratio
            updates_sq *= momentum
            updates_sq += (1.0 - momentum) * np.square(diff, out=temp)
            diff *= local_rate


@register_solver("Adam")
class AdamSolver(Solver):
    """m = beta1 * m + (1 - beta1) * grad; v = beta2 * v + (1 - beta2) * grad^2
    (beta1 = momentum, beta2 = momentum2, v in history[n + i]);
    step = local_rate * sqrt(1 - beta2^t) / (1 - beta1^t) * m / (sqrt(v) + delta),
    with t = iter + 1."""

    device_rule = "Adam"

    def step_scalars(self, index, rate):
        beta1, beta2 = self.param.momentum, self.param.momentum2
        return (rate * self.net.params_lr[index] * self._correction(),
                (beta1, 1.0 - beta1, beta2, 1.0 - beta2, self.param.delta))

    def _correction(self):
        """Adam's bias correction at this iteration, t = iter + 1."""
        t = self.iter + 1
        return np.sqrt(1.0 - self.param.momentum2 ** t) / (1.0 - self.param.momentum ** t)

    def pre_solve(self):
        self.history_blobs += [Blob(p.shape, p.dtype) for p in self.net.learnable_params]

    def compute_update_value(self, index, rate):
        beta1, beta2 = self.param.momentum, self.param.momentum2
        local_rate = rate * self.net.params_lr[index]
        correction = self._correction()
        pieces = self._pieces(self.net.learnable_params[index].diff, self.history_data(index),
                              self.history_data(len(self.net.learnable_params) + index))
        for diff, first, second, temp in pieces:
            first *= beta1
            first += (1.0 - beta1) * diff
            second *= beta2
            second += (1.0 - beta2) * np.square(diff, out=temp)
            np.sqrt(second, out=temp)
            temp += self.param.delta
            np.divide(first, temp, out=diff)
            diff *= local_rate * correction
