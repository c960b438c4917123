"""Every Caffe layer type, one module per family. Importing this package
registers them all under their Caffe type names (see cct.core.layer.register)."""
import importlib

_FAMILIES = ("data_input", "neuron", "conv", "pooling", "inner_product",
             "normalization", "loss", "metrics", "shape", "elementwise", "recurrent", "data", "python_layer",
             "ssd", "yolo", "segmentation", "roi", "depthwise")

for _family in _FAMILIES:
    importlib.import_module(f"{__name__}.{_family}")


def __getattr__(name):
    """pycaffe scripts do `from caffe import layers as L` and call `L.Convolution(...)`.
    With `import cct as caffe` that name is this package, so a capitalized name that is
    not a family module resolves to NetSpec's layer factory of that type."""
    if name.startswith("_"):
        raise AttributeError(name)
    from cct.net_spec import layers as spec_layers
    return getattr(spec_layers, name)
