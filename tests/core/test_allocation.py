"""The memory limit (cct.core.allocation) under the process's own resource
limits: RLIMIT_AS (`ulimit -v`) and RLIMIT_DATA (`ulimit -d`) count what a
process maps, and the kernel refuses a mapping past them (numpy's bare
MemoryError). Each case runs in a child process, which sets the limit on
itself after its imports: the test process keeps its own."""
import json
import subprocess
import sys

import pytest

# Four 1 GiB tops behind an Input (whose top numpy maps and never touches);
# each ReLU has its own top, so the net needs 4 GiB.
NET = """
name: "four_gib"
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 256 dim: 1024 dim: 1024 } } }
layer { name: "a" type: "ReLU" bottom: "x" top: "a" }
layer { name: "b" type: "ReLU" bottom: "a" top: "b" }
layer { name: "c" type: "ReLU" bottom: "b" top: "c" }
"""

CHILD = """
import json, resource, sys, time
import cct
from cct.core.allocation import available, peak_resident_bytes, _status_bytes
limit = getattr(resource, sys.argv[2])
resource.setrlimit(limit, (2 << 30, resource.getrlimit(limit)[1]))
report = {"limit": available()[1]}
start = time.perf_counter()
try:
    cct.Net(sys.argv[1], cct.TEST)
except cct.MemoryLimitError as refused:
    report["refused"] = str(refused)
report.update(seconds=time.perf_counter() - start, peak=peak_resident_bytes(), mapped=_status_bytes("VmSize"))
print(json.dumps(report))
"""


@pytest.mark.parametrize("limit", ["RLIMIT_AS", "RLIMIT_DATA"])
def test_a_net_over_the_process_limit_is_refused_before_it_allocates(tmp_path, limit):
    """Under a 2 GiB limit the 4 GiB net keeps its first top (mapped, within
    the limit) and is refused at its second, in under a second, with the
    limit and the largest stores named; the refused tops are never mapped."""
    path = tmp_path / "net.prototxt"
    path.write_text(NET)
    done = subprocess.run([sys.executable, "-c", CHILD, str(path), limit], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    command = {"RLIMIT_AS": "ulimit -v", "RLIMIT_DATA": "ulimit -d"}[limit]
    assert f"limit of 2 GiB leaves ({limit}, `{command}`" in report["limit"]
    message = report["refused"]
    assert f"{path}: layer 'a' (ReLU): top 'a' of shape (256, 1024, 1024) needs 1 GiB, more than what this " \
           "process's" in message, message
    assert message.endswith("Largest so far: blob 'x' 1 GiB"), message
    assert report["seconds"] < 1.0
    assert report["mapped"] < (2 << 30) and report["peak"] < (1 << 30)


def test_the_smallest_limit_wins():
    """The user's limit (or the machine's memory) and the two process limits:
    whichever leaves the least decides, and says which it is."""
    code = ("import resource, cct; from cct.core.allocation import available;"
            "resource.setrlimit(resource.RLIMIT_DATA, (3 << 30, resource.RLIM_INFINITY));"
            "resource.setrlimit(resource.RLIMIT_AS, (2 << 30, resource.RLIM_INFINITY));"
            "print(available()[1]); cct.set_memory_limit(1 << 30); print(available()[1]);"
            "cct.set_memory_limit(10 << 30); print(available()[1]);"
            "resource.setrlimit(resource.RLIMIT_AS, (5 << 30, resource.RLIM_INFINITY)); print(available()[1])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "(RLIMIT_AS, `ulimit -v`" in lines[0]
    assert lines[1] == "the memory limit of 1 GiB"
    assert "(RLIMIT_AS, `ulimit -v`" in lines[2]
    assert "(RLIMIT_DATA, `ulimit -d`" in lines[3]


def test_a_process_limit_counts_what_is_mapped_beyond_resident():
    """Under RLIMIT_AS the plan's terms (resident memory plus what is to come)
    fit exactly when the address space does: the limit given is the soft
    limit less what is mapped but not resident."""
    code = ("import json, resource; from cct.core.allocation import process_limits, resident_bytes, _status_bytes;"
            "resource.setrlimit(resource.RLIMIT_AS, (3 << 30, resource.RLIM_INFINITY));"
            "[(limit, _)] = process_limits();"
            "print(json.dumps([limit, resident_bytes(), _status_bytes('VmSize')]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    limit, resident, mapped = json.loads(done.stdout)
    # read a moment apart: the mapping may move by a page or two
    assert abs(limit - ((3 << 30) - (mapped - resident))) < 1 << 20
