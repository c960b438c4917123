"""Layers that read training data from disk: Data (LMDB/LevelDB of Datums),
ImageData (a list of image files), HDF5Data, WindowData (R-CNN style windows),
and HDF5Output (writes blobs to an HDF5 file).

Data, ImageData and WindowData load batches ahead of compute in a background
thread (Caffe's BasePrefetchingDataLayer): `prefetch` ready batches wait in a
queue.Queue; forward takes the next one. The thread is a daemon with a stop
event, stopped by `layer.close()` or when the layer is garbage collected; an
error in it (a missing or undecodable file) is re-raised by forward with the
layer's name and the file. Each thread draws crops, mirrors and shuffles from
its own generator seeded from cct.core.rng in setup, so a seeded run repeats.
HDF5Data holds its files in memory and runs synchronously, as in Caffe.

In data-parallel training (cct.training.distributed) the trainer sets Data,
ImageData and HDF5Data to read a Shard of their source (Layer.set_shard):
rank r of N reads the records r, r + N, r + 2N, ... of the one reading
order every rank walks, as Caffe's DataLayer::Skip does.
"""
import logging
import math
import os
import queue
import threading
import weakref

import numpy as np

from cct.core import rng as cct_rng
from cct.data.images import decode_image, read_image, resize_image
from cct.data.transformer import DataTransformer, read_image_list
from cct.data.db import backend_name, open_db
from cct.core.allocation import check_allocation
from cct.core.errors import CctError, DataError
from cct.core.layer import Layer, register
from cct.formats import hdf5
from cct.formats.text import read_text_file
from cct.proto import caffe_pb2

log = logging.getLogger("cct")

_LEGACY_TRANSFORM_FIELDS = ("scale", "mean_file", "crop_size", "mirror")


def merged_transform_param(layer, param_name):
    """layer_param.transform_param with the deprecated copies of its fields in
    `param_name` (data_param.scale, ...) folded in. cct.formats.upgrade moves them for
    V1 nets; a current-format prototxt that still sets them gets the same."""
    merged = caffe_pb2.TransformationParameter()
    merged.CopyFrom(layer.layer_param.transform_param)
    legacy = getattr(layer.layer_param, param_name)
    for field in _LEGACY_TRANSFORM_FIELDS:
        if not legacy.HasField(field):
            continue
        value = getattr(legacy, field)
        if merged.HasField(field) and getattr(merged, field) != value:
            raise layer.config_error(f"{param_name}.{field}", f"{value!r} conflicts with "
                                     f"transform_param.{field} {getattr(merged, field)!r}; set it once")
        setattr(merged, field, value)
    return merged


def _thread_rng():
    """A generator for a prefetch thread, seeded from the process-wide one."""
    return np.random.default_rng(int(cct_rng.get_rng().integers(2**63)))


class Shard:
    """Which records of a source a rank of data-parallel training reads
    (Caffe's DataLayer::Skip): the records are numbered in reading order,
    wrapping around the source included, and rank r of `size` reads those
    numbered r modulo size; so `size` ranks of batch b together read, each
    iteration, the records one reader of batch size*b reads. Shuffles draw from
    one generator seeded alike on every rank, so every rank walks one order."""

    def __init__(self, rank=0, size=1, seed=None):
        self.rank, self.size, self.seed = rank, size, seed

    def rng(self, otherwise):
        """The shuffling generator: seeded alike on every rank, else `otherwise`."""
        return otherwise if self.seed is None else np.random.default_rng(self.seed)

    def skip(self, offset):
        """How many records to pass over, `offset` records (ours and the
        other ranks') into the reading order, before the next one of ours."""
        return (self.rank - offset) % self.size


def check_shard(layer, rank, size):
    if not (isinstance(size, int) and isinstance(rank, int) and 0 <= rank < size):
        raise layer.config_error("shard", f"rank {rank!r} of {size!r}: need 0 <= rank < size")


# --- prefetching ------------------------------------------------------------------
class _Failure:
    def __init__(self, error):
        self.error = error


class _Uploaded:
    """A batch with its device copies, uploaded by the prefetch thread."""

    def __init__(self, batch, device, buffers):
        self.batch, self.device, self.buffers = batch, device, buffers


def _uploaded(batch, device):
    """`batch` (data, labels or None) with a fresh buffer on `device` holding
    each array: fresh, so no queued op can be reading one while it is written."""
    arrays = [array for array in batch if array is not None]
    buffers = []
    for array in arrays:
        buffers.append(device.empty(array.size))
        device.upload_aside(buffers[-1], array)
    return _Uploaded(batch, device, buffers)


