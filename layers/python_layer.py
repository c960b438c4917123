"""Python layers: type "Python", a layer written by the user in Python (Caffe's
PythonLayer, pycaffe's caffe.Layer). Loading a net with one imports the module
it names and runs its code, as Caffe does: a prototxt is trusted like a script
(README, "Trust boundary"), and every import is logged with the module's file."""
import importlib
import logging
import traceback

from cct.core.blob import Blob
from cct.core.layer import TRAIN, Layer, register

log = logging.getLogger("cct.layers.python_layer")


class BlobVec(list):
    """A layer's learnable blobs as pycaffe shows them to Python layers: a list
    of Blobs with add_blob(*shape) appending a new float32 Blob of that shape."""

    def add_blob(self, *shape):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        self.append(Blob(shape))


def _import_user_module(probe, name):
    """Import the layer's module. A module that is not on the path is the path's
    fault; one that fails while importing shows its own exception and line."""
    try:
        return importlib.import_module(name)
    except Exception as error:
        raise probe.config_error("python_param.module", _import_failure(name, error)) from error


def _import_failure(name, error):
    missing = getattr(error, "name", None) if isinstance(error, ModuleNotFoundError) else None
    if missing is not None and (name == missing or name.startswith(missing + ".")):
        return f"cannot import module '{name}' ({error}); is its folder on PYTHONPATH?"
    text = f"module '{name}' failed to import: {type(error).__name__}: {error}{_raised_at(error)}"
    if missing == "caffe":
        text += ("; the name `caffe` is cct's alias, installed with cct (caffe.py) and turned off by "
                 "CCT_CAFFE_ALIAS=0")
    return text


def _raised_at(error):
    """` (at file:line)` of the innermost frame the exception passed, outside importlib."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__)
              if "importlib" not in frame.filename and frame.filename != __file__]
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


@register("Python")
class PythonLayer(Layer):
    """python_param { module: "m" layer: "C" param_str: "..." share_in_parallel }

    Imports module `m` (from the Python path) and makes an instance of its class
    `C`, which must subclass cct.Layer and override setup/reshape/forward/backward
    (with pycaffe's signatures). Constructing a PythonLayer returns that instance,
    built like pycaffe builds it (`C(layer_param)`), with `param_str` (a str;
    also as `param_str_`, older pycaffe's name, which py-faster-rcnn reads),
    `phase` (cct.TRAIN/TEST), `type` "Python" and `blobs` a BlobVec set. Bottom
    and top counts are the user class's own (its exact_bottoms... attributes).
    share_in_parallel is accepted and has no effect (cct trains in one process).
    A Python layer is a loss only where the prototxt gives it a loss_weight.
    """

    def __new__(cls, layer_param, phase=TRAIN, source=None):
        probe = Layer(layer_param, phase, source)          # for its error helpers
        python_param = layer_param.python_param
        if not python_param.module:
            raise probe.config_error("python_param.module", "missing: name the Python module of the layer")
        if not python_param.layer:
            raise probe.config_error("python_param.layer", "missing: name the layer class in module "
                                     f"'{python_param.module}'")
        module = _import_user_module(probe, python_param.module)
        log.info("%s: runs Python code: imported module '%s' (%s) for class '%s'", probe.where(),
                 python_param.module, getattr(module, "__file__", None) or "built in", python_param.layer)
        user_class = getattr(module, python_param.layer, None)
        if user_class is None:
            raise probe.config_error("python_param.layer", f"module '{python_param.module}' "
                                     f"({getattr(module, '__file__', '?')}) has no class '{python_param.layer}'")
        if not (isinstance(user_class, type) and issubclass(user_class, Layer)):
            raise probe.config_error("python_param.layer", f"'{python_param.module}.{python_param.layer}' "
                                     "must be a class derived from cct.Layer (pycaffe: caffe.Layer)")
        layer = user_class(layer_param)
        layer.phase = phase
        layer.source = source
        layer.type = "Python"
        layer.param_str = python_param.param_str
        layer.param_str_ = python_param.param_str          # older pycaffe's name, which py-faster-rcnn reads
        if not isinstance(layer.blobs, BlobVec):
            layer.blobs = BlobVec(layer.blobs)
        return layer
