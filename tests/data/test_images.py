"""cct.data.images, Caffe's decode / grey / resize / encode through OpenCV: the
layout it hands out, what each colour mode keeps (EXIF orientation, alpha, grey),
INTER_LINEAR's own arithmetic (no antialiasing) on hand-computed pixels, and
errors that name the file. Bit-exactness against BVLC Caffe itself is in
tests/cli/test_datasets_caffe_images.py and tests/layers/test_data_caffe_images.py."""
import cv2
import numpy as np
import pytest

from cct.core.errors import ConfigError, DataError
from cct.data.images import decode_image, encode_image, read_image, resize_image
from helpers.caffe_images import FOLDER

IMAGES = FOLDER / "images"


def test_read_image_applies_exif_orientation_and_native_decode_does_not():
    # exif_rotated.jpg is stored 90 wide x 60 high with Orientation 6 (rotate 90 degrees).
    assert read_image(IMAGES / "exif_rotated.jpg").shape == (3, 90, 60)
    assert read_image(IMAGES / "exif_rotated.jpg", is_color=False).shape == (1, 90, 60)
    data = (IMAGES / "exif_rotated.jpg").read_bytes()
    assert decode_image(data, "native").shape == (3, 60, 90)
    assert decode_image(data, "color").shape == (3, 90, 60)


def test_colour_modes_keep_or_drop_alpha_and_grey():
    rgba = (IMAGES / "alpha_rgba.png").read_bytes()
    native, color = decode_image(rgba, "native"), decode_image(rgba, "color")
    assert native.shape == (4, 37, 50) and color.shape == (3, 37, 50)
    np.testing.assert_array_equal(color, native[:3])          # IMREAD_COLOR drops alpha, keeps BGR
    grey = (IMAGES / "stripes_gray.png").read_bytes()
    assert decode_image(grey, "native").shape == (1, 77, 123)
    colour_of_grey = decode_image(grey, "color")
    np.testing.assert_array_equal(colour_of_grey, np.repeat(decode_image(grey, "gray"), 3, axis=0))


def test_read_image_is_bgr_chw():
    bgr = cv2.imread(str(IMAGES / "gradient_rgb.png"), cv2.IMREAD_COLOR)          # (H, W, 3)
    np.testing.assert_array_equal(read_image(IMAGES / "gradient_rgb.png"), bgr.transpose(2, 0, 1))


def test_resize_is_inter_linear_without_antialiasing():
    # Shrinking 4 -> 1 samples at x = (0 + 0.5) * 4 - 0.5 = 1.5, between pixels 1 and 2:
    # 0, where an antialiasing filter would average in the 200 (Pillow gives 50).
    assert resize_image(np.array([[[0, 0, 0, 200]]], np.uint8), 1, 1).tolist() == [[[0]]]
    # Growing 2 -> 4 samples at -0.25 (clamped), 0.25, 0.75, 1.25 (clamped).
    assert resize_image(np.array([[[0, 100]]], np.uint8), 1, 4).tolist() == [[[0, 25, 75, 100]]]


def test_resize_keeps_one_channel_and_reads_chw():
    grey = np.arange(24, dtype=np.uint8).reshape(1, 4, 6)
    assert resize_image(grey, 2, 3).shape == (1, 2, 3)
    colour = np.random.default_rng(0).integers(0, 256, (3, 7, 5)).astype(np.uint8)
    expected = cv2.resize(colour.transpose(1, 2, 0).copy(), (9, 11), interpolation=cv2.INTER_LINEAR)
    np.testing.assert_array_equal(resize_image(colour, 11, 9), expected.transpose(2, 0, 1))


@pytest.mark.parametrize("channels", [1, 3])
def test_png_round_trip(channels):
    image = np.random.default_rng(1).integers(0, 256, (channels, 5, 6)).astype(np.uint8)
    np.testing.assert_array_equal(decode_image(encode_image(image, "png"), "native"), image)


def test_errors_name_the_file():
    with pytest.raises(DataError, match="nowhere.png: could not open or find file"):
        read_image("nowhere.png")
    with pytest.raises(DataError, match="record 7: cannot decode image"):
        decode_image(b"not an image", "color", "record 7")
    with pytest.raises(DataError, match="record 8: cannot decode image"):
        decode_image(b"", "color", "record 8")
    with pytest.raises(ConfigError, match="a.png: cannot encode as 'nope'"):
        encode_image(np.zeros((3, 2, 2), np.uint8), "nope", "a.png")
    with pytest.raises(ConfigError, match="record 9: unknown color mode 'rgb'"):
        decode_image(b"x", "rgb", "record 9")


def test_sixteen_bit_images_are_refused_as_caffe_does():
    ok, png16 = cv2.imencode(".png", np.full((2, 2), 1000, np.uint16))
    assert ok
    with pytest.raises(DataError, match="deep.png: image data type must be unsigned char"):
        decode_image(png16.tobytes(), "native", "deep.png")
    assert decode_image(png16.tobytes(), "color", "deep.png").dtype == np.uint8     # IMREAD_COLOR is 8-bit



def test_an_image_header_opencv_refuses_is_a_clean_error():
    """Found by the fuzzer (issue 15): a BMP whose header claims a width past
    OpenCV's limit raised cv2.error from inside imdecode."""
    bmp = bytearray(encode_image(np.zeros((3, 2, 2), np.uint8), "bmp"))
    bmp[18:22] = (1 << 30).to_bytes(4, "little")          # biWidth
    with pytest.raises(DataError, match="record 3: cannot decode image"):
        decode_image(bytes(bmp), "color", "record 3")
