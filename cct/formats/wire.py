"""A .caffemodel's blob values straight from its bytes (issue 39).

The protobuf wire format is walked down to each BlobProto (NetParameter.layer
-> LayerParameter.blobs, NetParameter.layers -> V1LayerParameter.blobs); the
packed `data` and `double_data` of each blob, or NVIDIA Caffe's `raw_data` of
`raw_data_type` (FLOAT16, FLOAT or DOUBLE), become numpy views of the file's
bytes, and the blobs' values (diffs included: loading reads none, as Caffe's
CopyTrainedLayersFrom) are cut out of the message. Protobuf then parses the
rest, a few kilobytes, and each value is copied once, into the net's array.

Whatever the walk does not expect (a V0 layer, values not packed, a length past
the end; raw_data beside data, of a type cct does not read, or ending inside a
value) raises Unexpected: the caller parses the whole file with protobuf, which
accepts or refuses it as it always did (refusals of raw_data: weights.py).
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
_DIFFS = {6: 4, 9: 8, 13: 1}                               # diff, double_diff, raw_diff: bytes per value
_RAW_TYPE, _RAW_DATA = 10, 12                              # BlobProto.raw_data_type, raw_data (NVIDIA Caffe)
# NVIDIA Caffe's Type (DOUBLE, FLOAT, FLOAT16) -> its raw_data's values: its
# Blob::ToProto writes the blob's memory, little-endian on its machines.
RAW_TYPES = {0: np.dtype("<f8"), 1: np.dtype("<f4"), 2: np.dtype("<f2")}


class Unexpected(Exception):
    """The bytes take a form the walk leaves to protobuf."""


def split_blobs(data):
    """(skeleton, values) of `data`, a serialized NetParameter: the same message
    without its blobs' values, and each blob's values in file order (float32
    views of `data`, or float64 where the blob has double_data, which Caffe
    reads in preference to data; where it has neither, its raw_data as
    raw_data_type says: float16, float32 or float64). A blob's raw_data_type
    stays in the skeleton only where the values are its raw_data."""
    values = []
    skeleton = b"".join(_message(data, 0, len(data), "NetParameter", values))
    return skeleton, values


def _message(data, start, end, name, values):
    """The pieces of the message in data[start:end], blobs' values cut out."""
    pieces = []
    for number, wire, field_start, value_start, value_end in fields(data, start, end):
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
    pieces, chunks, raw = [], {number: [] for number in _VALUES}, {}
    for number, wire, field_start, value_start, value_end in fields(data, start, end):
        if number == _RAW_DATA or number == _RAW_TYPE:
            raw[number] = _raw_field(data, number, wire, value_start, value_end)
            if number == _RAW_TYPE:
                pieces.append(data[field_start:value_end])
            continue
        if number not in _VALUES and number not in _DIFFS:
            pieces.append(data[field_start:value_end])
            continue
        size = _VALUES[number].itemsize if number in _VALUES else _DIFFS[number]
        if wire != _LENGTH or (value_end - value_start) % size:
            raise Unexpected(f"BlobProto field {number}: not packed values")
        if number in _VALUES and value_end > value_start:
            chunks[number].append(np.frombuffer(data, _VALUES[number], (value_end - value_start) // size,
                                                value_start))
    chosen = _raw_values(data, raw, chunks) or chunks[8] or chunks[5]
    values.append(chosen[0] if len(chosen) == 1 else    # a field given twice is concatenated, as protobuf does
                  np.concatenate(chosen) if chosen else np.zeros(0, np.float32))
    return pieces


def _raw_field(data, number, wire, start, end):
    """raw_data's (start, end) in `data`, or raw_data_type's value; the last
    one given counts, as protobuf keeps the last of an optional field."""
    if number == _RAW_DATA and wire == _LENGTH:
        return start, end
    if number == _RAW_TYPE and wire == _VARINT:
        return _read_varint(data, start, end)[0]
    raise Unexpected(f"BlobProto field {number}: wire type {wire}")


def _raw_values(data, raw, chunks):
    """[raw_data as its type's view] where the blob holds raw_data alone;
    anything else with a raw field (data beside it, a type cct does not read,
    values in part) is left to protobuf, whose message names the field."""
    if not raw:
        return []
    if chunks[5] or chunks[8] or _RAW_DATA not in raw or raw.get(_RAW_TYPE) not in RAW_TYPES:
        raise Unexpected("BlobProto raw_data beside data, or without a type cct reads")
    (start, end), dtype = raw[_RAW_DATA], RAW_TYPES[raw[_RAW_TYPE]]
    if (end - start) % dtype.itemsize:
        raise Unexpected("BlobProto raw_data: not a whole number of values")
    return [np.frombuffer(data, dtype, (end - start) // dtype.itemsize, start)] if end > start else []


def fields(data, start, end):
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
