"""cct.dnn: OpenCV 4's Caffe API (`cv2.dnn.readNetFromCaffe` & co.) on cct,
so a script stranded by OpenCV 5 (which removed its Caffe importer) changes
one name: `cv2.dnn.X` becomes `cct.dnn.X`.

    net = cct.dnn.readNetFromCaffe("deploy.prototxt", "weights.caffemodel")
    net.setInput(cct.dnn.blobFromImage(image, 1.0, (300, 300), (104.0, 177.0, 123.0)))
    detections = net.forward()            # SSD: (1, 1, images x keep_top_k, 7), as OpenCV 4

Names, argument orders, defaults and return types are OpenCV 4.14's (checked
against it in tests/pycaffe/test_dnn.py). Layer ids are OpenCV's: 0 is the
inputs' pseudo-layer "_input", 1.. the prototxt's layers other than Input, in
order. blobFromImage resizes with the `cv2` cct depends on, so its blobs are
OpenCV's bit for bit.
"""
import os
import time
import warnings

import cv2
import numpy as np

from cct.core.errors import ConfigError, ShapeError
from cct.core.layer import TEST
from cct.core.net import Net as _CaffeNet
from cct.layers.yolo import YoloDetectionOutput

# --- OpenCV's constants, with OpenCV 4.14's values ----------------------------------
DNN_BACKEND_DEFAULT, DNN_BACKEND_HALIDE, DNN_BACKEND_INFERENCE_ENGINE, DNN_BACKEND_OPENCV = 0, 1, 2, 3
DNN_BACKEND_VKCOM, DNN_BACKEND_CUDA, DNN_BACKEND_WEBNN, DNN_BACKEND_TIMVX, DNN_BACKEND_CANN = 4, 5, 6, 7, 8
DNN_TARGET_CPU, DNN_TARGET_OPENCL, DNN_TARGET_OPENCL_FP16, DNN_TARGET_MYRIAD, DNN_TARGET_VULKAN = 0, 1, 2, 3, 4
DNN_TARGET_FPGA, DNN_TARGET_CUDA, DNN_TARGET_CUDA_FP16, DNN_TARGET_HDDL, DNN_TARGET_NPU = 5, 6, 7, 8, 9
DNN_TARGET_CPU_FP16 = 10
DNN_LAYOUT_UNKNOWN, DNN_LAYOUT_ND, DNN_LAYOUT_NCHW, DNN_LAYOUT_NCDHW = 0, 1, 2, 3
DNN_LAYOUT_NHWC, DNN_LAYOUT_NDHWC, DNN_LAYOUT_PLANAR = 4, 5, 6
DNN_PMODE_NULL, DNN_PMODE_CROP_CENTER, DNN_PMODE_LETTERBOX = 0, 1, 2
CV_8U, CV_8S, CV_16U, CV_16S, CV_32S, CV_32F, CV_64F, CV_16F = 0, 1, 2, 3, 4, 5, 6, 7

_OPENCL_TARGETS = (DNN_TARGET_OPENCL, DNN_TARGET_OPENCL_FP16)
_F32 = np.float32


def getTickFrequency():
    """Ticks per second of getPerfProfile's counts: 1e9 (nanoseconds), as
    cv2.getTickFrequency() on Linux."""
    return 1e9


def getTickCount():
    """Now, in getTickFrequency() ticks (cv2.getTickCount)."""
    return time.perf_counter_ns()


# --- reading nets -------------------------------------------------------------------
def readNetFromCaffe(prototxt, caffeModel=None):
    """A Net from a Caffe deploy prototxt and, optionally, its .caffemodel
    weights (without them the layers keep their fillers' values), built in
    the TEST phase as OpenCV does."""
    _check_file(prototxt, "readNetFromCaffe", "prototxt")
    if caffeModel:
        _check_file(caffeModel, "readNetFromCaffe", "caffeModel")
    return Net(_CaffeNet(str(prototxt), TEST, weights=str(caffeModel) if caffeModel else None))


