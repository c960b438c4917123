"""pycaffe's caffe.io: images in, blobs in the net's layout, and conversions
between numpy arrays and Caffe's BlobProto / Datum messages.

Images are float32 H x W x K arrays in [0, 1], RGB (pycaffe's convention); a
Transformer turns them into the K x H x W (BGR, mean-subtracted, scaled) arrays
a net takes, in pycaffe's order: resize -> transpose -> channel swap ->
raw_scale -> subtract mean -> input_scale.

resize_image reproduces pycaffe's resize under a current scikit-image (>= 0.19:
`skimage.transform.resize`, mode 'constant'): a Gaussian pre-filter when it
shrinks (anti-aliasing, on by default since 0.15), then scipy.ndimage.zoom with
pixel centers aligned and pixels outside the image counting as the image
minimum, for every interpolation order. skimage's resize is those two scipy
calls, so cct makes them itself: scikit-image is not a dependency (it would
add 0.1 s to the first resize's import and five packages; tests compare with it).
"""
import numpy as np

from cct.core.errors import DataError, ShapeError
from cct.data import transformer
from cct.formats.weights import array_to_blob_proto, blob_proto_shape
from cct.formats.wire import RAW_TYPES
from cct.proto import caffe_pb2

# --- proto / datum / ndarray conversion --------------------------------------------
# Thin wrappers: the conversions live once, in cct.formats.weights (BlobProto) and
# cct.data.transformer (Datum), where they return what Caffe's C++ holds (float32).
# pycaffe's functions return float64 (np.array of the proto's Python floats), so
# these widen; the values are the same float32 numbers.


def blobproto_to_array(blob, return_diff=False):
    """The data (or diff) of a BlobProto as a float64 array, shaped by the legacy
    num/channels/height/width when any is set, else by `shape.dim`: a blob with
    neither is a scalar, so one value gives a 0-d array and more raise a
    ValueError (ShapeError), as pycaffe. As pycaffe, from the float fields
    `data`/`diff`; a blob holding only `double_data` (`double_diff`) gives those
    doubles, unrounded (pycaffe would fail), and one holding only NVIDIA
    Caffe's `raw_data` (`raw_diff`) its FLOAT16, FLOAT or DOUBLE values."""
    floats, doubles = (blob.diff, blob.double_diff) if return_diff else (blob.data, blob.double_data)
    values = np.array(floats if len(floats) or not len(doubles) else doubles, dtype=np.float64)
    raw, kind = (blob.raw_diff, blob.raw_diff_type) if return_diff else (blob.raw_data, blob.raw_data_type)
    if not values.size and raw:
        if kind not in RAW_TYPES or len(raw) % RAW_TYPES[kind].itemsize:
            raise ShapeError(f"BlobProto's raw {'diff' if return_diff else 'data'} ({len(raw)} bytes) is not "
                             f"of a type cct reads (FLOAT16, FLOAT, DOUBLE), got type {kind}")
        values = np.frombuffer(raw, RAW_TYPES[kind]).astype(np.float64)
    shape = blob_proto_shape(blob) if _has_shape(blob) else ()
    if values.size != int(np.prod(shape)):              # pycaffe's reshape raises a ValueError
        described = shape if _has_shape(blob) else "() (none given: a scalar)"
        raise ShapeError(f"BlobProto holds {values.size} values but its shape {described} needs "
                         f"{int(np.prod(shape))}")
    return values.reshape(shape)


def _has_shape(blob):
    # Weight files' shapeless blobs are vectors (cct.formats.weights); pycaffe's are scalars.
    return blob.HasField("shape") or any(blob.HasField(f) for f in ("num", "channels", "height", "width"))


def array_to_blobproto(arr, diff=None):
    """A BlobProto holding `arr` (shape in `shape.dim`), and `diff` if given."""
    return array_to_blob_proto(arr, diff)


def arraylist_to_blobprotovector_str(arraylist):
    """Serialized BlobProtoVector of the arrays."""
    vec = caffe_pb2.BlobProtoVector()
    vec.blobs.extend([array_to_blobproto(arr) for arr in arraylist])
    return vec.SerializeToString()


arraylist_to_blobprotovecor_str = arraylist_to_blobprotovector_str   # pycaffe's old spelling


def blobprotovector_str_to_arraylist(data):
    """The arrays in a serialized BlobProtoVector."""
    vec = caffe_pb2.BlobProtoVector()
    vec.ParseFromString(data)
    return [blobproto_to_array(blob) for blob in vec.blobs]


