"""Write BVLC GoogLeNet's deploy.prototxt and train_val.prototxt (Inception v1,
Szegedy et al. 2014, as in Caffe's models/bvlc_googlenet/).

The nine inception modules differ only in their branch widths, so they come
from one template instead of being typed 9 times. Run from anywhere:

    python models/bvlc_googlenet/make_googlenet.py

and commit the two prototxts it rewrites beside this script.
"""
import os

HERE = os.path.dirname(os.path.abspath(__file__))

# name: (1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5, pool proj); output channels = 1x1 + 3x3 + 5x5 + pool proj.
INCEPTION = {
    "3a": (64, 96, 128, 16, 32, 32),
    "3b": (128, 128, 192, 32, 96, 64),
    "4a": (192, 96, 208, 16, 48, 64),
    "4b": (160, 112, 224, 24, 64, 64),
    "4c": (128, 128, 256, 24, 64, 64),
    "4d": (112, 144, 288, 32, 64, 64),
    "4e": (256, 160, 320, 32, 128, 128),
    "5a": (256, 160, 320, 32, 128, 128),
    "5b": (384, 192, 384, 48, 128, 128),
}

LEARNED = """  param {
    lr_mult: 1
    decay_mult: 1
  }
  param {
    lr_mult: 2
    decay_mult: 0
  }
"""


def block(name, type_, bottoms, tops, body=""):
    lines = [f'layer {{\n  name: "{name}"\n  type: "{type_}"\n']
    lines += [f'  bottom: "{b}"\n' for b in bottoms]
    lines += [f'  top: "{t}"\n' for t in tops]
    return "".join(lines) + body + "}\n"


def fillers(bias):
    return ('    weight_filler {\n      type: "xavier"\n    }\n'
            f'    bias_filler {{\n      type: "constant"\n      value: {bias}\n    }}\n')


def conv(name, bottom, num_output, kernel, stride=1, pad=0):
    spec = f"    num_output: {num_output}\n"
    spec += f"    pad: {pad}\n" if pad else ""
    spec += f"    kernel_size: {kernel}\n"
    spec += f"    stride: {stride}\n" if stride != 1 else ""
    return block(name, "Convolution", [bottom], [name],
                 LEARNED + "  convolution_param {\n" + spec + fillers(0.2) + "  }\n")


def fc(name, bottom, num_output, bias):
    return block(name, "InnerProduct", [bottom], [name],
                 LEARNED + f"  inner_product_param {{\n    num_output: {num_output}\n"
                 + fillers(bias) + "  }\n")


def relu(name, blob):
    return block(name, "ReLU", [blob], [blob])


def pool(name, bottom, method, kernel, stride, pad=0):
    spec = f"    pool: {method}\n    kernel_size: {kernel}\n    stride: {stride}\n"
    spec += f"    pad: {pad}\n" if pad else ""
    return block(name, "Pooling", [bottom], [name], "  pooling_param {\n" + spec + "  }\n")


def lrn(name, bottom):
    return block(name, "LRN", [bottom], [name],
                 "  lrn_param {\n    local_size: 5\n    alpha: 0.0001\n    beta: 0.75\n  }\n")


def dropout(name, blob, ratio):
    return block(name, "Dropout", [blob], [blob], f"  dropout_param {{\n    dropout_ratio: {ratio}\n  }}\n")


def conv_relu(name, bottom, num_output, kernel, stride=1, pad=0, relu_name=None):
    return conv(name, bottom, num_output, kernel, stride, pad) + relu(relu_name, name)


def inception(key, bottom):
    """One module: four parallel branches concatenated along channels."""
    n1, r3, n3, r5, n5, pp = INCEPTION[key]
    p = f"inception_{key}/"
    text = conv_relu(p + "1x1", bottom, n1, 1, relu_name=p + "relu_1x1")
    text += conv_relu(p + "3x3_reduce", bottom, r3, 1, relu_name=p + "relu_3x3_reduce")
    text += conv_relu(p + "3x3", p + "3x3_reduce", n3, 3, pad=1, relu_name=p + "relu_3x3")
    text += conv_relu(p + "5x5_reduce", bottom, r5, 1, relu_name=p + "relu_5x5_reduce")
    text += conv_relu(p + "5x5", p + "5x5_reduce", n5, 5, pad=2, relu_name=p + "relu_5x5")
    text += pool(p + "pool", bottom, "MAX", 3, 1, pad=1)
    text += conv_relu(p + "pool_proj", p + "pool", pp, 1, relu_name=p + "relu_pool_proj")
    text += block(p + "output", "Concat", [p + b for b in ("1x1", "3x3", "5x5", "pool_proj")], [p + "output"])
    return text, p + "output"


def accuracy(prefix, classifier):
    test_only = "  include {\n    phase: TEST\n  }\n"
    return (block(f"{prefix}/top-1", "Accuracy", [classifier, "label"], [f"{prefix}/top-1"], test_only)
            + block(f"{prefix}/top-5", "Accuracy", [classifier, "label"], [f"{prefix}/top-5"],
                    test_only + "  accuracy_param {\n    top_k: 5\n  }\n"))


