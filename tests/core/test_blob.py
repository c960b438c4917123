"""Blob: storage kept across reshapes, views, the lazily made diff, sharing."""
import threading
import time

import numpy as np
import pytest

import cct
from cct.core.blob import Blob


def test_shape_count_and_legacy_accessors():
    blob = Blob((2, 3, 4, 5))
    assert blob.shape == (2, 3, 4, 5) and blob.count == 120
    assert (blob.num, blob.channels, blob.height, blob.width) == (2, 3, 4, 5)
    assert blob.count_range(1) == 60 and blob.count_range(1, 3) == 12
    assert blob.canonical_axis(-1) == 3
    short = Blob((7, 2))
    assert (short.num, short.channels, short.height, short.width) == (7, 2, 1, 1)
    with pytest.raises(cct.ShapeError):
        Blob((1, 1, 1, 1, 1)).num
    with pytest.raises(cct.ShapeError):
        blob.canonical_axis(4)
    with pytest.raises(cct.ShapeError):
        Blob((2, -1))


def test_reshape_accepts_ints_or_a_sequence():
    blob = Blob()
    assert blob.shape == () and blob.count == 1
    blob.reshape(2, 3)
    assert blob.shape == (2, 3)
    blob.reshape([4])
    assert blob.shape == (4,)
    blob.reshape_like(Blob((1, 5)))
    assert blob.shape == (1, 5)


def test_data_and_diff_start_at_zero_and_are_writable_views():
    blob = Blob((2, 3))
    assert not blob.data.any() and not blob.diff.any()
    blob.data[0, 1] = 4
    blob.diff = np.arange(6).reshape(2, 3)          # pycaffe-style assignment copies in
    assert blob.data[0, 1] == 4 and blob.diff.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert blob.data.dtype == blob.diff.dtype == np.float32
    assert Blob((2,), np.float64).diff.dtype == np.float64


def test_reshape_to_a_smaller_count_keeps_storage_and_views():
    blob = Blob((4, 3))
    blob.data[...] = np.arange(12).reshape(4, 3)
    blob.diff[...] = 1
    data_view, diff_view = blob.data, blob.diff
    blob.reshape(2, 3)
    assert np.shares_memory(blob.data, data_view) and np.shares_memory(blob.diff, diff_view)
    assert blob.data.tolist() == [[0, 1, 2], [3, 4, 5]]
    blob.reshape(4, 3)                               # back within capacity: same storage, same values
    assert np.shares_memory(blob.data, data_view) and blob.data[3, 2] == 11


def test_reshape_growth_keeps_values():
    blob = Blob((2,))
    blob.data[...] = [1, 2]
    blob.diff[...] = [3, 4]
    blob.reshape(5)
    assert blob.data.tolist() == [1, 2, 0, 0, 0] and blob.diff.tolist() == [3, 4, 0, 0, 0]


def test_diff_storage_is_made_on_first_use_only():
    blob = Blob((1000,))
    assert blob._diff_store is None
    blob.reshape(5000)                               # growth of the data alone
    assert blob._diff_store is None
    blob.data[...] = 1
    assert blob._diff_store is None
    assert not blob.diff.any() and blob.diff.shape == (5000,)
    assert blob._diff_store.size == blob._data_store.size
    blob.reshape(10, 10)                             # views follow the shape from then on
    assert blob.diff.shape == (10, 10) and np.shares_memory(blob.diff, blob._diff_store)


def test_lazy_diff_grows_with_the_data():
    blob = Blob((3,))
    blob.reshape(10)
    blob.diff[...] = 2
    blob.reshape(20)
    assert blob.diff[:10].tolist() == [2] * 10 and not blob.diff[10:].any()


def test_share_data_and_share_diff():
    owner, user = Blob((2, 3)), Blob((3, 2))
    user.share_data(owner)
    owner.data[...] = 7
    assert user.data.shape == (3, 2) and (user.data == 7).all()
    assert user._diff_store is None                  # sharing data does not make a diff
    user.share_diff(owner)                           # makes the owner's diff, then shares it
    assert owner._diff_store is not None
    user.diff[...] = 5
    assert (owner.diff == 5).all()
    with pytest.raises(cct.ShapeError):
        Blob((4,)).share_data(owner)
    with pytest.raises(cct.ShapeError):
        Blob((4,)).share_diff(owner)


