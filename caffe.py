"""`import caffe` answered by cct, so that pycaffe client code runs unchanged:
Python layers (`import caffe`, `class L(caffe.Layer)`), Caffe's detect.py and
classify.py, notebooks (`from caffe import layers as L, params as P`,
`from caffe.proto import caffe_pb2`, `import caffe.io`).

Installed beside cct as a one-file module. `caffe` becomes the cct package
itself and `caffe.io`, `caffe.proto.caffe_pb2`, `caffe.net_spec`, ... are
cct's own module objects (`caffe.Net is cct.Net`), never second copies.
`caffe.__cct_version__` says cct answered.

A built pycaffe (a `caffe/` package holding its `_caffe` extension) anywhere
on sys.path wins: cct_caffe_finder, first on sys.meta_path from start-up, gives
it without running this module; without that finder (python -S, an install made
before it) this module loads it (cct.core.caffe_name.real_pycaffe). Otherwise
`caffe` is cct, standing in for a `caffe/` package without `_caffe` (BVLC's
source tree, never built: one line on stderr says so) and passing over a
`caffe/` folder without __init__.py (data files only).
Turn the alias off with CCT_CAFFE_ALIAS=0: `import caffe` then fails as if
cct had not installed it (an unbuilt tree on the path fails on its `_caffe`).
"""
import importlib
import importlib.abc
import importlib.util
import sys

from cct.core import caffe_name

__cct_alias__ = __file__             # marks this file as cct's alias (caffe_name.ALIAS_MARK)


class CctSubmodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers `import caffe.X.Y` with the module cct.X.Y while `caffe` is cct,
    for the modules not yet loaded when the alias was made: without it, Python
    would load cct's file a second time as a new module named caffe.X.Y."""

    def __init__(self, package):
        self.package = package
        self.original_specs = {}

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("caffe.") or sys.modules.get("caffe") is not self.package:
            return None
        if importlib.util.find_spec("cct" + fullname[len("caffe"):]) is None:
            return None                  # Python's own "No module named 'caffe.x'"
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module("cct" + spec.name[len("caffe"):])
        self.original_specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module):
        # The import system stamped our spec on cct's module: give it its own back.
        module.__spec__ = self.original_specs.pop(module.__spec__.name)


def _alias_cct():
    import cct
    import cct.coord_map  # noqa: F401  (pycaffe's modules that cct's __init__ does not import)
    import cct.draw  # noqa: F401
    import cct.proto.caffe_pb2  # noqa: F401
    cct.__cct_alias__ = __file__
    for name, module in list(sys.modules.items()):
        if name.startswith("cct."):
            sys.modules["caffe" + name[len("cct"):]] = module
    sys.meta_path.insert(0, CctSubmodules(cct))
    return cct


def _load_real(spec):
    module = importlib.util.module_from_spec(spec)
    sys.modules[__name__] = module
    spec.loader.exec_module(module)
    return module


def _turned_off():
    unbuilt = caffe_name.unbuilt_pycaffe()
    if unbuilt is not None:
        return _load_real(unbuilt)       # fails on its _caffe, as it would without cct
    raise ModuleNotFoundError(f"No module named 'caffe' (cct's alias is turned off by "
                              f"{caffe_name.ALIAS_ENV}=0)", name="caffe")


def _stand_in():
    unbuilt = caffe_name.unbuilt_pycaffe()
    module = _alias_cct()
    if unbuilt is not None:
        print(caffe_name.stand_in_line(unbuilt), file=sys.stderr)
    return module


_real = caffe_name.real_pycaffe()
if _real is not None:
    _load_real(_real)
elif not caffe_name.alias_enabled():
    _turned_off()
else:
    sys.modules[__name__] = _stand_in()
