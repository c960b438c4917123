"""Nets written in Python: pycaffe's net_spec (`from cct import layers as L,
params as P, NetSpec`), producing the NetParameter pycaffe would.

    n = NetSpec()
    n.data, n.label = L.Data(batch_size=64, backend=P.Data.LMDB, source="train_lmdb",
                             transform_param=dict(scale=1. / 255), ntop=2)
    n.conv1 = L.Convolution(n.data, kernel_size=5, num_output=20)
    n.relu1 = L.ReLU(n.conv1, in_place=True)
    text = str(n.to_proto())

How a keyword argument of `L.<Type>(...)` lands, as in pycaffe:
- `ntop` (number of tops, default 1) and `in_place` (tops = bottoms) are ours;
- a name ending in `param` (`param`, `transform_param`, `convolution_param`...)
  is a LayerParameter field;
- anything else goes into the type's own parameter message (`<type>_param`,
  found from the message names: Convolution -> convolution_param) when that
  message has such a field, else into the LayerParameter (`include`,
  `loss_weight`, `propagate_down`, `name`...).
Values: a dict fills a message, a list of dicts adds repeated messages, a list
extends a repeated field, a scalar given for a repeated field is a one-item list.
Names: a top assigned to the NetSpec takes that name and gives it to its layer;
other tops and layers are named `<Type><count>` (Convolution1, ...).
"""
from collections import Counter, OrderedDict

from google.protobuf.message import Message

from cct.core.errors import ConfigError
from cct.proto import caffe_pb2


def param_name_dict():
    """{layer type: parameter field prefix}, from the LayerParameter's *_param
    fields and their message names: {"Convolution": "convolution", "ReLU": "relu", ...}.
    Where fields share a message, the first declared names it: BVLC's and the
    forks' own come before the fork fields that reuse their messages
    (relu6_param's ReLUParameter, MobileNet-YOLO's reorg and upsample numbers)."""
    names = {}
    for field in caffe_pb2.LayerParameter.DESCRIPTOR.fields:
        if field.name.endswith("_param") and field.message_type is not None:
            message_name = field.message_type.name
            if message_name.endswith("Parameter"):
                names.setdefault(message_name[:-len("Parameter")], field.name[:-len("_param")])
    return names


_PARAM_NAMES = param_name_dict()


def to_proto(*tops):
    """A NetParameter with every layer needed to compute `tops` (names automatic)."""
    layers = OrderedDict()
    autonames = Counter()
    for top in tops:
        top._to_proto(layers, {}, autonames)
    net = caffe_pb2.NetParameter()
    net.layer.extend(layers.values())
    return net


def assign_proto(proto, name, value):
    """Set field `name` of message `proto` from a Python value (recursively):
    dict -> message, list -> repeated field, scalar for a repeated field -> [scalar]."""
    field = getattr(proto, name)                    # AttributeError: no such field
    is_repeated = hasattr(field, "extend")
    if is_repeated and not isinstance(value, (list, tuple)):
        value = [value]
    if isinstance(value, (list, tuple)):
        if value and isinstance(value[0], dict):
            for item in value:
                message = field.add()
                for key, sub_value in item.items():
                    assign_proto(message, key, sub_value)
        else:
            field.extend(value)
    elif isinstance(value, dict):
        for key, sub_value in value.items():
            assign_proto(field, key, sub_value)
    elif isinstance(value, Message):
        field.CopyFrom(value)
    else:
        setattr(proto, name, value)


class Top:
    """One output blob of a layer (a Function); `n` is its index among the tops."""

    def __init__(self, fn, n):
        self.fn = fn
        self.n = n

    def to_proto(self):
        """A NetParameter with every layer needed to compute this top."""
        return to_proto(self)

    def _update(self, params):
        self.fn._update(params)

    def _to_proto(self, layers, names, autonames):
        return self.fn._to_proto(layers, names, autonames)


class NotATopError(ConfigError, TypeError):
    """A layer input that is not a Top: a TypeError, as pycaffe raises (and its tests
    expect), and a ConfigError, as every other net_spec mistake."""


