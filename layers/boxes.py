"""Box arithmetic the detection layers share (SSD's layers/ssd.py and the
YOLO ports' layers/yolo.py): boxes (.., 4) as (xmin, ymin, xmax, ymax) in
float32, each step in the forks' order (util/bbox_util.cpp's BBoxSize and
JaccardOverlap); darknet's centre-box overlap, which MobileNet-YOLO uses."""
import numpy as np

from cct.devices.jit import kernel

_F32 = np.float32


def box_sizes(boxes):
    """Area of each (.., 4) float32 box; 0 where xmax < xmin or ymax < ymin (BBoxSize)."""
    width = boxes[..., 2] - boxes[..., 0]
    height = boxes[..., 3] - boxes[..., 1]
    valid = (width >= 0) & (height >= 0)
    return np.where(valid, width * height, _F32(0))


def overlaps(boxes, sizes):
    """(K, K) float32 Jaccard overlaps of boxes (K, 4) with areas `sizes`
    (JaccardOverlap), every pair (SSD's compiled NMS computes one pair at a
    time, as it needs them: ssd._nms_every_class)."""
    a, b = boxes[:, None, :], boxes[None, :, :]
    apart = (b[..., 0] > a[..., 2]) | (b[..., 2] < a[..., 0]) | (b[..., 1] > a[..., 3]) | (b[..., 3] < a[..., 1])
    width = np.minimum(a[..., 2], b[..., 2]) - np.maximum(a[..., 0], b[..., 0])
    height = np.minimum(a[..., 3], b[..., 3]) - np.maximum(a[..., 1], b[..., 1])
    meet = ~apart & (width > 0) & (height > 0)
    inter = width * height
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = inter / (sizes[:, None] + sizes[None, :] - inter)
    return np.where(meet, ratio, _F32(0))


@kernel
def centre_iou(ax, ay, aw, ah, bx, by, bw, bh):
    """darknet's box_iou of two (x, y, w, h) centre boxes, float32 scalars, as
    MobileNet-YOLO's detection outputs compute it: no clipping, the
    intersection 0 where either side is negative, NaN where both areas are 0."""
    width = _centre_overlap(ax, aw, bx, bw)
    height = _centre_overlap(ay, ah, by, bh)
    inter = np.float32(0) if width < 0 or height < 0 else width * height
    return inter / (aw * ah + bw * bh - inter)


@kernel
def _centre_overlap(a, a_size, b, b_size):
    """darknet's overlap() on one axis, its comparisons as written (NaN picks the second)."""
    two = np.float32(2)
    low_a, low_b = a - a_size / two, b - b_size / two
    high_a, high_b = a + a_size / two, b + b_size / two
    return (high_a if high_a < high_b else high_b) - (low_a if low_a > low_b else low_b)
