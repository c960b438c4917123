"""The YOLO ports' detection outputs (layers/yolo.py) against plain
transcriptions of their C++ loops: the YOLOv2 port's DetectionOutput
(gklz1982/caffe-yolov2@ebb27029db4d, src/caffe/layers/detection_output_layer.cpp
Forward_cpu and include/caffe/util/bbox_util.hpp) and the choice between it
and SSD's; MobileNet-YOLO's Yolov3DetectionOutput and YoloDetectionOutput
(eric612/MobileNet-YOLO@69b4441cb3ec), which OpenCV 4.14 cannot create ("Can't
create layer"), so the fork's loops are the reference, also under a small
MobileNet-YOLO-shaped net."""
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


def ref_port_iou(a, b):
    return ref_jaccard(ref_normalized_bbox(*a[:4]), ref_normalized_bbox(*b[:4]))


def ref_apply_nms(boxes, threshold, iou=ref_port_iou):
    """ApplyNms (the YOLOv2 port's; MobileNet-YOLO's with darknet's iou)."""
    removed = set()
    for i in range(len(boxes) - 1):
        if i in removed:
            continue
        for j in range(i + 1, len(boxes)):
            if j not in removed and iou(boxes[i], boxes[j]) >= threshold:
                removed.add(j)
    return [i for i in range(len(boxes)) if i not in removed]


def ref_region_box(v, i, j, n, side, biases, num_classes):
    """get_region_box, class_index_and_score and the confidence of one box's
    values v (both YOLOv2 ports): (x, y, w, h, label, confidence)."""
    x = F32(F32(i + ref_sigmoid(v[0])) / F32(side))
    y = F32(F32(j + ref_sigmoid(v[1])) / F32(side))
    w = F32(F32(F32(np.exp(v[2])) * F32(biases[2 * n])) / F32(side))
    h = F32(F32(F32(np.exp(v[3])) * F32(biases[2 * n + 1])) / F32(side))
    label, score = ref_class_index_and_score(v[5:5 + num_classes])
    return x, y, w, h, label, F32(ref_sigmoid(v[4]) * score)


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
                predict = ref_region_box(swap[j * side + i][n], i, j, n, side, biases, num_classes)
                if predict[5] >= F32(confidence_threshold):
                    predicts.append(predict)
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


def assert_same_rows(got, want):
    """The same detections: images and labels exactly, the rest within float32 rounding."""
    assert got.shape == want.shape
    np.testing.assert_array_equal(got[..., :2], want[..., :2])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


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
    assert_same_rows(tops[0].data, want)


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


# --- MobileNet-YOLO (eric612/MobileNet-YOLO@69b4441cb3ec): its loops, one value at a time --
# src/caffe/layers/yolov3_detection_output_layer.cpp and yolo_detection_output_layer.cpp
# (Forward_cpu, overlap, box_intersection, box_union, box_iou, ApplyNms (ref_apply_nms),
# correct_yolo_boxes), src/caffe/util/bbox_util.cpp (get_region_box).
def ref_darknet_iou(a, b):
    def overlap(x1, w1, x2, w2):
        l1, l2 = F32(x1 - F32(w1 / F32(2))), F32(x2 - F32(w2 / F32(2)))
        left = l1 if l1 > l2 else l2
        r1, r2 = F32(x1 + F32(w1 / F32(2))), F32(x2 + F32(w2 / F32(2)))
        right = r1 if r1 < r2 else r2
        return F32(right - left)
    w, h = overlap(a[0], a[2], b[0], b[2]), overlap(a[1], a[3], b[1], b[3])
    inter = F32(0) if w < 0 or h < 0 else F32(w * h)
    union = F32(F32(F32(a[2] * a[3]) + F32(b[2] * b[3])) - inter)
    with np.errstate(divide="ignore", invalid="ignore"):
        return F32(inter / union)


def ref_darknet_top(predicts, nms_threshold, fake_rows, images):
    """The forward's end: std::sort by descending confidence (the tests' data
    have no ties, whose order std::sort leaves open), ApplyNms, the rows; with
    none kept, `fake_rows` rows of -1, the first `images` numbered."""
    confidences = [p[5] for p in predicts]
    assert len(set(confidences)) == len(confidences), "tied confidences: the fork's order is unspecified"
    predicts = sorted(predicts, key=lambda p: -p[5])
    kept = ref_apply_nms(predicts, F32(nms_threshold), ref_darknet_iou) if predicts else []
    if not kept:
        rows = np.full((fake_rows, 7), -1, F32)
        rows[:images, 0] = np.arange(images)
        return rows.reshape(1, 1, fake_rows, 7)
    rows = []
    for k in kept:
        x, y, w, h, label, confidence = predicts[k]
        rows.append([0, label + 1, confidence, F32(float(x) - float(w) / 2.), F32(float(y) - float(h) / 2.),
                     F32(float(x) + float(w) / 2.), F32(float(y) + float(h) / 2.)])
    return np.array(rows, F32).reshape(1, 1, len(rows), 7)


