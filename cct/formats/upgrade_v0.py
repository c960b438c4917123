"""V0 nets (`layers { layer { type: "conv" num_output: 96 kernelsize: 11 } }`)
-> V1 (`layers { type: CONVOLUTION convolution_param { ... } }`), as Caffe's
UpgradeV0Net: "padding" layers folded into the conv/pool they feed, then each
V0 field moved into the *_param message of the layer types that accept it.
A field the layer's type does not accept is an error (Caffe fails the upgrade).
"""
from cct.core.errors import ConfigError
from cct.proto import caffe_pb2

_V1 = caffe_pb2.V1LayerParameter

# V0 type string -> V1 enum name. "padding" is folded away before this applies.
V0_TYPES = {
    "accuracy": "ACCURACY", "bnll": "BNLL", "concat": "CONCAT", "conv": "CONVOLUTION",
    "data": "DATA", "dropout": "DROPOUT", "euclidean_loss": "EUCLIDEAN_LOSS", "flatten": "FLATTEN",
    "hdf5_data": "HDF5_DATA", "hdf5_output": "HDF5_OUTPUT", "im2col": "IM2COL",
    "images": "IMAGE_DATA", "infogain_loss": "INFOGAIN_LOSS", "innerproduct": "INNER_PRODUCT",
    "lrn": "LRN", "multinomial_logistic_loss": "MULTINOMIAL_LOGISTIC_LOSS", "pool": "POOLING",
    "relu": "RELU", "sigmoid": "SIGMOID", "softmax": "SOFTMAX", "softmax_loss": "SOFTMAX_LOSS",
    "split": "SPLIT", "tanh": "TANH", "window_data": "WINDOW_DATA",
}

# The V1 param message of each V0 type that has one.
_PARAM_OF = {
    "conv": "convolution_param", "innerproduct": "inner_product_param", "pool": "pooling_param",
    "dropout": "dropout_param", "lrn": "lrn_param", "data": "data_param",
    "hdf5_data": "hdf5_data_param", "images": "image_data_param",
    "window_data": "window_data_param", "infogain_loss": "infogain_loss_param",
    "concat": "concat_param", "hdf5_output": "hdf5_output_param",
}
_ANY = "*"

# V0 field -> (the V0 types that accept it, field name in their param message).
# Types _ANY: the field goes to the named V1 field or transform_param.<field> of every type.
_FIELDS = {
    "num_output": ("conv innerproduct", "num_output"),
    "biasterm": ("conv innerproduct", "bias_term"),
    "weight_filler": ("conv innerproduct", "weight_filler"),
    "bias_filler": ("conv innerproduct", "bias_filler"),
    "pad": ("conv pool", "pad"),
    "kernelsize": ("conv pool", "kernel_size"),
    "group": ("conv", "group"),
    "stride": ("conv pool", "stride"),
    "pool": ("pool", "pool"),                  # V0 PoolMethod numbers equal PoolingParameter's
    "dropout_ratio": ("dropout", "dropout_ratio"),
    "local_size": ("lrn", "local_size"),
    "alpha": ("lrn", "alpha"),
    "beta": ("lrn", "beta"),
    "k": ("lrn", "k"),
    "source": ("data hdf5_data images window_data infogain_loss", "source"),
    "batchsize": ("data hdf5_data images window_data", "batch_size"),
    "rand_skip": ("data images", "rand_skip"),
    "shuffle_images": ("images", "shuffle"),
    "new_height": ("images", "new_height"),
    "new_width": ("images", "new_width"),
    "concat_dim": ("concat", "concat_dim"),
    "det_fg_threshold": ("window_data", "fg_threshold"),
    "det_bg_threshold": ("window_data", "bg_threshold"),
    "det_fg_fraction": ("window_data", "fg_fraction"),
    "det_context_pad": ("window_data", "context_pad"),
    "det_crop_mode": ("window_data", "crop_mode"),
    "hdf5_output_param": ("hdf5_output", None),   # the whole message
    "scale": (_ANY, "transform_param.scale"),
    "meanfile": (_ANY, "transform_param.mean_file"),
    "cropsize": (_ANY, "transform_param.crop_size"),
    "mirror": (_ANY, "transform_param.mirror"),
    "blobs": (_ANY, "blobs"),
    "blobs_lr": (_ANY, "blobs_lr"),
    "weight_decay": (_ANY, "weight_decay"),
}


