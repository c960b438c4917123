"""Weights on disk: Caffe's .caffemodel (binary NetParameter) and HDF5 formats,
and the BlobProto <-> numpy conversions they rest on.

Large models (VGG-16 is ~550 MB) load without per-element Python work: the
file is mapped, cct.formats.wire cuts each blob's packed values (or NVIDIA
Caffe's FLOAT16/FLOAT/DOUBLE raw_data) out of the message as views of its
bytes, protobuf parses the rest, and each value is copied once, into the net's
array (float16 to float32: exact); writing builds the packed field bytes
directly from the array's buffer.
"""
import mmap
import os
import queue
import threading

import numpy as np

from cct.formats import pages
from cct.core.errors import CctError, ShapeError, WeightsError
from cct.formats import hdf5
from cct.formats.prototxt import atomic_path, atomic_write, parse_binary, read_bytes
from cct.formats.wire import RAW_TYPES, Unexpected, field_pieces, split_blobs, varint
from cct.proto import caffe_pb2

_PACKED_DATA_TAG = (5 << 3) | 2          # BlobProto.data = 5, length-delimited (packed)
_PACKED_DIFF_TAG = (6 << 3) | 2          # BlobProto.diff = 6
_LAYER_BLOBS = 7                          # LayerParameter.blobs
_NET_LAYER = 100                          # NetParameter.layer


def blob_proto_shape(blob_proto, count=None):
    """The shape a BlobProto describes: legacy num/channels/height/width when any
    is set (Caffe's Blob::FromProto looks at them first), else `shape.dim`,
    else its `count` values (by default those it holds) in one axis."""
    if _has_legacy_shape(blob_proto):
        return (blob_proto.num, blob_proto.channels, blob_proto.height, blob_proto.width)
    if blob_proto.HasField("shape"):
        return tuple(blob_proto.shape.dim)
    return (_stored_count(blob_proto),) if count is None else (count,)


def _stored_count(blob_proto):
    """How many values the BlobProto holds (raw_data's of a type cct reads)."""
    count = len(blob_proto.double_data) or len(blob_proto.data)
    if count or not blob_proto.HasField("raw_data_type") or blob_proto.raw_data_type not in RAW_TYPES:
        return count
    return len(blob_proto.raw_data) // RAW_TYPES[blob_proto.raw_data_type].itemsize


def _has_legacy_shape(blob_proto):
    return any(blob_proto.HasField(f) for f in ("num", "channels", "height", "width"))


# A BlobProto's value fields in the order NVIDIA Caffe's Blob::FromProto reads
# them (BVLC's reads the first two): doubles, floats, raw bytes, raw bytes' type.
_VALUE_FIELDS = {False: ("double_data", "data", "raw_data", "raw_data_type"),
                 True: ("double_diff", "diff", "raw_diff", "raw_diff_type")}


def blob_proto_to_array(blob_proto, diff=False, where=""):
    """A float32 array of the BlobProto's data (or diff), shaped as it says;
    `double_data` (`double_diff`) is read in preference to `data`, then NVIDIA
    Caffe's `raw_data` (`raw_diff`), as NVIDIA's Blob::FromProto reads them."""
    array = _shaped(_stored_values(blob_proto, diff, where), blob_proto, where, diff)
    return np.require(array, np.float32, ["W"])          # raw_data's values are views of the message


def _stored_values(blob_proto, diff=False, where=""):
    """The BlobProto's data (or diff) as stored: float32 from data/double_data,
    raw_data's values in their own type (converted when copied into a blob)."""
    doubles, floats, raw, _ = (getattr(blob_proto, name) for name in _VALUE_FIELDS[diff])
    if doubles or floats or not raw:
        return np.array(doubles or floats, dtype=np.float32)
    return _raw_values(blob_proto, diff, where)