def _host_batch(item):
    """(data, labels) of a prefetched item, uploaded or not."""
    return item.batch if isinstance(item, _Uploaded) else item


def _prefetch_loop(load_batch, ready, stop, target):
    # Holds no reference to the layer, so a dropped layer can be collected and stop us.
    while not stop.is_set():
        try:
            item = load_batch()
            device = target[0]
            if device is not None:
                item = _uploaded(item, device)
        except BaseException as error:          # handed to forward, which re-raises it
            item = _Failure(error)
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                break
            except queue.Full:
                continue
        if isinstance(item, _Failure):
            return


class Prefetcher:
    """Runs `load_batch()` in a daemon thread, keeping up to `count` results
    ready; with upload_to(device), each one's arrays uploaded there too."""

    def __init__(self, load_batch, count, name):
        self._pid = os.getpid()        # the thread lives in this process only (fork copies no threads)
        self._ready = queue.Queue(maxsize=max(1, int(count)))
        self._stop = threading.Event()
        self._target = [None]          # the device the thread uploads each batch to, or None
        self._thread = threading.Thread(target=_prefetch_loop, name=name, daemon=True,
                                        args=(load_batch, self._ready, self._stop, self._target))
        self._thread.start()

    def upload_to(self, device):
        """Upload the batches loaded from now on to `device` as well (None: stop;
        a device whose buffers are host memory needs no copy)."""
        self._target[0] = None if device is None or device.shares_host else device

    def get(self):
        """The next batch; re-raises an error the thread met (as _Failure)."""
        if os.getpid() != self._pid:
            # a forked child: its copy of the queue may hold batches the parent
            # reads too, or a lock the thread held at the fork, so it is not touched
            raise DataError(f"the net was built in process {self._pid}, which forked this one ({os.getpid()}): "
                            "a data layer's prefetch thread and database do not cross a fork; "
                            "build the net in the process that runs it")
        while True:
            try:
                return self._ready.get(timeout=0.5)
            except queue.Empty:
                if not self._thread.is_alive():
                    raise DataError("the prefetch thread has stopped") from None

    def stop(self, timeout=5.0):
        self._stop.set()
        try:                                    # wake a thread blocked on a full queue
            while True:
                self._ready.get_nowait()
        except queue.Empty:
            pass
        self._thread.join(timeout)

    @property
    def alive(self):
        return self._thread.is_alive()


def _shut_down(prefetcher, load_batch):
    """Stop the prefetch thread, then release what its loader holds (a database)."""
    prefetcher.stop()
    close = getattr(load_batch, "close", None)
    if close is not None:
        close()


class PrefetchingDataLayer(Layer):
    """Base of the prefetching data layers. A subclass's `data_setup(top)` sizes
    the tops and returns (load_batch, prefetch count); load_batch() returns
    (data (N, C, H, W) float32, labels (N,) float32 or None)."""
    exact_bottoms = 0
    min_tops, max_tops = 1, 2
    _prefetcher = None
    _failure = None

    def setup(self, bottom, top):
        self.output_labels = len(top) > 1
        self._top = top
        self._start(top)

    def _start(self, top):
        load_batch, count = self.data_setup(top)
        self._prefetcher = Prefetcher(load_batch, count, f"cct-prefetch-{self.name}")
        self._finalizer = weakref.finalize(self, _shut_down, self._prefetcher, load_batch)
        self._prefetch_count = max(1, int(count))

    def planned_bytes(self, bottom, top, partitions):
        # the batches waiting in the queue, and the one the thread is loading
        return {"prefetch": (self._prefetch_count + 1) * sum(blob.count * 4 for blob in top)}

    def reshape(self, bottom, top):
        pass                            # forward sizes the tops to each batch (Caffe's Forward)

    def forward(self, bottom, top):
        self._prefetcher.upload_to(None)
        self._set_tops(_host_batch(self._next_batch()), top)

    def runs_on(self, device, bottom, top):
        return self.all_float32(top)

    def forward_on(self, device, bottom, top):
        """The next batch, which the prefetch thread uploaded too where it
        knew the device (from the next batch on): both sides current then,
        and nothing goes up on the compute queue (Caffe's async_gpu_push)."""
        self._prefetcher.upload_to(device)
        item = self._next_batch()
        self._set_tops(_host_batch(item), top)
        if isinstance(item, _Uploaded) and item.device is device:
            for blob, buffer in zip(top, item.buffers):
                blob.adopt_device_data(device, buffer)

    def backward_on(self, device, top, propagate_down, bottom):
        pass

    def _next_batch(self):
        """The prefetch thread's next item, or its error raised under this layer's name."""
        if not self._finalizer.alive:
            raise DataError(f"{self.where()}: closed (Net.close): its prefetch thread has stopped "
                            "and its database is closed")
        if self._failure is None:
            try:
                item = self._prefetcher.get()
            except DataError as error:
                raise DataError(f"{self.where()}: {error}") from None
            if isinstance(item, _Failure):
                self._failure = item.error
        if self._failure is not None:
            error = self._failure
            if isinstance(error, CctError):
                raise type(error)(f"{self.where()}: {error}") from error
            raise DataError(f"{self.where()}: loading a batch failed: {error!r}") from error
        return item

    def _set_tops(self, batch, top):
        data, labels = batch
        top[0].reshape(data.shape)
        top[0].data[...] = data
        if self.output_labels:
            top[1].reshape(labels.shape)
            top[1].data[...] = labels

    def backward(self, top, propagate_down, bottom):
        pass

    def close(self):
        """Stop the prefetch thread and close the database (also done when the
        layer is collected); a forward after it is an error."""
        if self._prefetcher is not None:
            self._finalizer()

    @property
    def prefetch_alive(self):
        return self._prefetcher is not None and self._prefetcher.alive