def ref_correct_yolo_boxes(x, y, w, h, side_w, side_h, netw, neth):
    """correct_yolo_boxes(det, side_w, side_h, netw, neth, relative = 1)."""
    if F32(netw) / F32(side_w) < F32(neth) / F32(side_h):
        new_w, new_h = netw, (side_h * netw) // side_w
    else:
        new_w, new_h = (side_w * neth) // side_h, neth
    x = F32((float(x) - (netw - new_w) / 2. / netw) / float(F32(F32(new_w) / F32(netw))))
    y = F32((float(y) - (neth - new_h) / 2. / neth) / float(F32(F32(new_h) / F32(neth))))
    return x, y, F32(w * F32(F32(netw) / F32(new_w))), F32(h * F32(F32(neth) / F32(new_h)))


def ref_yolov3_detection_output(bottoms, num_classes, num_box, biases, anchors_scale, mask_group_num, mask,
                                confidence_threshold=0.01, nms_threshold=0.45):
    """Yolov3DetectionOutput's Forward_cpu (gaussian_box false)."""
    predicts = ref_yolov3_predicts(bottoms, num_classes, num_box, biases, anchors_scale, mask_group_num, mask,
                                   confidence_threshold)
    return ref_darknet_top(predicts, nms_threshold, bottoms[-1].shape[0], bottoms[0].shape[0])


def ref_yolov3_predicts(bottoms, num_classes, num_box, biases, anchors_scale, mask_group_num, mask,
                        confidence_threshold):
    """Its loop over the bottoms: the candidates, (x, y, w, h, class, score) each."""
    length, groups_num, mask_offset, predicts = 4 + num_classes + 1, len(mask) // mask_group_num, 0, []
    for t, bottom in enumerate(bottoms):
        num, channels, side_h, side_w = bottom.shape
        stride, flat = side_w * side_h, bottom.astype(F32).ravel()
        nw, nh = int(side_w * F32(anchors_scale[t])), int(side_h * F32(anchors_scale[t]))
        for b in range(num):
            for s in range(stride):
                for n in range(num_box):
                    index = n * length * stride + s + b * channels * stride
                    swap, class_score = {}, [F32(0)] * num_classes
                    for c in range(length):
                        value = flat[c * stride + index]
                        if c in (2, 3):
                            swap[c] = value
                        elif c > 4:
                            class_score[c - 5] = ref_sigmoid(value)
                        else:
                            swap[c] = ref_sigmoid(value)
                    y2, x2 = divmod(s, side_w)
                    for c in range(num_classes):
                        class_score[c] = F32(class_score[c] * swap[4])
                        if class_score[c] > F32(confidence_threshold):
                            m = mask[n + mask_offset]
                            x = F32(F32(x2 + swap[0]) / F32(side_w))
                            y = F32(F32(y2 + swap[1]) / F32(side_h))
                            w = F32(F32(F32(np.exp(swap[2])) * F32(biases[2 * m])) / F32(nw))
                            h = F32(F32(F32(np.exp(swap[3])) * F32(biases[2 * m + 1])) / F32(nh))
                            x, y, w, h = ref_correct_yolo_boxes(x, y, w, h, side_w, side_h, nw, nh)
                            predicts.append((x, y, w, h, c, class_score[c]))
        mask_offset += groups_num
    return predicts


def ref_mobilenet_yolo_detection_output(bottoms, num_classes, num_box, biases, confidence_threshold=0.01,
                                        nms_threshold=0.45):
    """YoloDetectionOutput's Forward_cpu: bottom[0], then bottom[1] if there is one."""
    predicts = []
    for bottom in bottoms[:2]:
        num, channels, height, width = bottom.shape
        side, per_box = width, channels // num_box
        swap = [F32(bottom[b, c, h, w]) for b in range(num) for h in range(height) for w in range(width)
                for c in range(channels)]                    # swap (num, H * W, num_box, C / num_box)
        for b in range(num):
            for j in range(side):
                for i in range(side):
                    for n in range(num_box):
                        index = b * height * width * channels + (j * side + i) * channels + n * per_box
                        predict = ref_region_box(swap[index:index + per_box], i, j, n, side, biases, num_classes)
                        if predict[5] >= F32(confidence_threshold):
                            predicts.append(predict)
    return ref_darknet_top(predicts, nms_threshold, bottoms[0].shape[0], bottoms[0].shape[0])


