"""Convolution, Deconvolution and Im2col (layers/conv.py): gradients under every
lowering type, forward against naive loops, Caffe's parameter checks, and the
BVLC reference cases run with each lowering forced."""
import numpy as np
import pytest

from cct.core.errors import ConfigError, ShapeError
from cct.testing.gradient_check import check_layer_gradient, make_layer, setup_layer
from helpers.layers import run_layer
from helpers.reference import assert_matches_caffe, run_case

RNG = np.random.default_rng(3)
TYPES = (1, 2, 3)


@pytest.fixture(params=TYPES, ids=lambda t: f"type{t}")
def lowering_type(request, monkeypatch):
    monkeypatch.setenv("CCT_LOWERING", str(request.param))
    return request.param


def conv_text(kind="Convolution", **fields):
    filler = 'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 }'
    body = " ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in fields.items())
    return f'type: "{kind}" convolution_param {{ {body} {filler} }}'


# --- naive references ---------------------------------------------------------------
def caffe_size(size, kernel, stride, pad, dilation):
    """Caffe's output size: C++ int division, which truncates toward zero."""
    return int((size + 2 * pad - (dilation * (kernel - 1) + 1)) / stride) + 1


def naive_conv(x, w, b, stride, pad, dilation, group):
    """Per output pixel: gather the window by explicit index arithmetic and sum."""
    n_, c_, h_, w_ = x.shape
    o_, cg, kh, kw = w.shape
    og = o_ // group
    (sh, sw), (ph, pw), (dh, dw) = stride, pad, dilation
    oh_, ow_ = caffe_size(h_, kh, sh, ph, dh), caffe_size(w_, kw, sw, pw, dw)
    y = np.zeros((n_, o_, oh_, ow_))
    for o in range(o_):
        g = o // og
        for oh in range(oh_):
            for ow in range(ow_):
                for i in range(kh):
                    for j in range(kw):
                        h, v = oh * sh - ph + i * dh, ow * sw - pw + j * dw
                        if 0 <= h < h_ and 0 <= v < w_:
                            y[:, o, oh, ow] += x[:, g * cg:(g + 1) * cg, h, v] @ w[o, :, i, j]
        if b is not None:
            y[:, o] += b[o]
    return y


def naive_deconv(x, w, b, stride, pad, dilation, group):
    """Every input pixel scatters w[c] * x into the output window it stamps."""
    n_, c_, h_, w_ = x.shape
    _, og, kh, kw = w.shape
    cg = c_ // group
    (sh, sw), (ph, pw), (dh, dw) = stride, pad, dilation
    oh_ = sh * (h_ - 1) + dh * (kh - 1) + 1 - 2 * ph
    ow_ = sw * (w_ - 1) + dw * (kw - 1) + 1 - 2 * pw
    y = np.zeros((n_, og * group, oh_, ow_))
    for c in range(c_):
        g = c // cg
        for h in range(h_):
            for v in range(w_):
                for i in range(kh):
                    for j in range(kw):
                        oh, ow = h * sh - ph + i * dh, v * sw - pw + j * dw
                        if 0 <= oh < oh_ and 0 <= ow < ow_:
                            y[:, g * og:(g + 1) * og, oh, ow] += x[:, c, h, v, None] * w[c, :, i, j]
    return y + b.reshape(1, -1, 1, 1)


def naive_im2col(x, kernel, stride, pad, dilation):
    """Caffe's im2col of each image: row c*KH*KW + i*KW + j, column oh*OW + ow."""
    n_, c_, h_, w_ = x.shape
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = kernel, stride, pad, dilation
    oh_, ow_ = caffe_size(h_, kh, sh, ph, dh), caffe_size(w_, kw, sw, pw, dw)
    out = np.zeros((n_, c_ * kh * kw, oh_, ow_))
    for c in range(c_):
        for i in range(kh):
            for j in range(kw):
                for oh in range(oh_):
                    for ow in range(ow_):
                        h, v = oh * sh - ph + i * dh, ow * sw - pw + j * dw
                        if 0 <= h < h_ and 0 <= v < w_:
                            out[:, (c * kh + i) * kw + j, oh, ow] = x[:, c, h, v]
    return out