class ShardedDataLayer(PrefetchingDataLayer):
    """A prefetching layer whose loader reads a Shard of its source."""
    shard = Shard()

    def set_shard(self, rank, size, seed):
        check_shard(self, rank, size)
        # the thread has read ahead the whole source's records: start it again on our shard
        self._finalizer()
        self.shard = Shard(rank, size, seed)
        self._start(self._top)


def _check_batch_size(layer, field, value):
    if value <= 0:
        raise layer.config_error(field, f"must be > 0, got {value}")


def _transform(transformer, images, what_of):
    """A batch of (C, H, W) images, transformed. Of one shape: stacked, one transform.
    Of several: as Caffe, each image on its own, which works where crop_size brings
    them to one size; a misfit is named by what_of(i)."""
    shape = images[0].shape
    if all(image.shape == shape for image in images):
        return transformer.transform_batch(np.stack(images))
    out = np.empty((len(images),) + transformer.infer_shape(shape), np.float32)     # (N, C, h, w)
    for index, image in enumerate(images):
        try:
            fits = transformer.infer_shape(image.shape) == out.shape[1:]
        except CctError as error:
            raise type(error)(f"{what_of(index)}: {error}") from None
        if not fits:
            raise DataError(f"{what_of(index)}: image is {_dims(image.shape)} but the batch's first is "
                            f"{_dims(shape)}; resize them to one size or crop them (crop_size)")
        transformer.transform_batch(image[None], out=out[index:index + 1])
    return out


def _dims(shape):
    return "x".join(str(d) for d in shape)


# --- Data ---------------------------------------------------------------------------
@register("Data")
class Data(ShardedDataLayer):
    """Datums from an LMDB or LevelDB, in key order, wrapping around at the end.
    data_param: source (db path), backend (LEVELDB default, LMDB), batch_size,
    rand_skip (skip a random 0..rand_skip-1 records at start), prefetch (4),
    force_encoded_color; transform_param (see cct.data.transformer).
    Tops: data (batch_size, C, h, w) from the first record of each batch, and
    optionally label (batch_size,)."""

    def data_setup(self, top):
        param = self.layer_param.data_param
        _check_batch_size(self, "data_param.batch_size", param.batch_size)
        if not param.source:
            raise self.config_error("data_param.source", "missing: give the database path")
        transform = merged_transform_param(self, "data_param")
        if param.force_encoded_color:
            transform.force_color = True
        self.transformer = DataTransformer(transform, self.phase, _thread_rng(), self.where())
        backend = backend_name(param.backend, f"{self.where()}: data_param.backend")
        db = open_db(param.source, backend)
        try:
            cursor, shape = self._first_record(db, param)
            top[0].reshape(shape)
        except BaseException:
            db.close()               # a refused net keeps no database open (its files, its map)
            raise
        if len(top) > 1:
            top[1].reshape(param.batch_size)
        loader = _DatumLoader(db, cursor, self.transformer, param.batch_size, param.source, self.shard)
        return loader, param.prefetch

    def _first_record(self, db, param):
        """A cursor on the first record to read, and the batch's shape from it."""
        cursor = db.cursor()
        if param.rand_skip:
            skip = int(self.shard.rng(cct_rng.get_rng()).integers(param.rand_skip))   # alike on every rank
            log.info("%s: skipping the first %d records", self.where(), skip)
            cursor.skip(skip)
        key, value = cursor.peek()
        datum = _parse_datum(value, param.source, key)
        image_shape = self.transformer.decode(datum, _record_what(param.source, key)).shape
        return cursor, (param.batch_size,) + self.transformer.infer_shape(image_shape)


