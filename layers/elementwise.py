"""Elementwise arithmetic between blobs, and along axes: Eltwise, Reduction,
Scale, Bias, Embed, and SENet's Axpy."""
import math

import numpy as np

from cct.core.layer import Layer, register
from cct.proto import caffe_pb2

from .shape import canonical_axis, gather_rows

_ELTWISE = caffe_pb2.EltwiseParameter
_REDUCTION = caffe_pb2.ReductionParameter


@register("Eltwise")
class Eltwise(Layer):
    """Combines same-shaped bottoms element by element.

    eltwise_param: operation PROD, SUM (default) or MAX; coeff: none or one
    per bottom (SUM uses them, MAX ignores them, PROD refuses them); stable_prod_grad (default true): PROD's gradient as
    the product of the other bottoms rather than top / bottom.
    top = prod_i b_i  |  sum_i coeff_i * b_i  |  max_i b_i (ties: bottom 1 beats
    bottom 0, later bottoms win only when strictly greater, as in Caffe).
    """
    min_bottoms = 2
    exact_tops = 1

    def setup(self, bottom, top):
        param = self.layer_param.eltwise_param
        self.op = param.operation
        # As Caffe: PROD refuses coefficients, MAX accepts and ignores them.
        if param.coeff and self.op == _ELTWISE.PROD:
            raise self.config_error("eltwise_param.coeff", "the PROD operation takes no coefficients")
        if param.coeff and len(param.coeff) != len(bottom):
            raise self.config_error("eltwise_param.coeff", f"give one coefficient per bottom "
                                    f"({len(bottom)}), got {len(param.coeff)}")
        self.coeffs = list(param.coeff) or [1.0] * len(bottom)
        self.stable_prod_grad = param.stable_prod_grad

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        for index, blob in enumerate(bottom[1:], 1):
            if blob.shape != shape:
                raise self.shape_error(f"bottom[{index}] has shape {blob.shape}, bottom[0] {shape}; "
                                       "Eltwise needs equal shapes")
        top[0].reshape(shape)

    def forward(self, bottom, top):
        inputs = [blob.data for blob in bottom]
        out = top[0].data
        if any(blob is top[0] for blob in bottom[1:]):
            out = np.empty_like(out)        # in place on a later bottom: keep it until read
        if self.op == _ELTWISE.PROD:
            np.multiply(inputs[0], inputs[1], out=out)
            for values in inputs[2:]:
                out *= values
        elif self.op == _ELTWISE.SUM:
            if self.coeffs[0] == 1:
                out[...] = inputs[0]
            else:
                np.multiply(inputs[0], self.coeffs[0], out=out)
            for values, coeff in zip(inputs[1:], self.coeffs[1:]):
                out += values if coeff == 1 else coeff * values
        else:
            self._argmax = argmax = np.ones(out.shape, np.int32)
            argmax[inputs[0] > inputs[1]] = 0
            np.maximum(inputs[0], inputs[1], out=out)
            for index, values in enumerate(inputs[2:], 2):
                argmax[values > out] = index
                np.maximum(out, values, out=out)
        if out is not top[0].data:
            top[0].data[...] = out

    def runs_on(self, device, bottom, top):
        return self.all_float32(bottom, top)

    def forward_on(self, device, bottom, top):
        count = top[0].count
        inputs = [blob.device_data(device) for blob in bottom]
        out = top[0].mutable_device_data(device)
        if any(blob is top[0] for blob in bottom[1:]):
            out = device.scratch("eltwise_out", count)     # in place on a later bottom: keep it until read
        if self.op == _ELTWISE.PROD:
            device.multiply(inputs[0], inputs[1], out, count)
            for values in inputs[2:]:
                device.multiply(out, values, out, count)
        elif self.op == _ELTWISE.SUM:
            device.axpby(count, self.coeffs[0], inputs[0], 0.0, out)
            for values, coeff in zip(inputs[1:], self.coeffs[1:]):
                device.axpby(count, coeff, values, 1.0, out)
        else:
            argmax = self.device_scratch(device, "eltwise_argmax", count)
            device.eltwise_max(inputs[0], inputs[1], out, argmax, count, 1)
            for index, values in enumerate(inputs[2:], 2):
                device.eltwise_max(out, values, out, argmax, count, index)
        if out is not top[0].mutable_device_data(device):
            device.copy(top[0].mutable_device_data(device), out, count)

    def backward_on(self, device, top, propagate_down, bottom):
        count = top[0].count
        top_diff = top[0].device_diff(device)
        # backwards over the bottoms, as backward: in place, bottom[0]'s diff is the top's
        for index in reversed(range(len(bottom))):
            if not propagate_down[index]:
                continue
            diff = bottom[index].mutable_device_diff(device)
            if self.op == _ELTWISE.PROD:
                device.multiply(self._device_others_product(device, top, bottom, index), top_diff, diff, count)
            elif self.op == _ELTWISE.SUM:
                if self.coeffs[index] != 1:
                    device.axpby(count, self.coeffs[index], top_diff, 0.0, diff)
                elif diff is not top_diff:
                    device.copy(diff, top_diff, count)
            else:
                device.keep_where_index(top_diff, self.device_scratch(device, "eltwise_argmax", count), index,
                                        diff, count)

    def _device_others_product(self, device, top, bottom, index):
        """PROD's d top / d bottom[index] in a device buffer: the other bottoms'
        product (stable_prod_grad) or top / bottom[index], as backward."""
        count = top[0].count
        if not self.stable_prod_grad:
            product = device.scratch("eltwise_product", count)
            device.divide(top[0].device_data(device), bottom[index].device_data(device), product, count)
            return product
        others = [blob.device_data(device) for k, blob in enumerate(bottom) if k != index]
        if len(others) == 1:
            return others[0]
        product = device.scratch("eltwise_product", count)
        device.multiply(others[0], others[1], product, count)
        for values in others[2:]:
            device.multiply(product, values, product, count)
        return product

    def epilogue(self, bottom, top):
        """A sum of two bottoms, for inference fusion (cct.runtime.fusion):
        ("sum", (coeff0, coeff1), False); None for other operations and counts."""
        if self.op != _ELTWISE.SUM or len(bottom) != 2:
            return None
        return "sum", tuple(self.coeffs), False

    def backward(self, top, propagate_down, bottom):
        top_diff = top[0].diff
        # Backwards over the bottoms: when the top is bottom[0] (in place) its diff is
        # overwritten last, after every other bottom has read it.
        for index in reversed(range(len(bottom))):
            if not propagate_down[index]:
                continue
            diff = bottom[index].diff
            if self.op == _ELTWISE.PROD:
                if self.stable_prod_grad:
                    others = [blob.data for k, blob in enumerate(bottom) if k != index]
                    product = others[0].copy()
                    for values in others[1:]:
                        product *= values
                else:
                    product = top[0].data / bottom[index].data
                np.multiply(product, top_diff, out=diff)
            elif self.op == _ELTWISE.SUM:
                if self.coeffs[index] == 1:
                    if diff is not top_diff:
                        diff[...] = top_diff
                else:
                    np.multiply(top_diff, self.coeffs[index], out=diff)
            else:
                np.multiply(top_diff, self._argmax == index, out=diff)


