"""cct.io: proto/datum round trips, the Transformer's order of operations,
resize_image against a naive skimage-style blur and bilinear resize, load_image and oversample
(tests/pycaffe/test_io_skimage.py compares with scikit-image itself)."""
import io as pyio

import numpy as np
import pytest
from PIL import Image

from cct import io as cio
from cct.core.errors import DataError, ShapeError
from cct.proto import caffe_pb2

rng = np.random.default_rng(3)


# --- protos and datums -----------------------------------------------------------------

def test_blobproto_round_trip_nd_and_diff():
    data = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    diff = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    proto = cio.array_to_blobproto(data, diff)
    assert list(proto.shape.dim) == [2, 3, 4, 5]
    np.testing.assert_array_equal(cio.blobproto_to_array(proto), data)
    np.testing.assert_array_equal(cio.blobproto_to_array(proto, return_diff=True), diff)
    vector = rng.standard_normal(7).astype(np.float32)
    np.testing.assert_array_equal(cio.blobproto_to_array(cio.array_to_blobproto(vector)), vector)
    with pytest.raises(ShapeError):
        cio.array_to_blobproto(data, diff[:1])


def test_blobproto_legacy_shape_and_double_data():
    proto = caffe_pb2.BlobProto(num=1, channels=2, height=1, width=3, data=range(6))
    array = cio.blobproto_to_array(proto)
    assert array.shape == (1, 2, 1, 3) and array[0, 1, 0, 2] == 5
    doubles = caffe_pb2.BlobProto(double_data=[0.5, 1.5])
    doubles.shape.dim.extend([2])
    np.testing.assert_array_equal(cio.blobproto_to_array(doubles), [0.5, 1.5])
    with pytest.raises(ShapeError):
        cio.blobproto_to_array(caffe_pb2.BlobProto(num=2, channels=1, height=1, width=1, data=[1.0]))


def test_blobprotovector_round_trip():
    arrays = [rng.standard_normal((1, 2, 3, 3)).astype(np.float32), np.arange(4, dtype=np.float32)]
    text = cio.arraylist_to_blobprotovector_str(arrays)
    assert isinstance(text, bytes)
    back = cio.blobprotovector_str_to_arraylist(text)
    assert len(back) == 2
    for got, want in zip(back, arrays):
        np.testing.assert_array_equal(got, want)
    assert cio.arraylist_to_blobprotovecor_str is cio.arraylist_to_blobprotovector_str


def test_datum_round_trips():
    pixels = rng.integers(0, 256, (3, 4, 5), dtype=np.uint8)
    datum = cio.array_to_datum(pixels, label=7)
    assert (datum.channels, datum.height, datum.width, datum.label) == (3, 4, 5, 7)
    assert len(datum.data) == 60 and not len(datum.float_data)
    back = cio.datum_to_array(caffe_pb2.Datum.FromString(datum.SerializeToString()))
    assert back.dtype == np.uint8
    np.testing.assert_array_equal(back, pixels)
    floats = rng.standard_normal((2, 3, 3)).astype(np.float32)
    datum = cio.array_to_datum(floats)
    assert not datum.HasField("label") and not len(datum.data)
    np.testing.assert_array_equal(cio.datum_to_array(datum), floats)
    with pytest.raises(ShapeError):
        cio.array_to_datum(pixels[0])


def test_pycaffe_dtypes_over_the_float32_core():
    """pycaffe returns float64 (np.array of the proto's Python floats); the core
    conversions that cct.io wraps return Caffe's float32. Same values."""
    from cct.data import transformer
    from cct.formats import weights
    values = rng.standard_normal((2, 3)).astype(np.float32)
    proto = cio.array_to_blobproto(values)
    assert weights.blob_proto_to_array(proto).dtype == np.float32
    assert cio.blobproto_to_array(proto).dtype == np.float64
    np.testing.assert_array_equal(cio.blobproto_to_array(proto), values)
    datum = cio.array_to_datum(values[None])
    assert transformer.datum_to_array(datum).dtype == np.float32
    assert cio.datum_to_array(datum).dtype == np.float64
    pixels = cio.datum_to_array(cio.array_to_datum(np.zeros((1, 2, 2), np.uint8)))
    pixels[0, 0, 0] = 1                                  # writable, as pycaffe's copy


