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