@register("Reduction")
class Reduction(Layer):
    """Reduces all axes from `axis` on to one number per leading index.

    reduction_param: operation SUM (default), ASUM (sum |x|), SUMSQ (sum x^2),
    MEAN; axis (default 0); coeff (default 1) scales the result.
    top shape = bottom shape[:axis] (a scalar for axis 0).
    """
    exact_bottoms = 1
    exact_tops = 1

    def reshape(self, bottom, top):
        param = self.layer_param.reduction_param
        axis = canonical_axis(self, bottom[0], param.axis, "reduction_param.axis")
        self._num = bottom[0].count_range(0, axis)
        self._dim = bottom[0].count_range(axis)
        self._coeff = param.coeff / self._dim if param.operation == _REDUCTION.MEAN else param.coeff
        top[0].reshape(bottom[0].shape[:axis])

    def forward(self, bottom, top):
        x = bottom[0].data.reshape(self._num, self._dim)
        op = self.layer_param.reduction_param.operation
        if op == _REDUCTION.ASUM:
            result = np.abs(x).sum(axis=1)
        elif op == _REDUCTION.SUMSQ:
            result = np.einsum("ij,ij->i", x, x)
        else:                                          # SUM and MEAN
            result = x.sum(axis=1)
        top[0].data[...] = (result * self._coeff).reshape(top[0].shape)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        x = bottom[0].data.reshape(self._num, self._dim)
        scale = top[0].diff.reshape(self._num, 1) * self._coeff
        out = bottom[0].diff.reshape(self._num, self._dim)
        op = self.layer_param.reduction_param.operation
        if op == _REDUCTION.ASUM:
            np.multiply(np.sign(x), scale, out=out)
        elif op == _REDUCTION.SUMSQ:
            np.multiply(x, 2 * scale, out=out)
        else:
            out[...] = scale


