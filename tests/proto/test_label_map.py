"""SSD's LabelMap through the names SSD's scripts use: `caffe_pb2.LabelMap`
from `cct.proto` and from `caffe.proto` (cct's alias), and text_format
parsing a label map written as SSD's data/VOC0712/labelmap_voc.prototxt is."""
from google.protobuf import text_format

import cct

# The head of SSD's labelmap_voc.prototxt, in its layout
LABELMAP_VOC = """item {
  name: "none_of_the_above"
  label: 0
  display_name: "background"
}
item {
  name: "aeroplane"
  label: 1
  display_name: "aeroplane"
}
item {
  name: "bicycle"
  label: 2
  display_name: "bicycle"
}
"""


def test_label_map_parses_through_both_names():
    from caffe.proto import caffe_pb2
    assert caffe_pb2.LabelMap is cct.proto.caffe_pb2.LabelMap
    labelmap = caffe_pb2.LabelMap()
    text_format.Merge(LABELMAP_VOC, labelmap)          # as ssd_detect.py reads it
    assert [(item.name, item.label, item.display_name) for item in labelmap.item] == [
        ("none_of_the_above", 0, "background"), ("aeroplane", 1, "aeroplane"), ("bicycle", 2, "bicycle")]
