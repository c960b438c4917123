"""The dataset tools (cct.cli.datasets): convert_imageset and
compute_image_mean, round trips through a Data layer, means against numpy,
flags and the errors for bad input."""
import lmdb
import numpy as np
import pytest
from PIL import Image

import cct
from cct.cli.datasets import compute_image_mean, convert_imageset, image_mean
from cct.core.errors import ConfigError, DataError
from cct.data.digits import convert_arrays_to_lmdb
from cct.data.transformer import load_mean_file
from cct.proto import caffe_pb2
from helpers.data import opencv_read, read_db, read_with_data_layer, rgb_to_bgr_chw
from helpers.requirements import require

RNG = np.random.default_rng(9)


@pytest.fixture
def image_set(tmp_path):
    """Four RGB PNGs (one a BMP) under root/ and a list file; returns (root, list, BGR CHW images)."""
    root = tmp_path / "root"
    root.mkdir()
    pixels, lines = [], []
    for index in range(4):
        rgb = RNG.integers(0, 256, (6, 5, 3)).astype(np.uint8)
        name = f"img{index}.bmp" if index == 3 else f"img{index}.png"
        Image.fromarray(rgb, "RGB").save(root / name)
        pixels.append(rgb_to_bgr_chw(rgb))
        lines.append(f"{name} {index + 1}")
    listing = tmp_path / "list.txt"
    listing.write_text("\n".join(lines) + "\n")
    return str(root) + "/", str(listing), np.stack(pixels)


# --- convert_imageset ------------------------------------------------------------------------
def test_convert_imageset_raw_round_trip(image_set, tmp_path):
    root, listing, pixels = image_set
    out = tmp_path / "db"
    assert convert_imageset([root, listing, str(out)]) == 0
    keys, datums = read_db(out)
    assert keys == ["00000000_img0.png", "00000001_img1.png", "00000002_img2.png", "00000003_img3.bmp"]
    assert all(not d.encoded and (d.channels, d.height, d.width) == (3, 6, 5) for d in datums)
    data, labels = read_with_data_layer(out, 4)
    np.testing.assert_array_equal(data, pixels)
    np.testing.assert_array_equal(labels, [1, 2, 3, 4])


def test_convert_imageset_gray_resize(image_set, tmp_path):
    root, listing, pixels = image_set
    out = tmp_path / "db"
    assert convert_imageset(["-gray", "--resize_width=4", "--resize_height", "3", root, listing, str(out)]) == 0
    data, _ = read_with_data_layer(out, 4)
    assert data.shape == (4, 1, 3, 4)
    np.testing.assert_array_equal(data[0], opencv_read(root + "img0.png", color=False, height=3, width=4))


def test_convert_imageset_encoded_keeps_file_bytes(image_set, tmp_path):
    root, listing, pixels = image_set
    out = tmp_path / "db"
    assert convert_imageset(["--encoded", root, listing, str(out)]) == 0
    _, datums = read_db(out)
    assert all(d.encoded for d in datums)
    assert datums[0].data == open(root + "img0.png", "rb").read()       # same format: the file itself
    data, labels = read_with_data_layer(out, 4)
    np.testing.assert_array_equal(data, pixels)
    np.testing.assert_array_equal(labels, [1, 2, 3, 4])


def test_convert_imageset_encode_type_reencodes(image_set, tmp_path):
    root, listing, pixels = image_set
    out = tmp_path / "db"
    assert convert_imageset(["--encode_type=png", root, listing, str(out)]) == 0   # implies --encoded
    _, datums = read_db(out)
    assert datums[3].encoded and datums[3].data[:8] == b"\x89PNG\r\n\x1a\n"      # the BMP became PNG
    data, _ = read_with_data_layer(out, 4)
    np.testing.assert_array_equal(data, pixels)


def test_convert_imageset_shuffle_keeps_every_image(image_set, tmp_path):
    root, listing, pixels = image_set
    cct.set_random_seed(4)
    out = tmp_path / "db"
    assert convert_imageset(["--shuffle=true", root, listing, str(out)]) == 0
    keys, datums = read_db(out)
    assert sorted(k.split("_", 1)[1] for k in keys) == ["img0.png", "img1.png", "img2.png", "img3.bmp"]
    for key, datum in zip(keys, datums):         # every label still goes with its image
        index = int(key.split("img")[1][0])
        assert datum.label == index + 1
        np.testing.assert_array_equal(np.frombuffer(datum.data, np.uint8).reshape(3, 6, 5), pixels[index])


def test_convert_imageset_check_size_and_skips(image_set, tmp_path):
    root, listing, _ = image_set
    Image.fromarray(np.zeros((7, 7, 3), np.uint8)).save(root + "big.png")
    with open(listing, "a") as handle:
        handle.write("missing.png 9\nbig.png 5\n")
    with pytest.raises(DataError, match="big.png: incorrect data field size"):
        convert_imageset(["--check_size", root, listing, str(tmp_path / "a")])
    # The database is written aside and renamed into place: a run that fails (or is killed)
    # leaves nothing under its name for the next run to refuse.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["list.txt", "root"]
    # Without --check_size an unreadable image is skipped, as Caffe does.
    assert convert_imageset([root, listing, str(tmp_path / "b")]) == 0
    keys, _ = read_db(tmp_path / "b")
    assert len(keys) == 5 and keys[-1] == "00000005_big.png"


