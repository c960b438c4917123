"""Durable snapshots (issue 15): `cct train` killed with SIGKILL at 20 seeded
random moments, many of them while it writes a snapshot, always leaves a newest
.caffemodel/.solverstate pair that loads and that `cct train --snapshot`
resumes from, and training that was killed and resumed ten times ends
bitwise where an unbroken run ends; N steps + snapshot in one process, resumed
for M steps in another, equals N + M steps bitwise; and every weights, state
and mean file is written through the atomic helper (cct.formats.prototxt:
written aside, flushed, renamed into place, its folder flushed).

The kill test's net has 300,000 weights, trained by Adam (whose state, two
histories, is twice the weights), with a snapshot every
iteration: an iteration takes about a millisecond, a snapshot of its files
(1.2 and 2.4 MB) 10 to 30, so a kill at a random moment of training mostly
lands in a snapshot, and most of those in the writing of a file itself. A
kill inside the atomic helper leaves its hidden scratch folder .tmp-NAME-*
behind (the helper's cleanup never runs; the resumed run's first write
removes it); one between the weights and the
state leaves weights newer than the newest state: both are counted, and at
least one of the 20 kills must be such a kill."""
import os
import random
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import h5py
import numpy as np
import pytest

from cct.data.transformer import save_mean_file
from cct.training import solver as solver_module

NET = """
name: "wide"
layer { name: "data" type: "HDF5Data" top: "x" top: "t"
  hdf5_data_param { source: "%(folder)s/data.txt" batch_size: 16 } }
layer { name: "fc1" type: "InnerProduct" bottom: "x" top: "h"
  inner_product_param { num_output: 4096 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu" type: "ReLU" bottom: "h" top: "h" }
layer { name: "fc2" type: "InnerProduct" bottom: "h" top: "y"
  inner_product_param { num_output: 8 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "y" bottom: "t" top: "loss" }
"""
SOLVERS = {"SGD": 'type: "SGD" momentum: 0.9', "Adam": 'type: "Adam" momentum: 0.9 momentum2: 0.999'}
EXTENSIONS = {"BINARYPROTO": (".caffemodel", ".solverstate"), "HDF5": (".caffemodel.h5", ".solverstate.h5")}
KILLS, SEED = 20, 15


def write_net(folder):
    """The net and its one batch of 16 rows: every iteration reads the same
    rows, in a resumed run as in an unbroken one (a resumed data layer starts
    from the first row, as in Caffe)."""
    rng = np.random.default_rng(0)
    with h5py.File(folder / "data.h5", "w") as data:
        data["x"] = rng.standard_normal((16, 64)).astype(np.float32)
        data["t"] = rng.standard_normal((16, 8)).astype(np.float32)
    (folder / "data.txt").write_text(f"{folder}/data.h5\n")
    (folder / "net.prototxt").write_text(NET % {"folder": folder})


def write_solver(folder, name, max_iter, snapshot, kind="SGD", snapshot_format="BINARYPROTO"):
    path = folder / f"{name}_{max_iter}.prototxt"
    # multistep: the step counter (current_step) is part of the state a resume must restore.
    path.write_text(f'net: "{folder}/net.prototxt" {SOLVERS[kind]} base_lr: 0.001 lr_policy: "multistep" '
                    f'gamma: 0.5 stepvalue: 3 stepvalue: 7 max_iter: {max_iter} snapshot: {snapshot} '
                    f'snapshot_prefix: "{folder}/{name}" snapshot_format: {snapshot_format} random_seed: 3')
    return path


def train(solver_path, *flags, log_path):
    """`cct train` in its own process, layer after layer (no timing of
    schedules for "auto") on one thread (several run at once); its log goes to a file (a
    pipe could fill up)."""
    with open(log_path, "w") as log_file:
        return subprocess.Popen([sys.executable, "-m", "cct.cli", "train", f"--solver={solver_path}",
                                 "--schedule=sequential", *map(str, flags)],
                                stdout=subprocess.DEVNULL, stderr=log_file, env={**os.environ, "CCT_THREADS": "1"})


def finish(process, log_path, timeout=120):
    assert process.wait(timeout=timeout) == 0, log_path.read_text()
    assert "Optimization Done." in log_path.read_text()


