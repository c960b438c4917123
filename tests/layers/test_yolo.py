"""The YOLOv2 port's DetectionOutput (layers/yolo.py) against a plain
transcription of the port's C++ loops (gklz1982/caffe-yolov2@ebb27029db4d,
src/caffe/layers/detection_output_layer.cpp Forward_cpu and
include/caffe/util/bbox_util.hpp), and the choice between it and SSD's."""
import math

import numpy as np
import pytest
from google.protobuf import text_format

import cct
from cct.core.errors import ConfigError, ShapeError
from cct.layers.ssd import DetectionOutput
from cct.layers.yolo import YoloDetectionOutput
from cct.proto import caffe_pb2
from cct.testing.gradient_check import make_layer
from helpers.layers import run_layer

F32 = np.float32


# --- the port's loops, one value at a time, float32 as its Dtype ---------------------
def ref_sigmoid(x):
    return F32(1.0 / (1.0 + math.exp(-float(x))))


def ref_class_index_and_score(values):
    values = [F32(v) for v in values]
    large = values[0]
    for v in values:
        if v > large:
            large = v
    total = F32(0)
    for i, v in enumerate(values):
        values[i] = F32(np.exp(F32(v - large)))
        total = F32(total + values[i])
    values = [F32(v / total) for v in values]
    large, index = values[0], 0
    for i, v in enumerate(values):
        if v > large:
            large, index = v, i
    return index, large


def ref_normalized_bbox(x, y, w, h):
    """setNormalizedBBox: corners in double, stored as float, clipped; its size."""
    xmin, xmax = F32(float(x) - float(w) / 2.0), F32(float(x) + float(w) / 2.0)
    ymin, ymax = F32(float(y) - float(h) / 2.0), F32(float(y) + float(h) / 2.0)
    xmin, xmax = max(xmin, F32(0)), min(xmax, F32(1))
    ymin, ymax = max(ymin, F32(0)), min(ymax, F32(1))
    size = F32(0) if xmax < xmin or ymax < ymin else F32(F32(xmax - xmin) * F32(ymax - ymin))
    return (xmin, ymin, xmax, ymax), size


def ref_jaccard(a, b):
    (a0, a1, a2, a3), size_a = a
    (b0, b1, b2, b3), size_b = b
    if b0 > a2 or b2 < a0 or b1 > a3 or b3 < a1:
        inter = (F32(0),) * 4
    else:
        inter = (max(a0, b0), max(a1, b1), min(a2, b2), min(a3, b3))
    width, height = F32(inter[2] - inter[0]), F32(inter[3] - inter[1])
    if width > 0 and height > 0:
        size = F32(width * height)
        return F32(size / F32(F32(size_a + size_b) - size))
    return F32(0)


def ref_apply_nms(boxes, threshold):
    removed = set()
    for i in range(len(boxes) - 1):
        if i in removed:
            continue
        for j in range(i + 1, len(boxes)):
            if j in removed:
                continue
            if ref_jaccard(ref_normalized_bbox(*boxes[i][:4]), ref_normalized_bbox(*boxes[j][:4])) >= threshold:
                removed.add(j)
    return [i for i in range(len(boxes)) if i not in removed]


def ref_yolo_detection_output(bottom, side, num_classes, num_box, biases, confidence_threshold, nms_threshold):
    """Forward_cpu for one image (1, C, H, W): its top (1, 1, D, 7)."""
    _, channels, height, width = bottom.shape
    per_box = channels // num_box
    swap = []                                   # swap[h * W + w][n][k], the port's loop order
    for h in range(height):
        for w in range(width):
            cell = [F32(bottom[0, c, h, w]) for c in range(channels)]
            swap.append([cell[n * per_box:(n + 1) * per_box] for n in range(num_box)])
    predicts = []                               # (x, y, w, h, label, confidence)
    for j in range(side):
        for i in range(side):
            for n in range(num_box):
                v = swap[j * side + i][n]
                x = F32(F32(i + ref_sigmoid(v[0])) / F32(side))
                y = F32(F32(j + ref_sigmoid(v[1])) / F32(side))
                w = F32(F32(F32(np.exp(v[2])) * F32(biases[2 * n])) / F32(side))
                h = F32(F32(F32(np.exp(v[3])) * F32(biases[2 * n + 1])) / F32(side))
                label, score = ref_class_index_and_score(v[5:5 + num_classes])
                confidence = F32(ref_sigmoid(v[4]) * score)
                if confidence >= F32(confidence_threshold):
                    predicts.append((x, y, w, h, label, confidence))
    kept = ref_apply_nms(predicts, F32(nms_threshold)) if predicts else []
    if not kept:
        return np.array([[[[0, -1, -1, -1, -1, -1, -1]]]], F32)
    rows = [[0, predicts[k][4], predicts[k][5], *predicts[k][:4]] for k in kept]
    return np.array(rows, F32).reshape(1, 1, len(rows), 7)


