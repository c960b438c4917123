"""Layers that hold the net's inputs: Input (shapes from input_param)."""
from cct.layer import Layer, register


@register("Input")
class Input(Layer):
    """Net inputs, filled by the user. input_param { shape { dim: ... } } gives one
    shape for every top or one per top. Reshape keeps what the user set."""
    min_tops = 1
    exact_bottoms = 0

    def setup(self, bottom, top):
        shapes = self.layer_param.input_param.shape
        if len(shapes) not in (0, 1, len(top)):
            raise self.config_error("input_param.shape", f"give one shape or one per top "
                                    f"({len(top)}), got {len(shapes)}")
        for index, blob in enumerate(top):
            if shapes:
                blob.reshape(tuple(shapes[0 if len(shapes) == 1 else index].dim))

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        pass