def _record_what(source, key):
    return f"{source}: record '{bytes(key).decode(errors='replace')}'"


def _parse_datum(value, source, key):
    try:
        return caffe_pb2.Datum.FromString(value)
    except Exception as error:          # protobuf's DecodeError
        raise DataError(f"{_record_what(source, key)}: not a serialized Datum: {error}") from None


class _DatumLoader:
    def __init__(self, db, cursor, transformer, batch_size, source, shard):
        self.db, self.cursor, self.transformer = db, cursor, transformer
        self.batch_size, self.source, self.shard = batch_size, source, shard
        self.offset = 0                 # records read or passed over

    def close(self):
        self.db.close()

    def __call__(self):
        keys, images, labels = [], [], np.empty(self.batch_size, np.float32)
        shard = self.shard
        for index in range(self.batch_size):
            skip = shard.skip(self.offset)
            self.cursor.skip(skip)              # the other ranks' records, unparsed
            key, value = self.cursor.next()
            self.offset += skip + 1
            datum = _parse_datum(value, self.source, key)
            images.append(self.transformer.decode(datum, _record_what(self.source, key)))
            labels[index] = datum.label
            keys.append(key)
        return _transform(self.transformer, images, lambda i: _record_what(self.source, keys[i])), labels


# --- ImageData ------------------------------------------------------------------------
@register("ImageData")
class ImageData(ShardedDataLayer):
    """Images named in a list file, each line `relative/path.jpg label`.
    image_data_param: source (the list), root_folder (prefixed to each path),
    batch_size (1), shuffle (reshuffled every epoch), rand_skip, new_height and
    new_width (resize both, or neither), is_color (true: 3 channels BGR, false:
    gray); transform_param. Tops: data (batch_size, C, h, w), label (batch_size,)."""

    def data_setup(self, top):
        param = self.layer_param.image_data_param
        _check_batch_size(self, "image_data_param.batch_size", param.batch_size)
        if (param.new_height > 0) != (param.new_width > 0):
            raise self.config_error("image_data_param.new_height", "set new_height and new_width "
                                    f"together, got {param.new_height} and {param.new_width}")
        if not param.source:
            raise self.config_error("image_data_param.source", "missing: give the image list file")
        entries = read_image_list(param.source, f"{self.where()}: image_data_param.source")
        rng = _thread_rng()
        self.transformer = DataTransformer(merged_transform_param(self, "image_data_param"),
                                           self.phase, rng, self.where())
        order_rng = self.shard.rng(rng)     # alike on every rank: one order of the lines
        if param.shuffle:
            order_rng.shuffle(entries)
        start = 0
        if param.rand_skip:
            start = int(self.shard.rng(cct_rng.get_rng()).integers(param.rand_skip))
            if start >= len(entries):
                raise self.config_error("image_data_param.rand_skip", f"skipping {start} images needs "
                                        f"more than the {len(entries)} in {param.source}")
        loader = _ImageLoader(entries, start, param, self.transformer, order_rng, self.shard)
        image_shape = loader.read(start).shape
        shape = (param.batch_size,) + self.transformer.infer_shape(image_shape)
        top[0].reshape(shape)
        if len(top) > 1:
            top[1].reshape(param.batch_size)
        return loader, self.layer_param.data_param.prefetch