def iterations(folder, name, extension):
    pattern = re.compile(re.escape(name) + r"_iter_(\d+)" + re.escape(extension))
    return sorted(int(m.group(1)) for entry in os.listdir(folder) if (m := pattern.fullmatch(entry)))


def scratch_folders(folder):
    return {entry for entry in os.listdir(folder) if entry.startswith(".tmp-")}


def assert_same_training(solver, state_a, state_b):
    """The weights and solver histories of two states, bitwise."""
    solver.restore(state_a)
    a = [p.data.copy() for p in solver.net.learnable_params] + [h.copy() for h in solver.history]
    iteration = solver.iter
    solver.restore(state_b)
    b = [p.data.copy() for p in solver.net.learnable_params] + [h.copy() for h in solver.history]
    assert solver.iter == iteration
    for ours, theirs in zip(a, b):
        assert ours.tobytes() == theirs.tobytes()


def kill_chain(folder, snapshot_format, solver_path, loader, moments):
    """Train, SIGKILL at each moment (seconds after the run has written its
    first new snapshot, which shows that its resume worked), check the newest
    complete pair loads into `loader` (a solver), resume from it with
    --snapshot; returns the last state and how many kills hit a snapshot being
    written."""
    model_ext, state_ext = EXTENSIONS[snapshot_format]
    state, resumed_from, mid_write, abandoned = None, 0, 0, set()
    for index, moment in enumerate(moments):
        log_path = folder / f"train_{index}.log"
        process = train(solver_path, *(["--snapshot", state] if state else []), log_path=log_path)
        try:
            deadline = time.monotonic() + 120
            while not [i for i in iterations(folder, "run", state_ext) if i > resumed_from]:
                assert process.poll() is None, f"cct train ended early:\n{log_path.read_text()}"
                assert time.monotonic() < deadline, f"no new snapshot:\n{log_path.read_text()}"
                time.sleep(0.01)
            # the resumed run's first write removed what the killed one abandoned
            assert not abandoned & scratch_folders(folder)
            time.sleep(moment)
        finally:
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=60)
        newest = iterations(folder, "run", state_ext)[-1]
        newest_model = iterations(folder, "run", model_ext)[-1]
        scratch = scratch_folders(folder)
        mid_write += bool(scratch) or newest_model > newest
        # Every file under a snapshot's name is whole: the newest weights,
        # even those of a snapshot whose state was never written, load.
        loader.net.copy_from(str(folder / f"run_iter_{newest_model}{model_ext}"))
        state = folder / f"run_iter_{newest}{state_ext}"
        loader.restore(state)                       # the newest complete pair loads
        assert loader.iter == newest
        # Keep the newest pair only: 1.2 MB files are written every iteration.
        for entry in os.listdir(folder):
            if entry.startswith("run_iter_") and not entry.startswith(f"run_iter_{newest}."):
                os.remove(folder / entry)
        resumed_from, abandoned = newest, scratch
    return state, mid_write


