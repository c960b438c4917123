"""Which module the name `caffe` gives in this process: a real pycaffe, or cct.

cct installs a one-file module `caffe` beside itself (caffe.py at the top of the
repository) so that pycaffe client code (Python layers, Caffe's detect.py,
notebooks) runs unchanged. A real pycaffe is always a package (a `caffe/` folder),
so it is told apart from that alias without importing it; the alias asks
`real_pycaffe()` first and steps aside for one anywhere on sys.path: earlier on
the path it wins anyway, later on the path (cct in a virtualenv, Caffe from
the system's packages) the alias loads it. `CCT_CAFFE_ALIAS=0` turns the alias
off. `caffe_import()` is the line `cct device_query` and `cct train` print.
Standard library only: the alias imports this before it decides."""
import importlib.machinery
import importlib.util
import os
import sys

ALIAS_ENV = "CCT_CAFFE_ALIAS"
ALIAS_MARK = "__cct_alias__"          # a name only cct's caffe.py defines: how a file is known as the alias


def alias_enabled():
    """False when the caffe_alias knob (CCT_CAFFE_ALIAS) says 0/off/false/no."""
    from cct.core import settings
    return settings.value("caffe_alias")


def _alias_source():
    from cct.core import settings
    source = settings.source_value("caffe_alias")[0]
    return f"{ALIAS_ENV}=0" if source == "environment" else "by a call"


def real_pycaffe():
    """The spec of the first `caffe` package (a folder with __init__.py) on
    sys.path, or None. One entry at a time: the alias module may sit in an
    earlier entry, and a whole-path search would stop at it."""
    for entry in list(sys.path):
        spec = importlib.machinery.PathFinder.find_spec("caffe", [entry])
        if spec is not None and spec.origin and spec.submodule_search_locations is not None:
            return spec
    return None


def caffe_import():
    """One line saying what `import caffe` gives here, without importing a real pycaffe."""
    loaded = sys.modules.get("caffe")
    if loaded is not None:
        return _describe_loaded(loaded)
    real = real_pycaffe()
    if real is not None:
        return f"pycaffe at {os.path.dirname(real.origin)} (Caffe's own: code that imports caffe does not get cct)"
    if not alias_enabled():
        return f"no module named 'caffe' (cct's alias is turned off: {_alias_source()})"
    spec = importlib.util.find_spec("caffe")
    if spec is None:
        return "no module named 'caffe' (cct's alias is not installed: pip install cct)"
    if _is_alias_file(spec.origin):
        return f"cct, through its alias {spec.origin}"
    return f"a module that is neither pycaffe nor cct's alias: {spec.origin}"


def _describe_loaded(module):
    version = getattr(module, "__cct_version__", None)
    if version is not None:
        return f"cct {version}, through its alias {getattr(module, ALIAS_MARK, '?')}"
    return f"pycaffe at {os.path.dirname(getattr(module, '__file__', '') or '?')} (loaded; not cct)"


def _is_alias_file(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as source:
            return ALIAS_MARK in source.read(4096)
    except (OSError, TypeError):
        return False
