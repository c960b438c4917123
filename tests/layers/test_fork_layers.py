"""The forks' small layers: SENet's Axpy, ShuffleNet's ShuffleChannel, the
YOLOv2 port's Reorg, MobileNet-YOLO's ReLU6, caffe-mobilenet's
ConvolutionDepthwise and DepthwiseConvolution, the Fast R-CNN fork's
Dropout scale_train, and HED's parameterless Crop. Forward against loops
written from each fork's C++ and against OpenCV 4's DNN module where it has
the layer (skipped, with one reason, where OpenCV 4 is not here); every
backward by the numerical gradient checker; the device paths on the numpy
CPU device and on OpenCL against the host; the errors."""
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

import cct
from cct.core.errors import ConfigError, ShapeError
from cct.core.passes import insert_splits, legacy_crop_offsets
from cct.devices.cpu import CPU
from cct.formats.prototxt import read_net
from cct.formats.upgrade import upgrade_net
from cct.testing.gradient_check import check_layer_gradient, make_layer
from helpers.devices import OPENCL, assert_close_both_ways, opencl_or_skip, run_both_ways
from helpers.layers import run_layer
from helpers.opencv4 import assert_close, compare_with_opencv

RNG = np.random.default_rng(147)
F32 = np.float32
HED = Path(__file__).parent / "fork_models" / "hed_deploy.prototxt"


def rand(*shape):
    return RNG.standard_normal(shape)


@pytest.fixture(params=["cpu", OPENCL])
def device(request):
    return CPU if request.param == "cpu" else opencl_or_skip()


def one_layer(kind, bottoms, fields="", top="y"):
    return (f'layer {{ name: "{top}" type: "{kind}" ' + " ".join(f'bottom: "{b}"' for b in bottoms)
            + f' top: "{top}" {fields} }}\n')


# --- Axpy ----------------------------------------------------------------------------
def naive_axpy(a, x, y):
    """The fork's Forward_cpu: top = y, then caffe_axpy per image and channel."""
    n, c = x.shape[:2]
    top = y.reshape(n, c, -1).copy()
    for i in range(n):
        for j in range(c):
            top[i, j] += a.reshape(n, c)[i, j] * x.reshape(n, c, -1)[i, j]
    return top.reshape(x.shape)


@pytest.mark.parametrize("a_shape", [(2, 3, 1, 1), (2, 3)])
def test_axpy_forward_and_gradient(a_shape):
    a, x, y = rand(*a_shape), rand(2, 3, 4, 5), rand(2, 3, 4, 5)
    _, _, tops = run_layer('type: "Axpy"', [a, x, y])
    np.testing.assert_allclose(tops[0].data, naive_axpy(a, x, y), rtol=1e-12)
    check_layer_gradient(make_layer('type: "Axpy"'), [a, x, y])


def test_axpy_in_place_on_y():
    a, x, y = rand(2, 3, 1, 1), rand(2, 3, 2, 2), rand(2, 3, 2, 2)
    layer = make_layer('type: "Axpy"')
    bottoms = [cct.Blob(v.shape, np.float64) for v in (a, x, y)]
    for blob, value in zip(bottoms, (a, x, y)):
        blob.data[...] = value
    layer.set_up(bottoms, [bottoms[2]])
    layer.forward(bottoms, [bottoms[2]])
    np.testing.assert_allclose(bottoms[2].data, naive_axpy(a, x, y), rtol=1e-12)
    dy = rand(*y.shape)
    bottoms[2].diff[...] = dy
    layer.backward([bottoms[2]], [True, True, True], bottoms)
    np.testing.assert_allclose(bottoms[1].diff, dy * a, rtol=1e-12)
    np.testing.assert_allclose(bottoms[0].diff, (dy * x).sum(axis=(2, 3), keepdims=True), rtol=1e-12)
    np.testing.assert_array_equal(bottoms[2].diff, dy)


