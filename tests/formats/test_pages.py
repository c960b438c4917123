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
