"""What hardware this process can use: the CPU's name and the OpenCL devices
(`cct device_query` prints them)."""


def cpu_name():
    """The CPU's model name (Linux), or None."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def opencl_devices():
    """One line per OpenCL device pyopencl finds, or one line saying why there is none."""
    try:
        import pyopencl
    except ImportError:
        return ["OpenCL: pyopencl not installed"]
    try:
        platforms = pyopencl.get_platforms()
    except Exception as error:        # no ICD loader / platform: a normal CPU-only machine
        return [f"OpenCL: no platform ({str(error).splitlines()[0] if str(error) else type(error).__name__})"]
    lines = []
    for platform_index, platform in enumerate(platforms):
        try:
            devices = platform.get_devices()
        except Exception:
            devices = []
        for device_index, device in enumerate(devices):
            lines.append(f"OpenCL device {platform_index}:{device_index}: {device.name.strip()} "
                         f"({platform.name.strip()}), {device.max_compute_units} compute units, "
                         f"{device.global_mem_size // 2**20} MiB")
    return lines or ["OpenCL: no devices"]


def measured_gflops(device, size=512, repeats=5):
    """SGEMM GFLOP/s of `device` on size x size x size, best of `repeats`
    (after one warm-up call that builds CLBlast's kernel)."""
    import time

    import numpy as np
    values = np.random.default_rng(0).standard_normal(size * size).astype(np.float32)
    a, b, c = (device.empty(size * size) for _ in range(3))
    device.upload(a, values)
    device.upload(b, values)
    device.gemm(False, False, size, size, size, 1.0, a, b, 0.0, c)
    device.finish()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        device.gemm(False, False, size, size, size, 1.0, a, b, 0.0, c)
        device.finish()
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best / 1e9


def describe_opencl_device(index):
    """device_query --gpu: the device's name, platform, compute units, memory and measured SGEMM GFLOP/s."""
    from cct.devices import opencl
    device = opencl.device(index)
    cl_device = device.cl_device
    return [f"Device id: {index}",
            f"Name: {device.name}",
            f"Platform: {cl_device.platform.name.strip()} ({cl_device.version.strip()})",
            f"Compute units: {cl_device.max_compute_units}",
            f"Global memory: {cl_device.global_mem_size // 2 ** 20} MiB "
            f"(largest buffer {cl_device.max_mem_alloc_size // 2 ** 20} MiB)",
            f"Measured SGEMM (CLBlast, 512^3): {measured_gflops(device):.1f} GFLOP/s"]
