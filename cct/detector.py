"""Detector: a Net (TEST phase) that classifies windows of images, as pycaffe's
caffe.Detector (R-CNN style): every window is cropped (optionally with
context_pad pixels of surrounding context, padded with the mean where the box
leaves the image), warped to the net's input size and run in batches."""
import os

import numpy as np

from cct import io as cct_io
from cct import pycaffe  # noqa: F401  (Net.forward_all)
from cct.core.errors import CctError
from cct.core.layer import TEST
from cct.core.net import Net


class Detector(Net):
    """Detector(model_file, pretrained_file, mean=None, input_scale=None,
    raw_scale=None, channel_swap=None, context_pad=None). Windows are
    (ymin, xmin, ymax, xmax) in pixels."""

    def __init__(self, model_file, pretrained_file, mean=None, input_scale=None,
                 raw_scale=None, channel_swap=None, context_pad=None):
        Net.__init__(self, model_file, TEST, weights=pretrained_file)
        self.transformer = cct_io.input_transformer(self, mean, input_scale, raw_scale, channel_swap)
        self.configure_crop(context_pad)

    def detect_windows(self, images_windows):
        """images_windows: iterable of (image filename, list of windows). Returns a
        list of {'window', 'prediction', 'filename'} dicts, window by window."""
        images_windows = [(name, list(windows)) for name, windows in images_windows]
        window_inputs = []
        for image_fname, windows in images_windows:
            image = cct_io.load_image(image_fname).astype(np.float32)
            for window in windows:
                window_inputs.append(self.crop(image, window))
        if not window_inputs:
            return []
        in_ = self.inputs[0]
        caffe_in = np.zeros((len(window_inputs), window_inputs[0].shape[2]) + self.blobs[in_].data.shape[2:],
                            dtype=np.float32)
        for ix, window_in in enumerate(window_inputs):
            caffe_in[ix] = self.transformer.preprocess(in_, window_in)
        predictions = self.forward_all(**{in_: caffe_in})[self.outputs[0]]
        detections = []
        ix = 0
        for image_fname, windows in images_windows:
            for window in windows:
                detections.append({"window": window, "prediction": predictions[ix], "filename": image_fname})
                ix += 1
        return detections

    def detect_selective_search(self, image_fnames):
        """Detection over Selective Search proposals (needs the
        selective_search_ijcv_with_python package and its MATLAB code)."""
        try:
            import selective_search_ijcv_with_python as selective_search
        except ImportError:
            raise CctError("detect_selective_search needs the selective_search_ijcv_with_python module "
                           "(https://github.com/sergeyk/selective_search_ijcv_with_python) on the Python "
                           "path; or compute windows yourself and call detect_windows") from None
        image_fnames = [os.path.abspath(f) for f in image_fnames]     # MATLAB needs absolute paths
        windows_list = selective_search.get_windows(image_fnames, cmd="selective_search_rcnn")
        return self.detect_windows(zip(image_fnames, windows_list))

    def crop(self, im, window):
        """The window of image `im` (H x W x K); with context_pad, the box grown so
        that context_pad pixels of context surround it at the net's input size."""
        window = np.asarray(window)
        crop = im[int(window[0]):int(window[2]), int(window[1]):int(window[3])]
        if not self.context_pad:
            return crop
        box = window.astype(float)
        crop_size = self.blobs[self.inputs[0]].width        # assumes a square input
        scale = crop_size / (1.0 * crop_size - self.context_pad * 2)
        half_h = (box[2] - box[0] + 1) / 2.0
        half_w = (box[3] - box[1] + 1) / 2.0
        center = (box[0] + half_h, box[1] + half_w)
        scaled_dims = scale * np.array((-half_h, -half_w, half_h, half_w))
        box = np.round(np.tile(center, 2) + scaled_dims)
        full_h = box[2] - box[0] + 1
        full_w = box[3] - box[1] + 1
        scale_h = crop_size / full_h
        scale_w = crop_size / full_w
        pad_y = int(round(max(0, -box[0]) * scale_h))      # how far the box leaves the image
        pad_x = int(round(max(0, -box[1]) * scale_w))
        im_h, im_w = im.shape[:2]
        box = np.clip(box, 0.0, [im_h, im_w, im_h, im_w])
        clip_h = box[2] - box[0] + 1
        clip_w = box[3] - box[1] + 1
        if clip_h <= 0 or clip_w <= 0:
            raise CctError(f"Detector.crop: window {tuple(window)} lies outside the {im_h}x{im_w} image")
        crop_h = int(round(clip_h * scale_h))
        crop_w = int(round(clip_w * scale_w))
        crop_h = min(crop_h, crop_size - pad_y)
        crop_w = min(crop_w, crop_size - pad_x)
        box = box.astype(int)
        context_crop = im[box[0]:box[2], box[1]:box[3]]
        context_crop = cct_io.resize_image(context_crop, (crop_h, crop_w))
        crop = np.ones(self.crop_dims, dtype=np.float32) * self.crop_mean
        crop[pad_y:pad_y + crop_h, pad_x:pad_x + crop_w] = context_crop
        return crop

    def configure_crop(self, context_pad):
        """Crop dimensions (the input's, in image layout) and, with context
        padding, the mean in unprocessed image space to fill outside the image."""
        in_ = self.inputs[0]
        transpose = self.transformer.transpose[in_]
        inverse = np.argsort(transpose)
        self.crop_dims = np.array(self.blobs[in_].data.shape[1:])[inverse]
        self.context_pad = context_pad
        if not context_pad:
            return
        channel_order = self.transformer.channel_swap.get(in_)
        raw_scale = self.transformer.raw_scale.get(in_)
        mean = self.transformer.mean.get(in_)
        if mean is None:
            self.crop_mean = np.zeros(self.crop_dims, dtype=np.float32)
            return
        crop_mean = np.array(mean, dtype=np.float32).transpose(inverse)
        if channel_order is not None:
            crop_mean = crop_mean[:, :, np.argsort(channel_order)]
        if raw_scale is not None:
            crop_mean /= raw_scale
        self.crop_mean = crop_mean