def test_axpy_errors():
    with pytest.raises(ShapeError, match=r"axpy.*a \(bottom\[0\]\) \(2, 3, 2, 1\) must be \(N, C\)"):
        run_layer('type: "Axpy"', [rand(2, 3, 2, 1), rand(2, 3, 2, 2), rand(2, 3, 2, 2)])
    with pytest.raises(ShapeError, match=r"y \(bottom\[2\]\) \(2, 3, 2, 3\) must have the shape of x"):
        run_layer('type: "Axpy"', [rand(2, 3), rand(2, 3, 2, 2), rand(2, 3, 2, 3)])
    x = cct.Blob((1, 2, 2, 2))
    with pytest.raises(ConfigError, match=r"'axpy' \(Axpy\): top: Axpy runs in place only on y"):
        make_layer('type: "Axpy"').set_up([cct.Blob((1, 2)), x, cct.Blob((1, 2, 2, 2))], [x])


def test_axpy_against_opencv(tmp_path):
    """OpenCV 4's importer rewrites Axpy as a Scale of the third bottom by the
    first plus the second (caffe_importer.cpp: addInput(layer.bottom(2),
    scaleId, 0)), a * y + x where the fork computes a * x + y (SE-ResNet's
    a * residual + shortcut), and takes one image only: so cct's Axpy with x
    and y exchanged gives OpenCV's numbers, at batch 1."""
    a, x, y = rand(1, 4, 1, 1).astype(F32), rand(1, 4, 3, 5).astype(F32), rand(1, 4, 3, 5).astype(F32)
    text = one_layer("Axpy", ["a", "x", "y"], top="out") + one_layer("Axpy", ["a", "y", "x"], top="swapped")
    ours, theirs = compare_with_opencv(tmp_path, text, {"a": a, "x": x, "y": y}, ["out", "swapped"])
    assert_close(ours["swapped"], theirs["out"])
    assert_close(ours["out"], theirs["swapped"])


@pytest.mark.parametrize("in_place", [False, True])
def test_axpy_on_device_matches_the_host(device, in_place):
    results = run_both_ways(device, 'type: "Axpy"', [rand(2, 3, 1, 1), rand(2, 3, 4, 5), rand(2, 3, 4, 5)],
                            in_place=in_place, in_place_bottom=2)
    assert_close_both_ways(results, 1e-6)


# --- ShuffleChannel ------------------------------------------------------------------
def naive_shuffle(x, group):
    """The fork's Resize_cpu: input channel i * (C / group) + j to output channel j * group + i."""
    n, c = x.shape[:2]
    cols = c // group
    y = np.empty_like(x)
    for i in range(group):
        for j in range(cols):
            y[:, j * group + i] = x[:, i * cols + j]
    return y


@pytest.mark.parametrize("group, shape", [(3, (2, 6, 3, 4)), (2, (1, 8, 5)), (1, (2, 4, 2, 2)), (4, (2, 4, 1, 1))])
def test_shuffle_channel_forward_and_gradient(group, shape):
    text = f'type: "ShuffleChannel" shuffle_channel_param {{ group: {group} }}'
    x = rand(*shape)
    _, _, tops = run_layer(text, [x])
    np.testing.assert_array_equal(tops[0].data, naive_shuffle(x, group))
    check_layer_gradient(make_layer(text), [x])


def test_shuffle_channel_errors():
    with pytest.raises(ConfigError, match=r"shuffle_channel_param.group: must divide the bottom's 5 channels, got 2"):
        run_layer('type: "ShuffleChannel" shuffle_channel_param { group: 2 }', [rand(1, 5, 2, 2)])
    with pytest.raises(ConfigError, match=r"shuffle_channel_param.group: must be > 0, got 0"):
        run_layer('type: "ShuffleChannel" shuffle_channel_param { group: 0 }', [rand(1, 4, 2, 2)])
    x = cct.Blob((1, 4, 2, 2))
    with pytest.raises(ConfigError, match=r"top: ShuffleChannel cannot run in place"):
        make_layer('type: "ShuffleChannel"').set_up([x], [x])


