"""Loading another test file as a module. pytest runs with --import-mode=importlib,
so test files cannot import each other by name; conftest.py puts this folder on
sys.path so that they can import this helper."""
import importlib.util
import sys
from pathlib import Path


def load_sibling(name):
    """tests/<name>.py as a module: the one pytest already loaded, if any, so its
    test-only layer registrations run once."""
    path = str(Path(__file__).with_name(f"{name}.py"))
    for module in list(sys.modules.values()):
        if getattr(module, "__file__", None) == path:
            return module
    spec = importlib.util.spec_from_file_location(f"cct_tests_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
