"""The YOLOv2 port's DetectionOutput (gklz1982/caffe-yolov2), as its CPU
forward computes it: src/caffe/layers/detection_output_layer.cpp with
get_region_box, class_index_and_score and ApplyNms of
include/caffe/util/bbox_util.hpp (the port has no .cu for it).

The type name and detection_output_param are SSD's as well (FORKS.md);
ssd.DetectionOutput builds this class when the fields are the port's
(is_yolo_flavour). Values are float32, as the port's Dtype, each step in its
order; the port's sigmoid rounds through double (1. / (1. + exp(-x))).
"""
import numpy as np

from cct.core.errors import ConfigError, layer_where
from cct.core.layer import Layer, NoBackward
from cct.layers.boxes import box_sizes, overlaps

_F32 = np.float32
# fields only the port's message has / only SSD's has (cct's schema holds both)
YOLO_FIELDS = ("side", "num_box", "coords", "nms_threshold", "biases", "label_map_file")
SSD_FIELDS = ("share_location", "background_label_id", "nms_param", "save_output_param", "code_type",
              "variance_encoded_in_target", "keep_top_k", "visualize", "visualize_threshold", "save_file")


def _given(p, name):
    field = getattr(p, name)
    return len(field) > 0 if name == "biases" else p.HasField(name)


def is_yolo_flavour(layer_param, source=None):
    """True where detection_output_param gives one of the port's own fields;
    a ConfigError where it also gives one of SSD's."""
    p = layer_param.detection_output_param
    yolo = [name for name in YOLO_FIELDS if _given(p, name)]
    if not yolo:
        return False
    ssd = [name for name in SSD_FIELDS if _given(p, name)]
    if ssd:
        raise ConfigError(f"{layer_where(layer_param, source)}: detection_output_param.{ssd[0]}: SSD's field, "
                          f"but detection_output_param.{yolo[0]} is the YOLOv2 port's; a DetectionOutput takes "
                          "the fields of one flavour")
    return True


def sigmoid(x):
    """float32 x -> float32 1 / (1 + exp(-x)), in double as the port's sigmoid."""
    return (1.0 / (1.0 + np.exp(-x.astype(np.float64)))).astype(_F32)


def class_scores(logits):
    """(K, classes) float32 -> (label, score) per row: the softmax's first
    largest value and its index (class_index_and_score; the sum in order)."""
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs = e / np.cumsum(e, axis=1, dtype=_F32)[:, -1:]
    labels = np.argmax(probs, axis=1)
    return labels, probs[np.arange(probs.shape[0]), labels]


def corner_boxes(centre):
    """(K, 4) float32 (x, y, w, h) -> (K, 4) (xmin, ymin, xmax, ymax) clipped
    to [0, 1] (setNormalizedBBox: x - w / 2.0 in double, stored as float)."""
    x, y, w, h = (centre[:, k].astype(np.float64) for k in range(4))
    boxes = np.stack([x - w / 2.0, y - h / 2.0, x + w / 2.0, y + h / 2.0], axis=1).astype(_F32)
    boxes[:, :2] = np.maximum(boxes[:, :2], _F32(0))
    boxes[:, 2:] = np.minimum(boxes[:, 2:], _F32(1))
    return boxes


def greedy_nms(centre, threshold):
    """Indices kept by the port's ApplyNms, in their order: no sorting, no
    classes; a box not yet removed removes every later one overlapping it by
    >= threshold."""
    boxes = corner_boxes(centre)
    iou = overlaps(boxes, box_sizes(boxes))
    removed = np.zeros(boxes.shape[0], bool)
    for i in range(boxes.shape[0] - 1):
        if not removed[i]:
            removed[i + 1:] |= iou[i, i + 1:] >= threshold
    return np.flatnonzero(~removed)


