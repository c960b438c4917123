"""cct.runtime.partition: a BlobSlice is a fixed view of its blob's batch rows.
Partitioned runs against whole ones are in test_executor.py."""
import pytest

import cct
from cct.runtime.partition import BlobSlice


def test_blob_slice_is_a_fixed_view():
    blob = cct.Blob((4, 2))
    view = BlobSlice(blob, 1, 3)
    view.data[...] = 5
    assert blob.data[1:3].tolist() == [[5, 5], [5, 5]] and blob.data[0].tolist() == [0, 0]
    view.reshape(2, 2)
    with pytest.raises(cct.ShapeError):
        view.reshape(4, 2)