def _raw_values(blob_proto, diff, where):
    """NVIDIA Caffe's raw_data (raw_diff) as its raw_data_type says: FLOAT16,
    FLOAT or DOUBLE; anything else is refused, as NVIDIA Caffe refuses it."""
    *_, field, type_field = _VALUE_FIELDS[diff]
    if not blob_proto.HasField(type_field):          # unset, or a number NVIDIA Caffe's Type lacks
        raise WeightsError(f"{where}BlobProto.{field} has no {type_field} cct knows: "
                           f"it reads FLOAT16, FLOAT and DOUBLE raw values")
    kind, raw = getattr(blob_proto, type_field), getattr(blob_proto, field)
    if kind not in RAW_TYPES:
        raise WeightsError(f"{where}BlobProto.{type_field} is {caffe_pb2.Type.Name(kind)}: "
                           f"cct reads FLOAT16, FLOAT and DOUBLE raw values")
    if len(raw) % RAW_TYPES[kind].itemsize:
        raise WeightsError(f"{where}BlobProto.{field} holds {len(raw)} bytes, not a whole number of "
                           f"{caffe_pb2.Type.Name(kind)} values ({RAW_TYPES[kind].itemsize} bytes each)")
    return np.frombuffer(raw, RAW_TYPES[kind])


def _shaped(array, blob_proto, where="", diff=False):
    """`array`, the values of `blob_proto`, in the shape it describes."""
    shape = blob_proto_shape(blob_proto, array.size)
    if array.size != int(np.prod(shape)):
        raise WeightsError(f"{where}BlobProto{_raw_field_named(blob_proto, diff)} holds {array.size} "
                           f"values but its shape {shape} needs {int(np.prod(shape))}")
    return array.reshape(shape)


def _raw_field_named(blob_proto, diff):
    """".raw_data (FLOAT16)" where the values are raw_data, for errors, else "":
    cct.formats.wire keeps raw_data_type in the message only where they are."""
    doubles, floats, raw, raw_type = _VALUE_FIELDS[diff]
    if not blob_proto.HasField(raw_type) or getattr(blob_proto, doubles) or getattr(blob_proto, floats):
        return ""
    return f".{raw} ({caffe_pb2.Type.Name(getattr(blob_proto, raw_type))})"


def array_to_blob_proto(array, diff=None):
    """A BlobProto with `array` as data (and `diff`, of the same shape), its shape
    in `shape.dim`; values are stored as float32, the type of BlobProto.data."""
    array = np.asarray(array)
    if diff is not None and np.shape(diff) != array.shape:
        raise ShapeError(f"BlobProto: diff shape {np.shape(diff)} differs from data shape {array.shape}")
    head = caffe_pb2.BlobProto()
    head.shape.dim.extend(array.shape)
    payload = head.SerializeToString() + _packed_floats(_PACKED_DATA_TAG, array)
    if diff is not None:
        payload += _packed_floats(_PACKED_DIFF_TAG, diff)
    return caffe_pb2.BlobProto.FromString(payload)


def _packed_floats(tag, array):
    raw = np.ascontiguousarray(array, dtype="<f4").tobytes()
    return varint(tag) + varint(len(raw)) + raw


def legacy_shape_matches(blob_shape, proto):
    """Caffe's Blob::ShapeEquals: a legacy 4-d proto matches a blob of <= 4 axes
    whose shape, padded with leading 1s, equals (num, channels, height, width);
    a proto without legacy dims matches on `shape.dim`."""
    if not _has_legacy_shape(proto):
        return tuple(blob_shape) == tuple(proto.shape.dim)
    if len(blob_shape) > 4:
        return False
    padded = (1,) * (4 - len(blob_shape)) + tuple(blob_shape)
    return padded == (proto.num, proto.channels, proto.height, proto.width)


# --- .caffemodel ----------------------------------------------------------------
def read_caffemodel(path):
    """The NetParameter in a .caffemodel, upgraded to the current format."""
    if not os.path.exists(path):
        raise WeightsError(f"{path}: weight file not found")
    return _upgraded(read_bytes(path), path)


def _mapped(path):
    """The bytes of the weight file at `path`, mapped rather than read where the
    system allows: a read fills fresh pages that cost 6x the copy out of them
    (BENCHMARKS.md, "Loading a .caffemodel"). Unmapped when the last view goes."""
    if not os.path.exists(path):
        raise WeightsError(f"{path}: weight file not found")
    try:
        with open(path, "rb") as handle:
            return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):                   # an empty file, a pipe: read it
        return read_bytes(path)