def _per_channel(bottom, blocks, operand):
    """The operand as one value per channel of bottom viewed as (N, C, rest)
    (C = 1 for a 1-d bottom), when the broadcast `blocks` (outer, dim, inner)
    are that view or the operand is one value; else None."""
    shape = bottom.shape
    channels = shape[1] if len(shape) > 1 else 1
    values = operand.data.reshape(-1)
    if blocks[1] == 1:
        return np.full(channels, values[0], values.dtype)
    if blocks[:2] == (shape[0], channels):        # then inner is the rest
        return values
    return None


def _learned_shape(layer, bottom, section):
    """Shape of a learned Scale/Bias blob: bottom[0].shape[axis:axis+num_axes]."""
    param = getattr(layer.layer_param, section)
    axis = canonical_axis(layer, bottom, param.axis, f"{section}.axis")
    if param.num_axes < -1:
        raise layer.config_error(f"{section}.num_axes", "must be >= 0, or -1 for all axes from "
                                 f"`axis` on, got {param.num_axes}")
    if param.num_axes >= 0 and axis + param.num_axes > len(bottom.shape):
        raise layer.config_error(f"{section}.num_axes", f"axis {axis} + num_axes {param.num_axes} "
                                 f"goes past the {len(bottom.shape)}-d bottom {bottom.shape}")
    end = len(bottom.shape) if param.num_axes == -1 else axis + param.num_axes
    return bottom.shape[axis:end]


def _broadcast_blocks(layer, bottom, operand, section):
    """(outer, dim, inner): bottom viewed so `operand` (shape matching bottom's axes
    from `axis` on) broadcasts along its middle. A 0-d operand applies everywhere."""
    shape, operand_shape = bottom.shape, operand.shape
    if not operand_shape:
        return 1, 1, bottom.count
    axis = canonical_axis(layer, bottom, getattr(layer.layer_param, section).axis, f"{section}.axis")
    end = axis + len(operand_shape)
    if shape[axis:end] != operand_shape:
        raise layer.shape_error(f"the {section.split('_')[0]} of shape {operand_shape} does not match "
                                f"bottom[0] {shape} from axis {axis}")
    return bottom.count_range(0, axis), operand.count, bottom.count_range(end)


