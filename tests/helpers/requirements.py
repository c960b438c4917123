"""What a test needs beyond cct itself, and what to install for it. A test
whose needs are missing skips with one reason that names the packages,
the same for every such test (so `-rs` folds them into one line); under
CI=true it fails instead: CI installs everything (tools/setup.sh --test),
and a skip there would hide a missing install step.

The `opencl` and `mpi` markers ask for these in tests/conftest.py; a test
that needs a package only in one of its cases calls `require` itself."""
import importlib.util
import os
import shutil

import pytest

SETUP = "bash tools/setup.sh --test"
# What tools/setup.sh --test downloads beside the venv: the forks' references.
REFERENCES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          ".venv", "test-references")


def reference_path(variable, name, fallback):
    """The environment's `variable`, else REFERENCES/name where setup put it, else `fallback`."""
    if os.environ.get(variable):
        return os.environ[variable]
    path = os.path.join(REFERENCES, name)
    return path if os.path.exists(path) else fallback


def _modules(*names):
    return [name for name in names if importlib.util.find_spec(name) is None]


def _programs(*names):
    return [name for name in names if shutil.which(name) is None]


def _opencl():
    """The apt packages and pip extras missing for the OpenCL tests, or None."""
    missing = _modules("pyopencl", "pyclblast")
    if missing:
        return f"Python packages {', '.join(missing)} (pip install -e '.[opencl]', after apt-get install " \
               "pocl-opencl-icd ocl-icd-opencl-dev libclblast-dev g++)"
    from cct.devices import opencl
    reason = opencl.why_unavailable()
    return f"an OpenCL device: {reason}" if reason else None


def _mpi():
    if _programs("mpirun"):
        return "mpirun (apt-get install openmpi-bin libopenmpi-dev)"
    if _modules("mpi4py"):
        return "Python package mpi4py (pip install -e '.[mpi]', after apt-get install libopenmpi-dev)"
    return None


def _module(name, extra):
    return lambda: f"Python package {name} (pip install -e '.[{extra}]')" if _modules(name) else None


def _program(*names_and_packages):
    """[(program, the apt package that has it)]: a check for all of them."""
    def check():
        lacking = [(name, package) for name, package in names_and_packages if _programs(name)]
        if lacking:
            return f"{', '.join(name for name, _ in lacking)} (apt-get install " \
                   f"{' '.join(package for _, package in lacking)})"
        return None
    return check


CHECKS = {
    "opencl": _opencl,
    "mpi": _mpi,
    "two hosts": _program(("ip", "iproute2"), ("unshare", "util-linux")),
    "graphviz": _program(("dot", "graphviz")),
    "pydot": _module("pydot", "draw"),
    "plyvel": _module("plyvel", "leveldb"),
    "matplotlib": _module("matplotlib", "plot"),
    "grpc_tools": _module("grpc_tools", "test"),
    "ruff": _module("ruff", "test"),
    "mypy": _module("mypy", "test"),
}
_found = {}


def missing(need):
    """What is missing for `need` (a key of CHECKS), in words, or None."""
    if need not in _found:
        _found[need] = CHECKS[need]()
    return _found[need]


def skip_or_fail(reason):
    """Skip with `reason`, or under CI=true fail with it."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI=true: every test must run ({SETUP} installs everything)", pytrace=False)
    pytest.skip(reason)


def require(need):
    """Skip (or under CI=true fail) the calling test when `need` is missing."""
    reason = missing(need)
    if reason:
        skip_or_fail(f"{need} tests need {reason}")
