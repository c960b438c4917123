"""The one pool (cct.devices.pool): OpenBLAS's threaded jobs on numba's
OpenMP threads during a net's passes, and the parallel kernels beside them.
The same bits as without it: the jobs are OpenBLAS's own, split as its own
threads split them; a parallel kernel does each value's steps as its serial
form. Skipped where the pool cannot start (no OpenBLAS setter, no GNU OpenMP
layer for numba)."""
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import cct
from cct.core import settings
from cct.devices import jit, pool
from cct.devices.blas import blas, blas_limited
from cct.layers import pooling_kernels
from cct.lowering import depthwise, geometry, type1, winograd
from cct.runtime import fusion

F32 = np.float32


@pytest.fixture(scope="module")
def started():
    jit.compiled(jit._touch)
    if not pool.start():
        pytest.skip("no pool here: no OpenBLAS with the callback setter, or numba without GNU OpenMP")
    return pool._pool


@pytest.fixture
def two_threads(started):
    if started.size < 2:
        pytest.skip("one core: numba's pool has one thread")
    with blas_limited(2):
        yield started


def gemms(rng):
    # shapes OpenBLAS splits across threads: wide, deep, square
    return [(rng.standard_normal((m, k), dtype=F32), rng.standard_normal((k, n), dtype=F32))
            for m, k, n in [(64, 576, 3136), (256, 2304, 196), (300, 301, 302), (8, 4096, 8)]]


def test_gemms_same_bits_on_the_pool(two_threads):
    products = gemms(np.random.default_rng(0))
    native = [a @ b for a, b in products]
    assert pool.acquire(2)
    try:
        assert pool.kernel_threads() == 2
        lent = [a @ b for a, b in products]
    finally:
        pool.release()
    assert all(np.array_equal(x, y) for x, y in zip(native, lent))
    assert pool._pool.lent == 0 and pool.kernel_threads() == 1


def test_only_the_lending_thread_runs_kernels_on_the_pool(two_threads):
    """Another thread's kernels run serially while a pass holds the pool (a
    worker's piece of that pass): in parallel there they would start a
    second team of OpenMP threads, after which batch 1 ran 1.4-2x slower."""
    import threading
    seen = []
    assert pool.acquire(2)
    try:
        worker = threading.Thread(target=lambda: seen.append(pool.kernel_threads()))
        worker.start()
        worker.join()
        assert pool.kernel_threads() == 2
    finally:
        pool.release()
    assert seen == [1] and pool._pool.lenders == {}


def test_not_lent_beyond_its_threads(started):
    assert not pool.acquire(started.size + 1)
    assert started.lent == 0


def test_lent_only_inside_a_pass(two_threads):
    net = small_net()
    seen = []
    original = pool.kernel_threads

    def spy():
        seen.append(pool._pool.lent)
        return original()
    pool.kernel_threads, saved = spy, pool.kernel_threads
    try:
        net.forward()
    finally:
        pool.kernel_threads = saved
    assert seen and all(lent >= 1 for lent in seen)
    assert pool._pool.lent == 0


def test_a_training_net_keeps_openblas_threads(two_threads):
    net = small_net(cct.TRAIN)
    seen = []
    original = pool.acquire

    def spy(threads):
        seen.append(threads)
        return original(threads)
    pool.acquire, saved = spy, pool.acquire
    try:
        net.forward()
    finally:
        pool.acquire = saved
    assert seen == [] and pool._pool.lent == 0


def small_net(phase=cct.TEST):
    """Conv -> BatchNorm -> Scale -> ReLU (one fused pass) -> 3x3 conv (Winograd
    at one image), large enough for the parallel forms."""
    from cct.proto import caffe_pb2
    from google.protobuf import text_format
    text = """
    layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 16 dim: 40 dim: 40 } } }
    layer { name: "c1" type: "Convolution" bottom: "data" top: "c1"
            convolution_param { num_output: 32 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.1 } } }
    layer { name: "bn" type: "BatchNorm" bottom: "c1" top: "c1" }
    layer { name: "sc" type: "Scale" bottom: "c1" top: "c1" scale_param { bias_term: true } }
    layer { name: "r1" type: "ReLU" bottom: "c1" top: "c1" }
    layer { name: "c2" type: "Convolution" bottom: "c1" top: "c2"
            convolution_param { num_output: 32 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.1 } } }
    """
    param = text_format.Parse(text, caffe_pb2.NetParameter())
    cct.set_random_seed(3)
    net = cct.Net(param, phase)
    rng = np.random.default_rng(1)
    for layer in net.layers:
        for blob in layer.blobs:
            blob.data[...] = rng.uniform(0.5, 1.5, blob.shape)
    net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].shape)
    return net


def test_net_same_bits_with_and_without(two_threads):
    net = small_net()
    with settings.override(workers=2):
        net.forward()
        lent = {name: blob.data.copy() for name, blob in net.blobs.items()}
        held, pool._pool = pool._pool, None
        try:
            net.forward()
        finally:
            pool._pool = held
    assert all(np.array_equal(lent[name], blob.data) for name, blob in net.blobs.items())


