"""The YOLO ports' detection outputs, as their CPU forwards compute them.

The YOLOv2 port's DetectionOutput (gklz1982/caffe-yolov2):
src/caffe/layers/detection_output_layer.cpp with get_region_box,
class_index_and_score and ApplyNms of include/caffe/util/bbox_util.hpp (the
port has no .cu for it).

The type name and detection_output_param are SSD's as well (FORKS.md);
ssd.DetectionOutput builds this class when the fields are the port's
(is_yolo_flavour). Values are float32, as the port's Dtype, each step in its
order; the port's sigmoid rounds through double (1. / (1. + exp(-x))).

MobileNet-YOLO's YoloDetectionOutput and Yolov3DetectionOutput
(eric612/MobileNet-YOLO@69b4441cb3ec, src/caffe/layers/
yolo_detection_output_layer.cpp and yolov3_detection_output_layer.cpp,
get_region_box of src/caffe/util/bbox_util.cpp): their own type names and
parameter messages; the same float32 steps and double sigmoid, then a sort by
confidence and darknet's NMS on centre boxes (boxes.centre_iou).
"""
import numpy as np

from cct.core.errors import ConfigError, layer_where
from cct.core.layer import Layer, NoBackward, register
from cct.devices.jit import kernel
from cct.layers.boxes import box_sizes, centre_iou, overlaps

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