def readNet(model, config="", framework=""):
    """OpenCV's readNet for Caffe files: the .caffemodel and the .prototxt in
    either order (OpenCV tells them by extension: a `model` ending .prototxt,
    or a `config` ending .caffemodel, swaps them). Other formats are refused."""
    model_ext, config_ext = _extension(model), _extension(config)
    caffe = str(framework).lower() == "caffe" or "caffemodel" in (model_ext, config_ext) \
        or "prototxt" in (model_ext, config_ext)
    if not caffe:
        raise ConfigError(f"readNet: model {str(model)!r} (config {str(config)!r}) is not a Caffe model: "
                          "cct.dnn reads .caffemodel with .prototxt only; use cv2.dnn for ONNX, TensorFlow, "
                          "Darknet and the other formats")
    if model_ext == "prototxt" or config_ext == "caffemodel":
        model, config = config, model
    return readNetFromCaffe(config, model or None)


def _extension(path):
    name = str(path or "")
    return name.rsplit(".", 1)[-1].lower() if "." in name else ""


def _check_file(path, function, argument):
    if not os.path.isfile(str(path)):
        raise ConfigError(f"{function}: {argument} {str(path)!r}: no such file")


# --- the net ------------------------------------------------------------------------
class Net:
    """cv2.dnn.Net's API over a TEST-phase cct.Net (`.net`). Layers are
    OpenCV's: the prototxt's own (no Input layer, none of the Split layers
    cct inserts), each with its own outputs (an in-place layer's input is
    kept as its producer's output, as OpenCV keeps it)."""

    def __init__(self, net):
        self.net = net
        self._indices = [i for i, layer in enumerate(net.layers)
                         if layer.type != "Input" and not _inserted_split(net, i)]
        self._names = tuple(net._layer_names[i] for i in self._indices)
        self._backend, self._target = DNN_BACKEND_DEFAULT, DNN_TARGET_CPU
        self._recorder = _Recorder(len(net.layers))
        net.executor.subscribe("before_forward", self._recorder.before)
        net.executor.subscribe("after_forward", self._recorder.after)

    # names and ids
    def getLayerNames(self):
        """The layers' names in id order (ids 1..), a tuple as OpenCV 4.14 gives."""
        return self._names

    def getLayerId(self, layer):
        """The id (1-based) of the layer named `layer`; -1 when there is none."""
        return self._names.index(layer) + 1 if layer in self._names else -1

    def getLayer(self, layerId):
        """The Layer of id `layerId` (an int; 0: the inputs' "_input") or name."""
        if isinstance(layerId, str):
            layerId = self._id_of(layerId, "getLayer")
        if layerId == 0:
            return Layer("_input", "", [])
        if not 0 < int(layerId) <= len(self._names):
            raise ConfigError(f"getLayer: no layer with id {layerId} (ids 0 to {len(self._names)})")
        layer = self.net.layers[self._indices[int(layerId) - 1]]
        return Layer(layer.name, layer.type, layer.blobs)

    def getUnconnectedOutLayers(self):
        """The ids of the layers no other layer reads, int32 (OpenCV 4's)."""
        net, read = self.net, set()
        producer = {}
        for i in range(len(net.layers)):
            read.update(producer[name] for name in net._bottom_names[i] if name in producer)
            producer.update((name, i) for name in net._top_names[i])
        return np.array([k + 1 for k, i in enumerate(self._indices) if i not in read], np.int32)

    def getUnconnectedOutLayersNames(self):
        """The names of getUnconnectedOutLayers' layers, a tuple."""
        return tuple(self._names[k - 1] for k in self.getUnconnectedOutLayers())

    def empty(self):
        return not self._names

    def _id_of(self, name, function):
        layer_id = self.getLayerId(name)
        if layer_id < 0:
            raise ConfigError(f"{function}: requested layer {name!r} not found in net '{self.net.name}' "
                              f"(getLayerNames() lists {len(self._names)})")
        return layer_id

    # backends and targets
    def setPreferableBackend(self, backendId):
        """Accepted and kept: cct is the only backend."""
        self._backend = int(backendId)

    def setPreferableTarget(self, targetId):
        """DNN_TARGET_OPENCL(_FP16): cct's OpenCL device (cct.set_mode_gpu, for
        the whole process), or the host with a warning where there is none, as
        OpenCV falls back; any other target: the host."""
        from cct.devices import opencl
        from cct.runtime import settings
        self._target = int(targetId)
        if self._target in _OPENCL_TARGETS and not opencl.available():
            warnings.warn(f"cct.dnn: DNN_TARGET_OPENCL: {opencl.why_unavailable()}; running on the host")
        settings.set_mode("gpu" if self._target in _OPENCL_TARGETS and opencl.available() else "cpu")

    # input and forward
    def setInput(self, blob, name="", scalefactor=1.0, mean=None):
        """Set input `name` (the first input when empty) to (blob - mean) *
        scalefactor, in float32; mean: a number or up to 4 per-channel values
        (axis 1), OpenCV's Scalar. A new shape reshapes the net."""
        name = name or (self.net.inputs[0] if self.net.inputs else "")
        if name not in self.net.inputs:
            raise ConfigError(f"setInput: name {name!r} is not an input of net '{self.net.name}' "
                              f"(inputs: {self.net.inputs})")
        values = _scaled_input(np.asarray(blob), float(scalefactor), _scalar(mean, "setInput: mean"))
        target = self.net.blobs[name]
        if target.shape != values.shape:
            target.reshape(*values.shape)
            self.net.reshape()
        target.data[...] = values

    def forward(self, outputName=None):
        """Run the net as far as the outputs asked for. outputName: a layer
        name (its first output; None or "": the last layer's) -> one array;
        a list of names -> a tuple of arrays, as OpenCV 4.14. SSD's
        DetectionOutput comes in OpenCV's layout (_opencv_detections)."""
        names = list(outputName) if isinstance(outputName, (list, tuple)) else None
        wanted = [self._index(name) for name in (names if names is not None else [outputName])]
        taken = self._run(wanted)
        outputs = tuple(self._as_opencv(i, taken[i]) for i in wanted)
        return outputs if names is not None else outputs[0]

    def _index(self, name):
        if not name:
            return self._indices[-1]
        return self._indices[self._id_of(name, "forward") - 1]

    def _run(self, wanted):
        """{layer index: copy of its first top} just after each wanted layer ran."""
        recorder = self._recorder
        recorder.start({i: self.net.top_vecs[i][0] for i in wanted})
        self.net._forward(0, max(wanted))
        return recorder.taken

    def _as_opencv(self, index, values):
        layer = self.net.layers[index]
        if layer.type != "DetectionOutput" or isinstance(layer, YoloDetectionOutput):
            return values           # OpenCV has SSD's flavour only; the YOLOv2 port's top as cct computes it
        keep = int(layer.layer_param.detection_output_param.keep_top_k)
        return _opencv_detections(values, keep, self.net.bottom_vecs[index][0].shape[0])

    def getPerfProfile(self):
        """(total ticks, per-layer ticks as a float64 array in id order) of the
        last forward, in getTickFrequency() units; layers it did not run: 0."""
        timings = self._recorder.ticks[self._indices].astype(np.float64)
        return int(timings.sum()), timings


