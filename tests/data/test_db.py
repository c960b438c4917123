"""cct.data.db: the LMDB writer growing its map, the cursor wrapping around,
record keys, backend names."""
import os

import pytest

from cct.core.errors import DataError
from cct.data import db as cct_db
from helpers.requirements import require


def test_db_cursor_wraps_and_lmdb_grows(tmp_path):
    path = tmp_path / "big"
    payload = bytes(10_000)
    with cct_db.LMDB(str(path), "w", commit_every=100, map_size=256 << 10) as db:   # ~3 MB: the map must grow
        for index in range(300):
            db.put(cct_db.record_key(index, "x.png"), payload)
    with cct_db.open_db(path, "lmdb") as db:
        assert len(db) == 300
        cursor = db.cursor()
        first = cursor.next()[0]
        assert first == b"00000000_x.png"
        cursor.skip(299)
        assert cursor.next()[0] == first and cursor.wrapped == 1
    assert cct_db.record_key(12) == "00000012"


def test_db_backend_names(tmp_path):
    assert cct_db.backend_name(1) == "lmdb" and cct_db.backend_name("LEVELDB") == "leveldb"
    with pytest.raises(DataError, match="unknown database backend 'rocks'"):
        cct_db.open_db(tmp_path, "rocks")


@pytest.mark.parametrize("backend", ["lmdb", "leveldb"])
def test_one_database_read_by_several_readers_at_once(tmp_path, backend):
    """LMDB opens a folder once per process and LevelDB locks it for one
    handle; readers share that handle (a test net reading the train net's
    database, a solver made twice), each with its own cursor."""
    if backend == "leveldb":
        require("plyvel")
    with cct_db.open_db(str(tmp_path / "db"), backend, "w") as writer:
        for index in range(3):
            writer.put(cct_db.record_key(index), bytes([index]))
    first = cct_db.open_db(str(tmp_path / "db"), backend, "r")
    second = cct_db.open_db(str(tmp_path / "db"), backend, "r")
    assert [value for _, value in first.items()] == [value for _, value in second.items()] == [b"\0", b"\1", b"\2"]
    cursors = first.cursor(), second.cursor()
    assert [cursors[0].next(), cursors[0].next(), cursors[1].next()][2][1] == b"\0"     # cursors apart
    first.close()
    assert len(second) == 3                   # still open for the other reader
    second.close()
    assert not [key for key in cct_db._readers if os.path.realpath(tmp_path / "db") in key]
    third = cct_db.open_db(str(tmp_path / "db"), backend, "r")
    assert len(third) == 3
    third.close()
