"""Neuron layers: element-wise functions of one bottom into one top of the same
shape (Caffe's NeuronLayer family), plus Dropout.

Every one may run in place (top[0] is bottom[0]). A layer whose backward needs
the input x keeps a copy of it when in place, since forward overwrites it
(Caffe's PReLU does this; its other neurons would silently read y instead).
"""
import math

import numpy as np

from cct.core.blob import Blob
from cct.core.fillers import fill
from cct.core.layer import TRAIN, Layer, NoBackward, register
from cct.proto import caffe_pb2
from cct.core.rng import get_rng


# Elements per slice where element-wise work runs in cache-sized pieces.
CHUNK_ELEMENTS = 1 << 18


class Neuron(Layer):
    """Base: one bottom, one top shaped like it."""
    exact_bottoms = 1
    exact_tops = 1
    batch_independent = True      # element-wise (Dropout, which draws random numbers, says otherwise)
    # True where backward reads the input x (not only y = f(x)).
    needs_input = False
    reshape_reads_layout = True   # a top shaped as its bottom, nothing else

    def reshape(self, bottom, top):
        if top[0] is not bottom[0] and top[0].shape != bottom[0].shape:
            top[0].reshape(bottom[0].shape)

    def keep_input(self, bottom, top):
        """The input x, copied aside when the layer runs in place and backward needs it."""
        x = bottom[0].data
        if top[0] is bottom[0] and self.needs_input:
            saved = self._saved_input = self.scratch("saved_input", x.shape, x.dtype)
            np.copyto(saved, x)
            return saved
        return x

    def input_of(self, bottom, top):
        """The x forward saw: the copy when in place, else bottom.data."""
        if top[0] is bottom[0] and self.needs_input:
            return self._saved_input
        return bottom[0].data