@register("Scale")
class Scale(Layer):
    """Multiplies by a scale broadcast over the bottom, plus an optional bias.

    The scale is bottom[1] or, with one bottom, a learned blob of shape
    bottom[0].shape[axis:axis+num_axes]. scale_param: axis (default 1),
    num_axes (default 1; -1: to the end; 0: a scalar), filler (default constant 1),
    bias_term (default false) with bias_filler (default constant 0): a learned
    bias of the scale's shape (blobs[-1]).
    top = bottom[0] * scale (+ bias), broadcast; top shape = bottom[0] shape.
    Runs in place.
    """
    splits_backward = True
    min_bottoms = 1
    max_bottoms = 2
    exact_tops = 1

    def setup(self, bottom, top):
        param = self.layer_param.scale_param
        if len(bottom) == 1 and not self.blobs:
            filler = param.filler if param.HasField("filler") else caffe_pb2.FillerParameter(type="constant", value=1)
            self.blobs.append(self.filled_blob(_learned_shape(self, bottom[0], "scale_param"), filler,
                                               "scale_param.filler"))
        if param.bias_term and len(self.blobs) == (len(bottom) == 1):   # not already made
            shape = bottom[1].shape if len(bottom) > 1 else self.blobs[0].shape
            self.blobs.append(self.filled_blob(shape, param.bias_filler, "scale_param.bias_filler"))

    def _scale(self, bottom):
        return bottom[1] if len(bottom) > 1 else self.blobs[0]

    def reshape(self, bottom, top):
        self._blocks = _broadcast_blocks(self, bottom[0], self._scale(bottom), "scale_param")
        if top[0] is not bottom[0]:
            top[0].reshape(bottom[0].shape)

    def forward(self, bottom, top):
        outer, dim, inner = self._blocks
        x = bottom[0].data.reshape(outer, dim, inner)
        # In place, the input is overwritten but the scale's gradient needs it.
        self._saved_input = x.copy() if top[0] is bottom[0] else None
        out = top[0].data.reshape(outer, dim, inner)
        np.multiply(x, self._scale(bottom).data.reshape(1, dim, 1), out=out)
        if self.layer_param.scale_param.bias_term:
            out += self.blobs[-1].data.reshape(1, dim, 1)

    def epilogue(self, bottom, top):
        """A learned scale (and bias) of one value per channel, or one value,
        for inference fusion (cct.runtime.fusion): ("affine", (None, scale,
        bias), whether backward reads the input: in place, the parameter
        gradients do). None for a scale given as bottom[1] or other axes.
        In place, the input is then not kept: a backward forced on the
        parameters (`cct time`) reads the output in its stead."""
        if len(bottom) != 1:
            return None
        scale = _per_channel(bottom[0], self._blocks, self.blobs[0])
        bias = (_per_channel(bottom[0], self._blocks, self.blobs[-1])
                if self.layer_param.scale_param.bias_term else None)
        if scale is None or (self.layer_param.scale_param.bias_term and bias is None):
            return None
        self._saved_input = None
        in_place = top[0] is bottom[0]
        return "affine", (None, scale, bias), in_place and any(map(self.param_wanted, range(len(self.blobs))))

    # backward (Layer.backward): the learned scale's and bias's gradients, then
    # the bottoms': a scale given as bottom[1] gets its gradient before bottom[0]'s
    # is written, which in place is the top's
    def backward_param(self, index, top, bottom):
        top_diff = self._top_diff(top)
        if self.layer_param.scale_param.bias_term and index == len(self.blobs) - 1:
            self.blobs[-1].diff += top_diff.sum(axis=(0, 2)).reshape(self.blobs[-1].shape)
        else:
            self.blobs[0].diff += self._scale_gradient(top_diff, bottom)

    def backward_data(self, top, propagate_down, bottom):
        top_diff = self._top_diff(top)
        if len(bottom) > 1 and propagate_down[1]:
            bottom[1].diff[...] = self._scale_gradient(top_diff, bottom)
        if propagate_down[0]:
            outer, dim, inner = self._blocks
            np.multiply(top_diff, self._scale(bottom).data.reshape(1, dim, 1),
                        out=bottom[0].diff.reshape(outer, dim, inner))

    def _top_diff(self, top):
        return top[0].diff.reshape(self._blocks)

    # --- on a device: every axis / num_axes, a learned or a given scale, with or without bias
    def runs_on(self, device, bottom, top):
        return self.all_float32(bottom, top)

    def forward_on(self, device, bottom, top):
        count = bottom[0].count
        x = bottom[0].device_data(device)
        self._device_input = None
        if top[0] is bottom[0]:             # the scale's gradient reads the input forward overwrites
            self._device_input = self.device_scratch(device, "scale_input", count)
            device.copy(self._device_input, x, count)
        bias = self.blobs[-1].device_data(device) if self.layer_param.scale_param.bias_term else None
        device.broadcast_affine(x, *self._blocks, top[0].mutable_device_data(device),
                                self._scale(bottom).device_data(device), bias)

    def backward_on(self, device, top, propagate_down, bottom):
        """As backward: the parameters' gradients (accumulated), then a given
        scale's, then bottom[0]'s (in place, that overwrites the top's diff)."""
        top_diff = top[0].device_diff(device)
        bias_term = self.layer_param.scale_param.bias_term
        for index in range(len(self.blobs)):
            if self.param_wanted(index):
                if bias_term and index == len(self.blobs) - 1:
                    sum_outer_inner(device, top_diff, *self._blocks, self.blobs[-1].mutable_device_diff(device), 1.0)
                else:
                    self._device_scale_gradient(device, top_diff, bottom, self.blobs[0].mutable_device_diff(device),
                                                1.0)
        if len(bottom) > 1 and propagate_down[1]:
            self._device_scale_gradient(device, top_diff, bottom, bottom[1].mutable_device_diff(device), 0.0)
        if propagate_down[0]:
            device.broadcast_affine(top_diff, *self._blocks, bottom[0].mutable_device_diff(device),
                                    self._scale(bottom).device_data(device))

    def _device_scale_gradient(self, device, top_diff, bottom, out, beta):
        """out (dim) = the top's gradient times the input, summed over outer and
        inner, plus beta * out."""
        count = bottom[0].count
        x = self._device_input if self._device_input is not None else bottom[0].device_data(device)
        product = device.scratch("scale_product", count)
        device.multiply(top_diff, x, product, count)
        sum_outer_inner(device, product, *self._blocks, out, beta)

    def _scale_gradient(self, top_diff, bottom):
        """d loss / d scale: the top's gradient times the input, summed over all but the scale's axes."""
        x = self._saved_input if self._saved_input is not None else bottom[0].data.reshape(self._blocks)
        return np.einsum("odi,odi->d", top_diff, x).reshape(self._scale(bottom).shape)


