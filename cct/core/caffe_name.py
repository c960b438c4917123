"""Which module the name `caffe` gives in this process: a real pycaffe, or cct.

cct installs a one-file module `caffe` beside itself (caffe.py at the top of the
repository) so that pycaffe client code (Python layers, Caffe's detect.py,
notebooks) runs unchanged, and a finder (cct_caffe_finder.py, put first on
sys.meta_path at start-up by the .pth both install kinds write) that decides
which `caffe` an import gives before Python's own path search. A built pycaffe
(a `caffe` package holding its `_caffe` extension) anywhere on sys.path wins;
otherwise cct answers, standing in for an unbuilt one (BVLC's source tree) and
passing over a `caffe` folder without __init__.py. `CCT_CAFFE_ALIAS=0` turns
the alias off. `caffe_import()` is the line `cct device_query` and `cct train`
print. Standard library only: the alias imports this before it decides."""
import importlib.util
import os
import sys
from importlib.abc import Loader
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any, Optional, cast

ALIAS_ENV = "CCT_CAFFE_ALIAS"
ALIAS_MARK = "__cct_alias__"          # a name only cct's caffe.py defines: how a file is known as the alias


def alias_enabled() -> bool:
    """False when the caffe_alias knob (CCT_CAFFE_ALIAS) says 0/off/false/no."""
    from cct.core import settings
    return settings.value("caffe_alias")


def _alias_source() -> str:
    from cct.core import settings
    source = settings.source_value("caffe_alias")[0]
    return f"{ALIAS_ENV}=0" if source == "environment" else "by a call"


def finder() -> ModuleType:
    """The module cct_caffe_finder (beside cct): by name, or by its path where an
    editable install made before that module existed maps no such name."""
    try:
        import cct_caffe_finder
    except ModuleNotFoundError:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "cct_caffe_finder.py")
        # (a file's spec, with its loader: never None)
        spec = cast(ModuleSpec, importlib.util.spec_from_file_location("cct_caffe_finder", os.path.normpath(path)))
        cct_caffe_finder = importlib.util.module_from_spec(spec)
        cast(Loader, spec.loader).exec_module(cct_caffe_finder)
        sys.modules["cct_caffe_finder"] = cct_caffe_finder
    return cct_caffe_finder


def real_pycaffe() -> Optional[ModuleSpec]:
    """The spec of the first built pycaffe (a `caffe` package holding `_caffe`) on sys.path, or None."""
    return finder().resolve()[0]


def unbuilt_pycaffe() -> Optional[ModuleSpec]:
    """The spec of the first `caffe` package without `_caffe` on sys.path (BVLC's
    source tree, never built), where no built one is on it; else None."""
    return finder().resolve()[1]


def stand_in_line(unbuilt: ModuleSpec) -> str:
    """The one stderr line cct's alias writes when it answers in place of an unbuilt tree."""
    return (f"import caffe: cct stands in for Caffe's {os.path.dirname(cast(str, unbuilt.origin))}, "
            f"which has no built {finder().BUILT_MODULE} extension (`make pycaffe` builds it)")


def caffe_import() -> str:
    """One line saying what `import caffe` gives here, without importing a real pycaffe."""
    loaded = sys.modules.get("caffe")
    if loaded is not None:
        return _describe_loaded(loaded)
    real = real_pycaffe()
    if real is not None:
        return (f"pycaffe at {os.path.dirname(cast(str, real.origin))} (Caffe's own: code that imports caffe does "
                "not get cct)")
    if not alias_enabled():
        return f"no module named 'caffe' (cct's alias is turned off: {_alias_source()})"
    spec = importlib.util.find_spec("caffe")
    if spec is None:
        return "no module named 'caffe' (cct's alias is not installed: pip install cct)"
    if _is_alias_file(spec.origin):
        unbuilt = unbuilt_pycaffe()
        standing_in = f" (standing in for {os.path.dirname(cast(str, unbuilt.origin))}: not built)" if unbuilt else ""
        return f"cct, through its alias {spec.origin}{standing_in}"
    return f"a module that is neither pycaffe nor cct's alias: {spec.origin}"


def _describe_loaded(module: ModuleType) -> str:
    version = getattr(module, "__cct_version__", None)
    if version is not None:
        return f"cct {version}, through its alias {getattr(module, ALIAS_MARK, '?')}"
    return f"pycaffe at {os.path.dirname(getattr(module, '__file__', '') or '?')} (loaded; not cct)"


def _is_alias_file(path: Any) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as source:
            return ALIAS_MARK in source.read(4096)
    except (OSError, TypeError):
        return False