def yolo_text(side, num_classes, num_box, biases, threshold=None, nms=None, extra=""):
    fields = f"num_classes: {num_classes} side: {side} num_box: {num_box} coords: 4 "
    fields += " ".join(f"biases: {b}" for b in biases)
    if threshold is not None:
        fields += f" confidence_threshold: {threshold}"
    if nms is not None:
        fields += f" nms_threshold: {nms}"
    return f'name: "det" type: "DetectionOutput" detection_output_param {{ {fields} {extra} }}'


BIASES = [0.74, 0.87, 2.42, 2.66, 4.31, 7.04, 1.5, 0.6]


def yolo_bottom(seed, side, num_classes, num_box):
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1.5, (1, num_box * (5 + num_classes), side, side)).astype(F32)
    return x


# (side, classes, boxes, confidence_threshold, nms_threshold)
CASES = [(3, 3, 2, 0.2, 0.3), (4, 5, 3, 0.1, 0.45), (2, 1, 4, 0.3, 0.2), (5, 4, 4, None, None)]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_yolo_detection_output_against_the_ports_loops(case, seed):
    """Several maps (one image each, the port's batch), classes and anchors;
    boxes below the threshold, and overlapping ones NMS removes."""
    side, classes, boxes, threshold, nms = CASES[case]
    biases = BIASES[:2 * boxes]
    bottom = yolo_bottom(10 * case + seed, side, classes, boxes)
    layer, _, tops = run_layer(yolo_text(side, classes, boxes, biases, threshold, nms), [bottom])
    assert isinstance(layer, YoloDetectionOutput)
    want = ref_yolo_detection_output(bottom, side, classes, boxes, biases,
                                     0.01 if threshold is None else threshold, 0.45 if nms is None else nms)
    got = tops[0].data
    assert got.shape == want.shape
    np.testing.assert_array_equal(got[..., :2], want[..., :2])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_the_cases_reach_the_threshold_and_nms():
    """The random maps above do have boxes below the threshold and boxes NMS removes."""
    below = removed = 0
    for case, (side, classes, boxes, threshold, nms) in enumerate(CASES):
        for seed in range(3):
            bottom = yolo_bottom(10 * case + seed, side, classes, boxes)
            everything = ref_yolo_detection_output(bottom, side, classes, boxes, BIASES[:2 * boxes], -1.0, 2.0)
            found = everything[0, 0, :, 2] >= (0.01 if threshold is None else threshold)
            kept = ref_yolo_detection_output(bottom, side, classes, boxes, BIASES[:2 * boxes],
                                             0.01 if threshold is None else threshold, 0.45 if nms is None else nms)
            below += int((~found).sum())
            removed += int(found.sum()) - kept.shape[2]
    assert below > 10 and removed > 10


def test_yolo_detection_output_known_values():
    """All-zero predictions: every box at its cell's centre, the anchor's size,
    objectness 0.5, classes tied (the first wins), confidence 0.5 / classes;
    the 2 x 2 cells' 0.25-wide boxes do not overlap; the second anchor's
    (as wide as the image, clipped) each hold their cell's small box, overlap
    1/9 >= 0.1, and go."""
    bottom = np.zeros((1, 2 * (5 + 3), 2, 2), F32)
    _, _, tops = run_layer(yolo_text(2, 3, 2, [0.5, 0.5, 2, 2], 0.1, 0.1), [bottom])
    want = [[0, 0, 0.5 / 3, x, y, 0.25, 0.25] for y in (0.25, 0.75) for x in (0.25, 0.75)]
    np.testing.assert_allclose(tops[0].data, np.array(want, F32).reshape(1, 1, 4, 7), rtol=1e-6)


def test_yolo_detection_output_nothing_found():
    bottom = yolo_bottom(5, 3, 2, 2)
    _, _, tops = run_layer(yolo_text(3, 2, 2, BIASES[:4], threshold=1.5), [bottom])
    np.testing.assert_array_equal(tops[0].data, [[[[0, -1, -1, -1, -1, -1, -1]]]])