# --- forward against the naive loops -------------------------------------------------------
CONV_CASES = [
    (dict(num_output=4, kernel_size=3), (2, 3, 6, 7), (1, 1), (0, 0), (1, 1), 1),
    (dict(num_output=6, kernel_size=3, pad=1, stride=2, group=2), (2, 4, 7, 6), (2, 2), (1, 1), (1, 1), 2),
    (dict(num_output=4, kernel_h=3, kernel_w=2, stride_h=2, stride_w=1, pad_h=2, pad_w=1),
     (1, 2, 7, 5), (2, 1), (2, 1), (1, 1), 1),
    (dict(num_output=2, kernel_size=3, dilation=2, pad=2, group=2), (2, 4, 7, 7), (1, 1), (2, 2), (2, 2), 2),
    ({"num_output": 3, "kernel_size": 2, "stride": 3, "dilation": "1 dilation: 2"},
     (2, 2, 8, 9), (3, 3), (0, 0), (1, 2), 1),
]


# Kernels that overrun the padded input by less than the stride: Caffe's truncating
# division still gives an output, the cells past the input read as zero.
OVERRUN_CASES = [
    (dict(num_output=3, kernel_size=3, stride=2), (2, 2, 2, 2), (2, 2), (0, 0), (1, 1), 1),
    (dict(num_output=4, kernel_h=4, kernel_w=3, stride_h=3, stride_w=2, pad_w=1, group=2),
     (2, 4, 3, 7), (3, 2), (0, 1), (1, 1), 2),
    (dict(num_output=2, kernel_size=3, dilation=2, stride=3, pad=1), (1, 3, 2, 4), (3, 3), (1, 1), (2, 2), 1),
]


@pytest.mark.parametrize("fields,shape,stride,pad,dilation,group", CONV_CASES + OVERRUN_CASES)
def test_convolution_forward_matches_naive(lowering_type, fields, shape, stride, pad, dilation, group):
    x = RNG.standard_normal(shape)
    layer, _, tops = run_layer(conv_text(**fields), [x])
    assert layer.lowering_type == lowering_type
    w, b = layer.blobs[0].data, layer.blobs[1].data
    np.testing.assert_allclose(tops[0].data, naive_conv(x, w, b, stride, pad, dilation, group), atol=1e-10)