class Layer:
    """cv2.dnn.Layer: `.name`, `.type`, and `.blobs`, the parameters read as
    copies (a 1-d blob as N x 1, OpenCV's Mat) and written in place (each
    array must hold the blob's count of values; it takes the blob's shape)."""

    def __init__(self, name, layer_type, blobs):
        self.name, self.type, self._blobs = name, layer_type, blobs

    @property
    def blobs(self):
        return tuple(blob.data.reshape(-1, 1).copy() if blob.data.ndim == 1 else blob.data.copy()
                     for blob in self._blobs)

    @blobs.setter
    def blobs(self, arrays):
        arrays = list(arrays)
        if len(arrays) > len(self._blobs):
            raise ShapeError(f"layer '{self.name}' ({self.type}): blobs: {len(arrays)} arrays given, "
                             f"the layer has {len(self._blobs)} blobs")
        for k, array in enumerate(arrays):
            array, blob = np.asarray(array, _F32), self._blobs[k]
            if array.size != blob.count:
                raise ShapeError(f"layer '{self.name}' ({self.type}): blobs[{k}]: {array.shape} holds "
                                 f"{array.size} values, the blob {tuple(blob.shape)} {blob.count}")
            blob.data[...] = array.reshape(blob.shape)


class _Recorder:
    """The executor's per-layer listener: each layer's ticks, and a copy of
    the tops asked for taken right after their layer (before an in-place
    layer overwrites them). It holds no reference to the net (no cycle)."""

    def __init__(self, count):
        self.ticks = np.zeros(count, np.int64)
        self.wanted, self.taken, self._began = {}, {}, 0

    def start(self, wanted):
        self.ticks[:] = 0
        self.wanted, self.taken = wanted, {}

    def before(self, index):
        self._began = time.perf_counter_ns()

    def after(self, index):
        self.ticks[index] += time.perf_counter_ns() - self._began
        if index in self.wanted:
            self.taken[index] = self.wanted[index].data.copy()