def copy_layers_from_caffemodel(net, path):
    """copy_layers_from_proto from the .caffemodel at `path`, each value copied
    once, from the file's bytes into the net's array (cct.formats.wire), the
    file's pages handed back as the copy passes them (cct.formats.pages); a file
    the walk leaves to protobuf is parsed whole, as read_caffemodel does."""
    data = _mapped(path)
    try:
        skeleton, values = split_blobs(data)
    except Unexpected:
        skeleton, values = data[:], None
    net_param = _upgraded(skeleton, path)
    if values is not None and sum(len(layer.blobs) for layer in net_param.layer) != len(values):
        net_param, values = _upgraded(data[:], path), None     # not expected: the upgrades keep the blobs' order
    copied = None if values is None else pages.ReleaseBehind(data).done
    return copy_layers_from_proto(net, net_param, path, values, copied)


class CopyBeside:
    """copy_layers_from_caffemodel beside the net's build: each layer's values
    are copied on a thread once the build hands it over (add(), after its
    setup and its shared parameters), so the copies' page faults run while the
    build's Python goes on (BENCHMARKS.md, "The weights copied beside the
    build"); nothing in a build reads a parameter's values. finish() waits for
    the copies and raises their first error: a bad file is reported after the
    build's own errors, as in Caffe, which loads once it has built. A file the
    walk leaves to protobuf (or an HDF5 one) is copied whole by finish()."""

    def __init__(self, path):
        self.path = str(path)
        self._error = None
        self._sources = None               # layer name -> [(its LayerParameter, its values)], in file order
        self._copied = None                # ReleaseBehind.done of the mapped file
        self._hdf5 = False
        self._queue = queue.SimpleQueue()
        self._thread = None
        try:
            self._hdf5 = is_hdf5(self.path)
            if not self._hdf5:
                self._sources, self._copied = self._split()
        except CctError as error:          # a damaged file, an upgrade refused: after the build's errors
            self._error = error

    def _split(self):
        data = _mapped(self.path)
        try:
            skeleton, values = split_blobs(data)
        except Unexpected:
            return None, None
        net_param = _upgraded(skeleton, self.path)
        if sum(len(layer.blobs) for layer in net_param.layer) != len(values):
            return None, None
        sources, offset = {}, 0
        for layer in net_param.layer:
            sources.setdefault(layer.name, []).append((layer, values[offset:offset + len(layer.blobs)]))
            offset += len(layer.blobs)
        return sources, pages.ReleaseBehind(data).done

    def add(self, layer):
        """Copy `layer`'s values from the file (on the thread), where it has them."""
        if self._sources is None or layer.name not in self._sources:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._copy, name="cct-weights", daemon=True)
            self._thread.start()
        self._queue.put(layer)

    def _copy(self):
        while True:
            layer = self._queue.get()
            if layer is None:
                return
            if self._error is not None:
                continue                   # the first error stands; the rest is not copied
            try:
                for source_layer, values in self._sources[layer.name]:
                    _copy_layer(layer, source_layer, values, f"{self.path}: layer '{layer.name}' ({layer.type})")
                    if values:
                        self._copied(values[-1])
            except Exception as error:      # raised by finish(), not lost with the thread
                self._error = error

    def wait(self):
        """No more layers: end the thread once it has copied those it was given."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def finish(self, net):
        """After wait(): the file's layers the net lacks (as
        copy_layers_from_caffemodel); raise the first copy's error."""
        if self._error is not None:
            raise self._error
        if self._sources is None:
            return copy_layers_from_hdf5(net, self.path) if self._hdf5 else copy_layers_from_caffemodel(net, self.path)
        return [name for name in self._sources if name not in net.layer_dict]


def _upgraded(data, path):
    from cct.formats.upgrade import upgrade_net
    return upgrade_net(parse_binary(data, caffe_pb2.NetParameter(), path), source=str(path))


