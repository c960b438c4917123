"""Softmax and the loss layers.

A loss layer's top[0] is a scalar blob of shape () (Caffe's 0-axis blob).
The net writes the layer's loss weight into top[0].diff before backward, so
backward scales every gradient by it, as Caffe's loss layers read
top[0]->cpu_diff()[0]. Label bottoms never get a gradient.
"""
import numpy as np

from cct.core.errors import DataError
from cct.core.layer import Layer, register
from cct.formats.prototxt import read_binary
from cct.proto import caffe_pb2
from cct.formats.weights import blob_proto_to_array

FULL, VALID, BATCH_SIZE, NONE = (caffe_pb2.LossParameter.FULL, caffe_pb2.LossParameter.VALID,
                                 caffe_pb2.LossParameter.BATCH_SIZE, caffe_pb2.LossParameter.NONE)
FLT_MIN = np.finfo(np.float32).tiny     # Caffe's floor under probabilities before log
LOG_THRESHOLD = 1e-20                   # Caffe's kLOG_THRESHOLD


def softmax(x3, out):
    """Softmax over axis 1 of x3 (outer, channels, inner) into `out` (may be x3)."""
    if not x3.size:
        return out                    # no values (an empty batch or no channels): nothing to normalize
    if x3.shape[2] == 1 and x3.shape[1] < 8:
        _softmax_few_channels(x3[:, :, 0], out[:, :, 0])
        return out
    np.subtract(x3, x3.max(axis=1, keepdims=True), out=out)
    np.exp(out, out=out)
    out /= out.sum(axis=1, keepdims=True)
    return out


def _softmax_few_channels(x2, out):
    """softmax over axis 1 of (outer, C < 8): a reduction over so short an
    axis runs numpy's slow loop per row (SSD's 8,732 x 2 scores: 0.8 ms),
    so the channels are taken a column at a time; the same numbers, as
    numpy sums fewer than 8 values from the left."""
    columns = range(1, x2.shape[1])
    largest = x2[:, 0].copy()
    for c in columns:
        np.maximum(largest, x2[:, c], out=largest)
    np.subtract(x2, largest[:, None], out=out)
    np.exp(out, out=out)
    total = out[:, 0].copy()
    for c in columns:
        total += out[:, c]
    out /= total[:, None]


def normalizer(mode, outer, inner, valid_count):
    """What the summed loss is divided by (Caffe's get_normalizer), at least 1."""
    if mode == FULL:
        value = outer * inner
    elif mode == VALID:
        value = outer * inner if valid_count < 0 else valid_count
    elif mode == BATCH_SIZE:
        value = outer
    else:
        value = 1
    return float(max(1, value))


