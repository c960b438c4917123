"""Exceptions cct raises. Every message names where the problem is: the file,
the layer (name and type) and the field, so a user can fix their prototxt."""


class CctError(Exception):
    """Base of every error cct raises on purpose."""


class ConfigError(CctError, ValueError):
    """A prototxt, solver or layer parameter that is malformed or out of range."""


class ShapeError(CctError, ValueError):
    """Blob shapes that do not fit a layer."""


class WeightsError(CctError, ValueError):
    """A weight file whose layers or blobs do not match the net."""


class DataError(CctError, IOError):
    """A data source that is missing or holds records that cannot be decoded."""


def layer_where(layer_param, source=None):
    """`layer 'conv1' (Convolution)`, with the file when known."""
    where = f"layer '{layer_param.name}' ({layer_param.type})"
    return f"{source}: {where}" if source else where