class Function:
    """A layer: its type, its inputs (Tops of other layers) and its parameters."""

    def __init__(self, type_name, inputs, params):
        self.type_name = type_name
        for index, value in enumerate(inputs):
            if not isinstance(value, Top):
                # pycaffe's message, word for word: its tests match it.
                raise NotATopError(f"{type_name} input {index} is not a Top (type is {type(value)})")
        self.inputs = inputs
        self.params = dict(params)
        self.ntop = self.params.pop("ntop", 1)
        self.in_place = self.params.pop("in_place", False)
        self.tops = tuple(Top(self, n) for n in range(self.ntop))

    def _get_name(self, names, autonames):
        if self not in names and self.ntop > 0:
            names[self] = self._get_top_name(self.tops[0], names, autonames)
        elif self not in names:
            autonames[self.type_name] += 1
            names[self] = self.type_name + str(autonames[self.type_name])
        return names[self]

    def _get_top_name(self, top, names, autonames):
        if top not in names:
            autonames[top.fn.type_name] += 1
            names[top] = top.fn.type_name + str(autonames[top.fn.type_name])
        return names[top]

    def _update(self, params):
        self.params.update(params)

    def _to_proto(self, layers, names, autonames):
        if self in layers:
            return
        bottom_names = []
        for top in self.inputs:
            top._to_proto(layers, names, autonames)
            bottom_names.append(layers[top.fn].top[top.n])
        layer = caffe_pb2.LayerParameter()
        layer.type = self.type_name
        layer.bottom.extend(bottom_names)
        if self.in_place:
            layer.top.extend(layer.bottom)
        else:
            for top in self.tops:
                layer.top.append(self._get_top_name(top, names, autonames))
        layer.name = self._get_name(names, autonames)
        for key, value in self.params.items():
            self._assign(layer, key, value)
        layers[self] = layer

    def _assign(self, layer, key, value):
        own = _PARAM_NAMES.get(self.type_name)
        first_error = None
        try:
            if not key.endswith("param") and own is not None:
                try:
                    assign_proto(getattr(layer, own + "_param"), key, value)
                    return
                except AttributeError as error:
                    first_error = error     # not a field of the type's message: a layer field
            assign_proto(layer, key, value)
        except AttributeError as error:
            where = (f"{own}_param nor LayerParameter" if own else
                     f"LayerParameter ({self.type_name} has no parameter message of its own)")
            raise ConfigError(f"L.{self.type_name}(): {key}={value!r}: not a field of {where} "
                              f"({first_error or error})") from None
        except (TypeError, ValueError) as error:
            raise ConfigError(f"L.{self.type_name}(): {key}={value!r}: {error}") from None


class NetSpec:
    """Named tops: assign them as attributes (`n.conv1 = L.Convolution(...)`);
    to_proto() gives every layer needed to produce them, using those names."""

    def __init__(self):
        super().__setattr__("tops", OrderedDict())

    def __setattr__(self, name, value):
        self.tops[name] = value

    def __getattr__(self, name):
        try:
            return self.tops[name]
        except KeyError:
            raise AttributeError(f"NetSpec has no top named {name!r}") from None

    def __setitem__(self, name, value):
        self.tops[name] = value

    def __getitem__(self, name):
        return self.tops[name]

    def __delitem__(self, name):
        del self.tops[name]

    def keys(self):
        return list(self.tops.keys())

    def vals(self):
        return list(self.tops.values())

    def update(self, name, params):
        self.tops[name]._update(params)

    def to_proto(self):
        names = {value: key for key, value in self.tops.items()}
        autonames = Counter()
        layers = OrderedDict()
        for top in self.tops.values():
            top._to_proto(layers, names, autonames)
        net = caffe_pb2.NetParameter()
        net.layer.extend(layers.values())
        return net


class Layers:
    """`L.Convolution(bottom, kernel_size=3)`: a Top (or a tuple of Tops when
    ntop > 1, or the Function itself when ntop == 0)."""

    def __getattr__(self, type_name):
        if type_name.startswith("__"):
            raise AttributeError(type_name)

        def layer_fn(*args, **kwargs):
            fn = Function(type_name, args, kwargs)
            if fn.ntop == 0:
                return fn
            if fn.ntop == 1:
                return fn.tops[0]
            return fn.tops
        return layer_fn


class Parameters:
    """`P.Pooling.MAX`: enum values of `<Name>Parameter` messages."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        message = getattr(caffe_pb2, name + "Parameter", None)
        if message is None:
            raise AttributeError(f"P.{name}: caffe_pb2 has no message {name}Parameter")

        class Param:
            def __getattr__(self, value_name):
                try:
                    return getattr(message, value_name)
                except AttributeError:
                    raise AttributeError(f"P.{name}.{value_name}: {name}Parameter has no "
                                         f"enum value {value_name}") from None
        return Param()


layers = Layers()
params = Parameters()
