"""Reading a text file cct is given (a prototxt, an image list, a window
file): as UTF-8, with every way it can fail as the caller's CctError naming
the file, and for bytes that are not UTF-8 the line and column too."""


def read_text_file(path, error, what="file"):
    """The text of the file at `path`; a missing file, a folder, an unreadable
    file or bytes that are not UTF-8 raise `error` (a CctError class), its
    message starting with `what` ("layer 'data' (ImageData): image list")."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except (FileNotFoundError, ValueError):         # ValueError: a null byte in the name
        raise error(f"{what} {str(path)!r} not found") from None
    except IsADirectoryError:
        raise error(f"{what} {str(path)!r} is a folder, expected a file") from None
    except OSError as failure:
        raise error(f"{what} {str(path)!r} cannot be read: {failure.strerror}") from None
    return decode_utf8(data, path, error, f"{what}: ")


def decode_utf8(data, path, error, prefix=""):
    """`data`, the bytes of the file at `path`, as text; bytes that are not
    UTF-8 raise `error` with `prefix` + "path:line:column: not UTF-8 text"."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as failure:
        line = data.count(b"\n", 0, failure.start) + 1
        column = failure.start - (data.rfind(b"\n", 0, failure.start) + 1) + 1
        raise error(f"{prefix}{path}:{line}:{column}: not UTF-8 text "
                    f"(byte 0x{data[failure.start]:02x})") from None


def undecoded_string(message, path=""):
    """(field path, bytes) of the first string field of `message`, nested
    messages included, that holds bytes which are not UTF-8, else None: a
    binary file can carry them, and protobuf hands them back as bytes, where
    everything else in cct expects str (a layer name, a blob name, a path).
    Only string fields and messages that can hold one are visited: a weight
    file's millions of floats are never touched (issue 39)."""
    for field, value in message.ListFields():
        if field.type == field.TYPE_STRING:
            found = _bytes_in(field, value, path)
        elif field.type == field.TYPE_MESSAGE and _holds_strings(field.message_type):
            found = _bytes_in_messages(field, value, path)
        else:
            continue
        if found:
            return found
    return None


def _bytes_in(field, value, path):
    values = value if field.is_repeated else [value]
    for index, item in enumerate(values):
        if isinstance(item, bytes):
            return _where(field, index, path), item
    return None


def _bytes_in_messages(field, value, path):
    for index, item in enumerate(value if field.is_repeated else [value]):
        found = undecoded_string(item, _where(field, index, path) + ".")
        if found:
            return found
    return None


def _where(field, index, path):
    return f"{path}{field.name}[{index}]" if field.is_repeated else f"{path}{field.name}"


_HOLDS_STRINGS = {}     # message full name -> whether it or a message inside it has a string field


def _holds_strings(descriptor):
    """Whether a message of this type can hold a string, at any depth
    (BlobProto cannot: the check skips a blob whole)."""
    name = descriptor.full_name
    if name not in _HOLDS_STRINGS:
        _HOLDS_STRINGS[name] = True             # a message type that contains itself: assume it may
        _HOLDS_STRINGS[name] = any(
            field.type == field.TYPE_STRING
            or (field.type == field.TYPE_MESSAGE and _holds_strings(field.message_type))
            for field in descriptor.fields)
    return _HOLDS_STRINGS[name]
