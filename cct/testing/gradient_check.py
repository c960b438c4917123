"""The numerical gradient checker shared by every layer test (and usable on
Python layers): central differences in float64 against the layer's backward.

The objective is sum_k <top_k.data, W_k> for fixed random W_k, so backward is
run with top_k.diff = W_k and every bottom and parameter element's analytic
gradient is compared with (L(x+h) - L(x-h)) / 2h. Big blobs are sampled.
"""
import numpy as np
from google.protobuf import text_format

from cct.core.blob import Blob
from cct.core.layer import TRAIN, create_layer
from cct.proto import caffe_pb2
from cct.core.rng import set_random_seed
from cct.runtime import settings


def make_layer(prototxt, phase=TRAIN):
    """A layer from LayerParameter text, e.g. 'type: "ReLU" relu_param { negative_slope: 0.1 }'."""
    param = text_format.Parse(prototxt, caffe_pb2.LayerParameter())
    if not param.name:
        param.name = param.type.lower() or "layer"
    return create_layer(param, phase)


def setup_layer(layer, bottom_arrays, num_tops=1, dtype=np.float64):
    """Blobs for `bottom_arrays`, `num_tops` empty tops, the layer set up and
    its params converted to `dtype`. Returns (bottoms, tops)."""
    bottoms = [_blob_of(np.asarray(a, dtype)) for a in bottom_arrays]
    tops = [Blob(dtype=dtype) for _ in range(num_tops)]
    layer.set_up(bottoms, tops)
    layer.configure(settings.layer_settings(layer))     # as a net's executor does
    layer.blobs[:] = [_blob_of(b.data.astype(dtype)) for b in layer.blobs]
    layer.param_propagate_down = [True] * len(layer.blobs)
    return bottoms, tops


def _blob_of(array):
    blob = Blob(array.shape, dtype=array.dtype)
    blob.data[...] = array
    return blob


def check_layer_gradient(layer, bottom_arrays, num_tops=1, check_bottoms=None, check_params=True,
                         step=1e-4, threshold=1e-4, kink=None, kink_range=-1.0, max_checks=150, seed=1701,
                         check_tops=None):
    """Raise AssertionError where analytic and numerical gradients disagree.

    check_bottoms: indices of bottoms to check (default all). check_tops:
    indices of the tops the objective sums (default all; the others get zero
    weights, for tops whose diff the layer ignores, as Caffe's checker picks
    a top with top_id). kink/kink_range:
    skip bottom elements within kink_range of a non-differentiable point.
    Error test (Caffe's): |analytic - numeric| <= threshold * max(1, |analytic|, |numeric|).
    """
    rng = np.random.default_rng(seed)
    bottoms, tops = setup_layer(layer, bottom_arrays, num_tops)
    check_bottoms = range(len(bottoms)) if check_bottoms is None else check_bottoms

    def objective():
        set_random_seed(seed)             # stochastic layers draw the same mask each time
        layer.reshape(bottoms, tops)
        layer.forward(bottoms, tops)
        return sum(float(np.sum(top.data * w)) for top, w in zip(tops, top_weights))

    set_random_seed(seed)
    layer.reshape(bottoms, tops)
    layer.forward(bottoms, tops)
    top_weights = [rng.uniform(-1, 1, top.shape) * (check_tops is None or k in check_tops)
                   for k, top in enumerate(tops)]
    objective()
    for top, w in zip(tops, top_weights):
        top.diff[...] = w
    for blob in layer.blobs:
        blob.diff[...] = 0
    propagate = [i in check_bottoms for i in range(len(bottoms))]
    layer.backward(tops, propagate, bottoms)
    checked = [(f"bottom[{i}]", bottoms[i], bottoms[i].diff.copy(), True) for i in check_bottoms]
    if check_params:
        checked += [(f"param[{i}]", b, b.diff.copy(), False) for i, b in enumerate(layer.blobs)]

    failures = []
    for label, blob, analytic, is_bottom in checked:
        flat = blob.data.reshape(-1)
        indices = np.arange(flat.size)
        if flat.size > max_checks:
            indices = rng.choice(flat.size, max_checks, replace=False)
        for index in indices:
            original = flat[index]
            if is_bottom and kink is not None and abs(original - kink) <= kink_range:
                continue
            flat[index] = original + step
            plus = objective()
            flat[index] = original - step
            minus = objective()
            flat[index] = original
            numeric = (plus - minus) / (2 * step)
            got = analytic.reshape(-1)[index]
            scale = max(1.0, abs(got), abs(numeric))
            if abs(got - numeric) > threshold * scale:
                failures.append(f"{label}[{np.unravel_index(index, blob.shape)}]: "
                                f"analytic {got:.6g} vs numeric {numeric:.6g}")
    objective()
    if failures:
        raise AssertionError(f"{layer.where()}: {len(failures)} gradient mismatches:\n  "
                             + "\n  ".join(failures[:20]))
