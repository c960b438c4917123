"""The ImageData and Data layers (layers/data.py, with cct.data.images and the
DataTransformer) against BVLC Caffe, bit for bit, on tests/data/caffe_images:
each net of its manifest built in TEST, one forward, its `data` top (and
`label`) equal to Caffe's. The Data nets read the databases and means that cct's
convert_imageset and compute_image_mean made, so they check the whole chain."""
import pytest

import cct
from helpers.caffe_images import MANIFEST, assert_bits_equal, build_workspace, inside

NETS = {net["key"]: net for net in MANIFEST["nets"]}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return build_workspace(tmp_path_factory.mktemp("caffe_images"))


@pytest.mark.parametrize("key", sorted(NETS))
def test_data_top_equals_caffes(workspace, key):
    spec = NETS[key]
    with inside(workspace):
        net = cct.Net(spec["prototxt"], cct.TEST)
        try:
            net.forward()
            assert_bits_equal(net.blobs["data"].data, key)
            if spec["label_key"]:
                assert_bits_equal(net.blobs["label"].data, spec["label_key"])
        finally:
            for layer in net.layers:
                if hasattr(layer, "close"):          # the prefetch threads and the database
                    layer.close()
