"""Reading and writing Caffe messages: prototxt text and binary protobuf.

Parse errors carry the file, line and column; an unknown field is an error,
as in Caffe (text_format rejects it), never skipped.
"""
import contextlib
import errno
import os
import re
import shutil
import socket
import stat
import tempfile

from google.protobuf import text_format
from google.protobuf.message import DecodeError

from cct.core.errors import ConfigError
from cct.formats import textproto
from cct.formats.forks import resolve_fork_fields
from cct.formats.text import decode_utf8
from cct.proto import caffe_pb2


def parse_text(text, message, source="<string>"):
    if textproto.parse(text, message):     # the everyday subset, in a regular expression's pass
        return message
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
    """Parse a prototxt file into `message` (an empty protobuf message); bytes
    that are not UTF-8 are a ConfigError naming the file, line and column."""
    return parse_text(decode_utf8(_read(path, "rb"), path, ConfigError), message, source=str(path))


def read_binary(path, message):
    return parse_binary(_read(path, "rb"), message, path)


def parse_binary(data, message, path):
    """Parse `data`, the bytes of the file at `path`, into `message`; a
    NetParameter's fork-numbered layer fields moved to cct's (cct.formats.forks)."""
    try:
        message.ParseFromString(data)
    except DecodeError as error:
        raise ConfigError(f"{path}: not a valid binary {message.DESCRIPTOR.name}: {error}") from None
    if isinstance(message, caffe_pb2.NetParameter):
        resolve_fork_fields(message, data)
    return message


def read_bytes(path):
    """The bytes of the file at `path`; a missing file or a folder is a ConfigError."""
    return _read(path, "rb")


def read_net(path_or_text, *, is_text=None):
    """A NetParameter from a prototxt path, a binary file, or prototxt text.

    Binary when the file does not parse as text (a .caffemodel used as a net).
    """
    if isinstance(path_or_text, caffe_pb2.NetParameter):
        return path_or_text
    path = os.fspath(path_or_text)
    if is_text is None and _is_text(path):
        return parse_text(path, caffe_pb2.NetParameter(), source=TEXT_SOURCE)
    if path.endswith((".caffemodel", ".binaryproto", ".pb")):
        return read_binary(path, caffe_pb2.NetParameter())
    return read_text(path, caffe_pb2.NetParameter())


TEXT_SOURCE = "<prototxt text>"           # what errors call a net given as text, not as a file


def _is_text(path):
    return not os.path.exists(path) and ("{" in path or "\n" in path or ":" in path)


def net_source(path_or_text):
    """How messages name a net: its file, "<prototxt text>" or "<NetParameter>"."""
    if isinstance(path_or_text, caffe_pb2.NetParameter):
        return "<NetParameter>"
    path = os.fspath(path_or_text)
    return TEXT_SOURCE if _is_text(path) else path


def read_solver(path):
    return read_text(path, caffe_pb2.SolverParameter())


def write_text(message, path):
    atomic_write(path, text_format.MessageToString(message).encode())


def write_binary(message, path):
    atomic_write(path, message.SerializeToString())


