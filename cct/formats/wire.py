"""A .caffemodel's blob values straight from its bytes (issue 39).

The protobuf wire format is walked down to each BlobProto (NetParameter.layer
-> LayerParameter.blobs, NetParameter.layers -> V1LayerParameter.blobs); the
packed `data` and `double_data` of each blob become numpy views of the file's
bytes, and the blobs' values (diffs included: loading reads none, as Caffe's
CopyTrainedLayersFrom) are cut out of the message. Protobuf then parses the
rest, a few kilobytes, and each value is copied once, into the net's array.

Whatever the walk does not expect (a V0 layer, values not packed, a length past
the end) raises Unexpected: the caller parses the whole file with protobuf,
which accepts or refuses it as it always did.
"""
import numpy as np

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5
# Each message the walk enters: {field number: the message that field holds}.
_FIELDS = {
    "NetParameter": {100: "LayerParameter", 2: "V1LayerParameter"},
    "LayerParameter": {7: "BlobProto"},
    "V1LayerParameter": {6: "BlobProto", 1: "V0LayerParameter"},
}
_VALUES = {5: np.dtype("<f4"), 8: np.dtype("<f8")}       # BlobProto.data, double_data
_DIFFS = {6: 4, 9: 8}                                      # diff, double_diff: bytes per value


class Unexpected(Exception):
    """The bytes take a form the walk leaves to protobuf."""


def split_blobs(data):
    """(skeleton, values) of `data`, a serialized NetParameter: the same message
    without its blobs' values, and each blob's values in file order (float32
    views of `data`, or float64 where the blob has double_data, which Caffe
    reads in preference to data)."""
    values = []
    skeleton = b"".join(_message(data, 0, len(data), "NetParameter", values))
    return skeleton, values


def _message(data, start, end, name, values):
    """The pieces of the message in data[start:end], blobs' values cut out."""
    pieces = []
    for number, wire, field_start, value_start, value_end in _fields(data, start, end):
        inner = _FIELDS[name].get(number) if wire == _LENGTH else None
        if inner is None:
            pieces.append(data[field_start:value_end])
        elif inner == "V0LayerParameter":
            raise Unexpected("a V0 layer: its blobs move in the V0 upgrade")
        elif inner == "BlobProto":
            pieces += field_pieces(number, _blob(data, value_start, value_end, values))
        else:
            pieces += field_pieces(number, _message(data, value_start, value_end, inner, values))
    return pieces


def _blob(data, start, end, values):
    """A BlobProto's pieces without its values; its values appended to `values`."""
    pieces, chunks = [], {number: [] for number in _VALUES}
    for number, wire, field_start, value_start, value_end in _fields(data, start, end):
        if number not in _VALUES and number not in _DIFFS:
            pieces.append(data[field_start:value_end])
            continue
        size = _VALUES[number].itemsize if number in _VALUES else _DIFFS[number]
        if wire != _LENGTH or (value_end - value_start) % size:
            raise Unexpected(f"BlobProto field {number}: not packed values")
        if number in _VALUES and value_end > value_start:
            chunks[number].append(np.frombuffer(data, _VALUES[number], (value_end - value_start) // size,
                                                value_start))
    chosen = chunks[8] or chunks[5]
    values.append(chosen[0] if len(chosen) == 1 else    # a field given twice is concatenated, as protobuf does
                  np.concatenate(chosen) if chosen else np.zeros(0, np.float32))
    return pieces


def _fields(data, start, end):
    """(number, wire type, field start, value start, value end) of each field
    of the message in data[start:end]."""
    position = start
    while position < end:
        field_start = position
        key, position = _read_varint(data, position, end)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise Unexpected("field number 0")
        value_start = position
        if wire == _VARINT:
            _, position = _read_varint(data, position, end)
        elif wire == _FIXED64:
            position += 8
        elif wire == _FIXED32:
            position += 4
        elif wire == _LENGTH:
            length, value_start = _read_varint(data, position, end)
            position = value_start + length
        else:
            raise Unexpected(f"wire type {wire}")          # groups: left to protobuf
        if position > end:
            raise Unexpected("a field runs past its message")
        yield number, wire, field_start, value_start, position


def _read_varint(data, position, end):
    value, shift = 0, 0
    while position < end and shift < 70:
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7
    raise Unexpected("a varint runs past its message")


def varint(value):
    """The bytes of `value` (>= 0) as a protobuf varint."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def field_pieces(number, pieces):
    """A length-delimited field `number` holding the concatenated `pieces`
    (bytes, or memoryviews of bytes)."""
    length = sum(len(piece) if isinstance(piece, bytes) else piece.nbytes for piece in pieces)
    return [varint((number << 3) | _LENGTH) + varint(length)] + pieces
