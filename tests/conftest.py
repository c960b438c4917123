"""Test-wide settings and fixtures. pytest runs with -n 2 on a 2-core machine:
one BLAS thread per worker, so two workers' GEMMs do not oversubscribe the
cores (OpenBLAS threads busy-wait, and a preempted one stalls the whole GEMM).
The lowering chooser's cache goes to a temporary folder. This folder is put on
sys.path so that test files can import the shared code in tests/helpers
(`from helpers.linreg import make_solver`); test files never import each other."""
import atexit
import os
import shutil
import sys
import tempfile

import numpy  # noqa: F401  (loads numpy's OpenBLAS: threadpoolctl limits only loaded libraries)
import scipy.linalg  # noqa: F401  (and scipy's, which cct's image resizing loads later)
import pytest
from threadpoolctl import threadpool_limits

threadpool_limits(limits=1, user_api="blas")
# The lowering chooser caches machine constants; keep tests off ~/.cache, in a
# folder the process that made it removes at its end (xdist's workers inherit it).
if "CCT_CACHE_DIR" not in os.environ:
    os.environ["CCT_CACHE_DIR"] = tempfile.mkdtemp(prefix="cct-cache-")
    atexit.register(shutil.rmtree, os.environ["CCT_CACHE_DIR"], ignore_errors=True)
# The two workers are each other's "other process": a net's thread count must not
# follow them (cct.runtime.cores); tests/runtime/test_cores.py turns it on.
os.environ.setdefault("CCT_FIT_CORES", "0")
sys.path.insert(0, os.path.dirname(__file__))

from helpers.requirements import missing, require  # noqa: E402  (needs the path above)

# Markers (setup.cfg) whose tests need packages beyond cct's own.
NEEDS = ("opencl", "mpi")


def pytest_report_header(config):
    """One line per marker whose packages are missing: its tests will skip."""
    return [f"{need} tests: missing {missing(need)}" for need in NEEDS if missing(need)]


@pytest.fixture(autouse=True)
def explicit_settings():
    """What a test sets by calls (set_mode_gpu, --gpu, set_schedule, load)
    ends with it (cct.core.settings.restoring)."""
    from cct.core.settings import restoring
    with restoring():
        yield


def pytest_runtest_setup(item):
    for need in NEEDS:
        if item.get_closest_marker(need):
            require(need)


@pytest.fixture(params=[1, 2], ids=lambda p: f"partitions{p}")
def partitions(request, monkeypatch):
    """Batch partitioning of the nets the test builds, through CCT_PARTITIONS:
    at p > 1 every layer that allows it runs as p batch partitions in parallel,
    at 1 every layer runs whole. A test asking for this fixture runs at 1 and 2;
    `@pytest.mark.parametrize("partitions", [p], indirect=True)` picks others."""
    from cct.runtime.settings import PARTITIONS_ENV
    monkeypatch.setenv(PARTITIONS_ENV, str(request.param))
    return request.param


@pytest.fixture(params=["sequential", "streams"])
def schedule(request, monkeypatch):
    """The backward schedule of the nets the test builds, through CCT_SCHEDULE:
    layer after layer, or as sub-tasks on streams (cct.runtime.scheduler)."""
    from cct.runtime.settings import SCHEDULE_ENV
    monkeypatch.setenv(SCHEDULE_ENV, request.param)
    return request.param


@pytest.fixture
def one_lowering_type(monkeypatch):
    """Every convolution on lowering type 1, for tests that compare runs which
    must take the same arithmetic: the chooser's pick can change within a
    process (another test recalibrates it), and the types sum in other orders."""
    from cct.runtime.settings import LOWERING_ENV
    monkeypatch.setenv(LOWERING_ENV, "1")


@pytest.fixture
def one_arithmetic(monkeypatch):
    """Every convolution on lowering type 1 and none on Winograd: for a whole
    detector compared with OpenCV 4 on an image whose priors tie within
    rounding (res10 on a flat image), where the rounding decides which of two
    overlapping boxes NMS keeps. Under a loaded CI host the chooser once put
    res10's layers on type 3 or Winograd F(4, 3), and NMS kept another box
    (with either forced, the flat image fails here too)."""
    from cct.runtime.settings import LOWERING_ENV, WINOGRAD_ENV
    monkeypatch.setenv(LOWERING_ENV, "1")
    monkeypatch.setenv(WINOGRAD_ENV, "0")


@pytest.fixture
def memory_limit():
    """cct.core.blob.set_memory_limit, the process's own limit restored after
    the test: `memory_limit(16 << 30)` refuses any one array above 16 GiB,
    whatever the machine has (a test machine may have more than a test asks)."""
    from cct.core.allocation import set_memory_limit
    previous = set_memory_limit(None)
    set_memory_limit(previous)
    yield set_memory_limit
    set_memory_limit(previous)
