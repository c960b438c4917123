"""Layers that hold the net's inputs: Input (shapes from input_param), DummyData
(filler-made tops), MemoryData (batches from arrays in memory), Parameter (a
learned blob as a top)."""
import logging

import numpy as np

from cct.core.blob import Blob
from cct.core.errors import ConfigError, ShapeError
from cct.core.fillers import FILLERS, fill
from cct.core.layer import Layer, register
from cct.proto import caffe_pb2

log = logging.getLogger("cct")


@register("Input")
class Input(Layer):
    """Net inputs, filled by the user. input_param { shape { dim: ... } } gives one
    shape for every top or one per top. Reshape keeps what the user set."""
    min_tops = 1
    exact_bottoms = 0

    def setup(self, bottom, top):
        shapes = self.layer_param.input_param.shape
        if len(shapes) not in (0, 1, len(top)):
            raise self.config_error("input_param.shape", f"give one shape or one per top "
                                    f"({len(top)}), got {len(shapes)}")
        for index, blob in enumerate(top):
            if shapes:
                blob.reshape(tuple(shapes[0 if len(shapes) == 1 else index].dim))

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        pass


@register("DummyData")
class DummyData(Layer):
    """Tops filled by fillers, for tests and benchmarks.

    dummy_data_param: shape (one for all tops or one per top), or the legacy
    num/channels/height/width (each once or once per top; 4-d tops);
    data_filler: none (constant 0), one for all tops, or one per top.
    As in Caffe, "constant" fillers fill their tops once at setup; every other
    filler refills its tops on every forward.
    """
    exact_bottoms = 0
    min_tops = 1
    draws_random = True           # the refilling fillers draw on every forward

    def setup(self, bottom, top):
        param = self.layer_param.dummy_data_param
        fillers = list(param.data_filler)
        if len(fillers) not in (0, 1, len(top)):
            raise self.config_error("dummy_data_param.data_filler", f"give none, one, or one per top "
                                    f"({len(top)}), got {len(fillers)}")
        if not fillers:
            fillers = [caffe_pb2.FillerParameter(type="constant", value=0)]
        self._fillers = [fillers[0 if len(fillers) == 1 else i] for i in range(len(top))]
        for index, filler in enumerate(fillers):
            if filler.type not in FILLERS:     # refilled tops would only fail at forward
                raise self.config_error(f"dummy_data_param.data_filler[{index}].type", f"unknown filler "
                                        f"{filler.type!r}; known: {', '.join(sorted(FILLERS))}")
        for blob, shape in zip(top, self._shapes(param, len(top))):
            blob.reshape(shape)
        for index, (blob, filler) in enumerate(zip(top, self._fillers)):
            if filler.type == "constant":
                self._fill(index, blob, filler)

    def _shapes(self, param, num_tops):
        legacy = ("num", "channels", "height", "width")
        if any(len(getattr(param, name)) for name in legacy):
            if len(param.shape):
                raise self.config_error("dummy_data_param.shape", "give shape or the legacy "
                                        "num/channels/height/width, not both")
            for name in legacy:
                if len(getattr(param, name)) not in (1, num_tops):
                    raise self.config_error(f"dummy_data_param.{name}", f"give it once or once per top "
                                            f"({num_tops}), got {len(getattr(param, name))}")
            pick = lambda values, i: values[0 if len(values) == 1 else i]   # noqa: E731
            return [tuple(pick(getattr(param, name), i) for name in legacy) for i in range(num_tops)]
        if len(param.shape) not in (1, num_tops):
            raise self.config_error("dummy_data_param.shape", f"give one shape or one per top "
                                    f"({num_tops}), got {len(param.shape)}")
        return [tuple(param.shape[0 if len(param.shape) == 1 else i].dim) for i in range(num_tops)]

    def _fill(self, index, blob, filler):
        fill(blob, filler, where=f"{self.where()}: dummy_data_param.data_filler[{index}]")

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        for index, (blob, filler) in enumerate(zip(top, self._fillers)):
            if filler.type != "constant":
                self._fill(index, blob, filler)


