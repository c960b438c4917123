"""Upgrade old net and solver definitions the way Caffe's upgrade_proto does.

Each pass takes a NetParameter and returns an upgraded copy; upgrade_net runs
whichever are needed, in Caffe's order: V0 -> V1, V1 data transforms, V1 -> V2
(`layers` -> `layer`), `input:` fields -> an Input layer, old BatchNorm params.
"""
from cct.core.errors import ConfigError
from cct.formats.text import undecoded_string
from cct.proto import caffe_pb2

# V1LayerParameter.LayerType enum name -> the type string of today's layers.
V1_TYPE_NAMES = {
    "NONE": "", "ABSVAL": "AbsVal", "ACCURACY": "Accuracy", "ARGMAX": "ArgMax", "BNLL": "BNLL",
    "CONCAT": "Concat", "CONTRASTIVE_LOSS": "ContrastiveLoss", "CONVOLUTION": "Convolution",
    "DECONVOLUTION": "Deconvolution", "DATA": "Data", "DROPOUT": "Dropout",
    "DUMMY_DATA": "DummyData", "EUCLIDEAN_LOSS": "EuclideanLoss", "ELTWISE": "Eltwise",
    "EXP": "Exp", "FLATTEN": "Flatten", "HDF5_DATA": "HDF5Data", "HDF5_OUTPUT": "HDF5Output",
    "HINGE_LOSS": "HingeLoss", "IM2COL": "Im2col", "IMAGE_DATA": "ImageData",
    "INFOGAIN_LOSS": "InfogainLoss", "INNER_PRODUCT": "InnerProduct", "LRN": "LRN",
    "MEMORY_DATA": "MemoryData", "MULTINOMIAL_LOGISTIC_LOSS": "MultinomialLogisticLoss",
    "MVN": "MVN", "POOLING": "Pooling", "POWER": "Power", "RELU": "ReLU", "SIGMOID": "Sigmoid",
    "SIGMOID_CROSS_ENTROPY_LOSS": "SigmoidCrossEntropyLoss", "SILENCE": "Silence",
    "SOFTMAX": "Softmax", "SOFTMAX_LOSS": "SoftmaxWithLoss", "SPLIT": "Split", "SLICE": "Slice",
    "TANH": "TanH", "WINDOW_DATA": "WindowData", "THRESHOLD": "Threshold",
}

# V1 fields that have no namesake in LayerParameter and are translated by hand.
_V1_SPECIAL = {"type", "blobs_lr", "weight_decay", "param", "blob_share_mode", "layer"}
_DATA_TRANSFORM_FIELDS = ("scale", "mean_file", "crop_size", "mirror")
_DATA_PARAMS = {"Data": "data_param", "ImageData": "image_data_param",
                "WindowData": "window_data_param"}


def upgrade_net(net, source="<net>"):
    """Return `net` upgraded to the current format (a copy when anything changed)."""
    undecoded = undecoded_string(net)
    if undecoded:
        raise ConfigError(f"{source}: {undecoded[0]}: not UTF-8 text: {undecoded[1]!r}")
    if any(layer.HasField("layer") for layer in net.layers):
        from cct.formats.upgrade_v0 import upgrade_v0_net
        net = upgrade_v0_net(net, source)
    if len(net.layers):
        net = upgrade_v1_net(net, source)
    if len(net.input_shape) or len(net.input_dim) or len(net.input):
        net = upgrade_net_input(net, source)
    return upgrade_batch_norm(net)


def upgrade_v1_net(net, source="<net>"):
    """V1 (`layers { type: CONVOLUTION blobs_lr: 1 }`) -> V2 (`layer { type: "Convolution" }`)."""
    if len(net.layer):
        raise ConfigError(f"{source}: uses both `layer` and the legacy `layers` field; "
                          "a net must use one of them")
    upgraded = caffe_pb2.NetParameter()
    upgraded.CopyFrom(net)
    upgraded.ClearField("layers")
    for v1_layer in net.layers:
        upgraded.layer.add().CopyFrom(upgrade_v1_layer(v1_layer, source))
    return upgraded