def copy_layers_from_proto(net, net_param, source="<weights>", values=None, copied=None):
    """Copy weights into `net` by layer name (Caffe's CopyTrainedLayersFrom).

    Source layers the net lacks are skipped, as in Caffe (fine-tuning renames
    the layers it wants to learn from scratch); every skipped name is returned.
    A layer whose blob count or shapes differ is an error. `values`, when
    given, are the blobs' values in order (wire.split_blobs): the BlobProtos
    then hold only their shapes; `copied(value)` is called with each layer's
    last value once its values are copied (or skipped with the layer). Where
    two of the net's layers have one name, the first gets the values, as
    Caffe's search goes (HDF5's lookup, below, takes the last).
    """
    first_named = {}
    for layer in net.layers:
        first_named.setdefault(layer.name, layer)
    skipped, offset = [], 0
    for source_layer in net_param.layer:
        count = len(source_layer.blobs)
        layer_values = values[offset:offset + count] if values is not None else [None] * count
        offset += count
        layer = first_named.get(source_layer.name)
        if layer is None:
            skipped.append(source_layer.name)
        else:
            _copy_layer(layer, source_layer, layer_values, f"{source}: layer '{source_layer.name}' ({layer.type})")
        if copied is not None and count:
            copied(layer_values[-1])
    return skipped


def _copy_layer(layer, source_layer, values, where):
    if len(layer.blobs) != len(source_layer.blobs):
        raise WeightsError(f"{where}: the file has {len(source_layer.blobs)} blobs, "
                           f"the net's layer has {len(layer.blobs)}")
    for index, (blob, proto, array) in enumerate(zip(layer.blobs, source_layer.blobs, values)):
        count = None if array is None else array.size
        if not legacy_shape_matches(blob.shape, proto):
            raise WeightsError(
                f"{where}: blobs[{index}]: shape mismatch, the file has {blob_proto_shape(proto, count)}, "
                f"the net wants {blob.shape}; to learn this layer from scratch, rename it")
        if array is None:
            array = _stored_values(proto, where=f"{where}: blobs[{index}]: ")
        # the one copy: the file's float32 (or float64, or float16: exact) values into the blob
        pages.small_pages(blob.data)
        blob.data[...] = _shaped(array, proto, f"{where}: blobs[{index}]: ").reshape(blob.shape)


def net_to_proto(net, write_diff=False):
    """The net as a NetParameter with its weights (Caffe's Net::ToProto): the
    name and each layer's parameters as the layer holds them (phase included)."""
    net_param = caffe_pb2.NetParameter(name=net.name)
    for layer in net.layers:
        layer_proto = net_param.layer.add()
        layer_proto.CopyFrom(layer.layer_param)
        layer_proto.ClearField("blobs")
        for blob in layer.blobs:
            layer_proto.blobs.add().CopyFrom(
                array_to_blob_proto(blob.read_data(), blob.read_diff() if write_diff else None))
    return net_param


def save_caffemodel(net, path, write_diff=False):
    """The bytes net_to_proto(net).SerializeToString() gives, written piece by
    piece: each weight array straight from its blob, so a snapshot of CaffeNet
    takes no extra 0.5 GB for a message and its serialized copy."""
    pieces = [caffe_pb2.NetParameter(name=net.name).SerializeToString()]
    for layer in net.layers:
        # read-only views: a device run's weights stay current on the device
        arrays = [(blob.read_data(), blob.read_diff() if write_diff else None) for blob in layer.blobs]
        pieces += field_pieces(_NET_LAYER, _layer_pieces(layer.layer_param, arrays))
    atomic_write(path, pieces)


def blob_pieces(array, diff=None):
    """array_to_blob_proto(array, diff).SerializeToString() as pieces, the
    float arrays as views (no copy where they are little-endian float32):
    data (field 5), diff (6), then shape (7), as protobuf orders them."""
    pieces = []
    for tag, values in ((_PACKED_DATA_TAG, array), (_PACKED_DIFF_TAG, diff)):
        if values is not None:
            raw = np.ascontiguousarray(values, dtype="<f4")
            pieces += [varint(tag) + varint(raw.nbytes), memoryview(raw).cast("B")]
    head = caffe_pb2.BlobProto()
    head.shape.dim.extend(np.shape(array))
    return pieces + [head.SerializeToString()]


