"""The process-wide BLAS thread controller: a net built after a partitioned
training step gets every BLAS thread, and no pass leaves the count lowered."""
import os
import signal

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

import cct
from cct.devices import blas as blas_module
from cct.runtime import threads
from cct.runtime.threads import BlasThreads

NET = """
name: "small"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 8 dim: 2 dim: 6 dim: 6 } shape { dim: 8 }
                     data_filler { type: "gaussian" } data_filler { type: "constant" value: 1 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 3 kernel_size: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
  inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def blas_count():
    # the lowest count of the loaded BLAS libraries (numpy's and scipy's): the one a GEMM may be left with
    return min(pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas")


@pytest.mark.parametrize("partitions", [2], indirect=True)    # conv and relu: 2 partitions of 1 BLAS thread
def test_nets_built_after_a_partitioned_step_get_every_blas_thread(partitions, tmp_path, monkeypatch):
    (tmp_path / "net.prototxt").write_text(NET)
    (tmp_path / "solver.prototxt").write_text(
        'net: "net.prototxt" base_lr: 0.01 lr_policy: "fixed" max_iter: 10 display: 0 '
        'test_iter: 1 test_interval: 100 test_initialization: false snapshot_after_train: false')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(blas_module, "_blas", None)     # a controller made below, under 2 threads
    with threadpool_limits(limits=2, user_api="blas"):
        solver = cct.SGDSolver("solver.prototxt")
        train = solver.net
        assert train.executor.partitions(train.layer_names.index("conv")) == 2
        solver.step(2)
        assert blas_count() == 2                     # the step gave the threads back
        assert solver.test_nets[0].executor.threads == 2
        later = cct.Net("net.prototxt", cct.TEST)
        assert later.executor.threads == 2
        later.forward()
        assert blas_count() == 2
        assert threads.blas() is later.executor.blas is train.executor.blas


def test_partitions_of_every_net_share_the_process_workers():
    first, second = threads.workers(3), threads.workers(2)
    assert second == first[:len(second)]


def test_blas_thread_count_is_set_and_restored():
    with threadpool_limits(limits=2, user_api="blas"):
        blas = BlasThreads()                         # its default: the 2 threads in force now
        blas.set(1)
        assert blas_count() == 1
        blas.restore()
        assert blas_count() == blas.default == 2


@pytest.mark.parametrize("mode", ["streams", "auto"])
def test_a_streamed_backward_leaves_every_blas_thread(mode, monkeypatch):
    """The streams lower and raise the BLAS count from their own threads: the
    count the library reports, not only the one last asked, must be back at
    the executor's after each backward (it was left at 1 in 11 of 12 "auto"
    iterations of LeNet, and every forward after ran its GEMMs on one thread)."""
    monkeypatch.setattr(blas_module, "_blas", None)
    with threadpool_limits(limits=2, user_api="blas"):
        monkeypatch.setenv("CCT_SCHEDULE", mode)
        net = cct.Net(NET.replace("dim: 8", "dim: 32"), cct.TRAIN)
        assert net.executor.threads == 2
        for _ in range(8):
            net.forward()
            net.backward()
            assert blas_count() == 2


def test_any_thread_sets_the_count():
    """threadpoolctl 3.8 drops an OpenBLAS set from every thread but the first
    that set one (here the main thread, by threadpool_limits): the streams'
    threads must reach the library all the same."""
    import threading
    with threadpool_limits(limits=2, user_api="blas"):
        blas = BlasThreads()
        seen = []

        def on_another_thread():
            blas.set(1)
            seen.append(blas_count())
            blas.set(2)
            seen.append(blas_count())
        thread = threading.Thread(target=on_another_thread)
        thread.start()
        thread.join()
        assert seen == [1, 2]



def test_run_all_waits_for_every_unit_and_raises_the_first_failure():
    import time
    done = []

    def unit(k):
        if k == 0:
            raise KeyError("unit 0")
        time.sleep(0.01 * k)
        done.append(k)
        if k >= 2:
            raise ValueError(f"unit {k}")
    with pytest.raises(KeyError, match="unit 0"):       # this thread's own unit wins
        threads.run_all(threads.workers(4), unit, [(k,) for k in range(4)])
    assert sorted(done) == [1, 2, 3]                      # none still running after the raise
    done.clear()
    with pytest.raises(ValueError, match="unit 2"):       # then the workers' in unit order
        threads.run_all(threads.workers(4), lambda k: unit(k) if k else None, [(k,) for k in range(4)])
    assert sorted(done) == [1, 2, 3]
    seen = []
    threads.run_all(threads.workers(3), seen.append, [(k,) for k in range(3)])
    assert sorted(seen) == [0, 1, 2]                      # the workers serve again after failures


def test_a_worker_whose_join_was_interrupted_finishes_its_call_before_the_next():
    import threading
    worker, release, order = threads.Worker("test-worker"), threading.Event(), []

    def slow():
        release.wait()
        order.append("slow")
    worker.submit(slow)           # never joined, as when Ctrl-C interrupts the join
    threading.Timer(0.05, release.set).start()
    worker.submit(order.append, "next")
    worker.join()
    assert order == ["slow", "next"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_runs_units_on_workers_of_its_own():
    """The parent's workers do not exist in a forked child (a multiprocessing
    worker forked from a process that ran a partitioned net): a run there
    starts workers of its own instead of waiting for ever on the dead ones."""
    done = []
    threads.run_all(threads.workers(2), done.append, [(0,), (1,)])       # the parent's worker exists
    assert sorted(done) == [0, 1]
    parent_workers = threads.workers(2)
    pid = os.fork()
    if pid == 0:                                   # the child: exit 0 only if the run ends, on new workers
        signal.alarm(20)
        try:
            child = []
            fresh = threads.workers(2)
            threads.run_all(fresh, child.append, [(0,), (1,)])
            os._exit(0 if sorted(child) == [0, 1] and fresh[0] is not parent_workers[0] else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


def test_a_layer_run_whole_spreads_its_kernels_on_the_executors_threads(monkeypatch):
    """A pooling layer run whole on 2 threads splits its kernel calls' planes
    over the executor's workers (Layer.run_partitions' spread); on 1 thread,
    or in batch partitions, it does not. The numbers are the same."""
    from cct.layers import pooling
    monkeypatch.setattr(pooling, "PARALLEL_ELEMENTS", 0)
    spread = []
    real = threads.Spread.__call__
    monkeypatch.setattr(threads.Spread, "__call__", lambda self, function, pieces: (
        spread.append(len(pieces)), real(self, function, pieces)))
    text = """name: "pool" force_backward: true
input: "data" input_shape { dim: 4 dim: 3 dim: 8 dim: 8 }
layer { name: "pool" type: "Pooling" bottom: "data" top: "pool" pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
"""
    x = np.random.default_rng(0).standard_normal((4, 3, 8, 8)).astype(np.float32)
    results = []
    for count, partitions in ((1, 1), (2, 1), (2, 2)):
        monkeypatch.setenv("CCT_PARTITIONS", str(partitions))
        net = cct.Net(text, cct.TEST)
        net.executor.threads = count
        net.blobs["data"].data[...] = x
        spread.clear()
        net.forward()
        net.blobs["pool"].diff[...] = net.blobs["pool"].data
        net.backward()
        assert spread == ([2, 2] if (count, partitions) == (2, 1) else [])     # forward and backward
        results.append((net.blobs["pool"].data.copy(), net.blobs["data"].diff.copy()))
    for data, diff in results[1:]:
        np.testing.assert_array_equal(data, results[0][0])
        np.testing.assert_array_equal(diff, results[0][1])
