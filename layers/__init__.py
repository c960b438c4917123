"""Every Caffe layer type, one module per family. Importing this package
registers them all under their Caffe type names (see cct.layer.register)."""
import importlib

_FAMILIES = ("data_input", "neuron", "activation", "conv", "pooling", "inner_product",
             "normalization", "loss", "metrics", "shape", "elementwise", "data", "python_layer")

for _family in _FAMILIES:
    try:
        importlib.import_module(f"{__name__}.{_family}")
    except ModuleNotFoundError as error:
        # Families are being written in parallel; only a missing family module is tolerated.
        if error.name != f"{__name__}.{_family}":
            raise