@pytest.mark.parametrize("group", [2, 3])
def test_shuffle_channel_against_opencv(tmp_path, group):
    text = one_layer("ShuffleChannel", ["x"], f"shuffle_channel_param {{ group: {group} }}")
    ours, theirs = compare_with_opencv(tmp_path, text, {"x": rand(2, 12, 3, 5).astype(F32)}, ["y"])
    np.testing.assert_array_equal(ours["y"], theirs["y"])


@pytest.mark.parametrize("group, shape", [(3, (2, 6, 3, 4)), (2, (5, 4, 2, 2))])
def test_shuffle_channel_on_device_matches_the_host(device, group, shape):
    results = run_both_ways(device, f'type: "ShuffleChannel" shuffle_channel_param {{ group: {group} }}',
                            [rand(*shape)])
    assert_close_both_ways(results, 0)


# --- Reorg ---------------------------------------------------------------------------
def naive_reorg(x, stride, reverse):
    """The fork's Forward_cpu: its reorg_cpu loop on the bottom's sizes, forward = reverse."""
    n, c, h, w = x.shape
    tc, tw, th = c // (stride * stride), w * stride, h * stride
    flat, out = x.reshape(-1), np.empty(x.size)
    for b in range(n):
        for k in range(c):
            for j in range(h):
                for i in range(w):
                    bottom_index = i + w * (j + h * (k + c * b))
                    c2, offset = k % tc, k // tc
                    w2, h2 = i * stride + offset % stride, j * stride + offset // stride
                    top_index = w2 + tw * (h2 + th * (c2 + tc * b))
                    if reverse:
                        out[top_index] = flat[bottom_index]
                    else:
                        out[bottom_index] = flat[top_index]
    if reverse:
        return out.reshape(n, tc, th, tw)
    return out.reshape(n, c * stride * stride, h // stride, w // stride)


@pytest.mark.parametrize("stride, reverse, shape", [(2, False, (2, 8, 4, 6)), (2, True, (2, 8, 4, 6)),
                                                    (3, False, (1, 9, 6, 3)), (3, True, (1, 18, 2, 3)),
                                                    (1, False, (1, 2, 3, 3))])
def test_reorg_forward_and_gradient(stride, reverse, shape):
    text = f'type: "Reorg" reorg_param {{ stride: {stride} reverse: {str(reverse).lower()} }}'
    x = rand(*shape)
    _, _, tops = run_layer(text, [x])
    want = naive_reorg(x, stride, reverse)
    assert tops[0].shape == want.shape
    np.testing.assert_array_equal(tops[0].data, want)
    check_layer_gradient(make_layer(text), [x])


def test_reorg_errors():
    with pytest.raises(ConfigError, match=r"reorg_param.stride: must be given"):
        run_layer('type: "Reorg"', [rand(1, 4, 2, 2)])
    with pytest.raises(ConfigError, match=r"reorg_param.stride: 2: its square must divide the channels"):
        run_layer('type: "Reorg" reorg_param { stride: 2 }', [rand(1, 6, 4, 4)])
    with pytest.raises(ConfigError, match=r"reorg_param.stride: 2: must divide the height and width of the bottom "
                                          r"\(1, 4, 3, 4\)"):
        run_layer('type: "Reorg" reorg_param { stride: 2 }', [rand(1, 4, 3, 4)])
    with pytest.raises(ShapeError, match=r"reorg.*bottom must be 4-d"):
        run_layer('type: "Reorg" reorg_param { stride: 2 }', [rand(4, 4)])


# OpenCV 4 reads neither stride (always 2) nor reverse: compared on the forward at stride 2
def test_reorg_against_opencv(tmp_path):
    text = one_layer("Reorg", ["x"], "reorg_param { stride: 2 }")
    ours, theirs = compare_with_opencv(tmp_path, text, {"x": rand(2, 8, 6, 4).astype(F32)}, ["y"])
    np.testing.assert_array_equal(ours["y"], theirs["y"])


# --- ReLU6 ---------------------------------------------------------------------------
def away_from_kinks(*shape):
    """Values in (-9, 9) at least 0.05 from 0 and 6."""
    x = RNG.uniform(-9, 9, shape)
    for kink in (0.0, 6.0):
        x = np.where(np.abs(x - kink) < 0.05, x + 0.1, x)
    return x


def test_relu6_forward_and_gradient():
    x = away_from_kinks(2, 3, 4, 5)
    _, _, tops = run_layer('type: "ReLU6"', [x])
    np.testing.assert_array_equal(tops[0].data, np.minimum(np.maximum(x, 0), 6))
    check_layer_gradient(make_layer('type: "ReLU6"'), [x])


def test_relu6_in_place_backward_reads_the_output():
    x = np.array([-1.0, 0.0, 3.0, 6.0, 7.0])
    blob = cct.Blob((5,), np.float64)
    blob.data[...] = x
    layer = make_layer('type: "ReLU6"')
    layer.set_up([blob], [blob])
    layer.forward([blob], [blob])
    np.testing.assert_array_equal(blob.data, [0, 0, 3, 6, 6])
    blob.diff[...] = 1
    layer.backward([blob], [True], [blob])
    np.testing.assert_array_equal(blob.diff, [0, 0, 1, 0, 0])      # the fork's: x > 0 and x < 6


def test_relu6_against_opencv(tmp_path):
    ours, theirs = compare_with_opencv(tmp_path, one_layer("ReLU6", ["x"]), {"x": away_from_kinks(2, 3, 4, 5).astype(F32)},
                                       ["y"])
    np.testing.assert_array_equal(ours["y"], theirs["y"])


@pytest.mark.parametrize("in_place", [False, True])
def test_relu6_on_device_matches_the_host(device, in_place):
    results = run_both_ways(device, 'type: "ReLU6"', [away_from_kinks(2, 3, 4, 5)], in_place=in_place)
    assert_close_both_ways(results, 0)


def naive_relu6(x, slope):
    """The fork's ReLU6Layer::Forward_cpu and Backward_cpu, element by element
    (the slope read from the proto's float)."""
    slope = float(np.float32(slope))
    y, factor = np.empty_like(x), np.empty_like(x)
    for i, value in np.ndenumerate(x):
        y[i] = min(max(value, 0.0) + slope * min(value, 0.0), 6.0)
        factor[i] = ((value > 0) + slope * (value <= 0)) * (value < 6.0)
    return y, factor


@pytest.mark.parametrize("slope", [0.1, -0.5])
def test_relu6_negative_slope(slope):
    """relu6_param (the fork's ReLUParameter, field 211): its negative_slope, as the fork's ReLU6 class."""
    text = f'type: "ReLU6" relu6_param {{ negative_slope: {slope} }}'
    x = away_from_kinks(2, 3, 4, 5)
    layer, bottoms, tops = run_layer(text, [x])
    want, factor = naive_relu6(x, slope)
    np.testing.assert_array_equal(tops[0].data, want)
    dy = rand(*x.shape)
    tops[0].diff[...] = dy
    layer.backward(tops, [True], bottoms)
    np.testing.assert_array_equal(bottoms[0].diff, dy * factor)
    check_layer_gradient(make_layer(text), [x])


@pytest.mark.parametrize("slope", [0.1, -0.5])
def test_relu6_negative_slope_in_place(slope):
    """In place: with a positive slope y stands in for x (the same signs, the
    same side of 6), with a negative one the layer keeps x aside."""
    x = away_from_kinks(3, 7)
    blob = cct.Blob(x.shape, np.float64)
    blob.data[...] = x
    layer = make_layer(f'type: "ReLU6" relu6_param {{ negative_slope: {slope} }}')
    layer.set_up([blob], [blob])
    layer.forward([blob], [blob])
    want, factor = naive_relu6(x, slope)
    np.testing.assert_array_equal(blob.data, want)
    blob.diff[...] = 1
    layer.backward([blob], [True], [blob])
    np.testing.assert_array_equal(blob.diff, factor)


def test_relu6_param_reads_from_a_binary_net(tmp_path):
    """Field 211 is free in BVLC's schema: a binary net keeps it as the fork wrote it."""
    from cct.proto import caffe_pb2
    net = caffe_pb2.NetParameter()
    text_format.Merge('layer { name: "r" type: "ReLU6" bottom: "x" top: "x" relu6_param { negative_slope: 0.25 } }',
                      net)
    data = net.SerializeToString()
    assert b"\x9a\x0d" in data                       # field 211, length-delimited: the fork's tag
    back = caffe_pb2.NetParameter()
    back.ParseFromString(data)
    assert back.layer[0].relu6_param.negative_slope == 0.25


@pytest.mark.parametrize("slope", [0.1, -0.5])
@pytest.mark.parametrize("in_place", [False, True])
def test_relu6_negative_slope_on_device_matches_the_host(device, slope, in_place):
    results = run_both_ways(device, f'type: "ReLU6" relu6_param {{ negative_slope: {slope} }}',
                            [away_from_kinks(2, 3, 4, 5)], in_place=in_place)
    assert_close_both_ways(results, 0)


# --- Dropout scale_train (Fast R-CNN's fork) -----------------------------------------
def test_dropout_without_scale_train():
    x = rand(4, 50)
    text = 'type: "Dropout" dropout_param { dropout_ratio: 0.3 scale_train: false }'
    cct.set_random_seed(5)
    _, _, tops = run_layer(text, [x], phase=cct.TRAIN)
    kept = tops[0].data != 0
    assert 0 < kept.mean() < 1
    np.testing.assert_array_equal(tops[0].data[kept], x[kept])              # unscaled in training
    check_layer_gradient(make_layer(text, cct.TRAIN), [x])
    factor = np.float32(1.0 / np.float32(1.0 / (1.0 - np.float32(0.3))))   # the fork's 1 / scale_, floats
    _, _, tops = run_layer(text, [x], phase=cct.TEST)
    np.testing.assert_array_equal(tops[0].data, x * factor)
    check_layer_gradient(make_layer(text, cct.TEST), [x])


@pytest.mark.parametrize("phase", [cct.TRAIN, cct.TEST])
def test_dropout_without_scale_train_on_device_matches_the_host(device, phase):
    # the host's masks uploaded (device_masks off): the device's own draw is not the host's
    results = run_both_ways(device, 'type: "Dropout" dropout_param { dropout_ratio: 0.4 scale_train: false }',
                            [rand(2, 3, 4, 5)], phase=phase, random_seed=9,
                            configure=lambda layer: layer.configure({"device_masks": False}))
    assert_close_both_ways(results, 1e-7)


# --- ConvolutionDepthwise, DepthwiseConvolution ----------------------------------------
def naive_depthwise(x, w, bias, stride, pad, dilation):
    """The fork's Forward_cpu (conv_dw_layer.cpp): per image, channel and
    output, the window's products summed in the fork's order, then the bias."""
    n, c, h, wd = x.shape
    kh, kw = w.shape[2:]
    oh = (h + 2 * pad[0] - (dilation[0] * (kh - 1) + 1)) // stride[0] + 1
    ow = (wd + 2 * pad[1] - (dilation[1] * (kw - 1) + 1)) // stride[1] + 1
    y = np.zeros((n, c, oh, ow))
    for i in range(n):
        for ch in range(c):
            for r in range(oh):
                for q in range(ow):
                    for a in range(kh):
                        for b in range(kw):
                            hi = -pad[0] + r * stride[0] + a * dilation[0]
                            wi = -pad[1] + q * stride[1] + b * dilation[1]
                            if 0 <= hi < h and 0 <= wi < wd:
                                y[i, ch, r, q] += w[ch, 0, a, b] * x[i, ch, hi, wi]
    return y + (0 if bias is None else bias.reshape(1, c, 1, 1))


DEPTHWISE = [  # convolution_param fields, (stride, pad, dilation) as (h, w) pairs
    ("kernel_size: 3 pad: 1", (1, 1), (1, 1), (1, 1)),
    ("kernel_size: 3 stride: 2 pad: 1 bias_term: false", (2, 2), (1, 1), (1, 1)),
    ("kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_h: 0 pad_w: 2 dilation: 2 dilation: 3", (2, 1), (0, 2), (2, 3)),
    ("kernel_size: 5 pad: 2 stride: 3", (3, 3), (2, 2), (1, 1)),
]
FILLERS = 'weight_filler { type: "gaussian" std: 1 } bias_filler { type: "gaussian" std: 1 }'


@pytest.mark.parametrize("index", range(len(DEPTHWISE)))
def test_convolution_depthwise_forward_and_gradient(index):
    fields, stride, pad, dilation = DEPTHWISE[index]
    # num_output and group are implied: the fork reads neither
    text = f'type: "ConvolutionDepthwise" convolution_param {{ num_output: 9 group: 2 {fields} {FILLERS} }}'
    x = rand(2, 4, 7, 8)
    layer, _, tops = run_layer(text, [x])
    assert layer.blobs[0].shape[:2] == (4, 1)
    bias = layer.blobs[1].data if len(layer.blobs) > 1 else None
    np.testing.assert_allclose(tops[0].data, naive_depthwise(x, layer.blobs[0].data, bias, stride, pad, dilation),
                               rtol=1e-12, atol=1e-12)
    check_layer_gradient(make_layer(text), [rand(2, 4, 7, 8)])


@pytest.mark.parametrize("kind", ["DepthwiseConvolution", "Convolution"])
def test_grouped_convolution_with_one_channel_per_group(kind):
    """group == channels == num_output: the direct kernels (cct.lowering.depthwise)."""
    text = f'type: "{kind}" convolution_param {{ num_output: 6 group: 6 kernel_size: 3 stride: 2 pad: 1 {FILLERS} }}'
    x = rand(2, 6, 9, 7)
    layer, _, tops = run_layer(text, [x])
    want = naive_depthwise(x, layer.blobs[0].data, layer.blobs[1].data, (2, 2), (1, 1), (1, 1))
    np.testing.assert_allclose(tops[0].data, want, rtol=1e-12, atol=1e-12)
    check_layer_gradient(make_layer(text), [x])


def test_depthwise_convolution_with_other_groups_is_convolution():
    text = f'convolution_param {{ num_output: 4 group: 2 kernel_size: 3 {FILLERS} }}'
    x = rand(2, 6, 5, 5)
    theirs, _, want = run_layer('type: "Convolution" ' + text, [x])
    layer, bottoms, tops = run_layer('type: "DepthwiseConvolution" ' + text, [x])
    for mine, blob in zip(layer.blobs, theirs.blobs):
        mine.data[...] = blob.data
    layer.forward(bottoms, tops)
    np.testing.assert_allclose(tops[0].data, want[0].data, rtol=1e-12)


def test_convolution_depthwise_errors():
    with pytest.raises(ConfigError, match=r"'convolutiondepthwise' \(ConvolutionDepthwise\): bottom: takes exactly 1"):
        run_layer('type: "ConvolutionDepthwise" convolution_param { kernel_size: 3 }', [rand(1, 2, 4, 4)] * 2, 2)
    with pytest.raises(ConfigError, match=r"convolution_param.kernel_size: must be > 0"):
        run_layer('type: "ConvolutionDepthwise" convolution_param { kernel_size: 0 }', [rand(1, 2, 4, 4)])


@pytest.mark.parametrize("index", [0, 1, 3])
def test_convolution_depthwise_against_opencv(tmp_path, index):
    fields = DEPTHWISE[index][0]
    text = one_layer("ConvolutionDepthwise", ["x"], f"convolution_param {{ num_output: 5 {fields} {FILLERS} }}")
    ours, theirs = compare_with_opencv(tmp_path, text, {"x": rand(2, 5, 9, 8).astype(F32)}, ["y"])
    assert_close(ours["y"], theirs["y"])


@pytest.mark.parametrize("in_place", [False])
def test_depthwise_layers_on_device_match_the_host(device, in_place):
    text = f'type: "ConvolutionDepthwise" convolution_param {{ kernel_size: 3 stride: 2 pad: 1 {FILLERS} }}'
    assert_close_both_ways(run_both_ways(device, text, [rand(2, 3, 7, 6)], in_place=in_place), 1e-5)


# --- HED's parameterless Crop ----------------------------------------------------------
# Where the fork's crop_layer.cpp puts each side output of HED's deploy net,
# from its coordinate maps: conv1_1's pad 35 moves the first by 35 - 1 = 34;
# each pool halves it on the way down and the deconvolution of kernel 2s,
# stride s, pad 0 adds (2s - 1) / 2 on the way up.
HED_OFFSETS = {"upscore-dsn1": 34, "upscore-dsn2": 35, "upscore-dsn3": 36, "upscore-dsn4": 38, "upscore-dsn5": 42}


def small_hed(size):
    """HED's deploy net on a size x size input with 4 channels per convolution
    (the offsets depend on the geometry alone) and seeded gaussian weights."""
    net = upgrade_net(read_net(str(HED)))
    shape = net.layer[0].input_param.shape[0]
    shape.dim[2] = shape.dim[3] = size
    for layer in net.layer:
        p = layer.convolution_param
        if layer.type == "Convolution" and p.num_output > 1:
            p.num_output = 4
        if layer.type in ("Convolution", "Deconvolution"):
            p.weight_filler.type, p.weight_filler.std = "gaussian", 0.3
            p.bias_filler.type, p.bias_filler.std = "gaussian", 0.1
    return net


def test_hed_side_outputs_at_the_forks_offsets():
    cct.set_random_seed(38)
    net = cct.Net(legacy_crop_offsets(small_hed(24)), cct.TEST)
    net.blobs["data"].data[...] = rand(1, 3, 24, 24)
    net.forward()
    for top, offset in HED_OFFSETS.items():
        upsampled = net.blobs[top.replace("upscore", "score") + "-up"].data
        want = upsampled[:, :, offset:offset + 24, offset:offset + 24]         # the old layer's copy
        np.testing.assert_array_equal(net.blobs[top].data, want)
    fused = net.blobs["upscore-fuse"].data
    assert fused.shape == (1, 1, 24, 24)


def test_hed_offsets_with_splits_and_a_log_line(caplog):
    with caplog.at_level("INFO", logger="cct"):
        net = legacy_crop_offsets(insert_splits(small_hed(500)), "hed_deploy.prototxt")
    crops = [layer for layer in net.layer if layer.type == "Crop"]
    assert [list(layer.crop_param.offset) for layer in crops] == [[o, o] for o in HED_OFFSETS.values()]
    assert "hed_deploy.prototxt: layer 'crop' (Crop): no crop_param; crops at the legacy offset (h 34, w 34)" \
        in caplog.text


def test_hed_through_net_crops_at_34(tmp_path):
    path = tmp_path / "hed.prototxt"
    path.write_text(str(small_hed(24)))
    net = cct.Net(str(path), cct.TEST)
    assert net.layers[[layer.type for layer in net.layers].index("Crop")].layer_param.crop_param.offset[:] == [34, 34]