def test_sharing_again_keeps_the_layout():
    """A Flatten or Reshape shares its bottom's data and diff at every
    reshape: sharing what is shared already makes no new views, so an
    execution plan (Layout.epoch) survives it."""
    from cct.core.blob import Layout
    owner, user = Blob((2, 3)), Blob((3, 2))
    user.share_data(owner)
    user.share_diff(owner)
    epoch, views = Layout.epoch, (user.data, user.diff)
    user.share_data(owner)
    user.share_diff(owner)
    assert Layout.epoch == epoch and user.data is views[0] and user.diff is views[1]


def test_a_blob_out_of_the_layout_reshapes_without_changing_it():
    from cct.core.blob import Layout
    rows = Blob((1, 1, 1, 7))
    rows.in_layout = False
    epoch = Layout.epoch
    rows.reshape((1, 1, 5, 7))
    assert Layout.epoch == epoch and rows.data.shape == (1, 1, 5, 7)
    epoch = Layout.epoch
    Blob((1, 1, 1, 7)).reshape((1, 1, 5, 7))
    assert Layout.epoch > epoch
    epoch = Layout.epoch
    with Layout.building():                     # a net being built: in no plan yet
        Blob((1, 1, 1, 7)).reshape((1, 1, 5, 7))
        Layout.changed()
    assert Layout.epoch == epoch


def test_building_a_net_keeps_another_nets_plan(tmp_path):
    """A net built after another one made its execution plan leaves that
    plan in use (the new net's blobs and choices are in no plan yet)."""
    path = tmp_path / "net.prototxt"
    path.write_text("""input: "x" input_shape { dim: 2 dim: 3 dim: 8 dim: 8 }
        layer { name: "c" type: "Convolution" bottom: "x" top: "c"
                convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" } } }
        layer { name: "r" type: "ReLU" bottom: "c" top: "c" }""")
    first = cct.Net(str(path), cct.TEST)
    for _ in range(3):
        first.forward()
    plan = first.executor._plan
    assert plan is not None and plan.current(first.executor.settings.version)
    cct.Net(str(path), cct.TEST).forward()
    assert first.executor._plan is plan and plan.current(first.executor.settings.version)


def test_data_placed_in_another_store_and_moved_out_again():
    """use_data_storage (a Concat's bottom in its top's store): the blob's
    data is a view of the store; a reshape past it moves the values to a
    store of the blob's own, leaving a larger diff store as it is;
    own_data_storage copies them out at once."""
    blob = Blob((3, 4))
    blob.diff[...] = 7                                    # a diff store of 12 elements
    blob.reshape(2, 3)
    top = np.zeros(10, np.float32)
    top[2:8] = np.arange(6)
    blob.use_data_storage(top[2:8])
    np.testing.assert_array_equal(blob.data, np.arange(6).reshape(2, 3))
    blob.data[...] += 1
    np.testing.assert_array_equal(top[2:8], np.arange(1, 7))        # written through
    blob.reshape(2, 5)                                    # past the piece, within the diff's store
    assert not np.shares_memory(blob.data, top)
    np.testing.assert_array_equal(blob.data.ravel()[:6], np.arange(1, 7))
    assert blob.diff.shape == (2, 5) and (blob.diff == 7).all()
    blob.reshape(2, 3)
    blob.use_data_storage(top[2:8])
    blob.own_data_storage()
    top[...] = -1
    np.testing.assert_array_equal(blob.data, np.arange(1, 7).reshape(2, 3))
    with pytest.raises(cct.ShapeError, match="cannot hold a blob of count 6"):
        blob.use_data_storage(top[:5])


