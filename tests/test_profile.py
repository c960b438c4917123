"""cct.runtime.profile's FLOP counts (against counts written out by hand) and the
profile table `cct time` prints after Caffe's per-layer lines."""
import re

import pytest

import cct
from cct import cli
from cct.runtime import profile
from cct.core.net import Net
from cct.proto import caffe_pb2
from google.protobuf import text_format

TINY = """
name: "tiny"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 4 dim: 3 dim: 9 dim: 9 } shape { dim: 4 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 6 kernel_size: 3 stride: 2 pad: 1 group: 3
                            weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool"
        pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "norm" type: "LRN" bottom: "pool" top: "norm" lrn_param { local_size: 3 } }
layer { name: "deconv" type: "Deconvolution" bottom: "norm" top: "deconv"
        convolution_param { num_output: 2 kernel_size: 2 stride: 2
                            weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "fc" type: "InnerProduct" bottom: "deconv" top: "fc"
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }
"""


def tiny_net():
    param = text_format.Parse(TINY, caffe_pb2.NetParameter())
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
    param = text_format.Parse(open(cct_model("bvlc_reference_caffenet/deploy.prototxt")).read(),
                              caffe_pb2.NetParameter())
    param.layer[0].input_param.shape[0].dim[0] = 1
    param.force_backward = False
    net = Net(param, cct.TEST)
    forward = sum(f for f, _ in profile.net_flops(net))
    assert forward / 1e9 == pytest.approx(1.45, abs=0.01)
    conv1 = profile.layer_flops(net.layers[1], net.bottom_vecs[1], net.top_vecs[1], [False])
    assert conv1[0] == 2 * 55 * 55 * 96 * 3 * 11 * 11


def cct_model(relative):
    import os
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", relative)


def test_time_prints_the_profile_table(tmp_path, capsys):
    path = tmp_path / "tiny.prototxt"
    path.write_text(TINY)
    code = cli.main(["time", "--model", str(path), "--iterations", "2", "--peak_size", "64"])
    err = capsys.readouterr().err
    assert code == 0, err
    messages = [line.split("] ", 1)[1] for line in err.splitlines() if "] " in line]
    # Caffe's own lines are untouched.
    assert any(re.fullmatch(r" +conv\tforward: [0-9.e+-]+ ms\.", m) for m in messages)
    assert any(re.fullmatch(r"GEMM peak: [0-9.]+ GFLOP/s \(sgemm 64, \d+ BLAS threads\)", m) for m in messages)
    start = next(i for i, m in enumerate(messages) if m.startswith("Profile per layer (GEMM peak"))
    header = messages[start + 1].split()
    assert header[:4] == ["layer", "type", "fwd", "ms"] and header[-2:] == ["lowering", "partitions"]
    rows = {m.split()[0]: m.split() for m in messages[start + 2:start + 2 + len(TINY_LAYERS)]}
    assert list(rows) == TINY_LAYERS
    for name in ("conv", "pool", "norm", "deconv", "fc"):
        layer_type, fwd_ms, bwd_ms, fwd_rate, bwd_rate, share, lowering, partitions = rows[name][1:]
        assert float(fwd_ms) >= 0 and float(bwd_ms) >= 0
        assert fwd_rate == "-" or float(fwd_rate) >= 0
        assert share == "-" or float(share) >= 0
        assert partitions == "1"
    assert rows["conv"][7] in ("1", "2", "3") and rows["deconv"][7] in ("1", "2", "3")
    assert rows["relu"][4:7] == ["-", "-", "-"] and rows["relu"][7] == "-"
    assert any(re.fullmatch(r"Net: [0-9.e+-]+ GFLOP per forward-backward, [0-9.]+ GFLOP/s = \d+% of "
                            r"the GEMM peak", m) for m in messages)


TINY_LAYERS = ["data", "conv", "relu", "pool", "norm", "deconv", "fc", "loss"]


def test_time_tune_shows_the_chosen_partitions(tmp_path, capsys):
    path = tmp_path / "tiny.prototxt"
    path.write_text(TINY)
    code = cli.main(["time", "--model", str(path), "--iterations", "1", "--peak_size", "0", "--tune"])
    err = capsys.readouterr().err
    assert code == 0, err
    messages = [line.split("] ", 1)[1] for line in err.splitlines() if "] " in line]
    plan_line = next(m for m in messages if m.startswith("Partitions: "))
    plan = dict(item.split("=") for item in plan_line[len("Partitions: "):].split(", "))
    assert "conv" in plan and "fc" in plan
    start = next(i for i, m in enumerate(messages) if m == "Profile per layer:")
    rows = {m.split()[0]: m.split() for m in messages[start + 2:start + 2 + len(TINY_LAYERS)]}
    for name, partitions in plan.items():
        assert rows[name][-1] == partitions
    assert not any("GEMM peak" in m for m in messages)


def test_time_refuses_a_negative_peak_size(tmp_path, capsys):
    path = tmp_path / "tiny.prototxt"
    path.write_text(TINY)
    assert cli.main(["time", "--model", str(path), "--peak_size", "-1"]) == 1
    assert "--peak_size: must be >= 0, got -1" in capsys.readouterr().err
