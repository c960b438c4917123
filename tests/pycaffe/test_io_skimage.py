"""cct.io against scikit-image itself: what pycaffe's io.py computes when it runs
on a current scikit-image (its set_mean, resize_image and load_image call
skimage.transform.resize and skimage.io.imread). The references below follow
BVLC 1.0's python/caffe/io.py step by step, with scikit-image doing the work.
Skipped where scikit-image is missing (setup.cfg's `test` extra installs it)."""
import numpy as np
import pytest
from PIL import Image

from cct import io as cio

skimage = pytest.importorskip("skimage")
from skimage.transform import resize as sk_resize          # noqa: E402

rng = np.random.default_rng(39)
TOLERANCE = 1e-6


def bvlc_resize_image(im, new_dims, order=1):
    """pycaffe's resize_image for 1 or 3 channels, on skimage: H x W x K -> float32."""
    im_min, im_max = im.min(), im.max()
    im_std = (im - im_min) / (im_max - im_min)
    resized = sk_resize(im_std, new_dims, order=order, mode="constant")   # anti-aliases a shrink
    return (resized * (im_max - im_min) + im_min).astype(np.float32)


# --- set_mean -------------------------------------------------------------------------------

def test_set_mean_resizes_an_imagenet_sized_mean_for_a_227_input():
    """BVLC 1.0 io.py Transformer.set_mean: normalize to [0, 1], resize_image, scale back."""
    mean = rng.uniform(60.0, 140.0, (3, 256, 256))            # ilsvrc_2012_mean.npy's shape and range
    transformer = cio.Transformer({"data": (10, 3, 227, 227)})
    transformer.set_mean("data", mean)
    m_min, m_max = mean.min(), mean.max()
    normal = (mean - m_min) / (m_max - m_min)
    expected = bvlc_resize_image(normal.transpose(1, 2, 0), (227, 227)).transpose(2, 0, 1) \
        * (m_max - m_min) + m_min
    got = transformer.mean["data"]
    assert got.shape == (3, 227, 227)
    np.testing.assert_allclose(got, expected, rtol=0, atol=TOLERANCE)
    image = rng.uniform(0, 1, (227, 227, 3)).astype(np.float32)
    transformer.set_transpose("data", (2, 0, 1))
    np.testing.assert_allclose(transformer.preprocess("data", image), image.transpose(2, 0, 1) - expected,
                               rtol=0, atol=1e-4)          # float32 image minus a ~100 mean


def test_set_mean_enlarges_a_grey_mean_and_refuses_other_channel_counts():
    transformer = cio.Transformer({"data": (1, 1, 12, 10)})
    mean = rng.uniform(0.0, 255.0, (5, 4))                       # H x W for one channel
    transformer.set_mean("data", mean)
    m_min, m_max = mean.min(), mean.max()
    expected = bvlc_resize_image(((mean - m_min) / (m_max - m_min))[:, :, None], (12, 10)) \
        .transpose(2, 0, 1) * (m_max - m_min) + m_min
    np.testing.assert_allclose(transformer.mean["data"], expected, rtol=0, atol=TOLERANCE)
    with pytest.raises(ValueError, match="3 mean channels, the input has 1"):
        transformer.set_mean("data", np.zeros((3, 12, 10)))


# --- resize_image -------------------------------------------------------------------------------

RATIOS = [((256, 256), (227, 227)), ((100, 60), (33, 70)), ((50, 40), (7, 9)), ((9, 9), (3, 3)),
          ((31, 17), (30, 16)), ((10, 12), (31, 25)), ((4, 5), (7, 9)), ((6, 6), (6, 6))]