def array_to_datum(arr, label=None):
    """A Datum of a C x H x W array: uint8 arrays as bytes in `data`, others as `float_data`."""
    return transformer.array_to_datum(arr, label)


def datum_to_array(datum):
    """The C x H x W array of a Datum (uint8 for byte data, float64 for float_data).
    The label is datum.label. An encoded (JPEG/PNG) datum is decoded as Caffe's
    data layer would: BGR channels (or one gray channel), uint8."""
    array = transformer.datum_to_array(datum)
    if array.dtype == np.float32:
        return array.astype(np.float64)          # pycaffe: np.array(float_data).astype(float)
    return array.copy()                          # writable, as pycaffe's np.fromstring copy


# --- pre-processing ---------------------------------------------------------------


class Transformer:
    """Turns H x W x K images into the K x H x W arrays of a net's input.

    `inputs`: {input blob name: its shape (N, K, H, W)}, e.g.
    `Transformer({'data': net.blobs['data'].data.shape})`.
    """

    def __init__(self, inputs):
        self.inputs = {name: tuple(shape) for name, shape in inputs.items()}
        self.transpose = {}
        self.channel_swap = {}
        self.raw_scale = {}
        self.mean = {}
        self.input_scale = {}

    def _check_input(self, in_):
        if in_ not in self.inputs:
            raise KeyError(f"{in_!r} is not one of the net inputs: {sorted(self.inputs)}")

    def preprocess(self, in_, data):
        """H' x W' x K image -> K x H x W float32 input for blob `in_`: resize to the
        blob's H x W, transpose, swap channels, raw_scale, subtract mean, input_scale."""
        self._check_input(in_)
        caffe_in = np.array(data, dtype=np.float32)          # a copy: the caller's image stays intact
        transpose = self.transpose.get(in_)
        channel_swap = self.channel_swap.get(in_)
        raw_scale = self.raw_scale.get(in_)
        mean = self.mean.get(in_)
        input_scale = self.input_scale.get(in_)
        in_dims = self.inputs[in_][2:]
        if caffe_in.shape[:2] != in_dims:
            caffe_in = resize_image(caffe_in, in_dims)
        if transpose is not None:
            caffe_in = caffe_in.transpose(transpose)
        if channel_swap is not None:
            caffe_in = caffe_in[list(channel_swap), :, :]
        if raw_scale is not None:
            caffe_in *= raw_scale
        if mean is not None:
            caffe_in -= mean
        if input_scale is not None:
            caffe_in *= input_scale
        return caffe_in

    def deprocess(self, in_, data):
        """Undo preprocess (but not the resize): K x H x W -> H x W x K."""
        self._check_input(in_)
        decaf_in = np.array(data, dtype=np.float32).squeeze()
        transpose = self.transpose.get(in_)
        channel_swap = self.channel_swap.get(in_)
        raw_scale = self.raw_scale.get(in_)
        mean = self.mean.get(in_)
        input_scale = self.input_scale.get(in_)
        if input_scale is not None:
            decaf_in /= input_scale
        if mean is not None:
            decaf_in += mean
        if raw_scale is not None:
            decaf_in /= raw_scale
        if channel_swap is not None:
            decaf_in = decaf_in[np.argsort(channel_swap), :, :]
        if transpose is not None:
            decaf_in = decaf_in.transpose(np.argsort(transpose))
        return decaf_in

    def set_transpose(self, in_, order):
        """Axis order to go from the image's layout to the blob's, e.g. (2, 0, 1) for HWK -> KHW."""
        self._check_input(in_)
        if len(order) != len(self.inputs[in_]) - 1:
            raise ValueError(f"set_transpose({in_!r}): order {tuple(order)} needs "
                             f"{len(self.inputs[in_]) - 1} axes, one per input axis after the batch")
        self.transpose[in_] = tuple(order)

    def set_channel_swap(self, in_, order):
        """Channel order after transpose, e.g. (2, 1, 0) for RGB -> BGR."""
        self._check_input(in_)
        if len(order) != self.inputs[in_][1]:
            raise ValueError(f"set_channel_swap({in_!r}): order {tuple(order)} needs one entry per "
                             f"input channel ({self.inputs[in_][1]})")
        self.channel_swap[in_] = tuple(order)

    def set_raw_scale(self, in_, scale):
        """Scale applied before the mean subtraction (e.g. 255 for [0, 255] models)."""
        self._check_input(in_)
        self.raw_scale[in_] = scale

    def set_mean(self, in_, mean):
        """Mean to subtract: K values (one per channel), or a K x H' x W' (or, one
        channel, H' x W') array. As pycaffe 1.0, an element-wise mean of another
        height and width is resized to the input's (normalized to [0, 1],
        resize_image, scaled back): the ImageNet mean (3 x 256 x 256) for a 227 input."""
        self._check_input(in_)
        mean = np.asarray(mean)
        channels, dims = self.inputs[in_][1], self.inputs[in_][2:]
        if mean.ndim == 1:
            if mean.shape[0] != channels:
                raise ValueError(f"set_mean({in_!r}): {mean.shape[0]} mean channels, the input has "
                                 f"{channels}")
            mean = mean[:, np.newaxis, np.newaxis]
        elif mean.ndim not in (2, 3):
            raise ValueError(f"set_mean({in_!r}): mean shape {mean.shape} is invalid: give K "
                             "values or a K x H x W array")
        else:
            shape = mean.shape if mean.ndim == 3 else (1,) + mean.shape
            if shape[0] != channels:
                raise ValueError(f"set_mean({in_!r}): mean shape {mean.shape} has {shape[0]} mean "
                                 f"channels, the input has {channels} (input shape {self.inputs[in_][1:]})")
            if shape[1:] != dims:
                mean = _resized_mean(mean.reshape(shape), dims)
        self.mean[in_] = mean

    def set_input_scale(self, in_, scale):
        """Scale applied last, after the mean subtraction."""
        self._check_input(in_)
        self.input_scale[in_] = scale


