"""Caffe's record databases: LMDB and LevelDB, holding serialized caffe_pb2.Datum
values under keys like `00000042_cat.jpg` (Caffe writes `%08d` + `_filename`).

    db = open_db(path, "lmdb")            # or "leveldb"; "r" (default) or "w"
    cursor = db.cursor()                  # key order, wraps around at the end
    key, value = cursor.next()
    with open_db(path, "lmdb", "w") as db:
        db.put(record_key(0, "cat.jpg"), datum.SerializeToString())

A cursor is used by one thread at a time (a Data layer reads the first record
in setup, then hands the cursor to its prefetch thread).
"""
import os
import threading

from cct.core.errors import DataError

BACKENDS = ("lmdb", "leveldb")


def record_key(index, filename=""):
    """Caffe's key: the index as 8 zero-padded digits, then `_filename` if given."""
    return f"{index:08d}_{filename}" if filename else f"{index:08d}"


def backend_name(backend, where="backend"):
    """'lmdb' or 'leveldb' from a string (any case) or a DataParameter.DB value."""
    if isinstance(backend, int):
        backend = {0: "leveldb", 1: "lmdb"}.get(backend, str(backend))
    name = str(backend).lower()
    if name not in BACKENDS:
        raise DataError(f"{where}: unknown database backend {backend!r}; use lmdb or leveldb")
    return name


def open_db(path, backend="lmdb", mode="r"):
    """Open the database at `path`: mode "r" reads an existing one, "w" creates
    a new one (Caffe's NEW; an existing one is an error, as in convert_imageset)."""
    path = os.fspath(path)
    if mode not in ("r", "w"):
        raise ValueError(f"open_db: mode must be 'r' or 'w', got {mode!r}")
    backend = backend_name(backend, path)
    if mode == "r" and not os.path.exists(path):
        raise DataError(f"{path}: database not found ({backend})")
    if mode == "w" and os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise DataError(f"{path}: database already exists; remove it or choose another name")
    return (LMDB if backend == "lmdb" else LevelDB)(path, mode)


def read_records(path, backend="lmdb"):
    """Every (key, value) once, in key order (bytes)."""
    with open_db(path, backend) as db:
        yield from db.items()


