"""cct.formats.pages: a mapped file's pages handed back behind a reader, with
the values unchanged."""
import mmap
import sys

import numpy as np
import pytest

import cct
from cct.formats import pages

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")
PAGE = mmap.PAGESIZE


def mapping_rss_kib(path):
    """The resident KiB of the mapping of `path` in /proc/self/smaps."""
    with open("/proc/self/smaps") as smaps:
        lines = smaps.read().splitlines()
    for index, line in enumerate(lines):
        if line.endswith(str(path)):
            for field in lines[index + 1:]:
                if field.startswith("Rss:"):
                    return int(field.split()[1])
    raise AssertionError(f"{path} is not mapped")


@linux
def test_release_behind_hands_back_the_pages_read_and_the_values_stay(tmp_path):
    path = tmp_path / "values.bin"
    values = np.arange(256 * PAGE // 4, dtype=np.float32)
    path.write_bytes(values.tobytes())
    with open(path, "rb") as handle:
        mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    view = np.frombuffer(mapping, np.float32)
    assert view.sum(dtype=np.float64) == values.sum(dtype=np.float64)      # every page read in
    resident = mapping_rss_kib(path)
    assert resident >= 256 * PAGE // 1024 * 0.9
    behind = pages.ReleaseBehind(mapping)
    behind.done(view[:values.size // 2 + 1])          # half and a little: the partial page stays
    assert mapping_rss_kib(path) <= resident - 127 * PAGE // 1024
    assert behind.released == 128 * PAGE
    behind.done(view[:10])                             # behind what was handed back already: nothing
    behind.done(values[:10])                           # not the mapping's memory: nothing
    assert behind.released == 128 * PAGE
    np.testing.assert_array_equal(view, values)        # read again from the page cache


def test_release_behind_leaves_bytes_alone():
    data = np.arange(4096, dtype=np.float32).tobytes()
    behind = pages.ReleaseBehind(data)
    behind.done(np.frombuffer(data, np.float32))
    assert behind.released == 0


@linux
def test_a_load_hands_back_the_file_as_it_copies(tmp_path, monkeypatch):
    """A net of two 1 MB InnerProduct layers loads the same values, and the
    mapping's pages before the last blob's end are handed back."""
    net_text = """
        name: "two" input: "x" input_shape { dim: 1 dim: 512 }
        layer { name: "a" type: "InnerProduct" bottom: "x" top: "a" inner_product_param { num_output: 512 } }
        layer { name: "b" type: "InnerProduct" bottom: "a" top: "b" inner_product_param { num_output: 512 } }"""
    proto = tmp_path / "two.prototxt"
    proto.write_text(net_text)
    source = cct.Net(str(proto), cct.TEST)
    generator = np.random.default_rng(7)
    for layer in source.layers:
        for blob in layer.blobs:
            blob.data[...] = generator.standard_normal(blob.shape)
    model = tmp_path / "two.caffemodel"
    source.save(str(model))
    released = []
    behind = pages.ReleaseBehind

    def recording(mapping):
        made = behind(mapping)
        released.append(made)
        return made
    monkeypatch.setattr(pages, "ReleaseBehind", recording)
    net = cct.Net(str(proto), cct.TEST, weights=str(model))
    for name in ("a", "b"):
        for mine, theirs in zip(net.params[name], source.params[name]):
            np.testing.assert_array_equal(mine.data, theirs.data)
    assert len(released) == 1 and released[0].released >= model.stat().st_size - 2 * PAGE


def vm_flags(array):
    """The VmFlags of the mapping (/proc/self/smaps) holding the middle of `array`."""
    middle = array.ctypes.data + array.nbytes // 2
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(bound, 16) for bound in head.split("-"))
                inside = low <= middle < high
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError("the array is not mapped")


@linux
def test_a_load_asks_small_pages_for_the_weights(tmp_path):
    """A layer of 8 MiB of weights loads into pages advised small ("nh"),
    its values the file's; a store of the same size not loaded keeps numpy's
    advice (the control: without small_pages the flag is not there)."""
    proto = tmp_path / "big.prototxt"
    proto.write_text("""name: "big" input: "x" input_shape { dim: 1 dim: 2048 }
        layer { name: "a" type: "InnerProduct" bottom: "x" top: "a" inner_product_param { num_output: 1024 } }""")
    source = cct.Net(str(proto), cct.TEST)
    source.params["a"][0].data[...] = np.random.default_rng(3).standard_normal((1024, 2048))
    model = tmp_path / "big.caffemodel"
    source.save(str(model))
    assert "nh" not in vm_flags(source.params["a"][0].data)
    net = cct.Net(str(proto), cct.TEST, weights=str(model))
    assert "nh" in vm_flags(net.params["a"][0].data)
    np.testing.assert_array_equal(net.params["a"][0].data, source.params["a"][0].data)


def test_small_pages_leaves_arrays_under_numpys_huge_page_size_alone():
    array = np.zeros(pages.HUGE_ADVICE_BYTES // 4 - 1, np.float32)
    pages.small_pages(array)                           # nothing to split: a heap's neighbours keep theirs
    if sys.platform.startswith("linux"):
        assert "nh" not in vm_flags(array)


def resident_pages(array):
    """How many of the pages under `array` are resident (mincore)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    start = array.ctypes.data // PAGE * PAGE
    length = array.ctypes.data + array.nbytes - start
    vector = np.zeros(-(-length // PAGE), np.uint8)
    assert libc.mincore(start, length, vector.ctypes.data) == 0, ctypes.get_errno()
    return int((vector & 1).sum())


@linux
def test_fault_in_makes_the_pages_resident_and_leaves_the_values():
    """Fresh anonymous memory (no page resident) and an array with values:
    after the thread, every page is resident and the values are the same."""
    fresh = mmap.mmap(-1, 3 << 20)                         # untouched: the kernel maps it lazily
    untouched = np.frombuffer(fresh, np.float32)
    assert resident_pages(untouched) == 0
    values = np.arange(1 << 19, dtype=np.float32)           # 2 MiB, written
    faulting = pages.FaultIn()
    faulting.add([untouched, values])
    assert faulting.started
    faulting.close()
    faulting.wait()
    assert resident_pages(untouched) == untouched.nbytes // PAGE
    np.testing.assert_array_equal(untouched, 0)
    np.testing.assert_array_equal(values, np.arange(1 << 19, dtype=np.float32))
    faulting.stop()                                          # after it is done: nothing left to stop


@linux
def test_fault_in_takes_small_pages():
    """The thread advises small pages on an array of numpy's huge-page size
    before it faults it in: huge ones, faulted beside the build on these
    VMs, held the building thread's allocations (GoogLeNet's deploy net
    built in 450-650 ms against 220-270; BENCHMARKS.md, "Small pages for
    the blobs faulted in beside the build")."""
    array = np.zeros(pages.HUGE_ADVICE_BYTES // 4 * 2, np.float32)
    assert "nh" not in vm_flags(array)
    faulting = pages.FaultIn()
    faulting.add([array])
    faulting.close()
    faulting.wait()
    spanned = -(-(array.ctypes.data + array.nbytes) // PAGE) - array.ctypes.data // PAGE
    assert "nh" in vm_flags(array)
    assert resident_pages(array) == spanned
    np.testing.assert_array_equal(array, 0)


def test_fault_in_leaves_small_arrays_to_the_forward():
    faulting = pages.FaultIn()
    faulting.add([np.zeros(1024, np.float32)])
    faulting.stop()
    assert not faulting.started


@linux
def test_fault_in_takes_nothing_after_stop():
    """After stop() (a net's first forward), arrays given later are left to
    whoever touches them: no thread starts, no page is faulted in."""
    maps = [mmap.mmap(-1, 4 << 20) for _ in range(3)]
    arrays = [np.frombuffer(m, np.uint8) for m in maps]
    faulting = pages.FaultIn()
    faulting.stop()                                           # before any
    faulting.add(arrays)
    assert not faulting.started and all(resident_pages(array) == 0 for array in arrays)


@linux
def test_a_net_faults_in_its_arena_and_blobs_until_its_first_forward(tmp_path):
    """A TEST net whose blobs and lowering take more than FAULT_IN_BYTES:
    its executor grows the building thread's arena to the memory plan's
    lowering and faults it and the tops in; the first forward stops the
    thread, which never changes an output."""
    from cct.core.workspace import thread_arena
    proto = tmp_path / "conv.prototxt"
    proto.write_text("""
        name: "conv" input: "x" input_shape { dim: 8 dim: 16 dim: 64 dim: 64 }
        layer { name: "c" type: "Convolution" bottom: "x" top: "c"
                convolution_param { num_output: 32 kernel_size: 5 pad: 2 weight_filler { type: "gaussian" std: 0.1 } } }
        layer { name: "r" type: "ReLU" bottom: "c" top: "c" }""")
    thread_arena().clear()
    net = cct.Net(str(proto), cct.TEST)
    executor = net.executor
    planned = executor.memory_plan.workspace(0, "lowering")
    assert planned > 0 and thread_arena().store.size == planned
    assert net.pages.started
    net.pages.wait()                                         # closed by the executor: it ends
    assert resident_pages(net.blobs["c"].data) >= net.blobs["c"].data.nbytes // PAGE
    x = np.random.default_rng(5).standard_normal(net.blobs["x"].shape).astype(np.float32)
    out = net.forward(x=x)["c"].copy()
    assert thread_arena().store.size == planned              # no store grown in the forward
    weight, bias = net.params["c"][0].data, net.params["c"][1].data
    lowered = np.lib.stride_tricks.sliding_window_view(np.pad(x, ((0, 0), (0, 0), (2, 2), (2, 2))), (5, 5), (2, 3))
    expected = np.einsum("nchwij,ocij->nohw", lowered, weight, optimize=True) + bias[:, None, None]
    np.testing.assert_allclose(out, np.maximum(expected, 0), rtol=1e-4, atol=1e-4)