def _inserted_split(net, index):
    """Whether layer `index` is a Split that cct's insert_splits added (its
    tops are named for it), not one the prototxt wrote."""
    layer = net.layers[index]
    if layer.type != "Split":
        return False
    name, tops = net._layer_names[index], net._top_names[index]
    return name.endswith("_split") and all(top == f"{name}_{k}" for k, top in enumerate(tops))


def _opencv_detections(rows, keep_top_k, images):
    """SSD's DetectionOutput top (1, 1, D, 7) in OpenCV 4.14's layout: the
    detections, then rows of zeros up to images x keep_top_k (all zeros when
    nothing is found; the fork's [i, -1, ...] rows are dropped). keep_top_k
    <= 0 (OpenCV 4.14 crashes there): exactly the detections, or one zero row."""
    rows = rows.reshape(-1, 7)
    rows = rows[rows[:, 1] != -1]
    count = images * keep_top_k if keep_top_k > 0 else max(1, rows.shape[0])
    out = np.zeros((1, 1, max(count, rows.shape[0]), 7), _F32)
    out[0, 0, :rows.shape[0]] = rows
    return out


def _scalar(values, what):
    """OpenCV's Scalar: a number -> (v, 0, 0, 0); up to 4 values, zero-padded."""
    if values is None:
        return np.zeros(4)
    values = np.atleast_1d(np.asarray(values, np.float64)).ravel()
    if values.size > 4:
        raise ValueError(f"{what}: at most 4 values (OpenCV's Scalar), got {values.size}")
    return np.concatenate([values, np.zeros(4 - values.size)])


def _scaled_input(blob, scale, mean):
    """setInput's (blob - mean) * scale as OpenCV's data layer computes it:
    blob * scale + (-mean * scale) per channel, in float32."""
    values = blob.astype(_F32)
    if scale == 1.0 and not mean.any():
        return values
    if not mean[1:].any():                     # one mean for every channel
        return values * _F32(scale) + _F32(-mean[0] * scale)
    if values.ndim < 2 or values.shape[1] > 4:
        raise ShapeError(f"setInput: per-channel means need at most 4 channels (axis 1), got {values.shape}")
    shift = (-mean[:values.shape[1]] * scale).astype(_F32).reshape(1, -1, *[1] * (values.ndim - 2))
    return values * _F32(scale) + shift


# --- images to blobs ----------------------------------------------------------------
def blobFromImage(image, scalefactor=1.0, size=(0, 0), mean=(0, 0, 0, 0), swapRB=False, crop=False,
                  ddepth=CV_32F):
    """One image (H x W, or H x W x C with C = 1, 3 or 4) -> a (1, C, h, w)
    blob; see blobFromImages."""
    return blobFromImages([image], scalefactor, size, mean, swapRB, crop, ddepth)