def yolov3_text(num_classes, num_box, biases, anchors_scale, mask, groups=None, threshold=None, nms=None,
                extra=""):
    fields = [f"num_classes: {num_classes}", f"num_box: {num_box}"]
    fields += [f"biases: {b}" for b in biases] + [f"anchors_scale: {s}" for s in anchors_scale]
    fields += [f"mask: {m}" for m in mask]
    for name, value in (("mask_group_num", groups), ("confidence_threshold", threshold), ("nms_threshold", nms)):
        if value is not None:
            fields.append(f"{name}: {value}")
    return (f'name: "det" type: "Yolov3DetectionOutput" yolov3_detection_output_param {{ {" ".join(fields)} '
            f'{extra} }}')


V3_BIASES = [10, 14, 23, 27, 37, 58, 81, 82, 135, 169, 344, 319]
# (bottom shapes (N, H, W), classes, num_box, anchors_scale, mask, mask_group_num (None: 2),
#  confidence_threshold, nms_threshold; None: the defaults)
V3_CASES = [
    ([(1, 3, 3), (1, 6, 6)], 3, 3, [32, 16], [3, 4, 5, 0, 1, 2], None, 0.3, 0.45),
    ([(2, 2, 3), (2, 4, 6)], 2, 2, [16, 8], [4, 5, 1, 2], None, 0.2, 0.3),          # batch 2, not square
    ([(1, 2, 2), (1, 4, 4), (1, 8, 8)], 1, 2, [32, 16, 8], [4, 5, 2, 3, 0, 1], 3, 0.4, 0.5),
    ([(1, 3, 3), (1, 6, 6)], 4, 2, [32, 16], [3, 4, 5, 0, 1, 2], None, None, None),  # 2 of 3 anchors a group
    ([(3, 4, 5)], 3, 3, [8], [0, 2, 4], 1, 0.25, 0.2),
]


def v3_case(case, seed):
    shapes, classes, num_box, scales, mask, groups, threshold, nms = V3_CASES[case]
    rng = np.random.default_rng(100 * case + seed)
    bottoms = [rng.normal(0, 1.5, (n, num_box * (5 + classes), h, w)).astype(F32) for n, h, w in shapes]
    text = yolov3_text(classes, num_box, V3_BIASES, scales, mask, groups, threshold, nms)
    reference = dict(num_classes=classes, num_box=num_box, biases=V3_BIASES, anchors_scale=scales,
                     mask_group_num=groups or 2, mask=mask)
    thresholds = dict(confidence_threshold=0.01 if threshold is None else threshold,
                      nms_threshold=0.45 if nms is None else nms)
    return bottoms, text, reference, thresholds


@pytest.mark.parametrize("case", range(len(V3_CASES)))
@pytest.mark.parametrize("seed", [0, 1])
def test_yolov3_detection_output_against_the_forks_loops(case, seed):
    """One to three bottoms, batches of 1 to 3, square and oblong maps, masks
    that give each bottom its anchors (all or the first num_box of a group),
    thresholds that leave boxes out and NMS that removes some."""
    bottoms, text, reference, thresholds = v3_case(case, seed)
    layer, _, tops = run_layer(text, bottoms)
    assert type(layer).__name__ == "Yolov3DetectionOutput"
    want = ref_yolov3_detection_output(bottoms, **reference, **thresholds)
    assert_same_rows(tops[0].data, want)


def test_the_yolov3_cases_reach_the_threshold_and_nms():
    below = removed = 0
    for case in range(len(V3_CASES)):
        for seed in range(2):
            bottoms, _, reference, thresholds = v3_case(case, seed)
            everything = len(ref_yolov3_predicts(bottoms, **reference, confidence_threshold=0.0))
            found = len(ref_yolov3_predicts(bottoms, **reference,
                                            confidence_threshold=thresholds["confidence_threshold"]))
            kept = ref_yolov3_detection_output(bottoms, **reference, **thresholds).shape[2]
            below += everything - found
            removed += found - kept
    assert below > 50 and removed > 50


