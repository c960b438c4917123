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
