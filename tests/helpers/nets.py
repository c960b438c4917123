"""Net texts more than one test file builds."""

# Every layer kind the profile counts FLOPs for, small: a grouped strided conv,
# ReLU in place, MAX pooling, LRN, a deconvolution, InnerProduct and a loss.
PROFILE_NET = """
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
PROFILE_NET_LAYERS = ["data", "conv", "relu", "pool", "norm", "deconv", "fc", "loss"]

_FILL = 'weight_filler { type: "gaussian" std: 0.2 } bias_filler { type: "gaussian" std: 0.1 }'

# From a blob "data" to a blob "sum": a convolution, an inception-like fork (a
# short branch and a two-convolution long one, joined by Concat) and a residual
# block (BatchNorm, Scale and ReLU in place, an Eltwise sum with the shortcut).
# The tests of the sub-task graph, the streams and the schedules put their own
# inputs and heads around it.
FORK_RESIDUAL = f"""
layer {{ name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param {{ num_output: 4 kernel_size: 3 pad: 1 {_FILL} }} }}
layer {{ name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }}
layer {{ name: "short" type: "Convolution" bottom: "conv1" top: "short"
  convolution_param {{ num_output: 2 kernel_size: 1 {_FILL} }} }}
layer {{ name: "long1" type: "Convolution" bottom: "conv1" top: "long1"
  convolution_param {{ num_output: 6 kernel_size: 3 pad: 1 {_FILL} }} }}
layer {{ name: "long2" type: "Convolution" bottom: "long1" top: "long2"
  convolution_param {{ num_output: 4 kernel_size: 3 pad: 1 {_FILL} }} }}
layer {{ name: "concat" type: "Concat" bottom: "short" bottom: "long2" top: "concat" }}
layer {{ name: "res" type: "Convolution" bottom: "concat" top: "res"
  convolution_param {{ num_output: 6 kernel_size: 3 pad: 1 {_FILL} }} }}
layer {{ name: "bn" type: "BatchNorm" bottom: "res" top: "res" }}
layer {{ name: "scale" type: "Scale" bottom: "res" top: "res"
  scale_param {{ bias_term: true filler {{ type: "gaussian" }} }} }}
layer {{ name: "relu2" type: "ReLU" bottom: "res" top: "res" }}
layer {{ name: "sum" type: "Eltwise" bottom: "res" bottom: "concat" top: "sum" }}
"""


# Builders of nets written out as prototxt text: an Input of 4 images 3x6x6
# and labels 0-4, convolutions, in-place ReLUs, and an InnerProduct +
# SoftmaxWithLoss head; a chain, an inception unit, and residual blocks
# (BatchNorm, Scale, Eltwise, optionally a projection shortcut). The
# critical-path tests and the schedule tests build them.
_BLOCK_FILL = 'weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "constant" value: 0.1 }'


def conv(name, bottom, outputs=4, kernel=3):
    return (f'layer {{ name: "{name}" type: "Convolution" bottom: "{bottom}" top: "{name}" '
            f'convolution_param {{ num_output: {outputs} kernel_size: {kernel} pad: {kernel // 2} {_BLOCK_FILL} }} }}\n')


def relu(blob):
    return f'layer {{ name: "relu_{blob}" type: "ReLU" bottom: "{blob}" top: "{blob}" }}\n'


def head(bottom, label="label", name="loss"):
    return (f'layer {{ name: "ip_{name}" type: "InnerProduct" bottom: "{bottom}" top: "ip_{name}" '
            f'inner_product_param {{ num_output: 5 {_BLOCK_FILL} }} }}\n'
            f'layer {{ name: "{name}" type: "SoftmaxWithLoss" bottom: "ip_{name}" bottom: "{label}" top: "{name}" }}\n')


INPUT = ('layer { name: "data" type: "Input" top: "data" top: "label" '
         'input_param { shape { dim: 4 dim: 3 dim: 6 dim: 6 } shape { dim: 4 } } }\n')


def chain(depth):
    text, bottom = INPUT, "data"
    for k in range(depth):
        text += conv(f"conv{k}", bottom) + relu(f"conv{k}")
        bottom = f"conv{k}"
    return text + head(bottom)


INCEPTION = (INPUT + conv("stem", "data") + relu("stem")
             + conv("b1x1", "stem", kernel=1)
             + conv("b3x3_reduce", "stem", kernel=1) + relu("b3x3_reduce") + conv("b3x3", "b3x3_reduce")
             + conv("b5x5_reduce", "stem", kernel=1) + conv("b5x5", "b5x5_reduce", kernel=5)
             + 'layer { name: "pool" type: "Pooling" bottom: "stem" top: "pool" '
               'pooling_param { pool: MAX kernel_size: 3 stride: 1 pad: 1 } }\n'
             + conv("pool_proj", "pool", kernel=1)
             + 'layer { name: "concat" type: "Concat" bottom: "b1x1" bottom: "b3x3" bottom: "b5x5" '
               'bottom: "pool_proj" top: "concat" }\n'
             + head("concat"))


def residual(name, bottom, projection=False):
    text = (conv(f"{name}_a", bottom)
            + f'layer {{ name: "{name}_bn" type: "BatchNorm" bottom: "{name}_a" top: "{name}_a" }}\n'
            + f'layer {{ name: "{name}_scale" type: "Scale" bottom: "{name}_a" top: "{name}_a" '
              f'scale_param {{ bias_term: true }} }}\n'
            + relu(f"{name}_a") + conv(f"{name}_b", f"{name}_a"))
    shortcut = bottom
    if projection:
        text += conv(f"{name}_proj", bottom, kernel=1)
        shortcut = f"{name}_proj"
    return text + (f'layer {{ name: "{name}" type: "Eltwise" bottom: "{name}_b" bottom: "{shortcut}" '
                   f'top: "{name}" }}\n' + relu(name))


def resnet(blocks, projection=False):
    text, bottom = INPUT + conv("stem", "data") + relu("stem"), "stem"
    for k in range(blocks):
        text += residual(f"res{k}", bottom, projection and k == 0)
        bottom = f"res{k}"
    return text + head(bottom)


def run_net_text(text, phase):
    """A net built from prototxt text, run forward and backward once (the
    tests of degenerate shapes: that it runs at all is what they check)."""
    import cct
    net = cct.Net(text, phase)
    net.forward()
    net.backward()
    return net