@register("ReLU")
class ReLU(Neuron):
    """y = max(x, 0) + negative_slope * min(x, 0).
    Fields: relu_param.negative_slope (0). Shapes: top = bottom."""

    def setup(self, bottom, top):
        self.slope = float(self.layer_param.relu_param.negative_slope)
        # With slope >= 0, y > 0 exactly where x > 0, so y can stand in for x.
        self.needs_input = self.slope < 0

    def forward(self, bottom, top):
        x = self.keep_input(bottom, top)
        if self.slope == 0:
            np.maximum(x, 0, out=top[0].data)
        else:
            top[0].data[...] = np.where(x > 0, x, x * x.dtype.type(self.slope))

    def bind_forward(self, bottom, top):
        """max(x, 0) on the arrays the plan's layout holds (Layer.bind_forward)."""
        if self.slope != 0:
            return super().bind_forward(bottom, top)
        x, y = bottom[0].data, top[0].data
        return lambda: np.maximum(x, 0, out=y)

    def bind_backward(self, top, propagate_down, bottom):
        """dx = dy where x > 0, on the arrays the plan's layout holds, with a
        mask of the layer's own for a blob of one slice (backward's numbers)."""
        if self.slope != 0 or not propagate_down[0] or bottom[0].count > CHUNK_ELEMENTS:
            return super().bind_backward(top, propagate_down, bottom)
        x, dy, dx = bottom[0].data, top[0], bottom[0]
        mask = self.scratch("relu_positive", x.shape, np.bool_)
        return lambda: np.multiply(dy.diff, np.greater(x, 0, out=mask), out=dx.diff)

    def runs_on(self, device, bottom, top):
        return self.all_float32(bottom, top)

    def forward_on(self, device, bottom, top):
        # in place too: y > 0 exactly where x > 0 when slope >= 0, and with a
        # negative slope the device's backward reads the saved input
        x = bottom[0].device_data(device)
        if top[0] is bottom[0] and self.needs_input:
            saved = self._device_input = self.device_scratch(device, "relu_input", bottom[0].count)
            device.copy(saved, x, bottom[0].count)
            x = saved
        # x is current on the device: an in-place top is too, another is written whole
        device.relu_forward(x, top[0].mutable_device_data(device, upload=False), bottom[0].count, self.slope)

    def backward_on(self, device, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        in_place_input = top[0] is bottom[0] and self.needs_input
        x = self._device_input if in_place_input else bottom[0].device_data(device)
        # dy is current on the device: an in-place dx is too, another is written whole
        device.relu_backward(x, top[0].device_diff(device), bottom[0].mutable_device_diff(device, upload=False),
                             bottom[0].count, self.slope)

    def epilogue(self, bottom, top):
        """For inference fusion (cct.runtime.fusion): ("relu", negative_slope,
        False); None in place with a negative slope, whose backward needs the
        input that a fused pass does not keep."""
        if top[0] is bottom[0] and self.needs_input:
            return None
        return "relu", self.slope, False

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        x = self.input_of(bottom, top) if self.needs_input else bottom[0].data
        if self.slope == 0:
            # In slices of about 1 MiB: the mask stays in the CPU cache, and a
            # whole-blob mask (74 MB for CaffeNet's relu1) would add to peak memory.
            flat_x, flat_dy, flat_dx = x.reshape(-1), top[0].diff.reshape(-1), bottom[0].diff.reshape(-1)
            size = flat_x.size
            mask = self.work("relu_positive", (min(size, CHUNK_ELEMENTS),), np.bool_)
            for start in range(0, size, CHUNK_ELEMENTS):
                stop = min(start + CHUNK_ELEMENTS, size)
                positive = np.greater(flat_x[start:stop], 0, out=mask[:stop - start])
                np.multiply(flat_dy[start:stop], positive, out=flat_dx[start:stop])
        else:
            positive = x > 0
            dtype = x.dtype.type
            np.multiply(top[0].diff, np.where(positive, dtype(1), dtype(self.slope)), out=bottom[0].diff)


@register("ReLU6")
class ReLU6(Neuron):
    """MobileNet-YOLO's ReLU6 (eric612/Caffe-YOLOv3-Windows's relu6_layer.cpp):
    y = min(max(x, 0) + negative_slope * min(x, 0), 6).
    Fields: relu6_param.negative_slope (0): the fork's relu6_param, a
    ReLUParameter at LayerParameter field 211, which its ReLU6 class reads
    (its engine is not read). With the default slope, min(max(x, 0), 6), as
    OpenCV and ncnn compute ReLU6. (The fork's layer factory builds its plain
    ReLU under this type name, with relu_param and no clip; cct follows the
    fork's ReLU6 class.) Shapes: top = bottom.
    Backward, the fork's: dx = dy * (x > 0 ? 1 : negative_slope) where x < 6,
    else 0. In place, y stands in for x (strictly between 0 and 6 exactly
    where x is, for a slope >= 0), as in the fork; with a negative slope the
    input is kept aside, as ReLU's.
    """
    LOW, HIGH = 0.0, 6.0

    def setup(self, bottom, top):
        self.slope = float(self.layer_param.relu6_param.negative_slope)
        self.needs_input = self.slope < 0          # y's sign is x's unless the slope flips it
        self._device_input = None

    def forward(self, bottom, top):
        x = self.keep_input(bottom, top)
        dtype = x.dtype.type
        if self.slope == 0:
            np.minimum(np.maximum(x, dtype(self.LOW), out=top[0].data), dtype(self.HIGH), out=top[0].data)
        else:                                      # the fork's Forward_cpu
            leaky = np.maximum(x, dtype(0)) + dtype(self.slope) * np.minimum(x, dtype(0))
            np.minimum(leaky, dtype(self.HIGH), out=top[0].data)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            x = self.input_of(bottom, top)
            dtype = x.dtype.type
            if self.slope == 0:
                inside = (x > dtype(self.LOW)) & (x < dtype(self.HIGH))
                np.multiply(top[0].diff, inside, out=bottom[0].diff)
            else:                                  # the fork's Backward_cpu
                factor = np.where(x > 0, dtype(1), dtype(self.slope)) * (x < dtype(self.HIGH))
                np.multiply(top[0].diff, factor, out=bottom[0].diff)

    # --- on a device: a clip; with a slope, ReLU's leaky map, then the clip at 6
    # (an input of -inf then gets no gradient, where the fork's gets slope * dy)
    def runs_on(self, device, bottom, top):
        return self.all_float32(bottom, top)

    def forward_on(self, device, bottom, top):
        x, count = bottom[0].device_data(device), bottom[0].count
        if self.slope == 0:
            device.clip_forward(x, top[0].mutable_device_data(device), count, self.LOW, self.HIGH)
            return
        self._device_input = None
        if top[0] is bottom[0] and self.needs_input:
            self._device_input = self.device_scratch(device, "relu6_input", count)
            device.copy(self._device_input, x, count)
            x = self._device_input
        y = top[0].mutable_device_data(device)
        device.relu_forward(x, y, count, self.slope)
        device.clip_forward(y, y, count, -math.inf, self.HIGH)

    def backward_on(self, device, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        count = bottom[0].count
        if self.slope == 0:
            device.clip_backward(bottom[0].device_data(device), top[0].device_diff(device),
                                 bottom[0].mutable_device_diff(device), count, self.LOW, self.HIGH)
            return
        x = self._device_input if self._device_input is not None else bottom[0].device_data(device)
        dx = bottom[0].mutable_device_diff(device)
        device.relu_backward(x, top[0].device_diff(device), dx, count, self.slope)
        device.clip_backward(x, dx, dx, count, -math.inf, self.HIGH)


@register("PReLU")
class PReLU(Neuron):
    """y = max(x, 0) + a_c * min(x, 0) with a learned slope a_c per channel (axis 1).
    Fields: prelu_param.filler (constant 0.25), prelu_param.channel_shared (false:
    one slope per channel, blob shape (C,); true: one slope, blob shape ()).
    Bottom: (N, C, ...), at least 2 axes. Top: same shape."""
    needs_input = True
    splits_backward = True

    def setup(self, bottom, top):
        param = self.layer_param.prelu_param
        if len(bottom[0].shape) < 2:
            raise self.shape_error(f"bottom must have at least 2 axes, got shape {bottom[0].shape}")
        self.channel_shared = bool(param.channel_shared)
        channels = bottom[0].shape[1]
        if not self.blobs:
            blob = Blob(() if self.channel_shared else (channels,))
            if param.HasField("filler"):
                filler = param.filler
            else:
                filler = caffe_pb2.FillerParameter(type="constant", value=0.25)
            fill(blob, filler, where=f"{self.where()}: prelu_param.filler")
            self.blobs.append(blob)
        want = 1 if self.channel_shared else channels
        if self.blobs[0].count != want:
            raise self.config_error("prelu_param.channel_shared",
                                    f"slope blob has {self.blobs[0].count} values, expected {want}")
        self.param_propagate_down = [True]          # the net overrides this from param specs

    def reshape(self, bottom, top):
        if len(bottom[0].shape) < 2:
            raise self.shape_error(f"bottom must have at least 2 axes, got shape {bottom[0].shape}")
        if not self.channel_shared and bottom[0].shape[1] != self.blobs[0].count:
            raise self.shape_error(f"bottom has {bottom[0].shape[1]} channels but the layer "
                                   f"was set up for {self.blobs[0].count}")
        super().reshape(bottom, top)

    def _slopes(self, x):
        """Slopes broadcastable against x viewed as (N, C, rest)."""
        slope = self.blobs[0].data.astype(x.dtype, copy=False)
        # (1, C, 1), not (1, -1, 1): C may be 0
        return slope.reshape(1, slope.size, 1) if not self.channel_shared else slope.reshape(1, 1, 1)

    def forward(self, bottom, top):
        x = self.keep_input(bottom, top)
        x3 = x.reshape(x.shape[0], x.shape[1], math.prod(x.shape[2:]))     # not -1: x may be empty
        y3 = np.where(x3 > 0, x3, x3 * self._slopes(x3))
        top[0].data[...] = y3.reshape(x.shape)

    # backward (Layer.backward): the slopes' gradient, then the input's (in
    # place, the input's diff is the top's)
    def backward_param(self, index, top, bottom):
        x3, dy3 = self._input_and_top_diff(bottom, top)
        # d/da_c = sum over batch and space of dy * x where x <= 0.
        grad = np.einsum("ncs,ncs->c", dy3, np.where(x3 <= 0, x3, 0))
        if self.channel_shared:
            grad = grad.sum()
        self.blobs[0].diff[...] += grad.reshape(self.blobs[0].shape)

    def backward_data(self, top, propagate_down, bottom):
        x3, dy3 = self._input_and_top_diff(bottom, top)
        scale = np.where(x3 > 0, x3.dtype.type(1), self._slopes(x3))
        bottom[0].diff[...] = (dy3 * scale).reshape(bottom[0].shape)

    def _input_and_top_diff(self, bottom, top):
        """x and dy viewed as (N, C, rest)."""
        x = self.input_of(bottom, top)
        x3 = x.reshape(x.shape[0], x.shape[1], math.prod(x.shape[2:]))     # not -1: x may be empty
        return x3, top[0].diff.reshape(x3.shape)


@register("ELU")
class ELU(Neuron):
    """y = x if x > 0 else alpha * (exp(x) - 1).  Fields: elu_param.alpha (1)."""

    def setup(self, bottom, top):
        self.alpha = float(self.layer_param.elu_param.alpha)
        # dy/dx for x <= 0 is alpha*exp(x) = y + alpha; y > 0 marks x > 0 when alpha >= 0.
        self.needs_input = self.alpha < 0

    def forward(self, bottom, top):
        x = self.keep_input(bottom, top)
        alpha = x.dtype.type(self.alpha)
        top[0].data[...] = np.where(x > 0, x, alpha * np.expm1(np.minimum(x, 0)))

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        y = top[0].data
        x = self.input_of(bottom, top) if self.needs_input else bottom[0].data
        bottom[0].diff[...] = top[0].diff * np.where(x > 0, 1, y + y.dtype.type(self.alpha))


@register("Sigmoid")
class Sigmoid(Neuron):
    """y = 1 / (1 + exp(-x)), computed as 0.5 * tanh(0.5 x) + 0.5 (no overflow)."""

    def forward(self, bottom, top):
        y = top[0].data
        np.multiply(bottom[0].data, 0.5, out=y)
        np.tanh(y, out=y)
        y *= 0.5
        y += 0.5

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            y = top[0].data
            bottom[0].diff[...] = top[0].diff * y * (1 - y)


@register("TanH")
class TanH(Neuron):
    """y = tanh(x)."""

    def forward(self, bottom, top):
        np.tanh(bottom[0].data, out=top[0].data)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            y = top[0].data
            bottom[0].diff[...] = top[0].diff * (1 - y * y)


@register("AbsVal")
class AbsVal(Neuron):
    """y = |x|. Not in place (as in Caffe: backward needs the sign of x)."""

    def setup(self, bottom, top):
        if top[0] is bottom[0]:
            raise self.config_error("top", "AbsVal does not allow in-place computation")

    def forward(self, bottom, top):
        np.abs(bottom[0].data, out=top[0].data)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            np.multiply(top[0].diff, np.sign(bottom[0].data), out=bottom[0].diff)


@register("BNLL")
class BNLL(Neuron):
    """Binomial normal log likelihood: y = log(1 + exp(x)), computed stably."""
    needs_input = True
    _EXP_LIMIT = 50.0           # Caffe's kBNLL_THRESHOLD: exp(x) is capped at exp(50)

    def forward(self, bottom, top):
        x = self.keep_input(bottom, top)
        np.logaddexp(x.dtype.type(0), x, out=top[0].data)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            e = np.exp(np.minimum(self.input_of(bottom, top), self._EXP_LIMIT))
            bottom[0].diff[...] = top[0].diff * e / (e + 1)


@register("Power")
class Power(Neuron):
    """y = (shift + scale * x) ^ power.
    Fields: power_param.power (1), .scale (1), .shift (0)."""
    needs_input = True

    def setup(self, bottom, top):
        p = self.layer_param.power_param
        self.power, self.scale, self.shift = float(p.power), float(p.scale), float(p.shift)
        self.diff_scale = self.power * self.scale

    def forward(self, bottom, top):
        x = self.keep_input(bottom, top)
        y = top[0].data
        if self.diff_scale == 0:
            # y does not depend on x: 1 for power 0, else shift^power.
            y[...] = 1.0 if self.power == 0 else self.shift ** self.power
            return
        inner = x * x.dtype.type(self.scale) if self.scale != 1 else x
        if self.shift != 0:
            inner = inner + x.dtype.type(self.shift)
        if self.power == 1:
            y[...] = inner
        else:
            np.power(inner, x.dtype.type(self.power), out=y)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dx = bottom[0].diff
        if self.diff_scale == 0:
            dx[...] = 0
            return
        x = self.input_of(bottom, top)
        dtype = x.dtype.type
        if self.power == 1:
            dx[...] = top[0].diff * dtype(self.diff_scale)
            return
        if self.power == 2:
            # d/dx (shift + scale x)^2 = diff_scale * (shift + scale x)
            grad = x * dtype(self.diff_scale * self.scale) + dtype(self.diff_scale * self.shift)
        else:
            # Caffe's form: power * scale * y / (shift + scale x); with shift 0, power * y / x.
            y = top[0].data
            with np.errstate(divide="ignore", invalid="ignore"):
                if self.shift == 0:
                    grad = y / x * dtype(self.power)
                else:
                    grad = y / (x * dtype(self.scale) + dtype(self.shift)) * dtype(self.diff_scale)
        np.multiply(top[0].diff, grad, out=dx)


@register("Exp")
class Exp(Neuron):
    """y = base ^ (shift + scale * x); base -1 (the default) means e.
    Fields: exp_param.base (-1, else > 0), .scale (1), .shift (0)."""

    def setup(self, bottom, top):
        p = self.layer_param.exp_param
        base = float(p.base)
        if base != -1 and not base > 0:
            raise self.config_error("exp_param.base", f"must be -1 (for e) or > 0, got {base}")
        log_base = 1.0 if base == -1 else np.log(base)
        self.inner_scale = log_base * float(p.scale)
        shift = float(p.shift)
        self.outer_scale = 1.0 if shift == 0 else (np.exp(shift) if base == -1 else base ** shift)

    def forward(self, bottom, top):
        x = bottom[0].data
        y = top[0].data
        np.multiply(x, x.dtype.type(self.inner_scale), out=y)
        np.exp(y, out=y)
        if self.outer_scale != 1:
            y *= x.dtype.type(self.outer_scale)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            y = top[0].data
            bottom[0].diff[...] = top[0].diff * y * y.dtype.type(self.inner_scale)


@register("Log")
class Log(Neuron):
    """y = log_base(shift + scale * x); base -1 (the default) means e.
    Fields: log_param.base (-1, else > 0), .scale (1), .shift (0)."""
    needs_input = True

    def setup(self, bottom, top):
        p = self.layer_param.log_param
        base = float(p.base)
        if base != -1 and not base > 0:
            raise self.config_error("log_param.base", f"must be -1 (for e) or > 0, got {base}")
        self.base_scale = 1.0 if base == -1 else 1.0 / np.log(base)
        self.scale, self.shift = float(p.scale), float(p.shift)

    def _inner(self, x):
        dtype = x.dtype.type
        inner = x * dtype(self.scale) if self.scale != 1 else x
        return inner + dtype(self.shift) if self.shift != 0 else inner

    def forward(self, bottom, top):
        x = self.keep_input(bottom, top)
        y = top[0].data
        np.log(self._inner(x), out=y)
        if self.base_scale != 1:
            y *= x.dtype.type(self.base_scale)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            x = self.input_of(bottom, top)
            bottom[0].diff[...] = top[0].diff * x.dtype.type(self.scale * self.base_scale) / self._inner(x)


@register("Threshold")
class Threshold(NoBackward, Neuron):
    """y = 1 if x > threshold else 0. Fields: threshold_param.threshold (0). No backward."""

    def setup(self, bottom, top):
        self.threshold = float(self.layer_param.threshold_param.threshold)

    def forward(self, bottom, top):
        np.greater(bottom[0].data, self.threshold, out=top[0].data, casting="unsafe")


@register("Clip")
class Clip(Neuron):
    """y = max(min, min(x, max)). Fields: clip_param.min, clip_param.max (both required;
    min > max is allowed, as in Caffe: y = min everywhere). Gradient passes where
    min <= x <= max."""
    needs_input = True

    def setup(self, bottom, top):
        p = self.layer_param.clip_param
        for field in ("min", "max"):
            if not p.HasField(field):
                raise self.config_error(f"clip_param.{field}", "is required")
        self.low, self.high = float(p.min), float(p.max)

    def forward(self, bottom, top):
        x = self.keep_input(bottom, top)
        dtype = x.dtype.type
        # Not np.clip: with min > max it returns max, Caffe's formula gives min.
        np.minimum(x, dtype(self.high), out=top[0].data)
        np.maximum(top[0].data, dtype(self.low), out=top[0].data)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            x = self.input_of(bottom, top)
            inside = (x >= x.dtype.type(self.low)) & (x <= x.dtype.type(self.high))
            np.multiply(top[0].diff, inside, out=bottom[0].diff)


@register("Swish")
class Swish(Neuron):
    """y = x * sigmoid(beta * x). Fields: swish_param.beta (1)."""

    def setup(self, bottom, top):
        self.beta = float(self.layer_param.swish_param.beta)

    def forward(self, bottom, top):
        x = bottom[0].data
        s = np.tanh(x * x.dtype.type(0.5 * self.beta))
        s *= 0.5
        s += 0.5
        self._sigmoid = s                        # (x.shape) sigmoid(beta x), for backward
        np.multiply(x, s, out=top[0].data)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            y, s = top[0].data, self._sigmoid
            by = y * y.dtype.type(self.beta)
            bottom[0].diff[...] = top[0].diff * (by + s * (1 - by))


@register("Dropout")
class Dropout(Neuron):
    """TRAIN: y = x * m / (1 - ratio), m ~ Bernoulli(1 - ratio) drawn per element
    from cct.core.rng; TEST: y = x. Fields: dropout_param.dropout_ratio (0.5, in [0, 1)),
    scale_train (true; false, the Fast R-CNN fork's: TRAIN y = x * m unscaled,
    TEST y = x * (1 - ratio), as its dropout_layer.cpp; backward alike)."""
    batch_independent = False     # one random stream, drawn in batch order
    draws_random = True
    run_settings = ("device_masks",)
    device_masks = True           # the device draws its TRAIN masks (the device_masks knob)

    def configure(self, settings):
        self.device_masks = settings.get("device_masks", True)

    def setup(self, bottom, top):
        ratio = float(self.layer_param.dropout_param.dropout_ratio)
        if not 0 <= ratio < 1:
            raise self.config_error("dropout_param.dropout_ratio", f"must be in [0, 1), got {ratio}")
        self.ratio = ratio
        self.scale = 1.0 / (1.0 - ratio)
        # the factor each phase multiplies by: the fork's scale_ is a float and
        # its TEST factor 1 / scale_ rounds to one again
        scale_train = self.layer_param.dropout_param.scale_train
        self.train_factor = self.scale if scale_train else 1.0
        self.test_factor = 1.0 if scale_train else float(np.float32(1.0 / np.float32(self.scale)))

    def planned_bytes(self, bottom, top, partitions):
        return {"work.dropout_uniform": bottom[0].count * 4} if self.phase == TRAIN else {}

    def epilogue(self, bottom, top):
        """TEST: the identity, for inference fusion (cct.runtime.fusion):
        ("copy", None, False); TRAIN draws a mask, and scale_train false
        scales at TEST: None."""
        return None if self.phase == TRAIN or self.test_factor != 1 else ("copy", None, False)

    def forward(self, bottom, top):
        x = bottom[0].data
        if self.phase != TRAIN:
            self._pass(x, top[0].data, top[0] is bottom[0])
            return
        np.multiply(x, self._draw_mask(x.shape, x.dtype), out=top[0].data)

    def _pass(self, source, target, in_place):
        """TEST's forward or backward: target = source * test_factor."""
        if self.test_factor != 1:
            np.multiply(source, source.dtype.type(self.test_factor), out=target)
        elif not in_place:
            target[...] = source

    def _draw_mask(self, shape, dtype):
        """The TRAIN mask, kept in self._mask: Bernoulli(1 - ratio) from the
        process's random stream, times the scale."""
        uniform = self.work("dropout_uniform", shape, np.float32)
        get_rng().random(dtype=np.float32, out=uniform)
        # The mask carries the scale, so forward and backward are one multiply each.
        self._mask = self.scratch("mask", shape, dtype)
        np.less(uniform, np.float32(1.0 - self.ratio), out=self._mask)
        self._mask *= dtype.type(self.train_factor)
        return self._mask

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        if self.phase != TRAIN:
            self._pass(top[0].diff, bottom[0].diff, top[0] is bottom[0])
            return
        np.multiply(top[0].diff, self._mask, out=bottom[0].diff)

    def runs_on(self, device, bottom, top):
        return self.all_float32(bottom, top)

    def forward_on(self, device, bottom, top):
        """TRAIN: the mask drawn on the device from a seed drawn from the
        process's random stream (Device.dropout_mask: seeded runs repeat,
        with other numbers than the host's draw); with device_masks off,
        drawn on the host with forward's very draws (the host's numbers) and
        uploaded. Applied on the device."""
        count = bottom[0].count
        x = bottom[0].device_data(device)
        if self.phase != TRAIN:
            self._pass_on(device, x, top[0].mutable_device_data(device), count, top[0] is bottom[0])
            return
        mask = self.device_scratch(device, "dropout_mask", count)
        if self.device_masks:
            seed = int(get_rng().integers(0, 2 ** 31))
            device.dropout_mask(mask, count, seed, float(np.float32(1.0 - self.ratio)), self.train_factor)
        else:
            device.upload(mask, self._draw_mask(bottom[0].shape, np.dtype(np.float32)).reshape(-1))
        device.multiply(x, mask, top[0].mutable_device_data(device, upload=False), count)

    def backward_on(self, device, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        count = bottom[0].count
        dy = top[0].device_diff(device)
        if self.phase != TRAIN:
            self._pass_on(device, dy, bottom[0].mutable_device_diff(device), count, top[0] is bottom[0])
            return
        device.multiply(dy, self.device_scratch(device, "dropout_mask", count),
                        bottom[0].mutable_device_diff(device, upload=False), count)

    def _pass_on(self, device, source, target, count, in_place):
        if self.test_factor != 1:
            device.axpby(count, self.test_factor, source, 0.0, target)
        elif not in_place:
            device.copy(target, source, count)