class _ImageLoader:
    def __init__(self, entries, start, param, transformer, rng, shard):
        self.entries, self.position, self.transformer, self.rng = entries, start, transformer, rng
        self.source, self.root = param.source, param.root_folder
        self.batch_size, self.shuffle, self.is_color = param.batch_size, param.shuffle, param.is_color
        self.new_height, self.new_width = param.new_height, param.new_width
        self.epoch = 0
        self.shard, self.offset = shard, 0      # lines read or passed over (Shard)

    def what(self, index):
        name, _, number = self.entries[index]
        return f"{self.source}:{number} ({name})"

    def read(self, index):
        name = self.entries[index][0]
        try:
            return read_image(self.root + name, self.new_height, self.new_width, self.is_color)
        except DataError as error:
            raise DataError(f"{self.source}:{self.entries[index][2]}: {error}") from None

    def __call__(self):
        images, labels, whats = [], np.empty(self.batch_size, np.float32), []
        for item in range(self.batch_size):
            for _ in range(self.shard.skip(self.offset)):      # the other ranks' lines
                self._advance()
            images.append(self.read(self.position))
            labels[item] = self.entries[self.position][1]
            whats.append(self.what(self.position))
            self._advance()
        return _transform(self.transformer, images, whats.__getitem__), labels

    def _advance(self):
        self.position += 1
        self.offset += 1
        if self.position >= len(self.entries):      # an epoch ends: start over, reshuffled
            self.position = 0
            self.epoch += 1
            if self.shuffle:
                self.rng.shuffle(self.entries)


# --- HDF5Data ----------------------------------------------------------------------------
@register("HDF5Data")
class HDF5Data(Layer):
    """Rows of HDF5 datasets named like the tops, from the .h5 files listed
    (one per line) in hdf5_data_param.source. batch_size rows per forward, in
    order, continuing into the next file and wrapping around after the last;
    shuffle permutes the files and the rows of each file (again every pass).
    Tops: one per dataset, (batch_size,) + the dataset's shape[1:], float32."""
    exact_bottoms = 0
    min_tops = 1
    draws_random = True           # shuffle draws a new order at the end of every pass
    shard = Shard()
    _seeded = None                # the shard's shuffling generator (set_shard)

    def setup(self, bottom, top):
        param = self.layer_param.hdf5_data_param
        if self.layer_param.HasField("transform_param"):
            raise self.config_error("transform_param", "HDF5Data does not transform data; "
                                    "store the data already transformed")
        _check_batch_size(self, "hdf5_data_param.batch_size", param.batch_size)
        if not param.source:
            raise self.config_error("hdf5_data_param.source", "missing: give the file listing .h5 files")
        self.files = self._read_list(param.source)
        self.names = list(self.layer_param.top)
        self.shuffle = param.shuffle
        self._first_file()
        for blob, array in zip(top, self.arrays):
            blob.reshape((param.batch_size,) + array.shape[1:])

    def set_shard(self, rank, size, seed):
        check_shard(self, rank, size)
        self.shard = Shard(rank, size, seed)
        self._seeded = self.shard.rng(None)
        self._first_file()              # the walk starts again, in the order every rank draws

    def _order_rng(self):
        return cct_rng.get_rng() if self._seeded is None else self._seeded

    def _first_file(self):
        self.offset = 0                 # rows read or passed over (Shard)
        self.file_order = np.arange(len(self.files))
        if self.shuffle:
            self._order_rng().shuffle(self.file_order)
        self.current_file = 0
        self._load(self.files[self.file_order[0]])

    def _read_list(self, source):
        names = read_text_file(source, DataError, f"{self.where()}: hdf5_data_param.source: list file").split()
        if not names:
            raise DataError(f"{self.where()}: {source} lists no HDF5 files")
        here = os.path.dirname(os.path.abspath(source))
        # Caffe resolves names from the working directory; fall back to the list's folder.
        return [name if os.path.exists(name) or os.path.isabs(name) else
                (os.path.join(here, name) if os.path.exists(os.path.join(here, name)) else name)
                for name in names]

    def _load(self, path):
        with hdf5.reading(path, DataError, where=f"{self.where()}: ") as handle:
            arrays = []
            for index, name in enumerate(self.names):
                if name not in handle or not hasattr(handle[name], "shape"):
                    raise DataError(f"{self.where()}: {path} has no dataset '{name}' (top {index}); "
                                    f"it holds: {', '.join(handle.keys()) or 'nothing'}")
                values = hdf5.dataset(handle, name, DataError, f"{self.where()}: {path}")
                if values.ndim < 1:
                    raise DataError(f"{self.where()}: {path}: dataset '{name}' is a scalar; need rows")
                with self.naming_allocations(()):     # the shape a file declares costs it nothing
                    check_allocation(values.shape, np.float32, f"{path}: dataset '{name}'")
                arrays.append(np.asarray(values[()], dtype=np.float32))
        rows = arrays[0].shape[0]
        for name, array in zip(self.names, arrays):
            if array.shape[0] != rows:
                raise DataError(f"{self.where()}: {path}: dataset '{name}' has {array.shape[0]} rows, "
                                f"'{self.names[0]}' has {rows}")
        if rows == 0:
            raise DataError(f"{self.where()}: {path}: datasets have no rows")
        self.arrays, self.rows, self.current_row = arrays, rows, 0
        self.row_order = np.arange(rows)
        if self.shuffle:
            self._order_rng().shuffle(self.row_order)

    def _next_file(self):
        if len(self.files) > 1:
            self.current_file += 1
            if self.current_file == len(self.files):
                self.current_file = 0
                if self.shuffle:
                    self._order_rng().shuffle(self.file_order)
            self._load(self.files[self.file_order[self.current_file]])
        self.current_row = 0
        if self.shuffle:
            self._order_rng().shuffle(self.row_order)

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        batch, size = top[0].shape[0], self.shard.size
        filled = 0
        while filled < batch:
            first = self.current_row + self.shard.skip(self.offset)      # our next row
            rows = self.row_order[first:self.rows:size][:batch - filled]
            take = len(rows)
            for blob, array in zip(top, self.arrays):
                blob.data[filled:filled + take] = array[rows]
            filled += take
            end = first + (take - 1) * size + 1 if filled == batch else self.rows
            self.offset += end - self.current_row
            self.current_row = end
            if self.current_row == self.rows:
                self._next_file()

    def backward(self, top, propagate_down, bottom):
        pass


