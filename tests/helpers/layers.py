"""One layer run on arrays, as the layer tests do it, and a Python layer class
for tests that need one from an importable module."""
import numpy as np

import cct
from cct.testing.gradient_check import make_layer, setup_layer


def run_layer(prototxt, arrays, num_tops=1, phase=cct.TRAIN, layer=None, dtype=np.float64):
    """A layer from LayerParameter text (or `layer`), set up on bottoms of
    `dtype` (float64) holding `arrays` with `num_tops` tops, then reshaped and
    run forward once (the contract: reshape before every forward). Returns
    (layer, bottoms, tops)."""
    layer = layer or make_layer(prototxt, phase)
    bottoms, tops = setup_layer(layer, arrays, num_tops, dtype=dtype)
    layer.reshape(bottoms, tops)
    layer.forward(bottoms, tops)
    return layer, bottoms, tops


class Echo(cct.Layer):
    """top = bottom, for `python_param { module: "helpers.layers" layer: "Echo" }`."""

    def setup(self, bottom, top):
        if len(bottom) != 1 or len(top) != 1:
            raise Exception("Echo takes one bottom and one top")

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = bottom[0].data

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            bottom[0].diff[...] = top[0].diff


# A Python layer's module as written for Caffe, to be saved as a .py file and
# imported unchanged: `import caffe` (cct's alias) and caffe.Layer. top = 2 * bottom.
PYCAFFE_DOUBLE_LAYER = '''
import caffe


class Double(caffe.Layer):
    def setup(self, bottom, top):
        pass

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = 2 * bottom[0].data

    def backward(self, top, propagate_down, bottom):
        bottom[0].diff[...] = 2 * top[0].diff
'''