@pytest.mark.slow
def test_killed_at_random_moments_always_resumes(tmp_path):
    rng = random.Random(SEED)
    moments = [rng.uniform(0.0, 0.1) for _ in range(KILLS)]
    folders, solvers, loaders = {name: tmp_path / name for name in EXTENSIONS}, {}, {}
    for name, folder in folders.items():
        folder.mkdir()
        write_net(folder)
        solvers[name] = write_solver(folder, "run", 10 ** 6, 1, "Adam", name)
        loaders[name] = solver_module.get_solver(str(solvers[name]))   # nets are built here, not in threads
    # The two formats' chains run side by side: each mostly waits on its `cct train`.
    with ThreadPoolExecutor(2) as pool:
        chains = {name: pool.submit(kill_chain, folder, name, solvers[name], loaders[name], moments[i::2])
                  for i, (name, folder) in enumerate(folders.items())}
        results = {name: chain.result() for name, chain in chains.items()}
    mid_write = sum(result[1] for result in results.values())
    print(f"{mid_write} of {KILLS} kills landed while a snapshot was being written")
    assert mid_write >= 1

    # Resumed once more, to the end; then compared with an unbroken run to the same iteration.
    runs = []
    for name, folder in folders.items():
        state, end = results[name][0], loaders[name].iter + 3
        resume = write_solver(folder, "run", end, 1, "Adam", name)
        unbroken = write_solver(folder, "unbroken", end, 0, "Adam", name)
        runs.append((folder / "resume.log", train(resume, "--snapshot", state, log_path=folder / "resume.log")))
        runs.append((folder / "unbroken.log", train(unbroken, log_path=folder / "unbroken.log")))
    for log_path, process in runs:
        finish(process, log_path)
    for name, folder in folders.items():
        end = loaders[name].iter + 3
        state_ext = EXTENSIONS[name][1]
        assert_same_training(loaders[name], folder / f"run_iter_{end}{state_ext}",
                             folder / f"unbroken_iter_{end}{state_ext}")


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(SOLVERS))
def test_steps_then_resume_in_another_process_equals_unbroken_steps(kind, tmp_path):
    write_net(tmp_path)
    n, m = 5, 4                      # the steps at 3 and 7 fall before and after the snapshot
    first = train(write_solver(tmp_path, "first", n, 0, kind), log_path=tmp_path / "first.log")
    unbroken = train(write_solver(tmp_path, "unbroken", n + m, 0, kind), log_path=tmp_path / "unbroken.log")
    finish(first, tmp_path / "first.log")                    # snapshot_after_train: first_iter_5
    resume = write_solver(tmp_path, "first", n + m, 0, kind)
    resumed = train(resume, "--snapshot", tmp_path / f"first_iter_{n}.solverstate", log_path=tmp_path / "resume.log")
    finish(resumed, tmp_path / "resume.log")
    finish(unbroken, tmp_path / "unbroken.log")
    loader = solver_module.get_solver(str(resume))
    assert_same_training(loader, tmp_path / f"first_iter_{n + m}.solverstate",
                         tmp_path / f"unbroken_iter_{n + m}.solverstate")
    assert loader.iter == n + m and loader.current_step == 2


@pytest.fixture
def durable_writes(monkeypatch):
    """The renames and fsyncs made from now on, as ("rename", target name) and
    ("fsync", name of the file or folder flushed), in order."""
    events = []
    real_replace, real_fsync = os.replace, os.fsync

    def replace(source, target):
        events.append(("rename", os.path.basename(target)))
        return real_replace(source, target)

    def fsync(descriptor):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{descriptor}"))))
        return real_fsync(descriptor)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "fsync", fsync)
    return events


def assert_durable(events, folder, name):
    """`name` was renamed into `folder` after an fsync of itself, and the folder
    was fsynced after the rename."""
    assert ("rename", name) in events, f"{name} was not renamed into place"
    rename = events.index(("rename", name))
    assert ("fsync", name) in events[:rename]
    assert ("fsync", folder.name) in events[rename + 1:]


WRITERS = {
    "snapshot, BINARYPROTO": lambda solver, folder: solver.snapshot(),
    "snapshot, HDF5": lambda solver, folder: solver.snapshot(),
    "Net.save": lambda solver, folder: solver.net.save(str(folder / "net.caffemodel")),
    "Net.save_hdf5": lambda solver, folder: solver.net.save_hdf5(str(folder / "net.caffemodel.h5")),
    "mean file": lambda solver, folder: save_mean_file(np.ones((3, 4, 5), np.float32), folder / "mean.binaryproto"),
}
WRITTEN = {"snapshot, BINARYPROTO": ["snap_iter_1.caffemodel", "snap_iter_1.solverstate"],
           "snapshot, HDF5": ["snap_iter_1.caffemodel.h5", "snap_iter_1.solverstate.h5"],
           "Net.save": ["net.caffemodel"], "Net.save_hdf5": ["net.caffemodel.h5"],
           "mean file": ["mean.binaryproto"]}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_weights_states_and_means_are_written_durably(writer, tmp_path, durable_writes):
    """Each file goes through the atomic helper (cct.formats.prototxt.atomic_path):
    written in a scratch folder, flushed, renamed into place, its folder flushed."""
    write_net(tmp_path)
    snapshot_format = "HDF5" if writer.endswith("HDF5") else "BINARYPROTO"
    solver = solver_module.get_solver(str(write_solver(tmp_path, "snap", 1, 0, snapshot_format=snapshot_format)))
    solver.step(1)
    durable_writes.clear()
    WRITERS[writer](solver, tmp_path)
    for name in WRITTEN[writer]:
        assert_durable(durable_writes, tmp_path, name)
    assert len([event for event in durable_writes if event[0] == "rename"]) == len(WRITTEN[writer])
    assert not scratch_folders(tmp_path)
