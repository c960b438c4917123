"""Drawing a NetParameter as a graph (pycaffe's caffe.draw): layers are boxes
(convolutions red, pooling orange, inner products purple, in-place layers green),
blobs are octagons; rendered by graphviz's `dot` through pydot.

    draw_net_to_file(net_param, "net.png", rankdir="LR", phase=cct.TRAIN)
"""
import shutil

from cct.core.errors import CctError
from cct.proto import caffe_pb2
from cct.formats.prototxt import atomic_write, read_net

LAYER_STYLE_DEFAULT = {"shape": "record", "fillcolor": "#6495ED", "style": "filled"}
NEURON_LAYER_STYLE = {"shape": "record", "fillcolor": "#90EE90", "style": "filled"}
BLOB_STYLE = {"shape": "octagon", "fillcolor": "#E0E0E0", "style": "filled"}

_LEARNING_TYPES = ("Convolution", "Deconvolution", "InnerProduct")


def _pydot():
    try:
        import pydot
    except ImportError:
        raise CctError("drawing nets needs the pydot package: pip install pydot") from None
    return pydot


def get_pooling_types_dict():
    """{pooling enum value: name}, e.g. {0: 'MAX', 1: 'AVE', 2: 'STOCHASTIC'}."""
    return {value.number: name for name, value in
            caffe_pb2.PoolingParameter.PoolMethod.DESCRIPTOR.values_by_name.items()}


def get_edge_label(layer):
    """Label of a layer's output edges: batch size of Data layers, num_output of
    convolutions and inner products."""
    if layer.type == "Data":
        return "Batch " + str(layer.data_param.batch_size)
    if layer.type in ("Convolution", "Deconvolution"):
        return str(layer.convolution_param.num_output)
    if layer.type == "InnerProduct":
        return str(layer.inner_product_param.num_output)
    return '""'


def get_layer_lr_mult(layer):
    """(weight lr_mult, bias lr_mult) of a Convolution/Deconvolution/InnerProduct layer."""
    if layer.type not in _LEARNING_TYPES:
        raise ValueError(f"{layer.type} layers do not have a learning rate multiplier")
    params = layer.param
    if len(params) > 2:
        raise ValueError(f"layer '{layer.name}': could not parse the learning rate multipliers "
                         f"({len(params)} param specs)")
    mults = [p.lr_mult for p in params] + [1.0] * (2 - len(params))
    return tuple(mults)


def get_layer_label(layer, rankdir, display_lrm=False):
    """The node label: name, (type [pool method]), kernel/stride/pad for spatial
    layers and optionally the lr multipliers; words separated by spaces in a
    vertical layout, newlines in a horizontal one."""
    separator = " " if rankdir in ("TB", "BT") else r"\n"
    descriptors = [layer.name]
    if layer.type == "Pooling":
        descriptors.append(f"({layer.type} {get_pooling_types_dict()[layer.pooling_param.pool]})")
    else:
        descriptors.append(f"({layer.type})")
    if layer.type in ("Convolution", "Deconvolution", "Pooling"):
        if layer.type == "Pooling":
            param = layer.pooling_param
            kernel_size, stride, pad = param.kernel_size, param.stride, param.pad
        else:
            param = layer.convolution_param
            kernel_size = param.kernel_size[0] if len(param.kernel_size) else 1
            stride = param.stride[0] if len(param.stride) else 1
            pad = param.pad[0] if len(param.pad) else 0
        descriptors.append(separator.join([f"kernel size: {kernel_size}", f"stride: {stride}", f"pad: {pad}"]))
    if display_lrm and layer.type in _LEARNING_TYPES:
        weight_mult, bias_mult = get_layer_lr_mult(layer)
        if weight_mult or bias_mult:
            descriptors.append(f"lr mult: {weight_mult:.1f}, {bias_mult:.1f}")
    # Outer quotes: graphviz would misread the colons otherwise.
    return '"%s"' % separator.join(descriptors)


def choose_color_by_layertype(layertype):
    if layertype in ("Convolution", "Deconvolution"):
        return "#FF5050"
    if layertype == "Pooling":
        return "#FF9900"
    if layertype == "InnerProduct":
        return "#CC33FF"
    return "#6495ED"


def _included(layer, phase):
    """pycaffe's phase filter: include rules by phase only (not level or stage)."""
    if len(layer.include) and len(layer.exclude):
        raise CctError(f"layer '{layer.name}' has both include and exclude specified")
    included = not len(layer.include)
    for rule in layer.include:
        included = included or rule.phase == phase
    for rule in layer.exclude:
        included = included and rule.phase != phase
    return included


def get_pydot_graph(caffe_net, rankdir, label_edges=True, phase=None, display_lrm=False):
    """A pydot graph of the NetParameter `caffe_net` (or a prototxt path/text).
    phase: cct.TRAIN/TEST to keep only that phase's layers; None keeps all."""
    pydot = _pydot()
    if not isinstance(caffe_net, caffe_pb2.NetParameter):
        caffe_net = read_net(caffe_net)
    graph = pydot.Dot(caffe_net.name or "Net", graph_type="digraph", rankdir=rankdir)
    nodes, edges = {}, []
    for layer in caffe_net.layer:
        if phase is not None and not _included(layer, phase):
            continue
        label = get_layer_label(layer, rankdir, display_lrm=display_lrm)
        node_name = f"{layer.name}_{layer.type}"
        if len(layer.bottom) == 1 and len(layer.top) == 1 and layer.bottom[0] == layer.top[0]:
            nodes[node_name] = pydot.Node(label, **NEURON_LAYER_STYLE)       # in-place
        else:
            style = dict(LAYER_STYLE_DEFAULT, fillcolor=choose_color_by_layertype(layer.type))
            nodes[node_name] = pydot.Node(label, **style)
        for bottom in layer.bottom:
            nodes[bottom + "_blob"] = pydot.Node(_quoted(bottom), **BLOB_STYLE)
            edges.append((bottom + "_blob", node_name, '""'))
        for top in layer.top:
            nodes[top + "_blob"] = pydot.Node(_quoted(top))
            edges.append((node_name, top + "_blob", get_edge_label(layer) if label_edges else '""'))
    for node in nodes.values():
        graph.add_node(node)
    for source, target, label in edges:
        graph.add_edge(pydot.Edge(nodes[source], nodes[target], label=label))
    return graph


def _quoted(name):
    # Blob names such as "data/label" or "a-b" are not graphviz IDs unless quoted.
    return f'"{name}"'


def draw_net(caffe_net, rankdir, ext="png", phase=None, display_lrm=False):
    """The drawing of the net as bytes in format `ext` (png, svg, pdf, dot, ...)."""
    graph = get_pydot_graph(caffe_net, rankdir, phase=phase, display_lrm=display_lrm)
    if ext != "raw" and shutil.which("dot") is None:
        raise CctError("drawing nets needs graphviz's `dot` program, which is not on PATH: "
                       "install graphviz (apt-get install graphviz, brew install graphviz)")
    if ext == "raw":
        return graph.to_string().encode()
    return graph.create(format=ext)


def draw_net_to_file(caffe_net, filename, rankdir="LR", phase=None, display_lrm=False):
    """Draw the net into `filename`, in the format its extension names; '.raw'
    writes the graphviz source text."""
    filename = str(filename)
    ext = filename[filename.rfind(".") + 1:]
    image = draw_net(caffe_net, rankdir, ext, phase, display_lrm)
    atomic_write(filename, image)