def test_yolo_detection_output_in_a_net():
    """A net that ends in the port's DetectionOutput runs (it was refused)."""
    text = ('name: "yolo" input: "data" input_shape { dim: 1 dim: 3 dim: 6 dim: 6 }\n'
            'layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" convolution_param { '
            'num_output: 14 kernel_size: 3 stride: 2 pad: 1 weight_filler { type: "gaussian" std: 0.5 } } }\n'
            'layer { name: "det" type: "DetectionOutput" bottom: "conv" top: "det" detection_output_param { '
            'num_classes: 2 side: 3 num_box: 2 biases: 0.74 biases: 0.87 biases: 2.42 biases: 2.66 '
            'confidence_threshold: 0.05 } }\n')
    net = cct.Net(text_format.Parse(text, caffe_pb2.NetParameter()), cct.TEST)
    net.blobs["data"].data[...] = np.random.default_rng(3).normal(size=(1, 3, 6, 6))
    det = net.forward()["det"]
    want = ref_yolo_detection_output(net.blobs["conv"].data.astype(F32), 3, 2, 2, BIASES[:4], 0.05, 0.45)
    np.testing.assert_allclose(det, want, rtol=1e-6, atol=1e-7)


def test_the_ssd_flavour_is_chosen_by_its_fields():
    ssd = make_layer('type: "DetectionOutput" detection_output_param { num_classes: 2 confidence_threshold: 0.5 '
                     'nms_param { nms_threshold: 0.4 } }')
    assert type(ssd) is DetectionOutput
    plain = make_layer('type: "DetectionOutput" detection_output_param { num_classes: 2 }')
    assert type(plain) is DetectionOutput


def test_yolo_detection_output_errors():
    with pytest.raises(ConfigError, match=r"layer 'det' \(DetectionOutput\): detection_output_param.keep_top_k: "
                                          r"SSD's field, but detection_output_param.side is the YOLOv2 port's"):
        make_layer(yolo_text(3, 2, 2, BIASES[:4], extra="keep_top_k: 5"))
    with pytest.raises(ConfigError, match=r"'det' \(DetectionOutput\): detection_output_param.biases: needs "
                                          r"2 \* num_box = 4 values .*got 3"):
        run_layer(yolo_text(3, 2, 2, BIASES[:3]), [yolo_bottom(0, 3, 2, 2)])
    with pytest.raises(ShapeError, match=r"'det' \(DetectionOutput\): bottom\[0\] \(1, 18, 3, 3\) must have "
                                         r"detection_output_param.num_box \* \(coords \+ 1 \+ num_classes\) = "
                                         r"2 \* 8 = 16 channels"):
        run_layer(yolo_text(3, 3, 2, BIASES[:4]), [yolo_bottom(0, 3, 4, 2)])
    with pytest.raises(ConfigError, match=r"'det' \(DetectionOutput\): detection_output_param.num_classes: "
                                          "must be given"):
        run_layer('name: "det" type: "DetectionOutput" detection_output_param { side: 3 num_box: 1 '
                  'biases: 1 biases: 1 }', [yolo_bottom(0, 3, 20, 1)])
    with pytest.raises(ConfigError, match=r"detection_output_param.coords: .*got 5"):
        run_layer(yolo_text(3, 2, 2, BIASES[:4]).replace("coords: 4", "coords: 5"), [yolo_bottom(0, 3, 2, 2)])
    with pytest.raises(ShapeError, match=r"'det' \(DetectionOutput\): bottom\[0\] \(2, 14, 3, 3\).*one image"):
        run_layer(yolo_text(3, 2, 2, BIASES[:4]), [np.concatenate([yolo_bottom(0, 3, 2, 2)] * 2)])
    with pytest.raises(ShapeError, match=r"detection_output_param.side 4: .*3 x 3 map"):
        run_layer(yolo_text(4, 2, 2, BIASES[:4]), [yolo_bottom(0, 3, 2, 2)])
    with pytest.raises(NotImplementedError, match="no backward"):
        layer, bottoms, tops = run_layer(yolo_text(3, 2, 2, BIASES[:4]), [yolo_bottom(0, 3, 2, 2)])
        layer.backward(tops, [True], bottoms)


def test_cct_dnn_gives_the_yolo_flavours_own_top(tmp_path):
    """cct.dnn reformats SSD's DetectionOutput as OpenCV does; OpenCV has no
    YOLO flavour, so that one's top comes as the layer wrote it."""
    import cct.dnn
    path = tmp_path / "yolo.prototxt"
    path.write_text('input: "data" input_shape { dim: 1 dim: 14 dim: 3 dim: 3 }\n'
                    'layer { name: "det" type: "DetectionOutput" bottom: "data" top: "det" detection_output_param { '
                    'num_classes: 2 side: 3 num_box: 2 biases: 0.74 biases: 0.87 biases: 2.42 biases: 2.66 } }\n')
    net = cct.dnn.readNetFromCaffe(str(path))
    bottom = yolo_bottom(4, 3, 2, 2)
    net.setInput(bottom)
    np.testing.assert_allclose(net.forward(), ref_yolo_detection_output(bottom, 3, 2, 2, BIASES[:4], 0.01, 0.45),
                               rtol=1e-6, atol=1e-7)