def blobFromImages(images, scalefactor=1.0, size=(0, 0), mean=(0, 0, 0, 0), swapRB=False, crop=False,
                   ddepth=CV_32F):
    """Images -> an NCHW blob, as OpenCV 4.14's blobFromImages: each image
    resized to size = (w, h) (cv2.resize, INTER_LINEAR; (0, 0): the first
    image's size), or with crop, resized keeping its aspect ratio until it
    covers size and cropped at the centre; its channels laid out (swapRB:
    the first and third swapped), then (value - mean[c]) * scalefactor per
    channel in float32, mean in the blob's channel order. ddepth CV_8U (uint8
    images only) allows no mean and no scaling."""
    if ddepth not in (CV_32F, CV_8U):
        raise ValueError(f"blobFromImages: ddepth must be CV_32F ({CV_32F}) or CV_8U ({CV_8U}), got {ddepth}")
    mean, scale = _scalar(mean, "blobFromImages: mean"), float(scalefactor)
    if ddepth == CV_8U and (scale != 1.0 or mean.any()):
        raise ValueError("blobFromImages: ddepth CV_8U allows no scalefactor and no mean (OpenCV's rule)")
    images = [np.asarray(image) for image in images]
    if not images:
        raise ValueError("blobFromImages: no images")
    width, height = (0, 0) if size is None else (int(size[0]), int(size[1]))
    if (width, height) == (0, 0):
        height, width = images[0].shape[:2]
    fitted = [_fit(image, width, height, crop) for image in images]
    return _nchw(fitted, mean, scale, swapRB, ddepth)


def _fit(image, width, height, crop):
    """The image at width x height, resized (and centre-cropped) as OpenCV does."""
    if image.shape[1] == width and image.shape[0] == height:
        return image
    if not crop:
        return cv2.resize(image, (width, height), interpolation=cv2.INTER_LINEAR)
    # OpenCV's factor is a float (single precision): the larger of the two ratios
    factor = max(_F32(width) / _F32(image.shape[1]), _F32(height) / _F32(image.shape[0]))
    resized = cv2.resize(image, None, fx=float(factor), fy=float(factor), interpolation=cv2.INTER_LINEAR)
    x, y = int(0.5 * (resized.shape[1] - width)), int(0.5 * (resized.shape[0] - height))   # C++ truncation
    return resized[y:y + height, x:x + width]


def _nchw(images, mean, scale, swap, ddepth):
    """(N, C, H, W) of equally shaped H x W (x C) images; C = 1, 3 or 4."""
    first = images[0]
    for k, image in enumerate(images):
        channels = 1 if image.ndim == 2 else image.shape[2] if image.ndim == 3 else 0
        if channels not in (1, 3, 4):
            raise ShapeError(f"blobFromImages: image {k}: {image.shape}: images are H x W or H x W x C "
                             "with 1, 3 or 4 channels")
        if image.shape[:2] != first.shape[:2] or image.dtype != first.dtype or image.size != first.size:
            raise ShapeError(f"blobFromImages: image {k} {image.shape} {image.dtype} differs from image 0 "
                             f"{first.shape} {first.dtype} after resizing")
    if ddepth == CV_8U and first.dtype != np.uint8:
        raise ValueError(f"blobFromImages: ddepth CV_8U takes uint8 images, got {first.dtype}")
    height, width = first.shape[:2]
    blob = np.stack([image.reshape(height, width, -1).transpose(2, 0, 1) for image in images])
    blob = blob.astype(np.uint8 if ddepth == CV_8U else _F32)
    if swap and blob.shape[1] >= 3:
        blob[:, [0, 2]] = blob[:, [2, 0]]
    if scale != 1.0 or mean.any():
        for c in range(blob.shape[1]):
            blob[:, c] = (blob[:, c] - _F32(mean[c])) * _F32(scale)
    return np.ascontiguousarray(blob)
