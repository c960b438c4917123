"""cct.net_spec: the prototxt text pycaffe's NetSpec writes, kwarg routing,
naming of automatic tops and layers, P enums and errors."""
import numpy as np
import pytest
from google.protobuf import text_format

import cct
from cct.core.errors import ConfigError
from cct.net_spec import NetSpec, layers as L, params as P, to_proto
from cct.proto import caffe_pb2


def lenet(lmdb, batch_size):
    # The LeNet notebook (examples/01-learning-lenet.ipynb), verbatim but for the imports.
    n = NetSpec()
    n.data, n.label = L.Data(batch_size=batch_size, backend=P.Data.LMDB, source=lmdb,
                             transform_param=dict(scale=1. / 255), ntop=2)
    n.conv1 = L.Convolution(n.data, kernel_size=5, num_output=20, weight_filler=dict(type='xavier'))
    n.pool1 = L.Pooling(n.conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.conv2 = L.Convolution(n.pool1, kernel_size=5, num_output=50, weight_filler=dict(type='xavier'))
    n.pool2 = L.Pooling(n.conv2, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.fc1 = L.InnerProduct(n.pool2, num_output=500, weight_filler=dict(type='xavier'))
    n.relu1 = L.ReLU(n.fc1, in_place=True)
    n.score = L.InnerProduct(n.relu1, num_output=10, weight_filler=dict(type='xavier'))
    n.loss = L.SoftmaxWithLoss(n.score, n.label)
    return n.to_proto()


LENET_TEXT = '''layer {
  name: "data"
  type: "Data"
  top: "data"
  top: "label"
  transform_param {
    scale: 0.00392156886
  }
  data_param {
    source: "mnist/mnist_train_lmdb"
    batch_size: 64
    backend: LMDB
  }
}
layer {
  name: "conv1"
  type: "Convolution"
  bottom: "data"
  top: "conv1"
  convolution_param {
    num_output: 20
    kernel_size: 5
    weight_filler {
      type: "xavier"
    }
  }
}
layer {
  name: "pool1"
  type: "Pooling"
  bottom: "conv1"
  top: "pool1"
  pooling_param {
    pool: MAX
    kernel_size: 2
    stride: 2
  }
}
layer {
  name: "conv2"
  type: "Convolution"
  bottom: "pool1"
  top: "conv2"
  convolution_param {
    num_output: 50
    kernel_size: 5
    weight_filler {
      type: "xavier"
    }
  }
}
layer {
  name: "pool2"
  type: "Pooling"
  bottom: "conv2"
  top: "pool2"
  pooling_param {
    pool: MAX
    kernel_size: 2
    stride: 2
  }
}
layer {
  name: "fc1"
  type: "InnerProduct"
  bottom: "pool2"
  top: "fc1"
  inner_product_param {
    num_output: 500
    weight_filler {
      type: "xavier"
    }
  }
}
layer {
  name: "relu1"
  type: "ReLU"
  bottom: "fc1"
  top: "fc1"
}
layer {
  name: "score"
  type: "InnerProduct"
  bottom: "fc1"
  top: "score"
  inner_product_param {
    num_output: 10
    weight_filler {
      type: "xavier"
    }
  }
}
layer {
  name: "loss"
  type: "SoftmaxWithLoss"
  bottom: "score"
  bottom: "label"
  top: "loss"
}
'''


def test_lenet_notebook_text_matches_pycaffe():
    assert str(lenet("mnist/mnist_train_lmdb", 64)) == LENET_TEXT


def test_text_parses_back_to_the_same_message():
    proto = lenet("x", 8)
    assert text_format.Parse(str(proto), caffe_pb2.NetParameter()) == proto


def test_unassigned_tops_and_layers_get_type_count_names():
    data = L.Input(shape=dict(dim=[2, 3]))
    top = L.Sigmoid(L.InnerProduct(L.InnerProduct(data, num_output=4), num_output=3))
    proto = top.to_proto()
    assert [(l.name, list(l.bottom), list(l.top)) for l in proto.layer] == [
        ("Input1", [], ["Input1"]),
        ("InnerProduct1", ["Input1"], ["InnerProduct1"]),
        ("InnerProduct2", ["InnerProduct1"], ["InnerProduct2"]),
        ("Sigmoid1", ["InnerProduct2"], ["Sigmoid1"])]
    assert list(proto.layer[1].input_param.shape) == []
    assert list(proto.layer[0].input_param.shape[0].dim) == [2, 3]
    assert to_proto(top) == proto


def test_shared_bottom_is_emitted_once_and_multi_top_unpacks():
    n = NetSpec()
    n.a, n.b = L.Input(shape=[dict(dim=[1, 2]), dict(dim=[1, 2])], ntop=2)
    n.sum = L.Eltwise(n.a, n.b)
    n.prod = L.Eltwise(n.a, n.b, operation=P.Eltwise.PROD)
    proto = n.to_proto()
    assert [l.name for l in proto.layer] == ["a", "sum", "prod"]
    assert list(proto.layer[0].top) == ["a", "b"]
    assert proto.layer[2].eltwise_param.operation == caffe_pb2.EltwiseParameter.PROD
    assert len(proto.layer[0].input_param.shape) == 2


def test_ntop_zero_returns_the_function_and_is_named():
    n = NetSpec()
    n.data = L.Input(shape=dict(dim=[1]))
    n.silence = L.Silence(n.data, ntop=0)
    proto = n.to_proto()
    assert (proto.layer[1].name, list(proto.layer[1].top)) == ("silence", [])
    unnamed = to_proto(L.Silence(L.Input(shape=dict(dim=[1])), ntop=0))
    assert unnamed.layer[1].name == "Silence1"


def test_kwarg_routing_layer_fields_type_param_and_generic_params():
    n = NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 3, 8, 8]))
    n.conv = L.Convolution(n.data, num_output=4, kernel_size=[3, 1], pad=1, bias_term=False,
                           param=[dict(lr_mult=1, decay_mult=1), dict(lr_mult=2, decay_mult=0)],
                           include=dict(phase=cct.TEST), propagate_down=[True],
                           weight_filler=dict(type="gaussian", std=0.5), engine=P.Convolution.CAFFE)
    n.loss = L.EuclideanLoss(n.conv, n.conv, loss_weight=0.5, loss_param=dict(normalize=False))
    conv, loss = n.to_proto().layer[1:]
    assert list(conv.convolution_param.kernel_size) == [3, 1]
    assert list(conv.convolution_param.pad) == [1]                 # scalar into a repeated field
    assert conv.convolution_param.bias_term is False
    assert conv.convolution_param.weight_filler.std == pytest.approx(0.5)
    assert conv.convolution_param.engine == caffe_pb2.ConvolutionParameter.CAFFE
    assert [(p.lr_mult, p.decay_mult) for p in conv.param] == [(1, 1), (2, 0)]
    assert [r.phase for r in conv.include] == [cct.TEST]
    assert list(conv.propagate_down) == [True]
    assert list(loss.loss_weight) == [0.5]
    assert loss.loss_param.normalize is False
    assert not loss.HasField("convolution_param")


