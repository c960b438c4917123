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
