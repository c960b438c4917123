"""Text files cct is given (cct.formats.text): UTF-8 or a clean error naming
the file, line and column; prototxts (net and solver) read through it
(issue 15: a prototxt with bytes that are not UTF-8 raised UnicodeDecodeError)."""
import pytest

import cct
from cct.core.errors import ConfigError, DataError
from cct.formats.text import read_text_file
from cct.training.solver import get_solver


def test_utf8_text_is_read_whole(tmp_path):
    path = tmp_path / "list.txt"
    path.write_text("caf\u00e9.png 1\n", encoding="utf-8")
    assert read_text_file(path, DataError, "image list") == "caf\u00e9.png 1\n"


def test_each_failure_is_the_callers_error_naming_the_file(tmp_path):
    path = tmp_path / "latin.txt"
    path.write_bytes(b"first line\nsecond \xe9t\xe9\n")
    with pytest.raises(DataError, match=r"^image list: .*latin.txt:2:8: not UTF-8 text \(byte 0xe9\)$"):
        read_text_file(path, DataError, "image list")
    with pytest.raises(ConfigError, match=r"^list '.*gone.txt' not found$"):
        read_text_file(tmp_path / "gone.txt", ConfigError, "list")
    with pytest.raises(ConfigError, match="is a folder, expected a file"):
        read_text_file(tmp_path, ConfigError, "list")
    with pytest.raises(ConfigError, match="not found"):
        read_text_file(str(tmp_path / "a\0b"), ConfigError, "list")


NET = b'layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 } } }\n'


def test_a_net_prototxt_that_is_not_utf8_names_the_file_line_and_column(tmp_path):
    path = tmp_path / "net.prototxt"
    path.write_bytes(NET + b'layer { name: "r\xe9lu" type: "ReLU" bottom: "data" top: "data" }\n')
    with pytest.raises(ConfigError, match=r"net.prototxt:2:17: not UTF-8 text \(byte 0xe9\)"):
        cct.Net(str(path), cct.TEST)


def test_a_solver_prototxt_that_is_not_utf8_is_a_clean_error(tmp_path):
    path = tmp_path / "solver.prototxt"
    path.write_bytes(b'base_lr: 0.1\nlr_policy: "fix\xffed"\n')
    with pytest.raises(ConfigError, match=r"solver.prototxt:2:16: not UTF-8 text \(byte 0xff\)"):
        get_solver(str(path))


def test_a_binary_net_with_a_name_that_is_not_utf8_is_a_clean_error(tmp_path):
    """Found by the fuzzer: protobuf hands such a string back as bytes, and the
    net's sorted blob names mixed bytes and str (TypeError)."""
    from cct.proto import caffe_pb2
    layer = caffe_pb2.LayerParameter(name="data", type="Input", top=["x"]).SerializeToString()
    layer = layer.replace(b'"\x01x', b'"\x02\xe9x')                  # top (field 4): 2 bytes, not UTF-8
    path = tmp_path / "net.caffemodel"
    path.write_bytes(b"\xa2\x06" + bytes([len(layer)]) + layer)       # NetParameter.layer (field 100)
    with pytest.raises(ConfigError, match=r"net.caffemodel: layer\[0\].top\[0\]: not UTF-8 text: b'\\xe9x'"):
        cct.Net(str(path), cct.TEST)
