"""Nets and solvers let go of what they hold as soon as they are dropped, with
the cyclic garbage collector off (issue 16, point 3): no reference cycles
between a net and its executor, so CPython frees them at once and their data
layers' databases close; two live solvers read one LMDB side by side."""
import gc
import os
import tracemalloc
import weakref

import numpy as np
import pytest
from google.protobuf import text_format

import cct
from cct.proto import caffe_pb2
from helpers.data import raw_datum, write_lmdb

NET = """
layer { name: "data" type: "Data" top: "data" top: "label"
        data_param { source: "SOURCE" batch_size: 4 backend: LMDB } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "wide" type: "InnerProduct" bottom: "conv" top: "wide"
        inner_product_param { num_output: 8192 weight_filler { type: "gaussian" std: 0.01 } } }
layer { name: "ip" type: "InnerProduct" bottom: "wide" top: "ip"
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.01 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    rng = np.random.default_rng(0)
    datums = [raw_datum(rng.integers(0, 256, (2, 8, 8), dtype=np.uint8), int(rng.integers(0, 5)))
              for _ in range(12)]
    return str(write_lmdb(tmp_path_factory.mktemp("release") / "lmdb", datums))


@pytest.fixture
def no_cyclic_gc():
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def make_solver(source):
    param = caffe_pb2.SolverParameter(base_lr=0.01, lr_policy="fixed", display=0, snapshot_after_train=False)
    param.net_param.CopyFrom(text_format.Parse(NET.replace("SOURCE", source), caffe_pb2.NetParameter()))
    return cct.SGDSolver(param)


def test_a_dropped_net_and_solver_are_freed_at_once(source, no_cyclic_gc):
    solver = make_solver(source)
    solver.step(2)
    dropped = [weakref.ref(solver), weakref.ref(solver.net), weakref.ref(solver.net.executor)]
    del solver
    assert [ref() for ref in dropped] == [None, None, None]
    net = cct.Net(text_format.Parse(NET.replace("SOURCE", source), caffe_pb2.NetParameter()), cct.TRAIN)
    net.forward()
    net.backward()
    dropped = weakref.ref(net)
    del net
    assert dropped() is None


def resident_bytes():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_memory_returns_after_a_solver_is_dropped(source, no_cyclic_gc):
    """The solver holds ~14 MB (a 1.2M-weight layer: data, diff, momentum);
    dropped, it leaves under 5% of that traced, and the process's resident
    memory within 5% of its level before."""
    make_solver(source).step(1)                  # warm: imports, caches, compiled kernels
    rss_before = resident_bytes()
    tracemalloc.start()
    try:
        solver = make_solver(source)
        solver.step(3)
        held = tracemalloc.get_traced_memory()[0]
        del solver
        left = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held > 10_000_000
    assert left <= 0.05 * held
    assert resident_bytes() <= 1.05 * rss_before


def test_two_solvers_on_one_lmdb_train_side_by_side_and_again_after_a_drop(source, no_cyclic_gc):
    first, second = make_solver(source), make_solver(source)
    for _ in range(3):
        first.step(1)
        second.step(1)
    np.testing.assert_array_equal(first.net.blobs["label"].data, second.net.blobs["label"].data)
    del first, second
    again = make_solver(source)                     # the database opens anew
    again.step(2)
    assert again.iter == 2


def open_readers(source):
    """How many readers share the LMDB environment of `source` now."""
    from cct.data import db
    real = os.path.realpath(source)
    return sum(count for key, (_, count) in db._readers.items() if real in key)


def test_close_and_with_release_the_database_and_a_drop_does_too(source, no_cyclic_gc):
    with make_solver(source) as solver:
        solver.step(1)
        assert open_readers(source) == 1
    assert open_readers(source) == 0
    with pytest.raises(cct.DataError, match="layer 'data' .*prefetch thread has stopped"):
        solver.net.forward()
    solver = make_solver(source)
    solver.step(1)
    assert open_readers(source) == 1
    del solver
    assert open_readers(source) == 0
    with cct.Net(text_format.Parse(NET.replace("SOURCE", source), caffe_pb2.NetParameter()), cct.TEST) as net:
        net.forward()
    assert open_readers(source) == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_is_told_the_data_layer_does_not_cross_a_fork(source):
    """A net built before a fork: the child's forward names the data layer and
    the fork at once, and reads no batch from the parent's queue (which holds
    batches the parent reads too)."""
    net = cct.Net(text_format.Parse(NET.replace("SOURCE", source), caffe_pb2.NetParameter()), cct.TEST)
    net.forward()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:                                   # the child: send the error's text, exit 0 if it was DataError
        import signal
        signal.alarm(20)
        code = 1
        try:
            net.forward()
            os.write(write, b"no error")
        except cct.DataError as error:
            os.write(write, str(error).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    message = os.read(read, 4096).decode()
    os.close(read)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (status, message)
    assert "layer 'data'" in message and "fork" in message and str(os.getpid()) in message, message
    net.forward()                                  # the parent's thread goes on
    net.close()