def test_type_param_wins_over_layer_field_as_in_pycaffe():
    # Python layers: `layer` names the class in python_param, not a LayerParameter field.
    proto = to_proto(L.Python(L.Input(shape=dict(dim=[1])), module="m", layer="C", param_str="{}"))
    assert (proto.layer[1].python_param.module, proto.layer[1].python_param.layer) == ("m", "C")


def test_a_types_fields_go_to_its_own_message_where_forks_reuse_it():
    """ReLUParameter is relu6_param's message too, ReorgParameter and
    UpsampleParameter MobileNet-YOLO's placeholders': a type's keywords still
    go to its own field."""
    n = NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 4, 4, 4]))
    n.relu = L.ReLU(n.data, negative_slope=0.1)
    n.reorg = L.Reorg(n.relu, stride=2)
    n.up = L.Upsample(n.relu, scale=2)
    n.det = L.Yolov3DetectionOutput(n.up, num_classes=1, mask_group_num=1)
    relu, reorg, up, det = n.to_proto().layer[1:]
    assert relu.relu_param.negative_slope == pytest.approx(0.1) and not relu.HasField("relu6_param")
    assert reorg.reorg_param.stride == 2 and up.upsample_param.scale == 2
    assert det.yolov3_detection_output_param.mask_group_num == 1


def test_update_keys_vals_and_item_access():
    n = NetSpec()
    n["data"] = L.Input(shape=dict(dim=[2, 4]))
    n.ip = L.InnerProduct(n["data"], num_output=3)
    n.update("ip", dict(num_output=7))
    assert n.keys() == ["data", "ip"] and n.vals()[1] is n.ip
    assert n.to_proto().layer[1].inner_product_param.num_output == 7
    del n["ip"]
    assert n.keys() == ["data"]
    with pytest.raises(AttributeError):
        n.nothing


