"""Whole-net gradient check: the wiring (split fan-out, in-place layers, concat,
eltwise, shared weights, loss weights) must give d(loss)/d(input) and parameter
gradients equal to central differences of the net's own loss. Float32 nets, so
smooth layers, a larger step and a looser tolerance than the per-layer checker."""
import numpy as np

import cct

NET = '''name: "wiring"
force_backward: true
layer { name: "data" type: "Input" top: "data" top: "target"
        input_param { shape { dim: 2 dim: 3 dim: 6 dim: 6 } shape { dim: 2 dim: 6 } } }
layer { name: "conv_a" type: "Convolution" bottom: "data" top: "a"
        param { name: "shared_w" } param { name: "shared_b" }
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.3 }
                            bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "tanh_a" type: "TanH" bottom: "a" top: "a" }
layer { name: "conv_b" type: "Convolution" bottom: "data" top: "b"
        param { name: "shared_w" } param { name: "shared_b" }
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 } }
layer { name: "sig_b" type: "Sigmoid" bottom: "b" top: "b" }
layer { name: "sum" type: "Eltwise" bottom: "a" bottom: "b" top: "sum" eltwise_param { coeff: 1 coeff: -0.5 } }
layer { name: "cat" type: "Concat" bottom: "sum" bottom: "a" top: "cat" }
layer { name: "bn" type: "BatchNorm" bottom: "cat" top: "cat" batch_norm_param { use_global_stats: false } }
layer { name: "scale" type: "Scale" bottom: "cat" top: "cat"
        scale_param { bias_term: true filler { type: "uniform" min: 0.5 max: 1.5 } } }
layer { name: "pool" type: "Pooling" bottom: "cat" top: "pool" pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "lrn" type: "LRN" bottom: "pool" top: "lrn" lrn_param { local_size: 3 alpha: 0.5 } }
layer { name: "fc" type: "InnerProduct" bottom: "lrn" top: "fc"
        inner_product_param { num_output: 6 weight_filler { type: "gaussian" std: 0.2 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "fc" bottom: "target" top: "loss" }
layer { name: "aux" type: "Reduction" bottom: "a" top: "aux" loss_weight: 0.25
        reduction_param { operation: SUMSQ axis: 0 } }
'''


def build():
    cct.set_random_seed(11)
    net = cct.Net(NET, cct.TRAIN)
    rng = np.random.default_rng(2)
    net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].shape)
    net.blobs["target"].data[...] = rng.standard_normal(net.blobs["target"].shape)
    return net


def loss_of(net):
    return net._forward()


def numeric(net, array, index, step=1e-2):
    original = array[index]
    array[index] = original + step
    plus = loss_of(net)
    array[index] = original - step
    minus = loss_of(net)
    array[index] = original
    return (plus - minus) / (2 * step)


def test_net_gradients_match_central_differences(partitions):
    net = build()
    assert "a_tanh_a_0_split" in net.layer_dict            # fan-out of an in-place top
    net.clear_param_diffs()
    loss_of(net)
    net._backward()
    checks = [("data", net.blobs["data"].data, net.blobs["data"].diff.copy())]
    checks += [(f"{name}[{i}]", blob.data, blob.diff.copy())
               for name in ("conv_a", "scale", "fc") for i, blob in enumerate(net.params[name])]
    rng = np.random.default_rng(0)
    for label, values, analytic in checks:
        for flat in rng.choice(values.size, min(values.size, 12), replace=False):
            index = np.unravel_index(flat, values.shape)
            expected = numeric(net, values, index)
            scale = max(1.0, abs(expected))
            assert abs(analytic[index] - expected) <= 2e-2 * scale, (label, index, analytic[index], expected)


def test_shared_weights_receive_both_layers_gradients():
    net = build()
    assert net.params["conv_a"][0] is net.params["conv_b"][0]
    assert len(net.learnable_params) == len(net._params) - 2