def auxiliary(index, bottom):
    """The auxiliary classifier on 4a (loss1) or 4d (loss2), weighted 0.3 in the loss."""
    p = f"loss{index}/"
    text = pool(p + "ave_pool", bottom, "AVE", 5, 3)
    text += conv_relu(p + "conv", p + "ave_pool", 128, 1, relu_name=p + "relu_conv")
    text += fc(p + "fc", p + "conv", 1024, 0.2) + relu(p + "relu_fc", p + "fc")
    text += dropout(p + "drop_fc", p + "fc", 0.7)
    text += fc(p + "classifier", p + "fc", 1000, 0)
    text += block(p + "loss", "SoftmaxWithLoss", [p + "classifier", "label"], [f"{p}loss{index}"],
                  "  loss_weight: 0.3\n")
    return text + accuracy(f"loss{index}", p + "classifier")


def data_layer(phase, source, batch_size, mirror):
    return block("data", "Data", [], ["data", "label"],
                 f"  include {{\n    phase: {phase}\n  }}\n"
                 f"  transform_param {{\n    mirror: {mirror}\n    crop_size: 224\n"
                 "    mean_value: 104\n    mean_value: 117\n    mean_value: 123\n  }\n"
                 f'  data_param {{\n    source: "{source}"\n    batch_size: {batch_size}\n'
                 "    backend: LMDB\n  }\n")


def googlenet(train):
    if train:
        text = data_layer("TRAIN", "examples/imagenet/ilsvrc12_train_lmdb", 32, "true")
        text += data_layer("TEST", "examples/imagenet/ilsvrc12_val_lmdb", 50, "false")
    else:
        text = block("data", "Input", [], ["data"], "  input_param {\n    shape {\n      dim: 10\n"
                     "      dim: 3\n      dim: 224\n      dim: 224\n    }\n  }\n")
    text += conv_relu("conv1/7x7_s2", "data", 64, 7, stride=2, pad=3, relu_name="conv1/relu_7x7")
    text += pool("pool1/3x3_s2", "conv1/7x7_s2", "MAX", 3, 2)
    text += lrn("pool1/norm1", "pool1/3x3_s2")
    text += conv_relu("conv2/3x3_reduce", "pool1/norm1", 64, 1, relu_name="conv2/relu_3x3_reduce")
    text += conv_relu("conv2/3x3", "conv2/3x3_reduce", 192, 3, pad=1, relu_name="conv2/relu_3x3")
    text += lrn("conv2/norm2", "conv2/3x3")
    text += pool("pool2/3x3_s2", "conv2/norm2", "MAX", 3, 2)
    bottom = "pool2/3x3_s2"
    for key in INCEPTION:
        module, bottom = inception(key, bottom)
        text += module
        if train and key in ("4a", "4d"):
            text += auxiliary(1 if key == "4a" else 2, bottom)
        if key in ("3b", "4e"):
            name = "pool3/3x3_s2" if key == "3b" else "pool4/3x3_s2"
            text += pool(name, bottom, "MAX", 3, 2)
            bottom = name
    text += pool("pool5/7x7_s1", bottom, "AVE", 7, 1)
    text += dropout("pool5/drop_7x7_s1", "pool5/7x7_s1", 0.4)
    text += fc("loss3/classifier", "pool5/7x7_s1", 1000, 0)
    if train:
        text += block("loss3/loss3", "SoftmaxWithLoss", ["loss3/classifier", "label"], ["loss3/loss3"],
                      "  loss_weight: 1\n")
        text += accuracy("loss3", "loss3/classifier")
    else:
        text += block("prob", "Softmax", ["loss3/classifier"], ["prob"])
    return 'name: "GoogleNet"\n' + text


HEADER = ("# Generated by models/bvlc_googlenet/make_googlenet.py: edit the script, not this file.\n"
          "# BVLC GoogLeNet, Inception v1 (Caffe's models/bvlc_googlenet/{name}).\n")

DESCRIPTIONS = {
    "deploy.prototxt": (False, "# Input: 10x3x224x224 crops. The main classifier only (no auxiliary losses);\n"
                               "# output: Softmax \"prob\" over 1000 classes.\n"),
    "train_val.prototxt": (True, "# ImageNet LMDBs (Caffe's paths), mean values 104/117/123, crop 224, mirror in\n"
                                 "# TRAIN; the two auxiliary classifiers (loss1 on inception_4a, loss2 on\n"
                                 "# inception_4d) weigh 0.3 each in the loss, the main one (loss3) 1.\n"),
}


def main():
    for name, (train, description) in DESCRIPTIONS.items():
        with open(os.path.join(HERE, name), "w") as out:
            out.write(HEADER.format(name=name) + description + googlenet(train))


if __name__ == "__main__":
    main()