class _Database:
    def __init__(self, path, mode):
        self.path, self.mode = path, mode

    def cursor(self):
        return Cursor(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _encode(self, key):
        return key.encode() if isinstance(key, str) else bytes(key)


class LMDB(_Database):
    """An LMDB environment (a folder holding data.mdb). Writes are batched into
    transactions of `commit_every` records, as convert_imageset commits per 1000;
    the map grows by doubling when full."""

    def __init__(self, path, mode, commit_every=1000, map_size=64 << 20):
        import lmdb
        super().__init__(path, mode)
        self._lmdb = lmdb
        try:
            if mode == "r":
                self.env = _open_reader(lmdb, path)
            else:
                os.makedirs(path, exist_ok=True)
                self.env = lmdb.open(path, map_size=map_size, subdir=True)
        except lmdb.Error as error:
            raise DataError(f"{path}: cannot open LMDB: {error}") from None
        self._commit_every = commit_every
        self._pending = []

    def items(self):
        with self.env.begin(buffers=False) as txn:
            yield from txn.cursor()

    def __len__(self):
        return self.env.stat()["entries"] + len(self._pending)

    def iterate_from_start(self):
        """A fresh iterator over (key, value) from the first record."""
        txn = self.env.begin(buffers=False)
        return iter(txn.cursor())

    def put(self, key, value):
        self._pending.append((self._encode(key), bytes(value)))
        if len(self._pending) >= self._commit_every:
            self.commit()

    def commit(self):
        pending, self._pending = self._pending, []
        while pending:
            try:
                with self.env.begin(write=True) as txn:
                    for key, value in pending:
                        txn.put(key, value)
                return
            except self._lmdb.MapFullError:
                # The aborted transaction wrote nothing; grow the map and retry.
                self.env.set_mapsize(self.env.info()["map_size"] * 2)

    def close(self):
        if self.env is not None:
            if self.mode == "w":
                self.commit()
                self.env.close()
            else:
                _close_reader(self.env)
            self.env = None


# LMDB opens an environment once per process, and LevelDB locks its folder
# for one handle per process: a second open of the same database (a test net
# reading the train net's, a second pycaffe Net, a solver made again) raises
# "already open in this process" / "lock ... already held". Readers therefore
# share one read-only handle per database, closed when the last of them closes;
# each reader keeps its own transaction or iterator on it.
_readers = {}              # database key -> [handle, readers]
_readers_lock = threading.Lock()


def _shared(key, open_handle):
    """The handle readers of database `key` share, opened by open_handle() for the first."""
    with _readers_lock:
        entry = _readers.get(key)
        if entry is None:
            entry = _readers[key] = [open_handle(), 0]
        entry[1] += 1
        return entry[0]


def _open_reader(lmdb, path):
    # a folder written anew (cct digits --overwrite) is another database: its
    # data file has another inode, so it gets an environment of its own
    data_file = os.path.join(path, "data.mdb") if os.path.isdir(path) else path
    try:
        status = os.stat(data_file)
        key = ("lmdb", os.path.realpath(path), status.st_dev, status.st_ino)
    except OSError:
        key = ("lmdb", os.path.realpath(path), None, None)
    # lock=False: readers never write a lock file, so read-only folders work.
    return _shared(key, lambda: lmdb.open(path, readonly=True, lock=False, readahead=False, max_readers=512,
                                          subdir=os.path.isdir(path)))


def _close_reader(handle):
    with _readers_lock:
        for key, entry in list(_readers.items()):
            if entry[0] is handle:
                entry[1] -= 1
                if not entry[1]:
                    del _readers[key]
                    handle.close()
                return


class LevelDB(_Database):
    """A LevelDB folder, through the optional `plyvel` package."""

    def __init__(self, path, mode):
        super().__init__(path, mode)
        try:
            import plyvel
        except ImportError:
            raise DataError(f"{path}: LevelDB needs plyvel: pip install plyvel") from None
        try:
            if mode == "r":
                self.db = _shared(("leveldb", os.path.realpath(path)), lambda: plyvel.DB(path))
            else:
                self.db = plyvel.DB(path, create_if_missing=True, error_if_exists=False)
        except plyvel.Error as error:
            raise DataError(f"{path}: cannot open LevelDB: {error}") from None
        self._batch = self.db.write_batch() if mode == "w" else None

    def items(self):
        yield from self.db.iterator()

    def __len__(self):
        return sum(1 for _ in self.db.iterator(include_value=False))

    def iterate_from_start(self):
        return iter(self.db.iterator())

    def put(self, key, value):
        self._batch.put(self._encode(key), bytes(value))

    def commit(self):
        if self._batch is not None:
            self._batch.write()
            self._batch = self.db.write_batch()

    def close(self):
        if self.db is not None:
            if self.mode == "w":
                self.commit()
                self.db.close()
            else:
                _close_reader(self.db)
            self.db = None


class Cursor:
    """Records in key order; after the last one it starts again at the first
    (Caffe's DataLayer::Next). An empty database is an error."""

    def __init__(self, db):
        self.db = db
        self._iterator = db.iterate_from_start()
        self._peeked = None
        self.wrapped = 0              # how many times the cursor went back to the start
        self.peek()

    def peek(self):
        """The (key, value) that next() returns, without advancing."""
        if self._peeked is None:
            self._peeked = next(self._iterator, None)
            if self._peeked is None:
                self.wrapped += 1
                self._iterator = self.db.iterate_from_start()
                self._peeked = next(self._iterator, None)
                if self._peeked is None:
                    raise DataError(f"{self.db.path}: database holds no records")
        return self._peeked

    def next(self):
        record = self.peek()
        self._peeked = None
        return record

    def skip(self, count):
        for _ in range(count):
            self.next()