def test_params_enums():
    assert P.Pooling.MAX == caffe_pb2.PoolingParameter.MAX
    assert P.Pooling.AVE == 1 and P.Data.LMDB == caffe_pb2.DataParameter.LMDB
    with pytest.raises(AttributeError, match="PoolingParameter has no enum value MIN"):
        P.Pooling.MIN
    with pytest.raises(AttributeError, match="NoSuchParameter"):
        P.NoSuch.X


def test_unknown_field_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"L.Convolution\(\): kernel_szie=3: not a field of convolution_param"):
        to_proto(L.Convolution(L.Input(), kernel_szie=3))
    with pytest.raises(ConfigError, match="Deconvolution has no parameter message"):
        to_proto(L.Deconvolution(L.Input(), kernel_size=3))
    with pytest.raises(ConfigError, match="num_output"):
        to_proto(L.InnerProduct(L.Input(), num_output="many"))
    proto = to_proto(L.Deconvolution(L.Input(), convolution_param=dict(kernel_size=3, num_output=2)))
    assert proto.layer[1].convolution_param.num_output == 2


def test_a_bottom_that_is_not_a_top_is_a_type_error_in_pycaffe_words():
    data = L.DummyData(ntop=2)                       # a tuple of two Tops
    for error_class in (TypeError, ConfigError):
        with pytest.raises(error_class, match=r"^Silence input 0 is not a Top \(type is <class 'tuple'>\)$"):
            L.Silence(data, ntop=0)
    with pytest.raises(TypeError, match=r"^ReLU input 1 is not a Top \(type is <class 'str'>\)$"):
        L.ReLU(data[0], "data")
    L.Silence(*data, ntop=0)


def test_netspec_net_builds_and_runs(tmp_path):
    n = NetSpec()
    n.data, n.label = L.Input(shape=[dict(dim=[4, 3]), dict(dim=[4])], ntop=2)
    n.ip = L.InnerProduct(n.data, num_output=2, weight_filler=dict(type="constant", value=0.1))
    n.relu = L.ReLU(n.ip, in_place=True)
    n.loss = L.SoftmaxWithLoss(n.ip, n.label)
    path = tmp_path / "net.prototxt"
    path.write_text(str(n.to_proto()))
    net = cct.Net(str(path), cct.TRAIN)
    net.blobs["data"].data[...] = np.arange(12).reshape(4, 3)
    net.blobs["label"].data[...] = [0, 1, 0, 1]
    loss = float(net.forward()["loss"])
    assert loss == pytest.approx(np.log(2.0), rel=1e-5)      # equal scores for both classes
    assert list(net.layer_dict) == ["data", "ip", "relu", "loss"]


def test_recurrent_layers_are_written_and_build():
    """L.LSTM(x, cont, recurrent_param=...), with expose_hidden's extra bottoms
    and tops, as pycaffe writes them (the recurrent types have no *_param
    message of their own: their fields go in recurrent_param)."""
    n = NetSpec()
    n.x, n.cont, n.h0, n.c0 = L.Input(shape=[dict(dim=[4, 2, 3]), dict(dim=[4, 2]), dict(dim=[1, 2, 5]),
                                             dict(dim=[1, 2, 5])], ntop=4)
    n.h, n.h_T, n.c_T = L.LSTM(n.x, n.cont, n.h0, n.c0, ntop=3, param=[dict(lr_mult=1), dict(lr_mult=2)],
                               recurrent_param=dict(num_output=5, expose_hidden=True,
                                                    weight_filler=dict(type="uniform", min=-0.1, max=0.1)))
    n.o = L.RNN(n.h, n.cont, recurrent_param=dict(num_output=2))
    text = str(n.to_proto())
    assert '''layer {
  name: "h"
  type: "LSTM"
  bottom: "x"
  bottom: "cont"
  bottom: "h0"
  bottom: "c0"
  top: "h"
  top: "h_T"
  top: "c_T"
  param {
    lr_mult: 1
  }
  param {
    lr_mult: 2
  }
  recurrent_param {
    num_output: 5
    weight_filler {
      type: "uniform"
      min: -0.1
      max: 0.1
    }
    expose_hidden: true
  }
}''' in text
    net = cct.Net(text_format.Parse(text, caffe_pb2.NetParameter()), cct.TEST)
    assert [net.blobs[name].shape for name in ("h", "h_T", "c_T", "o")] == [(4, 2, 5), (1, 2, 5), (1, 2, 5),
                                                                             (4, 2, 2)]
    assert [blob.shape for blob in net.params["h"]] == [(20, 3), (20,), (20, 5)]
