"""Cores held by other processes (cct.runtime.cores): the measurement on a
clock and tick counter the test drives, the parsing of /proc/stat, a real
busy process seen, and a net whose thread count nobody gave following the
cores free, with a new plan at each change."""
import os
import subprocess
import sys
import time

import pytest
from threadpoolctl import threadpool_limits

import cct
from cct.devices import blas as blas_module
from cct.runtime import cores
from cct.runtime.cores import HELD_SHARE, IDLE_SECONDS, WINDOW_SECONDS, Reading, Watch

NET = """
name: "small"
input: "data" input_shape { dim: 16 dim: 2 dim: 6 dim: 6 }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 3 kernel_size: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
"""


class Machine:
    """A clock, this process's CPU seconds and the cores' busy ticks (100 Hz), driven by the test."""

    def __init__(self):
        self.now, self.own, self.ticks = 0.0, 0.0, 0

    def run(self, seconds, own_cores, other_cores):
        self.now += seconds
        self.own += seconds * own_cores
        self.ticks += round(100 * seconds * (own_cores + other_cores))

    def watch(self, cores=2, quota=None):
        return Watch(clock=lambda: self.now, own_seconds=lambda: self.own, ticks=lambda: self.ticks,
                     cores=cores, quota=quota, tick_seconds=0.01)


@pytest.mark.parametrize("others, free", [(0.0, 2), (HELD_SHARE - 0.01, 2), (HELD_SHARE + 0.01, 1),
                                          (1.0, 1), (1.9, 1), (5.0, 1)])
def test_a_core_is_held_once_others_run_a_quarter_of_one(others, free):
    assert Reading(cores=2, others=others, seconds=1.0).free == free


@pytest.mark.parametrize("others, free", [(0.0, 2), (30.0, 2), (62.5, 1)])
def test_a_quota_caps_the_count_whatever_others_run_on_the_hosts_other_cores(others, free):
    """A container's 2 CPUs on a 64-core host: others' load elsewhere takes
    nothing from it until fewer than 2 cores are left."""
    assert Reading(cores=64, others=others, seconds=1.0, quota=2).free == free


def test_a_window_measures_what_other_processes_ran():
    machine = Machine()
    watch = machine.watch()
    machine.run(WINDOW_SECONDS / 2, own_cores=2, other_cores=1)
    assert watch.free() == 2 and watch.last is None        # the first window is still open
    machine.run(WINDOW_SECONDS, own_cores=1.5, other_cores=1)
    assert watch.free() == 1
    assert watch.last.others == pytest.approx(1.0, abs=0.05)   # its own 1.5 cores are not others'
    machine.run(WINDOW_SECONDS, own_cores=2, other_cores=0)
    assert watch.free() == 2
    assert [reading.free for reading in watch.history] == [1, 2]   # the changes, for cct time


def test_what_others_run_while_this_process_pauses_holds_nothing():
    """Another framework's turn between two passes (a benchmark's), then a
    pass with another process on a core throughout."""
    machine = Machine()
    watch = machine.watch()
    machine.run(0.05, own_cores=2, other_cores=0)
    watch.idle()
    machine.run(0.5, own_cores=0, other_cores=2)          # the pause: the others' turn
    assert watch.free() == 2 and watch.last is None         # that window started again
    machine.run(WINDOW_SECONDS, own_cores=1, other_cores=1)
    assert watch.free() == 1                                 # a busy neighbour while this process runs


@pytest.mark.parametrize("seconds, own_cores", [(IDLE_SECONDS / 2, 0), (WINDOW_SECONDS, 0.6)])
def test_a_short_pause_or_one_this_process_works_through_is_measured(seconds, own_cores):
    machine = Machine()
    watch = machine.watch()
    machine.run(WINDOW_SECONDS, own_cores=1, other_cores=1)
    watch.idle()
    machine.run(seconds, own_cores=own_cores, other_cores=1)
    assert watch.free() == 1