@register("Bias")
class Bias(Layer):
    """Adds a bias broadcast over the bottom.

    The bias is bottom[1] or, with one bottom, a learned blob of shape
    bottom[0].shape[axis:axis+num_axes]. bias_param: axis (default 1),
    num_axes (default 1; -1: to the end; 0: a scalar), filler (default constant 0).
    top = bottom[0] + bias, broadcast; top shape = bottom[0] shape. Runs in place.
    """
    splits_backward = True
    min_bottoms = 1
    max_bottoms = 2
    exact_tops = 1

    def setup(self, bottom, top):
        if len(bottom) == 1 and not self.blobs:
            self.blobs.append(self.filled_blob(_learned_shape(self, bottom[0], "bias_param"),
                                               self.layer_param.bias_param.filler, "bias_param.filler"))

    def _bias(self, bottom):
        return bottom[1] if len(bottom) > 1 else self.blobs[0]

    def reshape(self, bottom, top):
        self._blocks = _broadcast_blocks(self, bottom[0], self._bias(bottom), "bias_param")
        if top[0] is not bottom[0]:
            top[0].reshape(bottom[0].shape)

    def forward(self, bottom, top):
        outer, dim, inner = self._blocks
        np.add(bottom[0].data.reshape(outer, dim, inner), self._bias(bottom).data.reshape(1, dim, 1),
               out=top[0].data.reshape(outer, dim, inner))

    def epilogue(self, bottom, top):
        """A learned bias of one value per channel, or one value, for inference
        fusion (cct.runtime.fusion): ("affine", (None, None, bias), False);
        None for a bias given as bottom[1] or other axes."""
        if len(bottom) != 1:
            return None
        bias = _per_channel(bottom[0], self._blocks, self.blobs[0])
        return None if bias is None else ("affine", (None, None, bias), False)

    # backward (Layer.backward): the learned bias's gradient, then the bottoms'
    def backward_param(self, index, top, bottom):
        self.blobs[0].diff += self._bias_gradient(top, self.blobs[0].shape)

    def backward_data(self, top, propagate_down, bottom):
        if len(bottom) > 1 and propagate_down[1]:
            bottom[1].diff[...] = self._bias_gradient(top, bottom[1].shape)
        if propagate_down[0] and top[0] is not bottom[0]:
            bottom[0].diff[...] = top[0].diff

    def _bias_gradient(self, top, shape):
        """The top's gradient summed over all but the bias's axes, in the bias's shape."""
        return top[0].diff.reshape(self._blocks).sum(axis=(0, 2)).reshape(shape)

    # --- on a device: every axis / num_axes, a learned or a given bias
    def runs_on(self, device, bottom, top):
        return self.all_float32(bottom, top)

    def forward_on(self, device, bottom, top):
        device.broadcast_affine(bottom[0].device_data(device), *self._blocks, top[0].mutable_device_data(device),
                                bias=self._bias(bottom).device_data(device))

    def backward_on(self, device, top, propagate_down, bottom):
        top_diff = top[0].device_diff(device)
        if self.blobs and self.param_wanted(0):
            sum_outer_inner(device, top_diff, *self._blocks, self.blobs[0].mutable_device_diff(device), 1.0)
        if len(bottom) > 1 and propagate_down[1]:
            sum_outer_inner(device, top_diff, *self._blocks, bottom[1].mutable_device_diff(device), 0.0)
        if propagate_down[0] and top[0] is not bottom[0]:
            device.copy(bottom[0].mutable_device_diff(device), top_diff, bottom[0].count)