def test_convert_imageset_errors(image_set, tmp_path):
    root, listing, _ = image_set
    with pytest.raises(DataError, match="image list .*nolist.txt.* not found"):
        convert_imageset([root, str(tmp_path / "nolist.txt"), str(tmp_path / "x")])
    with pytest.raises(ConfigError, match="convert_imageset: .*arguments are required"):
        convert_imageset([root])
    with pytest.raises(ConfigError, match="invalid choice"):
        convert_imageset(["--backend=rocksdb", root, listing, str(tmp_path / "y")])
    with pytest.raises(ConfigError, match="convert_imageset: --gray: expected true or false"):
        convert_imageset(["--gray=maybe", root, listing, str(tmp_path / "y")])
    convert_imageset([root, listing, str(tmp_path / "z")])
    with pytest.raises(DataError, match="already exists"):
        convert_imageset([root, listing, str(tmp_path / "z")])
    with pytest.raises(DataError, match="none of the 4 images"):
        convert_imageset([str(tmp_path) + "/wrong/", listing, str(tmp_path / "w")])
    assert convert_imageset(["--help"]) == 0


def test_leveldb_round_trip(image_set, tmp_path):
    """convert_imageset --backend leveldb, read back by a Data layer, keys read by plyvel."""
    require("plyvel")
    import plyvel
    root, listing, pixels = image_set
    out = tmp_path / "images_leveldb"
    assert convert_imageset(["--backend", "leveldb", root, listing, str(out)]) == 0
    database = plyvel.DB(str(out))
    keys = [key.decode() for key, _ in database]
    database.close()
    assert keys == ["00000000_img0.png", "00000001_img1.png", "00000002_img2.png", "00000003_img3.bmp"]
    data, labels = read_with_data_layer(out, 4, backend="LEVELDB")
    np.testing.assert_array_equal(data, pixels)
    np.testing.assert_array_equal(labels, [1, 2, 3, 4])


def test_leveldb_backend_needs_plyvel(image_set, tmp_path):
    try:
        import plyvel  # noqa: F401
        pytest.skip("plyvel is installed")
    except ImportError:
        pass
    root, listing, _ = image_set
    with pytest.raises(DataError, match="LevelDB needs plyvel"):
        convert_imageset(["--backend", "leveldb", root, listing, str(tmp_path / "l")])


# --- compute_image_mean ------------------------------------------------------------------------
def test_compute_image_mean_equals_numpy(image_set, tmp_path):
    root, listing, pixels = image_set
    for flags, name in (([], "raw"), (["--encoded"], "enc")):
        out = tmp_path / name
        convert_imageset(flags + [root, listing, str(out)])
        mean_file = tmp_path / f"{name}.binaryproto"
        assert compute_image_mean([str(out), str(mean_file)]) == 0
        proto = caffe_pb2.BlobProto.FromString(mean_file.read_bytes())
        assert (proto.num, proto.channels, proto.height, proto.width) == (1, 3, 6, 5)
        expected = pixels.astype(np.float64).mean(axis=0)
        np.testing.assert_allclose(np.array(proto.data).reshape(3, 6, 5), expected, rtol=1e-6)
        np.testing.assert_allclose(load_mean_file(mean_file), expected, rtol=1e-6)
    assert compute_image_mean([str(tmp_path / "raw")]) == 0          # no output file: log only


def test_mean_file_feeds_the_transformer(image_set, tmp_path):
    root, listing, pixels = image_set
    convert_imageset([root, listing, str(tmp_path / "db")])
    compute_image_mean([str(tmp_path / "db"), str(tmp_path / "mean.binaryproto")])
    data, _ = read_with_data_layer(tmp_path / "db", 4, f'mean_file: "{tmp_path / "mean.binaryproto"}"')
    mean = pixels.astype(np.float64).mean(axis=0)
    np.testing.assert_allclose(data, pixels - mean, atol=1e-4)
    np.testing.assert_allclose(data.mean(axis=0), 0, atol=1e-4)


def test_compute_image_mean_errors(tmp_path):
    with pytest.raises(DataError, match="nodb: database not found"):
        compute_image_mean([str(tmp_path / "nodb")])
    convert_arrays_to_lmdb(np.zeros((1, 1, 2, 2), np.uint8), [0], tmp_path / "one")
    with lmdb.open(str(tmp_path / "one")) as env, env.begin(write=True) as txn:
        txn.put(b"00000001", caffe_pb2.Datum(channels=1, height=3, width=3, data=bytes(9)).SerializeToString())
    with pytest.raises(DataError, match="record '00000001': incorrect data field size"):
        image_mean(tmp_path / "one")