def test_without_proc_stat_every_allowed_core_is_free():
    watch = Watch(ticks=lambda: None, cores=3)
    assert watch.free() == 3 and watch.last is None


def test_busy_ticks_reads_the_cores_of_the_affinity_mask(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  9 9 9 9 9 9 9 9 0 0\n"
                    "cpu0 1 2 3 1000 50 4 5 6 0 0\n"          # busy: 1+2+3+4+5+6, not idle or iowait
                    "cpu1 10 0 0 1000 0 0 0 0 0 0\n"
                    "intr 5 5 5\nctxt 77\n")
    assert cores.busy_ticks(path=str(stat)) == 21 + 10
    assert cores.busy_ticks({1}, path=str(stat)) == 10
    assert cores.busy_ticks(path=str(tmp_path / "none")) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat")
def test_a_busy_process_is_seen_on_this_machine():
    """A real spinning child: others ran at least half a core (it runs on
    one of the allowed cores whatever else this machine does)."""
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        watch = Watch()
        time.sleep(WINDOW_SECONDS + 0.2)
        watch.free()
    finally:
        child.kill()
        child.wait()
    assert watch.last is not None and watch.last.others >= 0.5


@pytest.fixture
def two_blas_threads(monkeypatch):
    monkeypatch.setattr(blas_module, "_blas", None)    # a controller made below, under 2 threads
    with threadpool_limits(limits=2, user_api="blas"):
        yield


def test_a_net_follows_the_cores_free(two_blas_threads, monkeypatch):
    monkeypatch.setenv("CCT_FIT_CORES", "1")
    machine = Machine()
    with cores.watching(machine.watch()):
        net = cct.Net(NET, cct.TEST)
        executor, conv = net.executor, net.layer_names.index("conv")
        for _ in range(3):
            net.forward()
        assert executor.threads == 2 and executor.partitions(conv) == 2
        plan = executor._plan
        machine.run(WINDOW_SECONDS, own_cores=1, other_cores=1)
        net.forward()
        assert executor.threads == 1 and executor.partitions(conv) == 1
        assert executor._plan is not plan                 # the steps were made for 2 threads
        assert executor.blas.reported() == 1               # what runs after the net gets 1 too
        machine.run(WINDOW_SECONDS, own_cores=1, other_cores=0)
        net.forward()
        assert executor.threads == 2 and executor.blas.reported() == 2


@pytest.mark.parametrize("given", ["variable", "setter", "off"])
def test_a_count_given_is_not_fitted(given, two_blas_threads, monkeypatch):
    monkeypatch.setenv("CCT_FIT_CORES", "0" if given == "off" else "1")
    if given == "variable":
        monkeypatch.setenv("CCT_THREADS", "2")
    machine = Machine()
    with cores.watching(machine.watch()):
        net = cct.Net(NET, cct.TEST)
        if given == "setter":
            net.executor.threads = 2
        machine.run(WINDOW_SECONDS, own_cores=0, other_cores=1)
        net.forward()
        assert net.executor.threads == 2


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_opens_its_own_window():
    """The child's CPU time starts from zero: the parent's window would count
    the parent's own seconds as other processes'."""
    machine = Machine()
    watch = machine.watch()
    machine.run(WINDOW_SECONDS / 2, own_cores=2, other_cores=0)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:                              # the child: its own seconds from zero, nobody else running
        machine.own = 0.0
        machine.run(WINDOW_SECONDS, own_cores=2, other_cores=0)
        first = watch.free()
        machine.run(WINDOW_SECONDS, own_cores=2, other_cores=0)
        os.write(write, f"{first} {watch.free()}".encode())
        os._exit(0)
    os.close(write)
    got = os.read(read, 16)
    os.waitpid(pid, 0)
    assert got == b"2 2"                       # the parent's 0.25 s of its own were not taken for others'