def region_boxes(x, side, biases):
    """The YOLOv2 ports' region boxes of x (N, C, H, W), C = B * (5 +
    classes), B = len(biases): of each image, cells k = j * side + i (the
    first side * side of the H * W, row-major; i, j < side), each of their B
    boxes, (x, y, w, h) = ((i + sigmoid(tx)) / side, (j + sigmoid(ty)) /
    side, exp(tw) biases[b, 0] / side, exp(th) biases[b, 1] / side) in float32
    (get_region_box); per row, in (image, cell, box) order: centre (K, 4),
    label (K,) and confidence (K,), sigmoid(objectness) x the largest softmax
    class probability."""
    images, channels, height, width = x.shape
    num_box, cells = biases.shape[0], side * side
    pred = x.reshape(images, channels, height * width)[:, :, :cells].astype(_F32)
    pred = pred.transpose(0, 2, 1).reshape(images * cells * num_box, channels // num_box)
    image_cell, box = np.divmod(np.arange(pred.shape[0]), num_box)
    row, col = np.divmod(image_cell % cells, side)
    size = _F32(side)
    centre = np.empty((pred.shape[0], 4), _F32)
    centre[:, 0] = (col.astype(_F32) + sigmoid(pred[:, 0])) / size
    centre[:, 1] = (row.astype(_F32) + sigmoid(pred[:, 1])) / size
    centre[:, 2] = np.exp(pred[:, 2]) * biases[box, 0] / size
    centre[:, 3] = np.exp(pred[:, 3]) * biases[box, 1] / size
    labels, scores = class_scores(pred[:, 5:])
    return centre, labels, sigmoid(pred[:, 4]) * scores


def checked_counts(layer, p, field, names):
    """int(p.<name>) for each of `names`, num_classes first and required,
    each >= 1; errors name the layer's message `field`."""
    if not p.HasField("num_classes"):
        raise layer.config_error(f"{field}.num_classes", "must be given")
    counts = [int(getattr(p, name)) for name in names]
    for name, value in zip(names, counts):
        if value < 1:
            raise layer.config_error(f"{field}.{name}", f"must be >= 1, got {value}")
    return counts


def region_biases(layer, p, field, num_box, reader):
    """The anchors (num_box, 2) of a YOLOv2-style region output, whose
    forward (`reader`'s) reads 4 coordinates and then the objectness."""
    if p.coords != 4:
        raise layer.config_error(f"{field}.coords", f"{reader} forward reads 4 box coordinates (x, y, w, h) and "
                                 f"then the objectness, got {p.coords}")
    if len(p.biases) != 2 * num_box:
        raise layer.config_error(f"{field}.biases", f"needs 2 * num_box = {2 * num_box} values (a width and a "
                                 f"height per box), got {len(p.biases)}")
    return np.asarray(p.biases, _F32).reshape(num_box, 2)


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
    tops_follow_values = True
    type = "DetectionOutput"
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        p, field = self.layer_param.detection_output_param, "detection_output_param"
        self.num_classes, self.side, self.num_box = checked_counts(self, p, field, ("num_classes", "side", "num_box"))
        self.biases = region_biases(self, p, field, self.num_box, "the YOLOv2 port's")
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
        centre, labels, confidence = region_boxes(bottom[0].data, self.side, self.biases)
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


# --- MobileNet-YOLO (eric612/MobileNet-YOLO) ----------------------------------------
@kernel
def _kept_by_darknet_nms(centre, threshold, kept):
    """MobileNet-YOLO's ApplyNms over centre boxes (K, 4), sorted best first:
    writes the rows kept into `kept` and returns their count. The fork's
    box not yet removed removes each later one it overlaps by >= threshold,
    so a box stays unless a kept one overlaps it so (one pair at a time: no
    (K, K) matrix for the thousands of boxes a low threshold lets through)."""
    count = 0
    for row in range(centre.shape[0]):
        keep = True
        for k in range(count):
            a = kept[k]
            if centre_iou(centre[a, 0], centre[a, 1], centre[a, 2], centre[a, 3],
                          centre[row, 0], centre[row, 1], centre[row, 2], centre[row, 3]) >= threshold:
                keep = False
                break
        if keep:
            kept[count] = row
            count += 1
    return count


def darknet_nms(centre, confidence, threshold):
    """Indices MobileNet-YOLO keeps, best first: sorted by descending
    confidence, then its class-blind ApplyNms (darknet's centre-box overlap).
    The sort is stable; the fork's std::sort leaves ties unspecified
    (libstdc++ keeps their order up to 16 boxes)."""
    order = np.argsort(-confidence, kind="stable")
    kept = np.empty(order.size, np.int64)
    count = _kept_by_darknet_nms(np.ascontiguousarray(centre[order], _F32), _F32(threshold), kept)
    return order[kept[:count]]


def darknet_rows(centre, labels, confidence, threshold, images):
    """MobileNet-YOLO's top rows (D, 7) from its candidates: [0, label + 1,
    confidence, x - w / 2, y - h / 2, x + w / 2, y + h / 2] per box NMS keeps,
    best first, every image's as image 0 (the fork's loop pools the batch);
    the corners in double, stored as float, not clipped. With none, a row
    [i, -1, -1, -1, -1, -1, -1] per image."""
    kept = darknet_nms(centre, confidence, threshold) if confidence.size else np.empty(0, np.int64)
    if not kept.size:
        rows = np.full((images, 7), -1, _F32)
        rows[:, 0] = np.arange(images)
        return rows
    x, y, w, h = (centre[kept, k].astype(np.float64) for k in range(4))
    rows = np.zeros((kept.size, 7), _F32)
    rows[:, 1], rows[:, 2] = labels[kept] + 1, confidence[kept]
    rows[:, 3:] = np.stack([x - w / 2.0, y - h / 2.0, x + w / 2.0, y + h / 2.0], axis=1)
    return rows


class _DarknetOutput(NoBackward, Layer):
    """What MobileNet-YOLO's two detection outputs share: (1, 1, 1, 7) before
    forward, then the rows of darknet_rows."""
    exact_tops = 1
    tops_follow_values = True

    def _setup_common(self, p, field):
        """num_classes (required), num_box and the thresholds of `p`, the layer's message `field`."""
        self.num_classes, self.num_box = checked_counts(self, p, field, ("num_classes", "num_box"))
        self.confidence_threshold, self.nms_threshold = _F32(p.confidence_threshold), _F32(p.nms_threshold)

    def _check_bottoms(self, bottom, field):
        """Each bottom (N, C, H, W) with bottom[0]'s N and C = num_box * (4 + 1 + num_classes)."""
        per_box = 4 + 1 + self.num_classes
        for index, blob in enumerate(bottom):
            if len(blob.shape) != 4:
                raise self.shape_error(f"bottom[{index}] must be (N, C, H, W), got {blob.shape}")
            if blob.shape[0] != bottom[0].shape[0]:
                raise self.shape_error(f"bottom[{index}] {blob.shape} must have bottom[0]'s num {bottom[0].shape[0]}")
            if blob.shape[1] != self.num_box * per_box:
                raise self.shape_error(f"bottom[{index}] {blob.shape} must have {field}.num_box * (4 + 1 + "
                                       f"num_classes) = {self.num_box} * {per_box} = {self.num_box * per_box} "
                                       "channels")

    def _write(self, bottom, top, candidates):
        centre, labels, confidence = (np.concatenate(parts) for parts in zip(*candidates))
        rows = darknet_rows(centre, labels, confidence, self.nms_threshold, bottom[0].shape[0])
        top[0].reshape((1, 1, rows.shape[0], 7))
        top[0].data[0, 0] = rows


@register("YoloDetectionOutput")
class MobileNetYoloDetectionOutput(_DarknetOutput):
    """MobileNet-YOLO's YOLOv2 detections (src/caffe/layers/
    yolo_detection_output_layer.cpp, Forward_cpu): region boxes of one or two
    bottoms, sorted by confidence, a class-blind darknet NMS.

    Fields (yolo_detection_output_param): num_classes (required), num_box (5),
    coords (4; the fork reads 4 coordinates whatever it says, so only 4 is
    taken), confidence_threshold (0.01), nms_threshold (0.45), biases (2 *
    num_box anchor sizes in cells). side is not read (the fork takes each
    bottom's width), nor label_map_file (names for its log only).
    Bottoms: 1 or 2 (the fork reads the first two), each (N, C, H, W) with C =
    num_box * (4 + 1 + num_classes) and H >= W (its cells j * W + i, i, j <
    W), the same N and biases: region_boxes with side = W, kept where the
    confidence >= confidence_threshold.
    Top: (1, 1, D, 7), darknet_rows: [0, label + 1, confidence, xmin, ymin,
    xmax, ymax] (corners, not clipped), best first, the batch's images pooled
    as image 0 as the fork does; (1, 1, 1, 7) before forward.
    """
    min_bottoms = 1
    max_bottoms = 2

    def setup(self, bottom, top):
        p = self.layer_param.yolo_detection_output_param
        self._setup_common(p, "yolo_detection_output_param")
        self.biases = region_biases(self, p, "yolo_detection_output_param", self.num_box, "the fork's")

    def reshape(self, bottom, top):
        self._check_bottoms(bottom, "yolo_detection_output_param")
        for index, blob in enumerate(bottom):
            if blob.shape[2] < blob.shape[3]:
                raise self.shape_error(f"bottom[{index}] {blob.shape}: the fork reads a width x width map "
                                       "(its side is the width), so the height must be >= the width")
        top[0].reshape((1, 1, 1, 7))

    def forward(self, bottom, top):
        candidates = []
        for blob in bottom:
            centre, labels, confidence = region_boxes(blob.data, blob.shape[3], self.biases)
            found = confidence >= self.confidence_threshold
            candidates.append((centre[found], labels[found], confidence[found]))
        self._write(bottom, top, candidates)


@register("Yolov3DetectionOutput")
class Yolov3DetectionOutput(_DarknetOutput):
    """MobileNet-YOLO's YOLOv3 detections (src/caffe/layers/
    yolov3_detection_output_layer.cpp, Forward_cpu; the same arithmetic as
    eric612/Caffe-YOLOv3-Windows'): boxes of every bottom, one candidate per
    class scoring above the threshold, sorted by confidence, a class-blind
    darknet NMS.

    Fields (yolov3_detection_output_param): num_classes (required), num_box
    (3: boxes per cell), confidence_threshold (0.01), nms_threshold (0.45),
    biases (anchor width, height pairs in input pixels), anchors_scale (per
    bottom, >= 1: the input's size over the bottom's), mask_group_num (2: the
    number of bottoms), mask (anchor indices: bottom t's box n takes anchor
    mask[t * (len(mask) // mask_group_num) + n]). gaussian_box is refused:
    the fork's CPU forward reads that box's objectness from a buffer it never
    writes (and its GPU forward subtracts one uncertainty twice).
    Bottoms: mask_group_num of them, each (N, C, H, W), C = num_box * (4 + 1
    + num_classes), the same N. Per image, cell (j, i) of H x W, box n, its
    anchor a, class c: x = (i + sigmoid(tx)) / W, y = (j + sigmoid(ty)) / H,
    w = exp(tw) biases[2a] / (W * scale), h = exp(th) biases[2a + 1] / (H *
    scale); score sigmoid(class c) x sigmoid(objectness), a candidate where
    > confidence_threshold (its correct_yolo_boxes is the identity: the
    input is the map times an integer scale). Candidates in bottom, image,
    cell, box, class order.
    Top: (1, 1, D, 7), darknet_rows: [0, label + 1, score, xmin, ymin, xmax,
    ymax] (corners, not clipped), best first, the batch's images pooled as
    image 0 as the fork does; (1, 1, 1, 7) before forward.
    """
    min_bottoms = 1

    def setup(self, bottom, top):
        p = self.layer_param.yolov3_detection_output_param
        self._setup_common(p, "yolov3_detection_output_param")
        if p.gaussian_box:
            raise self.config_error("yolov3_detection_output_param.gaussian_box", "not supported: the fork's CPU "
                                    "forward reads the Gaussian box's objectness from a buffer it never writes")
        self._check_groups(p, len(bottom))
        self.scales = [int(scale) for scale in p.anchors_scale[:len(bottom)]]
        self.anchors = self._anchors(p, len(bottom))
        self.biases = np.asarray(p.biases, _F32)

    def _check_groups(self, p, bottoms):
        if p.mask_group_num != bottoms:
            raise self.config_error("yolov3_detection_output_param.mask_group_num", f"{p.mask_group_num}: the "
                                    f"fork takes one bottom per mask group, got {bottoms} bottoms")
        if len(p.anchors_scale) < bottoms:
            raise self.config_error("yolov3_detection_output_param.anchors_scale", f"needs a value per bottom "
                                    f"({bottoms}), got {len(p.anchors_scale)}")
        if min(p.anchors_scale[:bottoms]) < 1:
            raise self.config_error("yolov3_detection_output_param.anchors_scale",
                                    f"must be >= 1, got {list(p.anchors_scale)}")

    def _anchors(self, p, bottoms):
        """(bottoms, num_box) anchor indices: mask[t * (len(mask) // bottoms) + n]."""
        per_group = len(p.mask) // bottoms
        need = (bottoms - 1) * per_group + self.num_box
        if len(p.mask) < need:
            raise self.config_error("yolov3_detection_output_param.mask", f"bottom t's box n takes anchor "
                                    f"mask[t * (len(mask) // mask_group_num) + n]: {bottoms} bottoms of num_box "
                                    f"{self.num_box} need {need} values, got {len(p.mask)}")
        anchors = np.array([[p.mask[t * per_group + n] for n in range(self.num_box)] for t in range(bottoms)])
        if 2 * int(anchors.max()) + 1 >= len(p.biases):
            raise self.config_error("yolov3_detection_output_param.biases", f"mask names anchor {anchors.max()}, "
                                    f"which needs {2 * int(anchors.max()) + 2} values (a width and a height per "
                                    f"anchor), got {len(p.biases)}")
        return anchors

    def reshape(self, bottom, top):
        self._check_bottoms(bottom, "yolov3_detection_output_param")
        top[0].reshape((1, 1, 1, 7))

    def forward(self, bottom, top):
        self._write(bottom, top, [self._candidates(blob.data, t) for t, blob in enumerate(bottom)])

    def _candidates(self, x, t):
        """Bottom t's candidates, in (image, cell, box, class) order: centre
        (K, 4), label (K,), score (K,)."""
        images, _, height, width = x.shape
        cells = height * width
        pred = x.astype(_F32).reshape(images, self.num_box, 4 + 1 + self.num_classes, cells)
        scores = sigmoid(pred[:, :, 5:]) * sigmoid(pred[:, :, 4])[:, :, None]     # (N, B, classes, S)
        found = np.flatnonzero(scores.transpose(0, 3, 1, 2) > self.confidence_threshold)
        image_cell_box, labels = np.divmod(found, self.num_classes)
        image_cell, box = np.divmod(image_cell_box, self.num_box)
        image, cell = np.divmod(image_cell, cells)
        row, col = np.divmod(cell, width)
        values = pred[image, box, :4, cell]                                          # (K, 4)
        anchor = self.anchors[t][box]
        centre = np.empty((found.size, 4), _F32)
        centre[:, 0] = (col.astype(_F32) + sigmoid(values[:, 0])) / _F32(width)
        centre[:, 1] = (row.astype(_F32) + sigmoid(values[:, 1])) / _F32(height)
        centre[:, 2] = np.exp(values[:, 2]) * self.biases[2 * anchor] / _F32(width * self.scales[t])
        centre[:, 3] = np.exp(values[:, 3]) * self.biases[2 * anchor + 1] / _F32(height * self.scales[t])
        return centre, labels, scores[image, box, labels, cell]