def nan_division(numerator, denominator):
    """numerator / denominator as Caffe's float arithmetic gives it: 0 / 0 is
    NaN (a loss over an empty batch, which Caffe divides by N = 0 where it
    does not use a normalizer of at least 1), with no Python error and no warning."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.float64(numerator) / np.float64(denominator))


def loss_weight(top):
    return float(top[0].read_diff().reshape(-1)[0])      # read-only: a device's copy stays current


class LossLayer(Layer):
    """Base (Caffe's LossLayer): bottoms 0 and 1 share their first dimension,
    top[0] is a scalar."""
    is_loss = True
    exact_bottoms = 2
    exact_tops = 1

    def reshape(self, bottom, top):
        if not bottom[0].shape or not bottom[1].shape or bottom[0].shape[0] != bottom[1].shape[0]:
            raise self.shape_error(f"bottom[0] {bottom[0].shape} and bottom[1] {bottom[1].shape} "
                                   "must have the same first dimension")
        if top[0].shape != ():
            top[0].reshape(())

    def refuse_label_gradient(self, propagate_down, label_bottoms=(1,)):
        for index in label_bottoms:
            if index < len(propagate_down) and propagate_down[index]:
                raise NotImplementedError(f"{self.where()}: {self.type} cannot backpropagate to "
                                          f"bottom[{index}] (labels)")

    def read_ignore_label(self):
        loss_param = self.layer_param.loss_param
        self.ignore_label = loss_param.ignore_label if loss_param.HasField("ignore_label") else None


class LabelIndexer:
    """Flat indices of (outer, label, inner) entries of an (outer, C, inner)
    array, with the labels checked; the aranges are cached per shape."""

    def __init__(self):
        self._shape = None

    def index(self, layer, labels, channels, ignore_label):
        """labels: (outer, inner) floats. Returns (int labels (outer, inner), ignored
        ones set to 0; their flat indices; the valid mask (outer, inner), None when
        nothing is ignored; the valid count)."""
        outer, inner = labels.shape
        if self._shape != (outer, channels, inner):
            self._shape = (outer, channels, inner)
            self._outer = np.arange(outer).reshape(outer, 1) * (channels * inner)
            self._inner = np.arange(inner).reshape(1, inner)
        values = labels.astype(np.int64)         # Caffe's static_cast<int>: truncation
        valid = None
        if ignore_label is not None:
            valid = values != ignore_label
            if valid.all():
                valid = None
            else:
                values = np.where(valid, values, 0)
        if values.size and (values.min() < 0 or values.max() >= channels):
            bad = values[(values < 0) | (values >= channels)][0]
            raise DataError(f"{layer.where()}: label {bad} is outside [0, {channels})")
        count = values.size if valid is None else int(np.count_nonzero(valid))
        return values, self._outer + values * inner + self._inner, valid, count


@register("Softmax")
class Softmax(Layer):
    """y = exp(x) / sum over the axis of exp(x), computed after subtracting the max.
    Fields: softmax_param.axis (1). Shapes: top = bottom."""
    exact_bottoms = 1
    exact_tops = 1
    reshape_reads_layout = True

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        self.axis = bottom[0].canonical_axis(self.layer_param.softmax_param.axis)
        self.view = (bottom[0].count_range(0, self.axis), shape[self.axis], bottom[0].count_range(self.axis + 1))
        if top[0] is not bottom[0] and top[0].shape != shape:
            top[0].reshape(shape)

    def forward(self, bottom, top):
        softmax(bottom[0].data.reshape(self.view), top[0].data.reshape(self.view))

    def runs_on(self, device, bottom, top):
        return self.all_float32(bottom, top)

    def forward_on(self, device, bottom, top):
        # in place too: the kernel reads a column's inputs before it writes them
        # (the bottom copied up first: a top written whole needs no stale copy of its own)
        device.softmax_forward(bottom[0].device_data(device), top[0].mutable_device_data(device, upload=False),
                               *self.view)

    def backward_on(self, device, top, propagate_down, bottom):
        if propagate_down[0]:
            device.softmax_backward(top[0].device_data(device), top[0].device_diff(device),
                                    bottom[0].mutable_device_diff(device, upload=False), *self.view)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            y = top[0].data.reshape(self.view)
            dy = top[0].diff.reshape(self.view)
            dot = np.einsum("ocs,ocs->os", dy, y)[:, None, :]
            bottom[0].diff.reshape(self.view)[...] = (dy - dot) * y


@register("SoftmaxWithLoss")
class SoftmaxWithLoss(LossLayer):
    """Multinomial logistic loss of the softmax of bottom[0] along `axis`:
    loss = -sum over non-ignored (n, s) of log(max(p[n, label, s], FLT_MIN)) / normalizer.
    Fields: softmax_param.axis (1); loss_param.ignore_label; loss_param.normalization
    (VALID; FULL, BATCH_SIZE, NONE); deprecated loss_param.normalize (when normalization
    is unset: true -> VALID, false -> BATCH_SIZE).
    Bottoms: scores (outer, C, inner...), labels with outer*inner values.
    Tops: loss (); optional top[1]: the probabilities, shaped like bottom[0]."""
    exact_tops = None
    min_tops, max_tops = 1, 2

    def setup(self, bottom, top):
        loss_param = self.layer_param.loss_param
        self.read_ignore_label()
        if not loss_param.HasField("normalization") and loss_param.HasField("normalize"):
            self.normalization = VALID if loss_param.normalize else BATCH_SIZE
        else:
            self.normalization = loss_param.normalization
        self.indexer = LabelIndexer()

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        b = bottom[0]
        self.axis = b.canonical_axis(self.layer_param.softmax_param.axis)
        self.outer, self.inner = b.count_range(0, self.axis), b.count_range(self.axis + 1)
        self.channels = b.shape[self.axis]
        if self.outer * self.inner != bottom[1].count:
            raise self.shape_error(
                f"number of labels ({bottom[1].count}) must match the number of predictions "
                f"({self.outer * self.inner}): with softmax axis {self.axis} and scores {b.shape}, "
                f"labels must hold {self.outer * self.inner} values in [0, {self.channels})")
        if len(top) > 1 and top[1].shape != b.shape:
            top[1].reshape(b.shape)

    def forward(self, bottom, top):
        view = (self.outer, self.channels, self.inner)
        x = bottom[0].data.reshape(view)
        prob = getattr(self, "prob", None)
        if prob is None or prob.shape != view or prob.dtype != x.dtype:
            prob = self.prob = np.empty(view, x.dtype)
        softmax(x, prob)
        labels = bottom[1].data.reshape(self.outer, self.inner)
        _, flat, self.valid, self.count = self.indexer.index(self, labels, self.channels, self.ignore_label)
        self.flat = flat
        log_p = np.log(np.maximum(prob.reshape(-1)[flat], prob.dtype.type(FLT_MIN)))
        if self.valid is not None:
            log_p *= self.valid
        total = 0.0 - float(log_p.sum(dtype=np.float64))     # as Caffe's loss -= ...: +0 when nothing is summed
        top[0].data[...] = total / normalizer(self.normalization, self.outer, self.inner, self.count)
        if len(top) > 1:
            top[1].data[...] = prob.reshape(top[1].shape)

    def runs_on(self, device, bottom, top):
        return self.all_float32(bottom, top)

    def forward_on(self, device, bottom, top):
        """The softmax, each position's log-probability and their sum on the
        device, the loss left in top[0] there (weighted_loss_on reads it, one
        scalar) and the normalizer beside it for backward_on: nothing comes down."""
        outer, channels, inner = self.outer, self.channels, self.inner
        prob = self.device_scratch(device, "prob", outer * channels * inner)
        device.softmax_forward(bottom[0].device_data(device), prob, outer, channels, inner)
        positions = outer * inner
        per_position = device.scratch("softmax_loss", 2 * positions)
        device.softmax_loss_forward(prob, bottom[1].device_data(device), per_position, outer, channels, inner,
                                    self.ignore_label)
        fixed = None if self.normalization == VALID else normalizer(self.normalization, outer, inner, 0)
        device.softmax_loss_reduce(per_position, positions, top[0].mutable_device_data(device, upload=False),
                                   self.device_scratch(device, "stats", 3), fixed)
        if len(top) > 1:
            device.copy(top[1].mutable_device_data(device, upload=False), prob, outer * channels * inner)

    def weighted_loss_on(self, device, top):
        """The loss read (always: a bad label shows as a NaN loss, and then
        raises forward's DataError, from the position softmax_loss_reduce flagged)."""
        loss = float(top[0].read_data().reshape(-1)[0])
        if not np.isfinite(loss):
            stats = np.empty(3, np.float32)
            device.download(self.device_scratch(device, "stats", 3), stats)
            if stats[1] >= 0:
                label = stats[2]
                shown = int(label) if np.isfinite(label) else label
                raise DataError(f"{self.where()}: label {shown} is outside [0, {self.channels})")
        return super().weighted_loss_on(device, top)

    def backward_on(self, device, top, propagate_down, bottom):
        self.refuse_label_gradient(propagate_down)
        if not propagate_down[0]:
            return
        outer, channels, inner = self.outer, self.channels, self.inner
        # scaled on the device by the loss weight (top[0]'s diff, set by the net by a device fill)
        # over the normalizer forward_on left: nothing read here
        device.softmax_loss_backward(self.device_scratch(device, "prob", outer * channels * inner),
                                     bottom[1].device_data(device),
                                     bottom[0].mutable_device_diff(device, upload=False),     # written whole
                                     outer, channels, inner, top[0].device_diff(device),
                                     self.device_scratch(device, "stats", 3), self.ignore_label)

    def backward(self, top, propagate_down, bottom):
        self.refuse_label_gradient(propagate_down)
        if not propagate_down[0]:
            return
        view = (self.outer, self.channels, self.inner)
        dx = bottom[0].diff.reshape(view)
        dx[...] = self.prob
        flat_dx = dx.reshape(-1)
        flat_dx[self.flat] -= 1                      # indices are distinct: no lost updates
        if self.valid is not None:
            dx *= self.valid[:, None, :]
        dx *= dx.dtype.type(loss_weight(top) / normalizer(self.normalization, self.outer, self.inner,
                                                          self.count))


@register("EuclideanLoss")
class EuclideanLoss(LossLayer):
    """loss = sum (a - b)^2 / (2 N). Bottoms: a, b with the same count per item
    (N = first dimension). Both bottoms may receive a gradient."""

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        if bottom[0].count_range(1) != bottom[1].count_range(1):
            raise self.shape_error(f"inputs must have the same dimension: {bottom[0].shape} "
                                   f"vs {bottom[1].shape}")

    def allow_force_backward(self, bottom_index):
        return True

    def forward(self, bottom, top):
        a = bottom[0].data
        self.diff = a - bottom[1].data.reshape(a.shape)
        flat = self.diff.reshape(self.diff.size)
        # An empty batch: Caffe's dot / num / 2 is 0 / 0, NaN (euclidean_loss_layer.cpp)
        top[0].data[...] = nan_division(np.dot(flat, flat), bottom[0].shape[0]) / 2

    def backward(self, top, propagate_down, bottom):
        if not bottom[0].shape[0]:
            return                    # empty bottoms: no gradient to set
        scale = loss_weight(top) / bottom[0].shape[0]
        for index, sign in ((0, 1.0), (1, -1.0)):
            if propagate_down[index]:
                bottom[index].diff[...] = (self.diff * self.diff.dtype.type(sign * scale)).reshape(
                    bottom[index].shape)


@register("SigmoidCrossEntropyLoss")
class SigmoidCrossEntropyLoss(LossLayer):
    """Cross-entropy between targets t in [0, 1] and sigmoid(x), computed stably:
    loss = -sum over non-ignored of [x (t - [x >= 0]) - log(1 + exp(-|x|))] / normalizer.
    Fields: loss_param.ignore_label (compared with int(t)); loss_param.normalization
    (unset: BATCH_SIZE, or from the deprecated normalize: true -> VALID, false -> BATCH_SIZE).
    Normalizer sizes: outer = N, inner = count / N. Bottoms: x, t of the same count."""

    def setup(self, bottom, top):
        loss_param = self.layer_param.loss_param
        self.read_ignore_label()
        if loss_param.HasField("normalization"):
            self.normalization = loss_param.normalization
        elif loss_param.HasField("normalize"):
            self.normalization = VALID if loss_param.normalize else BATCH_SIZE
        else:
            self.normalization = BATCH_SIZE

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        if bottom[0].count != bottom[1].count:
            raise self.shape_error(f"inputs must have the same count: {bottom[0].shape} vs {bottom[1].shape}")
        self.outer, self.inner = bottom[0].shape[0], bottom[0].count_range(1)

    def forward(self, bottom, top):
        x = bottom[0].data
        t = bottom[1].data.reshape(x.shape)
        terms = x * (t - (x >= 0)) - np.log1p(np.exp(-np.abs(x)))
        self.valid = None
        count = x.size
        if self.ignore_label is not None:
            valid = t.astype(np.int64) != self.ignore_label
            if not valid.all():
                self.valid = valid
                terms *= valid
                count = int(np.count_nonzero(valid))
        self.norm = normalizer(self.normalization, self.outer, self.inner, count)
        top[0].data[...] = (0.0 - float(terms.sum(dtype=np.float64))) / self.norm   # +0 when empty, as Caffe

    def backward(self, top, propagate_down, bottom):
        self.refuse_label_gradient(propagate_down)
        if not propagate_down[0]:
            return
        x = bottom[0].data
        dtype = x.dtype.type
        sigmoid = np.tanh(x * dtype(0.5)) * dtype(0.5) + dtype(0.5)
        dx = sigmoid - bottom[1].data.reshape(x.shape)
        if self.valid is not None:
            dx *= self.valid
        dx *= dtype(loss_weight(top) / self.norm)
        bottom[0].diff[...] = dx


@register("HingeLoss")
class HingeLoss(LossLayer):
    """One-vs-all hinge loss. With d[n, k] = max(0, 1 - s x[n, k]), s = +1 for the
    true class and -1 otherwise: L1 loss = sum d / N, L2 loss = sum d^2 / N.
    Fields: hinge_loss_param.norm (L1; L2). Bottoms: scores (N, ...) flattened to
    (N, K), labels (N)."""

    def setup(self, bottom, top):
        self.norm = self.layer_param.hinge_loss_param.norm
        if self.norm not in (caffe_pb2.HingeLossParameter.L1, caffe_pb2.HingeLossParameter.L2):
            raise self.config_error("hinge_loss_param.norm", f"unknown norm {self.norm}")

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        if bottom[1].count != bottom[0].shape[0]:
            raise self.shape_error(f"expects one label per item: {bottom[0].shape[0]} items, "
                                   f"{bottom[1].count} labels")

    def _rows(self, bottom):
        num = bottom[0].shape[0]
        labels = bottom[1].data.reshape(num).astype(np.int64)
        dim = bottom[0].count_range(1)
        if num and (labels.min() < 0 or labels.max() >= dim):
            raise DataError(f"{self.where()}: labels must lie in [0, {dim}), got {labels.min()}..{labels.max()}")
        return np.arange(num), labels, (num, dim)

    def forward(self, bottom, top):
        rows, labels, shape = self._rows(bottom)
        signed = bottom[0].data.reshape(shape).copy()
        signed[rows, labels] *= -1
        self.margin = np.maximum(0, 1 + signed)          # (N, K) d
        if self.norm == caffe_pb2.HingeLossParameter.L1:
            total = float(self.margin.sum(dtype=np.float64))
        else:
            total = float(np.dot(self.margin.reshape(-1), self.margin.reshape(-1)))
        top[0].data[...] = nan_division(total, shape[0])     # an empty batch: Caffe's 0 / 0, NaN

    def backward(self, top, propagate_down, bottom):
        self.refuse_label_gradient(propagate_down)
        if not propagate_down[0] or not bottom[0].shape[0]:
            return
        rows, labels, shape = self._rows(bottom)
        if self.norm == caffe_pb2.HingeLossParameter.L1:
            grad = np.sign(self.margin)
        else:
            grad = 2 * self.margin
        grad[rows, labels] *= -1
        grad *= grad.dtype.type(loss_weight(top) / shape[0])
        bottom[0].diff[...] = grad.reshape(bottom[0].shape)


@register("MultinomialLogisticLoss")
class MultinomialLogisticLoss(LossLayer):
    """loss = -sum_n log(max(p[n, label_n], 1e-20)) / N for probabilities p
    (N, ...) flattened to (N, K) and labels (N, 1, 1, 1)."""

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        label = bottom[1]
        if label.count != label.shape[0]:
            raise self.shape_error(f"labels must be (N, 1, 1, 1), got {label.shape}")

    def _picked(self, bottom):
        num = bottom[0].shape[0]
        dim = bottom[0].count_range(1)
        labels = bottom[1].data.reshape(num).astype(np.int64)
        if num and (labels.min() < 0 or labels.max() >= dim):
            raise DataError(f"{self.where()}: labels must lie in [0, {dim}), got {labels.min()}..{labels.max()}")
        flat = np.arange(num) * dim + labels
        p = bottom[0].data.reshape(-1)[flat]
        return flat, np.maximum(p, p.dtype.type(LOG_THRESHOLD))

    def forward(self, bottom, top):
        _, p = self._picked(bottom)
        # an empty batch: Caffe's loss / num is 0 / 0, NaN
        top[0].data[...] = nan_division(-np.log(p).sum(dtype=np.float64), bottom[0].shape[0])

    def backward(self, top, propagate_down, bottom):
        self.refuse_label_gradient(propagate_down)
        if not propagate_down[0] or not bottom[0].shape[0]:
            return
        flat, p = self._picked(bottom)
        dx = bottom[0].diff
        dx[...] = 0
        dx.reshape(-1)[flat] = -loss_weight(top) / bottom[0].shape[0] / p


@register("InfogainLoss")
class InfogainLoss(LossLayer):
    """Softmax along `axis`, then loss = -sum over non-ignored (n, s) of
    sum_k H[label, k] log(max(p[n, k, s], 1e-20)) / normalizer.
    H (C x C) comes from infogain_loss_param.source (a binaryproto) or bottom[2].
    Fields: infogain_loss_param.source, .axis (1); loss_param.ignore_label,
    .normalization (VALID); loss_param.normalize is refused (deprecated, as in Caffe).
    Tops: loss (); optional top[1]: the probabilities. The gradient w.r.t. the scores
    is p * rowsum(H)[label] - H[label, :]."""
    exact_bottoms = None
    min_bottoms, max_bottoms = 2, 3
    exact_tops = None
    min_tops, max_tops = 1, 2

    def setup(self, bottom, top):
        loss_param = self.layer_param.loss_param
        if loss_param.HasField("normalize"):
            raise self.config_error("loss_param.normalize", 'is deprecated for InfogainLoss; use "normalization"')
        self.normalization = loss_param.normalization
        self.read_ignore_label()
        self.indexer = LabelIndexer()
        self.infogain = None
        if len(bottom) < 3:
            param = self.layer_param.infogain_loss_param
            if not param.HasField("source"):
                raise self.config_error("infogain_loss_param.source",
                                        "the infogain matrix file is required without a third bottom")
            blob_proto = read_binary(param.source, caffe_pb2.BlobProto())
            self.infogain = blob_proto_to_array(blob_proto)

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        b = bottom[0]
        self.axis = b.canonical_axis(self.layer_param.infogain_loss_param.axis)
        self.outer, self.inner = b.count_range(0, self.axis), b.count_range(self.axis + 1)
        self.channels = b.shape[self.axis]
        if self.outer * self.inner != bottom[1].count:
            raise self.shape_error(
                f"number of labels ({bottom[1].count}) must match the number of predictions "
                f"({self.outer * self.inner}) for scores {b.shape} and axis {self.axis}")
        h_count = self.infogain.size if self.infogain is not None else bottom[2].count
        if h_count != self.channels ** 2:
            raise self.shape_error(f"the infogain matrix must hold {self.channels}x{self.channels} "
                                   f"values, got {h_count}")
        if len(top) > 1 and top[1].shape != b.shape:
            top[1].reshape(b.shape)

    def _matrix(self, bottom, dtype):
        h = self.infogain if self.infogain is not None else bottom[2].data
        return h.reshape(self.channels, self.channels).astype(dtype, copy=False)

    def forward(self, bottom, top):
        view = (self.outer, self.channels, self.inner)
        x = bottom[0].data.reshape(view)
        self.prob = softmax(x, np.empty(view, x.dtype))
        labels = bottom[1].data.reshape(self.outer, self.inner)
        self.labels, _, valid, self.count = self.indexer.index(self, labels, self.channels,
                                                               self.ignore_label)
        self.valid = valid
        h = self._matrix(bottom, x.dtype)
        log_p = np.log(np.maximum(self.prob, x.dtype.type(LOG_THRESHOLD)))
        weights = h[self.labels].transpose(0, 2, 1)           # (outer, C, inner): H[label, k]
        per_item = (weights * log_p).sum(axis=1)              # (outer, inner)
        if valid is not None:
            per_item *= valid
        total = 0.0 - float(per_item.sum(dtype=np.float64))   # +0 when empty, as Caffe's loss -= ...
        top[0].data[...] = total / normalizer(self.normalization, self.outer, self.inner, self.count)
        if len(top) > 1:
            top[1].data[...] = self.prob.reshape(top[1].shape)

    def backward(self, top, propagate_down, bottom):
        self.refuse_label_gradient(propagate_down, label_bottoms=(1, 2))
        if not propagate_down[0]:
            return
        h = self._matrix(bottom, self.prob.dtype)
        row_sums = h.sum(axis=1)
        grad = self.prob * row_sums[self.labels][:, None, :] - h[self.labels].transpose(0, 2, 1)
        if self.valid is not None:
            grad *= self.valid[:, None, :]
        grad *= grad.dtype.type(loss_weight(top) / normalizer(self.normalization, self.outer,
                                                              self.inner, self.count))
        bottom[0].diff[...] = grad.reshape(bottom[0].shape)


@register("ContrastiveLoss")
class ContrastiveLoss(LossLayer):
    """Contrastive loss of feature pairs (a, b) with similarity y (nonzero: similar):
    d = ||a - b||; loss = sum_n [y d^2 + (1 - y) max(margin - d, 0)^2] / (2N)
    (legacy_version: max(margin - d^2, 0) for dissimilar pairs).
    Fields: contrastive_loss_param.margin (1), .legacy_version (false).
    Bottoms: a, b (N, C, 1, 1), y (N, 1, 1, 1). a and b may receive gradients.
    As in Caffe, the gradient divides by d + 1e-4 for dissimilar pairs."""
    exact_bottoms = 3

    def setup(self, bottom, top):
        p = self.layer_param.contrastive_loss_param
        self.margin, self.legacy = float(p.margin), bool(p.legacy_version)

    def allow_force_backward(self, bottom_index):
        return bottom_index != 2

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        a, b, y = bottom
        num = a.shape[0]
        if a.count != b.count or a.shape[0] != b.shape[0]:
            raise self.shape_error(f"bottoms 0 and 1 must have the same shape, got {a.shape} and {b.shape}")
        if y.count != num:
            raise self.shape_error(f"bottom[2] must hold one similarity value per pair ({num}), got {y.shape}")
        for index, blob in enumerate(bottom[:2]):
            if blob.count_range(2) != 1:
                raise self.shape_error(f"bottom[{index}] must be (N, C, 1, 1), got {blob.shape}")

    def forward(self, bottom, top):
        num = bottom[0].shape[0]
        self.diff = (bottom[0].data - bottom[1].data.reshape(bottom[0].shape)).reshape(num, bottom[0].count_range(1))
        self.dist_sq = np.einsum("nc,nc->n", self.diff, self.diff)
        self.similar = bottom[2].data.reshape(num).astype(np.int64) != 0
        if self.legacy:
            dissimilar = np.maximum(self.margin - self.dist_sq, 0)
        else:
            dissimilar = np.maximum(self.margin - np.sqrt(self.dist_sq), 0) ** 2
        per_pair = np.where(self.similar, self.dist_sq, dissimilar)
        # An empty batch: Caffe's loss / num / 2 is 0 / 0, NaN (contrastive_loss_layer.cpp)
        top[0].data[...] = nan_division(per_pair.sum(dtype=np.float64), num) / 2

    def backward(self, top, propagate_down, bottom):
        self.refuse_label_gradient(propagate_down, label_bottoms=(2,))
        num = bottom[0].shape[0]
        if not num:
            return                    # empty bottoms: no gradient to set
        if self.legacy:
            mdist = self.margin - self.dist_sq
            factor = -np.ones_like(mdist)
        else:
            dist = np.sqrt(self.dist_sq)
            mdist = self.margin - dist
            factor = -mdist / (dist + 1e-4)
        factor = np.where(mdist > 0, factor, 0)
        coefficient = np.where(self.similar, 1, factor).astype(self.diff.dtype)   # (N,)
        for index, sign in ((0, 1.0), (1, -1.0)):
            if propagate_down[index]:
                alpha = sign * loss_weight(top) / num
                grad = self.diff * (coefficient * self.diff.dtype.type(alpha))[:, None]
                bottom[index].diff[...] = grad.reshape(bottom[index].shape)
