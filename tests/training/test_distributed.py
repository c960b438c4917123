"""Data-parallel training's shards (Layer.set_shard, issue 14): every data
source read by N ranks of batch b gives, at every iteration, the records one
reader of batch N*b reads, so within an epoch the ranks' records are disjoint
and together cover the source."""
import numpy as np
import pytest

import cct
from cct.testing.gradient_check import make_layer
from helpers.data import raw_datum, start, write_hdf5_list, write_image_list, write_lmdb


# --- shards -----------------------------------------------------------------------------
def lmdb_source(folder, count):
    datums = [raw_datum(np.full((1, 2, 2), index % 256, np.uint8), index) for index in range(count)]
    return (f'type: "Data" data_param {{ source: "{write_lmdb(folder / "db", datums)}" '
            'backend: LMDB batch_size: %d }')


def image_source(folder, count):
    pixels = [np.full((3, 2, 2), index % 256, np.uint8) for index in range(count)]
    root, listing = write_image_list(folder, pixels, list(range(count)))
    return (f'type: "ImageData" image_data_param {{ source: "{listing}" root_folder: "{root}" '
            'shuffle: true batch_size: %d }')


def hdf5_source(folder, count):
    ids = np.arange(count, dtype=np.float32)
    cut = count // 2
    listing = write_hdf5_list(folder, [{"x": ids[:cut, None], "label": ids[:cut]},
                                       {"x": ids[cut:, None], "label": ids[cut:]}])
    return f'type: "HDF5Data" hdf5_data_param {{ source: "{listing}" shuffle: true batch_size: %d }}'


SOURCES = {"Data": lmdb_source, "ImageData": image_source, "HDF5Data": hdf5_source}


def reader(source, batch, rank, size, seed=11):
    """A layer of the source at `batch`, set to shard `rank` of `size`; it
    returns the record ids (the labels) of each batch it reads."""
    layer = make_layer(f'name: "d" top: "x" top: "label" {source % batch}', cct.TRAIN)
    tops = start(layer)
    layer.set_shard(rank, size, seed)

    def read():
        layer.reshape([], tops)
        layer.forward([], tops)
        return tops[1].data.astype(int).tolist()
    return layer, read


@pytest.mark.parametrize("kind", SOURCES)
@pytest.mark.parametrize("size", [2, 3])
def test_shards_read_what_one_reader_of_their_summed_batch_reads(kind, size, tmp_path):
    count, batch = 13, 2          # 13: the epochs do not end with an iteration
    source = SOURCES[kind](tmp_path, count)
    whole_layer, whole = reader(source, size * batch, 0, 1)
    shards = [reader(source, batch, rank, size) for rank in range(size)]
    for _ in range(3 * count // (size * batch) + 1):          # past two reshuffles
        expected = whole()
        parts = [read() for _, read in shards]
        assert sorted(sum(parts, [])) == sorted(expected)
        assert all(len(part) == batch for part in parts)
    for layer, _ in shards + [(whole_layer, None)]:
        getattr(layer, "close", lambda: None)()


@pytest.mark.parametrize("kind", SOURCES)
def test_shards_are_disjoint_and_cover_each_epoch(kind, tmp_path):
    size, batch = 2, 3
    count = 4 * size * batch      # an epoch is 4 iterations
    source = SOURCES[kind](tmp_path, count)
    shards = [reader(source, batch, rank, size) for rank in range(size)]
    for epoch in range(2):
        seen = [sum((read() for _ in range(4)), []) for _, read in shards]
        assert sorted(seen[0] + seen[1]) == list(range(count)), f"epoch {epoch}"
    for layer, _ in shards:
        getattr(layer, "close", lambda: None)()


def test_a_shard_outside_the_ranks_is_refused(tmp_path):
    layer = make_layer(f'name: "d" top: "x" top: "label" {lmdb_source(tmp_path, 3) % 1}', cct.TRAIN)
    start(layer)
    with pytest.raises(cct.core.errors.ConfigError, match=r"layer 'd' \(Data\): shard: rank 2 of 2"):
        layer.set_shard(2, 2, 0)
    layer.close()
