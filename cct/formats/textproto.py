"""Protobuf text format's everyday subset, parsed in one regular-expression
pass: what prototxt files are made of (names, `{ }` blocks, decimal numbers,
enum names, true/false, plain quoted strings, `#` comments).

protobuf's own text_format tokenizes in Python, character class by character
class, a large part of a net's load (BENCHMARKS.md, "Behind cct/formats/textproto.py").
Here re.findall does the tokenizing in C and a short loop sets the fields.

Anything outside the subset (escapes, hex or octal integers, numbers for
enums, a singular field given twice, an unknown field, a value out of its
field's range, `[ ]` lists of messages, extensions) makes `parse` give up
and return False, having cleared the message: the caller then parses with
text_format, whose numbers and error messages are the reference. So this
module never decides what a file means where text_format would decide
otherwise; tests/formats/test_textproto.py compares the two on every
prototxt the repository holds.
"""
import re
from typing import Any, Iterator, List

from google.protobuf.descriptor import FieldDescriptor

_TOKENS = re.compile(r"""
    \s+ | \#[^\n]*                                       # skipped: no group
  | ( "[^"\\\n]*" | '[^'\\\n]*'                          # a string without escapes
    | -?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?(?![\w.])   # a decimal number
    | [A-Za-z_]\w*                                       # a name
    | [{}<>:\[\],;]
    | \S[\w.]* )                                         # anything else: no value will take it
""", re.VERBOSE)

_INTEGER = re.compile(r"-?(?:0|[1-9]\d*)\Z")
_DECIMAL = re.compile(r"-?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?\Z")
_FLOAT_MAX = 3.4028234663852886e38      # beyond it text_format's float check decides
_CLOSE = {"{": "}", "<": ">"}
_RANGES = {
    FieldDescriptor.TYPE_INT32: (-2 ** 31, 2 ** 31), FieldDescriptor.TYPE_SINT32: (-2 ** 31, 2 ** 31),
    FieldDescriptor.TYPE_SFIXED32: (-2 ** 31, 2 ** 31), FieldDescriptor.TYPE_INT64: (-2 ** 63, 2 ** 63),
    FieldDescriptor.TYPE_SINT64: (-2 ** 63, 2 ** 63), FieldDescriptor.TYPE_SFIXED64: (-2 ** 63, 2 ** 63),
    FieldDescriptor.TYPE_UINT32: (0, 2 ** 32), FieldDescriptor.TYPE_FIXED32: (0, 2 ** 32),
    FieldDescriptor.TYPE_UINT64: (0, 2 ** 64), FieldDescriptor.TYPE_FIXED64: (0, 2 ** 64),
}
_FLOATS = (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE)
_BOOLS = {"true": True, "false": False}


class _Outside(Exception):
    """The text leaves the subset: text_format decides."""


def parse(text: str, message: Any) -> bool:
    """Parse `text` into the empty `message`, as text_format.Parse would;
    False (and `message` cleared) where the text leaves the subset."""
    if message.ListFields():
        return False                  # text_format's multiple-field checks see what is there
    tokens = iter([token for token in _TOKENS.findall(text) if token])
    try:
        if _fields(tokens, message, None) is not None:
            raise _Outside
    except (_Outside, StopIteration):
        message.Clear()
        return False
    return True


def _fields(tokens: Iterator[str], message: Any, close: Any) -> Any:
    """A message's fields up to `close` (None: the end of the text); returns
    the token that ended it (None at the end)."""
    by_name = message.DESCRIPTOR.fields_by_name
    for name in tokens:
        if name == close:
            return name
        field = by_name.get(name)
        if field is None:
            raise _Outside
        token = next(tokens)
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if token == ":":
                token = next(tokens)
            if token not in _CLOSE:
                raise _Outside
            if field.is_repeated:
                child = getattr(message, name).add()
            else:
                if message.HasField(name):
                    raise _Outside
                child = getattr(message, name)
                child.SetInParent()
            _fields(tokens, child, _CLOSE[token])
        else:
            if token != ":":
                raise _Outside
            token = next(tokens)
            if field.is_repeated:
                getattr(message, name).extend(_values(tokens, field, token))
            else:
                if message.HasField(name) or token == "[":
                    raise _Outside
                setattr(message, name, _scalar(field, token))
    if close is not None:
        raise _Outside                # the text ended inside a block
    return None


def _values(tokens: Iterator[str], field: Any, token: str) -> List[Any]:
    """A repeated scalar's values: one, or a `[a, b]` list."""
    if token != "[":
        return [_scalar(field, token)]
    values = []
    token = next(tokens)
    while token != "]":
        values.append(_scalar(field, token))
        token = next(tokens)
        if token == ",":
            token = next(tokens)
        elif token != "]":
            raise _Outside
    return values


def _scalar(field: Any, token: str) -> Any:
    """The value of `token` for `field`, where text_format would read the same."""
    kind = field.type
    if kind in _FLOATS:
        if _DECIMAL.match(token):
            value = float(token)
            if kind == FieldDescriptor.TYPE_DOUBLE or abs(value) <= _FLOAT_MAX:
                return value
    elif kind in _RANGES:
        if _INTEGER.match(token):
            low, high = _RANGES[kind]
            value = int(token)
            if low <= value < high:
                return value
    elif kind == FieldDescriptor.TYPE_ENUM:
        value = field.enum_type.values_by_name.get(token)
        if value is not None:
            return value.number
    elif kind == FieldDescriptor.TYPE_BOOL:
        if token in _BOOLS:
            return _BOOLS[token]
    elif kind in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
        if token[0] in "\"'":
            value = token[1:-1]
            return value.encode("utf-8") if kind == FieldDescriptor.TYPE_BYTES else value
    raise _Outside