def test_yolov3_detection_output_known_values():
    """All-zero predictions on a 2 x 2 map, input 8 x 8 (scale 4): every box
    at its cell's centre, score 0.5 x 0.5; anchor 0 (2 x 2 pixels) is a
    quarter-wide box, anchor 1 (16 x 16) twice the image. Ties keep the push
    order (8 candidates; libstdc++'s std::sort is an insertion sort below
    17). The first large box stays (IoU 1/64 with the small one), the others
    overlap it by 0.6 or 2.25/5.75 >= 0.3 and go."""
    bottom = np.zeros((1, 2 * (5 + 1), 2, 2), F32)
    _, _, tops = run_layer(yolov3_text(1, 2, [2, 2, 16, 16], [4], [0, 1], 1, 0.2, 0.3), [bottom])
    small = [[0, 1, 0.25, x - 0.125, y - 0.125, x + 0.125, y + 0.125] for y in (0.25, 0.75) for x in (0.25, 0.75)]
    want = [small[0], [0, 1, 0.25, -0.75, -0.75, 1.25, 1.25]] + small[1:]
    np.testing.assert_array_equal(tops[0].data, np.array(want, F32).reshape(1, 1, 5, 7))


def test_yolov3_detection_output_nothing_found():
    """A row [i, -1, ...] per image of the batch."""
    bottoms, text, _, _ = v3_case(1, 0)
    _, _, tops = run_layer(text.replace("confidence_threshold: 0.2", "confidence_threshold: 1.0"), bottoms)
    want = np.full((1, 1, 2, 7), -1, F32)
    want[0, 0, :, 0] = [0, 1]
    np.testing.assert_array_equal(tops[0].data, want)


MN_CASES = [([(1, 3, 3)], 3, 2, 0.2, 0.3), ([(1, 4, 4), (1, 2, 2)], 2, 3, 0.1, 0.45),
            ([(2, 3, 3)], 4, 2, None, None), ([(1, 5, 3), (1, 4, 4)], 1, 4, 0.3, 0.2)]   # H > W reads W rows


def mn_text(classes, num_box, biases, threshold=None, nms=None, extra=""):
    fields = [f"num_classes: {classes}", f"num_box: {num_box}", "coords: 4"] + [f"biases: {b}" for b in biases]
    fields += [f"confidence_threshold: {threshold}"] * (threshold is not None) + [f"nms_threshold: {nms}"] * (
        nms is not None)
    return f'name: "det" type: "YoloDetectionOutput" yolo_detection_output_param {{ {" ".join(fields)} {extra} }}'


@pytest.mark.parametrize("case", range(len(MN_CASES)))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mobilenet_yolo_detection_output_against_the_forks_loops(case, seed):
    """MobileNet-YOLO's YoloDetectionOutput: one or two bottoms (the same
    anchors), batch 2, a map taller than wide (the fork reads W x W cells)."""
    shapes, classes, num_box, threshold, nms = MN_CASES[case]
    rng = np.random.default_rng(10 * case + seed)
    bottoms = [rng.normal(0, 1.5, (n, num_box * (5 + classes), h, w)).astype(F32) for n, h, w in shapes]
    layer, _, tops = run_layer(mn_text(classes, num_box, BIASES[:2 * num_box], threshold, nms), bottoms)
    assert type(layer).__name__ == "MobileNetYoloDetectionOutput"
    want = ref_mobilenet_yolo_detection_output(bottoms, classes, num_box, BIASES[:2 * num_box],
                                               0.01 if threshold is None else threshold,
                                               0.45 if nms is None else nms)
    assert_same_rows(tops[0].data, want)


def test_mobilenet_yolo_detection_output_nothing_found():
    bottom = yolo_bottom(5, 3, 2, 2)
    _, _, tops = run_layer(mn_text(2, 2, BIASES[:4], threshold=1.5), [np.concatenate([bottom] * 3)])
    np.testing.assert_array_equal(tops[0].data[0, 0, :, 0], [0, 1, 2])
    np.testing.assert_array_equal(tops[0].data[0, 0, :, 1:], -1)