def test_blobproto_legacy_dims_win_over_shape_as_in_caffe():
    proto = caffe_pb2.BlobProto(num=1, channels=1, height=2, width=3, data=range(6))
    proto.shape.dim.extend([6])
    assert cio.blobproto_to_array(proto).shape == (1, 1, 2, 3)


def test_encoded_datum_decodes_to_bgr_chw():
    rgb = rng.integers(0, 256, (4, 6, 3), dtype=np.uint8)
    buffer = pyio.BytesIO()
    Image.fromarray(rgb).save(buffer, format="PNG")
    datum = caffe_pb2.Datum(encoded=True, data=buffer.getvalue(), label=1)
    np.testing.assert_array_equal(cio.datum_to_array(datum), rgb[:, :, ::-1].transpose(2, 0, 1))


# --- Transformer -----------------------------------------------------------------------

def test_preprocess_order_and_deprocess_inverse():
    image = rng.uniform(0, 1, (6, 5, 3)).astype(np.float32)
    original = image.copy()
    t = cio.Transformer({"data": (1, 3, 6, 5)})
    t.set_transpose("data", (2, 0, 1))
    t.set_channel_swap("data", (2, 1, 0))
    t.set_raw_scale("data", 255.0)
    t.set_mean("data", np.array([10.0, 20.0, 30.0]))
    t.set_input_scale("data", 0.5)
    out = t.preprocess("data", image)
    # Naive: pycaffe's order, written out channel by channel.
    expected = np.empty((3, 6, 5), np.float32)
    for c in range(3):
        source_channel = (2, 1, 0)[c]
        expected[c] = (image[:, :, source_channel] * 255.0 - (10.0, 20.0, 30.0)[c]) * 0.5
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-4)
    np.testing.assert_array_equal(image, original)          # the caller's image is untouched
    np.testing.assert_allclose(t.deprocess("data", out), image, atol=1e-5)


def test_preprocess_resizes_to_the_input_size_first():
    t = cio.Transformer({"data": (1, 3, 4, 4)})
    t.set_transpose("data", (2, 0, 1))
    image = rng.uniform(0, 1, (8, 8, 3)).astype(np.float32)
    out = t.preprocess("data", image)
    np.testing.assert_allclose(out, cio.resize_image(image, (4, 4)).transpose(2, 0, 1), rtol=1e-6)


def test_elementwise_mean_and_mean_checks():
    t = cio.Transformer({"data": (2, 3, 4, 4)})
    mean = rng.uniform(0, 1, (3, 4, 4))
    t.set_mean("data", mean)
    t.set_transpose("data", (2, 0, 1))
    image = rng.uniform(0, 1, (4, 4, 3)).astype(np.float32)
    np.testing.assert_allclose(t.preprocess("data", image), image.transpose(2, 0, 1) - mean, rtol=1e-5)
    gray = cio.Transformer({"data": (1, 1, 4, 4)})
    gray.set_mean("data", np.ones((4, 4)))                   # H x W for one channel
    with pytest.raises(ValueError, match="mean channels"):
        t.set_mean("data", np.zeros(2))
    with pytest.raises(ValueError, match="1 mean channels, the input has 3"):
        t.set_mean("data", np.zeros((1, 5, 5)))
    t.set_mean("data", rng.uniform(0, 1, (3, 5, 5)))       # resized, as pycaffe 1.0 (test_io_skimage.py)
    assert t.mean["data"].shape == (3, 4, 4)
    with pytest.raises(ValueError, match="invalid"):
        t.set_mean("data", np.zeros((1, 3, 4, 4)))
    with pytest.raises(ValueError, match="transpose"):
        t.set_transpose("data", (1, 0))
    with pytest.raises(ValueError, match="channel"):
        t.set_channel_swap("data", (1, 0))
    with pytest.raises(KeyError, match="not one of the net inputs"):
        t.set_raw_scale("label", 1.0)


