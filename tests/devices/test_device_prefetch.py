"""A data layer's batches in a device run (issue 37's pipeline): the prefetch
thread uploads each batch on the device's second queue as it loads it, so
the compute queue moves no input; the numbers are the host run's. And a
small upload is queued from a copy of its own: the caller may write its
array at once, and the queue does not drain; a large one waits instead."""
import threading

import numpy as np
import pytest

import cct
from cct.runtime import settings
from helpers.data import raw_datum, write_lmdb
from helpers.devices import opencl_or_skip

pytestmark = pytest.mark.opencl

BATCH, SHAPE = 4, (2, 9, 9)


def net_text(source):
    return f"""
name: "prefetched"
layer {{ name: "data" type: "Data" top: "data" top: "label"
  data_param {{ source: "{source}" batch_size: {BATCH} backend: LMDB prefetch: 1 }} transform_param {{ scale: 0.01 }} }}
layer {{ name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param {{ num_output: 3 kernel_size: 3 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
  inner_product_param {{ num_output: 5 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}
"""


@pytest.fixture
def prototxt(tmp_path):
    generator = np.random.default_rng(3)
    pixels = generator.integers(0, 256, (10,) + SHAPE)
    source = write_lmdb(tmp_path / "db", [raw_datum(p, int(i % 5)) for i, p in enumerate(pixels)])
    path = tmp_path / "net.prototxt"
    path.write_text(net_text(source))
    return str(path)


class Uploads:
    """Bytes each thread uploaded, by way (the compute queue, the second queue):
    `moved` since it was last cleared, `total` since the start."""

    def __init__(self, device, monkeypatch):
        self.moved, self.total = {}, {}
        for name in ("upload", "upload_aside"):
            monkeypatch.setattr(device, name, self._counting(name, getattr(device, name)))

    def _counting(self, name, call):
        def counted(buffer, host, *args):
            key = (name, threading.current_thread() is threading.main_thread())
            self.moved[key] = self.moved.get(key, 0) + host.nbytes
            self.total[key] = self.total.get(key, 0) + host.nbytes
            return call(buffer, host, *args)
        return counted


def run(prototxt, forwards, mode, device=None):
    """(the losses and the conv outputs of `forwards` forwards, the net) in `mode`."""
    if mode == "gpu":
        settings.set_device_id(device.index)
    settings.set_mode(mode)
    cct.set_random_seed(11)
    net = cct.Net(prototxt, cct.TRAIN)
    results = []
    for _ in range(forwards):
        net.forward()
        results.append((float(net.blobs["loss"].data), net.blobs["conv"].data.copy()))
    return results, net


def test_after_the_first_batches_no_input_goes_up_on_the_compute_queue(prototxt, monkeypatch):
    device = opencl_or_skip()
    on_host, _ = run(prototxt, 6, "cpu")
    uploads = Uploads(device, monkeypatch)
    settings.set_device_id(device.index)
    settings.set_mode("gpu")
    cct.set_random_seed(11)
    net = cct.Net(prototxt, cct.TRAIN)
    on_device = []
    for index in range(6):
        if index == 3:                    # the batches loaded before the device was known (2) are used up
            uploads.moved.clear()
        net.forward()
        on_device.append((float(net.blobs["loss"].data), net.blobs["conv"].data.copy()))
    assert net.executor.placed[0] == device.name
    batch_bytes = 4 * BATCH * (int(np.prod(SHAPE)) + 1)
    # the prefetch thread's: the last three batches at least, some maybe before the clear
    # (it works ahead: the batch after them may still be going up, so not counted here)
    assert uploads.total.get(("upload_aside", False), 0) >= 3 * batch_bytes
    assert uploads.moved.get(("upload", True), 0) == 0 and ("upload_aside", True) not in uploads.moved
    assert net.blobs["data"].heads()[0] == "synced"
    for (loss, conv), (expected_loss, expected_conv) in zip(on_device, on_host):
        np.testing.assert_allclose(conv, expected_conv, rtol=1e-5, atol=1e-6)
        assert loss == pytest.approx(expected_loss, rel=1e-5)


def test_a_host_run_after_a_device_run_stops_the_uploads(prototxt, monkeypatch):
    device = opencl_or_skip()
    _, net = run(prototxt, 3, "gpu", device)
    uploads = Uploads(device, monkeypatch)
    settings.set_mode("cpu")
    for _ in range(4):
        net.forward()
    # at most the batches the thread had begun before the mode changed
    assert uploads.moved.get(("upload_aside", False), 0) <= 2 * 4 * BATCH * (int(np.prod(SHAPE)) + 1)


def test_an_upload_is_queued_from_a_copy_of_its_own():
    device = opencl_or_skip()
    values = np.arange(1 << 16, dtype=np.float32)
    buffer = device.empty(values.size)
    device.upload(buffer, values)
    expected = values.copy()
    values[...] = -1                      # written at once: the queued copy is the caller's values before
    out = np.empty_like(values)
    device.download(buffer, out)
    np.testing.assert_array_equal(out, expected)


def test_a_large_upload_waits_for_the_queue_instead_of_a_copy():
    from cct.devices.opencl import STAGED_BYTES
    device = opencl_or_skip()
    values = np.arange(STAGED_BYTES // 4 + 1, dtype=np.float32)
    buffer = device.empty(values.size)
    device.upload(buffer, np.ones(4, np.float32))         # a small one queued before
    device.upload(buffer, values)
    assert not device._pending                            # the queue drained: nothing held
    values[...] = -1
    out = np.empty_like(values)
    device.download(buffer, out)
    np.testing.assert_array_equal(out, np.arange(values.size, dtype=np.float32))


def test_queued_uploads_are_let_go_once_done():
    device = opencl_or_skip()
    buffer = device.empty(16)
    for _ in range(50):
        device.upload(buffer, np.ones(16, np.float32))
    device.queue.finish()                 # done, though the device was not told
    device.upload(buffer, np.ones(16, np.float32))
    assert len(device._pending) <= 1      # let go at the next upload, oldest first
    device.finish()
    assert not device._pending