def test_two_threads_run_nets_on_the_pool_at_once(two_threads):
    """Two threads' passes at once each get an OpenMP team (numba's GNU OpenMP
    layer is thread-safe): both finish, with the numbers of one alone."""
    import threading
    nets = [small_net(), small_net()]
    with settings.override(workers=2):
        nets[0].forward()
        alone = nets[0].blobs["c2"].data.copy()
        outputs, errors = [None, None], []

        def run(k):
            try:
                for _ in range(5):
                    nets[k].forward()
                outputs[k] = nets[k].blobs["c2"].data.copy()
            except Exception as error:          # noqa: BLE001  (reported below)
                errors.append(error)
        threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    assert not errors and not any(thread.is_alive() for thread in threads)
    assert all(np.array_equal(output, alone) for output in outputs)
    assert pool._pool.lent == 0


def _parallel_cases(rng):
    """(kernel, arguments) of each parallel kernel, above PARALLEL_ELEMENTS."""
    image = rng.standard_normal((8, 1, 70, 70), dtype=F32)
    cols = np.zeros((8 * 9, 68 * 68), F32)
    channels = rng.standard_normal((40, 40, 24), dtype=F32)
    tiles = 10
    v6 = np.zeros((36, tiles * tiles, 24), F32)
    v4 = np.zeros((16, 20 * 20, 24), F32)
    product = rng.standard_normal((36, tiles * tiles, 48), dtype=F32)
    out = np.zeros((48, 40, 40), F32)
    values = rng.standard_normal((1, 64, 900), dtype=F32)
    maps = [rng.standard_normal(64, dtype=F32) for _ in range(3)]
    other, summed = rng.standard_normal((1, 64, 900), dtype=F32), np.zeros((1, 64, 900), F32)
    planes = rng.standard_normal((32, 40, 40), dtype=F32)
    depthwise_weights = rng.standard_normal((32, 9), dtype=F32)
    depthwise_out = np.zeros((32, 38 * 38), F32)
    pooled = rng.standard_normal((40, 29, 29), dtype=F32)
    return [
        (pooling_kernels.max_3x3_same, (pooled, np.zeros((40, 29, 29), F32))),
        (pooling_kernels.max_3x3_stride2, (pooled, np.zeros((40, 14, 14), F32))),
        (type1._lower_one_image, (image, 3, 3, 1, 68, 68, cols)),
        (depthwise._forward, (planes, depthwise_weights, 3, 3, 1, 1, 0, 0, 1, 1, 38, 38, depthwise_out)),
        (geometry._bias_relu, (rng.standard_normal((1, 32, 1600), dtype=F32), maps[0][:32].copy(), F32(0.1))),
        (winograd._input_channels, (channels, 1, 1, 4, tiles, tiles, v6, 0)),
        (winograd._input_channels_a4, (channels, 1, 1, 2, 20, 20, v4, 0)),
        (winograd._output_channels, (product, 1, 0, tiles, tiles, maps[0][:48].copy(), True, F32(0), True, out)),
        (fusion._in_place_pass, (values, *maps, True, F32(0), True, F32(0.1), True)),
        (fusion._kept_sum_pass, (values, *maps, True, F32(0), False, other, F32(1), F32(-0.5), F32(0), True,
                                 summed)),
    ]


@pytest.mark.parametrize("case", range(10))
def test_parallel_kernels_same_bits(two_threads, case):
    serial_args = _parallel_cases(np.random.default_rng(5))[case]
    kernel, arguments = serial_args
    parallel_arguments = _parallel_cases(np.random.default_rng(5))[case][1]
    assert arguments[0].size >= jit.PARALLEL_ELEMENTS
    jit.compiled(kernel.serial)(*arguments)
    assert pool.acquire(2)
    try:
        kernel(*parallel_arguments)
    finally:
        pool.release()
    assert kernel.parallel_form is not None
    for mine, theirs in zip(arguments, parallel_arguments):
        if isinstance(mine, np.ndarray):
            assert np.array_equal(mine, theirs, equal_nan=True)


def test_off_by_setting():
    code = "from cct.devices import jit, pool; jit.compiled(jit._touch); print(pool.start())"
    env = dict(os.environ, CCT_ONE_POOL="0")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_forked_child_gemms_without_the_pool(two_threads):
    """A child forked while the pool is lent uses OpenBLAS's own threads (GNU
    OpenMP's are not the child's): its threaded GEMM ends."""
    a = np.random.default_rng(2).standard_normal((400, 400), dtype=F32)
    expected = a @ a
    assert pool.acquire(2)
    try:
        child = os.fork()
        if child == 0:                          # pragma: no cover (the child)
            ok = pool._pool is None and blas().current >= 1 and np.array_equal(a @ a, expected)
            os._exit(0 if ok else 1)
    finally:
        pool.release()
    for _ in range(600):                        # a hung child fails the test, not the run
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(child, 9)
        os.waitpid(child, 0)
        pytest.fail("the forked child's GEMM hung")
    assert os.WEXITSTATUS(status) == 0
