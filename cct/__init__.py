"""cct: Caffe con Troll in Python. A Caffe-compatible CNN framework whose
Python API mirrors pycaffe name for name (`import cct as caffe`)."""
from cct.core import allocation
from cct.core.blob import Blob
from cct.core.errors import CctError, ConfigError, DataError, MemoryLimitError, ShapeError, WeightsError
from cct.core.layer import TEST, TRAIN, Layer, layer_type_list, register
from cct.core.net import Net
from cct.core.rng import set_random_seed
from cct import pycaffe  # noqa: F401  (attaches forward_all, set_input_arrays, callbacks to Net)
from cct.pycaffe import (Timer, NCCL, has_nccl, solver_count, set_solver_count, solver_rank, set_solver_rank,
                         set_multiprocess, init_log, log)
from cct import io
from cct.classifier import Classifier
from cct.detector import Detector
# pycaffe's `layers as L` is cct.layers itself: the subpackage of layer families
# resolves capitalized names to NetSpec layer factories (see layers/__init__.py).
from cct.net_spec import params, NetSpec, to_proto
from cct.training.solver import get_solver
from cct.training.updates import (SGDSolver, NesterovSolver, AdaGradSolver, RMSPropSolver, AdaDeltaSolver,
                                  AdamSolver)
from cct import layers  # noqa: E402  (registers every layer type)

# pycaffe's names, and cct's own beside them (`from cct import *` as from pycaffe's caffe).
__all__ = [
    "Blob", "Layer", "Net", "TEST", "TRAIN", "layer_type_list", "register", "set_random_seed",
    "CctError", "ConfigError", "DataError", "MemoryLimitError", "ShapeError", "WeightsError",
    "Timer", "NCCL", "has_nccl", "solver_count", "set_solver_count", "solver_rank", "set_solver_rank",
    "set_multiprocess", "init_log", "log", "io", "dnn", "Classifier", "Detector", "params", "NetSpec",
    "to_proto", "layers", "get_solver", "SGDSolver", "NesterovSolver", "AdaGradSolver", "RMSPropSolver",
    "AdaDeltaSolver", "AdamSolver", "set_mode_cpu", "set_mode_gpu", "set_device", "set_schedule", "set_fusion",
    "set_memory_limit", "allocation", "__version__",
    "pycaffe", "classifier", "detector", "net_spec", "proto",     # the submodules pycaffe's package binds
]


def __getattr__(name):
    """cct.dnn (OpenCV 4's Caffe API) on first use: it imports OpenCV, 20 ms
    that every `import cct` would otherwise pay."""
    if name == "dnn":
        import importlib
        return importlib.import_module("cct.dnn")
    raise AttributeError(f"module 'cct' has no attribute {name!r}")
__version__ = "0.1.0"
# Says "cct" where client code wrote `import caffe` (cct's alias, caffe.py): pycaffe has no such name.
__cct_version__ = __version__


def set_mode_cpu():
    """Layers run on the host (the default)."""
    from cct.runtime import settings
    settings.set_mode("cpu")


def set_mode_gpu():
    """Layers run on the OpenCL device of set_device (device 0 unless set;
    `cct device_query` lists them), each with its device path where it has
    one, else on the host with its blobs synced (cct.runtime.executor)."""
    from cct.runtime import settings
    settings.set_mode("gpu")


def set_schedule(mode):
    """cct's extension: how nets made from now on train, "sequential", "streams",
    "tuned" or "auto" (None: back to the run configuration / CCT_SCHEDULE / "auto"); what
    `cct train --schedule` sets (cct.runtime.settings, cct.runtime.scheduler)."""
    from cct.runtime import settings
    settings.set_schedule(mode)


def set_fusion(enabled):
    """cct's extension: whether TEST-phase nets built from now on run chains
    of BatchNorm, Scale, ReLU, Eltwise sums as one pass and Split tops as
    aliases (None: back to the run configuration / CCT_FUSION / on;
    cct.runtime.fusion)."""
    from cct.runtime import settings
    settings.set_fusion(enabled)


def set_memory_limit(nbytes):
    """cct's extension: refuse nets whose planned peak, and arrays, exceed
    `nbytes` (None: the machine's memory); what `--memory_limit` sets.
    Returns the previous limit (cct.core.allocation, cct.runtime.memory_plan)."""
    return allocation.set_memory_limit(nbytes)


def set_device(device_id):
    """The OpenCL device id set_mode_gpu runs on (`cct device_query`'s list)."""
    from cct.runtime import settings
    settings.set_device_id(device_id)
