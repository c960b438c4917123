"""Every file cct writes for keeps (weights, snapshots, means, plots, LMDBs, the
lowering cache) goes through cct.formats.prototxt.atomic_path: the new file is
fsynced before it is renamed over the old one and its folder is fsynced after,
and a failed write leaves the old file as it was and no temporary behind."""
import os

import h5py
import numpy as np
import pytest

import cct
from cct.formats.prototxt import atomic_path, atomic_write
from helpers.linreg import make_solver

NET = '''layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 5 } } }
         layer { name: "fc" type: "InnerProduct" bottom: "data" top: "fc"
                 inner_product_param { num_output: 3 weight_filler { type: "gaussian" } } }'''

LOG = ("I1231 23:59:59.950000  1234 solver.cpp:218] Iteration 0 (0 iter/s, 0.4s/100 iters), loss = 2.31\n"
       "I1231 23:59:59.950000  1234 solver.cpp:237]     Train net output #0: loss = 2.31 (* 1 = 2.31 loss)\n"
       "I0101 00:00:01.500000  1234 solver.cpp:237]     Train net output #0: loss = 0.4 (* 1 = 0.4 loss)\n")


@pytest.fixture
def disk_events(monkeypatch):
    """What reached the disk, in order: ("fsync", (device, inode)) for each os.fsync
    and ("replace", absolute target path) for each os.replace."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(handle):
        info = os.fstat(handle)
        events.append(("fsync", (info.st_dev, info.st_ino)))
        real_fsync(handle)

    def replace(source, target, **kwargs):
        real_replace(source, target, **kwargs)
        events.append(("replace", os.path.abspath(target)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def fsync_of(path):
    info = os.stat(path)
    return ("fsync", (info.st_dev, info.st_ino))


def assert_durable(events, path, inside=None):
    """`path` (or, for a folder such as an LMDB, the file `inside` it) was fsynced
    before `path` was renamed into place, and the parent folder after."""
    path = os.path.abspath(path)
    renamed = events.index(("replace", path))
    written = os.path.join(path, inside) if inside else path
    assert fsync_of(written) in events[:renamed], f"{written}: not fsynced before the rename"
    assert fsync_of(os.path.dirname(path)) in events[renamed + 1:], f"{path}: folder not fsynced after the rename"


def assert_only(folder, *names):
    assert sorted(os.listdir(folder)) == sorted(names), "a temporary was left behind"


# --- the helpers ---------------------------------------------------------------------------------
def test_atomic_write_fsyncs_file_then_folder(tmp_path, disk_events):
    target = tmp_path / "out.bin"
    atomic_write(target, b"new")
    assert target.read_bytes() == b"new"
    assert_durable(disk_events, target)
    assert_only(tmp_path, "out.bin")


def test_atomic_path_failure_keeps_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "model.caffemodel.h5"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_path(target) as temp_path:
            with open(temp_path, "wb") as out:
                out.write(b"half of the n")
            raise RuntimeError("disk full")
    assert target.read_bytes() == b"old"
    assert_only(tmp_path, "model.caffemodel.h5")


def test_atomic_path_temporary_keeps_the_name_and_folder(tmp_path):
    with atomic_path(tmp_path / "plot.png") as temp_path:
        assert os.path.basename(temp_path) == "plot.png"
        assert os.path.dirname(os.path.dirname(temp_path)) == str(tmp_path)    # same file system
        open(temp_path, "wb").close()
    assert_only(tmp_path, "plot.png")


def test_atomic_path_nothing_written_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing was written"):
        with atomic_path(tmp_path / "never.h5"):
            pass
    assert_only(tmp_path)


def test_atomic_path_folder_is_fsynced_inside(tmp_path, disk_events):
    target = tmp_path / "db"
    with atomic_path(target) as temp_path:
        os.makedirs(temp_path)
        (open(os.path.join(temp_path, "data.mdb"), "wb")).close()
    assert_durable(disk_events, target, inside="data.mdb")
    assert fsync_of(target) in disk_events


# --- every writer ----------------------------------------------------------------------------------
@pytest.fixture
def net():
    return cct.Net(NET, cct.TEST)


@pytest.mark.parametrize("write, name", [
    (lambda net, path: net.save(str(path)), "net.caffemodel"),
    (lambda net, path: net.save_hdf5(str(path)), "net.caffemodel.h5"),
])
def test_weights_are_durable(net, write, name, tmp_path, disk_events):
    write(net, tmp_path / name)
    assert_durable(disk_events, tmp_path / name)
    assert_only(tmp_path, name)


@pytest.mark.parametrize("snapshot_format, extensions", [
    ("BINARYPROTO", (".caffemodel", ".solverstate")),
    ("HDF5", (".caffemodel.h5", ".solverstate.h5")),
])
def test_snapshots_are_durable(snapshot_format, extensions, tmp_path, disk_events):
    solver = make_solver(f'type: "SGD" base_lr: 0.01 lr_policy: "fixed" '
                         f'snapshot_prefix: "{tmp_path / "run"}" snapshot_format: {snapshot_format}')
    solver.step(1)
    solver.snapshot()
    names = [f"run_iter_1{extension}" for extension in extensions]
    for name in names:
        assert_durable(disk_events, tmp_path / name)
    assert_only(tmp_path, *names)


def test_hdf5_failure_keeps_the_old_weights(net, tmp_path, monkeypatch):
    target = tmp_path / "net.caffemodel.h5"
    net.save_hdf5(str(target))
    before = target.read_bytes()

    def fail(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(h5py.Group, "create_dataset", fail)
    with pytest.raises(OSError, match="disk full"):
        net.save_hdf5(str(target))
    assert target.read_bytes() == before
    assert_only(tmp_path, "net.caffemodel.h5")


def test_mean_file_is_durable(tmp_path, disk_events):
    from cct.data.transformer import load_mean_file, save_mean_file
    mean = np.arange(12, dtype=np.float32).reshape(3, 2, 2)
    save_mean_file(mean, tmp_path / "mean.binaryproto")
    assert_durable(disk_events, tmp_path / "mean.binaryproto")
    np.testing.assert_array_equal(load_mean_file(tmp_path / "mean.binaryproto"), mean)


def test_plot_is_durable(tmp_path, disk_events):
    pytest.importorskip("matplotlib")
    from cct.cli.train_log import plot_training_log
    (tmp_path / "train.log").write_text(LOG)
    plot_training_log(str(tmp_path / "train.log"), str(tmp_path / "plot"))      # no extension: still PNG
    assert (tmp_path / "plot").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert_durable(disk_events, tmp_path / "plot")
    assert_only(tmp_path, "train.log", "plot")


def test_lowering_cache_is_durable(tmp_path, disk_events):
    from cct.lowering import chooser
    target = tmp_path / "cache" / "lowering.json"
    chooser._save_cache(target, {"version": 1})
    assert target.read_text() == '{\n "version": 1\n}'
    assert_durable(disk_events, target)


def test_digits_lmdb_is_durable_and_a_failure_keeps_the_old_one(tmp_path, disk_events, monkeypatch):
    from cct.data import digits
    train, test = digits.make_digits_lmdb(tmp_path, 20, 10, seed=1)
    for path in (train, test):
        assert_durable(disk_events, path, inside="data.mdb")
    before = (tmp_path / digits.TRAIN_LMDB / "data.mdb").read_bytes()

    def fail(images, labels, path):
        os.makedirs(path)
        (open(os.path.join(path, "data.mdb"), "wb")).close()
        raise OSError("disk full")
    monkeypatch.setattr(digits, "convert_arrays_to_lmdb", fail)
    with pytest.raises(OSError, match="disk full"):
        digits.make_digits_lmdb(tmp_path, 30, 10, seed=2, overwrite=True)
    assert (tmp_path / digits.TRAIN_LMDB / "data.mdb").read_bytes() == before
    assert_only(tmp_path, digits.TRAIN_LMDB, digits.TEST_LMDB)



def test_a_folder_replaces_a_folder(tmp_path):
    """An LMDB written again: the old folder stays whole until the new one is
    on disk, then only the new one is left, and no scratch folder."""
    target = tmp_path / "db"
    target.mkdir()
    (target / "old.mdb").write_bytes(b"old")
    with atomic_path(target) as temp_path:
        os.makedirs(temp_path)
        with open(os.path.join(temp_path, "data.mdb"), "wb") as out:
            out.write(b"new")
        assert (target / "old.mdb").read_bytes() == b"old"      # untouched while writing
    assert sorted(os.listdir(target)) == ["data.mdb"] and (target / "data.mdb").read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["db"]
