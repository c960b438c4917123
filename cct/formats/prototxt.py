"""Reading and writing Caffe messages: prototxt text and binary protobuf.

Parse errors carry the file, line and column; an unknown field is an error,
as in Caffe (text_format rejects it), never skipped.
"""
import os
import re
import tempfile

from google.protobuf import text_format
from google.protobuf.message import DecodeError

from cct.core.errors import ConfigError
from cct.proto import caffe_pb2


def parse_text(text, message, source="<string>"):
    try:
        text_format.Parse(text, message)
    except text_format.ParseError as error:
        where = _enclosing_layer(text, error.GetLine(), error.GetColumn()) if error.GetLine() else ""
        raise ConfigError(f"{source}:{error}{where}") from None
    return message


_LAYER_OPEN = re.compile(r"^\s*layers?\s*\{", re.MULTILINE)
_NAME = re.compile(r'\bname\s*:\s*"([^"]*)"')


def _enclosing_layer(text, line, column):
    """' (in layer 'conv1')' for the layer block that the 1-based line and column
    fall in, when the text has `layer {` blocks; a hint for the reader, not a parse."""
    offset = sum(len(row) + 1 for row in text.split("\n")[:line - 1]) + column
    starts = [m.start() for m in _LAYER_OPEN.finditer(text, 0, offset)]
    if not starts:
        return ""
    following = _LAYER_OPEN.search(text, offset)
    name = _NAME.search(text, starts[-1], following.start() if following else len(text))
    return f" (in layer '{name.group(1)}')" if name else ""


def read_text(path, message):
    """Parse a prototxt file into `message` (an empty protobuf message)."""
    return parse_text(_read(path, "r"), message, source=str(path))


def read_binary(path, message):
    data = _read(path, "rb")
    try:
        message.ParseFromString(data)
    except DecodeError as error:
        raise ConfigError(f"{path}: not a valid binary {message.DESCRIPTOR.name}: {error}") from None
    return message


def read_net(path_or_text, *, is_text=None):
    """A NetParameter from a prototxt path, a binary file, or prototxt text.

    Binary when the file does not parse as text (a .caffemodel used as a net).
    """
    if isinstance(path_or_text, caffe_pb2.NetParameter):
        return path_or_text
    path = os.fspath(path_or_text)
    if is_text is None and not os.path.exists(path) and ("{" in path or "\n" in path or ":" in path):
        return parse_text(path, caffe_pb2.NetParameter())
    if path.endswith((".caffemodel", ".binaryproto", ".pb")):
        return read_binary(path, caffe_pb2.NetParameter())
    return read_text(path, caffe_pb2.NetParameter())


def read_solver(path):
    return read_text(path, caffe_pb2.SolverParameter())


def write_text(message, path):
    atomic_write(path, text_format.MessageToString(message).encode())


def write_binary(message, path):
    atomic_write(path, message.SerializeToString())


def atomic_write(path, payload):
    """Write bytes so that `path` is either the old file or the whole new one:
    a crash or kill mid-write never leaves a truncated snapshot."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    handle, temp_path = tempfile.mkstemp(dir=folder, prefix=".tmp-" + os.path.basename(path))
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(payload)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp_path, path)
    except BaseException:
        if os.path.exists(temp_path):
            os.unlink(temp_path)
        raise


def _read(path, mode):
    try:
        with open(path, mode) as handle:
            return handle.read()
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a folder, expected a file") from None
