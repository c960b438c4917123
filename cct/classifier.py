"""Classifier: a Net (TEST phase) that predicts class probabilities of images,
as pycaffe's caffe.Classifier: images are resized to image_dims, cropped to the
net's input size (the center crop, or 10 crops: 4 corners + center and their
mirrors, whose predictions are averaged), preprocessed by a cct.io.Transformer
and run through the net in batches."""
import numpy as np

from cct import io as cct_io
from cct import pycaffe  # noqa: F401  (Net.forward_all)
from cct.core.layer import TEST
from cct.core.net import Net


class Classifier(Net):
    """Classifier(model_file, pretrained_file, image_dims=None, mean=None,
    input_scale=None, raw_scale=None, channel_swap=None).

    image_dims: (height, width) images are resized to before cropping; default
    the net's input size (one whole-image crop). mean, input_scale, raw_scale,
    channel_swap: the Transformer settings of the first input (see cct.io).
    """

    def __init__(self, model_file, pretrained_file, image_dims=None, mean=None,
                 input_scale=None, raw_scale=None, channel_swap=None):
        Net.__init__(self, model_file, TEST, weights=pretrained_file)
        self.transformer = cct_io.input_transformer(self, mean, input_scale, raw_scale, channel_swap)
        self.crop_dims = np.array(self.blobs[self.inputs[0]].data.shape[2:])
        if image_dims is None or len(image_dims) == 0:
            image_dims = self.crop_dims
        self.image_dims = np.array(image_dims)

    def predict(self, inputs, oversample=True):
        """inputs: H x W x K images. Returns N x C class probabilities (the first
        output), averaged over the 10 crops when oversample, else of the center crop."""
        input_ = np.zeros((len(inputs), self.image_dims[0], self.image_dims[1], inputs[0].shape[2]),
                          dtype=np.float32)
        for ix, image in enumerate(inputs):
            input_[ix] = cct_io.resize_image(image, self.image_dims)
        if oversample:
            input_ = cct_io.oversample(input_, self.crop_dims)
        else:
            center = self.image_dims / 2.0
            crop = np.concatenate([center - self.crop_dims / 2.0, center + self.crop_dims / 2.0]).astype(int)
            input_ = input_[:, crop[0]:crop[2], crop[1]:crop[3], :]
        in_ = self.inputs[0]
        caffe_in = np.zeros((input_.shape[0], input_.shape[3], input_.shape[1], input_.shape[2]),
                            dtype=np.float32)
        for ix, crop in enumerate(input_):
            caffe_in[ix] = self.transformer.preprocess(in_, crop)
        predictions = self.forward_all(**{in_: caffe_in})[self.outputs[0]]
        if oversample:
            predictions = predictions.reshape((len(predictions) // 10, 10, -1)).mean(1)
        return predictions
