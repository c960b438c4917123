"""cct.runtime.profile's FLOP counts, against counts written out by hand and
CaffeNet's published figure. The table `cct time` prints from them is tested
in tests/cli/test_time.py."""
import pytest
from google.protobuf import text_format

import cct
from cct.core.net import Net
from cct.proto import caffe_pb2
from cct.runtime import profile
from helpers.nets import PROFILE_NET
from helpers.paths import MODELS


def tiny_net():
    param = text_format.Parse(PROFILE_NET, caffe_pb2.NetParameter())
    return Net(param, cct.TRAIN)


def test_flop_counts_by_hand():
    net = tiny_net()
    counts = dict(zip(net.layer_names, profile.net_flops(net)))
    # conv: 4 images, 5x5 outputs, 6 filters of 1 channel (group 3) x 3x3: 2 FLOPs a multiply-add.
    conv = 2 * 4 * 5 * 5 * 6 * 1 * 3 * 3
    assert counts["conv"] == (conv, conv)             # the data needs no gradient: weights only
    assert counts["relu"] == (0, 0)
    # pool: 5x5 -> 2x2 windows of 3x3, per image and channel.
    pool = 4 * 6 * 2 * 2 * 9
    assert counts["pool"] == (pool, pool)
    norm_count = 4 * 6 * 2 * 2
    assert counts["norm"] == (norm_count * (3 + 5), norm_count * (3 + 7))
    # deconv: the convolution it transposes runs on the bottom's 2x2 positions,
    # weight (6, 2, 2, 2).
    deconv = 2 * 4 * 2 * 2 * 6 * 2 * 2 * 2
    assert counts["deconv"] == (deconv, 2 * deconv)
    fc = 2 * 4 * 5 * (2 * 4 * 4)
    assert counts["fc"] == (fc, 2 * fc)
    assert counts["loss"] == (0, 0)


def test_caffenet_counts_match_the_published_figures():
    param = text_format.Parse((MODELS / "bvlc_reference_caffenet" / "deploy.prototxt").read_text(),
                              caffe_pb2.NetParameter())
    param.layer[0].input_param.shape[0].dim[0] = 1
    param.force_backward = False
    net = Net(param, cct.TEST)
    forward = sum(f for f, _ in profile.net_flops(net))
    assert forward / 1e9 == pytest.approx(1.45, abs=0.01)
    conv1 = profile.layer_flops(net.layers[1], net.bottom_vecs[1], net.top_vecs[1], [False])
    assert conv1[0] == 2 * 55 * 55 * 96 * 3 * 11 * 11


def test_layer_bytes_count_each_array_once():
    """An in-place ReLU on 4x5 floats: forward reads and writes the blob (160
    bytes); backward reads the top's diff and the blob and writes the bottom's
    diff (240). An InnerProduct 4x5 -> 3 reads x and its 15 + 3 parameters and
    writes y forward; backward also reads and writes the parameter diffs."""
    net = Net("""force_backward: true
    layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 4 dim: 5 } } }
    layer { name: "relu" type: "ReLU" bottom: "x" top: "x" }
    layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { num_output: 3 } }""",
              cct.TRAIN)
    relu, ip = profile.net_bytes(net)[1:]
    assert relu == (160, 240)
    params = 4 * (15 + 3)
    assert ip == (80 + params + 48, 48 + 80 + 48 + params + 80 + 2 * params)


def test_an_ops_limit_is_the_longer_of_its_flops_and_bytes():
    assert profile.limit_ms(2e9, 1e6, peak=100.0, bandwidth=10.0) == pytest.approx(20.0)    # GEMM-bound
    assert profile.limit_ms(1e3, 1e9, peak=100.0, bandwidth=10.0) == pytest.approx(100.0)   # memory-bound
    assert profile.memory_bandwidth(threads=2, megabytes=8, repeats=2) > 0
