"""The only way to talk to hardware: today the CPU's numba kernel compiler
(jit); later the device interface and OpenCL. Layers and lowering may import it."""
