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
    everything else in cct expects str (a layer name, a blob name, a path)."""
    for field, value in message.ListFields():
        name = f"{path}{field.name}"
        values = value if field.is_repeated else [value]
        for index, item in enumerate(values):
            where = f"{name}[{index}]" if field.is_repeated else name
            if field.type == field.TYPE_STRING and isinstance(item, bytes):
                return where, item
            if field.type == field.TYPE_MESSAGE:
                found = undecoded_string(item, where + ".")
                if found:
                    return found
    return None
