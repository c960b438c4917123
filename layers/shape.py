"""Layers that route or reshape blobs without arithmetic on values beyond sums:
Split."""
from cct.layer import Layer, register


@register("Split")
class Split(Layer):
    """Copies its bottom to every top; backward sums the tops' diffs.
    Inserted by the net for blobs read by several layers."""
    exact_bottoms = 1
    min_tops = 1

    def reshape(self, bottom, top):
        for blob in top:
            blob.reshape(bottom[0].shape)

    def forward(self, bottom, top):
        for blob in top:
            if blob is not bottom[0]:
                blob.data[...] = bottom[0].data

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            total = top[0].diff.copy()
            for blob in top[1:]:
                total += blob.diff
            bottom[0].diff[...] = total