class YoloDetectionOutput(NoBackward, Layer):
    """The YOLOv2 port's detections: region boxes from one image's
    predictions, a class-blind greedy NMS.

    Fields (detection_output_param): num_classes (required), side (13),
    num_box (5), coords (4; the port reads 4 coordinates whatever it says, so
    only 4 is taken), confidence_threshold (0.01), nms_threshold (0.45),
    biases (2 * num_box anchor sizes in cells: w, h per box). label_map_file
    only names labels in the port and is not read.
    Bottom: (1, C, H, W), C = num_box * (coords + 1 + num_classes): per cell,
    per box, tx, ty, tw, th, objectness, the class logits. The port takes
    batch 1 only (its Reshape checks it). Cell k = j * side + i, of the first
    side * side of the H * W cells in row-major order (the port's loop; side
    should be H = W), box n: x = (i + sigmoid(tx)) / side, y = (j +
    sigmoid(ty)) / side, w = exp(tw) biases[2n] / side, h = exp(th)
    biases[2n+1] / side; confidence = sigmoid(objectness) x the largest
    softmax class probability, kept where >= confidence_threshold.
    Top: (1, 1, D, 7), a row [0, label, confidence, x, y, w, h] (centre and
    size, not clipped) per box NMS keeps, in cell, then box order; with none,
    one row [0, -1, -1, -1, -1, -1, -1]. (1, 1, 1, 7) before forward.
    """
    type = "DetectionOutput"
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        p = self.layer_param.detection_output_param
        if not p.HasField("num_classes"):
            raise self.config_error("detection_output_param.num_classes", "must be given")
        self.num_classes, self.side, self.num_box = int(p.num_classes), int(p.side), int(p.num_box)
        for name, value in (("num_classes", self.num_classes), ("side", self.side), ("num_box", self.num_box)):
            if value < 1:
                raise self.config_error(f"detection_output_param.{name}", f"must be >= 1, got {value}")
        if p.coords != 4:
            raise self.config_error("detection_output_param.coords", f"the YOLOv2 port's forward reads 4 box "
                                    f"coordinates (x, y, w, h) and then the objectness, got {p.coords}")
        if len(p.biases) != 2 * self.num_box:
            raise self.config_error("detection_output_param.biases", f"needs 2 * num_box = {2 * self.num_box} "
                                    f"values (a width and a height per box), got {len(p.biases)}")
        self.biases = np.asarray(p.biases, _F32).reshape(self.num_box, 2)
        self.confidence_threshold = _F32(p.confidence_threshold if p.HasField("confidence_threshold") else 0.01)
        self.nms_threshold = _F32(p.nms_threshold)

    def reshape(self, bottom, top):
        x = bottom[0]
        if len(x.shape) != 4:
            raise self.shape_error(f"bottom[0] must be (1, C, H, W), got {x.shape}")
        if x.shape[0] != 1:
            raise self.shape_error(f"bottom[0] {x.shape}: the YOLOv2 port's DetectionOutput takes one image "
                                   "(num 1; its Reshape checks it)")
        per_box = 4 + 1 + self.num_classes
        if x.shape[1] != self.num_box * per_box:
            raise self.shape_error(f"bottom[0] {x.shape} must have detection_output_param.num_box * (coords + 1 + "
                                   f"num_classes) = {self.num_box} * {per_box} = {self.num_box * per_box} channels")
        if self.side * self.side > x.shape[2] * x.shape[3]:
            raise self.shape_error(f"detection_output_param.side {self.side}: side * side cells do not fit "
                                   f"bottom[0]'s {x.shape[2]} x {x.shape[3]} map")
        top[0].reshape((1, 1, 1, 7))

    def forward(self, bottom, top):
        _, channels, height, width = bottom[0].shape
        cells = self.side * self.side
        # (C, H * W) -> per cell, per box, its 5 + num_classes values
        pred = bottom[0].data.reshape(channels, height * width).T[:cells].astype(_F32)
        pred = pred.reshape(cells * self.num_box, channels // self.num_box)     # row: cell * num_box + n
        cell, box = np.divmod(np.arange(pred.shape[0]), self.num_box)
        row, col = np.divmod(cell, self.side)
        side = _F32(self.side)
        centre = np.empty((pred.shape[0], 4), _F32)
        centre[:, 0] = (col.astype(_F32) + sigmoid(pred[:, 0])) / side
        centre[:, 1] = (row.astype(_F32) + sigmoid(pred[:, 1])) / side
        centre[:, 2] = np.exp(pred[:, 2]) * self.biases[box, 0] / side
        centre[:, 3] = np.exp(pred[:, 3]) * self.biases[box, 1] / side
        labels, scores = class_scores(pred[:, 5:])
        confidence = sigmoid(pred[:, 4]) * scores
        found = np.flatnonzero(confidence >= self.confidence_threshold)
        kept = found[greedy_nms(centre[found], self.nms_threshold)] if found.size else found
        if not kept.size:
            rows = np.full((1, 7), -1, _F32)        # the port's fake result for the image
            rows[0, 0] = 0
        else:
            rows = np.zeros((kept.size, 7), _F32)
            rows[:, 1], rows[:, 2], rows[:, 3:] = labels[kept], confidence[kept], centre[kept]
        top[0].reshape((1, 1, rows.shape[0], 7))
        top[0].data[0, 0] = rows