def sum_outer_inner(device, x, outer, dim, inner, out, beta):
    """out (dim) = x (outer, dim, inner) summed over its outer and inner axes,
    plus beta * out (1: a parameter's gradient accumulates): over inner
    first (into a scratch buffer), then over outer."""
    if inner != 1:
        partial = device.scratch("sum_outer_inner", outer * dim)
        device.sum_axis(x, outer * dim, inner, 1, partial)
        x = partial
    device.sum_axis(x, 1, outer, dim, out, beta)


@register("Embed")
class Embed(Layer):
    """A lookup table: each input index selects a row of a learned matrix.

    embed_param: num_output N (> 0), input_dim K (> 0, the vocabulary size),
    bias_term (default true), weight_filler, bias_filler.
    blobs: weight (K, N), bias (N,). bottom: integer indices in [0, K), stored
    as floats. top shape = bottom shape + (N,); top[..., :] = weight[index] + bias.
    The indices get no gradient.
    """
    splits_backward = True
    exact_bottoms = 1
    exact_tops = 1

    def allow_force_backward(self, bottom_index):
        return False

    def setup(self, bottom, top):
        param = self.layer_param.embed_param
        if param.num_output <= 0:
            raise self.config_error("embed_param.num_output", f"must be > 0, got {param.num_output}")
        if param.input_dim <= 0:
            raise self.config_error("embed_param.input_dim", f"must be > 0, got {param.input_dim}")
        if self.blobs:
            return
        self.blobs.append(self.filled_blob((param.input_dim, param.num_output), param.weight_filler,
                                           "embed_param.weight_filler"))
        if param.bias_term:
            self.blobs.append(self.filled_blob((param.num_output,), param.bias_filler, "embed_param.bias_filler"))

    def reshape(self, bottom, top):
        top[0].reshape(bottom[0].shape + (self.layer_param.embed_param.num_output,))

    def _indices(self, bottom):
        values = bottom[0].data.reshape(-1)
        indices = values.astype(np.intp)
        limit = self.layer_param.embed_param.input_dim
        bad = (indices < 0) | (indices >= limit) | (indices != values)
        if bad.any():
            raise self.shape_error(f"input values must be integers in [0, {limit}) (embed_param.input_dim); "
                                   f"got {values[bad][:5].tolist()}")
        return indices

    def forward(self, bottom, top):
        out = top[0].data.reshape(-1, self.layer_param.embed_param.num_output)
        gather_rows(self.blobs[0].data, self._indices(bottom), out)
        if self.layer_param.embed_param.bias_term:
            out += self.blobs[1].data

    # backward (Layer.backward): the weight's and the bias's gradients; the indices get none
    def backward_param(self, index, top, bottom):
        top_diff = top[0].diff.reshape(-1, self.layer_param.embed_param.num_output)
        if index == 0:
            np.add.at(self.blobs[0].diff, self._indices(bottom), top_diff)
        else:
            self.blobs[1].diff += top_diff.sum(axis=0)

    def backward_data(self, top, propagate_down, bottom):
        if propagate_down[0]:
            raise self.config_error("bottom[0]", "Embed cannot backpropagate to its index input; "
                                    "set propagate_down: false for it")