@register("MemoryData")
class MemoryData(Layer):
    """Serves batches from arrays held in memory (Caffe's MemoryDataLayer).

    memory_data_param: batch_size, channels, height, width (all > 0).
    tops: data (batch_size, channels, height, width) and label (batch_size,).
    Give the arrays with set_input_arrays(data, labels) or reset(data, labels, n);
    each forward serves the next batch_size items, wrapping around to the start.
    No transform_param is applied to the arrays (Caffe does none on Reset either).
    """
    exact_bottoms = 0
    exact_tops = 2

    def setup(self, bottom, top):
        param = self.layer_param.memory_data_param
        for name in ("batch_size", "channels", "height", "width"):
            if getattr(param, name) <= 0:
                raise self.config_error(f"memory_data_param.{name}", f"must be given and > 0, "
                                        f"got {getattr(param, name)}")
        self.batch_size = param.batch_size
        self.item_shape = (param.channels, param.height, param.width)
        if self.layer_param.HasField("transform_param"):
            log.warning("%s: transform_param is not applied to arrays given with "
                        "set_input_arrays/reset", self.where())
        self._data = self._labels = None
        self._num = self._pos = 0
        self.reshape(bottom, top)

    def set_input_arrays(self, data, labels):
        """pycaffe's Net.set_input_arrays: data (n, channels, height, width), labels (n,)
        (or (n, 1, 1, 1)); n must be a multiple of batch_size."""
        data = np.asarray(data)
        if data.ndim != 4 or data.shape[1:] != self.item_shape:
            raise ShapeError(f"{self.where()}: data must have shape (n,) + {self.item_shape} "
                             f"(memory_data_param), got {data.shape}")
        labels = np.asarray(labels)
        if labels.size != data.shape[0] or (labels.ndim and labels.shape[0] != data.shape[0]):
            raise ShapeError(f"{self.where()}: labels must hold one value per item ({data.shape[0]}), "
                             f"got shape {labels.shape}")
        self.reset(data, labels, data.shape[0])

    def reset(self, data, labels, n):
        """Caffe's MemoryDataLayer::Reset: serve the first n items of data/labels."""
        if n <= 0 or n % self.batch_size:
            raise ShapeError(f"{self.where()}: the number of items ({n}) must be a positive multiple "
                             f"of memory_data_param.batch_size ({self.batch_size})")
        data = np.asarray(data).reshape(-1, *self.item_shape)
        labels = np.asarray(labels).reshape(-1)
        if len(data) < n or len(labels) < n:
            raise ShapeError(f"{self.where()}: reset with n={n} but only {len(data)} data items and "
                             f"{len(labels)} labels")
        self._data, self._labels, self._num, self._pos = data[:n], labels[:n], n, 0

    def set_batch_size(self, batch_size):
        if batch_size <= 0:
            raise ConfigError(f"{self.where()}: batch size must be > 0, got {batch_size}")
        if self._data is not None and self._num % batch_size:
            raise ShapeError(f"{self.where()}: batch size {batch_size} does not divide the "
                             f"{self._num} items held; call reset first")
        self.batch_size = batch_size
        self._pos = 0

    def reshape(self, bottom, top):
        top[0].reshape((self.batch_size,) + self.item_shape)
        if top[1].count != self.batch_size:
            top[1].reshape((self.batch_size,))


    def forward(self, bottom, top):
        if self._data is None:
            raise ConfigError(f"{self.where()}: no data: call set_input_arrays(data, labels) "
                              "or reset(data, labels, n) before forward")
        start, end = self._pos, self._pos + self.batch_size
        top[1].reshape((self.batch_size, 1, 1, 1))      # (N,) at setup, (N,1,1,1) from forward on: Caffe's
        top[0].data[...] = self._data[start:end]
        top[1].data[...] = self._labels[start:end].reshape(top[1].shape)
        self._pos = end % self._num


@register("Parameter")
class Parameter(Layer):
    """Exposes a learned blob as its top (for use by other layers).

    parameter_param: shape. blobs: one of that shape, zero-initialized as in
    Caffe. top = the blob's data; backward adds the top's diff into the blob's diff.
    """
    exact_bottoms = 0
    exact_tops = 1

    def setup(self, bottom, top):
        shape = tuple(self.layer_param.parameter_param.shape.dim)
        if any(d < 0 for d in shape):
            raise self.config_error("parameter_param.shape", f"dims must be >= 0, got {list(shape)}")
        if not self.blobs:
            self.blobs.append(Blob(shape))
        top[0].reshape(self.blobs[0].shape)

    def reshape(self, bottom, top):
        top[0].reshape(self.blobs[0].shape)

    def forward(self, bottom, top):
        top[0].data[...] = self.blobs[0].data

    def backward(self, top, propagate_down, bottom):
        if not self.param_propagate_down or self.param_propagate_down[0]:
            self.blobs[0].diff += top[0].diff