def upgrade_v1_layer(v1_layer, source="<net>"):
    layer = caffe_pb2.LayerParameter()
    where = f"{source}: layer '{v1_layer.name}'"
    for field, value in v1_layer.ListFields():
        if field.name in _V1_SPECIAL:
            continue
        target = layer.DESCRIPTOR.fields_by_name.get(field.name)
        if target is None:
            raise ConfigError(f"{where}: field {field.name} has no V2 equivalent")
        if field.is_repeated:
            getattr(layer, field.name).extend(value)
        elif field.message_type is not None:
            getattr(layer, field.name).CopyFrom(value)
        else:
            setattr(layer, field.name, value)
    if v1_layer.HasField("type"):
        enum_name = caffe_pb2.V1LayerParameter.LayerType.Name(v1_layer.type)
        layer.type = V1_TYPE_NAMES.get(enum_name, "")
        if not layer.type:
            raise ConfigError(f"{where}: type: V1 layer type {enum_name} has no V2 equivalent")
    _upgrade_param_specs(v1_layer, layer)
    _move_data_transforms(layer, where)
    return layer


def _upgrade_param_specs(v1_layer, layer):
    """blobs_lr / weight_decay / param names / blob_share_mode -> ParamSpec list."""
    per_param = [("name", list(v1_layer.param)), ("lr_mult", list(v1_layer.blobs_lr)),
                 ("decay_mult", list(v1_layer.weight_decay)),
                 ("share_mode", list(v1_layer.blob_share_mode))]
    for attribute, values in per_param:
        for index, value in enumerate(values):
            while len(layer.param) <= index:
                layer.param.add()
            setattr(layer.param[index], attribute, value)


def _move_data_transforms(layer, where):
    """V1 data layers carried scale/mean_file/crop_size/mirror in their own params."""
    param_name = _DATA_PARAMS.get(layer.type)
    if not param_name or not layer.HasField(param_name):
        return
    data_param = getattr(layer, param_name)
    for field in _DATA_TRANSFORM_FIELDS:
        if data_param.HasField(field):
            setattr(layer.transform_param, field, getattr(data_param, field))
            data_param.ClearField(field)


def upgrade_net_input(net, source="<net>"):
    """`input:` + `input_dim:`/`input_shape:` fields -> an Input layer placed first."""
    upgraded = caffe_pb2.NetParameter()
    upgraded.CopyFrom(net)
    for field in ("input", "input_shape", "input_dim"):
        upgraded.ClearField(field)
    has_shape, has_dim = len(net.input_shape) > 0, len(net.input_dim) > 0
    if not (has_shape or has_dim):
        return upgraded   # a legacy caffemodel: the input names alone carry nothing
    if has_shape and len(net.input_shape) != len(net.input):
        raise ConfigError(f"{source}: input_shape: {len(net.input)} inputs but "
                          f"{len(net.input_shape)} input_shape entries")
    if has_dim and len(net.input_dim) != 4 * len(net.input):
        raise ConfigError(f"{source}: input_dim: {len(net.input)} inputs need "
                          f"{4 * len(net.input)} input_dim values, got {len(net.input_dim)}")
    input_layer = caffe_pb2.LayerParameter(name="input", type="Input")
    for index, name in enumerate(net.input):
        input_layer.top.append(name)
        shape = input_layer.input_param.shape.add()
        if has_shape:
            shape.CopyFrom(net.input_shape[index])
        else:
            shape.dim.extend(net.input_dim[4 * index:4 * index + 4])
    upgraded.ClearField("layer")
    upgraded.layer.add().CopyFrom(input_layer)
    upgraded.layer.extend(net.layer)
    return upgraded


def upgrade_batch_norm(net):
    """Old BatchNorm defs listed 3 ParamSpecs; their statistics must not learn."""
    stale = [layer for layer in net.layer if layer.type == "BatchNorm" and len(layer.param) == 3]
    if not stale:
        return net
    upgraded = caffe_pb2.NetParameter()
    upgraded.CopyFrom(net)
    for layer in upgraded.layer:
        if layer.type == "BatchNorm" and len(layer.param) == 3:
            for spec in layer.param:
                spec.lr_mult, spec.decay_mult = 0.0, 0.0
    return upgraded


_SOLVER_TYPE_NAMES = {0: "SGD", 1: "Nesterov", 2: "AdaGrad", 3: "RMSProp", 4: "AdaDelta", 5: "Adam"}


def upgrade_solver(solver, source="<solver>"):
    """The deprecated `solver_type` enum -> the `type` string (Caffe's UpgradeSolverType)."""
    if not solver.HasField("solver_type"):
        return solver
    if solver.HasField("type") and solver.type != _SOLVER_TYPE_NAMES[solver.solver_type]:
        raise ConfigError(f"{source}: solver_type: conflicts with type {solver.type!r}; give only `type`")
    upgraded = caffe_pb2.SolverParameter()
    upgraded.CopyFrom(solver)
    upgraded.type = _SOLVER_TYPE_NAMES[solver.solver_type]
    upgraded.ClearField("solver_type")
    return upgraded