def _resized_mean(mean, dims):
    """pycaffe 1.0's set_mean resize: a K x H' x W' mean -> K x H x W (dims = (H, W)),
    through resize_image on its values normalized to [0, 1] (float32 there, as pycaffe)."""
    m_min, m_max = mean.min(), mean.max()
    if m_max <= m_min:                          # constant: pycaffe would divide by 0 (NaN)
        return np.full((mean.shape[0],) + tuple(dims), m_min, dtype=mean.dtype)
    normal_mean = (mean - m_min) / (m_max - m_min)
    resized = resize_image(normal_mean.transpose(1, 2, 0), dims).transpose(2, 0, 1)
    return resized * (m_max - m_min) + m_min


# --- image IO ------------------------------------------------------------------------

# skimage's rgb2gray weights (ITU-R 709), which pycaffe's load_image(color=False) uses.
_GRAY_WEIGHTS = np.array([0.2125, 0.7154, 0.0721], np.float32)


def input_transformer(net, mean=None, input_scale=None, raw_scale=None, channel_swap=None):
    """The Transformer Classifier and Detector set up for a net's first input:
    HxWxC images to CxHxW, then the optional settings (None leaves one unset)."""
    name = net.inputs[0]
    transformer = Transformer({name: net.blobs[name].data.shape})
    transformer.set_transpose(name, (2, 0, 1))
    settings = ((transformer.set_mean, mean), (transformer.set_input_scale, input_scale),
                (transformer.set_raw_scale, raw_scale), (transformer.set_channel_swap, channel_swap))
    for setter, value in settings:
        if value is not None:
            setter(name, value)
    return transformer


def load_image(filename, color=True):
    """An image file as float32 in [0, 1]: H x W x 3 RGB, or H x W x 1 gray when
    color=False. Alpha is dropped; gray images are tiled to 3 channels for color.
    A JPEG is turned upright as its EXIF orientation says (H and W swap for
    orientations 5 to 8)."""
    from PIL import Image
    try:
        image = Image.open(filename)
        image.load()
        image = _upright(image)
    except FileNotFoundError:
        raise DataError(f"{filename}: image file not found") from None
    except Exception as error:
        raise DataError(f"{filename}: cannot read image: {error}") from None
    img = _image_as_float(image)
    if not color and img.ndim == 3:
        img = img[:, :, :3] @ _GRAY_WEIGHTS
    if img.ndim == 2:
        img = img[:, :, np.newaxis]
        if color:
            img = np.tile(img, (1, 1, 3))
    elif img.shape[2] == 4:
        img = img[:, :, :3]
    return img.astype(np.float32)


_EXIF_ORIENTATION = 0x0112          # the EXIF tag: how to turn the stored pixels to view them


def _upright(image):
    """A Pillow image turned as its EXIF orientation says, for JPEGs only, as
    pycaffe's skimage.io.imread did through imageio's JPEG reader (exifrotate,
    on by default; its other readers ignore the tag). imageio >= 2.16's reader
    turns only when asked (rotate=True), which skimage 0.26 does not: issue 39
    keeps the upright picture. Pillow names a camera's multi-picture JPEG MPO."""
    if image.format not in ("JPEG", "MPO") or image.getexif().get(_EXIF_ORIENTATION, 1) == 1:
        return image
    from PIL import ImageOps
    return ImageOps.exif_transpose(image)