# --- HDF5Output -------------------------------------------------------------------------
@register("HDF5Output")
class HDF5Output(Layer):
    """Writes bottom 0 as dataset "data" and bottom 1 as "label" to
    hdf5_output_param.file_name (created anew in setup). Each forward appends
    its batch along axis 0 (Caffe writes one batch; a second forward there fails).
    Bottoms: two blobs with the same num. No tops."""
    exact_bottoms = 2
    exact_tops = 0
    dataset_names = ("data", "label")

    def setup(self, bottom, top):
        import h5py
        self.file_name = self.layer_param.hdf5_output_param.file_name
        if not self.file_name:
            raise self.config_error("hdf5_output_param.file_name", "missing: give the output file")
        try:
            h5py.File(self.file_name, "w").close()
        except OSError as error:
            raise DataError(f"{self.where()}: cannot create {self.file_name}: {error}") from None

    def reshape(self, bottom, top):
        if bottom[0].shape[:1] != bottom[1].shape[:1]:
            raise self.shape_error(f"data and label must have the same num, got {bottom[0].shape} "
                                   f"and {bottom[1].shape}")

    def forward(self, bottom, top):
        import h5py
        with h5py.File(self.file_name, "a") as handle:
            for name, blob in zip(self.dataset_names, bottom):
                # Caffe writes legacy 4-d (num, channels, height, width) datasets.
                values = blob.data.reshape(blob.num, blob.channels, blob.height, blob.width)
                if name not in handle:
                    handle.create_dataset(name, data=values, maxshape=(None,) + values.shape[1:], chunks=True)
                    continue
                dataset = handle[name]
                if dataset.shape[1:] != values.shape[1:]:
                    raise self.shape_error(f"'{name}' changed shape from {dataset.shape[1:]} to "
                                           f"{values.shape[1:]} between batches")
                start = dataset.shape[0]
                dataset.resize(start + values.shape[0], axis=0)
                dataset[start:] = values

    def backward(self, top, propagate_down, bottom):
        pass


# --- WindowData ---------------------------------------------------------------------------
def _c_round(value):
    """C's round(): halves away from zero (Python's round() goes to even)."""
    return int(math.copysign(math.floor(abs(value) + 0.5), value))


def read_window_file(path, root_folder, fg_threshold, bg_threshold, what):
    """Caffe's window file: repeated `# index / image path / channels / height /
    width / num_windows / num_windows lines of 'label overlap x1 y1 x2 y2'`.
    Returns (images [(path, channels)], fg windows, bg windows); a window is
    (image index, label, overlap, x1, y1, x2, y2) in a (K, 7) float array."""
    tokens = read_text_file(path, DataError, f"{what}: window file").split()
    if not tokens:
        raise DataError(f"{what}: window file {path} is empty")
    images, fg, bg = [], [], []
    position = 0

    def take(count, context):
        nonlocal position
        if position + count > len(tokens):
            raise DataError(f"{path}: file ends inside {context}")
        chunk = tokens[position:position + count]
        position += count
        return chunk

    while position < len(tokens):
        hashtag, index = take(2, "an image header")
        context = f"image #{index}"
        if hashtag != "#":
            raise DataError(f"{path}: expected '#' before {context}, got {hashtag!r}")
        try:
            image_path = take(1, context)[0]
            channels, _height, _width, count = (int(t) for t in take(4, context))
            for _ in range(count):
                label, overlap, x1, y1, x2, y2 = take(6, f"the windows of {context}")
                window = [float(index), int(label), float(overlap), int(x1), int(y1), int(x2), int(y2)]
                if window[2] >= fg_threshold:
                    if window[1] <= 0:
                        raise DataError(f"{path}: {context}: a foreground window needs a label > 0, "
                                        f"got {window[1]}")
                    fg.append(window)
                elif window[2] < bg_threshold:
                    window[1] = window[2] = 0           # background: label and overlap forced to 0
                    bg.append(window)
        except ValueError as error:
            raise DataError(f"{path}: {context}: malformed entry: {error}") from None
        if int(index) != len(images):
            raise DataError(f"{path}: images must be numbered 0, 1, ... in order; got #{index} "
                            f"at position {len(images)}")
        images.append((root_folder + image_path, channels))
    as_array = lambda rows: np.array(rows, dtype=np.float64).reshape(-1, 7)  # noqa: E731
    return images, as_array(fg), as_array(bg)


