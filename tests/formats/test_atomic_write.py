"""Every file cct writes for keeps (weights, snapshots, means, plots, LMDBs, the
lowering cache) goes through cct.formats.prototxt.atomic_path: the new file is
fsynced before it is renamed over the old one and its folder is fsynced after,
and a failed write leaves the old file as it was and no temporary behind. It
ends with the permissions a plain open(path, "w") gives under the umask."""
import contextlib
import os
import stat

import h5py
import numpy as np
import pytest

import cct
from cct.formats.prototxt import atomic_path, atomic_write
from helpers.linreg import make_solver
from helpers.requirements import require

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
    require("matplotlib")
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


# --- permissions: those of a plain open(path, "w") ---------------------------------------------
@contextlib.contextmanager
def umask(value):
    previous = os.umask(value)
    try:
        yield
    finally:
        os.umask(previous)


def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def write_private(path):
    """A writer that creates its file 0600, as a temporary-file library would."""
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))


@pytest.mark.parametrize("mask, expected", [(0o022, 0o644), (0o027, 0o640), (0o002, 0o664)])
def test_a_new_file_gets_the_umask_mode_however_it_was_created(tmp_path, mask, expected):
    with umask(mask):
        atomic_write(tmp_path / "plain.bin", b"x")
        with atomic_path(tmp_path / "private.bin") as temp_path:
            write_private(temp_path)
    assert mode(tmp_path / "plain.bin") == expected
    assert mode(tmp_path / "private.bin") == expected
    assert_only(tmp_path, "plain.bin", "private.bin")          # the probe is gone too


def test_an_existing_file_keeps_its_mode_as_open_would(tmp_path):
    target = tmp_path / "keep.bin"
    target.write_bytes(b"old")
    os.chmod(target, 0o600)
    with umask(0o022):
        atomic_write(target, b"new")
    assert (mode(target), target.read_bytes()) == (0o600, b"new")


def test_files_of_a_written_folder_get_the_umask_mode(tmp_path):
    with umask(0o027), atomic_path(tmp_path / "db") as temp_path:
        os.makedirs(os.path.join(temp_path, "sub"))
        write_private(os.path.join(temp_path, "data.mdb"))
        write_private(os.path.join(temp_path, "sub", "lock.mdb"))
    assert mode(tmp_path / "db" / "data.mdb") == mode(tmp_path / "db" / "sub" / "lock.mdb") == 0o640


@pytest.mark.parametrize("mask, expected", [(0o022, 0o644), (0o077, 0o600)])
def test_weights_and_snapshots_follow_the_umask(net, tmp_path, mask, expected):
    solver = make_solver(f'type: "SGD" base_lr: 0.01 lr_policy: "fixed" snapshot_prefix: "{tmp_path / "run"}"')
    solver.step(1)
    with umask(mask):
        net.save(str(tmp_path / "net.caffemodel"))
        net.save_hdf5(str(tmp_path / "net.caffemodel.h5"))
        solver.snapshot()
    for name in ("net.caffemodel", "net.caffemodel.h5", "run_iter_1.caffemodel", "run_iter_1.solverstate"):
        assert mode(tmp_path / name) == expected, name


def test_a_killed_writers_scratch_is_removed_by_the_next_write(tmp_path):
    """A kill skips atomic_path's cleanup: the next write in the folder removes
    the scratch folders of this host's writers that are gone, and leaves a
    live writer's, and one that holds the only copy of a replaced folder."""
    import subprocess
    import sys
    from cct.formats.prototxt import _HOST
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    dead = tmp_path / f".tmp-net.caffemodel-{_HOST}-{gone}-abc123"
    live = tmp_path / f".tmp-other.caffemodel-{_HOST}-{os.getpid()}-def456"
    kept_old = tmp_path / f".tmp-db-{_HOST}-{gone}-ghi789"
    other_host = tmp_path / f".tmp-x.caffemodel-elsewhere-{gone}-jkl012"
    for scratch in (dead, live, kept_old, other_host):
        scratch.mkdir()
        (scratch / "partial").write_bytes(b"half a snapshot")
    (kept_old / ".old").mkdir()
    atomic_write(tmp_path / "net.caffemodel", b"whole")
    assert not dead.exists() and live.exists() and kept_old.exists() and other_host.exists()
    assert (tmp_path / "net.caffemodel").read_bytes() == b"whole"
