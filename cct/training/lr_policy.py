"""Learning-rate policies: Caffe's SGDSolver::GetLearningRate.

    fixed      base_lr
    step       base_lr * gamma ^ floor(iter / stepsize)
    exp        base_lr * gamma ^ iter
    inv        base_lr * (1 + gamma * iter) ^ -power
    multistep  base_lr * gamma ^ current_step; current_step advances by one
               when iter reaches stepvalue[current_step] (a counter the solver
               keeps and snapshots, as Caffe does)
    poly       base_lr * (1 - iter / max_iter) ^ power
    sigmoid    base_lr / (1 + exp(-gamma * (iter - stepsize)))
"""
import logging
import math

from cct.core.errors import ConfigError

log = logging.getLogger("cct.training.solver")

POLICIES = ("fixed", "step", "exp", "inv", "multistep", "poly", "sigmoid")


def learning_rate(param, iteration, current_step=0, source="<solver>"):
    """The rate for `iteration` under SolverParameter `param`.

    Returns (rate, current_step): `step` and `multistep` move the step
    counter, the other policies hand it back unchanged.
    """
    policy = param.lr_policy
    base_lr = param.base_lr

    def need(field, ok, requirement):
        if not ok:
            raise ConfigError(f"{source}: {field}: lr_policy {policy!r} needs {field} {requirement}, "
                              f"got {getattr(param, field)}")

    if policy == "fixed":
        return base_lr, current_step
    if policy == "step":
        need("stepsize", param.stepsize > 0, "> 0")
        need("gamma", param.gamma >= 0, ">= 0")
        current_step = iteration // param.stepsize
        return base_lr * math.pow(param.gamma, current_step), current_step
    if policy == "exp":
        need("gamma", param.gamma >= 0, ">= 0")
        return base_lr * math.pow(param.gamma, iteration), current_step
    if policy == "inv":
        need("gamma", param.gamma >= 0, ">= 0")
        return base_lr * math.pow(1.0 + param.gamma * iteration, -param.power), current_step
    if policy == "multistep":
        need("gamma", param.gamma >= 0, ">= 0")
        # One step per call at most, exactly as Caffe advances its counter.
        if current_step < len(param.stepvalue) and iteration >= param.stepvalue[current_step]:
            current_step += 1
            log.info("MultiStep Status: Iteration %d, step = %d", iteration, current_step)
        return base_lr * math.pow(param.gamma, current_step), current_step
    if policy == "poly":
        need("max_iter", param.max_iter > 0, "> 0")
        # Past max_iter Caffe's pow() gives NaN; the rate stays at 0 instead.
        remaining = max(0.0, 1.0 - iteration / param.max_iter)
        return base_lr * math.pow(remaining, param.power), current_step
    if policy == "sigmoid":
        need("gamma", param.gamma >= 0, ">= 0")
        need("stepsize", param.stepsize > 0, "> 0")
        exponent = -param.gamma * (iteration - param.stepsize)
        # exp overflows for far-off iterations; the rate there is 0.
        rate = 0.0 if exponent > 700 else base_lr / (1.0 + math.exp(exponent))
        return rate, current_step
    known = ", ".join(POLICIES)
    if not policy:
        raise ConfigError(f"{source}: lr_policy: not set; choose one of {known}")
    raise ConfigError(f"{source}: lr_policy: unknown learning rate policy {policy!r}; known: {known}")


def check_policy(param, source="<solver>"):
    """Fail at solver construction, not at the first update, on a bad policy."""
    # A step counter past the last stepvalue keeps multistep from logging here.
    learning_rate(param, 0, len(param.stepvalue), source)