@register("WindowData")
class WindowData(PrefetchingDataLayer):
    """Windows cut from images and warped to crop_size x crop_size (R-CNN
    fine-tuning). window_data_param: source (the window file), root_folder,
    batch_size, fg_threshold (0.5: overlap >= it is foreground), bg_threshold
    (0.5: overlap < it is background, label 0), fg_fraction (0.25 of each batch
    is foreground), context_pad (pixels of context around the warped window),
    crop_mode ("warp" or "square"), cache_images, scale (used when set, else
    transform_param.scale); transform_param: crop_size (required), mirror,
    mean_file (its center crop_size region is used) or mean_value.
    Tops: data (batch_size, channels, crop_size, crop_size) with the background
    windows first, label (batch_size,)."""
    exact_tops = 2
    min_tops = max_tops = None

    def data_setup(self, top):
        param = self.layer_param.window_data_param
        _check_batch_size(self, "window_data_param.batch_size", param.batch_size)
        if param.crop_mode not in ("warp", "square"):
            raise self.config_error("window_data_param.crop_mode", f"must be 'warp' or 'square', "
                                    f"got {param.crop_mode!r}")
        transform = merged_transform_param(self, "window_data_param")
        crop = transform.crop_size
        if crop <= 0:
            raise self.config_error("transform_param.crop_size", "WindowData needs crop_size > 0")
        if 2 * param.context_pad >= crop:
            raise self.config_error("window_data_param.context_pad", f"{param.context_pad} leaves no "
                                    f"room in crop_size {crop}")
        if not param.source:
            raise self.config_error("window_data_param.source", "missing: give the window file")
        images, fg, bg = read_window_file(param.source, param.root_folder, param.fg_threshold,
                                          param.bg_threshold, f"{self.where()}: window_data_param.source")
        channels = images[-1][1]
        num_fg = int(param.batch_size * param.fg_fraction)
        for count, windows, kind in ((num_fg, fg, "foreground"), (param.batch_size - num_fg, bg, "background")):
            if count and not len(windows):
                raise DataError(f"{self.where()}: {param.source} has no {kind} windows to sample")
        # The transformer only validates and loads means here; the warp needs its own loop.
        transformer = DataTransformer(transform, self.phase, None, self.where())
        if transformer.mean_image is not None:
            mean = transformer.mean_image
            if mean.shape[0] != channels or min(mean.shape[1:]) < crop:
                raise self.config_error("transform_param.mean_file", f"mean is {_dims(mean.shape)}; need "
                                        f"{channels} channels and at least {crop}x{crop}")
            offset = (mean.shape[2] - crop) // 2       # Caffe centers on the width for both axes
        else:
            values = transformer.mean_values if transformer.mean_values is not None else np.zeros(1, np.float32)
            if values.size not in (1, channels):
                raise self.config_error("transform_param.mean_value", f"give one value or one per "
                                        f"channel ({channels}), got {values.size}")
            mean = np.broadcast_to(values.reshape(-1, 1, 1), (channels, crop, crop))
            offset = 0
        scale = param.scale          # Caffe's WindowData reads only its own scale
        cache = None
        if param.cache_images:
            cache = []
            for image_path, _ in images:
                try:
                    with open(image_path, "rb") as handle:
                        cache.append(handle.read())
                except OSError:
                    raise DataError(f"{self.where()}: {param.source}: could not open or find file "
                                    f"{image_path}") from None
        top[0].reshape(param.batch_size, channels, crop, crop)
        top[1].reshape(param.batch_size)
        loader = _WindowLoader(images, fg, bg, cache, mean, offset, np.float32(scale), crop, num_fg,
                               param, transform.mirror, _thread_rng())
        return loader, self.layer_param.data_param.prefetch


