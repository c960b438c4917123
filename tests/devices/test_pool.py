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
from cct.lowering import ConvGeometry, depthwise, geometry, type1, winograd
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


@pytest.mark.parametrize("geom", [ConvGeometry(3, 8, 61, 45, 7, 7, stride_h=2, stride_w=2, pad_h=3, pad_w=3),
                                  ConvGeometry(4, 5, 40, 40, 5, 5, pad_h=1, pad_w=1),
                                  ConvGeometry(3, 6, 120, 140, 5, 5, stride_h=4, stride_w=4, dilation_h=2,
                                               dilation_w=2)],
                         ids=["stride2", "stride1", "stride4_dilation"])
def test_bands_shared_on_the_pool_give_one_thread_gemms(two_threads, geom, monkeypatch):
    """A one-image forward in bands given 2 threads on the pool: each
    thread lowers and multiplies its half of the rows by one-thread GEMMs
    (type1._bands_on_pool, cblas_sgemm called from the kernel), the values
    the one-piece path gives with the BLAS at one thread to float32
    rounding (numpy's matmul may call the GEMM with its operands otherwise
    ordered); the workspace holds a band per thread."""
    from cct.core.workspace import Arena
    from cct.lowering.chunking import band_slot_bytes
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, geom.channels, geom.in_h, geom.in_w), dtype=F32)
    w = rng.standard_normal(geom.weight_shape, dtype=F32)
    bias = rng.standard_normal(geom.num_output, dtype=F32)
    monkeypatch.setattr(type1, "BAND_BYTES", 3 * 4 * geom.channels * geom.kernel_h * geom.kernel_w * geom.out_w)
    monkeypatch.setattr(type1, "BAND_MIN_COLUMNS", 1)
    rows = type1.band_rows(geom, 1, 4)
    assert rows == 3 and len(type1.band_pieces(geom, rows, 2)) == 2
    with blas_limited(1):
        alone = type1.forward_in_bands(x, w, geom, rows, np.empty(geom.output_shape(1), F32), Arena(), bias, 0.0)
    calls = []
    original = type1._bands_on_pool.parallel
    monkeypatch.setattr(type1._bands_on_pool, "parallel", lambda *a: calls.append(a[-3].tolist()) or original(*a))
    arena = Arena()
    arena.plan(band_slot_bytes(geom, rows, 4, 2))
    assert pool.acquire(2)
    try:
        shared = type1.forward_in_bands(x, w, geom, rows, np.empty(geom.output_shape(1), F32), arena, bias, 0.0,
                                        threads=2)
    finally:
        pool.release()
    assert calls == [[0, geom.out_h // 2, geom.out_h]]
    np.testing.assert_allclose(shared, alone, rtol=1e-5, atol=1e-5 * np.abs(alone).max())
    assert not arena.stores
    assert blas().current == 2                   # the pass's count back after the one-thread GEMMs


def test_stacked_products_side_by_side_on_the_pool(two_threads, monkeypatch):
    """Winograd's stack of tile products (geometry.stacked_matmul) on the
    pool: each item a one-thread GEMM on one of its threads, numpy's values
    to float32 rounding, strided slices of a stack included (a group's
    channels); off the pool, numpy's matmul itself."""
    rng = np.random.default_rng(3)
    u = rng.standard_normal((16, 12, 40), dtype=F32)
    v = rng.standard_normal((16, 20, 57), dtype=F32)
    calls = []
    original = geometry._stack_on_pool.parallel
    monkeypatch.setattr(geometry._stack_on_pool, "parallel", lambda *a: calls.append(1) or original(*a))
    with blas_limited(1):
        expected = np.matmul(u[:, :6, :10], v[:, :10])
    out = np.full((16, 8, 57), np.nan, F32)
    assert pool.acquire(2)
    try:
        geometry.stacked_matmul(u[:, :6, :10], v[:, :10], out[:, 1:7])
    finally:
        pool.release()
    assert calls == [1] and blas().current == 2
    np.testing.assert_allclose(out[:, 1:7], expected, rtol=1e-5, atol=1e-5)
    assert np.isnan(out[:, 0]).all() and np.isnan(out[:, 7]).all()
    geometry.stacked_matmul(u[:, :6, :10], v[:, :10], out[:, 1:7])       # not lent: numpy's
    assert calls == [1]


def test_sgemm64_is_numpys_gemm():
    """The cblas_sgemm compiled kernels call is the one numpy's matmul
    calls: at one thread, the same bits."""
    from cct.devices.blas import sgemm64
    sgemm = sgemm64()
    if sgemm is None:
        pytest.skip("numpy's BLAS is not an ILP64 OpenBLAS of its own wheel")
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((37, 150), dtype=F32), rng.standard_normal((150, 211), dtype=F32)
    c = np.zeros((37, 300), F32)
    with blas_limited(1):
        sgemm(101, 111, 111, 37, 211, 150, 1.0, a.ctypes.data, 150, b.ctypes.data, 211, 0.0, c[:, 50:].ctypes.data,
              300)
        assert np.array_equal(c[:, 50:261], a @ b) and not c[:, :50].any() and not c[:, 261:].any()


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


def acquire_calls(monkeypatch):
    """The thread counts pool.acquire is asked for from now until the test's end."""
    seen, original = [], pool.acquire
    monkeypatch.setattr(pool, "acquire", lambda threads: seen.append(threads) or original(threads))
    return seen


def test_a_training_net_keeps_openblas_threads(two_threads, monkeypatch):
    net = small_net(cct.TRAIN)
    seen = acquire_calls(monkeypatch)
    net.forward()
    assert seen == [] and pool._pool.lent == 0


def test_a_pass_in_batch_partitions_keeps_openblas_threads(two_threads, monkeypatch):
    """A TEST net with layers in batch partitions (on the executor's
    workers) lends no pool, planned or not: the pool's threads, spinning
    after a whole layer's parallel kernel, held the cores the workers
    needed (ResNet-50 at batch 16 took 1.4-1.6x the time)."""
    net = small_net()
    net.blobs["data"].reshape(4, 16, 40, 40)
    net.reshape()
    executor = net.executor
    executor.threads = 2
    for index in range(len(net.layers)):
        if executor.partitionable(index):
            executor.set_partitions(index, 2)
    assert any(executor.partitions(index) > 1 for index in range(len(net.layers)))
    seen = acquire_calls(monkeypatch)
    for _ in range(4):                  # the last ones on an execution plan
        net.forward()
    assert executor._plan is not None and executor._plan.partitioned
    assert seen == [] and pool._pool.lent == 0
    assert executor.partitioned() and "not lent to a pass with layers in batch partitions" in pool.describe(
        True, executor.partitioned())


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
    planes_chw = rng.standard_normal((24, 40, 40), dtype=F32)
    tiles_product = rng.standard_normal((36, 48, tiles * tiles), dtype=F32)
    return [
        (pooling_kernels.max_3x3_same, (pooled, np.zeros((40, 29, 29), F32))),
        (pooling_kernels.max_3x3_stride2, (pooled, np.zeros((40, 14, 14), F32))),
        (type1._lower_one_image, (image, 3, 3, 1, 68, 68, cols)),
        (depthwise._forward, (planes, depthwise_weights, 3, 3, 1, 1, 0, 0, 1, 1, 38, 38, depthwise_out)),
        (geometry._bias_relu, (rng.standard_normal((1, 32, 1600), dtype=F32), maps[0][:32].copy(), F32(0.1))),
        (winograd._input_channels, (channels, 1, 1, 4, tiles, tiles, v6, 0)),
        (winograd._input_channels_a4, (channels, 1, 1, 2, 20, 20, v4, 0)),
        (winograd._output_channels, (product, 1, 0, tiles, tiles, maps[0][:48].copy(), True, F32(0), True, out)),
        (winograd._input_a6, (planes_chw, 1, 1, 4, tiles, tiles, np.zeros((36, 24, tiles * tiles), F32), 0)),
        (winograd._input_a4, (planes_chw, 1, 1, 2, 20, 20, np.zeros((16, 24, 20 * 20), F32), 0)),
        (winograd._output_tiles, (tiles_product, 1, 0, tiles, tiles, maps[0][:48].copy(), True, F32(0.1), True,
                                  np.zeros((48, 40, 40), F32))),
        (fusion._in_place_pass, (values, *maps, True, F32(0), True, F32(0.1), True)),
        (fusion._kept_sum_pass, (values, *maps, True, F32(0), False, other, F32(1), F32(-0.5), F32(0), True,
                                 summed)),
        (fusion._mapped_pass, (values, *maps, True, F32(0.1), True, F32(0), False, summed)),
    ]


@pytest.mark.parametrize("case", range(14))
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
