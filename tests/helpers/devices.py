"""Devices for tests: the OpenCL device where one exists (pocl in CI),
else a skip that says why; and a runner that applies one op on a device
and on the numpy reference device to the same inputs."""
import numpy as np
import pytest

from cct.devices import opencl
from cct.devices.cpu import CPU
from helpers.requirements import require


# A fixture's param for the OpenCL device: the tests that use the fixture are
# marked `opencl` (-m "not opencl" leaves them out; conftest skips them, or
# fails them under CI=true, where OpenCL is missing).
OPENCL = pytest.param("opencl", marks=pytest.mark.opencl)


def opencl_or_skip(index=0):
    require("opencl")
    return opencl.device(index)


def on_device(device, host_arrays):
    """Device buffers holding copies of the host arrays (flat float32)."""
    buffers = []
    for array in host_arrays:
        flat = np.ascontiguousarray(array, np.float32).reshape(-1)
        buffer = device.empty(flat.size)
        device.upload(buffer, flat)
        buffers.append(buffer)
    return buffers


def to_host(device, buffer, count):
    out = np.empty(count, np.float32)
    device.download(buffer, out)
    return out


def same_op(device, op, arrays, outputs, *args, **kwargs):
    """Run `op(*buffers, *args)` on `device` and on CPU over copies of `arrays`
    (inputs and output buffers alike); return [(device result, reference)]
    for the buffers at the indexes `outputs`."""
    results = []
    for target in (device, CPU):
        buffers = on_device(target, arrays)
        getattr(target, op)(*buffers, *args, **kwargs) if not callable(op) else op(target, *buffers)
        results.append([to_host(target, buffers[i], np.asarray(arrays[i]).size) for i in outputs])
    return list(zip(*results))


def run_both_ways(device, prototxt, arrays, num_tops=1, in_place=False, phase=None, seed=3,
                  propagate_down=None, in_place_bottom=0, random_seed=None, configure=None, settings=None):
    """A float32 layer from LayerParameter text run twice on copies of the
    same bottoms and parameters: with its own forward and backward (the host
    code, the reference), and with forward_on/backward_on on `device`. Top
    diffs are random (fixed seed). `in_place`: top 0 is bottom 0 (bottom
    `in_place_bottom` when given). `random_seed`: the process's random stream
    (cct.core.rng) is seeded with it before each forward, so a layer that
    draws (Dropout) draws the same numbers both ways. `configure(layer)` is
    called on each new layer before its set_up (e.g. Split's aliases);
    `settings`, run settings given after it (Layer.configure, as a net's
    executor gives them: {"lowering_budget_mb": 1}).
    Returns {name: (device value, host value)} for every top's data, every
    bottom's diff propagate_down asks for and every parameter's diff (read
    back through Blob.data/.diff)."""
    import cct
    from cct.core.blob import Blob
    from cct.core.rng import set_random_seed
    from cct.testing.gradient_check import make_layer

    phase = cct.TRAIN if phase is None else phase
    results = {}
    params = None
    for run in ("host", "device"):
        layer = make_layer(prototxt, phase)
        if configure is not None:
            configure(layer)
        bottoms = []
        for array in arrays:
            blob = Blob(np.shape(array), np.float32)
            blob.data[...] = array
            bottoms.append(blob)
        tops = [bottoms[in_place_bottom]] if in_place else [Blob(dtype=np.float32) for _ in range(num_tops)]
        layer.set_up(bottoms, tops)
        if settings is not None:
            layer.configure(settings)
        if params is None:
            params = [blob.data.copy() for blob in layer.blobs]
        for blob, values in zip(layer.blobs, params):
            blob.data[...] = values
            blob.diff[...] = 0.5                      # parameter gradients accumulate into what is there
        layer.reshape(bottoms, tops)
        assert layer.runs_on(device, bottoms, tops), f"{layer.type} has no device path for these blobs"
        if random_seed is not None:
            set_random_seed(random_seed)
        if run == "host":
            layer.forward(bottoms, tops)
        else:
            layer.forward_on(device, bottoms, tops)
        outputs = {f"top{i}": top.data.copy() for i, top in enumerate(tops)}
        diff_rng = np.random.default_rng(seed + 1)
        for top in tops:
            top.diff[...] = diff_rng.standard_normal(top.shape)
        down = propagate_down or [True] * len(bottoms)
        if run == "host":
            layer.backward(tops, down, bottoms)
        else:
            layer.backward_on(device, tops, down, bottoms)
        outputs.update({f"bottom{i}.diff": b.diff.copy() for i, b in enumerate(bottoms) if down[i]})
        outputs.update({f"param{i}.diff": p.diff.copy() for i, p in enumerate(layer.blobs)})
        for name, value in outputs.items():
            results.setdefault(name, []).append(value)
    return {name: (device_value, host_value) for name, (host_value, device_value) in results.items()}


def assert_close_both_ways(results, tolerance=1e-5):
    """Every device value within `tolerance` of the host's, relative to the host's largest."""
    for name, (ours, reference) in results.items():
        scale = max(float(np.abs(reference).max(initial=0)), 1e-6)
        error = float(np.abs(ours - reference).max(initial=0)) / scale
        assert error <= tolerance, f"{name}: relative error {error:.3g} > {tolerance}"