class _WindowLoader:
    def __init__(self, images, fg, bg, cache, mean, mean_offset, scale, crop, num_fg, param, mirror, rng):
        self.images, self.fg, self.bg, self.cache = images, fg, bg, cache
        self.mean, self.mean_offset, self.scale, self.crop = mean, mean_offset, scale, crop
        self.num_fg, self.batch_size, self.mirror, self.rng = num_fg, param.batch_size, mirror, rng
        self.context_pad, self.square, self.source = param.context_pad, param.crop_mode == "square", param.source

    def __call__(self):
        channels = self.mean.shape[0]
        data = np.zeros((self.batch_size, channels, self.crop, self.crop), np.float32)
        labels = np.empty(self.batch_size, np.float32)
        item = 0
        for windows, count in ((self.bg, self.batch_size - self.num_fg), (self.fg, self.num_fg)):
            for _ in range(count):
                window = windows[self.rng.integers(len(windows))]
                do_mirror = bool(self.mirror and self.rng.integers(2))
                self._fill(data[item], window, do_mirror)
                labels[item] = window[1]
                item += 1
        return data, labels

    def _load(self, index):
        path = self.images[index][0]
        if self.cache is not None:
            return decode_image(self.cache[index], "color", path)
        return read_image(path, is_color=True)

    def _fill(self, out, window, do_mirror):
        """Warp one window into out (C, crop, crop), following Caffe's geometry."""
        image = self._load(int(window[0]))                  # (C, H, W) BGR
        height, width = image.shape[1:]
        crop, pad = self.crop, self.context_pad
        x1, y1, x2, y2 = (int(v) for v in window[3:7])
        pad_w = pad_h = 0
        out_w = out_h = crop
        if pad > 0 or self.square:
            context_scale = crop / (crop - 2 * pad)
            half_h, half_w = (y2 - y1 + 1) / 2.0, (x2 - x1 + 1) / 2.0
            center_x, center_y = x1 + half_w, y1 + half_h
            if self.square:
                half_h = half_w = max(half_h, half_w)
            x1, x2 = _c_round(center_x - half_w * context_scale), _c_round(center_x + half_w * context_scale)
            y1, y2 = _c_round(center_y - half_h * context_scale), _c_round(center_y + half_h * context_scale)
            # The grown region may leave the image: clip it and remember by how much.
            unclipped_h, unclipped_w = y2 - y1 + 1, x2 - x1 + 1
            pad_x1, pad_y1 = max(0, -x1), max(0, -y1)
            pad_x2, pad_y2 = max(0, x2 - width + 1), max(0, y2 - height + 1)
            x1, x2, y1, y2 = x1 + pad_x1, x2 - pad_x2, y1 + pad_y1, y2 - pad_y2
            scale_x, scale_y = crop / unclipped_w, crop / unclipped_h
            out_w = _c_round((x2 - x1 + 1) * scale_x)
            out_h = _c_round((y2 - y1 + 1) * scale_y)
            pad_x1, pad_x2 = _c_round(pad_x1 * scale_x), _c_round(pad_x2 * scale_x)
            pad_y1 = _c_round(pad_y1 * scale_y)
            pad_h = pad_y1
            pad_w = pad_x2 if do_mirror else pad_x1           # the padding mirrors with the image
            out_h = min(out_h, crop - pad_h)                  # rounding may overflow the crop
            out_w = min(out_w, crop - pad_w)
        if not (0 <= x1 <= x2 < width and 0 <= y1 <= y2 < height) or out_w <= 0 or out_h <= 0:
            raise DataError(f"{self.source}: window ({x1}, {y1}, {x2}, {y2}) does not fit image "
                            f"{self.images[int(window[0])][0]} ({width}x{height})")
        warped = resize_image(image[:, y1:y2 + 1, x1:x2 + 1], out_h, out_w)   # (C, out_h, out_w)
        if do_mirror:
            warped = warped[:, :, ::-1]
        top, left = pad_h, pad_w
        mean = self.mean[:, self.mean_offset + top:self.mean_offset + top + out_h,
                         self.mean_offset + left:self.mean_offset + left + out_w]
        out[:, top:top + out_h, left:left + out_w] = (warped.astype(np.float32) - mean) * self.scale