def upgrade_v0_net(net_param, source="<net>"):
    """A V1 NetParameter (`layers` with V1 types and *_param messages) from a V0 one."""
    padded = _fold_padding_layers(net_param, source)
    upgraded = caffe_pb2.NetParameter()
    upgraded.CopyFrom(padded)
    upgraded.ClearField("layers")
    for connection in padded.layers:
        upgraded.layers.add().CopyFrom(_upgrade_layer(connection, source))
    return upgraded


def _where(connection, source):
    return f"{source}: layer '{connection.layer.name}' (V0 type '{connection.layer.type}')"


def _fold_padding_layers(net_param, source):
    """Drop each "padding" layer; the conv or pool layer reading its output takes
    its pad and reads its input instead (Caffe's UpgradeV0PaddingLayers)."""
    folded = caffe_pb2.NetParameter()
    folded.CopyFrom(net_param)
    folded.ClearField("layers")
    producer = {name: None for name in net_param.input}     # blob -> last V0 layer writing it
    for connection in net_param.layers:
        where = _where(connection, source)
        extra = [f.name for f, _ in connection.ListFields() if f.name not in ("layer", "bottom", "top")]
        if not connection.HasField("layer") or extra:
            raise ConfigError(f"{where}: a V0 net's `layers` entries hold only bottom, top and a "
                              f"`layer {{}}` (found {extra or 'no layer {}'})")
        is_padding = connection.layer.type == "padding"
        if not is_padding:
            kept = folded.layers.add()
            kept.CopyFrom(connection)
        for index, blob in enumerate(connection.bottom):
            if blob not in producer:
                raise ConfigError(f"{where}: bottom[{index}]: unknown blob '{blob}'")
            padding = producer[blob]
            if padding is None or padding.layer.type != "padding":
                continue
            if connection.layer.type not in ("conv", "pool"):
                raise ConfigError(f"{where}: reads the output of padding layer "
                                  f"'{padding.layer.name}'; only conv and pool layers may")
            if len(connection.bottom) != 1 or len(padding.bottom) != 1 or len(padding.top) != 1:
                raise ConfigError(f"{where}: a padding layer and the layer it feeds must each "
                                  "have exactly one bottom (and the padding layer one top)")
            kept.layer.pad = padding.layer.pad
            kept.bottom[index] = padding.bottom[0]
        for blob in connection.top:
            producer[blob] = connection
    return folded


def _upgrade_layer(connection, source):
    """One V0 `layers { layer { ... } }` entry -> a V1LayerParameter."""
    v0 = connection.layer
    where = _where(connection, source)
    layer = _V1(bottom=list(connection.bottom), top=list(connection.top))
    if v0.HasField("name"):
        layer.name = v0.name
    if v0.HasField("type"):
        if v0.type not in V0_TYPES:
            raise ConfigError(f"{where}: type: unknown V0 layer type '{v0.type}'; "
                              f"known: {', '.join(sorted(V0_TYPES))}")
        layer.type = _V1.LayerType.Value(V0_TYPES[v0.type])
    for field, value in v0.ListFields():
        if field.name in ("name", "type"):
            continue
        types, target = _FIELDS.get(field.name, ("", None))
        if types == _ANY:
            *path, target = target.split(".")
            message = getattr(layer, path[0]) if path else layer
        elif v0.type in types.split():
            message = getattr(layer, _PARAM_OF[v0.type])
        else:
            raise ConfigError(f"{where}: {field.name}: not a parameter of V0 layer type '{v0.type}'")
        if target is None:
            message.CopyFrom(value)
        elif field.is_repeated:
            getattr(message, target).extend(value)
        elif message.DESCRIPTOR.fields_by_name[target].is_repeated:
            getattr(message, target).append(value)      # pad/kernel_size/stride of a conv
        elif field.message_type is not None:
            getattr(message, target).CopyFrom(value)
        else:
            setattr(message, target, value)
    return layer
