"""Exceptions cct raises. Every message names where the problem is: the file,
the layer (name and type) and the field, so a user can fix their prototxt."""
from typing import Any, Optional


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


class MemoryLimitError(CctError, MemoryError):
    """An array refused before it is allocated: it would not fit in memory.
    The message is `what` + `need` ("blob" + " of shape (64, 1000000000) needs
    238 GiB, ..."); `blob` is the Blob being sized (None for a work array), so
    the layer that catches it can say which of its tops it was and re-raise
    it renamed (cct.core.layer.Layer.naming_allocations)."""

    def __init__(self, what: str, need: str, blob: Any = None, named: bool = False):
        super().__init__(f"{what}{need}")
        self.what, self.need, self.blob, self.named = what, need, blob, named

    def renamed(self, what: str) -> "MemoryLimitError":
        """The same error under a fuller name, final: the layer and the field."""
        return MemoryLimitError(what, self.need, named=True)

    def noted(self, note: str) -> "MemoryLimitError":
        """The same error with `note` added to its message."""
        return MemoryLimitError(self.what, self.need + note, self.blob, self.named)


def layer_where(layer_param: Any, source: Optional[str] = None) -> str:
    """`layer 'conv1' (Convolution)`, with the file when known."""
    where = f"layer '{layer_param.name}' ({layer_param.type})"
    return f"{source}: {where}" if source else where