def _layer_pieces(layer_param, arrays):
    """A LayerParameter's bytes with `arrays` [(data, diff)] as its blobs (field 7),
    spliced between its lower- and higher-numbered fields, where protobuf puts them."""
    below, above = caffe_pb2.LayerParameter(), caffe_pb2.LayerParameter()
    below.CopyFrom(layer_param)
    above.CopyFrom(layer_param)
    for descriptor, _ in layer_param.ListFields():
        (above if descriptor.number < _LAYER_BLOBS else below).ClearField(descriptor.name)
    above.ClearField("blobs")
    below.DiscardUnknownFields()            # protobuf writes unknown fields last: `above` keeps them
    pieces = [below.SerializeToString()]
    for data, diff in arrays:
        pieces += field_pieces(_LAYER_BLOBS, blob_pieces(data, diff))
    return pieces + [above.SerializeToString()]


# --- HDF5 (Caffe's Net::ToHDF5 / CopyTrainedLayersFromHDF5) ----------------------
def save_hdf5(net, path, write_diff=False):
    """`data/<layer>/<i>` for parameters the layer owns (shared ones are stored once,
    by their owner), `diff/<layer>/<i>` for all; a group for every layer."""
    import h5py
    with atomic_path(path) as temp_path, h5py.File(temp_path, "w") as out:
        data = out.create_group("data")
        diff = out.create_group("diff") if write_diff else None
        for layer_index, layer in enumerate(net.layers):
            data_group = data.create_group(layer.name)
            diff_group = diff.create_group(layer.name) if write_diff else None
            for index, blob in enumerate(layer.blobs):
                if net.owns_param(layer_index, index):
                    data_group.create_dataset(str(index), data=blob.read_data())
                if write_diff:
                    diff_group.create_dataset(str(index), data=blob.read_diff())


def copy_layers_from_hdf5(net, path):
    with hdf5.reading(path, WeightsError, "HDF5 weight file") as weights:
        if "data" not in weights:
            raise WeightsError(f"{path}: not a Caffe HDF5 weight file (no 'data' group)")
        data = hdf5.group(weights, "data", WeightsError, str(path))
        skipped = []
        for layer_name in data:
            if layer_name in net.layer_dict:
                _copy_hdf5_layer(net, layer_name, data, path)
            else:
                skipped.append(layer_name)
    return skipped


def _copy_hdf5_layer(net, layer_name, data, path):
    layer = net.layer_dict[layer_name]
    layer_index = net.layer_names.index(layer_name)
    where = f"{path}: layer '{layer_name}' ({layer.type})"
    stored = hdf5.group(data, layer_name, WeightsError, f"{path}: data")
    if len(stored) > len(layer.blobs):
        raise WeightsError(f"{where}: the file has {len(stored)} blobs, "
                           f"the net's layer has {len(layer.blobs)}")
    for index, blob in enumerate(layer.blobs):
        if str(index) not in stored:
            if net.owns_param(layer_index, index):      # a shared param is loaded by its owner
                raise WeightsError(f"{where}: blobs[{index}]: missing from the file")
            continue
        values = hdf5.dataset(stored, str(index), WeightsError, where)
        if values.size != blob.count:                   # checked before reading: the file may declare 8 GiB
            raise WeightsError(f"{where}: blobs[{index}]: shape mismatch, the file has "
                               f"{values.shape}, the net wants {blob.shape}")
        pages.small_pages(blob.data)
        blob.data[...] = values[()].reshape(blob.shape)


def is_hdf5(path):
    """Whether the weight file at `path` is HDF5 (by its signature)."""
    try:
        with open(path, "rb") as handle:
            return handle.read(8) == b"\x89HDF\r\n\x1a\n"
    except (FileNotFoundError, ValueError):             # ValueError: a null byte in the name
        raise WeightsError(f"{path}: weight file not found") from None
    except IsADirectoryError:
        raise WeightsError(f"{path}: weight file is a folder, expected a file") from None