def test_yolov3_detection_output_errors():
    bottoms, _, _, _ = v3_case(0, 0)
    v3 = dict(num_classes=3, num_box=3, biases=V3_BIASES, anchors_scale=[32, 16], mask=[3, 4, 5, 0, 1, 2])
    where = r"layer 'det' \(Yolov3DetectionOutput\): yolov3_detection_output_param"
    cases = [
        (dict(v3, groups=3), where + r".mask_group_num: 3: the fork takes one bottom per mask group, got 2 bottoms"),
        (dict(v3, anchors_scale=[32]), where + r".anchors_scale: needs a value per bottom \(2\), got 1"),
        (dict(v3, anchors_scale=[32, 0]), where + r".anchors_scale: must be >= 1, got \[32, 0\]"),
        (dict(v3, mask=[3, 4, 5, 0]), where + r".mask: bottom t's box n takes anchor mask\[t \* \(len\(mask\) "
                                      r"// mask_group_num\) \+ n\]: 2 bottoms of num_box 3 need 5 values, got 4"),
        (dict(v3, mask=[3, 4, 6, 0, 1, 2]), where + r".biases: mask names anchor 6, which needs 14 values .*got 12"),
        (dict(v3, extra="gaussian_box: true"), where + r".gaussian_box: not supported"),
        (dict(v3, num_box=0), where + r".num_box: must be >= 1, got 0"),
    ]
    for fields, message in cases:
        with pytest.raises(ConfigError, match=message):
            run_layer(yolov3_text(**fields), bottoms)
    with pytest.raises(ConfigError, match=where + ".num_classes: must be given"):
        run_layer('name: "det" type: "Yolov3DetectionOutput" yolov3_detection_output_param { anchors_scale: 8 '
                  'mask: 0 biases: 1 biases: 1 mask_group_num: 1 }', bottoms[:1])
    with pytest.raises(ShapeError, match=r"'det' \(Yolov3DetectionOutput\): bottom\[1\] \(1, 27, 6, 6\) must "
                                         r"have yolov3_detection_output_param.num_box \* \(4 \+ 1 \+ num_classes\) "
                                         r"= 3 \* 8 = 24 channels"):
        run_layer(yolov3_text(**v3), [bottoms[0], np.zeros((1, 27, 6, 6), F32)])
    with pytest.raises(ShapeError, match=r"bottom\[1\] \(2, 24, 6, 6\) must have bottom\[0\]'s num 1"):
        run_layer(yolov3_text(**v3), [bottoms[0], np.zeros((2, 24, 6, 6), F32)])
    with pytest.raises(NotImplementedError, match="no backward"):
        layer, bottom_blobs, tops = run_layer(yolov3_text(**v3), bottoms)
        layer.backward(tops, [True, False], bottom_blobs)


def test_mobilenet_yolo_detection_output_errors():
    bottom = yolo_bottom(0, 3, 2, 2)
    where = r"layer 'det' \(YoloDetectionOutput\): "
    with pytest.raises(ConfigError, match=where + r"yolo_detection_output_param.biases: needs 2 \* num_box = 4 "):
        run_layer(mn_text(2, 2, BIASES[:3]), [bottom])
    with pytest.raises(ConfigError, match=where + r"yolo_detection_output_param.coords: .*got 5"):
        run_layer(mn_text(2, 2, BIASES[:4]).replace("coords: 4", "coords: 5"), [bottom])
    with pytest.raises(ConfigError, match=where + r"yolo_detection_output_param.num_classes: must be given"):
        run_layer('name: "det" type: "YoloDetectionOutput" yolo_detection_output_param { num_box: 1 biases: 1 '
                  'biases: 1 }', [bottom])
    with pytest.raises(ShapeError, match=where + r"bottom\[0\] \(1, 14, 3, 3\) must have yolo_detection_output_"
                                         r"param.num_box \* \(4 \+ 1 \+ num_classes\) = 2 \* 8 = 16 channels"):
        run_layer(mn_text(3, 2, BIASES[:4]), [bottom])
    with pytest.raises(ShapeError, match=where + r"bottom\[0\] \(1, 14, 2, 3\): the fork reads a width x width"):
        run_layer(mn_text(2, 2, BIASES[:4]), [bottom[:, :, :2]])
    with pytest.raises(ConfigError, match=where + r"bottom: takes at most 2 bottom blob\(s\), got 3"):
        run_layer(mn_text(2, 2, BIASES[:4]), [bottom] * 3)