# --- resize, load, oversample -------------------------------------------------------------

def naive_blur(image, new_dims):
    """skimage.transform.resize's anti-aliasing before a shrink: along each axis
    that shrinks by s = old / new > 1, a Gaussian of sigma (s - 1) / 2, cut at
    4 sigma, with 0 outside the image."""
    out = image.astype(np.float64)
    for axis, (old, new) in enumerate(zip(image.shape[:2], new_dims)):
        sigma = (old / new - 1) / 2
        if sigma <= 0:
            continue
        radius = int(4 * sigma + 0.5)
        weights = np.exp(-0.5 * (np.arange(-radius, radius + 1) / sigma) ** 2)
        weights /= weights.sum()
        moved = np.moveaxis(out, axis, 0)
        blurred = np.zeros_like(moved)
        for i in range(old):
            for k, weight in zip(range(i - radius, i + radius + 1), weights):
                if 0 <= k < old:
                    blurred[i] += weight * moved[k]
        out = np.moveaxis(blurred, 0, axis)
    return out


def naive_resize(image, new_dims, order):
    """skimage.transform.resize without its blur: pixel centers aligned, outside pixels 0."""
    h, w, k = image.shape
    out = np.zeros((new_dims[0], new_dims[1], k))

    def pixel(r, c, ch):
        return image[r, c, ch] if 0 <= r < h and 0 <= c < w else 0.0
    for i in range(new_dims[0]):
        for j in range(new_dims[1]):
            r = (i + 0.5) * h / new_dims[0] - 0.5
            c = (j + 0.5) * w / new_dims[1] - 0.5
            for ch in range(k):
                if order == 0:
                    out[i, j, ch] = pixel(int(np.floor(r + 0.5)), int(np.floor(c + 0.5)), ch)
                    continue
                r0, c0 = int(np.floor(r)), int(np.floor(c))
                dr, dc = r - r0, c - c0
                top = (1 - dc) * pixel(r0, c0, ch) + dc * pixel(r0, c0 + 1, ch)
                bottom = (1 - dc) * pixel(r0 + 1, c0, ch) + dc * pixel(r0 + 1, c0 + 1, ch)
                out[i, j, ch] = (1 - dr) * top + dr * bottom
    return out


@pytest.mark.parametrize("shape,new_dims,order", [((4, 5, 3), (7, 9), 1), ((8, 6, 1), (3, 4), 1),
                                                  ((5, 5, 3), (10, 3), 0), ((6, 4, 3), (6, 4), 1),
                                                  ((20, 9, 3), (6, 9), 1)])
def test_resize_image_matches_naive(shape, new_dims, order):
    image = rng.uniform(-2, 3, shape).astype(np.float32)
    lo, hi = image.min(), image.max()
    expected = naive_resize(naive_blur((image - lo) / (hi - lo), new_dims), new_dims, order) * (hi - lo) + lo
    got = cio.resize_image(image, new_dims, interp_order=order)
    assert got.shape == new_dims + (shape[2],) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_resize_constant_and_many_channel_images():
    constant = np.full((3, 3, 3), 0.25, np.float32)
    np.testing.assert_array_equal(cio.resize_image(constant, (5, 2)), np.full((5, 2, 3), 0.25))
    image = rng.uniform(0, 1, (4, 4, 5)).astype(np.float32)
    got = cio.resize_image(image, (7, 7))
    assert got.shape == (7, 7, 5)
    # scipy.ndimage.zoom aligns the corners for other channel counts, as in pycaffe.
    np.testing.assert_allclose(got[[0, 0, -1, -1], [0, -1, 0, -1]], image[[0, 0, -1, -1], [0, -1, 0, -1]], atol=1e-6)


