"""The forks' depthwise convolution layers: caffe-mobilenet's
ConvolutionDepthwise (group implied) and DepthwiseConvolution (group given).
Both are Convolution with its setup, weights and arithmetic; a geometry
with one input channel and one output per group runs cct.lowering's direct
depthwise kernels (cct.lowering.depthwise), as any Convolution of that
geometry does.
"""
from cct.proto import caffe_pb2
from cct.core.layer import register

from .conv import Convolution


@register("ConvolutionDepthwise")
class ConvolutionDepthwise(Convolution):
    """caffe-mobilenet's depthwise convolution (farmingyard/caffe-mobilenet's
    conv_dw_layer.cpp, from BVLC PR #5665): each input channel convolved with
    its own kernel.

    convolution_param: kernel_size | kernel_h+kernel_w, stride | stride_h+
    stride_w, pad | pad_h+pad_w, dilation, bias_term, weight_filler,
    bias_filler. num_output and group are implied: both the bottom's
    channels C, whatever the prototxt gives (the fork reads neither).
    Params: weight (C, 1, KH, KW), bias (C,). One bottom (N, C, H, W), one top
    (N, C, OH, OW), OH and OW as Convolution's.
    """
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        channels = bottom[0].shape[1] if len(bottom[0].shape) > 1 else 0
        if not channels:
            raise self.shape_error(f"bottom {bottom[0].shape} has no channels to convolve one by one")
        implied = caffe_pb2.LayerParameter()
        implied.CopyFrom(self.layer_param)
        implied.convolution_param.num_output = implied.convolution_param.group = channels
        self.layer_param = implied
        super().setup(bottom, top)


@register("DepthwiseConvolution")
class DepthwiseConvolution(Convolution):
    """yonghenglh6/DepthwiseConvolution's layer: on the CPU, Caffe's grouped
    Convolution (its depthwise_conv_layer.cpp runs BaseConvolutionLayer's
    GEMMs; its GPU kernel assumes group == channels == num_output), so
    Convolution's fields, shapes and arithmetic, group given in
    convolution_param as MobileNets give it (group = num_output = channels).
    """
