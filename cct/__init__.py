"""cct: Caffe con Troll in Python. A Caffe-compatible CNN framework whose
Python API mirrors pycaffe name for name (`import cct as caffe`)."""
from .blob import Blob
from .errors import CctError, ConfigError, DataError, ShapeError, WeightsError
from .layer import TEST, TRAIN, Layer, layer_type_list, register
from .net import Net
from .rng import set_random_seed

__version__ = "0.1.0"


def set_mode_cpu():
    """cct runs on the CPU unless a layer is given an OpenCL device."""


def set_device(device_id):
    """Kept for pycaffe scripts; device selection happens per run configuration."""