@pytest.mark.parametrize("fields,shape,stride,pad,dilation,group", [
    (dict(num_output=3, kernel_size=4, stride=2, pad=1), (2, 2, 4, 3), (2, 2), (1, 1), (1, 1), 1),
    (dict(num_output=4, kernel_h=3, kernel_w=2, stride_h=1, stride_w=3, group=2, dilation=2),
     (1, 4, 3, 4), (1, 3), (0, 0), (2, 2), 2),
])
def test_deconvolution_forward_matches_naive(lowering_type, fields, shape, stride, pad, dilation, group):
    x = RNG.standard_normal(shape)
    layer, _, tops = run_layer(conv_text("Deconvolution", **fields), [x])
    w, b = layer.blobs[0].data, layer.blobs[1].data
    assert w.shape[:2] == (shape[1], fields["num_output"] // group)
    np.testing.assert_allclose(tops[0].data, naive_deconv(x, w, b, stride, pad, dilation, group), atol=1e-10)


@pytest.mark.parametrize("fields,kernel,stride,pad,dilation", [
    (dict(kernel_size=3), (3, 3), (1, 1), (0, 0), (1, 1)),
    (dict(kernel_h=2, kernel_w=3, stride_h=2, stride_w=1, pad_h=1, pad_w=2), (2, 3), (2, 1), (1, 2), (1, 1)),
    (dict(kernel_size=2, dilation=2, pad=1, stride=2), (2, 2), (2, 2), (1, 1), (2, 2)),
    (dict(kernel_h=6, kernel_w=4, stride_h=3, stride_w=2), (6, 4), (3, 2), (0, 0), (1, 1)),
    (dict(kernel_size=3, dilation=3, stride=4), (3, 3), (4, 4), (0, 0), (3, 3)),
])
def test_im2col_forward_matches_naive(fields, kernel, stride, pad, dilation):
    x = RNG.standard_normal((2, 3, 5, 6))
    body = " ".join(f"{k}: {v}" for k, v in fields.items())
    _, _, tops = run_layer(f'type: "Im2col" convolution_param {{ {body} }}', [x])
    np.testing.assert_array_equal(tops[0].data, naive_im2col(x, kernel, stride, pad, dilation))


# --- gradients ----------------------------------------------------------------------------
@pytest.mark.parametrize("fields,shape", [
    (dict(num_output=3, kernel_size=3), (2, 2, 5, 5)),
    (dict(num_output=4, kernel_size=3, pad=1, stride=2, group=2), (2, 4, 6, 5)),
    (dict(num_output=2, kernel_h=2, kernel_w=3, pad_h=1, stride_h=1, stride_w=2, dilation=2), (1, 3, 6, 7)),
    (dict(num_output=4, kernel_size=1, bias_term=False), (2, 3, 3, 4)),
    (dict(num_output=3, kernel_size=3, stride=2), (2, 2, 2, 2)),                       # overruns both axes
    (dict(num_output=4, kernel_h=4, kernel_w=2, stride_h=3, stride_w=2, pad_w=1, group=2), (2, 4, 3, 4)),
    (dict(num_output=2, kernel_size=3, dilation=2, stride=3, pad=1), (1, 2, 2, 3)),
])
def test_convolution_gradient(lowering_type, fields, shape):
    check_layer_gradient(make_layer(conv_text(**fields)), [RNG.standard_normal(shape)])


@pytest.mark.parametrize("fields,shape", [
    (dict(num_output=3, kernel_size=4, stride=2, pad=1), (2, 2, 3, 3)),
    (dict(num_output=4, kernel_size=3, stride=2, group=2, dilation=2), (1, 4, 3, 2)),
])
def test_deconvolution_gradient(lowering_type, fields, shape):
    check_layer_gradient(make_layer(conv_text("Deconvolution", **fields)), [RNG.standard_normal(shape)])


def test_convolution_two_bottoms_share_weights(lowering_type):
    check_layer_gradient(make_layer(conv_text(num_output=2, kernel_size=2, pad=1)),
                         [RNG.standard_normal((2, 2, 4, 4)), RNG.standard_normal((2, 2, 4, 4))], num_tops=2)


@pytest.mark.parametrize("param,shape", [
    ("kernel_size: 3 pad: 1 stride: 2", (2, 2, 5, 4)),
    ("kernel_h: 4 kernel_w: 3 stride_h: 3 stride_w: 2", (2, 2, 3, 2)),           # overruns both axes
])
def test_im2col_gradient(param, shape):
    check_layer_gradient(make_layer(f'type: "Im2col" convolution_param {{ {param} }}'),
                         [RNG.standard_normal(shape)])


def test_kernel_3_stride_2_on_2x2_input(lowering_type):
    """Caffe: (2 + 0 - 3) / 2 + 1 = 1 (C++ division truncates -1/2 to 0); the one
    window covers the 4 pixels and 5 zeros past the image."""
    layer = make_layer(conv_text(num_output=2, kernel_size=3, stride=2))
    x = np.array([[[[1.0, 2.0], [3.0, 4.0]]]])
    bottoms, tops = setup_layer(layer, [x])
    assert tops[0].shape == (1, 2, 1, 1)
    layer.blobs[0].data[...] = np.arange(1.0, 19.0).reshape(2, 1, 3, 3)   # [[1 2 3] [4 5 6] [7 8 9]], then +9
    layer.blobs[1].data[...] = [0.5, -1.0]
    layer.forward(bottoms, tops)
    # 1*1 + 2*2 + 3*4 + 4*5 = 37 (+0.5); 1*10 + 2*11 + 3*13 + 4*14 = 127 (-1)
    np.testing.assert_allclose(tops[0].data.ravel(), [37.5, 126.0])
    tops[0].diff[...] = np.array([1.0, 2.0]).reshape(1, 2, 1, 1)
    for blob in layer.blobs:
        blob.diff[...] = 0
    layer.backward(tops, [True], bottoms)
    # dx[h, v] = sum_o dy[o] * w[o, 0, h, v]: [1+20, 2+22], [4+26, 5+28]
    np.testing.assert_allclose(bottoms[0].diff, [[[[21.0, 24.0], [30.0, 33.0]]]])
    dw = np.zeros((2, 1, 3, 3))
    dw[:, 0, :2, :2] = np.array([1.0, 2.0]).reshape(2, 1, 1) * x[0, 0]
    np.testing.assert_allclose(layer.blobs[0].diff, dw)
    np.testing.assert_allclose(layer.blobs[1].diff, [1.0, 2.0])


def test_im2col_kernel_3_stride_2_on_2x2_input():
    x = np.array([[[[1.0, 2.0], [3.0, 4.0]]]])
    _, _, tops = run_layer('type: "Im2col" convolution_param { kernel_size: 3 stride: 2 }', [x])
    assert tops[0].shape == (1, 9, 1, 1)
    np.testing.assert_array_equal(tops[0].data.ravel(), [1, 2, 0, 3, 4, 0, 0, 0, 0])


# --- contract ----------------------------------------------------------------------------
def test_param_diffs_accumulate_and_bottom_diff_is_set(lowering_type):
    layer = make_layer(conv_text(num_output=3, kernel_size=3, pad=1))
    bottoms, tops = setup_layer(layer, [RNG.standard_normal((2, 2, 4, 4))])
    layer.forward(bottoms, tops)
    tops[0].diff[...] = RNG.standard_normal(tops[0].shape)
    layer.backward(tops, [True], bottoms)
    first = [b.diff.copy() for b in layer.blobs]
    bottom_diff = bottoms[0].diff.copy()
    layer.backward(tops, [True], bottoms)
    for blob, once in zip(layer.blobs, first):
        np.testing.assert_allclose(blob.diff, 2 * once)
    np.testing.assert_allclose(bottoms[0].diff, bottom_diff)


def test_shapes_and_params():
    layer, _, tops = run_layer(conv_text(num_output=8, kernel_size=5, pad=2, group=2), [np.zeros((2, 4, 27, 27))])
    assert tops[0].shape == (2, 8, 27, 27)
    assert [b.shape for b in layer.blobs] == [(8, 2, 5, 5), (8,)]
    layer, _, tops = run_layer(conv_text(num_output=5, kernel_size=2, bias_term=False), [np.zeros((1, 3, 4, 4))])
    assert len(layer.blobs) == 1 and tops[0].shape == (1, 5, 3, 3)
    layer, _, tops = run_layer(conv_text("Deconvolution", num_output=4, kernel_size=4, stride=2, pad=1),
                               [np.zeros((1, 6, 5, 5))])
    assert tops[0].shape == (1, 4, 10, 10) and layer.blobs[0].shape == (6, 4, 4, 4)


def test_lowering_type_attribute_overrides(monkeypatch):
    monkeypatch.delenv("CCT_LOWERING", raising=False)
    x = RNG.standard_normal((2, 3, 6, 6))
    layer, bottoms, tops = run_layer(conv_text(num_output=4, kernel_size=3, pad=1, stride=2), [x])
    assert layer.lowering_type == 1
    first = tops[0].data.copy()
    for kind in (2, 3):
        layer.lowering_type = kind
        layer.forward(bottoms, tops)
        np.testing.assert_allclose(tops[0].data, first, atol=1e-12)


@pytest.mark.parametrize("fields,message", [
    (dict(num_output=0, kernel_size=3), "num_output"),
    (dict(num_output=4), "kernel_size"),
    (dict(num_output=4, kernel_size=0), "kernel_size"),
    (dict(num_output=4, kernel_size=3, kernel_h=3, kernel_w=3), "not both"),
    (dict(num_output=4, kernel_size=3, stride=0), "stride"),
    (dict(num_output=4, kernel_size=3, pad=1, pad_h=1, pad_w=1), "not both"),
    (dict(num_output=4, kernel_size=3, stride_w=2), "stride"),
    (dict(num_output=4, kernel_h=3), "kernel_size"),
    (dict(num_output=3, kernel_size=3, group=2), "group"),
    (dict(num_output=4, kernel_size=3, group=3), "group"),
    (dict(num_output=4, kernel_size=3, axis=2), "axis"),
    ({"num_output": 4, "kernel_size": "3 kernel_size: 3 kernel_size: 3"}, "kernel_size"),
])
def test_config_errors(fields, message):
    layer = make_layer(conv_text(**fields))
    with pytest.raises(ConfigError, match=message):
        setup_layer(layer, [np.zeros((1, 4, 6, 6))])


def test_force_nd_im2col_gives_the_same_numbers():
    """It only selects Caffe's N-d im2col routine; 2-d results are unchanged."""
    x = RNG.standard_normal((2, 4, 6, 6))
    plain, _, plain_tops = run_layer(conv_text(num_output=3, kernel_size=3), [x])
    forced = make_layer(conv_text(num_output=3, kernel_size=3, force_nd_im2col=True))
    bottoms, tops = setup_layer(forced, [x])
    for ours, theirs in zip(forced.blobs, plain.blobs):
        ours.data[...] = theirs.data
    forced.forward(bottoms, tops)
    np.testing.assert_array_equal(tops[0].data, plain_tops[0].data)


def test_bad_environment_and_shapes(monkeypatch):
    monkeypatch.setenv("CCT_LOWERING", "4")
    with pytest.raises(ConfigError, match="CCT_LOWERING"):
        setup_layer(make_layer(conv_text(num_output=2, kernel_size=3)), [np.zeros((1, 2, 5, 5))])
    monkeypatch.delenv("CCT_LOWERING")
    with pytest.raises(ShapeError, match="does not fit"):
        setup_layer(make_layer(conv_text(num_output=2, kernel_size=5)), [np.zeros((1, 2, 3, 3))])
    # (2 - 5) / 2 truncates to -1: 0 outputs, which Caffe's Blob::Reshape takes (an empty top; see
    # tests/layers/test_degenerate_shapes.py); (2 - 5) / 1 + 1 = -2 it refuses
    _, tops = setup_layer(make_layer(conv_text(num_output=2, kernel_size=5, stride=2)), [np.zeros((1, 2, 2, 2))])
    assert tops[0].shape == (1, 2, 0, 0)
    with pytest.raises(ShapeError, match="does not fit"):
        setup_layer(make_layer('type: "Im2col" convolution_param { kernel_size: 5 }'), [np.zeros((1, 2, 2, 2))])
    with pytest.raises(ConfigError, match="axis"):
        setup_layer(make_layer(conv_text(num_output=2, kernel_size=1)), [np.zeros((1, 2, 3))])


# --- the BVLC reference cases under each lowering type --------------------------------------
CONV_REFERENCE_CASES = ["conv_basic", "conv_few_in_many_out", "conv_group_dilation", "conv_many_in_few_out",
                        "conv_no_bias", "conv_stride_pad_rect", "deconv"]


@pytest.mark.parametrize("name", CONV_REFERENCE_CASES)
def test_reference_cases_under_every_lowering(lowering_type, name):
    assert_matches_caffe(run_case(name), name)


# --- the forward's lowering kept for the backward -----------------------------------------
def test_backward_reads_the_kept_lowering_until_the_bottom_is_written(monkeypatch):
    from cct.lowering import ConvGeometry, reference, type1
    geom = ConvGeometry(1, 4, 20, 19, 3, 3)                       # type 1 image by image
    x = RNG.standard_normal(geom.input_shape(3))
    layer, bottoms, tops = run_layer(conv_text(num_output=4, kernel_size=3), [x])
    dy = tops[0].diff
    dy[...] = RNG.standard_normal(dy.shape)
    lowerings = []
    lower = type1._lower_image_major
    monkeypatch.setattr(type1, "_lower_image_major", lambda *args: lowerings.append(args) or lower(*args))
    layer.backward(tops, [True], bottoms)
    assert not lowerings
    np.testing.assert_allclose(layer.blobs[0].diff, reference.backward_weights(x, dy, geom), rtol=1e-10)
    np.testing.assert_allclose(bottoms[0].diff, reference.backward_data(dy, layer.blobs[0].data, geom), rtol=1e-10)
    assert layer._kept_matrix(0, 1, x) is None           # spent: the data gradient's product went over it
    layer.forward(bottoms, tops)                          # keeps it again
    lowerings.clear()
    # written between forward and backward (a pycaffe script may): lowered again, as it is now, as Caffe does
    bottoms[0].data[2, 0, 19, 18] += 1.0
    layer.blobs[0].diff[...] = 0
    layer.backward(tops, [True], bottoms)
    assert len(lowerings) == 1
    np.testing.assert_allclose(layer.blobs[0].diff, reference.backward_weights(bottoms[0].data, dy, geom),
                               rtol=1e-10)


def test_only_a_training_convolution_keeps_its_lowering():
    import cct
    x = RNG.standard_normal((3, 1, 20, 19))
    text = conv_text(num_output=4, kernel_size=3)
    train, _, _ = run_layer(text, [x])
    test, _, _ = run_layer(text, [x], phase=cct.TEST)
    deconvolution, _, _ = run_layer(conv_text("Deconvolution", num_output=4, kernel_size=3), [x])
    assert train._scratch_kept and train.keep_lowering
    assert not test.__dict__.get("_scratch_kept") and not test.keep_lowering
    assert not deconvolution.__dict__.get("_scratch_kept") and not deconvolution.keep_lowering


def test_a_pointwise_forward_keeps_nothing_and_the_plan_counts_nothing_kept():
    """A 1x1 convolution on 14x14 planes multiplies its input itself
    (cct.lowering.pointwise): nothing is lowered, so nothing is kept, and the
    memory plan charges no kept lowering for it (a 3x3 one is charged)."""
    x = RNG.standard_normal((3, 2, 14, 14))
    pointwise, bottoms, _ = run_layer(conv_text(num_output=4, kernel_size=1), [x])
    assert not pointwise._scratch_kept
    assert "kept" not in pointwise.planned_bytes(bottoms, None, 1)
    lowered, bottoms, _ = run_layer(conv_text(num_output=4, kernel_size=3), [x])
    assert lowered._scratch_kept and lowered.planned_bytes(bottoms, None, 1)["kept"] > 0