def conv(name, bottom, outputs, kernel=1, stride=1, kind="Convolution", group=1, relu="ReLU6"):
    pad = kernel // 2
    text = (f'layer {{ name: "{name}" type: "{kind}" bottom: "{bottom}" top: "{name}" convolution_param {{ '
            f'num_output: {outputs} kernel_size: {kernel} stride: {stride} pad: {pad} group: {group} }} }}\n')
    return text + (f'layer {{ name: "{name}/relu" type: "{relu}" bottom: "{name}" top: "{name}" }}\n' if relu else "")


# MobileNet-YOLO's lite deploy in small: depthwise-separable blocks, a head
# on the 4 x 4 map, the 4 x 4 features upsampled (nearest) and concatenated
# with the 8 x 8 ones for a second head, both into Yolov3DetectionOutput.
MOBILENET_YOLO = ('name: "mobilenet_yolo" input: "data" input_shape { dim: 1 dim: 3 dim: 32 dim: 32 }\n'
                  + conv("conv0", "data", 8, 3, 2)
                  + conv("conv1/dw", "conv0", 8, 3, 2, "DepthwiseConvolution", 8) + conv("conv1", "conv1/dw", 16)
                  + conv("conv2/dw", "conv1", 16, 3, 2, "DepthwiseConvolution", 16)
                  + conv("conv2", "conv2/dw", 32, relu="ReLU")
                  + conv("head1", "conv2", 24, relu=None)
                  + conv("conv3", "conv2", 8)
                  + 'layer { name: "up" type: "Upsample" bottom: "conv3" top: "up" upsample_param { scale: 2 } }\n'
                  'layer { name: "cat" type: "Concat" bottom: "up" bottom: "conv1" top: "cat" }\n'
                  + conv("head2", "cat", 24, relu=None)
                  + 'layer { name: "detection_out" type: "Yolov3DetectionOutput" bottom: "head1" bottom: "head2" '
                  'top: "detection_out" include { phase: TEST } yolov3_detection_output_param { num_classes: 3 '
                  'confidence_threshold: 0.3 nms_threshold: 0.45 biases: 2 biases: 3 biases: 4 biases: 6 biases: 6 '
                  'biases: 5 biases: 8 biases: 12 biases: 14 biases: 10 biases: 20 biases: 24 anchors_scale: 8 '
                  'anchors_scale: 4 mask_group_num: 2 mask: 3 mask: 4 mask: 5 mask: 0 mask: 1 mask: 2 } }\n')


def test_a_mobilenet_yolo_shaped_net():
    """The net's detections are the fork's loops on its two heads (seeded
    weights); its Upsample repeats each value 2 x 2."""
    net = cct.Net(MOBILENET_YOLO, cct.TEST)
    rng = np.random.default_rng(38)
    for blobs in net.params.values():
        for blob in blobs:
            blob.data[...] = rng.normal(0, 0.5, blob.shape)
    net.blobs["data"].data[...] = rng.uniform(-1, 1, (1, 3, 32, 32))
    det = net.forward()["detection_out"]
    heads = [net.blobs[name].data.astype(F32) for name in ("head1", "head2")]
    assert [h.shape for h in heads] == [(1, 24, 4, 4), (1, 24, 8, 8)]
    want = ref_yolov3_detection_output(heads, 3, 3, [2, 3, 4, 6, 6, 5, 8, 12, 14, 10, 20, 24], [8, 4], 2,
                                       [3, 4, 5, 0, 1, 2], 0.3, 0.45)
    assert want.shape[2] > 3
    assert_same_rows(det, want)
    np.testing.assert_array_equal(net.blobs["up"].data, net.blobs["conv3"].data.repeat(2, 2).repeat(2, 3))


def test_cct_dnn_gives_mobilenet_yolos_own_top(tmp_path):
    """OpenCV 4.14 has no Yolov3DetectionOutput: cct.dnn passes its top on as the layer wrote it."""
    import cct.dnn
    bottoms, text, reference, thresholds = v3_case(0, 1)
    path = tmp_path / "yolov3.prototxt"
    path.write_text('input: "a" input_shape { dim: 1 dim: 24 dim: 3 dim: 3 }\n'
                    'input: "b" input_shape { dim: 1 dim: 24 dim: 6 dim: 6 }\n'
                    f'layer {{ {text} bottom: "a" bottom: "b" top: "det" }}\n')
    net = cct.dnn.readNetFromCaffe(str(path))
    net.setInput(bottoms[0], "a")
    net.setInput(bottoms[1], "b")
    assert_same_rows(net.forward(), ref_yolov3_detection_output(bottoms, **reference, **thresholds))