def _image_as_float(image):
    """skimage.img_as_float of what skimage.io.imread returns for a Pillow image."""
    if image.mode in ("I;16", "I;16B", "I;16L"):
        return np.asarray(image, dtype=np.float32) / 65535.0
    if image.mode in ("I", "F"):
        return np.asarray(image, dtype=np.float32)
    if image.mode == "1":
        return np.asarray(image.convert("L"), dtype=np.float32) / 255.0
    if image.mode not in ("L", "RGB", "RGBA"):
        image = image.convert("RGBA" if "A" in image.mode or "transparency" in image.info else "RGB")
    return np.asarray(image, dtype=np.float32) / 255.0


def resize_image(im, new_dims, interp_order=1):
    """Resize an H x W x K image to new_dims = (height, width), as pycaffe does.

    1 or 3 channels: values rescaled to [0, 1], resized as skimage.transform.resize
    (see _skimage_resize: anti-aliased when it shrinks), scaled back; the
    arithmetic in the image's own dtype, as pycaffe's. Other channel counts:
    scipy.ndimage.zoom with corners aligned, no anti-aliasing. Returns float32.
    """
    from scipy.ndimage import zoom             # here: importing it costs `import cct` 0.2 s
    im = np.asarray(im)
    new_dims = tuple(int(d) for d in new_dims)
    if im.shape[-1] in (1, 3):
        im_min, im_max = im.min(), im.max()
        if im_max <= im_min:                      # constant image: avoid dividing by 0
            return np.full((new_dims[0], new_dims[1], im.shape[-1]), im_min, dtype=np.float32)
        im_std = (im - im_min) / (im_max - im_min)
        resized_im = _skimage_resize(im_std, new_dims, interp_order) * (im_max - im_min) + im_min
    else:
        factors = tuple(np.array(new_dims, dtype=float) / np.array(im.shape[:2])) + (1.0,)
        resized_im = zoom(im, factors, order=interp_order)
    if resized_im.shape[:2] != new_dims:
        raise ShapeError(f"resize_image: got {resized_im.shape[:2]} instead of {new_dims}")
    return resized_im.astype(np.float32)


def _skimage_resize(image, new_dims, order):
    """skimage.transform.resize(image, new_dims, order, mode='constant') of an
    H x W x K float image in [0, 1] -> new_dims[0] x new_dims[1] x K, same dtype
    (float16 as float32). When any axis shrinks by s = old / new > 1, a Gaussian
    of sigma max(0, (s - 1) / 2) per axis blurs first (zeros outside, truncated
    at 4 sigma); then zoom with pixel centers aligned, clipped to [0, 1]."""
    from scipy.ndimage import gaussian_filter, zoom
    if image.dtype == np.float16:
        image = image.astype(np.float32)        # skimage computes float16 in float32
    old = np.array(image.shape, dtype=float)
    new = np.array(new_dims + image.shape[2:], dtype=float)
    scales = old / new                          # > 1 along an axis that shrinks
    if np.any(scales > 1):
        image = gaussian_filter(image, np.maximum(0, (scales - 1) / 2), mode="grid-constant", cval=0.0)
    resized = zoom(image, 1 / scales, order=order, mode="grid-constant", cval=0.0, grid_mode=True)
    return np.clip(resized, 0, 1, out=resized)  # skimage clips to the input's range


def oversample(images, crop_dims):
    """The 4 corner crops, the center crop and their mirrors of every image:
    images: N images H x W x K; returns 10*N x h x w x K float32, image by image."""
    images = [np.asarray(im) for im in images]
    im_shape = np.array(images[0].shape)
    crop_dims = np.array(crop_dims, dtype=int)
    im_center = im_shape[:2] / 2.0
    crops_ix = []
    for i in (0, im_shape[0] - crop_dims[0]):
        for j in (0, im_shape[1] - crop_dims[1]):
            crops_ix.append((i, j, i + crop_dims[0], j + crop_dims[1]))
    center = np.concatenate([im_center - crop_dims / 2.0, im_center + crop_dims / 2.0]).astype(int)
    crops_ix.append(tuple(center))
    crops = np.empty((10 * len(images), crop_dims[0], crop_dims[1], im_shape[-1]), dtype=np.float32)
    for index, im in enumerate(images):
        base = 10 * index
        for k, (top, left, bottom, right) in enumerate(crops_ix):
            crops[base + k] = im[top:bottom, left:right, :]
        crops[base + 5:base + 10] = crops[base:base + 5, :, ::-1, :]   # mirrors
    return crops