@register("Axpy")
class Axpy(Layer):
    """SENet's scale-and-add (hujie-frank/SENet's axpy_layer.cpp): top = a * x + y,
    a one value per image and channel.

    No parameters. Bottoms: a (N, C) or (N, C, 1, 1), x (N, C, ...), y the
    shape of x. Top: the shape of x. May run in place on y (bottom[2]), not on
    a or x. Backward: da = sum over the pixels of dy * x, dx = a * dy, dy
    passes to y.
    """
    exact_bottoms = 3
    exact_tops = 1
    batch_independent = True

    def setup(self, bottom, top):
        for index in (0, 1):
            if top[0] is bottom[index]:
                raise self.config_error("top", f"Axpy runs in place only on y (bottom[2]), not on bottom[{index}]")

    def reshape(self, bottom, top):
        a, x, y = (blob.shape for blob in bottom)
        if len(x) < 2 or a[:2] != x[:2] or math.prod(a) != x[0] * x[1]:
            raise self.shape_error(f"a (bottom[0]) {a} must be (N, C) or (N, C, 1, 1) for x (bottom[1]) {x}")
        if y != x:
            raise self.shape_error(f"y (bottom[2]) {y} must have the shape of x (bottom[1]) {x}")
        if top[0] is not bottom[2]:
            top[0].reshape(x)
        self._blocks = (x[0] * x[1], math.prod(x[2:]))       # (N*C, pixels)

    def _scale(self, bottom):
        return bottom[0].data.reshape(self._blocks[0], 1)

    def forward(self, bottom, top):
        x = bottom[1].data.reshape(self._blocks)
        out = top[0].data.reshape(self._blocks)
        if top[0] is bottom[2]:
            out += x * self._scale(bottom)
        else:
            np.multiply(x, self._scale(bottom), out=out)
            out += bottom[2].data.reshape(self._blocks)

    def backward(self, top, propagate_down, bottom):
        dy = top[0].diff.reshape(self._blocks)
        if propagate_down[0]:
            bottom[0].diff.reshape(-1)[...] = np.einsum("cp,cp->c", dy, bottom[1].data.reshape(self._blocks))
        if propagate_down[1]:
            np.multiply(dy, self._scale(bottom), out=bottom[1].diff.reshape(self._blocks))
        if propagate_down[2] and top[0] is not bottom[2]:
            bottom[2].diff[...] = top[0].diff

    # --- on a device: a * x as Scale's broadcast over (1, N*C, pixels), y added by axpby
    def runs_on(self, device, bottom, top):
        return self.all_float32(bottom, top)

    def forward_on(self, device, bottom, top):
        channels, pixels = self._blocks
        count = channels * pixels
        out = top[0].mutable_device_data(device)
        in_place = top[0] is bottom[2]
        # in place, y is the output: a * x goes to a scratch buffer, then y is added to it
        product = device.scratch("axpy_product", count) if in_place else out
        device.broadcast_affine(bottom[1].device_data(device), 1, channels, pixels, product,
                                bottom[0].device_data(device))
        device.axpby(count, 1.0, product if in_place else bottom[2].device_data(device), 1.0, out)

    def backward_on(self, device, top, propagate_down, bottom):
        channels, pixels = self._blocks
        count = channels * pixels
        dy = top[0].device_diff(device)
        if propagate_down[0]:
            product = device.scratch("axpy_product", count)
            device.multiply(dy, bottom[1].device_data(device), product, count)
            device.sum_axis(product, channels, pixels, 1, bottom[0].mutable_device_diff(device))
        if propagate_down[1]:
            device.broadcast_affine(dy, 1, channels, pixels, bottom[1].mutable_device_diff(device),
                                    bottom[0].device_data(device))
        if propagate_down[2] and top[0] is not bottom[2]:
            device.copy(bottom[2].mutable_device_diff(device), dy, count)