def test_diff_made_once_when_asked_from_several_threads():
    blob = Blob((64, 1000))
    views = [None] * 8
    barrier = threading.Barrier(8)

    def take(index):
        barrier.wait()
        views[index] = blob.diff
        views[index][index] = index + 1

    threads = [threading.Thread(target=take, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(np.shares_memory(view, blob.diff) for view in views)
    assert blob.diff[:8, 0].tolist() == list(range(1, 9))


class SlowDevice:
    """A device whose buffers are numpy arrays apart from the host's and whose
    download takes 20 ms: long enough for every thread to arrive during one."""
    shares_host = False

    def __init__(self):
        self.downloads = 0

    def empty(self, count):
        return np.zeros(count, np.float32)

    def upload(self, buffer, host):
        buffer[:host.size] = host

    def download(self, buffer, host):
        self.downloads += 1
        time.sleep(0.02)
        host[...] = buffer[:host.size]

    def fill(self, buffer, value, count):
        buffer[:count] = value


@pytest.mark.parametrize("store", ["data", "diff"])
def test_a_store_a_device_is_ahead_with_comes_down_once_for_several_threads(store):
    """The update's race (issue 37): threads that ask for a store at once
    while a device is ahead with it get it copied down once; each then
    updates its own part, and no later copy overwrites what one has begun."""
    blob, device = Blob((8, 1000)), SlowDevice()
    written = blob.mutable_device_data(device) if store == "data" else blob.mutable_device_diff(device)
    written[:] = 1.0                                     # the device is ahead: the host holds zeros
    barrier = threading.Barrier(8)

    def update(row):
        barrier.wait()
        getattr(blob, store)[row] += row                 # each thread its own row, as the update's stripes

    threads = [threading.Thread(target=update, args=(row,)) for row in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert device.downloads == 1
    np.testing.assert_array_equal(getattr(blob, store)[:, 0], 1.0 + np.arange(8))


# --- arrays too large are refused before numpy allocates (issue 15) -------------------
def test_a_blob_larger_than_the_limit_is_refused_before_it_is_allocated(memory_limit):
    memory_limit(16 << 30)
    with pytest.raises(cct.core.errors.MemoryLimitError,
                       match=r"^blob of shape \(64, 1000000000\) needs 238 GiB, more than the memory limit of 16 GiB"):
        Blob((64, 10**9))


def test_a_shape_whose_count_overflows_int64_is_refused_not_wrapped(memory_limit):
    with pytest.raises(cct.core.errors.MemoryLimitError, match="needs"):
        Blob((10**10, 10**10, 10**10))
    memory_limit(1 << 20)
    blob = Blob((512, 512))                   # 1 MiB: at the limit, allowed
    with pytest.raises(MemoryError, match=r"of shape \(513, 512\) needs 1.002 MiB, more than the memory limit of 1 MiB"):
        blob.reshape(513, 512)
    assert blob.shape == (512, 512)           # a refused reshape leaves the blob as it was


def test_an_empty_shape_numpy_cannot_index_is_refused_too():
    """Found by the fuzzer: a blob of 0 elements whose other axes multiply past
    2^63 passed the size check and failed in numpy's reshape (ValueError)."""
    with pytest.raises(cct.core.errors.MemoryLimitError, match="too large for numpy"):
        Blob((8791026472627208191, 1, 3, 0, 5))
    assert Blob((2**30, 0, 2**30)).count == 0              # large axes around an empty one: allowed


def test_another_nets_reshape_keeps_a_nets_plan(tmp_path):
    """A net reshaped at every forward (a classifier fed each frame's face
    count) changes its own layout epoch, not the one another net's plan is
    bound to; a net's own reshape still makes its plan stale."""
    path = tmp_path / "net.prototxt"
    path.write_text("""input: "x" input_shape { dim: 2 dim: 3 dim: 8 dim: 8 }
        layer { name: "c" type: "Convolution" bottom: "x" top: "c"
                convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" } } }
        layer { name: "r" type: "ReLU" bottom: "c" top: "c" }""")
    detector, classifier = cct.Net(str(path), cct.TEST), cct.Net(str(path), cct.TEST)
    for _ in range(3):
        detector.forward()
    plan, version = detector.executor._plan, detector.executor.settings.version
    assert plan is not None and plan.current(version)
    for faces in (1, 3, 2):
        classifier.blobs["x"].reshape(faces, 3, 8, 8)
        classifier.forward()
        before = detector.forward()["c"].copy()
        assert detector.executor._plan is plan and plan.current(version)
        np.testing.assert_array_equal(detector.forward()["c"], before)
    detector.blobs["x"].reshape(1, 3, 8, 8)
    assert not plan.current(version)
    assert detector.forward()["c"].shape == (1, 4, 6, 6)