@pytest.mark.parametrize("channels", [3, 1], ids=["colour", "grey"])
@pytest.mark.parametrize("old,new", RATIOS, ids=[f"{o[0]}x{o[1]}-to-{n[0]}x{n[1]}" for o, n in RATIOS])
def test_resize_image_matches_skimage(old, new, channels):
    """Shrinks (anti-aliased: skimage's Gaussian pre-filter), enlargements, one
    of each per axis, and the identity; float32 images as Transformer passes them."""
    image = rng.uniform(-20.0, 300.0, old + (channels,)).astype(np.float32)
    got = cio.resize_image(image, new)
    assert got.shape == new + (channels,) and got.dtype == np.float32
    np.testing.assert_allclose(got, bvlc_resize_image(image, new), rtol=0, atol=TOLERANCE)
    unit = rng.uniform(0, 1, old + (channels,))                  # float64, in [0, 1]: 1e-6 absolute
    np.testing.assert_allclose(cio.resize_image(unit, new), bvlc_resize_image(unit, new), rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("order", [0, 3])
def test_resize_image_other_orders_match_skimage(order):
    image = rng.uniform(0, 1, (40, 30, 3))
    for new in ((13, 11), (90, 70)):
        np.testing.assert_allclose(cio.resize_image(image, new, interp_order=order),
                                   bvlc_resize_image(image, new, order), rtol=0, atol=TOLERANCE)


# --- load_image and EXIF orientation ------------------------------------------------------------

# Stored pixels from the upright picture, per EXIF orientation (the tag says how to
# turn the stored pixels to view them, so the file holds the inverse turn).
STORED = {1: lambda a: a, 2: lambda a: a[:, ::-1], 3: lambda a: a[::-1, ::-1], 4: lambda a: a[::-1],
          5: lambda a: a.transpose(1, 0, 2), 6: lambda a: np.rot90(a, 1),
          7: lambda a: np.rot90(a, 2).transpose(1, 0, 2), 8: lambda a: np.rot90(a, -1)}


def upright_picture():
    """A smooth 90 x 60 RGB uint8 picture that JPEG keeps close to itself."""
    rows, cols = np.mgrid[0:90, 0:60]
    channels = (rows * 2.5, cols * 4.0, 128 + 100 * np.sin(rows / 9.0) * np.cos(cols / 7.0))
    return np.stack(channels, axis=-1).clip(0, 255).astype(np.uint8)


def save_jpeg(path, pixels, orientation):
    image = Image.fromarray(np.ascontiguousarray(pixels))
    exif = image.getexif()
    exif[0x0112] = orientation
    image.save(path, quality=95, exif=exif)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_load_image_applies_the_jpeg_exif_orientation(tmp_path, orientation):
    """As pycaffe's skimage.io.imread did through imageio's legacy JPEG reader
    (exifrotate, on by default). Today's imageio turns only when asked
    (rotate=True, the reference here); skimage 0.26 does not ask (issue 39)."""
    import imageio.v3 as iio
    upright = upright_picture()
    path = str(tmp_path / f"o{orientation}.jpg")
    save_jpeg(path, STORED[orientation](upright), orientation)
    got = cio.load_image(path)
    expected = skimage.img_as_float(iio.imread(path, rotate=True)).astype(np.float32)
    assert got.shape == (90, 60, 3) == expected.shape
    np.testing.assert_allclose(got, expected, rtol=0, atol=TOLERANCE)
    assert np.abs(got - upright / 255.0).mean() < 0.01        # upright, not just the same turn as imageio's
    grey = cio.load_image(path, color=False)
    assert grey.shape == (90, 60, 1)
    np.testing.assert_allclose(grey[:, :, 0], skimage.color.rgb2gray(expected), rtol=0, atol=TOLERANCE)


def test_load_image_turns_a_grey_jpeg_and_leaves_a_png_as_stored(tmp_path):
    """Only a JPEG turns (pycaffe's imageio PNG reader ignores the tag, as skimage's does)."""
    upright = upright_picture()[:, :, 1]
    stored = np.ascontiguousarray(np.rot90(upright, 1))
    for name in ("grey.jpg", "grey.png"):
        image = Image.fromarray(stored)
        exif = image.getexif()
        exif[0x0112] = 6
        image.save(str(tmp_path / name), exif=exif)
    jpeg = cio.load_image(str(tmp_path / "grey.jpg"), color=False)
    read = skimage.img_as_float(skimage.io.imread(str(tmp_path / "grey.jpg")))      # as stored
    np.testing.assert_allclose(jpeg[:, :, 0], np.rot90(read, -1), rtol=0, atol=TOLERANCE)
    png = cio.load_image(str(tmp_path / "grey.png"), color=False)
    np.testing.assert_array_equal(png[:, :, 0], stored / np.float32(255.0))