def test_load_image_color_gray_alpha(tmp_path):
    rgb = rng.integers(0, 256, (5, 4, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "rgb.png")
    Image.fromarray(np.dstack([rgb, np.full((5, 4), 9, np.uint8)])).save(tmp_path / "rgba.png")
    Image.fromarray(rgb[:, :, 0]).save(tmp_path / "gray.png")
    img = cio.load_image(str(tmp_path / "rgb.png"))
    assert img.shape == (5, 4, 3) and img.dtype == np.float32
    np.testing.assert_allclose(img, rgb / 255.0, atol=1e-7)
    np.testing.assert_allclose(cio.load_image(str(tmp_path / "rgba.png")), rgb / 255.0, atol=1e-7)
    gray = cio.load_image(str(tmp_path / "gray.png"))
    assert gray.shape == (5, 4, 3)
    np.testing.assert_allclose(gray[:, :, 2], rgb[:, :, 0] / 255.0, atol=1e-7)
    gray1 = cio.load_image(str(tmp_path / "gray.png"), color=False)
    assert gray1.shape == (5, 4, 1)
    as_gray = cio.load_image(str(tmp_path / "rgb.png"), color=False)
    expected = (rgb / 255.0) @ np.array([0.2125, 0.7154, 0.0721])
    np.testing.assert_allclose(as_gray[:, :, 0], expected, atol=1e-6)
    with pytest.raises(DataError, match="not found"):
        cio.load_image(str(tmp_path / "missing.png"))


def test_oversample_corners_center_and_mirrors():
    images = rng.uniform(0, 1, (2, 6, 7, 3)).astype(np.float32)
    crops = cio.oversample(images, (4, 4))
    assert crops.shape == (20, 4, 4, 3)
    for n, im in enumerate(images):
        windows = [(0, 0), (0, 3), (2, 0), (2, 3), (1, 1)]     # corners, then center (3-2, 3.5-2)
        for k, (y, x) in enumerate(windows):
            np.testing.assert_array_equal(crops[10 * n + k], im[y:y + 4, x:x + 4])
            np.testing.assert_array_equal(crops[10 * n + 5 + k], im[y:y + 4, x:x + 4][:, ::-1])


def test_blobproto_to_array_reads_the_float_data_in_float64_as_pycaffe():
    """pycaffe reads `data`/`diff` (np.array of the proto's floats); doubles
    alone come back unrounded."""
    blob = caffe_pb2.BlobProto(data=[1.5, 2.25], diff=[0.5, 1.0], double_data=[1e-300, 7.0])
    blob.shape.dim.extend([2])
    assert cio.blobproto_to_array(blob).dtype == np.float64
    assert cio.blobproto_to_array(blob).tolist() == [1.5, 2.25]
    assert cio.blobproto_to_array(blob, return_diff=True).tolist() == [0.5, 1.0]
    tiny = caffe_pb2.BlobProto(double_data=[1e-300, 7.0])
    tiny.shape.dim.extend([2])
    assert cio.blobproto_to_array(tiny).tolist() == [1e-300, 7.0]


def test_blobproto_to_array_reads_nvidia_raw_data():
    """A BlobProto holding only NVIDIA Caffe's raw_data (FLOAT16 here) gives
    its values; a raw type cct does not read is an error naming it."""
    values = np.array([[0.5, -2.0, 3.25]], np.float16)
    blob = caffe_pb2.BlobProto(raw_data=values.tobytes(), raw_data_type=caffe_pb2.FLOAT16)
    blob.shape.dim.extend([1, 3])
    np.testing.assert_array_equal(cio.blobproto_to_array(blob), values.astype(np.float64))
    blob.raw_data_type = caffe_pb2.INT
    with pytest.raises(ShapeError, match="not of a type cct reads"):
        cio.blobproto_to_array(blob)
