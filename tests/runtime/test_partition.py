"""cct.runtime.partition: a BlobSlice is a fixed view of its blob's batch rows;
a partition without samples is skipped. Partitioned runs against whole ones
are in test_executor.py."""
import numpy as np
import pytest

import cct
from cct.runtime.partition import BlobSlice, PartitionedLayer
from cct.runtime.threads import workers


def test_blob_slice_is_a_fixed_view():
    blob = cct.Blob((4, 2))
    view = BlobSlice(blob, 1, 3)
    view.data[...] = 5
    assert blob.data[1:3].tolist() == [[5, 5], [5, 5]] and blob.data[0].tolist() == [0, 0]
    view.reshape(2, 2)
    with pytest.raises(cct.ShapeError):
        view.reshape(4, 2)


@pytest.mark.parametrize("ask", ["device_data", "mutable_device_data", "device_diff", "mutable_device_diff"])
def test_a_blob_slice_refuses_a_device_by_name(ask):
    """A partition's view lives on the host: any device buffer asked of it,
    written or read, is refused with HostOnly's message (Blob passes upload=
    to written_on, which must take it)."""
    view = BlobSlice(cct.Blob((4, 2)), 1, 3)
    with pytest.raises(RuntimeError, match="lives on the host"):
        getattr(view, ask)(object())


def test_partitions_without_samples_are_skipped():
    """More partitions than samples (the executor never asks for that): the
    empty ones run nothing, the others give the whole layer's numbers."""
    net = cct.Net('''layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }
                     layer { name: "relu" type: "ReLU" bottom: "data" top: "out" }''', cct.TEST)
    net.blobs["data"].data[...] = np.arange(-3, 3).reshape(2, 3)
    runner = PartitionedLayer(net.layers[1], 4)
    ran = []
    for index, clone in enumerate(runner.clones):
        clone.forward = lambda bottom, top, index=index, run=clone.forward: ran.append(index) or run(bottom, top)
    runner.forward(workers(4), net.bottom_vecs[1], net.top_vecs[1])
    assert len(ran) == 2 and net.blobs["out"].data.tolist() == [[0, 0, 0], [0, 1, 2]]
    assert runner._bounds(2) == [(0, 0), (0, 1), (1, 1), (1, 2)] and runner._bounds(7)[-1] == (5, 7)