def atomic_write(path, payload):
    """Write bytes (or a list of bytes-like pieces, written in turn) so that
    `path` is either the old file or the whole new one: a crash or kill
    mid-write never leaves a truncated snapshot."""
    with atomic_path(path) as temp_path:
        with open(temp_path, "wb") as out:
            for piece in [payload] if isinstance(payload, (bytes, bytearray, memoryview)) else payload:
                out.write(piece)


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary path in `path`'s folder for writers that need a file
    name (h5py, matplotlib, LMDB); it ends in the same name, so a writer that
    picks its format from the extension picks the right one. When the block
    ends without an exception, what was written there (a file, or a folder such
    as an LMDB) is flushed to disk, renamed over `path`, and the folder's entry
    is flushed too: after a crash, `path` holds the old contents or the whole
    new ones. On an exception the temporary is removed and `path` is untouched.
    A folder replacing a folder takes two renames (the old one aside, the new
    one in: a rename cannot replace a non-empty folder); a crash between them
    leaves the old folder in the hidden .tmp-NAME-* folder beside `path`.
    A scratch folder whose writer was killed is removed by the next write in
    its folder (_remove_abandoned_scratch), unless it holds such an old folder.
    Permissions are those a plain open(path, "w") gives (see _plain_modes).

        with atomic_path("net.caffemodel.h5") as temp_path:
            with h5py.File(temp_path, "w") as out: ...
    """
    target = os.path.abspath(os.fspath(path))
    folder, name = os.path.split(target)
    os.makedirs(folder, exist_ok=True)
    _remove_abandoned_scratch(folder)
    # A private folder, not a temporary file: the writer creates its own file
    # or folder under the final name, and a failure removes one thing.
    scratch = tempfile.mkdtemp(dir=folder, prefix=f".tmp-{name}-{_HOST}-{os.getpid()}-")
    temp_path = os.path.join(scratch, name)
    try:
        yield temp_path
        if not os.path.lexists(temp_path):
            raise FileNotFoundError(errno.ENOENT, f"nothing was written for {path}", temp_path)
        _plain_modes(temp_path, target)
        _fsync_written(temp_path)
        if os.path.isdir(temp_path) and os.path.isdir(target) and not os.path.islink(target):
            os.replace(target, os.path.join(scratch, ".old"))    # removed with the scratch folder
        os.replace(temp_path, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    # The rename (and the scratch folder's removal) last only once the folder is on disk.
    _fsync(folder)


_HOST = socket.gethostname().replace("-", "_")
_SCRATCH = re.compile(r"\.tmp-.+-(?P<host>[^-]+)-(?P<pid>\d+)-[^-]+")


def _remove_abandoned_scratch(folder):
    """Remove the scratch folders a killed writer on this host left in
    `folder` (a kill skips the cleanup; a partial snapshot can be hundreds of
    MB): those whose process is gone. Another host's, on a shared file
    system, are left alone: its processes cannot be seen from here."""
    for entry in os.listdir(folder):
        match = _SCRATCH.fullmatch(entry)
        scratch = os.path.join(folder, entry)
        # (one holding .old keeps the only copy of a folder a kill caught between its two renames)
        if (match and match["host"] == _HOST and not _alive(int(match["pid"]))
                and not os.path.lexists(os.path.join(scratch, ".old"))):
            shutil.rmtree(scratch, ignore_errors=True)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:          # another user's process
        return True
    return True


def _plain_modes(temp_path, target):
    """Give what was written the permissions a plain open(target, "w") would:
    an existing file keeps its own; a new file, or each file of a written
    folder, gets 0o666 less the umask, however its writer created it (a
    private temporary, a library's own mode). Folders keep their mkdir modes."""
    new_file_mode = _new_file_mode(temp_path + ".mode-probe")
    if os.path.islink(temp_path):
        return
    if not os.path.isdir(temp_path):
        existing_mode = _existing_file_mode(target)
        os.chmod(temp_path, new_file_mode if existing_mode is None else existing_mode)
        return
    for root, _, files in os.walk(temp_path):
        for file_name in files:
            path = os.path.join(root, file_name)
            if not os.path.islink(path):
                os.chmod(path, new_file_mode)


def _existing_file_mode(path):
    try:
        info = os.stat(path)
    except OSError:
        return None
    return stat.S_IMODE(info.st_mode) if stat.S_ISREG(info.st_mode) else None


def _new_file_mode(probe):
    """The mode open() gives a new file, read off a probe file made at `probe`:
    the umask can only be read by setting it, process-wide, under running
    threads (and a folder's default ACL, which the probe follows, would be missed)."""
    with open(probe, "w"):
        pass
    try:
        return stat.S_IMODE(os.stat(probe).st_mode)
    finally:
        os.remove(probe)


def _fsync_written(path):
    """Flush a written file, or every file in a written folder and the folder itself."""
    if not os.path.isdir(path):
        _fsync(path)
        return
    for root, _, files in os.walk(path):
        for file_name in files:
            _fsync(os.path.join(root, file_name))
        _fsync(root)


def _fsync(path):
    if os.name == "nt" and os.path.isdir(path):
        return                       # Windows cannot open a folder to flush it
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _read(path, mode):
    try:
        with open(path, mode) as handle:
            return handle.read()
    except (FileNotFoundError, ValueError):         # ValueError: a null byte in the name
        raise ConfigError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a folder, expected a file") from None
