"""Layers that measure rather than learn: Accuracy and ArgMax. Neither has a
backward (Caffe's NOT_IMPLEMENTED); force_backward does not ask them for one."""
import numpy as np

from cct.core.errors import DataError
from cct.core.layer import Layer, NoBackward, register


@register("Accuracy")
class Accuracy(NoBackward, Layer):
    """Top-k classification accuracy over the non-ignored labels.
    An item counts as correct when fewer than top_k classes score >= its true
    class's score, other than the true class itself (Caffe master's rule: ties
    count against the true class).
    Fields: accuracy_param.top_k (1), .axis (1), .ignore_label.
    Bottoms: scores (outer, C, inner...), labels with outer*inner values.
    Tops: accuracy (); optional top[1]: per-class accuracy (C,), 0 for absent classes."""
    exact_bottoms = 2
    min_tops, max_tops = 1, 2

    def setup(self, bottom, top):
        param = self.layer_param.accuracy_param
        self.top_k = int(param.top_k)
        self.ignore_label = param.ignore_label if param.HasField("ignore_label") else None

    def reshape(self, bottom, top):
        b = bottom[0]
        # No labels (an empty batch): Caffe's check divides by their count (SIGFPE); there
        # are no classes per label to compare top_k with, and the accuracy of none is 0.
        if bottom[1].count and self.top_k > b.count // bottom[1].count:
            raise self.config_error("accuracy_param.top_k", f"must not exceed the number of classes "
                                    f"({b.count // bottom[1].count}), got {self.top_k}")
        self.axis = b.canonical_axis(self.layer_param.accuracy_param.axis)
        self.outer, self.inner = b.count_range(0, self.axis), b.count_range(self.axis + 1)
        self.channels = b.shape[self.axis]
        if self.outer * self.inner != bottom[1].count:
            raise self.shape_error(
                f"number of labels ({bottom[1].count}) must match the number of predictions "
                f"({self.outer * self.inner}): with axis {self.axis} and scores {b.shape}, labels "
                f"must hold {self.outer * self.inner} values in [0, {self.channels})")
        if top[0].shape != ():
            top[0].reshape(())
        if len(top) > 1 and top[1].shape != (self.channels,):
            top[1].reshape((self.channels,))

    def forward(self, bottom, top):
        scores = bottom[0].data.reshape(self.outer, self.channels, self.inner)
        labels = bottom[1].data.reshape(self.outer, self.inner).astype(np.int64)
        valid = np.ones(labels.shape, bool) if self.ignore_label is None else labels != self.ignore_label
        labels = np.where(valid, labels, 0)
        if labels.size and (labels.min() < 0 or labels.max() >= self.channels):
            bad = labels[(labels < 0) | (labels >= self.channels)][0]
            raise DataError(f"{self.where()}: label {bad} is outside [0, {self.channels})")
        true_score = np.take_along_axis(scores, labels[:, None, :], axis=1)     # (outer, 1, inner)
        at_least = np.count_nonzero(scores >= true_score, axis=1) - 1           # (outer, inner)
        correct = valid & (at_least < self.top_k)
        count = int(np.count_nonzero(valid))
        top[0].data[...] = np.count_nonzero(correct) / count if count else 0.0
        if len(top) > 1:
            seen = np.bincount(labels[valid], minlength=self.channels)
            right = np.bincount(labels[correct], minlength=self.channels)
            top[1].data[...] = np.where(seen > 0, right / np.maximum(seen, 1), 0.0)


@register("ArgMax")
class ArgMax(NoBackward, Layer):
    """Indices (or values) of the top_k largest entries; among equal values the
    higher index ranks first (Caffe sorts (value, index) pairs descending).
    Fields: argmax_param.out_max_val (false), .top_k (1), .axis (unset).
    With axis: top = bottom with that axis resized to top_k, holding indices, or
    the values when out_max_val. Without axis: over each item's flattened values,
    top (N, 1, top_k) of indices, or (N, 2, top_k) of indices then values when
    out_max_val, padded with 1s to the bottom's number of axes."""
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        param = self.layer_param.argmax_param
        self.out_max_val = bool(param.out_max_val)
        self.top_k = int(param.top_k)
        if self.top_k < 1:
            raise self.config_error("argmax_param.top_k", f"must be >= 1, got {self.top_k}")
        self.has_axis = param.HasField("axis")
        if self.has_axis:
            axis = bottom[0].canonical_axis(param.axis)
            if self.top_k > bottom[0].shape[axis]:
                raise self.config_error("argmax_param.top_k", f"must not exceed the size of axis {axis} "
                                        f"({bottom[0].shape[axis]}), got {self.top_k}")
        elif self.top_k > bottom[0].count_range(1):
            raise self.config_error("argmax_param.top_k", f"must not exceed the values per item "
                                    f"({bottom[0].count_range(1)}), got {self.top_k}")

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if self.has_axis:
            self.axis = bottom[0].canonical_axis(self.layer_param.argmax_param.axis)
            out = list(shape)
            out[self.axis] = self.top_k
        else:
            out = [1] * max(3, len(shape))
            out[0], out[2] = shape[0], self.top_k
            if self.out_max_val:
                out[1] = 2
        if top[0].shape != tuple(out):
            top[0].reshape(tuple(out))

    def _top_k(self, values):
        """(indices, values) of the top_k along the last axis, ties to the higher index."""
        reverse = values[..., ::-1]
        size = values.shape[-1]
        if self.top_k == 1:
            order = np.argmax(reverse, axis=-1)[..., None]
        else:
            order = np.argsort(-reverse, axis=-1, kind="stable")[..., :self.top_k]
        indices = size - 1 - order
        return indices, np.take_along_axis(values, indices, axis=-1)

    def forward(self, bottom, top):
        x = bottom[0].data
        if self.has_axis:
            indices, values = self._top_k(np.moveaxis(x, self.axis, -1))
            result = values if self.out_max_val else indices
            top[0].data[...] = np.moveaxis(result, -1, self.axis)
            return
        n = x.shape[0]                  # explicit sizes: -1 is ambiguous when n is 0
        indices, values = self._top_k(x.reshape(n, bottom[0].count_range(1)))        # (N, top_k)
        out = top[0].data.reshape(n, 2 if self.out_max_val else 1, self.top_k)
        out[:, 0, :] = indices
        if self.out_max_val:
            out[:, 1, :] = values
